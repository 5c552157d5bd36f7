"""Where a recurrent layer's GPU time goes: projection floor, recurrent kernel, glue, vertical overhead.

For each family (7B shapes, a few layers, bfloat16) and each case (batch x length) it prints:

* floor: the layer's projections alone (a `lax.scan` over layers of every LINEAR_PARAMS matmul
  with bf16 out, no other op), the speed of light of a layer built on those matmuls;
* the full `jaxembed.embed`, horizontal and vertically chunked, as ratios over the floor;
* a device-trace breakdown of each full run (jax.profiler): time in GEMMs, in the recurrent
  kernel (Pallas), and in everything else (glue), with the largest glue kernels named;
* `memory_analysis()` temporaries per in-flight token (b x t horizontally, b x V vertically).

    python benchmarks/gpu_breakdown.py [--families mamba2,rwkv7,xlstm] [--layers 4]
        [--cases 1x32k,32x4k] [--vertical 1:4096,32:512] [--hlo-dir DIR] [--json FILE]

On a CPU it runs too (`--scaled` for width/16 shapes), but the numbers that
matter are the GPU's; docs/benchmarks.md records them with the device and date.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from jaxembed import models  # noqa: E402
from jaxembed.bench import measure  # noqa: E402
from jaxembed.bench.worker import device_params  # noqa: E402
from jaxembed.config import load_config  # noqa: E402
from jaxembed.schedule import embed  # noqa: E402

CONFIGS = {
    "mamba2": ROOT / "configs/models/codestral-mamba-7b.yaml",
    "rwkv7": ROOT / "configs/models/rwkv7-g0-7.2b.yaml",
    "xlstm": ROOT / "configs/models/xlstm-7b.yaml",
}
KERNEL_NAMES = re.compile(r"ssd_chunked|wkv7|mlstm", re.I)
GEMM_NAMES = re.compile(r"gemm|nvjet|xmma|cutlass|cublas|sm90_|wgmma", re.I)


def median_ms(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def projection_floor(cfg, params, batch: int, length: int, dtype):
    """A jitted fn(params) running every layer's LINEAR_PARAMS matmuls (bf16 out) under `lax.scan`."""
    names = [n for n in models.family(cfg).LINEAR_PARAMS if n in params["layers"]]
    key = jax.random.key(1)
    d_ins = sorted({params["layers"][n].shape[1] for n in names})
    inputs = {d: jax.random.normal(jax.random.fold_in(key, d), (batch, length, d), jnp.float32).astype(dtype)
              for d in d_ins}

    def run(layers, inputs):
        def body(carry, w):
            # each output is the new carry: live at the end, never fused into anything else
            return tuple(jnp.einsum("btd,de->bte", inputs[w_l.shape[0]], w_l, preferred_element_type=dtype)
                         for w_l in w), None
        init = tuple(jnp.zeros((batch, length, layers[n].shape[2]), dtype) for n in names)
        out, _ = lax.scan(body, init, tuple(layers[n] for n in names))
        return out

    flops = 2 * batch * length * sum(params["layers"][n][0].size for n in names) * params["layers"][names[0]].shape[0]
    return jax.jit(run), ({n: params["layers"][n] for n in names}, inputs), flops


