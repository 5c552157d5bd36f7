"""A long-document use of contextual section embeddings: which function of which file answers a query?

    python benchmarks/section_retrieval.py --model runs/packages-xlstm-full-mined/model \
        --heldout data/packages/heldout.jsonl [--documents 120] [--min-sections 4 --max-sections 40]

Documents are the held-out source files of the packages corpus (`jaxembed corpus packages`), their
sections the file's documented functions in source order (the corpus positives, docstrings removed), the
queries the functions' docstring summaries. Three ways to embed, one table:
- independent: every section alone (`encode_document`);
- contextual: every section with the sections of its file before it, in one pass (`encode_sections`);
- whole document: one embedding per file (`encode_document` of the joined sections).
Section retrieval ranks all sections of all sampled files (nDCG@10, recall@10); file retrieval ranks the
files (recall@1, recall@10), a file scored by its best section for the first two ways.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

import jaxembed


def documents(heldout: Path, n: int, lo: int, hi: int, seed: int) -> list[list[dict]]:
    by_file: dict[str, list[dict]] = defaultdict(list)
    for line in heldout.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        path, lineno, _ = row["name"].rsplit(":", 2)
        by_file[path].append({**row, "line": int(lineno)})
    files = sorted(f for f, rows in by_file.items() if lo <= len(rows) <= hi)
    picked = sorted(np.random.default_rng(seed).choice(len(files), min(n, len(files)), replace=False))
    return [sorted(by_file[files[i]], key=lambda r: r["line"]) for i in picked]


def metrics(scores: np.ndarray, targets: np.ndarray, ks=(1, 10)) -> dict:
    target = scores[np.arange(len(targets)), targets]
    rank = (scores > target[:, None]).sum(axis=1)
    out = {f"recall@{k}": float((rank < k).mean()) for k in ks}
    out["ndcg@10"] = float(np.where(rank < 10, 1 / np.log2(rank + 2), 0).mean())
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--heldout", type=Path, default=Path("data/packages/heldout.jsonl"))
    parser.add_argument("--documents", type=int, default=120)
    parser.add_argument("--min-sections", type=int, default=4)
    parser.add_argument("--max-sections", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    model = jaxembed.load(args.model)
    docs = documents(args.heldout, args.documents, args.min_sections, args.max_sections, args.seed)
    sections = [r["positive"] for d in docs for r in d]
    doc_of = np.array([i for i, d in enumerate(docs) for _ in d])
    instruction = docs[0][0].get("instruction") or None
    queries = model.encode_query([r["query"] for d in docs for r in d], instruction=instruction,
                                 show_progress_bar=False)
    separate = model.encode_document(sections, show_progress_bar=False)
    contextual = np.concatenate([model.encode_sections([r["positive"] for r in d], show_progress_bar=False)
                                 for d in docs])
    whole = model.encode_document(["\n\n".join(r["positive"] for r in d) for d in docs], show_progress_bar=False)

    targets = np.arange(len(sections))
    rows = []
    for name, emb in (("independent sections", separate), ("contextual sections (encode_sections)", contextual)):
        s = queries @ emb.T
        per_doc = np.full((len(queries), len(docs)), -np.inf, np.float32)
        for j in range(len(docs)):
            per_doc[:, j] = s[:, doc_of == j].max(axis=1)
        rows.append((name, metrics(s, targets), metrics(per_doc, doc_of)))
    rows.append(("whole document", None, metrics(queries @ whole.T, doc_of)))

    print(f"{len(docs)} held-out files, {len(sections)} sections and queries ({args.model})\n")
    print("| embedding | section nDCG@10 | section recall@10 | file recall@1 | file recall@10 |")
    print("|---|---|---|---|---|")
    for name, sec, doc in rows:
        left = f"{sec['ndcg@10']:.3f} | {sec['recall@10']:.3f}" if sec else "- | -"
        print(f"| {name} | {left} | {doc['recall@1']:.3f} | {doc['recall@10']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
