"""Pallas kernels on a GPU: correctness against the XLA references, speed against the peers and
the roofline, and end-to-end encode with kernels vs the XLA path. Prints markdown tables.

    python benchmarks/kernels.py                     # everything (needs a GPU; exits 2 without one)
    python benchmarks/kernels.py --only check        # compile + match the references only
    python benchmarks/kernels.py --only ops --families ssd --lengths 4096 16384
    python benchmarks/kernels.py --only conv          # Mamba2's layer SSD: x convolved in the kernel or by XLA

Operator shapes are those of Codestral Mamba 7B (SSD: 128 heads x 64, 8 groups, n = 128),
RWKV7 7.2B (WKV7: 64 heads, 64 x 64 state) and xLSTM 7B (mLSTM: 8 heads, k = 256, v = 512), in
bfloat16, batch 1 and 32, T = 4k ... 64k. Peers, when importable: mamba_ssm's Triton
`mamba_chunk_scan_combined` (from a source tree given by --mamba-src or MAMBA_SSM_SRC, imported
without its CUDA extension), fla's `chunk_rwkv7`, mlstm_kernels' `mlstm_chunkwise__xl_chunk`.
The roofline row is max(FLOPs / measured bf16 matmul rate, bytes / measured copy bandwidth),
with the fewest bytes the operator must move (inputs read once, outputs written once).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tarfile
import time
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FAMILIES = ("ssd", "wkv7", "mlstm")
SHAPES = {  # per family: the 7B model's operator dims
    "ssd": dict(h=128, p=64, g=8, n=128, chunk=256, model="Codestral Mamba 7B"),
    "wkv7": dict(h=64, p=64, n=64, chunk=32, model="RWKV7 7.2B"),
    "mlstm": dict(h=8, k=256, v=512, chunk=64, model="xLSTM 7B"),
}
CONFIGS = {"ssd": "codestral-mamba-7b.yaml", "wkv7": "rwkv7-g0-7.2b.yaml", "mlstm": "xlstm-7b.yaml"}


def need_gpu():
    import jax

    if jax.default_backend() != "gpu":
        sys.exit(f"benchmarks/kernels.py needs a GPU: jax's default backend is {jax.default_backend()!r} "
                 f"(devices {jax.devices()}). Nothing was measured.")
    return jax.devices()[0].device_kind


# ---- timing -------------------------------------------------------------------------------

REPS = 10


def time_jax(fn, args, reps=None):
    import jax

    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(reps or REPS):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_torch(fn, reps=None):
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps or REPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def ceilings():
    """Measured bf16 matmul rate (FLOP/s) and copy bandwidth (bytes read + written per second)."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.PRNGKey(0), (8192, 8192), jnp.bfloat16)
    b = jax.random.normal(jax.random.PRNGKey(1), (8192, 8192), jnp.bfloat16)
    mm = jax.jit(lambda a, b: a @ b)
    rate = 2 * 8192**3 / time_jax(mm, (a, b), reps=20)
    x = jax.random.normal(jax.random.PRNGKey(2), (1 << 30,), jnp.bfloat16)  # 2 GiB
    cp = jax.jit(lambda x: x + 1)
    bw = 2 * x.nbytes / time_jax(cp, (x,), reps=20)
    return rate, bw


# ---- inputs -------------------------------------------------------------------------------

def inputs(family, b, t, dtype, key, shape=None):
    """Random operator inputs in the model's layout (JAX arrays)."""
    import jax
    import jax.numpy as jnp

    s = shape or SHAPES[family]
    ks = jax.random.split(key, 8)
    nrm = lambda k, shp: jax.random.normal(k, shp, jnp.float32)
    if family == "ssd":
        h, p, g, n = s["h"], s["p"], s["g"], s["n"]
        return dict(x=nrm(ks[0], (b, t, h, p)).astype(dtype), dt=nrm(ks[1], (b, t, h)) - 2.0,
                    A=-jnp.exp(nrm(ks[2], (h,))), B=nrm(ks[3], (b, t, g, n)).astype(dtype),
                    C=nrm(ks[4], (b, t, g, n)).astype(dtype), D=nrm(ks[5], (h,)), dt_bias=nrm(ks[6], (h,)) * 0.5)
    if family == "wkv7":
        h, p, n = s["h"], s["p"], s["n"]
        kk = nrm(ks[3], (b, t, h, n))
        kk = kk / jnp.linalg.norm(kk, axis=-1, keepdims=True)
        gate = jax.nn.sigmoid(nrm(ks[4], (b, t, h, n)))
        # in the dtype RWKV7's projections hand the kernel (which casts each tile to float32 as it loads it)
        arrays = dict(r=nrm(ks[0], (b, t, h, n)), w_logit=nrm(ks[1], (b, t, h, n)),
                      k=nrm(ks[2], (b, t, h, n)) * 0.3, v=nrm(ks[5], (b, t, h, p)), a=-kk, b=kk * gate)
        return {name: x.astype(dtype) for name, x in arrays.items()}
    h, dk, dv = s["h"], s["k"], s["v"]
    return dict(q=nrm(ks[0], (b, t, h, dk)).astype(dtype), k=nrm(ks[1], (b, t, h, dk)).astype(dtype),
                v=nrm(ks[2], (b, t, h, dv)).astype(dtype), i=nrm(ks[3], (b, t, h)) * 2,
                f=nrm(ks[4], (b, t, h)) + 3.0)


def run_op(family, backend, args, chunk, blocks=None):
    from jaxembed import kernels

    op = {"ssd": kernels.ssd_chunked, "wkv7": kernels.wkv7_chunked, "mlstm": kernels.mlstm_chunked}[family]
    a = dict(args)
    pos = [a.pop(k) for k in {"ssd": ("x", "dt", "A", "B", "C"), "wkv7": ("r", "w_logit", "k", "v", "a", "b"),
                              "mlstm": ("q", "k", "v", "i", "f")}[family]]
    return op(*pos, chunk_size=chunk, backend=backend, blocks=blocks, **a)


