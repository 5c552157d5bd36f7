"""Hard negatives for a training triples file: `jaxembed mine IN.jsonl OUT.jsonl --negatives K`.

The candidates are the distinct non-blank positives of all records (the pool), compared after collapsing
whitespace and case (the first spelling in the file is the one written), so no record gets the same text twice. Each
query ranks the pool, best first, ties to the lower pool index (first appearance in the file):

* ``bm25``: bm25s's Okapi BM25 (k1 1.5, b 0.75, Lucene idf; its tokenizer with English stopwords). The scores
  are bm25s's own per-(document, term) index entries, summed for many queries at once by one sparse product.
  A document sharing no term with the query scores 0 and is not a candidate: it would be a random negative,
  not a hard one.
* ``model``: cosine similarity of an `Embedder`'s normalised embeddings, queries through `encode_query` with
  the record's instruction (the model's default instruction when the record has none), documents through
  `encode_document`.

Walking its ranking in order, a query takes the first `negatives` candidates that pass four rules, and each
skipped candidate is counted once, under the first rule it fails:

1. positive: not a positive of a record with this query text, compared after collapsing whitespace and case (the
   record's own positive, its near-duplicates and the query's other positives are all false negatives);
2. query: not the query's own text, compared the same way (symmetric pairs (a, b) and (b, a) put every query in
   the pool, where it ranks first against itself);
3. rank window: rank >= `skip_top` (0-based, in the ranking that includes the positive and the query);
4. margin: score < `margin` x the query's score for its own positive. A positive scoring <= 0 (BM25: no shared
   term; model: cosine <= 0) gives no such bound, so the margin is not applied for that query (counted).

The output records are the input ones, every field kept in order, with ``negatives`` replaced by the mined
ones; a record that finds fewer keeps what it found (counted). A record whose query or positive is blank is
passed through with no negatives (`load_triples` drops it anyway).
"""

from __future__ import annotations

import argparse
import functools
import json
import numbers
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from jaxembed.errors import ConfigError, DataError, check_positive_int
from jaxembed.files import write_text_atomically
from jaxembed.text import same_text_key

METHODS = ("bm25", "model")
_BLOCK_ELEMENTS = 1 << 26  # pool scores held at once (256 MiB of float32), whatever the pool size
_MAX_BLOCK_ROWS = 256


def mine_negatives(records, *, negatives: int, method: str = "bm25", embedder=None, skip_top: int = 0,
                   depth: int = 100, margin: float | None = 0.95, max_length: int | None = None,
                   batch_size: int = 64, show_progress: bool = False) -> tuple[list[dict], dict]:
    """Records with mined hard negatives, and the stats (see the module docstring for the rules).

    depth: candidates ranked per query (at most the pool size). max_length and batch_size: the embedder's
    encode settings (method "model" only).
    """
    start_time = time.perf_counter()
    _check_args(negatives=negatives, method=method, skip_top=skip_top, depth=depth, margin=margin,
                max_length=max_length, batch_size=batch_size)
    if method == "model" and embedder is None:
        raise ConfigError("method 'model' needs an embedder (jaxembed.load(PATH))")
    if method == "bm25" and embedder is not None:
        raise ConfigError("an embedder is used only by method 'model'; pass method='model' or no embedder")
    _check_records(records)

    active = [i for i, rec in enumerate(records) if rec["query"].strip() and rec["positive"].strip()]
    if not active:
        raise DataError(f"no record has both a non-blank query and a non-blank positive ({len(records)} records)")
    first_spelling: dict[str, str] = {}  # positive with whitespace and case collapsed -> its first spelling
    for rec in records:
        if rec["positive"].strip():
            first_spelling.setdefault(same_text_key(rec["positive"]), rec["positive"])
    pool, pool_normalised = list(first_spelling.values()), list(first_spelling)
    if len(pool) < 2:
        raise DataError(f"need at least 2 distinct non-blank positives to mine negatives from, got {len(pool)}")
    pool_index = {text: j for j, text in enumerate(pool_normalised)}
    positives_of_query: dict[str, set[str]] = {}  # by the query with whitespace and case collapsed
    for i in active:
        positives_of_query.setdefault(same_text_key(records[i]["query"]), set()).add(
            same_text_key(records[i]["positive"]))

    queries = [records[i]["query"] for i in active]
    positive = np.array([pool_index[same_text_key(records[i]["positive"])] for i in active], np.int32)
    if method == "bm25":
        score_rows = _bm25_scorer(queries, pool)
    else:
        encode = dict(batch_size=batch_size, max_length=max_length, show_progress_bar=show_progress)
        instructions = [records[i].get("instruction") or None for i in active]
        score_rows = _cosine_scorer(embedder, queries, instructions, pool, **encode)

    counts = dict.fromkeys(("margin_not_applied", "skipped_positive", "skipped_query", "skipped_rank",
                            "skipped_margin"), 0)
    mined: dict[int, list[str]] = {}
    short: list[int] = []  # records that found fewer than asked
    ranked = _ranked(score_rows, positive, len(pool), min(depth, len(pool)), show_progress)
    for row, top_scores, top_index, positive_score in ranked:
        use_margin = margin is not None and positive_score > 0
        counts["margin_not_applied"] += margin is not None and not use_margin
        query_key = same_text_key(queries[row])
        own = positives_of_query[query_key]
        chosen = []
        for rank, (score, j) in enumerate(zip(top_scores.tolist(), top_index.tolist(), strict=True)):
            if method == "bm25" and score <= 0:
                break  # sorted: no document further down shares a term with the query
            if pool_normalised[j] in own:
                counts["skipped_positive"] += 1
            elif pool_normalised[j] == query_key:
                counts["skipped_query"] += 1
            elif rank < skip_top:
                counts["skipped_rank"] += 1
            elif use_margin and score >= margin * positive_score:
                counts["skipped_margin"] += 1
            else:
                chosen.append(pool[j])
                if len(chosen) == negatives:
                    break
        if len(chosen) < negatives:
            short.append(active[row])
        mined[active[row]] = chosen

    out = [{**rec, "negatives": mined.get(i, [])} for i, rec in enumerate(records)]
    stats = {"records": len(records), "pool": len(pool), "method": method, "negatives": negatives,
             "skip_top": skip_top, "depth": depth, "margin": margin, "blank_records": len(records) - len(active),
             "mined": sum(len(n) for n in mined.values()), **counts, "fewer_than_requested": len(short),
             "fewer_than_requested_records": [i + 1 for i in short[:20]],
             "seconds": round(time.perf_counter() - start_time, 3)}
    return out, stats


