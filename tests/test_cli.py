"""`jaxembed embed`: files or stdin in, .npy or .jsonl out, with throughput on stderr."""

import io
import json
import os
import threading

import numpy as np

import jaxembed
from jaxembed.cli import main


def test_embed_file_to_npy_and_stdin_to_jsonl(hf_model_dir, tmp_path, capsys, monkeypatch):
    path, _ = hf_model_dir
    texts = ["first line", "", "a third, longer line of text to embed"]
    src = tmp_path / "texts.txt"
    src.write_text("\n".join(texts) + "\n")
    assert main(["embed", str(src), "--model", str(path), "-o", str(tmp_path / "out.npy"), "--quiet"]) == 0
    assert "tokens/s" in capsys.readouterr().err
    expected = jaxembed.load(path).encode(texts)
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), expected, rtol=1e-5, atol=1e-6)
    assert main(["embed", str(src), "--model", str(path), "-o", str(tmp_path / "out.jsonl"), "--quiet"]) == 0
    written = [json.loads(line)["embedding"] for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    # the .npy's float32 values exactly (they were rounded to 7 decimals: up to 4e-4 off for small components)
    np.testing.assert_array_equal(np.array(written, np.float64).astype(np.float32), np.load(tmp_path / "out.npy"))
    assert np.array_equal(np.array(written, np.float64), np.load(tmp_path / "out.npy").astype(np.float64))

    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(texts) + "\n"))
    assert main(["embed", "--model", str(path), "--query", "--instruction", "Find it", "--quiet"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["text"] for r in rows] == texts
    queries = jaxembed.load(path).encode_query(texts, instruction="Find it")
    np.testing.assert_allclose(np.array([r["embedding"] for r in rows]), queries, atol=1e-6)
    # jaxembed's warnings are one line of the command's, not Python's file:line and source line
    assert main(["embed", str(src), "--model", str(path), "-o", str(tmp_path / "cut.npy"), "--max-length", "3",
                 "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "jaxembed embed: warning: max_length=3: truncated 2 of 3 texts" in err and ".py:" not in err


def test_embed_errors(hf_model_dir, tmp_path, capsys):
    path, _ = hf_model_dir
    src = tmp_path / "t.txt"
    src.write_text("x\n")
    assert main(["embed", str(src), "--model", str(path), "--vertical-chunk-size", "12", "--quiet"]) == 2
    assert "not a multiple of the chunk size" in capsys.readouterr().err


def test_usage_errors_are_one_line(capsys):
    """argparse printed its whole usage block (19 lines for embed) before the error."""
    import pytest

    for argv, why in ((["embed", "x.txt"], "jaxembed embed: error: the following arguments are required: --model"),
                      (["serve", "--model", "m", "--port", "abc"], "argument --port: invalid int value: 'abc'"),
                      ([], "the following arguments are required: command"),
                      (["embed", "--model", "m", "--bogus"],
                       "jaxembed embed: error: unrecognized arguments: --bogus (`jaxembed embed --help`")):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and why in err and err.count("\n") == 1 and "usage:" not in err, err


def test_embed_checks_the_output_path_first(hf_model_dir, tmp_path, capsys, monkeypatch):
    """Before any work: a wrong suffix, a missing directory, a directory, an existing file without
    --overwrite; each one line on stderr, exit 2, nothing written."""
    path, _ = hf_model_dir
    src = tmp_path / "t.txt"
    src.write_text("x\n")
    (tmp_path / "adir.npy").mkdir()
    (tmp_path / "old.npy").write_bytes(b"old")
    (tmp_path / "dangling.npy").symlink_to(tmp_path / "gone" / "x.npy")  # written through: its directory counts
    cases = {tmp_path / "out.txt": "must end in", tmp_path / "missing_dir" / "out.npy": "does not exist",
             tmp_path / "adir.npy": "is a directory", tmp_path / "old.npy": "exists; pass --overwrite",
             tmp_path / "dangling.npy": f"(a link to {tmp_path / 'gone' / 'x.npy'}): directory {tmp_path / 'gone'} "
                                        "does not exist"}
    for bad, why in cases.items():
        assert main(["embed", str(src), "--model", str(path), "-o", str(bad), "--quiet"]) == 2
        err = capsys.readouterr().err
        assert why in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert (tmp_path / "old.npy").read_bytes() == b"old"
    assert main(["embed", str(src), "--model", str(path), "-o", str(tmp_path / "old.npy"), "--overwrite",
                 "--quiet"]) == 0
    assert np.load(tmp_path / "old.npy").shape[0] == 1
    # inputs that are not regular files are read (a named pipe, as `<(...)` and /dev/stdin are); a directory is
    # named as one (both were "no such file")
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text("x\n"), daemon=True)
    writer.start()
    assert main(["embed", str(fifo), "--model", str(path), "-o", str(tmp_path / "piped.npy"), "--quiet"]) == 0
    writer.join()
    np.testing.assert_array_equal(np.load(tmp_path / "piped.npy"), np.load(tmp_path / "old.npy"))
    capsys.readouterr()
    assert main(["embed", str(tmp_path / "adir.npy"), "--model", str(path), "--quiet"]) == 2
    assert "adir.npy is a directory; name a text file in it" in capsys.readouterr().err
    monkeypatch.setattr("sys.stdin", None)  # `<&-`: "'NoneType' object is not iterable"
    assert main(["embed", "--model", str(path), "--quiet"]) == 2
    assert "jaxembed embed: error: stdin is closed; name the input files" in capsys.readouterr().err
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".old.npy.tmp-")]  # no temporary left


