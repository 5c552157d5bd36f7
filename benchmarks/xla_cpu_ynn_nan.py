"""How often XLA:CPU's YNN fusions make a Mamba2 batch of single-chunk inputs NaN (jaxembed/xla_cpu.py).

Each trial is a fresh process: the scaled Codestral Mamba 7B config (configs/models/), one layer,
the family's random init (key 0), a batch of B inputs of T tokens each (T <= Q: one SSD chunk),
embedded by jit-compiled `jaxembed.embed`. The same trials run with the YNN fusions on
(JAXEMBED_KEEP_XLA_CPU_YNN=1: XLA's default) and off (jaxembed's default). The table counts the
processes whose output has a non-finite row and the number of such rows.

`--speed` adds what turning the fusions off costs: each scaled 7B config of the model
comparison (all layers) at batch 1 x 4096 and batch 16 x 512, min of 3 timed calls after the
compiling one, in a fresh process per setting.

    python benchmarks/xla_cpu_ynn_nan.py --trials 12 --batch 16 --length 256 --speed
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = """
import dataclasses, json, sys
import jax, jaxlib, numpy as np
import jaxembed
from jaxembed import models
from jaxembed.bench import measure
from jaxembed.config import load_config
cfg = load_config(sys.argv[1])
cfg = dataclasses.replace(cfg, n_layers=1) if sys.argv[4] == "one-layer" else cfg
params = models.family(cfg).init_params(cfg, jax.random.key(0))
b, t = int(sys.argv[2]), int(sys.argv[3])
ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (b, t), dtype=np.int32)
f = jax.jit(lambda p, i, n: jaxembed.embed(p, cfg, i, n, normalize=False))
call = lambda: np.asarray(f(params, ids, np.full(b, t, np.int32)))
out = call()
min_s = measure.time_run(call, repeats=3).min_s if sys.argv[4] == "timed" else None
print(json.dumps({"bad_rows": int((~np.isfinite(out).all(-1)).sum()), "min_s": min_s,
                  "jaxlib": jaxlib.__version__}))
"""


def trial(config: Path, batch: int, length: int, keep_ynn: bool, mode: str = "one-layer") -> dict:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["JAXEMBED_KEEP_XLA_CPU_YNN"] = "1" if keep_ynn else "0"
    proc = subprocess.run([sys.executable, "-c", WORKER, str(config), str(batch), str(length), mode], env=env,
                          capture_output=True, text=True, cwd=ROOT, check=False)
    if proc.returncode:
        raise RuntimeError(f"trial failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "configs/models/scaled-codestral-mamba-7b.yaml")
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--speed", action="store_true", help="also time the scaled 7B configs with the fusions on and off")
    args = ap.parse_args()
    rows = []
    for keep_ynn in (True, False):
        results = [trial(args.config, args.batch, args.length, keep_ynn) for _ in range(args.trials)]
        bad = [r["bad_rows"] for r in results]
        rows.append(("on (XLA's default)" if keep_ynn else "off (jaxembed's default)",
                     sum(b > 0 for b in bad), " ".join(map(str, bad)), results[0]["jaxlib"]))
    print(f"batch {args.batch} x {args.length} tokens, {args.config.name} (1 layer), "
          f"{args.trials} fresh processes each\n")
    print("| YNN fusions | processes with NaN rows | NaN rows per process | jaxlib |")
    print("|---|---|---|---|")
    for label, n_bad, per_process, jaxlib_version in rows:
        print(f"| {label} | {n_bad} of {args.trials} | {per_process} | {jaxlib_version} |")
    if args.speed:
        speed_table()


def speed_table() -> None:
    print("\n| config | batch x tokens | YNN on: s | YNN off: s | off / on |")
    print("|---|---|---|---|---|")
    for name in ("codestral-mamba-7b", "rwkv7-g0-7.2b", "xlstm-7b", "mistral-7b-v0.1", "mistral-7b-v0.3"):
        config = ROOT / f"configs/models/scaled-{name}.yaml"
        for batch, length in ((1, 4096), (16, 512)):
            on, off = (trial(config, batch, length, keep, mode="timed")["min_s"] for keep in (True, False))
            print(f"| scaled {name} | {batch} x {length} | {on:.3f} | {off:.3f} | {off / on:.2f} |")


if __name__ == "__main__":
    main()
