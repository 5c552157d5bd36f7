"""`jaxembed mine`: hard negatives by BM25 or a model, checked against rankings computed here from scratch
(Okapi BM25 written out; cosines from the embedder's own embeddings), the skip rules, the file round trip
through `load_triples`, and the CLI."""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter
from pathlib import Path

import bm25s
import jax
import numpy as np
import pytest

from jaxembed import models
from jaxembed.config import load_config
from jaxembed.embedder import Embedder
from jaxembed.errors import ConfigError, DataError
from jaxembed.testing import make_tokenizer
from jaxembed.train import mine
from jaxembed.train.data import load_triples
from jaxembed.train.mine import mine_file, mine_negatives

ROOT = Path(__file__).resolve().parents[1]

# query -> positive; the positives overlap in words so that each query ranks several of them
PAIRS = [
    ("how does python sort lists", "python sorts lists with the sorted builtin"),
    ("map keys to values in python", "python dictionaries map keys to values"),
    ("append items to a python list", "python lists append items at the end of the list"),
    ("boil water for pasta", "cooking pasta needs boiling water and salt"),
    ("rust vector push values", "rust vectors grow when pushing values"),
    ("sort an array in java", "java sorts arrays with arrays sort"),
    ("compare keys when sorting lists", "sorting algorithms compare keys of list items"),
    ("python sorted keys", "the sorted builtin takes a key function in python"),
    ("java hash map values", "java hash maps store values by keys"),
    ("lists in rust", "rust has vectors instead of python lists"),
]


def records_of(pairs, **extra):
    return [{"query": q, "positive": p, "negatives": ["old"], **extra} for q, p in pairs]


def reference_bm25(queries, docs):
    """Okapi BM25 as bm25s defines it (k1 1.5, b 0.75, Lucene idf log(1 + (N - df + .5) / (df + .5)), term
    frequency part tf / (tf + k1 (1 - b + b |d| / avgdl)), a repeated query term counted each time), on
    bm25s's tokens: float64 [queries, docs]."""
    doc_tokens = bm25s.tokenize(docs, stopwords="en", return_ids=False, show_progress=False)
    query_tokens = bm25s.tokenize(queries, stopwords="en", return_ids=False, show_progress=False)
    n, avgdl = len(doc_tokens), np.mean([len(d) for d in doc_tokens])
    df = Counter(t for d in doc_tokens for t in set(d))

    def score(q, d):
        tf, k1, b = Counter(d), 1.5, 0.75
        idf = {t: math.log(1 + (n - df[t] + 0.5) / (df[t] + 0.5)) for t in q}
        return sum(idf[t] * tf[t] / (tf[t] + k1 * (1 - b + b * len(d) / avgdl)) for t in q if tf[t])

    return np.array([[score(q, d) for d in doc_tokens] for q in query_tokens])


def reference_negatives(records, pool, scores, *, k, skip_top, margin, drop_zero):
    """The first k candidates of each query's ranking (score desc, pool index asc) that are neither a positive of
    its query nor the query (whitespace collapsed), ranked >= skip_top and, when the positive scores > 0, below
    margin x it."""
    out = []
    for i, rec in enumerate(records):
        own = {" ".join(r["positive"].split()) for r in records if r["query"] == rec["query"]}
        own.add(" ".join(rec["query"].split()))
        row, positive_score = scores[i], scores[i][pool.index(rec["positive"])]
        chosen = []
        for rank, j in enumerate(sorted(range(len(pool)), key=lambda j: (-row[j], j))):
            if drop_zero and row[j] <= 0:
                break
            if " ".join(pool[j].split()) in own or rank < skip_top:
                continue
            if margin is not None and positive_score > 0 and row[j] >= margin * positive_score:
                continue
            chosen.append(pool[j])
        out.append(chosen[:k])
    return out


# ---------------------------------------------------------------------------------------------------------
# BM25


@pytest.mark.parametrize("skip_top, margin, exercised", [
    (0, None, None), (2, None, "skipped_rank"), (0, 0.5, "skipped_margin"), (1, 0.9, "skipped_margin"),
])
def test_bm25_negatives_are_the_best_scoring_eligible_candidates_in_order(skip_top, margin, exercised):
    records = records_of(PAIRS)
    pool = [p for _, p in PAIRS]
    scores = reference_bm25([q for q, _ in PAIRS], pool)
    expected = reference_negatives(records, pool, scores, k=3, skip_top=skip_top, margin=margin, drop_zero=True)
    out, stats = mine_negatives(records, negatives=3, skip_top=skip_top, margin=margin)
    assert [r["negatives"] for r in out] == expected
    assert sum(map(len, expected)) >= 20  # the rankings are deep enough to test the order
    assert stats["pool"] == len(pool) and stats["records"] == len(records) and stats["method"] == "bm25"
    assert stats["fewer_than_requested"] == sum(len(n) < 3 for n in expected)
    assert stats["mined"] == sum(map(len, expected))
    if exercised:
        assert stats[exercised] > 0


