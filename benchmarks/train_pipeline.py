"""Is the training input pipeline ever the bottleneck? The pipeline alone against the step it feeds.

    python benchmarks/train_pipeline.py [--config configs/train/stdlib-tiny.yaml] [--steps 30] [--threads 2]

Runs in one process, on the demo config's data (build it first: `jaxembed corpus stdlib data/stdlib`):

1. tokenization, once: the first `Trainer` (cold token cache: `datasets.map`) and a second one (cache hit);
2. the pipeline alone: `Trainer.batch(step)` + the device put for `--steps` steps, in tokens/s, beside the
   per-step tokenization the trainer did before (the same batches' texts through the tokenizer);
3. the demo's training steps (`Trainer.run`, `--steps` steps, no evaluation): tokens/s and input-wait
   share from the trainer's own metrics rows.

Prints a markdown table with the ratio pipeline / step (the acceptance asks for >= 10x, wait <= 5%).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, cpu_model, pin_threads


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs/train/stdlib-tiny.yaml")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    pinned = pin_threads(args.threads)

    import jax
    import numpy as np

    from jaxembed.text import tokenize_texts
    from jaxembed.train.config import CheckpointSection, EvalSection, load_train_config
    from jaxembed.train.trainer import Trainer

    with tempfile.TemporaryDirectory(prefix="jaxembed-pipeline-") as tmp:
        cfg = load_train_config(args.config)
        cfg = dataclasses.replace(
            cfg, data=dataclasses.replace(cfg.data, heldout=None, token_cache=str(Path(tmp) / "tokens")),
            train=dataclasses.replace(cfg.train, max_steps=args.steps), eval=EvalSection(),
            checkpoint=CheckpointSection(directory=str(Path(tmp) / "checkpoints"), every=10**9, keep=1),
            output=None, log=str(Path(tmp) / "metrics.jsonl"), tensorboard=None)
        tick = time.perf_counter()
        Trainer(cfg, show_progress=False)
        cold = time.perf_counter() - tick
        tick = time.perf_counter()
        trainer = Trainer(cfg, show_progress=False)
        warm = time.perf_counter() - tick
        rows = sum(trainer.sizes.values())

        # the pipeline alone: what the input thread does per step
        tick, tokens = time.perf_counter(), 0
        for step in range(args.steps):
            batch = trainer.batch(step)
            jax.block_until_ready(trainer._device_batch(batch))
            tokens += batch.tokens
        pipeline_tps = tokens / (time.perf_counter() - tick)

        # what each step cost before: the batch's texts through the tokenizer, then padding
        tick, tokens = time.perf_counter(), 0
        for step in range(args.steps):
            source, index = trainer._plan(step // trainer.steps_per_epoch)[step % trainer.steps_per_epoch]
            records = trainer.sources[source][index.tolist()]
            texts = ([trainer.query_text({"instruction": i, "query": q}, source)
                      for q, i in zip(records["query"], records["instruction"], strict=True)]
                     + records["positive"] + [n for negs in records["negatives"] for n in negs])
            ids, _ = tokenize_texts(trainer.tokenizer, texts, trainer.eos, cfg.data.max_tokens)
            padded = np.zeros((len(ids), max(map(len, ids))), np.int32)
            for row, x in zip(padded, ids, strict=True):
                row[: len(x)] = x
            tokens += sum(map(len, ids))
        per_step_tps = tokens / (time.perf_counter() - tick)

        # the demo's steps, from the trainer's own metrics (the first window holds the compilation)
        log = trainer.run()
        steps = [r for r in log if "loss" in r]
        windows = {}
        for r in steps:
            windows.setdefault((r["tokens_per_s"], r["input_wait_share"]), []).append(r["step"])
        later = [w for w, s in windows.items() if s[0] > 1] or list(windows)
        step_tps = float(np.mean([w[0] for w in later]))
        wait = float(np.mean([w[1] for w in later]))

    print(f"# training input pipeline vs the demo step ({args.config.name}, {args.steps} steps, "
          f"{pinned.get('threads', args.threads)} threads, {cpu_model()}, jax {jax.__version__}, "
          f"{jax.devices()[0].platform})\n")
    print(f"tokenization of {rows} rows: {cold:.1f} s cold (datasets.map, Trainer init included), "
          f"{warm:.1f} s with the token cache\n")
    print("| what | tokens/s | / demo step |")
    print("|---|---|---|")
    print(f"| pipeline alone (gather + pad + device put) | {pipeline_tps:,.0f} | {pipeline_tps / step_tps:.1f}x |")
    print(f"| per-step tokenization (before) | {per_step_tps:,.0f} | {per_step_tps / step_tps:.1f}x |")
    print(f"| demo training step (trainer metrics, after the first window) | {step_tps:,.0f} | 1.0x |")
    print(f"\ninput-wait share of the demo's step time: {wait:.2%} (windows after the first)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
