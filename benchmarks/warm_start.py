"""Warm starts (issue #22): how much of a fresh process's `encode` is compilation, first with an empty
persistent compilation cache and then with the one the first process wrote.

    python benchmarks/warm_start.py [--config configs/models/bench-memory-4l-256.yaml] [--texts 600]
        [--threads 2]

Each run is a fresh process with JAXEMBED_COMPILATION_CACHE pointing at one new temporary directory. It
embeds the same texts (the functions of this machine's stdlib corpus, up to 512 tokens, batch 32) and
sums JAX's own compile events (`jax.monitoring`: tracing, lowering to MLIR, backend compilation or its
cache retrieval), so the compile share is what JAX measured, not a difference of wall times.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, cpu_model, pin_threads

EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
          "/jax/core/compile/backend_compile_duration")


def run(config: Path, n_texts: int) -> dict:
    import time

    start = time.perf_counter()
    import jax
    import jax.monitoring

    compile_s = {e: 0.0 for e in EVENTS}
    hits = []

    def on_duration(event, seconds, **_):
        if event in compile_s:
            compile_s[event] += seconds

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(
        lambda event, **_: hits.append(1) if event == "/jax/compilation_cache/cache_hits" else None)

    from jaxembed import models
    from jaxembed.config import load_config
    from jaxembed.embedder import Embedder
    from jaxembed.testing import make_tokenizer
    from jaxembed.train.corpus import collect_functions

    cfg = load_config(config)
    records, _ = collect_functions(modules=["argparse", "json", "email", "csv", "textwrap", "difflib", "shutil",
                                            "calendar", "string", "fractions", "statistics", "heapq"], workers=1)
    texts = [r["positive"] for r in records][:n_texts]
    model = Embedder(models.family(cfg).init_params(cfg, jax.random.key(0)), cfg,
                     tokenizer=make_tokenizer(min(4096, cfg.vocab_size)))
    setup = time.perf_counter() - start
    tick = time.perf_counter()
    model.encode(texts, batch_size=32, max_length=512, show_progress_bar=False)
    encode_s = time.perf_counter() - tick
    return {"texts": len(texts), "tokens": model.last_stats["tokens"], "batches": model.last_stats["batches"],
            "setup_s": setup, "encode_s": encode_s, "compile_s": sum(compile_s.values()), "cache_hits": len(hits),
            "trace_s": compile_s[EVENTS[0]], "lower_s": compile_s[EVENTS[1]], "backend_s": compile_s[EVENTS[2]]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs/models/bench-memory-4l-256.yaml")
    parser.add_argument("--texts", type=int, default=600)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--point", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    pinned = pin_threads(args.threads)
    if args.point:
        print(json.dumps(run(args.config, args.texts)))
        return 0
    with tempfile.TemporaryDirectory(prefix="jaxembed-xla-cache-") as cache:
        env = {**os.environ, "JAXEMBED_COMPILATION_CACHE": cache}
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        runs = []
        for _ in range(2):
            out = subprocess.run([sys.executable, __file__, "--point", "--config", str(args.config), "--texts",
                                  str(args.texts), "--threads", str(args.threads)], env=env, capture_output=True,
                                 text=True, check=True)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        cache_mib = sum(f.stat().st_size for f in Path(cache).rglob("*") if f.is_file()) / 2**20
    import jax

    r = runs[0]
    print(f"# warm start ({args.config.name}, {r['texts']} texts, {r['tokens']:,} tokens, {r['batches']} batches, "
          f"{pinned['threads']} threads, {cpu_model()}, jax {jax.__version__})\n")
    print("| fresh process | encode wall (s) | compiling (s): trace + lower + backend | compile share | cache hits |")
    print("|---|---|---|---|---|")
    for name, r in zip(("first (empty cache)", "second (cache from the first)"), runs, strict=True):
        print(f"| {name} | {r['encode_s']:.2f} | {r['compile_s']:.2f}: {r['trace_s']:.2f} + {r['lower_s']:.2f} + "
              f"{r['backend_s']:.2f} | **{r['compile_s'] / r['encode_s']:.1%}** | {r['cache_hits']} |")
    print(f"\ncache written by the first process: {cache_mib:.1f} MiB; process setup (imports, weights, tokenizer) "
          f"{runs[0]['setup_s']:.1f} s and {runs[1]['setup_s']:.1f} s, not counted above")
    return 0


if __name__ == "__main__":
    sys.exit(main())