def cost(family, b, t, dtype_bytes):
    """(FLOPs, fewest bytes) of the operator: its matmul work at the kernel's chunk, inputs read
    once and outputs (y and the final state) written once."""
    s = SHAPES[family]
    if family == "ssd":
        h, p, g, n, L = s["h"], s["p"], s["g"], s["n"], 64
        flops = 2 * b * t * h * (L * n / 2 + L * p / 2 + 2 * n * p)  # causal C Bᵀ and M x, C Sᵀ, state
        byts = dtype_bytes * b * t * (2 * h * p + 2 * g * n) + 4 * b * t * h + 4 * b * h * p * n
    elif family == "wkv7":
        h, p, n, L = s["h"], s["p"], s["n"], 16
        flops = 2 * b * t * h * (3 * L * n + 4 * L * n / 2 + 4 * n * p + 2 * L * p + math.log2(L) * L * (L + p))
        byts = dtype_bytes * b * t * h * (5 * n + 2 * p) + 4 * b * h * p * n
    else:
        h, dk, dv, L = s["h"], s["k"], s["v"], 64
        flops = 2 * b * t * h * (L * dk / 2 + L * dv / 2 + 2 * dk * dv)
        byts = dtype_bytes * b * t * h * (2 * dk + 2 * dv) + 8 * b * t * h + 4 * b * h * dk * dv
    return flops, byts


# ---- peers --------------------------------------------------------------------------------

def import_mamba_ssm(src):
    """mamba_ssm's Triton SSD without its CUDA extension: stub the package, import the modules."""
    if src is None:
        return None, "no mamba_ssm source (--mamba-src / MAMBA_SSM_SRC)"
    src = Path(src)
    if src.suffix == ".gz":
        dest = Path("/tmp/mamba_ssm_src")
        with tarfile.open(src) as tar:
            tar.extractall(dest)
        src = next(dest.glob("mamba_ssm-*"))
    for name in ("mamba_ssm", "mamba_ssm.ops", "mamba_ssm.ops.triton", "mamba_ssm.utils"):
        mod = types.ModuleType(name)
        mod.__path__ = [str(src / name.replace(".", "/"))]
        sys.modules[name] = mod
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except Exception as e:  # report why the peer is absent
        return None, f"mamba_ssm import failed: {type(e).__name__}: {e}"
    return mamba_chunk_scan_combined, "ok"


def torch_inputs(args):
    import torch

    return {k: torch.from_numpy(np.asarray(v.astype("float32"))).to("cuda").to(
        torch.bfloat16 if str(v.dtype) == "bfloat16" else torch.float32) for k, v in args.items()}


def peer_fn(family, args, peers):
    """A zero-argument callable running the peer on the same inputs, or (None, why)."""
    import torch

    ta = torch_inputs(args)
    if family == "ssd":
        fn, why = peers["mamba_ssm"]
        if fn is None:
            return None, why
        return (lambda: fn(ta["x"], ta["dt"], ta["A"], ta["B"], ta["C"], SHAPES["ssd"]["chunk"], D=ta["D"],
                           dt_bias=ta["dt_bias"], dt_softplus=True, return_final_states=True)), "mamba_ssm Triton"
    if family == "wkv7":
        try:
            from fla.ops.rwkv7 import chunk_rwkv7
        except Exception as e:
            return None, f"fla import failed: {type(e).__name__}: {e}"
        bf = {k: v.to(torch.bfloat16) for k, v in ta.items()}  # fla's kernels are made for bf16 inputs
        # fla takes log w itself: RWKV7's map of the logits (ops.wkv7.log_decay)
        bf["log_w"] = (-math.exp(-0.5) * torch.sigmoid(ta["w_logit"].float())).to(torch.bfloat16)
        return (lambda: chunk_rwkv7(bf["r"], bf["log_w"], bf["k"], bf["v"], bf["a"], bf["b"], scale=1.0,
                                    output_final_state=True)), "fla chunk_rwkv7 (bf16 in)"
    try:
        from mlstm_kernels.torch.chunkwise.triton_xl_chunk import mlstm_chunkwise__xl_chunk
    except Exception as e:
        return None, f"mlstm_kernels import failed: {type(e).__name__}: {e}"
    hm = {k: ta[k].transpose(1, 2).contiguous() for k in ("q", "k", "v", "i", "f")}  # [B, NH, S, ...]
    return (lambda: mlstm_chunkwise__xl_chunk(hm["q"], hm["k"], hm["v"], hm["i"], hm["f"], return_last_states=True,
                                              chunk_size=128, autocast_kernel_dtype=torch.bfloat16)), \
        "mlstm_kernels xl_chunk"


# ---- sections -----------------------------------------------------------------------------

def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# (1, 1337) is 21 chunks of 64 at batch 1 (84 of WKV7's 16): long enough that every kernel splits the
# sequence into segments (kernels.common.sequence_segments), so the segment-state kernels and the combine
# run compiled
CHECK_CASES = ((2, 37), (1, 300), (1, 1337))


def check(rows):
    """Each kernel compiled for the GPU against its XLA reference (float32 at full matmul precision),
    odd lengths and non-power-of-two dims, with a random initial state, forward and gradients."""
    import jax
    import jax.numpy as jnp

    small = {"ssd": dict(h=6, p=48, g=2, n=40), "wkv7": dict(h=3, p=40, n=48), "mlstm": dict(h=3, k=40, v=72)}
    for family in FAMILIES:
        for dtype in (jnp.float32, jnp.bfloat16):
            for b, t in CHECK_CASES:
                key = jax.random.PRNGKey(b * 1000 + t)
                args = inputs(family, b, t, dtype, key, small[family])
                upcast = {k: (v.astype(jnp.float32) if v.dtype == jnp.bfloat16 else v) for k, v in args.items()}
                with jax.default_matmul_precision("highest"):  # exact float32 dots in both
                    ref = jax.jit(lambda a, family=family: run_op(family, "xla", a, 16))(upcast)
                    out = jax.jit(lambda a, family=family: run_op(family, "pallas", a, 16))(args)
                y_err = rel_err(out[0].astype(jnp.float32), ref[0])
                s_err = max(rel_err(o, r) for o, r in zip(jax.tree.leaves(out[1]), jax.tree.leaves(ref[1]),
                                                          strict=True))
                first = next(iter(args))

                def grad(backend, a, family=family, first=first):  # SSD: the kernel backward up to 8 chunks
                    loss = lambda a: jnp.sum(run_op(family, backend, a, 16)[0].astype(jnp.float32) ** 2)
                    return jax.jit(jax.grad(loss))(a)[first].astype(jnp.float32)

                with jax.default_matmul_precision("highest"):
                    g_out, g_ref = grad("pallas", args), grad("xla", upcast)
                finite = bool(jnp.all(jnp.isfinite(g_out)))
                g_err = rel_err(g_out, g_ref)
                rows.append(dict(family=family, dtype=jnp.dtype(dtype).name, b=b, t=t, y_rel_err=y_err,
                                 state_rel_err=s_err, grad_finite=finite, grad_rel_err=g_err))
                print(f"check {family:5s} {jnp.dtype(dtype).name:8s} b={b} t={t}: y {y_err:.2e} state {s_err:.2e} "
                      f"grad {g_err:.2e} finite {finite}", flush=True)
    check_packed_ssd(rows)
    check_ssd_backward_heads(rows)
    check_stacked_lora_input(rows)
    check_normed_in_place(rows)
    check_gated_norm_backward(rows)
    check_splits(rows, small)  # last: the step's time limit cuts the newest check first


