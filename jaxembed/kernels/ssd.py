"""Chunked SSD (Mamba2) as one Pallas kernel; reference: `jaxembed.ops.ssd.chunked` (same signature).

One program per (batch row b, head h, block of head-dim columns) walks the chunks of L tokens.
For chunk c, entering with the state S [p, n] (float32, in registers):

    M     = tril(C Bᵀ ∘ exp(a_cum_l - a_cum_s)) diag(dt)          [l, s]   (eq. 8)
    y     = M x + diag(exp(a_cum)) C Sᵀ + D x                    [l, p]   (eqs. 8, 11)
    S     = exp(a_cum_L) S + (x ∘ dt exp(a_to_end))ᵀ B            [p, n]   (eqs. 9, 10)

The diagonal block, the output correction and the chunk-boundary state are the three products
of one iteration; the loop is the inter-chunk recurrence. Matmul operands are in the activation
dtype (the state is cast like `ops.ssd.chunk_output` does), accumulation and every decay,
exponential and the state are float32. Shapes as in `ops.ssd`: x [b, t, h, p], dt [b, t, h],
A [h], B and C [b, t, g, n], D [h] or [h, p], state [b, h, p, n].
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxembed.kernels import common
from jaxembed.ops import ssd as ref

F32 = jnp.float32


def _kernel(x_ref, dt_ref, a_cum_ref, a_to_end_ref, B_ref, C_ref, D_ref, s0_ref, y_ref, s_ref, *, L, n_chunks):
    causal, _ = common.causal_masks(L)
    D = D_ref[...]  # [pb]

    def chunk(c, S):  # S [pb, n] float32
        t = pl.ds(pl.multiple_of(c * L, L), L)
        x, Bc, Cc = x_ref[t, :], B_ref[t, :], C_ref[t, :]  # [l, pb] [l, n] [l, n]
        dt, a_cum, a_to_end = dt_ref[t], a_cum_ref[t], a_to_end_ref[t]  # [l] float32
        decay = jnp.exp(jnp.minimum(a_cum[:, None] - a_cum[None, :], 0.0))  # [l, s], clamped above the diagonal
        M = jnp.where(causal, common.dot(Cc, Bc, trans_b=True) * decay * dt[None, :], 0.0)
        y = common.dot(M.astype(x.dtype), x)
        y += jnp.exp(a_cum)[:, None] * common.dot(Cc, S.astype(Cc.dtype), trans_b=True)
        y += D[None, :] * x.astype(F32)
        y_ref[t, :] = y.astype(y_ref.dtype)
        w = (x.astype(F32) * (dt * jnp.exp(a_to_end))[:, None]).astype(x.dtype)  # [s, pb]
        chunk_decay = jnp.exp(jnp.min(a_cum))  # a_cum falls monotonically (A < 0, dt >= 0): min = last
        return chunk_decay * S + common.dot(w, Bc, trans_a=True)

    s_ref[...] = lax.fori_loop(0, n_chunks, chunk, s0_ref[...])


def _forward(x, dt, A, B, C, D, dt_bias, state, *, dt_limit, blocks, interpret):
    b, t, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    r = h // g
    L = blocks.chunk
    P, N = common.padded(p), common.padded(n)
    pb = blocks.value_block
    T = t + (-t % L)
    dt = ref.discretize_dt(dt, dt_bias, dt_limit)  # [b, t, h] float32
    # padding tokens have dt = 0: no decay, no input; the final state is that of the last real token
    dt = common.pad_axis(jnp.moveaxis(dt, 1, 2), 2, T)  # [b, h, T]
    a = (dt * A.astype(F32)[:, None]).reshape(b, h, T // L, L)
    a_cum = jnp.cumsum(a, axis=-1)
    a_to_end = lax.cumsum(a, axis=a.ndim - 1, reverse=True) - a  # Σ over the rest of the chunk, no cancellation
    a_cum, a_to_end = a_cum.reshape(b, h, T), a_to_end.reshape(b, h, T)
    xp = common.pad_axis(common.pad_axis(x, 1, T), 3, P)
    Bp, Cp = (common.pad_axis(common.pad_axis(v, 1, T), 3, N) for v in (B, C))
    Dp = common.pad_axis(jnp.broadcast_to((D[:, None] if D.ndim == 1 else D).astype(F32), (h, p)), 1, P)
    s0 = common.pad_axis(common.pad_axis(state, 2, P), 3, N)

    seq = pl.BlockSpec((None, T, None, pb), lambda i, j, k: (i, 0, j, k))
    per_head = pl.BlockSpec((None, None, T), lambda i, j, k: (i, j, 0))
    group = pl.BlockSpec((None, T, None, N), lambda i, j, k: (i, 0, j // r, 0))
    st = pl.BlockSpec((None, None, pb, N), lambda i, j, k: (i, j, k, 0))
    y, final = common.call(
        lambda *refs: _kernel(*refs, L=L, n_chunks=T // L),
        grid=(b, h, P // pb),
        in_specs=[seq, per_head, per_head, per_head, group, group,
                  pl.BlockSpec((None, pb), lambda i, j, k: (j, k)), st],
        out_specs=[seq, st],
        out_shape=[jax.ShapeDtypeStruct((b, T, h, P), x.dtype), jax.ShapeDtypeStruct((b, h, P, N), F32)],
        blocks=blocks, interpret=interpret, name="ssd_chunked",
    )(xp, dt, a_cum, a_to_end, Bp, Cp, Dp, s0)
    return y[:, :t, :, :p], final[:, :, :p, :n]


@common.cached
def _differentiable(chunk_size, dt_limit, blocks, interpret):
    def forward(x, dt, A, B, C, D, dt_bias, state):
        return _forward(x, dt, A, B, C, D, dt_bias, state, dt_limit=dt_limit, blocks=blocks, interpret=interpret)

    def reference(x, dt, A, B, C, D, dt_bias, state):
        return ref.chunked(x, dt, A, B, C, chunk_size=chunk_size, D=D, dt_bias=dt_bias, dt_limit=dt_limit,
                           initial_state=state)

    return common.with_reference_vjp(forward, reference)


def chunked(x, dt, A, B, C, *, chunk_size, D=None, dt_bias=None, dt_limit=(0.0, math.inf), initial_state=None,
            blocks: common.BlockSizes | None = None, interpret: bool = False):
    """`ops.ssd.chunked` computed by the Pallas kernel; gradients are `jax.vjp` of the reference
    (run with chunk_size). Returns (y [b, t, h, p] in x's dtype, final state [b, h, p, n] float32)."""
    ref._heads_per_group(x, B, C)
    if x.ndim != 4 or dt.shape != x.shape[:3] or B.shape[:2] != x.shape[:2]:
        raise ValueError(f"expected x [b, t, h, p], dt [b, t, h], B and C [b, t, g, n]; got x {x.shape}, "
                         f"dt {dt.shape}, B {B.shape}")
    h, p = x.shape[2], x.shape[3]
    state = ref._check_state(initial_state, x, B)
    D = jnp.zeros((h,), F32) if D is None else D
    dt_bias = jnp.zeros((h,), F32) if dt_bias is None else dt_bias
    if blocks is None:
        blocks = common.heuristic("ssd", key_dim=B.shape[3], value_dim=p)
    blocks = common.check_blocks(blocks, p)
    f = _differentiable(chunk_size, tuple(float(v) for v in dt_limit), blocks, bool(interpret))
    return f(x, dt, A, B, C, D, dt_bias, state)
