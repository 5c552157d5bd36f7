"""Training data: load_triples (jsonl/parquet through `datasets`, drops, errors with file and line), the batch
plan, and the stdlib code-search corpus."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from jaxembed.train.corpus import INSTRUCTION, SOURCE, build_code_corpus, build_stdlib_corpus, collect_functions
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
    with pytest.raises(DataError, match="no usable rows"):
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


def test_bytes_that_are_not_utf8_are_named_with_their_line(tmp_path):
    """pyarrow reads Latin-1 bytes into a string column and fails only when the column is converted: a raw
    UnicodeDecodeError with no file or line. The record-by-record scan names both."""
    f = tmp_path / "lat.jsonl"
    f.write_bytes(json.dumps(row(0)).encode() + b"\n" + b'{"query": "caf\xe9", "positive": "p", "negatives": ["n"]}\n')
    with pytest.raises(DataError, match=r"lat\.jsonl: line 2: not valid UTF-8"):
        load_triples(f)


def test_malformed_parquet_names_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"query": ["a", None, "c"], "positive": ["p", "p", "p"],
                             "negatives": [["n"], ["n"], ["n"]]}), f)
    with pytest.raises(DataError, match=r"bad\.parquet: row 2: field 'query' must be a string, got null"):
        load_triples(f)
    pq.write_table(pa.table({"query": ["a"], "positive": ["p"]}), f)  # pairs: no negatives field, none
    with pytest.raises(DataError, match=r"no usable rows .* in .*bad\.parquet: .*dropped 1 with fewer than 1 "):
        load_triples(f)
    pairs, report = load_triples(f, negatives_per_query=0)
    assert pairs["bad"]["negatives"] == [[]] and report.kept == 1
    pq.write_table(pa.table({"query": ["a"], "negatives": [["n"]]}), f)
    with pytest.raises(DataError, match=r"bad\.parquet: row 1: missing field 'positive'"):
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
    r0 = DataReport(rows=5, kept=5, unused_negatives=5, negatives_per_query=0)  # read "more than 0 (the first 0)"
    assert "5 rows had negatives, unused (negatives_per_query is 0)" in r0.summary()


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


def _package(root, name, functions):
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text("\n\n".join(functions) + "\n")


def _function(name, summary, body):
    return f'def {name}(x):\n    """{summary}\n\n    More text.\n    """\n' + "".join(f"    {line}\n" for line in body)


def test_code_corpus_over_several_roots_splits_by_package(tmp_path):
    """Packages from several roots (sys.path order: the first root's copy of a name wins), files parsed on
    worker processes, one-statement bodies when asked for, the split by package."""
    first, second = tmp_path / "stdlib", tmp_path / "site-packages"
    two = ["scaled = [value * 2 + 1 for value in x]", "return [abs(value) for value in scaled]"]
    one = ["return sorted(x, key=lambda item: (item.priority, item.name))"]
    _package(first, "alpha", [_function(f"a{i}", f"Compute the alpha value number {i}", two) for i in range(40)])
    _package(second, "alpha", [_function("shadowed", "This copy is never imported at all", two)])
    for name in ("beta", "gamma", "delta"):
        _package(second, name, [_function(f"{name}{i}", f"Order the {name} items number {i}", one if i % 2 else two)
                                for i in range(40)])
    records, files = collect_functions([first, second], workers=2)
    assert files == {"files": 4, "skipped_files": 0, "namespace_packages": []}
    assert not any("shadowed" in r["name"] for r in records)
    assert len(records) == 40 + 3 * 20  # one-statement bodies are left out by default
    counts = build_code_corpus(tmp_path / "out", roots=[first, second], source="code", heldout_fraction=0.25,
                               min_body_statements=1, workers=2)
    assert counts["train_rows"] + counts["heldout_rows"] == 160 and counts["heldout_modules"] == 1
    train, heldout = _read(tmp_path / "out" / "train.jsonl"), _read(tmp_path / "out" / "heldout.jsonl")
    assert not {r["module"] for r in train} & {r["module"] for r in heldout}
    assert {r["source"] for r in train + heldout} == {"code"}
    single = next(r for r in train + heldout if r["name"].endswith(":beta1") or r["name"].endswith(":gamma1"))
    assert single["positive"] == "def " + single["name"].rsplit(":", 1)[1] + "(x):\n    " + one[0]


def test_code_corpus_nested_functions_near_duplicates_and_failed_reruns(tmp_path):
    """A nested function's docstring is cut from its enclosing function's positive, and neither is the other's
    negative; records equal up to whitespace (positives) or case, quotes and end punctuation (queries) are kept
    once; markup summaries and stub bodies are left out; a method is dedented by its def line although a string
    in it starts at column 0; namespace packages are named, not read; a rerun that fails leaves both files as
    they were."""
    root = tmp_path / "site-packages"
    body = ["scaled = [value * 2 + 1 for value in x]", "return [abs(value) for value in scaled]"]
    nested = ('def outer(x):\n    """Apply the outer transformation to all values"""\n'
              '    def inner(y):\n        """Double every inner value exactly twice"""\n'
              '        doubled = [value * 2 for value in y]\n        return [value * 2 for value in doubled]\n'
              '    total = sum(inner(x)) + len(x)\n    return [total - value for value in inner(x)]\n')
    near_copy = _function("a_copy", "Compute the alpha value number 0.", ["", body[0], "", body[1]])  # of a0
    same_query = _function("a_renamed", "compute the ``alpha`` value number 1", [body[0], "return scaled[::-1]"])
    skipped = [_function("a_markup", ":param x: the values to scale by two", body),
               _function("a_stub", "Subclasses compute the scaled values here", [
                   'raise NotImplementedError("subclasses compute the scaled values here")'])]
    method = ('class Holder:\n    def render(self, x):\n        """Render the values as an indented text block"""\n'
              '        text = """\nvalues:\n"""\n        return text + "\\n".join(f"  {value}" for value in x)\n')
    _package(root, "alpha", [nested, method] + [_function(f"a{i}", f"Compute the alpha value number {i}", body)
                                                for i in range(30)] + [near_copy, same_query] + skipped)
    for name in ("beta", "gamma"):
        _package(root, name, [_function(f"{name}{i}", f"Order the {name} items number {i}", body[1:] * 2)
                              for i in range(30)])
    (root / "nsp").mkdir()
    (root / "nsp" / "mod.py").write_text(_function("n", "A function in a namespace package", body))
    out = tmp_path / "out"
    counts = build_code_corpus(out, roots=[root], source="code", heldout_fraction=0.3, negatives=3, workers=1)
    assert counts["namespace_packages"] == ["nsp"] and counts["heldout_modules"] == 1
    rows = _read(out / "train.jsonl") + _read(out / "heldout.jsonl")
    names = [r["name"].rsplit(":", 1)[1] for r in rows]
    assert not {"a_copy", "a_renamed", "a_markup", "a_stub"} & set(names) and len(rows) == 3 + 30 + 60
    by_name = {r["name"].rsplit(":", 1)[1]: r for r in rows}
    # dedented by the def line's indentation although the string's lines start at column 0
    assert by_name["render"]["positive"].startswith("def render(self, x):\n    text = ")
    assert all(compile(r["positive"], r["name"], "exec") for r in rows)
    outer, inner = by_name["outer"], by_name["inner"]
    assert "Double every inner value" not in outer["positive"] and "def inner(y):" in outer["positive"]
    assert outer["positive"] not in inner["negatives"] and inner["positive"] not in outer["negatives"]
    before = {name: (out / name).read_bytes() for name in ("train.jsonl", "heldout.jsonl")}
    with pytest.raises(ValueError, match=r"the heldout split has 3\d functions: too few for 40 distinct negatives"):
        build_code_corpus(out, roots=[root], source="code", heldout_fraction=0.3, negatives=40, workers=1)
    for fraction, split in ((0.01, "heldout"), (0.99, "train")):
        with pytest.raises(ValueError, match=f"the {split} split is empty: heldout_fraction {fraction} of 93"):
            build_code_corpus(out, roots=[root], source="code", heldout_fraction=fraction, workers=1)
    assert {name: (out / name).read_bytes() for name in before} == before


# ------------------------------------------------------------------------------------------ token pipeline


def _tokenize(sources, tokenizer, cache_dir, max_tokens=12, k=2, template="Q: {prompt} | ", defaults=None):
    from jaxembed.train.pipeline import tokenize_sources

    defaults = defaults or {}

    def query_text(instruction, query, source):
        instruction = instruction or defaults.get(source, "")
        return (template.format(prompt=instruction) if instruction else "") + query

    return tokenize_sources(sources, tokenizer=tokenizer, eos=tokenizer.eos_token_id, max_tokens=max_tokens,
                            query_text=query_text, cache_dir=cache_dir,
                            settings=lambda source: {"template": template, "instruction": defaults.get(source, "")},
                            negatives_per_query=k, show_progress=False)


def _expected_ids(tokenizer, text, max_tokens):
    ids = tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
    return ids if len(ids) <= max_tokens else ids[: max_tokens - 1] + [tokenizer.eos_token_id]


def test_tokenized_batches_match_the_tokenizer_and_the_cache_is_keyed_by_content(tmp_path, tokenizer, monkeypatch):
    rows = [{"query": f"sort the list number {i}" + " again" * (i % 5), "positive": f"def f{i}(x): return sorted(x)",
             "negatives": [f"def g{i}(): pass", "x = 1" * (i % 7 + 1)], "instruction": "find code" if i % 2 else ""}
            for i in range(23)]
    path = write_jsonl(tmp_path / "code.jsonl", rows)
    sources, _ = load_triples(path, negatives_per_query=2)
    tokens = _tokenize(sources, tokenizer, tmp_path / "cache")["code"]
    picked = np.array([22, 3, 7, 0, 11])
    arrays, n_tokens, truncated = tokens.batch(picked, chunk_size=8)
    expected = {"query": [], "pos": [], "neg": []}
    for i in picked:
        r = rows[i]
        query = ("Q: find code | " if r["instruction"] else "") + r["query"]
        expected["query"].append(_expected_ids(tokenizer, query, 12))
        expected["pos"].append(_expected_ids(tokenizer, r["positive"], 12))
        expected["neg"] += [_expected_ids(tokenizer, n, 12) for n in r["negatives"]]
    L = arrays["query_ids"].shape[1]
    assert L == 16 and arrays["neg_ids"].shape == (5, 2, L)  # max 12 tokens -> the 16 bucket (Q = 8)
    for name, ids, lens in (("query", arrays["query_ids"], arrays["query_len"]),
                            ("pos", arrays["pos_ids"], arrays["pos_len"]),
                            ("neg", arrays["neg_ids"].reshape(-1, L), arrays["neg_len"].reshape(-1))):
        assert lens.tolist() == [len(x) for x in expected[name]]
        assert ids.tolist() == [x + [0] * (L - len(x)) for x in expected[name]]
    full = [len(tokenizer(t)["input_ids"]) + 1 for i in picked
            for t in (("Q: find code | " if rows[i]["instruction"] else "") + rows[i]["query"], rows[i]["positive"],
                      *rows[i]["negatives"])]
    assert truncated == sum(n > 12 for n in full) > 0 and n_tokens == sum(min(n, 12) for n in full)

    # a second run reads the cache: the tokenizer is not called
    monkeypatch.setattr(type(tokenizer), "__call__", lambda *a, **k: pytest.fail("tokenized again"))
    again = _tokenize(sources, tokenizer, tmp_path / "cache")["code"]
    assert again.fingerprint == tokens.fingerprint
    assert all(np.array_equal(a, b) for a, b in zip(again.batch(picked, 8)[0].values(), arrays.values(), strict=True))
    monkeypatch.undo()
    # anything the ids depend on changes the key: never a cache file made from something else
    changed = [_tokenize(sources, tokenizer, tmp_path / "cache", max_tokens=13)["code"].fingerprint,
               _tokenize(sources, tokenizer, tmp_path / "cache", template="I: {prompt} | ")["code"].fingerprint]
    rows[4]["negatives"][1] += " # edited"
    sources2, _ = load_triples(write_jsonl(tmp_path / "code.jsonl", rows), negatives_per_query=2)
    changed.append(_tokenize(sources2, tokenizer, tmp_path / "cache")["code"].fingerprint)
    assert len({tokens.fingerprint, *changed}) == 4
    assert len(list((tmp_path / "cache").glob("tokens-*.arrow"))) == 4


def test_a_sources_default_instruction_keys_that_source_alone(tmp_path, tokenizer, monkeypatch):
    """The key held every source's instruction: editing one re-tokenized all of them."""
    rows = [{"query": f"query {i}", "positive": f"doc {i}", "negatives": [f"neg {i}"]} for i in range(5)]
    sources, _ = load_triples([write_jsonl(tmp_path / "a.jsonl", rows), write_jsonl(tmp_path / "b.jsonl", rows)],
                              negatives_per_query=1)
    before = _tokenize(sources, tokenizer, tmp_path / "cache", max_tokens=32, k=1, defaults={"a": "find", "b": "find"})
    calls = []
    real = type(tokenizer).__call__
    monkeypatch.setattr(type(tokenizer), "__call__", lambda self, texts, *a, **k: calls.append(texts) or real(
        self, texts, *a, **k))
    after = _tokenize(sources, tokenizer, tmp_path / "cache", max_tokens=32, k=1, defaults={"a": "find", "b": "search"})
    assert after["a"].fingerprint == before["a"].fingerprint and after["b"].fingerprint != before["b"].fingerprint
    assert calls and all("Q: search | query 0" in texts for texts in calls)  # b alone was tokenized again
    ids = after["b"].batch(np.array([0]), chunk_size=8)[0]["query_ids"][0]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Q: search | query 0"
    # a checkpoint recorded under the earlier scheme (one key of every source's instructions) still matches
    from jaxembed.train.pipeline import tokenize_sources

    old_settings = {"template": "Q: {prompt} | ", "instructions": [("a", "find"), ("b", "search")]}
    common = dict(tokenizer=tokenizer, eos=tokenizer.eos_token_id, max_tokens=32, cache_dir=tmp_path / "cache",
                  negatives_per_query=1, show_progress=False, query_text=lambda i, q, s: q)
    old = tokenize_sources(sources, settings=lambda source: old_settings, **common)
    new = tokenize_sources(sources, settings=lambda source: {"instruction": source}, legacy_settings=old_settings,
                           **common)
    assert {s: t.legacy_fingerprint for s, t in new.items()} == {s: t.fingerprint for s, t in old.items()}


def test_a_token_cache_changed_since_it_was_written_is_made_again(tmp_path, tokenizer):
    """The file name is a key of what went in, not of the bytes: one changed int32 was read as ids (and the
    resume check still matched); a truncated file was Arrow's error, naming no file."""
    rows = [{"query": f"sort list number {i}", "positive": f"def f{i}(x): return sorted(x)", "negatives": ["x = 1"]}
            for i in range(9)]
    sources, _ = load_triples(write_jsonl(tmp_path / "code.jsonl", rows), negatives_per_query=1)
    cache = tmp_path / "cache"
    good = _tokenize(sources, tokenizer, cache, k=1)["code"]
    expected = good.batch(np.arange(9), chunk_size=8)[0]
    (arrow,) = cache.glob("tokens-*.arrow")
    data = bytearray(arrow.read_bytes())
    at = data.find(np.asarray(good.query.values[:3], np.int32).tobytes())  # the first query's ids in the file
    assert at > 0
    data[at: at + 4] = np.int32(7).tobytes()
    arrow.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="its bytes differ from the digest written with it"):
        again = _tokenize(sources, tokenizer, cache, k=1)["code"]
    assert all(np.array_equal(a, b) for a, b in zip(again.batch(np.arange(9), 8)[0].values(), expected.values(),
                                                    strict=True))
    (cache / (arrow.name + ".xxh3")).unlink()  # no digest (an older cache): read as it is; damage is named
    arrow.write_bytes(arrow.read_bytes()[: arrow.stat().st_size // 2])
    with pytest.raises(DataError, match=f"{arrow.name}: a token cache that cannot be read .*delete it"):
        _tokenize(sources, tokenizer, cache, k=1)


def test_the_rows_hash_cannot_be_matched_by_moving_a_separator():
    """Texts were joined with \\0 and negatives with \\1: ["g\\1d", "e"] and ["g", "d\\1e"] hashed alike, and a run on
    the second rows was fed the first rows' cached ids (and resumed the other's checkpoint)."""
    import datasets

    from jaxembed.train.pipeline import _rows_hash

    def rows(query, positive, negatives):
        return datasets.Dataset.from_dict({"query": [query], "positive": [positive], "instruction": [""],
                                           "negatives": [negatives]})

    assert _rows_hash(rows("q", "p", ["g\1d", "e"])) != _rows_hash(rows("q", "p", ["g", "d\1e"]))
    assert _rows_hash(rows("a\0b", "c", [])) != _rows_hash(rows("a", "b\0c", []))
    assert _rows_hash(rows("q", "p", ["n"])) == _rows_hash(rows("q", "p", ["n"]))


def test_tokenized_batches_without_negatives(tmp_path, tokenizer):
    sources, _ = load_triples(write_jsonl(tmp_path / "d.jsonl", [row(i, k=0) for i in range(6)]),
                              negatives_per_query=0)
    arrays, n_tokens, _ = _tokenize(sources, tokenizer, tmp_path / "cache", k=0)["d"].batch([5, 1], chunk_size=8)
    assert arrays["neg_ids"].shape == (2, 0, arrays["query_ids"].shape[1]) and arrays["neg_len"].shape == (2, 0)
    assert arrays["pos_ids"][0, : arrays["pos_len"][0]].tolist() == _expected_ids(tokenizer, "p5", 12)
    assert n_tokens == int(arrays["query_len"].sum() + arrays["pos_len"].sum())