# each kernel's split over chunks (kernels.common.SPLITS), checked by `check_splits` at these tiles
# (chunk, value block, warps): mLSTM's at the heuristic's; WKV7's where its walk reaches wgmma (chunks of 32
# and 64, 8 warps: the factor kernel spills nothing at 32 and ~1.6 KB a thread at 64; kernel_registers.py)
SPLIT_TILES = {"mlstm": [None], "wkv7": [(32, 64, 8), (64, 64, 8)]}


def check_splits(rows, small):
    """Each kernel's split over chunks compiled for the GPU, against the XLA reference, with one segment
    and with four, at the check's odd lengths: mLSTM's outputs as a kernel of their own
    (`BlockSizes.parallel_outputs`: the walk writes each chunk's entering state) and WKV7's chunk factors
    (`BlockSizes.parallel_factors`: the walk reads them)."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from jaxembed.kernels import BlockSizes, heuristic
    from jaxembed.kernels.common import SPLITS

    for family, tiles in SPLIT_TILES.items():
        dims = small[family]
        for tile in tiles:
            if tile is None:
                default = heuristic(family, key_dim=dims.get("k", dims.get("n")),
                                    value_dim=dims.get("v", dims.get("p")))
                tile = (default.chunk, default.value_block, default.num_warps)
            chunk, vb, warps = tile
            for dtype in (jnp.float32, jnp.bfloat16):
                for b, t in CHECK_CASES:
                    args = inputs(family, b, t, dtype, jax.random.PRNGKey(b * 1000 + t + 7), dims)
                    upcast = {k: (v.astype(jnp.float32) if v.dtype == jnp.bfloat16 else v) for k, v in args.items()}
                    with jax.default_matmul_precision("highest"):
                        ref = jax.jit(lambda a, family=family: run_op(family, "xla", a, 16))(upcast)
                    for segments in (1, 4):
                        blocks = dataclasses.replace(BlockSizes(chunk=chunk, value_block=vb, num_warps=warps,
                                                                segments=segments), **{SPLITS[family]: True})
                        with jax.default_matmul_precision("highest"):
                            out = jax.jit(lambda a, family=family, blocks=blocks: run_op(family, "pallas", a, 16,
                                                                                         blocks))(args)
                        y_err = rel_err(out[0].astype(jnp.float32), ref[0])
                        s_err = max(rel_err(o, r) for o, r in zip(jax.tree.leaves(out[1]), jax.tree.leaves(ref[1]),
                                                                  strict=True))
                        label = f"{family} ({SPLITS[family]}, tile {chunk},{vb},{warps}, {segments} segments)"
                        rows.append(dict(family=label, dtype=jnp.dtype(dtype).name, b=b, t=t, y_rel_err=y_err,
                                         state_rel_err=s_err))
                        print(f"check {label}, {jnp.dtype(dtype).name:8s} b={b} t={t}: y {y_err:.2e} "
                              f"state {s_err:.2e}", flush=True)


BACKWARD_TIMING_SHAPE = (192, 256, 16, 64, 1, 128)  # (b, t, h, p, g, n): a training step's 256-token group


def check_ssd_backward_heads(rows):
    """The SSD backward kernel with programs walking 1, 2 and 4 heads of a group (summing dB and dC on
    chip), in chunks of 64 and of 32, against `jax.vjp` of the XLA reference; then timed at the
    training step's shape (192 texts x 256 tokens, 16 heads of 64, n 128) for each count the rule
    could pick in the chunk `ssd_backward.chunk_length` picks, and the rule's count in chunks of 64
    (the backward's chunk until session 18)."""
    import math

    import jax
    import jax.numpy as jnp

    from jaxembed.kernels import ssd_backward
    from jaxembed.ops import ssd as ref

    def case(b, t, h, p, g, n, dtype, seed):
        ks = jax.random.split(jax.random.PRNGKey(seed), 10)
        shapes = [(b, t, h, p), (b, t, h), (h,), (b, t, g, n), (b, t, g, n), (h,), (h,), (b, h, p, n), (b, t, h, p),
                  (b, h, p, n)]
        a = [jax.random.normal(k, s) for k, s in zip(ks, shapes, strict=True)]
        a[2] = -jnp.exp(a[2])
        for i in (0, 3, 4, 8):
            a[i] = a[i].astype(dtype)
        return a

    def reference(x, dt, A, B, C, D, dt_bias, s0):
        return ref.chunked(x, dt, A, B, C, chunk_size=64, D=D, dt_bias=dt_bias, initial_state=s0)

    for dtype in (jnp.float32, jnp.bfloat16):
        a = case(2, 250, 8, 64, 2, 64, dtype, 11)  # 4 chunks of 64, 8 of 32, the last partly padding
        upcast = [v.astype(jnp.float32) for v in a]
        with jax.default_matmul_precision("highest"):
            want = jax.jit(lambda *v: jax.vjp(reference, *v[:8])[1]((v[8], v[9])))(*upcast)
            for chunk, heads in ((64, 1), (64, 2), (64, 4), (32, 1), (32, 4)):
                got = jax.jit(lambda *v, heads=heads, chunk=chunk: ssd_backward.backward(
                    *v, dt_limit=(0.0, math.inf), chunk=chunk, interpret=False, heads_per_program=heads))(*a)
                err = max(rel_err(gv.astype(jnp.float32), w) for gv, w in zip(got, want, strict=True))
                rows.append(dict(family=f"ssd_backward (L {chunk}, {heads} heads/program)",
                                 dtype=jnp.dtype(dtype).name, b=2, t=250, grad_rel_err=err, grad_finite=bool(all(
                                     jnp.all(jnp.isfinite(gv.astype(jnp.float32))) for gv in got))))
                print(f"check ssd_backward {jnp.dtype(dtype).name:8s} L {chunk} heads/program {heads}: grad {err:.2e}",
                      flush=True)
    b, t, h, p, g, n = BACKWARD_TIMING_SHAPE
    a = case(b, t, h, p, g, n, jnp.bfloat16, 12)
    pick = ssd_backward.choose_heads_per_program(batch=b, heads=h, heads_per_group=h // g, value_blocks=2)
    rule_chunk = ssd_backward.chunk_length(t, 64)
    for chunk, heads in [(rule_chunk, heads) for heads in (1, 2, 4, 8, 16)] + [(64, pick)]:
        fn = jax.jit(lambda *v, heads=heads, chunk=chunk: ssd_backward.backward(
            *v, dt_limit=(0.0, math.inf), chunk=chunk, interpret=False, heads_per_program=heads))
        ms = time_jax(fn, a) * 1e3
        rows.append(dict(family="ssd_backward", b=b, t=t, chunk=chunk, heads=heads, ms=ms,
                         pick=heads == pick and chunk == rule_chunk))
        print(f"time ssd_backward {b}x{t} h{h} p{p} n{n} L {chunk} heads/program {heads:2d}: {ms:.3f} ms"
              f"{'  (the rules pick this)' if rows[-1]['pick'] else ''}", flush=True)


def check_stacked_lora_input(rows):
    """The norm that writes LoRA's GEMM input [u | s u A] (`kernels.norm`) compiled for the GPU
    against its XLA form, then both timed at the training step's shapes (192 texts x 256 tokens):
    Mamba2's pre-mixer norm (d 768 from the float32 residual) and its gated norm (1536 columns)."""
    import jax
    import jax.numpy as jnp

    from jaxembed import kernels

    def case(lead, d, r, gated, dtype, seed):
        ks = jax.random.split(jax.random.PRNGKey(seed), 4)
        x = jax.random.normal(ks[0], (*lead, d)).astype(dtype if gated else jnp.float32)
        z = jax.random.normal(ks[1], (*lead, d)).astype(dtype) if gated else None
        return x, 1.0 + jax.random.normal(ks[2], (d,)), jax.random.normal(ks[3], (d, r)) * d ** -0.5, z

    def op(backend, group, dtype):
        return jax.jit(lambda x, w, a, z: kernels.stacked_lora_input(
            x, w, a, z, scale=2.0, eps=1e-5, group_size=group, out_dtype=dtype, backend=backend))

    for dtype in (jnp.float32, jnp.bfloat16):
        for lead, d, group, r, gated in (((2, 37), 100, 100, 5, False), ((1, 300), 96, 48, 16, True)):
            args = case(lead, d, r, gated, dtype, d + r)
            with jax.default_matmul_precision("highest"):
                err = rel_err(op("pallas", group, dtype)(*args).astype(jnp.float32),
                              op("xla", group, dtype)(*args).astype(jnp.float32))
            rows.append(dict(family=f"stacked_lora_input ({'gated' if gated else 'rms'})", dtype=jnp.dtype(dtype).name,
                             b=lead[0], t=lead[1], y_rel_err=err))
            print(f"check stacked_lora_input {'gated' if gated else 'rms'} {jnp.dtype(dtype).name:8s} "
                  f"{lead}: {err:.2e}", flush=True)
    for d, group, gated in ((768, 768, False), (1536, 1536, True)):
        args = case((192, 256), d, 16, gated, jnp.bfloat16, 3)
        ms = {backend: time_jax(op(backend, group, jnp.bfloat16), args) * 1e3 for backend in ("pallas", "xla")}
        rows.append(dict(family=f"stacked_lora_input ({'gated' if gated else 'rms'})", b=192, t=256, d=d,
                         kernel_ms=ms["pallas"], xla_ms=ms["xla"]))
        print(f"time stacked_lora_input {'gated' if gated else 'rms'} 192x256 d{d} r16: kernel {ms['pallas']:.3f} ms, "
              f"XLA {ms['xla']:.3f} ms ({ms['pallas'] / ms['xla']:.2f}x)", flush=True)


def check_normed_in_place(rows, reps=20):
    """The (gated) norm written over its input (`kernels.norm.normed_in_place`) compiled for the GPU
    against its XLA form: a group held whole, a group read in column chunks, rows that are not
    whole blocks. Then both timed at Codestral's gated norm (1 x 32k tokens, 8 groups of 1024), each
    `reps` times in one loop whose carry is the norm's output, so the kernel writes over a buffer
    nothing else reads, as in the model; GB/s counts y and z read and the output written."""
    import jax
    import jax.numpy as jnp

    from jaxembed import kernels

    def case(lead, d, gated, dtype, seed):
        ks = jax.random.split(jax.random.PRNGKey(seed), 3)
        x = jax.random.normal(ks[0], (*lead, d)).astype(dtype)
        z = jax.random.normal(ks[1], (*lead, d)).astype(dtype) if gated else None
        return x, 1.0 + jax.random.normal(ks[2], (d,)), z

    def op(backend, group):
        return jax.jit(lambda x, w, z: kernels.normed_in_place(x, w, z, backend=backend, eps=1e-5, group_size=group))

    for dtype in (jnp.float32, jnp.bfloat16):
        for lead, d, group, gated in (((2, 37), 100, 100, False), ((1, 300), 96, 48, True),
                                      ((3, 5), 16400, 8200, True)):
            args = case(lead, d, gated, dtype, d)
            err = rel_err(op("pallas", group)(*args).astype(jnp.float32), op("xla", group)(*args).astype(jnp.float32))
            name = f"normed_in_place ({'gated' if gated else 'rms'}, group {group})"
            rows.append(dict(family=name, dtype=jnp.dtype(dtype).name, b=lead[0], t=lead[1], y_rel_err=err))
            print(f"check {name} {jnp.dtype(dtype).name:8s} {lead}: {err:.2e}", flush=True)
    y, w, z = case((1, 32768), 8192, True, jnp.bfloat16, 7)

    def loop(backend):
        def run(y, w, z):
            norm = lambda i, y: kernels.normed_in_place(y, w, z, backend=backend, eps=1e-5, group_size=1024)
            return jax.lax.fori_loop(0, reps, norm, y)
        return jax.jit(run)

    ms = {backend: time_jax(loop(backend), (y, w, z)) * 1e3 / reps for backend in ("pallas", "xla")}
    gbs = 3 * y.nbytes / (ms["pallas"] * 1e-3) / 1e9
    rows.append(dict(family="normed_in_place (gated, group 1024)", b=1, t=32768, d=8192, kernel_ms=ms["pallas"],
                     xla_ms=ms["xla"]))
    print(f"time normed_in_place gated 1x32768 d8192 group 1024: kernel {ms['pallas']:.3f} ms ({gbs:.0f} GB/s), "
          f"XLA {ms['xla']:.3f} ms ({ms['pallas'] / ms['xla']:.2f}x)", flush=True)


def check_gated_norm_backward(rows):
    """The gated norm's backward as one Pallas pass (`kernels.norm.gated_norm_backward`: dy, dz, n
    and 1/rms) compiled for the GPU against its XLA form, then both timed at the 24-layer throughput
    config's shapes (192 texts x 256 tokens, one group of 1536 channels) and at Codestral's
    (8 groups of 1024)."""
    import jax
    import jax.numpy as jnp

    from jaxembed import kernels

    def case(lead, d, dtype, seed):
        ks = jax.random.split(jax.random.PRNGKey(seed), 4)
        y, z, dn = (jax.random.normal(k, (*lead, d)).astype(dtype) for k in ks[:3])
        return y, z, dn, 1.0 + jax.random.normal(ks[3], (d,))

    def op(backend, group, dtype):
        return jax.jit(lambda y, z, dn, w: kernels.gated_norm_backward(
            y, z, dn, w, backend=backend, eps=1e-5, group_size=group, norm_dtype=dtype))

    for dtype in (jnp.float32, jnp.bfloat16):
        for lead, d, group in (((2, 37), 96, 48), ((1, 300), 1536, 1536)):
            args = case(lead, d, dtype, d)
            got, want = op("pallas", group, dtype)(*args), op("xla", group, dtype)(*args)
            err = max(rel_err(a.astype(jnp.float32), b.astype(jnp.float32)) for a, b in zip(got, want, strict=True))
            rows.append(dict(family=f"gated_norm_backward (group {group})", dtype=jnp.dtype(dtype).name, b=lead[0],
                             t=lead[1], y_rel_err=err))
            print(f"check gated_norm_backward group {group} {jnp.dtype(dtype).name:8s} {lead}: {err:.2e}", flush=True)
    for lead, d, group in (((192, 256), 1536, 1536), ((4, 4096), 8192, 1024)):
        args = case(lead, d, jnp.bfloat16, 3)
        ms = {backend: time_jax(op(backend, group, jnp.bfloat16), args) * 1e3 for backend in ("pallas", "xla")}
        gbs = 6 * args[0].nbytes / (ms["pallas"] * 1e-3) / 1e9  # y, z, dn read; dy, dz, n written
        rows.append(dict(family=f"gated_norm_backward (group {group})", b=lead[0], t=lead[1], d=d,
                         kernel_ms=ms["pallas"], xla_ms=ms["xla"]))
        print(f"time gated_norm_backward {lead[0]}x{lead[1]} d{d} group {group}: kernel {ms['pallas']:.3f} ms "
              f"({gbs:.0f} GB/s), XLA {ms['xla']:.3f} ms ({ms['pallas'] / ms['xla']:.2f}x)", flush=True)


def check_packed_ssd(rows):
    """The SSD kernel reading x, B and C as column blocks of Mamba2's packed xbc (the layer's path)."""
    import jax
    import jax.numpy as jnp

    from jaxembed import kernels

    dims = dict(heads=4, head_dim=32, groups=2, state_size=32)  # packable: blocks start on boundaries
    width = dims["heads"] * dims["head_dim"] + 2 * dims["groups"] * dims["state_size"]
    for dtype in (jnp.float32, jnp.bfloat16):
        for b, t in CHECK_CASES:
            ks = jax.random.split(jax.random.PRNGKey(7 * t + b), 6)
            h = dims["heads"]
            args = dict(xbc=jax.random.normal(ks[0], (b, t, width)).astype(dtype),
                        dt=jax.random.normal(ks[1], (b, t, h)) - 1.0, A=-jnp.exp(jax.random.normal(ks[2], (h,))),
                        D=jax.random.normal(ks[3], (h,)), dt_bias=0.5 * jax.random.normal(ks[4], (h,)),
                        initial_state=jax.random.normal(ks[5], (b, h, dims["head_dim"], dims["state_size"])))

            def op(a, backend):
                a = dict(a)
                return kernels.ssd_chunked_xbc(a.pop("xbc"), a.pop("dt"), a.pop("A"), chunk_size=16, backend=backend,
                                               **dims, **a)

            upcast = {k: v.astype(jnp.float32) for k, v in args.items()}
            with jax.default_matmul_precision("highest"):
                ref = jax.jit(lambda a: op(a, "xla"))(upcast)
                out = jax.jit(lambda a: op(a, "pallas"))(args)
            y_err, s_err = rel_err(out[0].astype(jnp.float32), ref[0]), rel_err(out[1], ref[1])
            rows.append(dict(family="ssd_xbc", dtype=jnp.dtype(dtype).name, b=b, t=t, y_rel_err=y_err,
                             state_rel_err=s_err, grad_finite=None, grad_rel_err=None))
            print(f"check ssd_xbc {jnp.dtype(dtype).name:8s} b={b} t={t}: y {y_err:.2e} state {s_err:.2e}", flush=True)


def ops_table(rows, families, lengths, batches, peers, rate, bw, mem_bytes):
    import jax
    import jax.numpy as jnp

    for family in families:
        for b in batches:
            for t in lengths:
                dtype = jnp.bfloat16
                flops, byts = cost(family, b, t, 2)
                row = dict(family=family, model=SHAPES[family]["model"], b=b, t=t,
                           roofline_ms=1e3 * max(flops / rate, byts / bw), gflop=flops / 1e9, gbytes=byts / 1e9)
                if 6 * byts > 0.8 * mem_bytes:  # inputs, outputs, peers' intermediates
                    row["note"] = f"skipped: needs ~{6 * byts / 2**30:.0f} GiB"
                    rows.append(row)
                    print(row, flush=True)
                    continue
                args = inputs(family, b, t, dtype, jax.random.PRNGKey(t + b))
                chunk = SHAPES[family]["chunk"]
                for backend in ("pallas", "xla"):
                    try:
                        fn = jax.jit(lambda a, family=family, backend=backend, chunk=chunk:
                                     run_op(family, backend, a, min(chunk, 64)))
                        row[f"{backend}_ms"] = 1e3 * time_jax(fn, (args,))
                    except Exception as e:  # OOM and the like go in the table
                        row[f"{backend}_ms"] = None
                        row.setdefault("note", "")
                        row["note"] += f" {backend}: {type(e).__name__}: {str(e)[:120]}"
                    jax.clear_caches()
                try:
                    fn, label = peer_fn(family, args, peers)
                    row["peer"] = label
                    row["peer_ms"] = None if fn is None else 1e3 * time_torch(fn)
                except Exception as e:
                    row["peer_ms"] = None
                    row["peer"] = f"failed: {type(e).__name__}: {str(e)[:160]}"
                del args
                rows.append(row)
                print(row, flush=True)


SWEEP = {  # (chunk, value_block, num_warps, segments) candidates for the heuristic; segments None = auto
    "ssd": [(64, 32, 4, 1), (64, 64, 4, 1), (64, 64, 8, 1), (128, 32, 8, 1), (32, 64, 4, 1),
            (64, 64, 4, 2), (64, 64, 4, 4), (64, 64, 4, 8), (64, 64, 4, 16)],
    # a 5th entry True: its chunk factors a kernel parallel over chunks (BlockSizes.parallel_factors, session 22;
    # the walk on wgmma at chunks of 32 and 64; kernel_registers.py)
    "wkv7": [(16, 16, 4, 1), (16, 32, 4, 1), (16, 32, 4, 2), (16, 32, 4, 8), (16, 32, 4, 16), (32, 32, 4, None),
             (16, 64, 4, None), (16, 64, 8, None), (32, 64, 8, None, True), (64, 64, 8, None, True),
             (32, 64, 4, None, True)],
    # since session 18 mLSTM's scores are a kernel of their own: (64, 64, 8) no longer spills. A 5th entry
    # True: its outputs a kernel parallel over chunks (BlockSizes.parallel_outputs, session 21; the walk
    # then holds 211 registers at 8 warps, the outputs kernel 48, no spills: kernel_registers.py)
    "mlstm": [(64, 32, 8, 1), (64, 64, 8, 1), (128, 64, 8, 1), (32, 64, 4, 1), (64, 128, 8, 1), (32, 128, 8, 1),
              (64, 32, 8, 2), (64, 32, 8, 4), (64, 32, 8, 8), (64, 32, 8, 16), (64, 64, 8, None),
              (64, 32, 8, 1, True), (64, 32, 4, None, True)],
}


def sweep(rows, families, lengths=(4096, 16384), b=1):
    """Time each BlockSizes candidate on the 7B shapes (the data behind `kernels.heuristic` and
    `kernels.common.sequence_segments`); 4096 is the vertical chunk of the batch-1 embed."""
    import jax
    import jax.numpy as jnp

    from jaxembed.kernels import BlockSizes, heuristic
    from jaxembed.kernels.common import SPLITS, sequence_segments

    for family in families:
        s = SHAPES[family]
        default = heuristic(family, key_dim=s.get("n", s.get("k")), value_dim=s.get("p", s.get("v")))
        for t in lengths:
            args = inputs(family, b, t, jnp.bfloat16, jax.random.PRNGKey(7))
            programs = b * s["h"] * (s.get("p", s.get("v")) // default.value_block)
            auto = sequence_segments(default, programs=programs, n_chunks=-(-t // default.chunk))
            split = SPLITS.get(family)
            for chunk, vb, warps, segments, *parallel in SWEEP[family] + [
                    (default.chunk, default.value_block, default.num_warps, None, split and getattr(default, split))]:
                parallel = bool(parallel and parallel[0])
                blocks = BlockSizes(chunk=chunk, value_block=vb, num_warps=warps, segments=segments,
                                    **({split: parallel} if split else {}))
                try:
                    fn = jax.jit(lambda a, family=family, blocks=blocks: run_op(family, "pallas", a, 16, blocks))
                    ms = 1e3 * time_jax(fn, (args,))
                except Exception as e:
                    ms = f"{type(e).__name__}: {str(e)[:100]}"
                rows.append(dict(family=family, b=b, t=t, chunk=chunk, value_block=vb, num_warps=warps,
                                 segments=segments, split=split if parallel else None, heuristic=blocks == default,
                                 heuristic_segments=auto if blocks == default else None, ms=ms))
                print(rows[-1], flush=True)
                jax.clear_caches()
            del args


CONV_CASES = (  # Mamba2 layer shapes: (label, b, t, h, p, g, n, carries a state, differentiated)
    ("Codestral, vertical chunk", 1, 4096, 128, 64, 8, 128, True, False),
    ("Codestral, 32 x V=512", 32, 512, 128, 64, 8, 128, True, False),
    ("training 24L d768, fwd + bwd", 192, 256, 24, 64, 1, 128, False, True),
)


# the fused conv kernel's tiles (chunk, value block, warps) timed at the inference shapes beside the
# heuristic's (64, 64, 4): at 32 x 512 that tile spills 156-184 bytes a thread in its chunk loop,
# (64, 32, 4) 4 and (64, 32, 8) none, with twice the programs (benchmarks/kernel_registers.py)
CONV_TILES = ((64, 32, 4), (64, 32, 8))


def _conv_layer_paths(b, t, h, p, g, n, stateful, blocks=None):
    """(fused, unfused, proj, conv weight): the two paths of `conv_paths` as functions of the
    projection's output and the conv weight, on random Mamba2-layer inputs; the fused one with
    `blocks` (None: the heuristic's)."""
    import jax
    import jax.numpy as jnp

    from jaxembed import kernels
    from jaxembed.ops import ssd as ref

    conv_dim, k = h * p + 2 * g * n, 4
    ks = jax.random.split(jax.random.PRNGKey(b + t), 6)
    proj = jax.random.normal(ks[0], (b, t, conv_dim + h), jnp.float32).astype(jnp.bfloat16)
    A = -jnp.exp(jax.random.normal(ks[1], (h,)))
    conv_state = jnp.zeros((b, k - 1, conv_dim), jnp.bfloat16)
    weight = (0.5 * jax.random.normal(ks[2], (k, conv_dim))).astype(jnp.bfloat16)
    bias = (0.1 * jax.random.normal(ks[3], (conv_dim,))).astype(jnp.bfloat16)
    dims = dict(heads=h, head_dim=p, groups=g, state_size=n)
    rest = dict(chunk_size=256, D=jnp.ones((h,)), dt_bias=jnp.zeros((h,)),
                initial_state=jax.random.normal(ks[4], (b, h, p, n)) if stateful else None)

    def fused(proj, weight):
        return kernels.ssd_conv_chunked(proj, A, conv_state, weight, bias, offset=0, backend="pallas",
                                        final_state=stateful, blocks=blocks, **dims, **rest)[0]

    def unfused(proj, weight):
        xbc, dt = ref.split_projection(proj, offset=0, **dims)
        xbc, _ = ref.causal_conv(xbc, conv_state, weight, bias, out_dtype=proj.dtype)
        return kernels.ssd_chunked_xbc(xbc, dt, A, backend="pallas", **dims, **rest)[0]

    return fused, unfused, proj, weight


def conv_paths(rows, reps=None):
    """Mamba2's layer SSD from the projection's output two ways: the kernel that convolves x per
    chunk itself (`kernels.ssd_conv_chunked`, the layer's path), and XLA's causal conv + SiLU
    written out, then the kernel on the convolved xbc (`ssd_chunked_xbc`, the path before). At
    inference shapes (with the carried SSM state) and at the training step's (forward and
    backward). The fused path saves HBM bytes; this says whether it is also the faster one."""
    import jax
    import jax.numpy as jnp

    for label, b, t, h, p, g, n, stateful, differentiated in CONV_CASES:
        fused, unfused, proj, weight = _conv_layer_paths(b, t, h, p, g, n, stateful)
        row = dict(case=label, b=b, t=t)
        for name, fn in (("fused_ms", fused), ("unfused_ms", unfused)):
            if differentiated:
                step = jax.jit(jax.grad(lambda proj, weight, fn=fn: jnp.sum(fn(proj, weight).astype(jnp.float32) ** 2),
                                        argnums=(0, 1)))
            else:
                step = jax.jit(fn)
            try:
                row[name] = 1e3 * time_jax(step, (proj, weight), reps)
            except Exception as err:  # an OOM and the like go in the table
                row[name] = f"{type(err).__name__}: {str(err)[:100]}"
            jax.clear_caches()
        rows.append(row)
        print(row, flush=True)
    from jaxembed.kernels import BlockSizes

    for label, b, t, h, p, g, n, stateful, differentiated in CONV_CASES:
        if differentiated:
            continue
        for chunk, value_block, warps in CONV_TILES:
            blocks = BlockSizes(chunk=chunk, value_block=value_block, num_warps=warps)
            fused, _, proj, weight = _conv_layer_paths(b, t, h, p, g, n, stateful, blocks)
            row = dict(case=f"{label}, tile ({chunk}, {value_block}, {warps})", b=b, t=t, unfused_ms="-")
            try:
                row["fused_ms"] = 1e3 * time_jax(jax.jit(fused), (proj, weight), reps)
            except Exception as err:
                row["fused_ms"] = f"{type(err).__name__}: {str(err)[:100]}"
            jax.clear_caches()
            rows.append(row)
            print(row, flush=True)


def encode_table(rows, families, layers, lengths):
    """embed() of a 7B-width model (first `layers` layers, random weights, bfloat16), batch 1,
    vertically chunked with V = 4096: Pallas kernels vs the XLA chunked path."""
    import jax
    import jax.numpy as jnp

    from jaxembed import config as config_lib
    from jaxembed import models
    from jaxembed.schedule import embed

    for family in families:
        cfg = config_lib.load_config(ROOT / "configs" / "models" / CONFIGS[family])
        import dataclasses

        cfg = dataclasses.replace(cfg, n_layers=layers)
        fam = models.family(cfg)
        params = fam.init_params(cfg, jax.random.PRNGKey(0), dtype=jnp.bfloat16)
        for t in lengths:
            ids = jax.random.randint(jax.random.PRNGKey(t), (1, t), 0, cfg.vocab_size)
            lengths_ = jnp.array([t])
            row = dict(family=family, config=CONFIGS[family], layers=layers, t=t)
            for backend in ("pallas", "xla"):
                fn = jax.jit(lambda p, i, n, cfg=cfg, backend=backend: embed(p, cfg, i, n, vertical_chunk_size=4096,
                                                                              kernels=backend))
                try:
                    row[f"{backend}_s"] = time_jax(fn, (params, ids, lengths_), reps=3)
                    row[f"{backend}_emb"] = np.asarray(fn(params, ids, lengths_), np.float32)
                except Exception as e:
                    row[f"{backend}_s"] = None
                    row["note"] = f"{backend}: {type(e).__name__}: {str(e)[:160]}"
                jax.clear_caches()
            if row.get("pallas_emb") is not None and row.get("xla_emb") is not None:
                row["emb_rel_err"] = rel_err(row["pallas_emb"], row["xla_emb"])
            row.pop("pallas_emb", None), row.pop("xla_emb", None)
            rows.append(row)
            print(row, flush=True)


def fmt(v, spec=".2f"):
    return "-" if v is None else format(v, spec)


def markdown(device, rate, bw, check_rows, op_rows, enc_rows, conv_rows=()):
    out = [f"Device: {device}; measured bf16 matmul {rate / 1e12:.0f} TFLOP/s, copy {bw / 1e12:.2f} TB/s "
           f"(read + write); {time.strftime('%Y-%m-%d')}.", ""]
    timed = [r for r in check_rows if "ms" in r]
    against_xla = [r for r in check_rows if "kernel_ms" in r]
    checked = [r for r in check_rows if "ms" not in r and "kernel_ms" not in r]
    if checked:
        out += ["| kernel | dtype | b | t | y rel err | state rel err | grad rel err | grad finite |",
                "|---|---|---|---|---|---|---|---|"]
        out += [f"| {r['family']} | {r['dtype']} | {r['b']} | {r['t']} | {fmt(r.get('y_rel_err'), '.1e')} | "
                f"{fmt(r.get('state_rel_err'), '.1e')} | {fmt(r.get('grad_rel_err'), '.1e')} | "
                f"{r.get('grad_finite', '-')} |" for r in checked]
        out.append("")
    if timed:
        out += ["| SSD backward kernel, b x t | chunk L | heads per program | ms | the rules' pick |",
                "|---|---|---|---|---|"]
        out += [f"| {r['b']} x {r['t']} | {r['chunk']} | {r['heads']} | {r['ms']:.3f} | {'yes' if r['pick'] else ''} |"
                for r in timed]
        out.append("")
    if against_xla:
        out += ["| kernel, b x t x d (bf16; LoRA rank 16) | kernel ms | XLA form ms | kernel / XLA |",
                "|---|---|---|---|"]
        out += [f"| {r['family']}, {r['b']} x {r['t']} x {r['d']} | {r['kernel_ms']:.3f} | {r['xla_ms']:.3f} | "
                f"{r['kernel_ms'] / r['xla_ms']:.2f} |" for r in against_xla]
        out.append("")
    if conv_rows:
        out += ["| Mamba2 layer SSD (b x t) | x convolved in the kernel ms | XLA conv + kernel ms | fused / XLA conv |",
                "|---|---|---|---|"]
        for r in conv_rows:
            f, u = r["fused_ms"], r["unfused_ms"]
            both = isinstance(f, float) and isinstance(u, float)
            out.append(f"| {r['case']} ({r['b']} x {r['t']}) | {fmt(f) if isinstance(f, float) else f} | "
                       f"{fmt(u) if isinstance(u, float) else u} | {fmt(f / u) if both else '-'} |")
        out.append("")
    if op_rows:
        out += ["| operator (model) | b | T | Pallas ms | XLA ms | peer | peer ms | peer / Pallas | roofline ms | "
                "Pallas / roofline |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in op_rows:
            p, pe, rf = r.get("pallas_ms"), r.get("peer_ms"), r["roofline_ms"]
            out.append(f"| {r['family']} ({r['model']}) | {r['b']} | {r['t']} | {fmt(p)} | {fmt(r.get('xla_ms'))} | "
                       f"{r.get('peer', '-')} | {fmt(pe)} | {fmt(pe / p if p and pe else None)} | {fmt(rf)} | "
                       f"{fmt(p / rf if p else None)} |" + (f" {r['note']}" if r.get("note") else ""))
        out.append("")
    if enc_rows:
        out += ["| encode (config, layers) | T | Pallas s | XLA s | XLA / Pallas | emb rel diff |",
                "|---|---|---|---|---|---|"]
        for r in enc_rows:
            p, x = r.get("pallas_s"), r.get("xla_s")
            out.append(f"| {r['family']} ({r['config']}, {r['layers']}) | {r['t']} | {fmt(p, '.3f')} | "
                       f"{fmt(x, '.3f')} | {fmt(x / p if p and x else None)} | {fmt(r.get('emb_rel_err'), '.1e')} |"
                       + (f" {r['note']}" if r.get("note") else ""))
    return "\n".join(out)


def main(argv=None):
    global REPS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=("check", "sweep", "conv", "ops", "encode"), nargs="*", default=None)
    ap.add_argument("--families", nargs="*", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--lengths", nargs="*", type=int, default=[4096, 16384, 65536])
    ap.add_argument("--batches", nargs="*", type=int, default=[1, 32])
    ap.add_argument("--sweep-lengths", nargs="*", type=int, default=[4096, 16384])
    ap.add_argument("--encode-lengths", nargs="*", type=int, default=[16384])
    ap.add_argument("--encode-layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=REPS, help="timed repetitions (the median is reported)")
    ap.add_argument("--mamba-src", default=os.environ.get("MAMBA_SSM_SRC"))
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "benchmarks" / "results")))
    args = ap.parse_args(argv)
    device = need_gpu()
    REPS = args.reps
    sections = set(args.only or ("check", "sweep", "conv", "ops", "encode"))
    rate, bw = ceilings()
    print(f"device {device}: bf16 matmul {rate / 1e12:.0f} TFLOP/s, copy {bw / 1e12:.2f} TB/s", flush=True)
    import jax

    mem = (jax.devices()[0].memory_stats() or {}).get("bytes_limit", 64 << 30)
    check_rows, op_rows, enc_rows, sweep_rows, conv_rows = [], [], [], [], []
    from jaxembed.bench import measure

    measure.exit_on_sigterm()
    try:  # a step cut at its time limit still writes the rows it has
        if "check" in sections:
            check(check_rows)
        if "sweep" in sections:
            sweep(sweep_rows, args.families, args.sweep_lengths)
        if "conv" in sections:
            conv_paths(conv_rows)
        if "ops" in sections:
            peers = {"mamba_ssm": import_mamba_ssm(args.mamba_src)}
            ops_table(op_rows, args.families, args.lengths, args.batches, peers, rate, bw, mem)
        if "encode" in sections:
            encode_table(enc_rows, args.families, args.encode_layers, args.encode_lengths)
    finally:
        table = markdown(device, rate, bw, check_rows, op_rows, enc_rows, conv_rows)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "kernels.md").write_text(table + "\n")
        (out / "kernels.json").write_text(json.dumps(dict(device=device, check=check_rows, sweep=sweep_rows,
                                                          ops=op_rows, encode=enc_rows, conv=conv_rows), indent=1,
                                                     default=str))
        print(table)


if __name__ == "__main__":
    main()
