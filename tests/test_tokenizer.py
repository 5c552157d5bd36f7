"""`jaxembed tokenizer`: a byte-level BPE learnt from a training file's queries and positives, written
atomically as a directory the trainer and `jaxembed.load` read."""

from __future__ import annotations

import json

import pytest

from jaxembed.checkpoint import _umask
from jaxembed.cli import main
from jaxembed.embedder import load_tokenizer

WORD_IN_POSITIVES = "frobnicatewidget"
WORD_IN_NEGATIVES = "zzyzxquuxblorp"


def _write_triples(path, n=40):
    rows = [{"query": f"Frobnicate the widget number {i}.",
             "positive": f"def {WORD_IN_POSITIVES}(self, n={i}):\n    return self.{WORD_IN_POSITIVES}(n - 1)",
             "negatives": [f"def {WORD_IN_NEGATIVES}():\n    {WORD_IN_NEGATIVES}({i})"]} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_cli_learns_the_training_texts_and_writes_a_loadable_tokenizer(tmp_path, capsys):
    train = tmp_path / "train.jsonl"
    _write_triples(train)
    out = tmp_path / "bpe"
    assert main(["tokenizer", str(train), str(out), "--vocab-size", "300"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary == {"texts": 80, "vocab_size": 300, "out_dir": str(out)}  # 40 queries + 40 positives

    tok = load_tokenizer(str(out))
    assert (tok.eos_token_id, tok.pad_token_id, len(tok)) == (0, 1, 300)
    # the positives' identifier, seen 80 times, became one token; the negatives' one was never read
    assert tok.tokenize(WORD_IN_POSITIVES) == [WORD_IN_POSITIVES]
    assert len(tok.tokenize(WORD_IN_NEGATIVES)) > 3
    text = "def café(x):\n\treturn x  # ünïcode"
    assert tok.decode(tok(text)["input_ids"]) == text  # byte-level: every text round-trips
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind


def test_cli_refuses_an_existing_directory_a_small_vocabulary_and_a_missing_file(tmp_path, capsys):
    train = tmp_path / "train.jsonl"
    _write_triples(train, n=4)
    out = tmp_path / "bpe"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    for extra in ([], ["--overwrite"]):  # --overwrite used to delete keep.txt with the directory
        assert main(["tokenizer", str(train), str(out), "--vocab-size", "300", *extra]) == 2
        assert "bpe: holds files a tokenizer does not write (keep.txt); refusing to replace it" in \
            capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"
    for extra in ([], ["--overwrite"]):  # the training file itself, named as OUT_DIR: it was moved aside
        assert main(["tokenizer", str(train), str(train), "--vocab-size", "300", *extra]) == 2
        assert "train.jsonl: exists and is not a directory" in capsys.readouterr().err
    assert train.is_file()
    assert main(["tokenizer", str(train), str(tmp_path / "b2"), "--vocab-size", "100"]) == 2
    assert "--vocab-size must be >= 258" in capsys.readouterr().err
    assert main(["tokenizer", str(train), str(tmp_path / "no" / "b2"), "--vocab-size", "300"]) == 2
    assert "directory" in capsys.readouterr().err
    assert main(["tokenizer", str(tmp_path / "nope.jsonl"), str(tmp_path / "b3"), "--vocab-size", "300"]) == 2
    assert "nope.jsonl: no such file" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"  # was a bytes-only tokenizer and exit 0
    empty.write_text(json.dumps({"query": "", "positive": "", "negatives": []}) + "\n")
    assert main(["tokenizer", str(empty), str(tmp_path / "b4"), "--vocab-size", "300"]) == 2
    assert "empty.jsonl: no text to learn merges from" in capsys.readouterr().err

    (out / "keep.txt").unlink()
    assert main(["tokenizer", str(train), str(out), "--vocab-size", "300"]) == 0  # an empty directory
    assert main(["tokenizer", str(train), str(out), "--vocab-size", "300"]) == 2
    assert "bpe: a tokenizer is already there; pass --overwrite" in capsys.readouterr().err
    assert main(["tokenizer", str(train), str(out), "--vocab-size", "300", "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    assert len(load_tokenizer(str(out))) == 300
    assert out.stat().st_mode & 0o055 == 0o055 & ~_umask()  # readable by others as umask allows (was 0700)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bpe", "empty.jsonl", "train.jsonl"]
    (tmp_path / "link").symlink_to(out)  # the target is replaced (the link became a directory, exit 2)
    assert main(["tokenizer", str(train), str(tmp_path / "link"), "--vocab-size", "290", "--overwrite"]) == 0
    assert (tmp_path / "link").is_symlink() and len(load_tokenizer(str(out))) == 290
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bpe", "empty.jsonl", "link", "train.jsonl"]
    capsys.readouterr()
    assert main(["tokenizer", str(train), str(tmp_path / "b5"), "--vocab-size", "100000"]) == 0
    assert "the texts ran out of merges at" in capsys.readouterr().err


@pytest.mark.parametrize("line, message", [('{"query": 3, "positive": "x", "negatives": []}', "query"),
                                           ('{"query": "q"', "train.jsonl")])
def test_cli_names_the_bad_record(tmp_path, capsys, line, message):
    train = tmp_path / "train.jsonl"
    train.write_text('{"query": "a b c", "positive": "d e f", "negatives": []}\n' + line + "\n")
    assert main(["tokenizer", str(train), str(tmp_path / "bpe"), "--vocab-size", "300"]) == 2
    err = capsys.readouterr().err
    assert message in err and "line 2" in err
    assert not (tmp_path / "bpe").exists()


def test_mistral_common_tokenizers_are_not_given_split_special_tokens():
    """mistral-common's transformers backend refuses `split_special_tokens` (it never reads special tokens
    out of text, so there is nothing to split): `text_ids` calls it without; every other tokenizer with."""
    from jaxembed.text import text_ids

    class MistralCommonBackend:  # the class name is what `text_ids` goes by
        def __call__(self, text, **kwargs):
            if "split_special_tokens" in kwargs:
                raise ValueError("`MistralCommonBackend` does not support `split_special_tokens`.")
            return {"input_ids": [7, 8]}

    class OtherTokenizer(MistralCommonBackend):
        def __call__(self, text, **kwargs):
            return {"input_ids": [int(kwargs["split_special_tokens"])]}

    assert text_ids(MistralCommonBackend(), "a </s>", add_special_tokens=True) == {"input_ids": [7, 8]}
    assert text_ids(OtherTokenizer(), "a </s>", add_special_tokens=True) == {"input_ids": [1]}
