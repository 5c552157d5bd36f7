"""Retrieval quality of trained models beside BM25, on one held-out query set.

    python benchmarks/train_quality.py sample data/packages/heldout.jsonl 2000
        # -> data/packages/heldout-2000.jsonl: a seeded random sample of the held-out rows
    python benchmarks/train_quality.py table data/packages/heldout-2000.jsonl NAME=RUN_DIR [NAME=RUN_DIR ...]
    python benchmarks/train_quality.py score data/packages/heldout-2000.jsonl MODEL_DIR --max-length 128

`table` prints one markdown row per method, nDCG@10 / recall@10 / MRR@10, every method ranking the same
queries against the same documents (the sample's positives):
- BM25 (`bm25s`, its English stopwords and default Lucene scoring) over the raw texts;
- "untrained": the first run's step-0 evaluation (the random model before its first step);
- each run: the last evaluation row of RUN_DIR/metrics.jsonl (the trainer's `retrieval_metrics`).
A run's evaluation must have been made on this sample (its `queries`/`docs` counts are checked).

`score` re-measures an exported model without its run's log: `jaxembed.load`, `encode_query` (with each row's
own `instruction`; a training config's per-source defaults are not applied) and `encode_document`, ranked by
cosine with ties counted against the positive, as the trainer does.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def sample(path: Path, n: int, seed: int = 0) -> Path:
    from jaxembed.files import write_text_atomically

    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if n >= len(lines):
        raise SystemExit(f"{path} has {len(lines)} rows; ask for fewer than that")
    picked = sorted(np.random.default_rng(seed).choice(len(lines), n, replace=False))
    out = path.with_name(f"{path.stem}-{n}{path.suffix}")
    write_text_atomically(out, "".join(lines[i] + "\n" for i in picked))
    return out


def documents_and_targets(rows: list[dict]) -> tuple[list[str], np.ndarray]:
    """The sample's distinct positives (sorted), and each query's positive as an index into them."""
    docs = sorted({r["positive"] for r in rows})
    index = {d: i for i, d in enumerate(docs)}
    return docs, np.array([index[r["positive"]] for r in rows])


def bm25_metrics(rows: list[dict], k: int = 10) -> dict:
    import bm25s

    from jaxembed.train.trainer import retrieval_metrics

    docs, targets = documents_and_targets(rows)
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize(docs, stopwords="en", show_progress=False), show_progress=False)
    scores = np.zeros((len(rows), len(docs)), np.float32)
    for i, query in enumerate(bm25s.tokenize([r["query"] for r in rows], stopwords="en", show_progress=False,
                                             return_ids=False)):
        scores[i] = retriever.get_scores(query)
    return retrieval_metrics(scores, targets, k)


def run_evals(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if any(key.startswith("eval/") for key in r)]


def table(heldout: Path, runs: list[tuple[str, Path]], k: int = 10) -> str:
    rows = [json.loads(line) for line in heldout.read_text(encoding="utf-8").splitlines() if line.strip()]
    docs = len({r["positive"] for r in rows})
    results = [("BM25 (bm25s)", bm25_metrics(rows, k), "-")]
    for i, (name, run) in enumerate(runs):
        evals = run_evals(run)
        if not evals:
            raise SystemExit(f"{run}/metrics.jsonl has no evaluation rows")
        for row in (evals[0], evals[-1]):
            if (row["eval/queries"], row["eval/docs"]) != (len(rows), docs):
                raise SystemExit(f"{run}: evaluated on {row['eval/queries']} queries / {row['eval/docs']} docs, "
                                 f"{heldout} has {len(rows)} / {docs}")
        if i == 0:
            results.append(("untrained (random init)", {key[5:]: v for key, v in evals[0].items() if "/" in key}, 0))
        results.append((name, {key[5:]: v for key, v in evals[-1].items() if "/" in key}, evals[-1]["step"]))
    lines = [f"{len(rows)} held-out queries, each ranked against all {docs} held-out documents\n",
             f"| method | steps | nDCG@{k} | recall@{k} | MRR@{k} |", "|---|---|---|---|---|"]
    for name, m, steps in results:
        lines.append(f"| {name} | {steps} | {m[f'ndcg@{k}']:.3f} | {m[f'recall@{k}']:.3f} | {m[f'mrr@{k}']:.3f} |")
    return "\n".join(lines)


def score(heldout: Path, model_dir: Path, max_length: int | None, k: int = 10) -> dict:
    import warnings

    import jaxembed
    from jaxembed.train.trainer import retrieval_metrics

    rows = [json.loads(line) for line in heldout.read_text(encoding="utf-8").splitlines() if line.strip()]
    docs, targets = documents_and_targets(rows)
    model = jaxembed.load(model_dir)
    with warnings.catch_warnings():  # cutting to max_length is asked for here, as in training
        warnings.simplefilter("ignore", UserWarning)
        order, parts = [], []
        for instruction in {r.get("instruction") or None for r in rows}:  # one batched encode per instruction
            picked = [i for i, r in enumerate(rows) if (r.get("instruction") or None) == instruction]
            order += picked
            parts.append(model.encode_query([rows[i]["query"] for i in picked], instruction=instruction,
                                            max_length=max_length, batch_size=128))
        queries = np.concatenate(parts)[np.argsort(order)]  # back to the rows' order
        documents = model.encode_document(docs, max_length=max_length, batch_size=128)
    return retrieval_metrics(queries @ documents.T, targets, k)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("sample")
    p.add_argument("heldout", type=Path)
    p.add_argument("n", type=int)
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("table")
    p.add_argument("heldout", type=Path)
    p.add_argument("runs", nargs="+", help="NAME=RUN_DIR (the directory holding metrics.jsonl)")
    p = sub.add_parser("score")
    p.add_argument("heldout", type=Path)
    p.add_argument("model", type=Path, help="a directory jaxembed.load reads (a run's exported model)")
    p.add_argument("--max-length", type=int, default=None, help="cut texts to this many tokens (data.max_tokens)")
    args = parser.parse_args(argv)
    if args.command == "sample":
        print(sample(args.heldout, args.n, args.seed))
    elif args.command == "score":
        print(json.dumps(score(args.heldout, args.model, args.max_length)))
    else:
        runs = [(spec.split("=", 1)[0], Path(spec.split("=", 1)[1])) for spec in args.runs]
        print(table(args.heldout, runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