def test_margin_skips_a_near_duplicate_of_the_positive_and_whitespace_duplicates_are_positives():
    positive = "python sorts lists quickly using timsort merging runs found in nearly ordered data"
    near_duplicate = positive + " today"  # one word more: a near-equal score
    pairs = PAIRS + [("timsort merging runs", positive), ("other query", near_duplicate),
                     ("another query", positive.replace(" ", "  ") + "\n")]  # the positive up to whitespace
    records = records_of(pairs)
    pool = [p for _, p in pairs]
    scores = reference_bm25([q for q, _ in pairs], pool)
    row = len(PAIRS)
    ratio = scores[row, pool.index(near_duplicate)] / scores[row, pool.index(positive)]
    assert 0.95 <= ratio < 1

    out, stats = mine_negatives(records, negatives=2, margin=None)
    assert out[row]["negatives"][0] == near_duplicate  # without the margin: the best non-positive
    assert stats["skipped_positive"] >= 2  # its own positive and the whitespace variant, both ranked above
    out, stats = mine_negatives(records, negatives=2, margin=0.95)
    assert near_duplicate not in out[row]["negatives"]
    assert not any(" ".join(n.split()) == positive for n in out[row]["negatives"])
    assert out[row]["negatives"] == reference_negatives(records, pool, scores, k=2, skip_top=0, margin=0.95,
                                                        drop_zero=True)[row]
    assert stats["skipped_margin"] > 0


def test_positives_equal_up_to_whitespace_and_case_are_one_candidate():
    """Two records whose positives differ only in whitespace and case give the pool one entry (the first
    spelling): a third record gets that text once, not both spellings, and neither record gets the other's
    (with --no-margin a case-only variant of the positive was its first negative)."""
    text = "python sorts lists with the sorted builtin"
    pairs = [("how does python sort lists", text), ("python list sorting builtin", "PYTHON  sorts lists\twith the "
                                                                                   "Sorted builtin "), *PAIRS[1:]]
    out, stats = mine_negatives(records_of(pairs), negatives=3, margin=None)
    assert stats["pool"] == len(PAIRS)
    third = next(r for r in out if r["query"] == "python sorted keys")
    assert text in third["negatives"]
    assert len({" ".join(n.split()).lower() for n in third["negatives"]}) == len(third["negatives"]) == 3
    assert all(" ".join(n.split()).lower() != text for r in out[:2] for n in r["negatives"])


def test_other_positives_of_the_same_query_are_not_negatives():
    """The same query, also written with other whitespace: its positives are never its negatives."""
    second = "python lists sort in place with list sort"
    for query in (PAIRS[0][0], " " + PAIRS[0][0].replace(" ", "  \t") + "\n"):
        pairs = PAIRS + [(query, second)]  # a second positive for query 0
        out, stats = mine_negatives(records_of(pairs), negatives=3, margin=None)
        assert second not in out[0]["negatives"] and PAIRS[0][1] not in out[-1]["negatives"], query
        assert stats["skipped_positive"] >= 2


def test_symmetric_pairs_never_get_their_own_query_as_a_negative():
    """Pairs (a, b) and (b, a) put every query in the pool, where BM25 ranks it first against itself (before
    the fix each of these records got its own query as its first negative)."""
    pairs = [*PAIRS[:4], *[(p, q.replace(" ", "  ") + " ") for q, p in PAIRS[:4]], *PAIRS[4:]]
    records = records_of(pairs)
    pool = [p for _, p in pairs]
    out, stats = mine_negatives(records, negatives=2, margin=None)
    assert all(" ".join(n.split()) != " ".join(r["query"].split()) for r in out for n in r["negatives"])
    assert stats["skipped_query"] >= 8
    expected = reference_negatives(records, pool, reference_bm25([q for q, _ in pairs], pool), k=2, skip_top=0,
                                   margin=None, drop_zero=True)
    assert [r["negatives"] for r in out] == expected