def mine_file(in_path, out_path, *, overwrite: bool = False, **kwargs) -> dict:
    """Mine negatives for a .jsonl/.json triples file into a .jsonl file (written atomically); the stats.
    kwargs: those of `mine_negatives`. Every field of the input records is kept."""
    from jaxembed.train.data import read_raw_records

    in_path, out_path = Path(in_path), Path(out_path)
    _check_paths(in_path, out_path, overwrite=overwrite)
    records, lines = read_raw_records(in_path)
    if not records:
        raise DataError(f"{in_path}: no records to mine (the file is empty)")
    out, stats = mine_negatives(records, **kwargs)
    if lines is not None:  # a .jsonl's short records are named by their lines
        stats["fewer_than_requested_lines"] = [lines[i - 1] for i in stats["fewer_than_requested_records"]]
    write_text_atomically(out_path, "".join(json.dumps(rec, ensure_ascii=False) + "\n" for rec in out))
    return stats


def add_parser(sub) -> argparse.ArgumentParser:
    """Register `jaxembed mine` on the CLI's subparsers."""
    p = sub.add_parser("mine", help="replace each record's negatives with hard negatives mined from the positives "
                                    "of all records (BM25 or a model)")
    p.add_argument("input", type=Path, help="training triples, .jsonl or .json")
    p.add_argument("output", type=Path, help=".jsonl: the input records, negatives replaced")
    p.add_argument("--negatives", type=int, required=True, help="negatives per record")
    p.add_argument("--method", choices=METHODS, default="bm25")
    p.add_argument("--model", default=None, help="converted or Hugging Face directory (--method model)")
    p.add_argument("--skip-top", type=int, default=0, metavar="N",
                   help="skip the candidates at 0-based ranks below N, the positive (and the query, if in the pool) "
                        "counted among the ranks (where false negatives hide; default 0)")
    p.add_argument("--depth", type=int, default=100, help="candidates ranked per query (default 100)")
    margin = p.add_mutually_exclusive_group()
    margin.add_argument("--margin", type=float,
                        help="keep candidates scoring below MARGIN x the positive's score (default 0.95)")
    margin.add_argument("--no-margin", dest="margin", action="store_const", const=None, help="no margin rule")
    p.add_argument("--max-length", type=int, default=None, help="truncate longer texts (--method model)")
    p.add_argument("--batch-size", type=int, default=64, help="encode batch size (--method model)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output (atomically)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_mine, margin=0.95)
    return p


def cmd_mine(args) -> int:
    settings = dict(negatives=args.negatives, method=args.method, skip_top=args.skip_top, depth=args.depth,
                    margin=args.margin, max_length=args.max_length, batch_size=args.batch_size)
    _check_args(**settings)  # before loading a model
    _check_paths(args.input, args.output, overwrite=args.overwrite)
    embedder = None
    if args.method == "model":
        if args.model is None:
            raise ConfigError("--method model needs --model PATH")
        import jaxembed

        embedder = jaxembed.load(args.model)
    elif args.model is not None:
        raise ConfigError("--model is used only with --method model")
    stats = mine_file(args.input, args.output, overwrite=args.overwrite, embedder=embedder,
                      show_progress=not args.quiet, **settings)
    print(json.dumps(stats))
    import sys

    if stats["blank_records"]:
        print(f"jaxembed mine: {stats['blank_records']} record(s) with a blank query or positive were written "
              "without negatives (the trainer drops them)", file=sys.stderr)
    if stats["fewer_than_requested"]:
        kind, numbers = (("lines", stats["fewer_than_requested_lines"]) if "fewer_than_requested_lines" in stats
                         else ("records", stats["fewer_than_requested_records"]))
        more = ", ..." if stats["fewer_than_requested"] > len(numbers) else ""
        print(f"jaxembed mine: {stats['fewer_than_requested']} record(s) got fewer than {args.negatives} negatives "
              f"({kind} {', '.join(map(str, numbers))}{more}, counted from 1); training with "
              f"negatives_per_query={args.negatives} drops them: lower --negatives, --skip-top or --margin, or add "
              "data", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------------------
# ranking


@functools.partial(jax.jit, static_argnames="k")
def _top_k_with_positive(scores, positive, k: int):
    """Each row's k best scores and pool indices, best first, ties to the lower index (lax.top_k's order), and
    each row's score for its positive, read from the same matrix so the margin compares like with like."""
    top_scores, top_index = jax.lax.top_k(scores, k)
    return top_scores, top_index, jnp.take_along_axis(scores, positive[:, None], axis=1)[:, 0]


@functools.partial(jax.jit, static_argnames="k")
def _cosine_top_k(queries, docs, positive, k: int):
    # HIGHEST: float32 products on accelerators too (TF32 would reorder near ties)
    return _top_k_with_positive(jnp.matmul(queries, docs.T, precision=jax.lax.Precision.HIGHEST), positive, k=k)


def _ranked(score_rows, positive: np.ndarray, pool_size: int, k: int, show_progress: bool):
    """(query row, top scores [k], top pool indices [k], positive's score) per query, scored in blocks of
    rows whose pool scores fit _BLOCK_ELEMENTS. score_rows(rows, positive, k): _top_k_with_positive's triple."""
    n = len(positive)
    block = max(1, min(_MAX_BLOCK_ROWS, _BLOCK_ELEMENTS // pool_size, n))
    for start in tqdm(range(0, n, block), desc="mining negatives", unit="block", disable=not show_progress):
        rows = np.minimum(np.arange(start, start + block), n - 1)  # the last block repeats its last row: one shape
        top_scores, top_index, positive_scores = map(np.asarray, score_rows(rows, positive[rows], k))
        for j in range(min(block, n - start)):
            yield start + j, top_scores[j], top_index[j], float(positive_scores[j])


def _bm25_scorer(queries: list[str], pool: list[str]):
    import logging

    import bm25s
    import scipy.sparse

    logging.getLogger("bm25s").setLevel(logging.WARNING)  # bm25s sets DEBUG, printed once absl configures logging

    pool_tokens = bm25s.tokenize(pool, stopwords="en", show_progress=False)
    if not pool_tokens.vocab:
        raise DataError("no positive has a BM25 term (every word a stopword or one character): use --method model")
    retriever = bm25s.BM25()  # k1 1.5, b 0.75, Lucene idf
    retriever.index(pool_tokens, show_progress=False)
    # bm25s's index: per (document, term) score, CSC over terms; the term-major view sums a query's terms
    index = retriever.scores
    n_terms = len(index["indptr"]) - 1
    term_doc = scipy.sparse.csr_matrix((index["data"], index["indices"], index["indptr"]),
                                       shape=(n_terms, index["num_docs"]))
    vocab = retriever.vocab_dict
    query_terms = [[vocab[t] for t in tokens if t in vocab]
                   for tokens in bm25s.tokenize(queries, stopwords="en", return_ids=False, show_progress=False)]

    def score_rows(rows, positive, k):
        terms = [query_terms[r] for r in rows]
        row_of_term = np.repeat(np.arange(len(rows)), [len(t) for t in terms])
        # a repeated query term counts once per occurrence, as in bm25s's get_scores (duplicates sum)
        counts = scipy.sparse.csr_matrix(
            (np.ones(len(row_of_term), np.float32), (row_of_term, np.concatenate(terms).astype(np.int64))),
            shape=(len(rows), n_terms))
        return _top_k_with_positive((counts @ term_doc).toarray(), positive, k=k)

    return score_rows


def _cosine_scorer(embedder, queries: list[str], instructions: list[str | None], pool: list[str], **encode):
    docs = jnp.asarray(embedder.encode_document(pool, normalize_embeddings=True, **encode))
    query_emb = np.empty((len(queries), docs.shape[1]), np.float32)
    by_instruction: dict[str | None, list[int]] = {}
    for i, instruction in enumerate(instructions):
        by_instruction.setdefault(instruction, []).append(i)
    for instruction, rows in by_instruction.items():
        query_emb[rows] = embedder.encode_query([queries[i] for i in rows], instruction=instruction,
                                                normalize_embeddings=True, **encode)
    return lambda rows, positive, k: _cosine_top_k(query_emb[rows], docs, positive, k=k)


# ---------------------------------------------------------------------------------------------------------
# checks and files



def _check_args(*, negatives, method, skip_top, depth, margin, max_length, batch_size) -> None:
    if method not in METHODS:
        raise ConfigError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    check_positive_int("negatives", negatives, error=ConfigError)
    check_positive_int("depth", depth, error=ConfigError)
    check_positive_int("batch_size", batch_size, error=ConfigError)
    check_positive_int("max_length", max_length, optional=True, error=ConfigError)
    if not isinstance(skip_top, numbers.Integral) or isinstance(skip_top, bool) or skip_top < 0:
        raise ConfigError(f"skip_top must be an int >= 0, got {skip_top!r}")
    if depth <= skip_top:
        raise ConfigError(f"depth ({depth}) must be larger than skip_top ({skip_top}): no candidate would be left")
    if depth < negatives:
        raise ConfigError(f"depth ({depth}) must be at least negatives ({negatives})")
    if margin is not None and (not isinstance(margin, numbers.Real) or isinstance(margin, bool)
                               or not 0 < margin <= 1):
        raise ConfigError(f"margin must be in (0, 1] or None, got {margin!r}")
    if method == "bm25" and max_length is not None:
        raise ConfigError("max_length applies to method 'model' only")


def _check_records(records) -> None:
    if not isinstance(records, (list, tuple)) or not records:
        raise DataError(f"records must be a non-empty list of dicts, got {records!r:.80}")
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise DataError(f"records[{i}]: expected a dict with query/positive, got {type(rec).__name__}")
        for field in ("query", "positive"):
            if not isinstance(rec.get(field), str):
                raise DataError(f"records[{i}]: field {field!r} must be a string, got {rec.get(field)!r:.80}")
        if rec.get("instruction") is not None and not isinstance(rec["instruction"], str):
            raise DataError(f"records[{i}]: field 'instruction' must be a string when given")


def _check_paths(in_path: Path, out_path: Path, *, overwrite: bool) -> None:
    """Refuse, before any work, an input mine cannot read or an output it should not write."""
    if in_path.suffix.lower() not in (".jsonl", ".json"):
        raise DataError(f"{in_path}: mine reads .jsonl or .json training triples, got {in_path.suffix or 'no suffix'}")
    if not in_path.is_file():
        raise DataError(f"{in_path}: no such file")
    if out_path.suffix != ".jsonl":
        raise DataError(f"{out_path}: the output must be a .jsonl file")
    parent = Path(os.path.realpath(out_path)).parent if out_path.is_symlink() else out_path.parent  # written through
    if not parent.is_dir():
        raise DataError(f"{out_path}: directory {parent} does not exist")
    if out_path.is_dir():
        raise DataError(f"{out_path} is a directory; the output is a .jsonl file")
    if out_path.resolve() == in_path.resolve() and not overwrite:
        raise DataError(f"{out_path} is the input file; pass --overwrite (overwrite=True) to replace it")
    if out_path.exists() and not overwrite:
        raise DataError(f"{out_path} exists; pass --overwrite (overwrite=True) to replace it")
