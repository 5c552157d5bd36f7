"""Compiled temporaries of `jaxembed.embed`, from `memory_analysis()`, per schedule and layer count.

The params are shapes only (`jax.ShapeDtypeStruct`), so nothing is allocated and a 64-layer 7B
program is measured on any machine in seconds: what a schedule holds besides the weights, before
it runs (issue #19: temporaries per in-flight token, no V that runs out of memory where
horizontal runs). For each family, layer count, batch x length and schedule it prints the
temporaries (GiB), per in-flight token (KB; b x t horizontally, b x V vertically), the weights,
and the layer states (one copy: the least a vertical schedule can hold).

    python benchmarks/program_memory.py [--families mamba2,rwkv7,xlstm] [--layers model]
        [--cases 1x128k,32x4k] [--vertical 256,512,1024,2048,4096] [--dtype bfloat16] [--kernels auto] [--target h100]

The numbers are the compiling backend's: on a GPU the Pallas kernels' program, on a CPU the XLA
path's (its intra-chunk matrices are materialised). `--target h100` (or h200) compiles the GPU
program on a machine without one (benchmarks/_cuda_target.py; needs `pip install "jax[cuda12]"`).
Use `--dtype float32` on a CPU's own program: XLA:CPU converts bf16 weights to float32 once,
outside the layer loop, and counts the copy as temporaries.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxembed import models  # noqa: E402
from jaxembed.bench import measure  # noqa: E402
from jaxembed.config import load_config  # noqa: E402
from jaxembed.schedule import embed  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from gpu_breakdown import CONFIGS  # noqa: E402  (the 7B configs, one list for both scripts)

GiB = 2.0**30


def param_specs(cfg, dtype: str, sharding=None):
    """The params as shapes in `dtype` (decays float32, as `Embedder` keeps them)."""
    family = models.family(cfg)
    shapes = jax.eval_shape(lambda: family.init_params(cfg, jax.random.key(0)))
    return jax.tree_util.tree_map_with_path(
        lambda path, a: jax.ShapeDtypeStruct(a.shape, models.param_dtype(family, str(path[-1].key), a.dtype, dtype),
                                             sharding=sharding),
        shapes)


def nbytes(tree) -> int:
    return sum(a.size * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def temp_bytes(cfg, params, batch: int, length: int, V: int | None, kernels: str, sharding=None) -> int:
    ids = jax.ShapeDtypeStruct((batch, length), jnp.int32, sharding=sharding)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=sharding)
    compiled = jax.jit(lambda p, i, n: embed(p, cfg, i, n, vertical_chunk_size=V, kernels=kernels)
                       ).lower(params, ids, lengths).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="mamba2,rwkv7,xlstm")
    ap.add_argument("--layers", default="model", help="layer counts, e.g. 2,64; 'model': the config's own")
    ap.add_argument("--cases", default="1x128k,32x4k", help="batch x length, comma-separated")
    ap.add_argument("--vertical", default="256,512,1024,2048,4096", help="vertical chunk sizes V (< length)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kernels", default="auto")
    ap.add_argument("--target", default=None, choices=["h100", "h200"],
                    help="compile for this GPU without one (deviceless; the Pallas kernels' program)")
    args = ap.parse_args(argv)
    sharding = None
    if args.target:
        import _cuda_target

        _cuda_target.setup()  # before the first backend: jax's platform is read then
        sharding = _cuda_target.sharding(args.target)
        args.kernels = "pallas"
    device = args.target or jax.devices()[0].device_kind
    print(f"device: {device}; jax {jax.__version__}; {args.dtype}; kernels {args.kernels}; "
          f"{time.strftime('%Y-%m-%d')}", flush=True)
    header = ["family", "layers", "b x t", "schedule", "temps GiB", "KB/token", "weights GiB", "states GiB",
              "compile s"]
    rows = []
    for family in args.families.split(","):
        full = load_config(CONFIGS[family])
        for item in args.layers.split(","):
            n_layers = full.n_layers if item == "model" else int(item)
            cfg = dataclasses.replace(full, n_layers=n_layers)
            params = param_specs(cfg, args.dtype, sharding)
            for case in args.cases.split(","):
                batch, length = (measure.parse_length(x) for x in case.lower().split("x"))
                states = nbytes(jax.eval_shape(functools.partial(models.family(cfg).init_state, cfg, batch))) * n_layers
                schedules = [None] + [v for v in measure.parse_int_list(args.vertical) if v < length]
                for V in schedules:
                    t0 = time.perf_counter()
                    try:
                        temps = temp_bytes(cfg, params, batch, length, V, args.kernels, sharding)
                    except Exception as err:  # one program that does not compile does not hide the others
                        print(f"{family} L={n_layers} {case} V={V}: {type(err).__name__}: {str(err)[:200]}")
                        continue
                    in_flight = batch * (V or length)
                    rows.append([family, n_layers, case, "horizontal" if V is None else f"V={V}",
                                 f"{temps / GiB:.2f}", f"{temps / in_flight / 1024:.1f}", f"{nbytes(params) / GiB:.2f}",
                                 "-" if V is None else f"{states / GiB:.2f}", f"{time.perf_counter() - t0:.1f}"])
                    print(measure.text_table(header, rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(measure.text_table(header, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
