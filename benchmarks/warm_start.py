"""Warm starts (issue #22): how much of a fresh process's wall time is compilation, first with an empty
persistent compilation cache and then with the one the first process wrote.

    python benchmarks/warm_start.py [--config configs/models/bench-memory-4l-256.yaml] [--texts 600]
        [--threads 2] [--how api,cli]

The parent saves a random model of the config as a converted checkpoint and writes the texts (the
functions of this machine's stdlib corpus) to a jsonl corpus. Each measured run is then a fresh process
doing what a user does, from `python` to exit:

- api: `jaxembed.load(MODEL).encode_document(texts, batch_size=32, max_length=...)`;
- cli: `jaxembed embed --model MODEL --corpus texts.jsonl --output-dir OUT` (the same batch and length).

Each way gets its own new cache directory (JAXEMBED_COMPILATION_CACHE), used by two processes one after
the other. The compile time is the sum of JAX's own compile events over the whole process
(`jax.monitoring`: tracing, lowering to MLIR, backend compilation or its cache retrieval), and the wall
time is the parent's clock around the child process, interpreter start and imports included.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, cpu_model, pin_threads

EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace", "/jax/core/compile/jaxpr_to_mlir_module_duration":
          "lower", "/jax/core/compile/backend_compile_duration": "backend"}
BATCH_SIZE = 32
MODULES = ["argparse", "json", "email", "csv", "textwrap", "difflib", "shutil", "calendar", "string", "fractions",
           "statistics", "heapq"]


def child(how: str, max_length: int, model: Path, corpus: Path, out_dir: Path, report: Path) -> None:
    """One measured process: listen to JAX's compile events from before anything compiles, then embed."""
    import jax.monitoring

    seconds = dict.fromkeys(EVENTS.values(), 0.0)
    hits, programs = [], []

    def on_duration(event, duration, **_):
        if event in EVENTS:
            seconds[EVENTS[event]] += duration
            programs.append(event)

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(
        lambda event, **_: hits.append(1) if event == "/jax/compilation_cache/cache_hits" else None)
    if how == "api":
        import jaxembed

        texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
        embedder = jaxembed.load(model)
        tick = time.perf_counter()
        embedder.encode_document(texts, batch_size=BATCH_SIZE, max_length=max_length, show_progress_bar=False)
        encode_s, tokens = time.perf_counter() - tick, embedder.last_stats["tokens"]
    else:
        from jaxembed.cli import main

        tick = time.perf_counter()
        code = main(["embed", "--model", str(model), "--corpus", str(corpus), "--output-dir", str(out_dir),
                     "--batch-size", str(BATCH_SIZE), "--max-length", str(max_length), "--quiet"])
        if code:
            raise SystemExit(code)
        encode_s, tokens = time.perf_counter() - tick, None
    report.write_text(json.dumps({**seconds, "compile_s": sum(seconds.values()), "cache_hits": len(hits),
                                  "programs": programs.count("/jax/core/compile/backend_compile_duration"),
                                  "encode_s": encode_s, "tokens": tokens}))


def prepare(config: Path, n_texts: int, root: Path) -> tuple[Path, Path, int]:
    """A converted random model of `config` and a jsonl corpus of stdlib functions under root."""
    import jax

    from jaxembed import checkpoint, models
    from jaxembed.config import load_config
    from jaxembed.testing import make_tokenizer
    from jaxembed.train.corpus import collect_functions

    cfg = load_config(config)
    model = checkpoint.save(root / "model", cfg, models.family(cfg).init_params(cfg, jax.random.key(0)),
                            tokenizer=make_tokenizer(min(4096, cfg.vocab_size)))
    records, _ = collect_functions(modules=MODULES, workers=1)
    texts = [r["positive"] for r in records][:n_texts]
    corpus = root / "texts.jsonl"
    corpus.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
    return model, corpus, len(texts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs/models/bench-memory-4l-256.yaml")
    parser.add_argument("--texts", type=int, default=600)
    parser.add_argument("--max-length", type=int, default=512, help="cut longer texts (EOS included)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--how", default="api,cli", help="comma-separated: api, cli")
    parser.add_argument("--child", nargs=6, metavar=("HOW", "MAX_LENGTH", "MODEL", "CORPUS", "OUT", "REPORT"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    pinned = pin_threads(args.threads)
    if args.child:
        how, max_length, *paths = args.child
        child(how, int(max_length), *map(Path, paths))
        return 0
    ways = [w.strip() for w in args.how.split(",") if w.strip()]
    if not ways or set(ways) - {"api", "cli"}:
        parser.error(f"--how: a comma-separated list of api and cli, got {args.how!r}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="jaxembed-warm-start-") as tmp:
        root = Path(tmp)
        model, corpus, n_texts = prepare(args.config, args.texts, root)
        for how in ways:
            cache = root / f"cache-{how}"
            env = {**os.environ, "JAXEMBED_COMPILATION_CACHE": str(cache)}
            env.pop("JAX_COMPILATION_CACHE_DIR", None)
            for k, name in enumerate(("first (empty cache)", "second (cache from the first)")):
                report = root / f"{how}-{k}.json"
                tick = time.perf_counter()
                subprocess.run([sys.executable, __file__, "--threads", str(args.threads), "--child", how,
                                str(args.max_length), str(model), str(corpus), str(root / f"out-{how}-{k}"),
                                str(report)], env=env, check=True)
                wall = time.perf_counter() - tick
                rows.append((how, name, wall, json.loads(report.read_text())))
    import jax

    tokens = next((r["tokens"] for *_, r in rows if r["tokens"]), None)
    print(f"# warm start ({args.config.name}, {n_texts} texts{f', {tokens:,} tokens' if tokens else ''}, batch "
          f"{BATCH_SIZE}, max_length {args.max_length}, {pinned['threads']} threads, {cpu_model()}, "
          f"jax {jax.__version__})\n")
    print("| way | fresh process | process wall (s) | of which encode (s) | compiling (s): trace + lower + backend "
          "| compile share of wall | programs | cache hits |")
    print("|---|---|---|---|---|---|---|---|")
    for how, name, wall, r in rows:
        print(f"| {how} | {name} | {wall:.2f} | {r['encode_s']:.2f} | {r['compile_s']:.2f}: {r['trace']:.2f} + "
              f"{r['lower']:.2f} + {r['backend']:.2f} | **{r['compile_s'] / wall:.1%}** | {r['programs']} | "
              f"{r['cache_hits']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