def test_a_positive_sharing_no_term_skips_the_margin_and_a_query_without_terms_gets_none():
    pairs = PAIRS + [("python rust java", "completely unrelated words here"), ("the of and", "stopwords only query")]
    out, stats = mine_negatives(records_of(pairs), negatives=3, margin=0.95)
    # score < 0.95 x 0 is impossible: the margin is not applied, so the query still gets its best candidates
    pool = [p for _, p in pairs]
    scores = reference_bm25([q for q, _ in pairs], pool)
    assert out[-2]["negatives"] == reference_negatives(records_of(pairs), pool, scores, k=3, skip_top=0,
                                                       margin=None, drop_zero=True)[-2]
    assert len(out[-2]["negatives"]) == 3
    assert out[-1]["negatives"] == []  # only stopwords: no candidate shares a term
    assert stats["margin_not_applied"] == 2 and stats["fewer_than_requested"] >= 1


def test_fewer_than_requested_are_kept_and_counted_and_blank_records_pass_through():
    pairs = [("sort lists", "sort lists fast"), ("sort arrays", "sort arrays fast"), ("cook pasta", "cook pasta well"),
             ("", "blank query"), ("blank positive", "  ")]
    out, stats = mine_negatives(records_of(pairs, source="s"), negatives=3, margin=None)
    assert out[0]["negatives"] == ["sort arrays fast"]  # the only other document sharing a term
    assert out[2]["negatives"] == [] and out[3]["negatives"] == [] and out[4]["negatives"] == []
    assert stats["fewer_than_requested"] == 3 and stats["blank_records"] == 2 and stats["pool"] == 4
    assert stats["fewer_than_requested_records"] == [1, 2, 3]  # named, counted from 1 (blank records aside)
    assert all(r["source"] == "s" for r in out)


# ---------------------------------------------------------------------------------------------------------
# files and arguments


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_mine_file_keeps_every_field_in_order_and_loads_as_triples(tmp_path):
    rows = [{"module": "m", "query": q, "name": f"n{i}", "positive": p, "negatives": [], "source": "code",
             "instruction": "find it", "score": 0.5} for i, (q, p) in enumerate(PAIRS)]
    src = write_jsonl(tmp_path / "train.jsonl", rows)
    out = tmp_path / "mined.jsonl"
    stats = mine_file(src, out, negatives=2, margin=None)
    mined = [json.loads(line) for line in out.read_text().splitlines()]
    assert [list(r) for r in mined] == [list(r) for r in rows]
    assert [{k: v for k, v in r.items() if k != "negatives"} for r in mined] == \
           [{k: v for k, v in r.items() if k != "negatives"} for r in rows]
    datasets, report = load_triples(out, negatives_per_query=2)
    assert report.kept == len(rows) - stats["fewer_than_requested"] and report.kept >= 8
    assert datasets["code"]["negatives"] == [r["negatives"] for r in mined if len(r["negatives"]) == 2]


def test_mine_file_takes_pairs_without_negatives_and_a_byte_order_mark(tmp_path):
    """Query/positive pairs (no negatives field, what mining starts from), in a file that begins with a
    UTF-8 byte-order mark: mined, and the output trains."""
    src = tmp_path / "pairs.jsonl"
    src.write_text("\ufeff" + "".join(json.dumps({"query": q, "positive": p}) + "\n" for q, p in PAIRS),
                   encoding="utf-8")
    out = tmp_path / "mined.jsonl"
    stats = mine_file(src, out, negatives=1, margin=None)
    mined = [json.loads(line) for line in out.read_text().splitlines()]
    found = len(PAIRS) - stats["fewer_than_requested"]
    assert [(r["query"], r["positive"]) for r in mined] == list(PAIRS) and stats["mined"] == found >= 8
    datasets, report = load_triples(out, negatives_per_query=1)
    assert report.kept == found
    pairs_only, report = load_triples(src, negatives_per_query=0)
    assert report.kept == len(PAIRS) and pairs_only["pairs"]["negatives"] == [[]] * len(PAIRS)


