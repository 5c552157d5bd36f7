"""LongEmbed-style evaluation memory: peak RSS of `mteb.evaluate` through `MtebEncoder` versus
document length, with vertical chunking ("auto": V = 2Q for batches) and without (horizontal).

Each (mode, length) point is a fresh process (this script with --worker) that builds a random
4-layer d_model 256 Mamba2 (configs/models/bench-memory-4l-256.yaml), a local retrieval task of 4
queries and 4 documents of `length` tokens each (real standard-library source, no hub), runs it
through mteb with max_length 32768 (nothing cut), and reports its peak RSS (ru_maxrss) and the
nDCG@10. Vertical memory should stay flat in the length; horizontal grows with it.

    .venv/bin/python benchmarks/eval_long_memory.py                       # 2k, 8k, 32k
    .venv/bin/python benchmarks/eval_long_memory.py --lengths 4096,32768
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

MARK = "@@EVAL_LONG_MEMORY@@"


def _documents(tokenizer, n: int, length: int) -> list[str]:
    """n texts of exactly `length - 1` tokens (EOS makes `length`), cut from consecutive stdlib files."""
    import sysconfig

    ids = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        ids += tokenizer(path.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)["input_ids"]
        if len(ids) >= n * length:
            break
    return [tokenizer.decode(ids[i * length : i * length + length - 1]) for i in range(n)]


def worker(mode: str, length: int) -> dict:
    os.environ["HF_HUB_OFFLINE"] = "1"
    import jax
    import mteb

    from jaxembed import models
    from jaxembed.embedder import Embedder
    from jaxembed.eval.encoder import MtebEncoder
    from jaxembed.eval.local_tasks import long_document_task
    from jaxembed.testing import make_tokenizer

    cfg = common.load_config(common.CONFIGS / "bench-memory-4l-256.yaml")
    tokenizer = make_tokenizer(512)
    docs = _documents(tokenizer, 4, length)
    queries = [d[:200] for d in docs]  # each query is its document's opening
    embedder = Embedder(models.family(cfg).init_params(cfg, jax.random.key(0)), cfg, tokenizer=tokenizer)
    encoder = MtebEncoder(embedder, name="bench/mamba2-4l-256", max_length=32768,
                          vertical_chunk_size="auto" if mode == "vertical" else None)
    before = common.peak_rss_mib()
    result = mteb.evaluate(encoder, [long_document_task(queries, docs)], cache=None, show_progress_bar=False)
    doc_tokens = max(len(x) for x in embedder.tokenize(docs))
    return {"mode": mode, "length": length, "doc_tokens": doc_tokens, "peak_rss_mib": common.peak_rss_mib(),
            "before_eval_rss_mib": before, "ndcg_at_10": result.task_results[0].get_score(),
            "truncated": encoder.truncated()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="2048,8192,32768")
    parser.add_argument("--modes", default="vertical,horizontal")
    parser.add_argument("--worker", nargs=2, metavar=("MODE", "LENGTH"))
    args = parser.parse_args()
    if args.worker:
        print(MARK + json.dumps(worker(args.worker[0], int(args.worker[1]))))
        return
    rows = []
    for mode in args.modes.split(","):
        for length in map(int, args.lengths.split(",")):
            out = subprocess.run([sys.executable, __file__, "--worker", mode, str(length)], capture_output=True,
                                 text=True)
            line = next((x for x in out.stdout.splitlines() if x.startswith(MARK)), None)
            if line is None:
                print(f"{mode} {length}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
                continue
            rows.append(json.loads(line[len(MARK):]))
            r = rows[-1]
            print(f"{mode:10s} {length:6d} tokens  peak RSS {r['peak_rss_mib']:8.0f} MiB  "
                  f"nDCG@10 {r['ndcg_at_10']:.3f}", file=sys.stderr)
    print(f"\n{common.cpu_model()}, mteb.evaluate via MtebEncoder, 4 queries + 4 documents per point\n")
    print("| mode | doc tokens | peak RSS (MiB) | / shortest | truncated |")
    print("|---|---|---|---|---|")
    for mode in args.modes.split(","):
        sub = [r for r in rows if r["mode"] == mode]
        for r in sub:
            print(f"| {mode} | {r['doc_tokens']} | {r['peak_rss_mib']:.0f} "
                  f"| {r['peak_rss_mib'] / sub[0]['peak_rss_mib']:.3f} | {r['truncated']} |")


if __name__ == "__main__":
    main()
