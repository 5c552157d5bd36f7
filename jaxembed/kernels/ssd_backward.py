"""The chunked SSD's backward as a Pallas kernel, for sequences of a few chunks (training texts).

Differentiating the SSD as `jax.vjp` of `ops.ssd.chunked` recomputes it in XLA and writes its
float32 [b x h, Q, Q] intra-chunk matrices and their cotangents to memory several times over: at
192 texts x 256 tokens (16 heads of 64, n = 128) it moves 14.4 GB, about two thirds of a Mamba2
training step's glue on the GPU (docs/benchmarks.md, "Training step"). This kernel keeps every
[L, L] product on chip, as the forward kernel does: 4.6 GB at that shape, most of it the float32
partial dB and dC of every program, summed by XLA.

One program per (batch row b, head h, block of head-dim columns) walks the chunks of L tokens in
reverse, carrying dS, the cotangent of the state leaving the chunk. For a chunk entered with the
state S [pb, n], with a = dt A, cs its cumulative sum within the chunk, L_ij = exp(cs_i - cs_j)
(i >= j), M = L ∘ C Bᵀ, X̃ = dt ∘ x, w_j = exp(cs_L - cs_j) and dy the output's cotangent:

    dX̃   = Mᵀ dy + w ∘ (B dSᵀ)                                       [l, pb]
    dM   = tril(dy X̃ᵀ),  P = dM ∘ M                                  [l, l]
    dC   = (dM ∘ L) B + exp(cs) ∘ (dy S)                             [l, n]
    dB   = (dM ∘ L)ᵀ C + w ∘ (X̃ dS)                                  [l, n]
    dcs  = rowsum P - colsum P - w ∘ rowsum(X̃ ∘ B dSᵀ) + exp(cs) ∘ rowsum(dy ∘ C Sᵀ),
           and the chunk's last token also Σ_j w_j X̃_j · (dS B_j) + exp(cs_L) (dS : S)
           (P's diagonal cancels and is left out; the w terms go to da as a prefix sum)
    dS  <- (exp(cs) ∘ dy)ᵀ C + exp(cs_L) dS                          [pb, n]

(docs/kernels.md derives them; tests/test_kernels.py checks them against `jax.vjp` of the
reference.) The state entering chunk c is recomputed from the initial state by the forward
kernel's state step over chunks 0 .. c-1, so nothing per chunk goes to memory; that is
quadratic in the chunk count, which is why sequences of more than MAX_CHUNKS chunks keep the
reference's backward. XLA then sums dB, dC and dcs over the program's heads and value blocks,
turns dcs into da (a reverse cumulative sum within each chunk) and chains dt's discretisation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxembed.kernels import common
from jaxembed.kernels.ssd import _rows, _state_step  # the forward kernel's chunk rows and state step
from jaxembed.ops import ssd as ref

F32 = jnp.float32
MAX_CHUNKS = 8  # longer sequences differentiate through the reference (see the module docstring)
VALUE_BLOCK = 32  # the backward carries S and dS [pb, n]: half the forward's largest block


def _kernel(x_ref, dy_ref, dt_ref, a_cum_ref, a_to_end_ref, B_ref, C_ref, s0_ref, ds_ref,
            dxt_ref, dB_ref, dC_ref, dcs_ref, r_ref, ds0_ref, *, L, chunks):
    causal, strict = common.causal_masks(L)
    last = lax.broadcasted_iota(jnp.int32, (L,), 0) == L - 1

    def entering(c):
        def step(k, S):
            t = _rows(k, L)
            return _state_step(S, x_ref[t, :], B_ref[t, :], dt_ref[t], a_cum_ref[t], a_to_end_ref[t])
        return lax.fori_loop(0, c, step, s0_ref[...])

    def chunk(i, dS):
        c = chunks - 1 - i
        t = _rows(c, L)
        S = entering(c)
        x, dy = x_ref[t, :], dy_ref[t, :]  # [l, pb]
        Bc, Cc = B_ref[t, :], C_ref[t, :]  # [l, n]
        dt, a_cum, a_to_end = dt_ref[t], a_cum_ref[t], a_to_end_ref[t]  # [l]
        cdt = x.dtype
        decay = jnp.where(causal, jnp.exp(jnp.minimum(a_cum[:, None] - a_cum[None, :], 0.0)), 0.0)  # L [l, s]
        M = common.dot(Cc, Bc, trans_b=True) * decay
        xdt = x.astype(F32) * dt[:, None]  # X̃
        w, e = jnp.exp(a_to_end), jnp.exp(a_cum)
        dSB = common.dot(Bc, dS.astype(Bc.dtype), trans_b=True)  # [l, pb]: B_j dSᵀ
        dxt_ref[t, :] = common.dot(M.astype(cdt), dy.astype(cdt), trans_a=True) + w[:, None] * dSB
        # dy X̃ᵀ as (dy xᵀ) diag(dt): x enters the dot as stored, dt in float32 after it (the forward
        # folds dt into M the same way), so X̃ is never rounded to the activation dtype
        dM = jnp.where(causal, common.dot(dy.astype(cdt), x, trans_b=True) * dt[None, :], 0.0)
        dML = (dM * decay).astype(Bc.dtype)
        SC = common.dot(Cc, S.astype(Cc.dtype), trans_b=True)  # [l, pb]: S C_i
        dC_ref[t, :] = common.dot(dML, Bc) + e[:, None] * common.dot(dy.astype(cdt), S.astype(cdt))
        dB_ref[t, :] = common.dot(dML, Cc, trans_a=True) + (w * dt)[:, None] * common.dot(x, dS.astype(cdt))
        # L_ii = 1 whatever cs is: the diagonal's row and column terms cancel exactly, so they are
        # left out rather than added and subtracted (under strong decay they dominate P, and their
        # float32 remainder piled up in da)
        P = jnp.where(strict, dM * M, 0.0)
        end = jnp.sum(jnp.where(last, e, 0.0))  # exp(cs_L), a scalar
        dcs = jnp.sum(P, axis=1) - jnp.sum(P, axis=0) + e * jnp.sum(dy.astype(F32) * SC, axis=1)
        dcs_ref[t] = jnp.where(last, dcs + end * jnp.sum(dS * S), dcs)
        # w's terms, -r_i at every row and Σ r on the last, add up in da to an exclusive prefix sum
        # of r: written apart and summed that way by XLA, without the cancellation
        r_ref[t] = w * jnp.sum(xdt * dSB, axis=1)
        return common.dot((e[:, None] * dy.astype(F32)).astype(Cc.dtype), Cc, trans_a=True) + end * dS

    ds0_ref[...] = lax.fori_loop(0, chunks, chunk, ds_ref[...])


def backward(x, dt, A, B, C, D, dt_bias, state, dy, d_state, *, dt_limit, chunk, interpret):
    """Cotangents of (x, dt, A, B, C, D, dt_bias, state) for `ops.ssd.chunked`'s (y, final state)
    given theirs (dy, d_state): shapes and dtypes as the inputs. One chunk layout of `chunk`
    tokens; t <= MAX_CHUNKS * chunk."""
    b, t, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    r = h // g
    L = chunk
    T = -(-t // L) * L
    chunks = T // L
    if chunks > MAX_CHUNKS:
        raise ValueError(f"{t} tokens are {chunks} chunks of {L}; the kernel backward takes at most {MAX_CHUNKS}")
    P, N = common.padded(p), common.padded(n)
    pb = min(VALUE_BLOCK, P)
    vb = P // pb
    dt_eff, dt_vjp = jax.vjp(lambda d, bias: ref.discretize_dt(d, bias, dt_limit), dt, dt_bias)
    dt_eff = common.pad_axis(dt_eff, 1, T)  # padding tokens: dt = 0, no decay and no input
    a = (dt_eff * A.astype(F32)).reshape(b, chunks, L, h)
    a_cum = jnp.cumsum(a, axis=2).reshape(b, T, h)
    a_to_end = (lax.cumsum(a, axis=2, reverse=True) - a).reshape(b, T, h)

    def time_major(v, width):  # [b, t, k, d] -> [b, T, k * width]
        return common.pad_axis(common.pad_axis(v, 3, width), 1, T).reshape(b, T, -1)

    x3, dy3 = time_major(x, P), time_major(dy.astype(x.dtype), P)
    B3, C3 = time_major(B, N), time_major(C, N)
    s0 = common.pad_axis(common.pad_axis(state.astype(F32), 2, P), 3, N)
    ds = common.pad_axis(common.pad_axis(d_state.astype(F32), 2, P), 3, N)

    column = pl.BlockSpec((None, T, pb), lambda i, j, k: (i, 0, j * vb + k))
    per_head = pl.BlockSpec((None, T, None), lambda i, j, k: (i, 0, j))
    group = pl.BlockSpec((None, T, N), lambda i, j, k: (i, 0, j // r))
    state_tile = pl.BlockSpec((None, None, pb, N), lambda i, j, k: (i, j, k, 0))
    partial = pl.BlockSpec((None, None, None, T, N), lambda i, j, k: (i, j, k, 0, 0))
    per_position = pl.BlockSpec((None, None, None, T), lambda i, j, k: (i, j, k, 0))
    blocks = common.BlockSizes(chunk=L, value_block=pb, num_warps=4, num_stages=1)
    dxt, dB, dC, dcs, r_terms, ds0 = common.call(
        lambda *refs: _kernel(*refs, L=L, chunks=chunks),
        grid=(b, h, vb),
        in_specs=[column, column, per_head, per_head, per_head, group, group, state_tile, state_tile],
        out_specs=[column, partial, partial, per_position, per_position, state_tile],
        out_shape=[jax.ShapeDtypeStruct((b, T, h * P), F32), jax.ShapeDtypeStruct((b, h, vb, T, N), F32),
                   jax.ShapeDtypeStruct((b, h, vb, T, N), F32), jax.ShapeDtypeStruct((b, h, vb, T), F32),
                   jax.ShapeDtypeStruct((b, h, vb, T), F32), jax.ShapeDtypeStruct((b, h, P, N), F32)],
        blocks=blocks, interpret=interpret, name="ssd_chunked_backward",
    )(x3, dy3, dt_eff, a_cum, a_to_end, B3, C3, s0, ds)

    dxt = dxt.reshape(b, T, h, P)[:, :t, :, :p]  # dX̃
    dt_eff = dt_eff[:, :t]
    xf, dyf = x.astype(F32), dy.astype(F32)
    Df = D.astype(F32)
    dx = dt_eff[..., None] * dxt + dyf * (Df[:, None] if D.ndim == 1 else Df)
    dD = jnp.sum(dyf * xf, axis=(0, 1))
    dD = jnp.sum(dD, axis=-1) if D.ndim == 1 else dD

    def grouped(v):  # [b, h, vb, T, N] -> [b, t, g, n]
        v = v.sum(axis=2).reshape(b, g, r, T, N).sum(axis=2)
        return jnp.moveaxis(v, 1, 2)[:, :t, :, :n]

    def per_chunk(v):  # [b, h, vb, T] -> [b, chunks, L, h]
        return jnp.moveaxis(v.sum(axis=2), 1, 2).reshape(b, chunks, L, h)

    dcs, r_terms = per_chunk(dcs), per_chunk(r_terms)
    # cs = cumsum(a) within the chunk: da_k = Σ_{i >= k} dcs_i, and w's terms Σ_{i < k} r_i
    da = lax.cumsum(dcs, axis=2, reverse=True) + jnp.cumsum(r_terms, axis=2) - r_terms
    da = da.reshape(b, T, h)[:, :t]
    d_dt_eff = jnp.sum(xf * dxt, axis=-1) + da * A.astype(F32)
    dA = jnp.sum(da * dt_eff, axis=(0, 1))
    d_dt, d_bias = dt_vjp(d_dt_eff)
    return (dx.astype(x.dtype), d_dt.astype(dt.dtype), dA.astype(A.dtype), grouped(dB).astype(B.dtype),
            grouped(dC).astype(C.dtype), dD.astype(D.dtype), d_bias.astype(dt_bias.dtype),
            ds0[:, :, :p, :n].astype(state.dtype))
