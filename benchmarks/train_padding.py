"""Length groups in the training step: padded tokens, compiles and tokens/s for train.length_groups.

    python benchmarks/train_padding.py [--config configs/train/gpu-throughput-24l-768.yaml] [--batches 40]
        [--groups 1,2,4,8] [--speed-layers 2] [--speed-batch 32] [--steps 8] [--threads 2]

A batch's N = B (2 + k) texts are embedded in `length_groups` equal blocks of the texts sorted by
length, each padded to its own bucket (jaxembed/train/step.py). With one group, every text is
padded to the batch's longest. Two parts, on the config's own corpus and tokenizer:

1. padding, on the host: over the first `--batches` batches of the run's plan, the tokens the
   step computes (padding included) per real token, and the distinct length plans (one
   compilation each), for each group count. On a GPU where the step is compute-bound, tokens/s
   scales with real / computed.
2. speed, on this machine: the trainer itself on the same data, with the config's model cut to
   `--speed-layers` layers and `--speed-batch` queries, `--steps` steps per group count;
   tokens/s from its own metrics after the first window (which holds the compilation).

Prints markdown tables for docs/benchmarks.md.
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
    parser.add_argument("--config", type=Path, default=REPO / "configs/train/gpu-throughput-24l-768.yaml")
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--groups", default="1,2,4,8")
    parser.add_argument("--speed-layers", type=int, default=2)
    parser.add_argument("--speed-batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    pinned = pin_threads(args.threads)

    import jax
    import numpy as np
    import yaml

    from jaxembed.train.config import CheckpointSection, EvalSection, load_train_config
    from jaxembed.train.trainer import Trainer

    groups = [int(g) for g in args.groups.split(",")]
    with tempfile.TemporaryDirectory(prefix="jaxembed-padding-") as tmp:
        tmp = Path(tmp)
        base = load_train_config(args.config)
        model = yaml.safe_load((REPO / base.model.init).read_text() if not Path(base.model.init).is_absolute()
                               else Path(base.model.init).read_text())
        small = tmp / "model.yaml"
        small.write_text(yaml.safe_dump({**model, "n_layers": args.speed_layers}))

        def trainer(length_groups: int, batch_size: int, steps: int) -> Trainer:
            cfg = dataclasses.replace(
                base, model=dataclasses.replace(base.model, init=str(small)),
                data=dataclasses.replace(base.data, heldout=None, token_cache=str(tmp / "tokens")),
                train=dataclasses.replace(base.train, batch_size=batch_size, max_steps=steps,
                                          length_groups=length_groups, log_every=1),
                eval=EvalSection(), checkpoint=CheckpointSection(directory=str(tmp / f"ckpt-{length_groups}"),
                                                                 every=10**9, keep=1),
                output=None, log=str(tmp / f"metrics-{length_groups}.jsonl"), tensorboard=None)
            return Trainer(cfg, show_progress=False)

        # 1. padding over the run's own batches
        padding = []
        for g in groups:
            t = trainer(g, base.train.batch_size, args.batches)
            batches = [t.batch(step) for step in range(min(args.batches, t.total_steps))]
            real = sum(b.tokens for b in batches)
            computed = sum(b.padded_tokens for b in batches)
            plans = sorted({b.plan for b in batches}, key=lambda p: -sum(b.plan == p for b in batches))
            padding.append((g, t.length_groups, real / len(batches), computed / real, plans))
            chunk = t.chunk_size

        # 2. the trainer's own tokens/s on this machine
        speed = []
        for g in groups:
            t = trainer(g, args.speed_batch, args.steps)
            rows = [r for r in t.run() if "loss" in r]
            later = [r for r in rows if r["step"] > 1]
            tps = float(np.median([r["tokens_per_s"] for r in later]))
            speed.append((g, tps, float(np.mean([r["padded_tokens"] / r["tokens"] for r in later])),
                          len(t._step_fns)))

    name = args.config.name
    print(f"# length groups ({name}; {time.strftime('%Y-%m-%d')}; {cpu_model()}, "
          f"{pinned.get('threads', args.threads)} threads, jax {jax.__version__})\n")
    print(f"## Padding: the first {args.batches} batches of batch size {base.train.batch_size}, "
          f"max_tokens {base.data.max_tokens}, Q {chunk}\n")
    print("| length_groups (used) | real tokens / batch | computed / real | real / computed, vs 1 group "
          "| plans (compiles) | most common plan |")
    print("|---|---|---|---|---|---|")
    first = padding[0][3]
    for g, used, real, ratio, plans in padding:
        print(f"| {g} ({used}) | {real:,.0f} | {ratio:.2f} | {first / ratio:.2f}x | {len(plans)} | "
              f"{', '.join(map(str, plans[0]))} |")
    print(f"\n## Speed on this machine: {args.speed_layers} layers of the config's model, batch "
          f"{args.speed_batch}, {args.steps} steps (median of the steps after the first)\n")
    print("| length_groups | tokens/s (real) | vs 1 group | computed / real | plans compiled |")
    print("|---|---|---|---|---|")
    for g, tps, ratio, compiled in speed:
        print(f"| {g} | {tps:,.0f} | {tps / speed[0][1]:.2f}x | {ratio:.2f} | {compiled} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