def device_trace(fn, args, calls: int = 2) -> dict:
    """Sum of device kernel time per category over `calls` calls, per call, from a jax.profiler trace."""
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as logdir:
        jax.profiler.start_trace(logdir)
        for _ in range(calls):
            jax.block_until_ready(fn(*args))
        jax.profiler.stop_trace()
        files = glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True)
        if not files:
            return {"error": "no trace written"}
        data = ProfileData.from_file(files[-1])
    warnings.filterwarnings("ignore", message="builtin type", category=DeprecationWarning)  # profiler's stats type
    by_name: dict[str, list] = {}
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        lines = [ln for ln in plane.lines if ln.name.startswith("Stream")] or list(plane.lines)
        for line in lines:
            for ev in line.events:
                stats = dict(ev.stats)
                label = ev.name
                op = stats.get("hlo_op") or stats.get("tf_op") or ""
                entry = by_name.setdefault(label, [0.0, 0, op])
                entry[0] += ev.duration_ns / 1e6 / calls
                entry[1] += 1
    out = {"gemm_ms": 0.0, "kernel_ms": 0.0, "glue_ms": 0.0, "glue_top": []}
    glue = []
    for name, (ms, count, op) in by_name.items():
        if KERNEL_NAMES.search(name) or KERNEL_NAMES.search(op):
            out["kernel_ms"] += ms
        elif GEMM_NAMES.search(name):
            out["gemm_ms"] += ms
        else:
            out["glue_ms"] += ms
            glue.append((ms, count // calls, name[:60], op[:40]))
    out["glue_top"] = sorted(glue, reverse=True)[:12]
    return out


def temp_kb_per_token(compiled, in_flight: int) -> float | None:
    try:
        mem = compiled.memory_analysis()
        return mem.temp_size_in_bytes / in_flight / 1024
    except Exception:  # memory_analysis is optional on some backends
        return None


def run_case(family: str, cfg, batch: int, length: int, V: int | None, args, results: list):
    dtype = jnp.dtype(args.dtype)
    params = device_params(cfg, args.dtype, seed=0, device=jax.devices()[0])
    ids = jax.random.randint(jax.random.key(2), (batch, length), 0, cfg.vocab_size, jnp.int32)
    lengths = jnp.full((batch,), length, jnp.int32)
    row = {"family": family, "batch": batch, "length": length, "layers": cfg.n_layers, "V": V}

    floor_fn, floor_args, flops = projection_floor(cfg, params, batch, length, dtype)
    row["floor_ms"] = median_ms(floor_fn, floor_args, args.repeats)
    row["floor_tflops"] = flops / row["floor_ms"] / 1e9
    del floor_args

    for mode, v in (("horizontal", None), ("vertical", V)):
        if mode == "vertical" and (v is None or v >= length):
            continue
        call_args = (params, ids, lengths)
        compiled = jax.jit(lambda p, i, n, v=v: embed(p, cfg, i, n, vertical_chunk_size=v)).lower(*call_args).compile()
        row[f"{mode}_ms"] = median_ms(compiled, call_args, args.repeats)
        row[f"{mode}_temp_kb_per_token"] = temp_kb_per_token(compiled, batch * (v or length))
        if args.profile:
            row[f"{mode}_trace"] = device_trace(compiled, call_args)
        if args.hlo_dir:
            Path(args.hlo_dir).mkdir(parents=True, exist_ok=True)
            (Path(args.hlo_dir) / f"{family}-b{batch}-t{length}-{mode}.hlo.txt").write_text(compiled.as_text())
    results.append(row)
    print_row(row)
    del params


def print_row(row):
    fl = row["floor_ms"]
    head = (f"{row['family']:<7} b={row['batch']:<3} t={measure.fmt_len(row['length']):>5} L={row['layers']}  "
            f"floor {fl:8.2f} ms ({row['floor_tflops']:.0f} TFLOP/s)")
    print(head, flush=True)
    for mode in ("horizontal", "vertical"):
        if f"{mode}_ms" not in row:
            continue
        ms = row[f"{mode}_ms"]
        kb = row.get(f"{mode}_temp_kb_per_token")
        line = (f"    {mode:<10}{'' if mode == 'horizontal' else ' V=' + str(row['V'])}: "
                f"{ms:8.2f} ms = {ms / fl:.3f} x floor")
        if kb is not None:
            line += f", temps {kb:.1f} KB/token"
        tr = row.get(f"{mode}_trace")
        if tr and "gemm_ms" in tr:
            line += (f"\n      trace: gemm {tr['gemm_ms']:.2f}  kernel {tr['kernel_ms']:.2f}  glue {tr['glue_ms']:.2f}"
                     f"  (sum {tr['gemm_ms'] + tr['kernel_ms'] + tr['glue_ms']:.2f}) ms")
            for ms_, count, name, op in tr["glue_top"]:
                line += f"\n        {ms_:7.3f} ms x{count:<4} {name}  [{op}]"
        print(line, flush=True)


def parse_cases(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        b, t = item.lower().split("x")
        out.append((int(b), measure.parse_length(t)))
    return out


def add_case_arguments(ap: argparse.ArgumentParser) -> None:
    """The options that pick what is measured, shared with gpu_program.py."""
    ap.add_argument("--families", default="mamba2,rwkv7,xlstm")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--cases", default="1x32k,32x4k")
    ap.add_argument("--vertical", default="1:4096,32:512", help="V per batch size, batch:V,...")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tile", action="append", default=[], metavar="KERNEL=L,VB,WARPS",
                    help="run KERNEL (ssd, wkv7, mlstm) with this (chunk, value block, warps) instead of the "
                         "heuristic's tile (kernels.common._TILES); KERNEL=L,VB,WARPS,parallel: with its split over "
                         "chunks (kernels.common.SPLITS: mlstm's parallel_outputs, wkv7's parallel_factors)")


def set_tiles(items: list[str]) -> None:
    """Override `kernels.heuristic`'s tile of each named kernel: "wkv7=64,32,8", or with the kernel's
    split over chunks (`kernels.common.SPLITS`: mLSTM's outputs, WKV7's chunk factors) "mlstm=64,32,8,parallel"."""
    from jaxembed.kernels import common

    for item in items:
        kernel, _, tile = item.partition("=")
        fields = tile.split(",")
        parallel = fields[3:] == ["parallel"]
        if kernel not in common._TILES or len(fields) != 3 + parallel or not all(v.isdigit() for v in fields[:3]):
            raise SystemExit(f"--tile: expected KERNEL=L,VB,WARPS[,parallel] with KERNEL one of "
                             f"{sorted(common._TILES)}, got {item!r}")
        if parallel and kernel not in common.SPLITS:
            raise SystemExit(f"--tile: {kernel} has no split over chunks (',parallel' is for {sorted(common.SPLITS)})")
        common._TILES[kernel] = (*(int(v) for v in fields[:3]), parallel)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_case_arguments(ap)
    ap.add_argument("--scaled", action="store_true", help="the width/16 configs/models/scaled-*.yaml (CPU checks)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-profile", dest="profile", action="store_false")
    ap.add_argument("--hlo-dir", default=None, help="write each full run's optimised HLO here")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    set_tiles(args.tile)
    vertical = {int(b): int(v) for b, v in (item.split(":") for item in args.vertical.split(","))}
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; {time.strftime('%Y-%m-%d')}"
          + "".join(f"; tile {t}" for t in args.tile), flush=True)
    results: list = []
    measure.exit_on_sigterm()
    try:  # a step cut at its time limit still writes the rows it has
        for family in args.families.split(","):
            path = CONFIGS[family]
            if args.scaled:
                path = path.with_name("scaled-" + path.name)
            cfg = dataclasses.replace(load_config(path), n_layers=args.layers)
            for batch, length in parse_cases(args.cases):
                try:
                    run_case(family, cfg, batch, length, vertical.get(batch), args, results)
                except Exception as err:  # one failing case (e.g. out of memory) does not hide the others
                    status, msg = measure.classify_error(err)
                    print(f"{family} b={batch} t={length}: {status}: {msg[:300]}", flush=True)
                    results.append({"family": family, "batch": batch, "length": length, "status": status,
                                    "error": msg})
    finally:
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    measured = [r for r in results if r.get("status") in (None, "ok")]
    if not measured:
        print("nothing was measured: every case failed", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
