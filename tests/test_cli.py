"""`jaxembed embed`: files or stdin in, .npy or .jsonl out, with throughput on stderr."""

import io
import json

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

    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(texts) + "\n"))
    assert main(["embed", "--model", str(path), "--query", "--instruction", "Find it", "--quiet"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["text"] for r in rows] == texts
    queries = jaxembed.load(path).encode_query(texts, instruction="Find it")
    np.testing.assert_allclose(np.array([r["embedding"] for r in rows]), queries, atol=1e-6)


def test_embed_errors(hf_model_dir, tmp_path, capsys):
    path, _ = hf_model_dir
    src = tmp_path / "t.txt"
    src.write_text("x\n")
    assert main(["embed", str(src), "--model", str(path), "--vertical-chunk-size", "12", "--quiet"]) == 2
    assert "not a multiple of the chunk size" in capsys.readouterr().err


def test_embed_checks_the_output_path_first(hf_model_dir, tmp_path, capsys):
    """Before any work: a wrong suffix, a missing directory, a directory, an existing file without
    --overwrite; each one line on stderr, exit 2, nothing written."""
    path, _ = hf_model_dir
    src = tmp_path / "t.txt"
    src.write_text("x\n")
    (tmp_path / "adir.npy").mkdir()
    (tmp_path / "old.npy").write_bytes(b"old")
    cases = {tmp_path / "out.txt": "must end in", tmp_path / "missing_dir" / "out.npy": "does not exist",
             tmp_path / "adir.npy": "is a directory", tmp_path / "old.npy": "exists; pass --overwrite"}
    for bad, why in cases.items():
        assert main(["embed", str(src), "--model", str(path), "-o", str(bad), "--quiet"]) == 2
        err = capsys.readouterr().err
        assert why in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert (tmp_path / "old.npy").read_bytes() == b"old"
    assert main(["embed", str(src), "--model", str(path), "-o", str(tmp_path / "old.npy"), "--overwrite",
                 "--quiet"]) == 0
    assert np.load(tmp_path / "old.npy").shape[0] == 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".old.npy.tmp-")]  # no temporary left
