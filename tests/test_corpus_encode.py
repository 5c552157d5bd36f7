"""`jaxembed embed --corpus FILE --output-dir DIR` (jaxembed/embed_corpus.py): sharded output that equals
`Embedder.encode`, a run killed with SIGKILL and restarted giving the same bytes as an uninterrupted one, two
processes under jax.distributed on 8 CPU devices each covering every record once with the one-device numbers,
and refusals of bad input and of a directory that belongs to another run.

The subprocesses start first (module fixture) and run while the in-process checks do; every batch has one shape
(8 texts of 9..16 tokens, Q = 8), so each process compiles one program."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import suite_xla_flags

import jaxembed
from jaxembed import cli
from jaxembed.convert import convert
from jaxembed.embed_corpus import KILL_AFTER_SHARDS_ENV, embed_corpus, load_corpus_embeddings, open_corpus
from jaxembed.errors import DataError

ROOT = Path(__file__).resolve().parents[1]
ROWS, SHARD, BATCH = 64, 16, 8
WORDS = ("list sort dictionary key value string format file path open read write line number integer float "
         "iterate loop function return class method module import error raise exception test").split()


def corpus_texts(tokenizer) -> list[str]:
    """ROWS texts of 9..16 tokens with EOS (one length bucket at Q = 8), some with non-ASCII characters."""
    rng = np.random.default_rng(0)
    texts = []
    for _ in range(50 * ROWS):
        words = list(rng.choice(WORDS, size=int(rng.integers(2, 5))))
        if len(texts) % 5 == 0:
            words.append("café")
        text = " ".join(words)
        if 9 <= len(tokenizer(text)["input_ids"]) + 1 <= 16:
            texts.append(text)
        if len(texts) == ROWS:
            return texts
    raise AssertionError("too few texts of 9..16 tokens")


def args(model_dir, corpus, out, *extra, id_field: str | None = "id") -> list[str]:
    return ["embed", "--model", str(model_dir), "--corpus", str(corpus), "--output-dir", str(out),
            *(("--id-field", id_field) if id_field else ()), "--shard-size", str(SHARD), "--batch-size", str(BATCH),
            "--quiet", *extra]


def env(devices: int | None = None, **extra) -> dict:
    out = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(ROOT), **extra}
    out["XLA_FLAGS"] = suite_xla_flags(devices)
    return out


def finish(proc) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope="module")
def work(tmp_path_factory, hf_model_dir, tokenizer):
    path = tmp_path_factory.mktemp("corpus_encode")
    model_dir, _ = hf_model_dir
    texts = corpus_texts(tokenizer)
    corpus = path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"doc-{i}", "text": t}) + "\n" for i, t in enumerate(texts)),
                      encoding="utf-8")
    cmd = [sys.executable, "-m", "jaxembed.cli"]
    procs = {"killed": subprocess.Popen(cmd + args(model_dir, corpus, path / "resumed"), cwd=path,
                                        env=env(**{KILL_AFTER_SHARDS_ENV: "2"}), stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)}
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    for i in range(2):
        procs[f"process{i}"] = subprocess.Popen(
            cmd + args(model_dir, corpus, path / "distributed", "--coordinator", f"localhost:{port}",
                       "--num-processes", "2", "--process-id", str(i)),
            cwd=path, env=env(devices=8), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    converted = convert(model_dir, path / "converted", progress=False)  # orbax params, read by every process
    for i in range(2):  # process 1 given another option
        procs[f"mismatched{i}"] = subprocess.Popen(
            cmd + args(converted, corpus, path / "mismatched", "--coordinator", f"localhost:{port}",
                       "--num-processes", "2", "--process-id", str(i), *(["--no-normalize"] if i else [])),
            cwd=path, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    model = jaxembed.load(model_dir)
    stats = embed_corpus(model, corpus, path / "reference", id_field="id", shard_size=SHARD, batch_size=BATCH,
                         show_progress_bar=False)
    try:
        yield {"path": path, "model_dir": model_dir, "model": model, "texts": texts, "corpus": corpus,
               "procs": procs, "stats": stats}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def test_shards_equal_encode_and_read_every_format(work):
    """The shards, in corpus order, are `Embedder.encode` of the texts; .txt and .parquet give the same bytes,
    and a smaller shard size (one batch per shard, other batch members) the same numbers."""
    path, model, texts = work["path"], work["model"], work["texts"]
    emb, ids = load_corpus_embeddings(path / "reference")
    ref = model.encode(texts, batch_size=BATCH)
    assert emb.shape == ref.shape == (ROWS, model.embedding_dim) and emb.dtype == np.float32
    assert np.abs(emb - ref).max() < 1e-5
    assert ids == [f"doc-{i}" for i in range(ROWS)]
    manifest = json.loads((path / "reference/manifest.json").read_text())
    assert [s["rows"] for s in manifest["shards"]] == [[i * SHARD, (i + 1) * SHARD] for i in range(ROWS // SHARD)]
    assert manifest["identity"]["model"]["fingerprint"] == model.fingerprint
    assert manifest["identity"]["corpus"]["rows"] == ROWS and work["stats"]["batches"] == ROWS // BATCH

    (path / "corpus.txt").write_text("".join(t + "\n" for t in texts), encoding="utf-8")
    # the id column first: columns were taken by position, so the ids were embedded and the texts kept as ids
    pq.write_table(pa.table({"key": list(range(ROWS)), "body": texts}), path / "corpus.parquet", row_group_size=10)
    embed_corpus(model, path / "corpus.txt", path / "txt", shard_size=SHARD, batch_size=BATCH,
                 show_progress_bar=False)
    embed_corpus(model, path / "corpus.parquet", path / "parquet", text_field="body", id_field="key",
                 shard_size=SHARD, batch_size=BATCH, show_progress_bar=False)
    for name, want_ids in (("txt", None), ("parquet", list(range(ROWS)))):
        got, got_ids = load_corpus_embeddings(path / name)
        assert got.tobytes() == emb.tobytes() and got_ids == want_ids, name

    # --overwrite replaces another run's output: shard size 8 leaves no file of the 16-row shards
    shutil.copytree(path / "reference", path / "resharded")
    embed_corpus(model, work["corpus"], path / "resharded", id_field="id", shard_size=8, batch_size=BATCH,
                 overwrite=True, show_progress_bar=False)
    got, got_ids = load_corpus_embeddings(path / "resharded")
    assert np.abs(got - emb).max() < 1e-6 and got_ids == ids
    assert len(list((path / "resharded").glob("shard-*.npy"))) == ROWS // 8


def test_bad_input_and_another_runs_directory_are_refused(work, capsys):
    path, model_dir = work["path"], work["model_dir"]
    bad = path / "bad"
    bad.mkdir()
    lines = {"missing_field.jsonl": '{"id": 1, "text": "a"}\n{"id": 2, "body": "b"}\n',
             "number.jsonl": '{"id": 1, "text": "a"}\n\n{"id": 2, "text": "b"}\n{"id": 3, "text": 5}\n',
             "mixed_ids.jsonl": '{"id": 1, "text": "a"}\n{"id": "x", "text": "b"}\n',
             "broken.jsonl": '{"id": 1, "text": "a"}\n{"id": 2, "text": "b\n',
             "huge_id.jsonl": '{"id": 1, "text": "a"}\n{"id": 18446744073709551616, "text": "b"}\n',
             "surrogate.jsonl": '{"id": 1, "text": "a"}\n{"id": 2, "text": "b\\ud800"}\n'}
    for name, text in lines.items():
        (bad / name).write_text(text)
    (bad / "latin1.txt").write_bytes(b"ok\ncaf\xe9\n")
    pq.write_table(pa.table({"text": ["a", None, "c"]}), bad / "null.parquet")
    pq.write_table(pa.table({"text": [1, 2]}), bad / "ints.parquet")
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), bad / "empty.parquet")
    pq.write_table(pa.table({"text": ["a", "b"], "id": pa.array([1, 2**64 - 1], pa.uint64())}),
                   bad / "huge_id.parquet")
    expect = {
        "missing.jsonl": "missing.jsonl: no such file",
        "missing_field.jsonl": "missing_field.jsonl, line 2 (row 1): no field 'text' (fields: 'id', 'body')",
        "number.jsonl": "number.jsonl, line 4 (row 2): field 'text' is number (5), not a string",
        "mixed_ids.jsonl": "mixed_ids.jsonl, line 2 (row 1): id 'x' is a string, but the first record's id is an "
                           "integer",
        "broken.jsonl": "broken.jsonl, line 2 (row 1): not valid JSON",
        "huge_id.jsonl": "huge_id.jsonl, line 2 (row 1): id 18446744073709551616 does not fit int64",
        "surrogate.jsonl": "surrogate.jsonl, line 2 (row 1): field 'text' holds a lone surrogate (U+D800",
        "latin1.txt": "latin1.txt, line 2: not valid UTF-8 (byte 0xe9 at column 4)",
        "null.parquet": "null.parquet, row 1: field 'text' is null",
        "ints.parquet": "ints.parquet, row 0: field 'text' is int64 (1), not a string",
        "empty.parquet": "empty.parquet: no records to embed",  # was Arrow's "BatchSize must be greater than 0"
        "huge_id.parquet": "huge_id.parquet, row 1: id 18446744073709551615 does not fit int64",  # was accepted
        "corpus.csv": "unsupported corpus file type '.csv'",
    }
    for name, message in expect.items():
        with_ids = "jsonl" in name or name == "huge_id.parquet"
        assert cli.main(args(model_dir, bad / name, bad / "out", id_field="id" if with_ids else None)) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, (name, err)
    assert not (bad / "out").exists()  # refused before anything was written
    with pytest.raises(DataError, match="a .txt corpus has no fields"):
        open_corpus(bad / "latin1.txt", id_field="id")
    (bad / "dup.jsonl").write_text("".join(json.dumps({"id": i % 3, "text": "t"}) + "\n" for i in range(7)))
    pq.write_table(pa.table({"text": ["a", "b", "c"], "id": ["x", "y", "x"]}), bad / "dup.parquet")
    for name, message in (("dup.jsonl", "4 row(s) repeat an earlier id (first: 0 again at row 3)"),
                          ("dup.parquet", "1 row(s) repeat an earlier id (first: 'x' again at row 2)")):
        with pytest.warns(UserWarning, match=re.escape(message)):
            assert open_corpus(bad / name, id_field="id").rows in (7, 3)

    # another run's directory: other options, another corpus, or files that are not ours
    ref = path / "reference"
    before = {p.name: p.read_bytes() for p in ref.iterdir()}
    assert cli.main(args(model_dir, work["corpus"], ref, "--no-normalize")) == 2
    err = capsys.readouterr().err
    assert "holds the embeddings of another run (manifest.json): options.normalize (there: true, now: false)" in err
    assert "pass --overwrite" in err and err.count("\n") == 1
    other = path / "other.jsonl"
    other.write_text(work["corpus"].read_text() + '{"id": "doc-x", "text": "one more"}\n')
    options = dict(id_field="id", shard_size=SHARD, batch_size=BATCH, show_progress_bar=False)
    for corpus, kwargs, message in ((work["corpus"], {"prompt": "Query: "}, 'options.prompt (there: null, now: "Q'),
                                    (work["corpus"], {"max_length": 12}, "options.max_length (there: null, now: 12)"),
                                    (work["corpus"], {"shard_size": 8}, "options.shard_size (there: 16, now: 8)"),
                                    (other, {}, "corpus.rows (there: 64, now: 65); corpus.sha256")):
        with pytest.raises(DataError, match="holds the embeddings of another run") as info:
            embed_corpus(work["model"], corpus, ref, **{**options, **kwargs})
        assert message in str(info.value)
    assert {p.name: p.read_bytes() for p in ref.iterdir()} == before  # untouched
    damaged = path / "damaged"  # a finished directory whose files changed: the reader refuses it, a rerun mends it
    shutil.copytree(ref, damaged)
    (damaged / "shard-00002.npy").unlink()
    saved = (damaged / "shard-00001.ids.json").read_bytes()
    (damaged / "shard-00001.ids.json").write_text('["doc-16"]')
    with pytest.raises(DataError, match="shard-00001.ids.json: checksum differs from the manifest's"):
        load_corpus_embeddings(damaged)
    with pytest.warns(UserWarning) as caught:  # was refused: "pass --overwrite" recomputed every shard
        embed_corpus(work["model"], work["corpus"], damaged, **options)
    assert sorted(str(w.message).split(str(damaged) + "/")[1] for w in caught) == [
        "shard-00001.ids.json has changed since it was written (checksum differs): recomputing shard 1",
        "shard-00002.npy is missing: recomputing shard 2"]
    assert {p.name: p.read_bytes() for p in damaged.iterdir()} == before  # the uninterrupted run's bytes
    assert (damaged / "shard-00001.ids.json").read_bytes() == saved
    stale = json.loads((damaged / "manifest.json").read_text())  # an entry a mended shard no longer matches
    stale["shards"][0]["sha256"] = "0" * 64
    (damaged / "manifest.json").write_text(json.dumps(stale))
    embed_corpus(work["model"], work["corpus"], damaged, **options)  # was "shard 0 is listed twice"
    assert {p.name: p.read_bytes() for p in damaged.iterdir()} == before
    (damaged / "shard-00002.npy").unlink()
    (damaged / "shard-00001.ids.json").write_text('["doc-16"]')
    with pytest.raises(DataError, match="shard-00001.ids.json: checksum differs from the manifest's"):
        load_corpus_embeddings(damaged)
    # the reader names a listed file that is gone and a manifest cut short (they were bare Python errors)
    with pytest.raises(DataError, match="shard-00002.npy: listed in .*manifest.json but missing"):
        load_corpus_embeddings(damaged, verify=False)
    (damaged / "manifest.json").write_text((damaged / "manifest.json").read_text()[:50])
    with pytest.raises(DataError, match="manifest.json: not a readable manifest of a finished run"):
        load_corpus_embeddings(damaged)
    (bad / "notes").mkdir()
    (bad / "notes/todo.txt").write_text("mine")
    assert cli.main(args(model_dir, work["corpus"], bad / "notes")) == 2
    assert "is not empty (todo.txt) and holds no corpus embeddings" in capsys.readouterr().err


def test_sigkill_then_restart_gives_the_uninterrupted_output(work):
    """`jaxembed embed --corpus` killed right after writing its second shard's files (before its manifest lists
    them), then run again with the same arguments: every file equals the uninterrupted run's, byte for byte."""
    path = work["path"]
    killed = finish(work["procs"]["killed"])
    assert killed.returncode == -9, killed.stderr[-3000:]
    out = path / "resumed"
    listed = json.loads((out / "process-00000.json").read_text())
    assert [s["index"] for s in listed["shards"]] == [0] and not listed["complete"]
    assert (out / "shard-00001.npy").exists() and not (out / "manifest.json").exists()
    embed_corpus(work["model"], work["corpus"], out, id_field="id", shard_size=SHARD, batch_size=BATCH,
                 show_progress_bar=False)  # the CLI's arguments, through the API: the same identity
    files = {p.name: p.read_bytes() for p in out.iterdir()}
    assert files == {p.name: p.read_bytes() for p in (path / "reference").iterdir()}


