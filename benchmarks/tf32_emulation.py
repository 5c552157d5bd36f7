"""What the GPU's TF32 dots do to the WKV7 kernel's accuracy, emulated on any machine.

Under jax's default matmul precision a float32 dot on an NVIDIA GPU runs on the tensor cores as
TF32 (operands rounded to a 10-bit mantissa, float32 accumulation); a CPU computes it in full
float32, so the interpreted kernels on CPU never show that rounding. This script runs the WKV7
kernel in Pallas' interpreter with every dot's float32 operands rounded to TF32 first, and
compares it with the token-by-token recurrence (`ops.wkv7.recurrent`, full float32), in two forms
of the in-chunk log-decay sums:

    mask dots   g = tril(1) @ log w as dots, as the kernel did until 2026-11-25: TF32 rounds each
                log decay before it is summed
    cumsum      the kernel's `_log_decay_sums` now: float32 adds

with RWKV7 7.2B's head (n = p = 64), kernel chunks of 16 (the heuristic's; `--chunks 16,32,64`
for others: WKV7's dots are [L, .] products, and only L >= 64 can run on Hopper's wgmma), one
sequence, and decays drawn as RWKV7's log w = -exp(-1/2) sigmoid(z): "mixed" z ~ N(0, 3^2), "slow"
z ~ N(-6, 3^2) (most channels long memory). Prints relative errors of y and the final state.

The kernel runs in two forms: "fused" (every chunk's intra-chunk work in the walk) and "factors"
(`BlockSizes.parallel_factors`: the chunk factors a kernel of their own, the walk two products a
chunk; `--forms fused,factors`, cumsum sums only).

    python benchmarks/tf32_emulation.py [--length 512] [--chunks 16] [--forms fused]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxembed.kernels import BlockSizes, common  # noqa: E402
from jaxembed.kernels import wkv7 as kernel  # noqa: E402
from jaxembed.ops import wkv7  # noqa: E402
from jaxembed.testing import rel_err  # noqa: E402


def to_tf32(x):
    """Round float32 to TF32's 10-bit mantissa (to nearest, ties away), kept as float32."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jax.lax.bitcast_convert_type((bits + jnp.uint32(0x1000)) & jnp.uint32(0xFFFFE000), jnp.float32)


def tf32_dot(exact_dot):
    def dot(a, b, **kw):
        return exact_dot(*(to_tf32(x) if x.dtype == jnp.float32 else x for x in (a, b)), **kw)

    return dot


def mask_dot_sums(lw):
    """The old in-kernel sums: products with 0/1 masks (through `common.dot`, so TF32 under emulation)."""
    inclusive, strict = common.causal_masks(lw.shape[0])
    g = common.dot(inclusive.astype(jnp.float32), lw)
    g_prev = common.dot(strict.astype(jnp.float32), lw)
    g_to_end = common.dot(jnp.transpose(strict).astype(jnp.float32), lw)
    return g, g_prev, g_to_end, jnp.sum(lw, axis=0)


def inputs(rng, t, slow):
    b, h, n, p = 1, 2, 64, 64

    def normal(shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)

    kk = normal((b, t, h, n))
    kk = kk / jnp.linalg.norm(kk, axis=-1, keepdims=True)
    z = normal((b, t, h, n), 3.0) - (6.0 if slow else 0.0)
    return (normal((b, t, h, n)), z, normal((b, t, h, n), 0.5), normal((b, t, h, p)),  # r, the decay's logits, k, v
            -kk, kk * jax.nn.sigmoid(normal((b, t, h, n)))), jnp.asarray(rng.standard_normal((b, h, p, n)), jnp.float32)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--chunks", default="16", help="kernel chunk sizes L, comma-separated (at most 64)")
    ap.add_argument("--forms", default="fused", help="fused and/or factors, comma-separated")
    args = ap.parse_args(argv)
    chunks = [int(v) for v in args.chunks.split(",")]
    forms = args.forms.split(",")
    if not set(forms) <= {"fused", "factors"}:
        raise SystemExit(f"--forms: fused and/or factors, got {args.forms!r}")
    rng = np.random.default_rng(0)
    exact_dot, cumsum_sums = common.dot, kernel._log_decay_sums
    print(f"WKV7 kernel (interpreted, all dots TF32-emulated) against the float32 recurrence, t = {args.length}\n")
    print("| decays | chunk L | form | log-decay sums | y rel err | state rel err |\n|---|---|---|---|---|---|")
    for slow in (False, True):
        xs, s0 = inputs(rng, args.length, slow)
        y_ref, s_ref = jax.jit(wkv7.recurrent)(*xs, initial_state=s0)
        for L, form, (name, sums) in itertools.product(chunks, forms, (("mask dots (before)", mask_dot_sums),
                                                                        ("cumsum (now)", cumsum_sums))):
            if form == "factors" and sums is mask_dot_sums:
                continue
            blocks = BlockSizes(chunk=L, value_block=32, segments=1, parallel_factors=form == "factors")
            common.dot, kernel._log_decay_sums = tf32_dot(exact_dot), sums
            try:  # the kernel with its custom_vjp, built anew (not from its cache) so that the patches are traced
                y, s = kernel._differentiable.__wrapped__(L, blocks, True)(*xs, s0)
            finally:
                common.dot, kernel._log_decay_sums = exact_dot, cumsum_sums
            print(f"| {'slow' if slow else 'mixed'} | {L} | {form} | {name} | {rel_err(y, y_ref):.2e} | "
                  f"{rel_err(s, s_ref):.2e} |", flush=True)


if __name__ == "__main__":
    main()
