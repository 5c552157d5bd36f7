"""The GPU program of `jaxembed.embed`, compiled here without a GPU: memory and HBM traffic by kind.

Issue #19 asks for the glue around each layer's two projections and its recurrent kernel to
cost at most 10% more than those, and for temporaries of at most 48 KB per in-flight token. Both
are decided by the compiled GPU program: which ops XLA fuses, what it writes to HBM between
kernels, and what it keeps alive. This script compiles `embed` for an H100 or H200 through XLA's
deviceless compilation (benchmarks/_cuda_target.py: jax's CUDA plugin, no GPU, no driver) and
reads, from the executable itself:

* `memory_analysis()` temporaries, in GiB and per in-flight token (b x t horizontally, b x V
  vertically), as gpu_breakdown.py reports them on a GPU;
* the HBM traffic of every kernel launch (bytes of its operands and result, a sliced operand
  counted as its slice) times its loop trip counts, summed by kind: GEMMs, the recurrent Pallas
  kernels, per-(chunk, layer) weight-slice copies, and glue (every other fusion);
* "glue+copy ms": glue plus copy traffic at the target's HBM peak, a floor for their time (they
  are bandwidth-bound). Against the H100's own traces of 2026-11-23 (main at 6ddd919), the glue
  it measured was 1.04-1.32x this figure for all three families, except Mamba2 at 32 x 4k (2.3x),
  whose glue then was mostly transposes (docs/benchmarks.md).

    python benchmarks/gpu_program.py [--families mamba2,rwkv7,xlstm] [--layers 4] [--cases 1x32k,32x4k]
        [--vertical 1:4096,32:512] [--target h100] [--top 6] [--hlo-dir DIR]
        [--tile wkv7=64,32,8] [--tile mlstm=64,32,8,parallel]

Needs `pip install "jax[cuda12]"` (the plugin and NVIDIA's libraries, no GPU). Nothing is timed:
it shows where a change moves bytes before a GPU is there to time it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import _cuda_target  # noqa: E402
from _hlo_traffic import traffic  # noqa: E402

_cuda_target.setup()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from gpu_breakdown import CONFIGS, add_case_arguments, set_tiles  # noqa: E402  (the 7B configs, one list for the GPU scripts)

from jaxembed import models  # noqa: E402
from jaxembed.bench.measure import parse_length  # noqa: E402
from jaxembed.config import load_config  # noqa: E402
from jaxembed.schedule import embed  # noqa: E402

GiB = 2.0**30


def param_specs(cfg, dtype: str, sharding):
    """The params as shapes on the target, cast as `Embedder` casts them (the family's
    FLOAT32_PARAMS stay float32)."""
    family = models.family(cfg)
    shapes = jax.eval_shape(lambda: family.init_params(cfg, jax.random.key(0)))

    def spec(path, a):
        keep = not jnp.issubdtype(a.dtype, jnp.floating) or str(path[-1].key) in family.FLOAT32_PARAMS
        return jax.ShapeDtypeStruct(a.shape, a.dtype if keep else jnp.dtype(dtype), sharding=sharding)

    return jax.tree_util.tree_map_with_path(spec, shapes)


def compile_embed(cfg, params, batch: int, length: int, V: int | None, sharding):
    ids = jax.ShapeDtypeStruct((batch, length), jnp.int32, sharding=sharding)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=sharding)
    return jax.jit(lambda p, i, n: embed(p, cfg, i, n, vertical_chunk_size=V, kernels="pallas")
                   ).lower(params, ids, lengths).compile()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_case_arguments(ap)
    ap.add_argument("--target", default="h100", choices=sorted(_cuda_target.TARGETS))
    ap.add_argument("--top", type=int, default=0, help="list this many of the largest glue ops per program")
    ap.add_argument("--hlo-dir", default=None, help="write each program's optimised HLO here")
    args = ap.parse_args(argv)
    set_tiles(args.tile)
    sharding = _cuda_target.sharding(args.target)
    bandwidth = _cuda_target.BANDWIDTH[args.target]
    vertical = {int(b): int(v) for b, v in (item.split(":") for item in args.vertical.split(","))}
    print(f"target: {args.target} (compiled here, nothing run); jax {jax.__version__}; {args.dtype}; "
          f"{args.layers} layers; {time.strftime('%Y-%m-%d')}")
    print(f"{'family':<7} {'b x t':>8} {'schedule':>10} {'temps GiB':>9} {'KB/token':>8} {'GEMM GB':>8} "
          f"{'kernel GB':>9} {'copy GB':>8} {'glue GB':>8} {'glue launches':>13} {'glue+copy ms':>12}")
    for family in args.families.split(","):
        cfg = dataclasses.replace(load_config(CONFIGS[family]), n_layers=args.layers)
        params = param_specs(cfg, args.dtype, sharding)
        for case in args.cases.split(","):
            batch, length = (parse_length(x) for x in case.split("x"))
            for V in (None, vertical.get(batch)):
                if V is not None and V >= length:
                    continue
                compiled = compile_embed(cfg, params, batch, length, V, sharding)
                hlo = compiled.as_text()
                temps = compiled.memory_analysis().temp_size_in_bytes
                t = traffic(hlo)
                schedule = "horizontal" if V is None else f"V={V}"
                per_token = temps / (batch * (V or length)) / 1024
                print(f"{family:<7} {case:>8} {schedule:>10} {temps / GiB:9.2f} {per_token:8.1f} "
                      f"{t['gemm'] / 1e9:8.1f} {t['kernel'] / 1e9:9.1f} {t['copy'] / 1e9:8.1f} {t['glue'] / 1e9:8.1f} "
                      f"{t['glue_launches']:13d} {1e3 * (t['glue'] + t['copy']) / bandwidth:12.2f}", flush=True)
                for moved, name, times, shape in t["top_glue"][: args.top]:
                    print(f"{'':>20}{moved / 1e9:8.2f} GB  x{times:<5} {name[:40]:<40} {shape}")
                if args.hlo_dir:
                    Path(args.hlo_dir).mkdir(parents=True, exist_ok=True)
                    (Path(args.hlo_dir) / f"{family}-{case}-{schedule}.hlo.txt").write_text(hlo)
    return 0


if __name__ == "__main__":
    sys.exit(main())
