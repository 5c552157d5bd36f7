"""Registers and register spills of every Pallas kernel in the programs users run, from ptxas itself,
compiled here without a GPU.

A kernel that needs more than the 255 registers a thread may hold spills to local memory (L1, then
HBM): each spilled value costs a store and loads on the program's serial chunk loop. Nothing in the
jaxpr or the HLO shows it; ptxas reports it per kernel. This script compiles the embedding programs
(`gpu_program.py`: horizontal and vertically chunked) and the training step (`gpu_train_program.py`)
for an H100 through XLA's deviceless compilation (benchmarks/_cuda_target.py), each in a child
process whose XLA logs ptxas's `-v` report, and prints, per program, each jaxembed kernel's
registers per thread, spilled bytes per thread (stores / loads), and the tensor-core instructions
its PTX uses: `wgmma` (Hopper's warpgroup MMA, the fast path for matrix work on an H100 or H200) or
`mma.sync` (the pre-Hopper path, e.g. for dots whose row tile is under 64), read from the PTX that
XLA hands ptxas (a ptxas wrapper under `CUDA_ROOT` keeps a copy of each).

    python benchmarks/kernel_registers.py [--programs mamba2:1x32k,rwkv7:1x32k,xlstm:1x32k,train]
        [--target h100] [--tile wkv7=64,32,8]

Needs jax's CUDA plugin (see gpu_program.py). Nothing runs and nothing is timed: whether a spill
costs time is for the GPU; that a kernel does not spill is certain from here.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the `name=` of every jaxembed Pallas kernel (jaxembed/kernels/*.py); XLA's own fusions are not listed
KERNELS = ("ssd_chunked", "ssd_segment_states", "ssd_chunked_backward", "wkv7_chunked", "wkv7_segment_states",
           "wkv7_chunk_factors", "mlstm_chunked", "mlstm_segment_states", "mlstm_scores", "mlstm_chunk_states",
           "mlstm_chunk_outputs", "stacked_lora_input", "normed_in_place", "gated_norm_backward")
DEFAULT_PROGRAMS = "mamba2:1x32k,mamba2:32x4k,rwkv7:1x32k,xlstm:1x32k,train"


def child_command(program: str, target: str, tiles: list[str] = ()) -> list[str]:
    """The compile that reports `program`: "family:case" (embed, horizontal and vertical) or "train";
    `tiles` ("wkv7=64,32,8") override the heuristic's tiles of the embedding programs."""
    if program == "train":
        return [sys.executable, str(ROOT / "benchmarks" / "gpu_train_program.py"), "--target", target]
    family, _, case = program.partition(":")
    if not family or not case:
        raise SystemExit(f"--programs: expected family:case (e.g. mamba2:1x32k) or train, got {program!r}")
    return [sys.executable, str(ROOT / "benchmarks" / "gpu_program.py"), "--families", family, "--cases", case,
            "--target", target, *(f"--tile={tile}" for tile in tiles)]


def ptxas_reports(log: str) -> list[tuple[str, int, int, int]]:
    """(kernel, registers, spill store bytes, spill load bytes) for each jaxembed kernel ptxas built,
    in the order it built them, from ptxas's `-v` lines in XLA's log."""
    rows, name, spills = [], None, None
    for line in log.splitlines():
        if m := re.search(r"Function properties for (\S+)", line):
            name, spills = m.group(1), None
        elif m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line):
            spills = int(m.group(1)), int(m.group(2))
        elif (m := re.search(r"Used (\d+) registers", line)) and name is not None:
            if name in KERNELS and spills is not None:
                rows.append((name, int(m.group(1)), *spills))
            name = None
    return rows


def mma_paths(ptx: str) -> dict[str, str]:
    """{kernel: "wgmma", "mma.sync", "wgmma+mma.sync" or "none"} for each jaxembed kernel entry in a
    PTX module: which tensor-core instructions its body issues."""
    out = {}
    for name, body in re.findall(r"\.entry (\w+)\s*\((.*?)(?=\.entry |\Z)", ptx, flags=re.S):
        if name in KERNELS:
            kinds = [kind for kind, pattern in (("wgmma", "wgmma.mma_async"), ("mma.sync", "mma.sync"))
                     if pattern in body]
            out[name] = "+".join(kinds) or "none"
    return out


def ptxas_wrapper(root: Path) -> Path:
    """A CUDA root (jax reads `CUDA_ROOT` before the wheel's) whose bin/ptxas copies its PTX input into
    root/ptx and runs the real ptxas; nvvm (libdevice) is the wheel's. Returns the PTX folder."""
    try:
        import nvidia.cuda_nvcc  # the wheel jax's CUDA plugin brings: bin/ptxas, nvvm/libdevice
    except ImportError:
        raise SystemExit("kernel_registers.py needs jax's CUDA plugin and NVIDIA's compiler wheel "
                         "(pip install \"jax[cuda12]\", see gpu_program.py)") from None

    real = Path(next(iter(nvidia.cuda_nvcc.__path__)))
    (root / "bin").mkdir(parents=True)
    (root / "nvvm").symlink_to(real / "nvvm")
    ptx = root / "ptx"
    ptx.mkdir()
    wrapper = root / "bin" / "ptxas"
    wrapper.write_text(f'#!/bin/sh\n[ -f "$1" ] && cp "$1" "{ptx}/$(basename "$1").ptx"\n'
                       f'exec "{real / "bin" / "ptxas"}" "$@"\n')
    wrapper.chmod(0o755)
    return ptx


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--programs", default=DEFAULT_PROGRAMS)
    ap.add_argument("--target", default="h100")
    ap.add_argument("--tile", action="append", default=[], metavar="KERNEL=L,VB,WARPS",
                    help="another tile for KERNEL in the embedding programs (gpu_program.py --tile)")
    args = ap.parse_args(argv)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="subprocess_compilation=3",
               JAXEMBED_COMPILATION_CACHE="off", JAX_ENABLE_COMPILATION_CACHE="false")
    print(f"{'program':14s} {'kernel':22s} {'registers':>9s} {'spill stores B':>14s} {'spill loads B':>13s} "
          f"{'MMA':>14s}")
    for program in args.programs.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            cuda_root = Path(tmp) / "cuda"
            ptx_dir = ptxas_wrapper(cuda_root)
            done = subprocess.run(child_command(program, args.target, args.tile),
                                  env=dict(env, CUDA_ROOT=str(cuda_root)), capture_output=True, text=True)
            paths = {}
            for f in sorted(ptx_dir.iterdir()):
                for name, path in mma_paths(f.read_text(errors="replace")).items():
                    paths[name] = path if paths.get(name, path) == path else "varies"
        if done.returncode:
            print(f"{program}: the compile failed (exit {done.returncode}):\n{done.stderr[-2000:]}", file=sys.stderr)
            continue
        rows = ptxas_reports(done.stderr)
        if not rows:
            print(f"{program}: no ptxas report in XLA's log (XLA must run ptxas as a program, not its library)",
                  file=sys.stderr)
        for name, registers, stores, loads in sorted(set(rows)):
            print(f"{program:14s} {name:22s} {registers:9d} {stores:14d} {loads:13d} {paths.get(name, '?'):>14s}",
                  flush=True)


if __name__ == "__main__":
    main()
