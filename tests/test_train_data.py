"""Training data: load_triples (jsonl/parquet through `datasets`, drops, errors with file and line), the batch
plan, and the stdlib code-search corpus."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from jaxembed.train.corpus import INSTRUCTION, SOURCE, build_stdlib_corpus
from jaxembed.train.corpus import main as corpus_main
from jaxembed.train.data import DataError, DataReport, leftover, load_triples, plan_batches

# A small, fixed set of stdlib modules: enough functions for a split with negatives, fast to parse.
CORPUS_MODULES = ["argparse", "bisect", "calendar", "csv", "difflib", "email", "fractions", "heapq", "json",
                  "shutil", "string", "textwrap"]


def write_jsonl(path, rows, blank_lines=()):
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    for i in sorted(blank_lines):
        lines.insert(i, "   ")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def row(i, k=2, **extra):
    return {"query": f"q{i}", "positive": f"p{i}", "negatives": [f"n{i}_{j}" for j in range(k)], **extra}


# ------------------------------------------------------------------------------------------ load_triples


def test_jsonl_round_trip_defaults_and_extra_fields(tmp_path):
    rows = [row(0, instruction="find it"), row(1, source="other", module="m"), row(2, k=3, note={"x": 1})]
    f = write_jsonl(tmp_path / "pairs.jsonl", rows, blank_lines=[1])
    data, report = load_triples(f, negatives_per_query=2)
    assert list(data) == ["other", "pairs"]  # sorted by source; source defaults to the file stem
    pairs = data["pairs"]
    assert pairs.column_names == ["query", "positive", "negatives", "instruction", "source"]
    assert pairs["query"] == ["q0", "q2"] and pairs["positive"] == ["p0", "p2"]
    assert pairs["negatives"] == [["n0_0", "n0_1"], ["n2_0", "n2_1"]]  # first k of 3 kept
    assert pairs["instruction"] == ["find it", ""] and pairs["source"] == ["pairs", "pairs"]
    assert data["other"][0] == {"query": "q1", "positive": "p1", "negatives": ["n1_0", "n1_1"], "instruction": "",
                                "source": "other"}
    assert (report.rows, report.kept, report.unused_negatives) == (3, 3, 1)
    assert report.dropped_empty == {} and report.dropped_few_negatives == {}
    assert "read 3 rows, kept 3" in report.summary()


def test_parquet_round_trip_and_file_order(tmp_path):
    import datasets

    rows = [row(i, k=1, source="a" if i % 2 else "b") for i in range(6)]
    f = tmp_path / "t.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(f))
    jl = write_jsonl(tmp_path / "more.jsonl", [row(9, k=1, source="a")])
    data, report = load_triples([f, str(jl)], negatives_per_query=1)
    assert data["a"]["query"] == ["q1", "q3", "q5", "q9"]  # file order, files in the order given
    assert data["b"]["query"] == ["q0", "q2", "q4"]
    assert data["b"]["negatives"] == [["n0_0"], ["n2_0"], ["n4_0"]]
    assert report.kept == 7 and report.kept_by_source == {"a": 4, "b": 3}


def test_changed_file_is_not_served_stale(tmp_path):
    f = write_jsonl(tmp_path / "x.jsonl", [row(0)])
    assert load_triples(f)[0]["x"]["query"] == ["q0"]
    write_jsonl(f, [row(1), row(2)])
    assert load_triples(f)[0]["x"]["query"] == ["q1", "q2"]


def test_drops_are_counted_per_source(tmp_path):
    rows = [
        row(0, source="a"),
        {**row(1, source="a"), "negatives": ["ok", "  \t "]},  # whitespace-only negative
        {**row(2, source="b"), "query": " "},
        {**row(3, source="b"), "positive": ""},
        row(4, k=1, source="b"),  # too few negatives
        row(5, k=0, source="a"),
        row(6, k=4, source="a"),
    ]
    data, report = load_triples(write_jsonl(tmp_path / "d.jsonl", rows), negatives_per_query=2)
    assert report.rows == 7 and report.kept == 2
    assert report.dropped_empty == {"a": 1, "b": 2}
    assert report.dropped_few_negatives == {"a": 1, "b": 1}
    assert report.unused_negatives == 1
    assert list(data) == ["a"] and data["a"]["query"] == ["q0", "q6"]
    s = report.summary()
    assert "kept 2" in s and "dropped 3 with an empty" in s and "dropped 2 with fewer than 2 negatives" in s
    with pytest.raises(DataError, match="no usable training rows"):
        load_triples(write_jsonl(tmp_path / "e.jsonl", rows[1:4]), negatives_per_query=2)


@pytest.mark.parametrize("bad, message", [
    ('{"query": "q", "positive": oops}', r"bad\.jsonl: line 3: invalid JSON"),
    ('{"query": "q", "negatives": ["n"]}', r"bad\.jsonl: line 3: missing field 'positive'"),
    ('{"query": 5, "positive": "p", "negatives": ["n"]}',
     r"bad\.jsonl: line 3: field 'query' must be a string, got int"),
    ('{"query": null, "positive": "p", "negatives": ["n"]}', r"line 3: field 'query' must be a string, got null"),
    ('{"query": "q", "positive": "p", "negatives": "n"}', r"line 3: field 'negatives' must be a list of strings"),
    ('{"query": "q", "positive": "p", "negatives": ["n", 3]}', r"line 3: negatives\[1\] must be a string, got int"),
    ('{"query": "q", "positive": "p", "negatives": ["n", null]}', r"line 3: negatives\[1\] must be a string, got null"),
    ('["q", "p", ["n"]]', r"line 3: expected a JSON object"),
    ('{"query": "q", "positive": "p", "negatives": ["n"], "source": 7}', r"line 3: field 'source' must be a string"),
])
def test_malformed_jsonl_names_file_and_real_line(tmp_path, bad, message):
    # line 1 good, line 2 blank, line 3 bad, line 4 good
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps(row(0)) + "\n\n" + bad + "\n" + json.dumps(row(1)) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=message):
        load_triples(f)


def test_malformed_parquet_names_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"query": ["a", None, "c"], "positive": ["p", "p", "p"],
                             "negatives": [["n"], ["n"], ["n"]]}), f)
    with pytest.raises(DataError, match=r"bad\.parquet: row 2: field 'query' must be a string, got null"):
        load_triples(f)
    pq.write_table(pa.table({"query": ["a"], "positive": ["p"]}), f)
    with pytest.raises(DataError, match=r"bad\.parquet: row 1: missing field 'negatives'"):
        load_triples(f)
    f.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"bad\.parquet: cannot read as parquet"):
        load_triples(f)


def test_unknown_suffix_and_missing_path(tmp_path):
    (tmp_path / "d.csv").write_text("query,positive\n")
    with pytest.raises(DataError, match=r"d\.csv.*\.jsonl, \.json, \.parquet"):
        load_triples(tmp_path / "d.csv")
    with pytest.raises(DataError, match=r"nowhere\.jsonl: no such file"):
        load_triples([write_jsonl(tmp_path / "ok.jsonl", [row(0)]), tmp_path / "nowhere.jsonl"])
    with pytest.raises(DataError, match="negatives_per_query"):
        load_triples(tmp_path / "ok.jsonl", negatives_per_query=-1)


# ------------------------------------------------------------------------------------------ plan_batches


def test_plan_is_deterministic_and_order_independent():
    sizes = {"a": 103, "b": 40, "c": 7}
    plan = plan_batches(sizes, 8, seed=3, epoch=1)
    again = plan_batches(dict(reversed(sizes.items())), 8, seed=3, epoch=1)
    assert [s for s, _ in plan] == [s for s, _ in again]
    assert all(np.array_equal(x, y) for (_, x), (_, y) in zip(plan, again, strict=True))
    for other in (plan_batches(sizes, 8, seed=4, epoch=1), plan_batches(sizes, 8, seed=3, epoch=2)):
        assert [s for s, _ in other] != [s for s, _ in plan] or not all(
            np.array_equal(x, y) for (_, x), (_, y) in zip(plan, other, strict=True))
    # Pinned: the same plan on every machine and in every process (PCG64 + SeedSequence, crc32 of the names,
    # never Python's salted hash()).
    assert "".join(s for s, _ in plan) == "babaaaababaaaaaab"
    assert plan[0][1].tolist() == [17, 33, 37, 5, 35, 8, 12, 2]


def test_every_full_batch_used_exactly_once():
    sizes = {"a": 103, "b": 40, "c": 7}
    plan = plan_batches(sizes, 8, seed=0)
    assert Counter(s for s, _ in plan) == {"a": 12, "b": 5}  # c is smaller than a batch
    for name, n in sizes.items():
        idx = [b for s, b in plan if s == name]
        assert all(b.shape == (8,) and b.dtype == np.int64 for b in idx)
        flat = np.concatenate(idx) if idx else np.zeros(0, np.int64)
        assert len(set(flat.tolist())) == len(flat) and (flat < n).all() and (flat >= 0).all()
    assert leftover(sizes, 8) == {"a": 7, "b": 0, "c": 7}


def test_sources_drawn_in_proportion_to_size():
    sizes = {"big": 3000, "small": 1000}
    plan = plan_batches(sizes, 10, seed=1)
    first_quarter = [s for s, _ in plan[:100]]
    assert 60 <= first_quarter.count("big") <= 90  # expectation 75, not all of one source first
    fractions = [np.mean([s == "big" for s, _ in plan_batches(sizes, 10, seed=s)[:40]]) for s in range(20)]
    assert abs(np.mean(fractions) - 0.75) < 0.05


def test_plan_rejects_bad_batch_sizes():
    with pytest.raises(DataError, match="batch_size must be a positive int"):
        plan_batches({"a": 10}, 0, seed=0)
    with pytest.raises(DataError, match=r"batch_size 32 is larger than every source \(a: 10 rows, b: 20 rows\)"):
        plan_batches({"b": 20, "a": 10}, 32, seed=0)
    with pytest.raises(DataError, match="seed"):
        plan_batches({"a": 10}, 2, seed=-1)


def test_report_summary_is_one_line():
    r = DataReport(rows=5, kept=3, dropped_empty={"x": 1}, dropped_few_negatives={"y": 1}, unused_negatives=2,
                   negatives_per_query=1, kept_by_source={"x": 3})
    assert "\n" not in r.summary() and "kept 3 (x 3)" in r.summary()


# ------------------------------------------------------------------------------------------ stdlib corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus")
    counts = build_stdlib_corpus(out, modules=CORPUS_MODULES, max_per_module=25, negatives=2, seed=0,
                                 heldout_fraction=0.25)
    return out, counts


def _read(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_corpus_split_by_module_with_hard_negatives(corpus):
    out, counts = corpus
    train, heldout = _read(out / "train.jsonl"), _read(out / "heldout.jsonl")
    assert len(train) == counts["train_rows"] > 0 and len(heldout) == counts["heldout_rows"] > 0
    train_modules, heldout_modules = {r["module"] for r in train}, {r["module"] for r in heldout}
    assert not train_modules & heldout_modules
    assert train_modules | heldout_modules <= set(CORPUS_MODULES)
    assert (counts["train_modules"], counts["heldout_modules"]) == (len(train_modules), len(heldout_modules))
    assert 0.1 < len(heldout) / (len(train) + len(heldout)) < 0.45
    assert max(Counter(r["module"] for r in train + heldout).values()) <= 25
    for rows in (train, heldout):
        positives = {r["positive"]: r["module"] for r in rows}
        assert len(positives) == len(rows) and len({r["query"] for r in rows}) == len(rows)
        for r in rows:
            assert r["source"] == SOURCE and r["instruction"] == INSTRUCTION
            assert len(r["query"].split()) >= 4 and r["positive"].startswith(("def ", "async def "))
            assert r["query"] not in " ".join(r["positive"].split())  # the docstring is gone
            assert len(r["negatives"]) == 2 and r["positive"] not in r["negatives"]
            assert len(set(r["negatives"])) == 2
            assert all(n in positives for n in r["negatives"])  # negatives come from the same split
    module_of = {r["positive"]: r["module"] for r in train}
    same_module = sum(all(module_of[n] == r["module"] for n in r["negatives"]) for r in train)
    assert same_module / len(train) > 0.9


def test_corpus_is_byte_identical_and_loads(corpus, tmp_path, capsys):
    out, counts = corpus
    again = build_stdlib_corpus(tmp_path, modules=CORPUS_MODULES, max_per_module=25, negatives=2, seed=0,
                                heldout_fraction=0.25)
    assert again == counts
    for name in ("train.jsonl", "heldout.jsonl"):
        assert (tmp_path / name).read_bytes() == (out / name).read_bytes()
    data, report = load_triples([out / "train.jsonl", out / "heldout.jsonl"], negatives_per_query=2)
    assert list(data) == [SOURCE] and report.kept == report.rows == counts["train_rows"] + counts["heldout_rows"]
    assert data[SOURCE][0]["query"] == _read(out / "train.jsonl")[0]["query"]


def test_corpus_cli(tmp_path, capsys, monkeypatch):
    import jaxembed.train.corpus as corpus_mod

    seen = {}

    def fake_build(out_dir, **kwargs):  # the CLI wiring only; the real build is covered above
        seen.update(kwargs, out_dir=out_dir)
        return {"train_rows": 3, "train_modules": 2, "heldout_rows": 1, "heldout_modules": 1, "files": 4,
                "skipped_files": 0, "python": "3.x"}

    monkeypatch.setattr(corpus_mod, "build_stdlib_corpus", fake_build)
    assert corpus_main([str(tmp_path), "--heldout-fraction", "0.3", "--seed", "5"]) == 0
    assert seen["heldout_fraction"] == 0.3 and seen["seed"] == 5 and seen["out_dir"] == str(tmp_path)
    assert "3 rows from 2 modules" in capsys.readouterr().out
