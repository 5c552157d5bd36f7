"""Chunked WKV7 (RWKV7) as one Pallas kernel; reference: `jaxembed.ops.wkv7.chunked` (same signature).

One program per (batch row b, head h, block of value rows) walks the chunks of L tokens carrying
the state S [p, n] in registers. With the state S entering a chunk, g the in-chunk cumulative
log decay and the decayed factors of `ops.wkv7.chunk_intra` (Ã, R̃, B̂, K̂, B̄, K̄):

    U   = (I - tril(Ã B̂ᵀ, -1))⁻¹ (Ã Sᵀ + tril(Ã K̂ᵀ, -1) V)        u_t = S_{t-1} a_t   [l, p]
    y   = R̃ Sᵀ + tril(R̃ B̂ᵀ) U + tril(R̃ K̂ᵀ) V                                       [l, p]
    S   = S diag(exp(g_L)) + Uᵀ B̄ + Vᵀ K̄                                             [p, n]

The unit lower-triangular inverse is applied as the product (I + M)(I + M²)(I + M⁴)... , exact
for a strictly lower-triangular M of size L <= 2^k (M^L = 0): log2(L) pairs of matmuls instead
of a row-by-row substitution. Rows of S evolve independently (the transition acts on the key
side), which is what lets programs split the value dim. Everything is float32, like the
reference; zero-padded key columns keep log w = 0 and never touch the real columns.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxembed.kernels import common
from jaxembed.ops import wkv7 as ref

F32 = jnp.float32


def _kernel(r_ref, lw_ref, k_ref, v_ref, a_ref, b_ref, s0_ref, y_ref, s_ref, *, L, n_chunks):
    inclusive, strict = common.causal_masks(L)
    incl_f, strict_f = inclusive.astype(F32), strict.astype(F32)
    after_f = jnp.transpose(strict_f)  # [t, s] = 1 where s > t

    def chunk(c, S):  # S [pb, n]
        t = pl.ds(pl.multiple_of(c * L, L), L)
        r, lw, k, a, b = (ref_[t, :] for ref_ in (r_ref, lw_ref, k_ref, a_ref, b_ref))  # [l, n]
        v = v_ref[t, :]  # [l, pb]
        g, g_prev, g_to_end = common.dot(incl_f, lw), common.dot(strict_f, lw), common.dot(after_f, lw)
        g_end = jnp.sum(lw, axis=0)  # [n]
        a_dec, r_dec = a * jnp.exp(g_prev), r * jnp.exp(g)
        inv = jnp.exp(-g)  # <= exp(0.61 L) (see ops.wkv7.MAX_CHUNK)
        b_inv, k_inv = b * inv, k * inv
        to_end = jnp.exp(g_to_end)
        M_ab = jnp.where(strict, common.dot(a_dec, b_inv, trans_b=True), 0.0)
        M_ak = jnp.where(strict, common.dot(a_dec, k_inv, trans_b=True), 0.0)
        M_rb = jnp.where(inclusive, common.dot(r_dec, b_inv, trans_b=True), 0.0)
        M_rk = jnp.where(inclusive, common.dot(r_dec, k_inv, trans_b=True), 0.0)
        U = common.dot(a_dec, S, trans_b=True) + common.dot(M_ak, v)
        power = M_ab
        for step in range(max(L - 1, 1).bit_length()):  # U = Π_k (I + M^(2^k)) rhs
            U = U + common.dot(power, U)
            if step + 1 < max(L - 1, 1).bit_length():
                power = common.dot(power, power)
        y = common.dot(r_dec, S, trans_b=True) + common.dot(M_rb, U) + common.dot(M_rk, v)
        y_ref[t, :] = y
        return S * jnp.exp(g_end)[None, :] + common.dot(U, b * to_end, trans_a=True) + common.dot(v, k * to_end,
                                                                                                  trans_a=True)

    s_ref[...] = lax.fori_loop(0, n_chunks, chunk, s0_ref[...])


def _forward(r, log_w, k, v, a, b, state, *, blocks, interpret):
    bsz, t, h, n = r.shape
    p = v.shape[-1]
    L = blocks.chunk
    N, P = common.padded(n), common.padded(p)
    pb = blocks.value_block
    T = t + (-t % L)
    # padding steps are identities: log w = 0 and r = k = a = b = v = 0
    key_side = [common.pad_axis(common.pad_axis(x.astype(F32), 1, T), 3, N) for x in (r, log_w, k, a, b)]
    vp = common.pad_axis(common.pad_axis(v.astype(F32), 1, T), 3, P)
    s0 = common.pad_axis(common.pad_axis(state, 2, P), 3, N)

    keys = pl.BlockSpec((None, T, None, N), lambda i, j, m: (i, 0, j, 0))
    values = pl.BlockSpec((None, T, None, pb), lambda i, j, m: (i, 0, j, m))
    st = pl.BlockSpec((None, None, pb, N), lambda i, j, m: (i, j, m, 0))
    rp, lwp, kp, ap, bp = key_side
    y, final = common.call(
        lambda *refs: _kernel(*refs, L=L, n_chunks=T // L),
        grid=(bsz, h, P // pb),
        in_specs=[keys, keys, keys, values, keys, keys, st],
        out_specs=[values, st],
        out_shape=[jax.ShapeDtypeStruct((bsz, T, h, P), F32), jax.ShapeDtypeStruct((bsz, h, P, N), F32)],
        blocks=blocks, interpret=interpret, name="wkv7_chunked",
    )(rp, lwp, kp, vp, ap, bp, s0)
    return y[:, :t, :, :p], final[:, :, :p, :n]


@common.cached
def _differentiable(chunk_size, blocks, interpret):
    def forward(r, log_w, k, v, a, b, state):
        return _forward(r, log_w, k, v, a, b, state, blocks=blocks, interpret=interpret)

    def reference(r, log_w, k, v, a, b, state):
        return ref.chunked(r, log_w, k, v, a, b, chunk_size=chunk_size, initial_state=state)

    return common.with_reference_vjp(forward, reference)


def chunked(r, log_w, k, v, a, b, *, chunk_size: int, initial_state=None, blocks: common.BlockSizes | None = None,
            interpret: bool = False):
    """`ops.wkv7.chunked` computed by the Pallas kernel; gradients are `jax.vjp` of the reference
    (run with chunk_size). Returns (y [b, t, h, p] float32, final state [b, h, p, n] float32)."""
    state = ref._check(r, log_w, k, v, a, b, initial_state)
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or not 1 <= chunk_size <= ref.MAX_CHUNK:
        raise ValueError(f"chunk_size must be an int in [1, {ref.MAX_CHUNK}], got {chunk_size!r}")
    p = v.shape[-1]
    if blocks is None:
        blocks = common.heuristic("wkv7", key_dim=r.shape[-1], value_dim=p)
    blocks = common.check_blocks(blocks, p)
    if blocks.chunk > ref.MAX_CHUNK:
        raise ValueError(f"BlockSizes.chunk = {blocks.chunk} exceeds {ref.MAX_CHUNK}, the largest chunk whose "
                         "factored decays stay inside float32's range")
    if blocks.segments not in (None, 1):  # its segments would also carry the n x n transition diag(w) + a bᵀ
        raise ValueError(f"the WKV7 kernel walks the whole sequence in one program per value block; "
                         f"BlockSizes.segments must be None or 1, got {blocks.segments}")
    return _differentiable(chunk_size, blocks, bool(interpret))(r, log_w, k, v, a, b, state)