def test_mine_file_refuses_to_replace_files_and_names_bad_lines(tmp_path):
    src = write_jsonl(tmp_path / "train.jsonl", records_of(PAIRS))
    out = tmp_path / "mined.jsonl"
    mine_file(src, out, negatives=1)
    with pytest.raises(DataError, match="mined.jsonl exists; pass --overwrite"):
        mine_file(src, out, negatives=1)
    link = tmp_path / "link.jsonl"
    link.symlink_to(out)
    mine_file(src, link, negatives=2, overwrite=True)  # written through the link (it became a plain file)
    counts = [len(json.loads(line)["negatives"]) for line in out.read_text().splitlines()]
    assert link.is_symlink() and max(counts) == 2 >= min(counts)
    (tmp_path / "dangling.jsonl").symlink_to(tmp_path / "gone" / "m.jsonl")  # refused before the work, by its target
    with pytest.raises(DataError, match=r"dangling.jsonl: directory .*gone does not exist"):
        mine_file(src, tmp_path / "dangling.jsonl", negatives=1)
    with pytest.raises(DataError, match="is the input file"):
        mine_file(src, src, negatives=1)
    with pytest.raises(DataError, match=r"must be a \.jsonl file"):
        mine_file(src, tmp_path / "mined.parquet", negatives=1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(src.read_text() + '{"query": "q", "positive": 3, "negatives": []}\n')
    with pytest.raises(DataError, match=r"bad.jsonl: line 11: field 'positive' must be a string"):
        mine_file(bad, tmp_path / "x.jsonl", negatives=1)
    assert not (tmp_path / "x.jsonl").exists()
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(DataError, match=r"dir.jsonl is a directory"):
        mine_file(src, tmp_path / "dir.jsonl", negatives=1, overwrite=True)
    bad.write_text(src.read_text() + '{"query": "q", "positive": "half of a pair \\udc00", "negatives": []}\n')
    with pytest.raises(DataError, match=r"line 11: field 'positive' holds a lone surrogate \(U\+DC00 at character 15"):
        mine_file(bad, tmp_path / "x.jsonl", negatives=1)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(negatives=0), ConfigError, "negatives must be a positive int"),
    (dict(negatives=2, skip_top=5, depth=5), ConfigError, r"depth \(5\) must be larger than skip_top \(5\)"),
    (dict(negatives=6, depth=5), ConfigError, r"depth \(5\) must be at least negatives \(6\)"),
    (dict(negatives=1, skip_top=-1), ConfigError, "skip_top must be an int >= 0"),
    (dict(negatives=1, margin=0.0), ConfigError, r"margin must be in \(0, 1\] or None"),
    (dict(negatives=1, margin=1.5), ConfigError, r"margin must be in \(0, 1\] or None"),
    (dict(negatives=1, method="tfidf"), ConfigError, "method must be one of bm25, model"),
    (dict(negatives=1, method="model"), ConfigError, "method 'model' needs an embedder"),
    (dict(negatives=1, max_length=8), ConfigError, "max_length applies to method 'model' only"),
])
def test_bad_arguments_are_named(kwargs, error, message):
    with pytest.raises(error, match=message):
        mine_negatives(records_of(PAIRS), **kwargs)


def test_bad_records_are_named():
    with pytest.raises(DataError, match="need at least 2 distinct non-blank positives"):
        mine_negatives(records_of([("a query", "same doc"), ("b query", "same doc")]), negatives=1)
    with pytest.raises(DataError, match=r"records\[1\]: field 'positive' must be a string"):
        mine_negatives([{"query": "q", "positive": "p"}, {"query": "q"}], negatives=1)
    with pytest.raises(DataError, match="no positive has a BM25 term"):
        mine_negatives(records_of([("a b", "the of"), ("c d", "x y")]), negatives=1)


# ---------------------------------------------------------------------------------------------------------
# CLI