def test_embed_stream_and_sections_of_a_file(hf_model_dir, tmp_path, capsys):
    """--stream: the whole file's embedding (= encode of its text); --sections with a separator line or a
    token size: each section in the context of those before it (= encode_ids of the prefix + EOS)."""
    path, _ = hf_model_dir
    parts = ["def first(x):\n    return x + 1", "class Second:\n    pass\n\nmore = 2", "# the end  "]
    src = tmp_path / "doc.txt"
    src.write_text("\n---\n".join(parts) + "\n", encoding="utf-8")
    model = jaxembed.load(path)
    assert main(["embed", "--model", str(path), "--stream", str(src), "-o", str(tmp_path / "s.npy"), "--quiet",
                 "--vertical-chunk-size", "8"]) == 0
    np.testing.assert_allclose(np.load(tmp_path / "s.npy")[0], model.encode(src.read_text()), atol=2e-6)

    assert main(["embed", "--model", str(path), "--sections", str(src), "--separator=---", "--quiet"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["section"] for r in rows] == [0, 1, 2]
    ended = tmp_path / "ended.txt"  # a separator on the last line ends section 2; it starts no empty one
    ended.write_text(src.read_text() + "---\n", encoding="utf-8")
    assert main(["embed", "--model", str(path), "--sections", str(ended), "--separator=---", "--quiet"]) == 0
    assert [json.loads(line)["embedding"] for line in capsys.readouterr().out.splitlines()] == \
           [r["embedding"] for r in rows]
    ids = [model.tokenizer(p, add_special_tokens=False)["input_ids"] for p in parts]
    expected = model.encode_ids([sum(ids[: i + 1], []) + [model.eos_token_id] for i in range(3)],
                                vertical_chunk_size=None)
    np.testing.assert_allclose(np.array([r["embedding"] for r in rows]), expected, atol=2e-6)
    # a section's own blank lines are its text: only the newline before the separator goes (all of them went)
    blank = tmp_path / "blank.txt"
    blank.write_text("one\n\n\n---\r\ntwo\r\n\r\n", encoding="utf-8", newline="")
    assert main(["embed", "--model", str(path), "--sections", str(blank), "--separator=---", "--quiet"]) == 0
    got = np.array([json.loads(line)["embedding"] for line in capsys.readouterr().out.splitlines()])
    np.testing.assert_allclose(got, model.encode_sections(["one\n\n", "two\r\n"]), atol=2e-6)

    assert main(["embed", "--model", str(path), "--sections", str(src), "--section-tokens", "5", "--quiet"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    all_ids = model.tokenizer(src.read_text(), add_special_tokens=False)["input_ids"]
    assert len(rows) == -(-len(all_ids) // 5) and rows[-1]["tokens"] == [5 * (len(rows) - 1), len(all_ids)]
    last = model.encode_ids([all_ids + [model.eos_token_id]], vertical_chunk_size=None)[0]
    np.testing.assert_allclose(rows[-1]["embedding"], last, atol=2e-6)
    crlf = tmp_path / "crlf.txt"  # the file's own line endings, as --stream reads them (they were made \n)
    crlf.write_bytes(src.read_bytes().replace(b"\n", b"\r\n"))
    assert main(["embed", "--model", str(path), "--sections", str(crlf), "--section-tokens", "5", "--quiet"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    raw_ids = model.tokenizer(crlf.read_bytes().decode(), add_special_tokens=False)["input_ids"]
    assert len(raw_ids) > len(all_ids) and rows[-1]["tokens"][1] == len(raw_ids)
    np.testing.assert_allclose(rows[-1]["embedding"], model.encode_ids([raw_ids + [model.eos_token_id]],
                                                                       vertical_chunk_size=None)[0], atol=2e-6)

    assert main(["embed", "--model", str(path), "--sections", str(src), "--quiet"]) == 2
    assert "--sections needs --separator LINE or --section-tokens N" in capsys.readouterr().err

    # token sections of a query: the prompt's ids come before section 0, as encode_sections puts them
    assert main(["embed", "--model", str(path), "--sections", str(src), "--section-tokens", "5", "--query",
                 "--instruction", "Find it", "--quiet"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    prompt = model.tokenizer(model.query_prompt("Find it"), add_special_tokens=False)["input_ids"]
    last = model.encode_ids([prompt + all_ids + [model.eos_token_id]], vertical_chunk_size=None)[0]
    np.testing.assert_allclose(rows[-1]["embedding"], last, atol=2e-6)


def test_options_that_do_not_apply_are_refused_and_a_byte_order_mark_is_not_text(hf_model_dir, tmp_path, capsys):
    """--instruction without --query, and --max-length / --max-tokens-per-batch on a whole-file stream or its
    sections, would be ignored: each is a one-line error. A UTF-8 byte-order mark starting a file is not
    part of its first text, in a list of lines, a stream and a corpus alike."""
    path, _ = hf_model_dir
    src = tmp_path / "t.txt"
    src.write_text("hello world\nsecond\n")
    cases = [(["embed", str(src), "--instruction", "Find it"], "--instruction is the query instruction: add --query"),
             (["embed", "--corpus", str(src), "--output-dir", str(tmp_path / "c"), "--instruction", "x"],
              "add --query"),
             (["embed", "--stream", str(src), "--max-length", "8"], "--max-length cuts each text of a list"),
             (["embed", "--sections", str(src), "--separator=---", "--max-length", "8"], "--max-length cuts"),
             (["embed", "--stream", str(src), "--max-tokens-per-batch", "64"], "--max-tokens-per-batch sizes")]
    for argv, why in cases:
        assert main([*argv, "--model", str(path), "--quiet"]) == 2, argv
        err = capsys.readouterr().err
        assert why in err and err.count("\n") == 1, (argv, err)
    bom = tmp_path / "bom.txt"
    bom.write_bytes(b"\xef\xbb\xbf" + src.read_bytes())
    model = jaxembed.load(path)
    expected = model.encode(["hello world", "second"])
    assert main(["embed", str(bom), "--model", str(path), "-o", str(tmp_path / "b.npy"), "--quiet"]) == 0
    np.testing.assert_allclose(np.load(tmp_path / "b.npy"), expected, atol=1e-6)
    assert main(["embed", "--model", str(path), "--stream", str(bom), "-o", str(tmp_path / "s.npy"), "--quiet"]) == 0
    np.testing.assert_allclose(np.load(tmp_path / "s.npy")[0], model.encode("hello world\nsecond\n"), atol=2e-6)
    assert main(["embed", "--corpus", str(bom), "--output-dir", str(tmp_path / "c"), "--model", str(path),
                 "--quiet"]) == 0
    from jaxembed.embed_corpus import load_corpus_embeddings

    np.testing.assert_allclose(load_corpus_embeddings(tmp_path / "c")[0], expected, atol=1e-6)


def test_templates_and_instructions_read_backslash_escapes():
    """`--query-template "Instruct: {prompt}\nQuery: "` in a shell passes a backslash and an n: stored as such,
    every query embedding changed silently. \\n, \\t and \\\\ are read as the characters they stand for."""
    from jaxembed.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["convert", "a", "b", "--query-template", r"Instruct: {prompt}\nQuery: ",
                              "--default-instruction", r"Find\tit"])
    assert (args.query_template, args.default_instruction) == ("Instruct: {prompt}\nQuery: ", "Find\tit")
    args = parser.parse_args(["embed", "--model", "m", "--query", "--instruction", r"a\\n b\q"])
    assert args.instruction == "a\\n b\\q"  # an escaped backslash stays one; an unknown escape is left alone


def test_a_missing_extra_is_named_and_a_closed_pipe_is_quiet():
    """`jaxembed eval` without mteb said only "ModuleNotFoundError: No module named 'mteb'"; `jaxembed ... | head`
    ended in "error: BrokenPipeError" (exit 2)."""
    import os
    import subprocess
    import sys

    from jaxembed.cli import one_line

    assert one_line(ModuleNotFoundError("No module named 'mteb'", name="mteb")) == \
        "No module named 'mteb': pip install 'jaxembed[eval]'"
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written
    try:
        done = subprocess.run([sys.executable, "-m", "jaxembed.cli", "bench", "--list"], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (141, "")