def test_two_processes_on_8_devices_each(work):
    """jax.distributed, two processes on localhost, each splitting its batches over 8 CPU devices: process p wrote
    the shards s % 2 == p, every record is there exactly once, and the numbers are the one-device ones."""
    path = work["path"]
    results = [finish(work["procs"][f"process{i}"]) for i in range(2)]
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    assert "on 8 device(s)" in results[0].stderr
    out = path / "distributed"
    for p in range(2):
        manifest = json.loads((out / f"process-{p:05d}.json").read_text())
        assert [s["index"] for s in manifest["shards"]] == list(range(p, ROWS // SHARD, 2)) and manifest["complete"]
    emb, ids = load_corpus_embeddings(out)
    assert len(ids) == len(set(ids)) == ROWS and set(ids) == {f"doc-{i}" for i in range(ROWS)}
    ref, ref_ids = load_corpus_embeddings(path / "reference")
    assert ids == ref_ids and np.abs(emb - ref).max() < 1e-6


def test_processes_given_different_options_all_stop_naming_them(work):
    """Process 1 with --no-normalize: it exited 0 after writing unnormalised shards, and process 0 failed at the
    merge with "written by another run". Now both stop before embedding, naming the option. The model is a
    converted one: under jax.distributed orbax refused its params ("Topology mismatch"), as if damaged."""
    for i in range(2):
        r = finish(work["procs"][f"mismatched{i}"])
        assert r.returncode == 2, r.stderr[-3000:]
        assert "process(es) [1] differ from process 0 in options.normalize;" in r.stderr, r.stderr[-3000:]
    assert not list((work["path"] / "mismatched").glob("shard-*"))


def test_processes_with_uneven_device_counts_are_named(monkeypatch):
    """2 and 1 local devices: process_allgather failed with "cannot reshape array of size 3 into shape (2,2)"
    (and, before the identity check, the final barrier after all the work). Counted here as jax reports them."""
    import jax

    from jaxembed.distributed import check_processes_agree

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "local_device_count", lambda: 2)
    monkeypatch.setattr(jax, "device_count", lambda: 3)
    with pytest.raises(DataError, match=r"different numbers of local devices \(2 here, 3 in all over 2 processes\)"):
        check_processes_agree({"options.normalize": "true"}, error=DataError, advice="")