def run_cli(argv) -> int:
    """As `jaxembed.cli.main` will run it once `add_parser` is registered in build_parser."""
    parser = argparse.ArgumentParser(prog="jaxembed")
    mine.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_mines_a_file_and_prints_the_stats(tmp_path, capsys):
    src = write_jsonl(tmp_path / "train.jsonl", records_of(PAIRS))
    out = tmp_path / "mined.jsonl"
    assert run_cli(["mine", str(src), str(out), "--negatives", "2", "--skip-top", "1", "--quiet"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["records"] == len(PAIRS) and stats["margin"] == 0.95 and stats["skip_top"] == 1
    assert [json.loads(line)["negatives"] for line in out.read_text().splitlines()] == \
           [r["negatives"] for r in mine_negatives(records_of(PAIRS), negatives=2, skip_top=1)[0]]
    assert run_cli(["mine", str(src), str(out), "--negatives", "2", "--no-margin", "--overwrite", "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out)["margin"] is None
    assert run_cli(["mine", str(src), str(out), "--negatives", "40", "--overwrite", "--quiet"]) == 0
    captured = capsys.readouterr()
    stats, err = json.loads(captured.out), captured.err
    assert stats["fewer_than_requested"] == len(PAIRS)  # the short records are named on stderr, not only counted
    assert f"{len(PAIRS)} record(s) got fewer than 40 negatives (lines 1, 2, 3" in err
    # named by their lines, blank lines counted (records 2 and 3 are lines 4 and 5 here)
    src.write_text("\n".join(src.read_text().splitlines()[:1] + ["", ""] + src.read_text().splitlines()[1:]) + "\n")
    assert run_cli(["mine", str(src), str(out), "--negatives", "40", "--overwrite", "--quiet"]) == 0
    assert "(lines 1, 4, 5, " in capsys.readouterr().err
    # blank records are said on stderr too, not only counted; with nothing but blank ones it is an error
    write_jsonl(src, records_of(PAIRS + [("", "a blank query")]))
    assert run_cli(["mine", str(src), str(out), "--negatives", "1", "--overwrite", "--quiet"]) == 0
    assert "1 record(s) with a blank query or positive were written without negatives" in capsys.readouterr().err
    write_jsonl(src, records_of([(" ", p) for _, p in PAIRS]))
    with pytest.raises(DataError, match=r"no record has both a non-blank query and a non-blank positive \(10 rec"):
        run_cli(["mine", str(src), str(out), "--negatives", "1", "--overwrite", "--quiet"])
    with pytest.raises(ConfigError, match="--method model needs --model PATH"):
        run_cli(["mine", str(src), str(tmp_path / "m.jsonl"), "--negatives", "2", "--method", "model"])
    with pytest.raises(ConfigError, match="--model is used only with --method model"):
        run_cli(["mine", str(src), str(tmp_path / "m.jsonl"), "--negatives", "2", "--model", "somewhere"])


# ---------------------------------------------------------------------------------------------------------
# model


@pytest.fixture(scope="module")
def embedder():
    """A random tiny xLSTM (its EOS state mixes the whole text, so the cosines tell texts apart)."""
    cfg = load_config(ROOT / "configs/models/tiny-train-xlstm.yaml")
    return Embedder(models.family(cfg).init_params(cfg, jax.random.key(0)), cfg, tokenizer=make_tokenizer(512))


MODEL_PAIRS = PAIRS[:8]
ENCODE = dict(batch_size=4, max_length=48, show_progress_bar=False)


def model_records():
    return [{"query": q, "positive": p, "negatives": [], "instruction": "find code" if i % 2 else ""}
            for i, (q, p) in enumerate(MODEL_PAIRS)]


def test_model_negatives_are_the_closest_eligible_candidates_by_cosine(embedder):
    records = model_records()
    pool = [p for _, p in MODEL_PAIRS]
    queries = embedder.encode([embedder.query_prompt(r["instruction"] or None) + r["query"] for r in records], **ENCODE)
    cosines = queries @ embedder.encode_document(pool, **ENCODE).T
    gaps = np.diff(np.sort(cosines, axis=1), axis=1)
    assert gaps.min() > 1e-5, "near-tied cosines: the order would hang on rounding"
    margin = float(np.median(cosines / np.diag(cosines)[:, None]))  # a margin that skips about half
    expected = reference_negatives(records, pool, cosines, k=3, skip_top=1, margin=margin, drop_zero=False)
    out, stats = mine_negatives(records, negatives=3, method="model", embedder=embedder, skip_top=1, margin=margin,
                                batch_size=4, max_length=48)
    assert [r["negatives"] for r in out] == expected
    assert stats["method"] == "model" and stats["skipped_margin"] > 0 and stats["skipped_rank"] > 0


def test_cli_model_method_loads_the_model_named(embedder, tmp_path, capsys, monkeypatch):
    import jaxembed

    loaded = []
    monkeypatch.setattr(jaxembed, "load", lambda path: loaded.append(path) or embedder)
    src = write_jsonl(tmp_path / "train.jsonl", model_records())
    out = tmp_path / "mined.jsonl"
    argv = ["mine", str(src), str(out), "--negatives", "2", "--method", "model", "--model", "tiny-dir",
            "--no-margin", "--batch-size", "4", "--max-length", "48", "--quiet"]
    assert run_cli(argv) == 0 and loaded == ["tiny-dir"]
    assert json.loads(capsys.readouterr().out)["method"] == "model"
    expected, _ = mine_negatives(model_records(), negatives=2, method="model", embedder=embedder, margin=None,
                                 batch_size=4, max_length=48)
    assert [json.loads(line)["negatives"] for line in out.read_text().splitlines()] == \
           [r["negatives"] for r in expected]
