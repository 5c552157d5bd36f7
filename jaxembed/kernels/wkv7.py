"""Chunked WKV7 (RWKV7) as a Pallas kernel (two at small batch, see below); reference: `jaxembed.ops.wkv7.chunked`.

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
reference; the in-chunk sums of log decays are float32 adds (no dot, which TF32 would round);
padded key columns keep log w = 0 (logits of -inf) and never touch the real columns.

With `segments` > 1 (batch 1: too few programs for the GPU) the grid gains a segment axis. The
state update is linear in S: over a segment, S_end = S_in T_seg + H_seg, with T_seg the product
of the segment's transitions diag(w_t) + a_t b_tᵀ [n, n] and H_seg its end state from zero.
`_segment_state_kernel` computes both for every segment but the last, in parallel, by running the
state half of the chunk loop on more rows: the value rows from a zero state (H), and n rows that
start as the identity with v = 0 (T, whose rows evolve like state rows with no input). Segment
k's program enters with S_k = S_{k-1} T_{k-1} + H_{k-1} (S_0 the initial state).

With `BlockSizes.parallel_factors`, the state-independent part of each chunk's work (the inverse and
its products, `_chunk_factors`) is a kernel of one program per chunk, and the walks read its factors:
per chunk y = R Sᵀ + Y and S ← S diag(d) + S A + H (docs/kernels.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxembed.kernels import common
from jaxembed.ops import wkv7 as ref
from jaxembed.ops.common import StateSlot, through_slot

F32 = jnp.float32


def _log_decay_sums(lw):
    """In-chunk sums of the log decays lw [l, n]: through t (g), before t, and after t to the chunk
    end, and the whole chunk's. Adds (a cumsum), not products with 0/1 masks: a float32 dot runs as
    TF32 on the GPU under jax's default precision, which would round every log decay to 10 bits."""
    g = jnp.cumsum(lw, axis=0)
    g_end = jnp.sum(lw, axis=0)  # [n]
    # <= 0 exactly (the sum and the scan add in different orders: their difference can be +1 ulp)
    return g, g - lw, jnp.minimum(g_end[None, :] - g, 0.0), g_end


def _decayed(lw, k, a, b, strict):
    """The chunk's decay-weighted factors from its tiles [l, n] (`ops.wkv7.chunk_intra`): (g, the
    chunk's own log decay g_L [n], Ã, B̂, K̂, B̄, K̄, the strictly lower M_ab = tril(Ã B̂ᵀ, -1) and
    M_ak = tril(Ã K̂ᵀ, -1)); `strict` is the [l, l] mask rows > cols."""
    g, g_prev, g_to_end, g_end = _log_decay_sums(lw)
    to_end = jnp.exp(g_to_end)  # <= 1
    a_dec = a * jnp.exp(g_prev)
    inv = jnp.exp(-g)  # <= exp(0.61 L) (see ops.wkv7.MAX_CHUNK)
    b_inv, k_inv = b * inv, k * inv
    M_ab = jnp.where(strict, common.dot(a_dec, b_inv, trans_b=True), 0.0)
    M_ak = jnp.where(strict, common.dot(a_dec, k_inv, trans_b=True), 0.0)
    return g, g_end, a_dec, b_inv, k_inv, b * to_end, k * to_end, M_ab, M_ak


def _unit_lower_solve(M, rhs, L):
    """(I - M)⁻¹ rhs for a strictly lower-triangular M [L, L], as Π_k (I + M^(2^k)) rhs: exact once
    2^k >= L (M^L = 0), log2(L) pairs of matmuls instead of a row-by-row substitution. rhs is a tuple
    of [L, .] tiles sharing the powers of M."""
    steps = max(L - 1, 1).bit_length()
    power = M
    for step in range(steps):
        rhs = tuple(x + common.dot(power, x) for x in rhs)
        if step + 1 < steps:
            power = common.dot(power, power)
    return rhs


def _through_chunk(S, lw, k, v, a, b, masks, L):
    """The state S [pb, n] entering a chunk -> (U, g, B̂, K̂, the state leaving it)."""
    g, g_end, a_dec, b_inv, k_inv, b_end, k_end, M_ab, M_ak = _decayed(lw, k, a, b, masks[1])
    (U,) = _unit_lower_solve(M_ab, (common.dot(a_dec, S, trans_b=True) + common.dot(M_ak, v),), L)
    S_next = S * jnp.exp(g_end)[None, :] + common.dot(U, b_end, trans_a=True) + common.dot(v, k_end, trans_a=True)
    return U, g, b_inv, k_inv, S_next


def _chunk_factors(tiles, v, L, store):
    """A chunk's state-independent factors (`BlockSizes.parallel_factors`), float32, from its tiles
    (`tiles()` -> r, log w, k, a, b, bonus: [l, n]; `v()` [l, p]): with S [p, n] the state entering it,

        y = R Sᵀ + Y,    S_next = S diag(d) + S A + H

    The fused loop's U = W Sᵀ + U₀ with W = (I - M_ab)⁻¹ Ã [l, n] and U₀ = (I - M_ab)⁻¹ M_ak V [l, p], so
    R = R̃ + tril(R̃ B̂ᵀ) W and Y = tril(R̃ B̂ᵀ) U₀ + tril(R̃ K̂ᵀ) V [l, .], A = Wᵀ B̄ [n, n],
    H = U₀ᵀ B̄ + Vᵀ K̄ [p, n] and d = exp(g_L) [n]. The decay diag(d) stays apart from A, as in the
    fused loop: the state's own term is never rounded by a (TF32) dot.

    `store(name, value)` takes each factor (and the bonus weight) as soon as it is computed, and each of
    the three phases derives the tiles it needs from the refs anew: an [l, 64] float32 tile is l / 2
    registers a thread at 4 warps, and the one-pass form, holding them all across the solve, spilled
    576 B a thread at l = 32 (36 B this way; benchmarks/kernel_registers.py)."""
    inclusive, strict = common.causal_masks(L)

    def decayed():
        r, lw, k, a, b, bonus = tiles()
        return (r, bonus, *_decayed(lw, k, a, b, strict))

    # the solve: W and U₀ share the powers of M_ab
    _, bonus, _, _, a_dec, _, _, _, _, M_ab, M_ak = decayed()
    store("bonus", bonus)
    W, U0 = _unit_lower_solve(M_ab, (a_dec, common.dot(M_ak, v())), L)
    # the state update's factors
    _, _, _, g_end, _, _, _, b_end, k_end, _, _ = decayed()
    store("A", common.dot(W, b_end, trans_a=True))
    store("d", jnp.exp(g_end))
    store("H", common.dot(U0, b_end, trans_a=True) + common.dot(v(), k_end, trans_a=True))
    # the outputs' factors
    r, _, g, _, _, b_inv, k_inv, _, _, _, _ = decayed()
    r_dec = r * jnp.exp(g)
    M_rb = jnp.where(inclusive, common.dot(r_dec, b_inv, trans_b=True), 0.0)
    store("R", r_dec + common.dot(M_rb, W))
    M_rk = jnp.where(inclusive, common.dot(r_dec, k_inv, trans_b=True), 0.0)
    store("Y", common.dot(M_rb, U0) + common.dot(M_rk, v()))


def _key_tiles(r_ref, w_ref, k_ref, a_ref, extra_refs, *, rwkv7: bool):
    """tiles(t) -> (r, log w, k, a, b, bonus weight) at chunk rows t, float32 [l, n] (the bonus
    weight [l], or None). The delta rule's refs: a and b (extra_refs = (b,)). With `rwkv7`, RWKV7's
    projections: a_ref holds a's LoRA output, extra_refs the head's a0, k_k, k_a and r_k [n], and k,
    a, b and the bonus weight are derived here (`ops.wkv7.rwkv7_inputs`). log w is RWKV7's map of the
    logits (`ops.wkv7.log_decay`); r_ref may be None (no outputs, no bonus)."""

    def tiles(t):
        r = None if r_ref is None else r_ref[t, :].astype(F32)
        lw, k = ref.log_decay(w_ref[t, :]), k_ref[t, :]
        if not rwkv7:
            (b_ref,) = extra_refs
            return r, lw, k.astype(F32), a_ref[t, :].astype(F32), b_ref[t, :].astype(F32), None
        a0, k_k, k_a, r_k = (p_ref[...] for p_ref in extra_refs)
        key, a, b, bonus = ref.rwkv7_inputs(k, a_ref[t, :], a0, k_k, k_a, r=r, r_k=r_k)
        return r, lw, key, a, b, bonus

    return tiles


def _walk(chunk, s0_ref, layer_ref, seg_T_ref, seg_H_ref, s_ref, *, value_block, chunks, segments):
    """Run `chunk(c, S)` over segment `program_id(3)`'s chunks (all of them when segments == 1), from
    the initial state carried through the segments before it by their transitions and own end
    states, and store the final state from the last segment. `layer_ref`: the state refs are the
    stack of every layer's states, and it says whose entry (`common.state_tile`)."""
    tile = common.state_tile(layer_ref, value_block, axis=2)  # [pb, n] of [b, h, p, n]
    S, first = s0_ref[tile], 0
    if segments > 1:
        segment = pl.program_id(3)
        S = lax.fori_loop(0, segment, lambda j, S: common.dot(S, seg_T_ref[j]) + seg_H_ref[j], S)
        first = segment * chunks
    end = lax.fori_loop(first, first + chunks, chunk, S)
    common.at_sequence_end(segments, lambda: s_ref.__setitem__(tile, end))


def _state_refs(refs, *, segments, in_place):
    """(layer_ref, the segments' T and H refs, the rest) of a walk's refs after its initial state."""
    layer_ref, *refs = refs if in_place else (None, *refs)
    seg_T_ref, seg_H_ref, *refs = refs if segments > 1 else (None, None, *refs)
    return layer_ref, seg_T_ref, seg_H_ref, refs


def _kernel(r_ref, w_ref, k_ref, v_ref, a_ref, *refs, L, chunks, segments, rwkv7, in_place):
    """The fused walk: every chunk's intra-chunk work and state update in one loop (`_walk`). With
    `rwkv7` (`_key_tiles`) it also writes each token's bonus weight."""
    extra, (s0_ref, *refs) = (refs[:4], refs[4:]) if rwkv7 else (refs[:1], refs[1:])
    layer_ref, seg_T_ref, seg_H_ref, (y_ref, *refs) = _state_refs(refs, segments=segments, in_place=in_place)
    bonus_ref, s_ref = refs if rwkv7 else (None, *refs)
    tiles = _key_tiles(r_ref, w_ref, k_ref, a_ref, extra, rwkv7=rwkv7)
    masks = common.causal_masks(L)
    inclusive = masks[0]

    def chunk(c, S):  # S [pb, n]
        t = pl.ds(pl.multiple_of(c * L, L), L)
        r, lw, k, a, b, bonus = tiles(t)  # [l, n]
        if bonus_ref is not None:
            bonus_ref[t] = bonus
        v = v_ref[t, :].astype(F32)  # [l, pb]
        U, g, b_inv, k_inv, S_next = _through_chunk(S, lw, k, v, a, b, masks, L)
        r_dec = r * jnp.exp(g)
        M_rb = jnp.where(inclusive, common.dot(r_dec, b_inv, trans_b=True), 0.0)
        M_rk = jnp.where(inclusive, common.dot(r_dec, k_inv, trans_b=True), 0.0)
        y = common.dot(r_dec, S, trans_b=True) + common.dot(M_rb, U) + common.dot(M_rk, v)
        y_ref[t, :] = y.astype(y_ref.dtype)
        return S_next

    _walk(chunk, s0_ref, layer_ref, seg_T_ref, seg_H_ref, s_ref, value_block=v_ref.shape[-1], chunks=chunks,
          segments=segments)


def _factor_kernel(r_ref, w_ref, k_ref, v_ref, a_ref, *refs, L, rwkv7):
    """One chunk's `_chunk_factors` (and, with `rwkv7`, its tokens' bonus weights): one program per
    (batch row, head, chunk), no state, so every chunk at once."""
    extra, (R_ref, Y_ref, A_ref, d_ref, H_ref, *bonus_ref) = (refs[:4], refs[4:]) if rwkv7 else (refs[:1], refs[1:])
    tiles = _key_tiles(r_ref, w_ref, k_ref, a_ref, extra, rwkv7=rwkv7)
    outs = {"R": R_ref, "Y": Y_ref, "A": A_ref, "d": d_ref, "H": H_ref, "bonus": bonus_ref[0] if rwkv7 else None}

    def store(name, value):
        if outs[name] is not None:
            outs[name][...] = value

    _chunk_factors(lambda: tiles(slice(None)), lambda: v_ref[...].astype(F32), L, store)


def _factored_step(S, c, A_ref, d_ref, H_ref, H=None):
    """The state leaving chunk c from the state S [pb, n] entering it: S diag(d) + S A + H."""
    return S * d_ref[pl.ds(c, 1), :] + common.dot(S, A_ref[c]) + (H_ref[c] if H is None else H)


def _factored_kernel(R_ref, Y_ref, A_ref, d_ref, H_ref, s0_ref, *refs, L, chunks, segments, in_place):
    """The walk over precomputed chunk factors (`_factor_kernel`): per chunk y = R Sᵀ + Y and the
    state update, two [l or pb, n] x [n, .] products."""
    layer_ref, seg_T_ref, seg_H_ref, (y_ref, s_ref) = _state_refs(refs, segments=segments, in_place=in_place)

    def chunk(c, S):
        t = pl.ds(pl.multiple_of(c * L, L), L)
        y_ref[t, :] = (common.dot(R_ref[t, :], S, trans_b=True) + Y_ref[t, :]).astype(y_ref.dtype)
        return _factored_step(S, c, A_ref, d_ref, H_ref)

    _walk(chunk, s0_ref, layer_ref, seg_T_ref, seg_H_ref, s_ref, value_block=Y_ref.shape[-1], chunks=chunks,
          segments=segments)


def _segment_start(shape, value_blocks):
    """(whether this program's rows are transition rows, their start): row blocks below
    `value_blocks` are value rows entered with a zero state, the others rows of the identity
    (rows past n stay zero)."""
    block = pl.program_id(2)
    transition = block >= value_blocks
    rows = lax.broadcasted_iota(jnp.int32, shape, 0) + (block - value_blocks) * shape[0]
    cols = lax.broadcasted_iota(jnp.int32, shape, 1)
    return transition, jnp.where(jnp.logical_and(transition, rows == cols), 1.0, 0.0).astype(F32)


def _segment_state_kernel(w_ref, k_ref, v_ref, a_ref, *refs, L, chunks, value_blocks, rwkv7):
    """Rows of segment `program_id(3)`'s [H; T] (see the module docstring), the transition rows
    entered with v = 0 (`_segment_start`)."""
    *extra, s_ref = refs
    tiles = _key_tiles(None, w_ref, k_ref, a_ref, extra, rwkv7=rwkv7)
    masks = common.causal_masks(L)
    transition, S0 = _segment_start(s_ref.shape, value_blocks)

    def chunk(c, S):
        t = pl.ds(pl.multiple_of(c * L, L), L)
        _, lw, k, a, b, _ = tiles(t)
        v = v_ref[t, :].astype(F32)
        return _through_chunk(S, lw, k, jnp.where(transition, jnp.zeros_like(v), v), a, b, masks, L)[-1]

    first = pl.program_id(3) * chunks
    s_ref[...] = lax.fori_loop(first, first + chunks, chunk, S0)


def _factored_segment_kernel(A_ref, d_ref, H_ref, s_ref, *, chunks, value_blocks):
    """`_segment_state_kernel` over precomputed chunk factors: transition rows take no H."""
    transition, S0 = _segment_start(s_ref.shape, value_blocks)

    def chunk(c, S):
        return _factored_step(S, c, A_ref, d_ref, H_ref, H=jnp.where(transition, 0.0, H_ref[c]))

    first = pl.program_id(3) * chunks
    s_ref[...] = lax.fori_loop(first, first + chunks, chunk, S0)


def _forward(r, w_logit, k, v, a, extra, state, *, rwkv7, blocks, interpret):
    """The kernels on the delta rule's inputs (extra = (b,)) or, with `rwkv7`, on RWKV7's
    projections (a = a's LoRA output, extra = (a0, k_k, k_a, r_k) [h, n]; `_key_tiles`). Returns
    (y, the bonus weight [b, t, h] float32 or None, final state). A `StateSlot` state is read and
    written in place in its stack where the kernel can address it (`common.addressable_slot`),
    else copied out and back; the final state is then the slot. With `blocks.parallel_factors`, a
    kernel parallel over chunks computes every chunk's `_chunk_factors` first, and the walk reads them."""
    bsz, t, h, n = r.shape
    p = v.shape[-1]
    L = blocks.chunk
    N, P = common.padded(n), common.padded(p)
    pb = blocks.value_block
    vb = P // pb
    segments, chunks, T = common.segment_layout(blocks, programs=bsz * h * vb, t=t)
    in_place = common.addressable_slot(state, segments=segments, padded=(P, N) != (p, n))
    if isinstance(state, StateSlot) and not in_place:
        y, bonus, end = _forward(r, w_logit, k, v, a, extra, state.read().astype(F32), rwkv7=rwkv7, blocks=blocks,
                                 interpret=interpret)
        return y, bonus, state.write(end)
    # padding steps are identities: log w = 0 (a logit of -inf) and r = k = a = b = v = 0 (RWKV7's
    # k = 0 gives key = a = b = 0 whatever a's LoRA). Inputs stay in their dtype (the kernel casts
    # each tile to float32 as it loads it): no float32 copies.
    rp, lwp, kp, ap = (common.pad_axis(common.pad_axis(x, 1, T, fill), 3, N, fill)
                       for x, fill in ((r, 0.0), (w_logit, -jnp.inf), (k, 0.0), (a, 0.0)))
    vp = common.pad_axis(common.pad_axis(v, 1, T), 3, P)

    keys = pl.BlockSpec((None, T, None, N), lambda i, j, z, s: (i, 0, j, 0))
    values = pl.BlockSpec((None, T, None, pb), lambda i, j, z, s: (i, 0, j, z))
    st = pl.BlockSpec((None, None, pb, N), lambda i, j, z, s: (i, j, z, 0))
    if in_place:
        state_args, state_specs = common.slot_inputs(state)
    else:
        state_args, state_specs = [common.pad_axis(common.pad_axis(state, 2, P), 3, N)], [st]
    if rwkv7:  # the head's a0, k_k, k_a, r_k
        extra_args = [common.pad_axis(x, 1, N) for x in extra]
        extra_key_specs = [pl.BlockSpec((None, N), lambda i, j, *_: (j, 0))] * 4
    else:  # b
        extra_args = [common.pad_axis(common.pad_axis(extra[0], 1, T), 3, N)]
        extra_key_specs = [keys]
    transition_blocks = -(-N // pb)
    # the segment-state kernel's transition row blocks read (and zero) the last value block: any would do
    transition_block = lambda z: jnp.minimum(z, vb - 1)
    if blocks.parallel_factors:
        n_chunks = T // L
        chunk_keys = pl.BlockSpec((None, L, None, N), lambda i, j, c: (i, c, j, 0))
        chunk_values = pl.BlockSpec((None, L, None, P), lambda i, j, c: (i, c, j, 0))
        factor_shapes = [jax.ShapeDtypeStruct((bsz, T, h, N), F32), jax.ShapeDtypeStruct((bsz, T, h, P), F32),
                         jax.ShapeDtypeStruct((bsz, h, n_chunks, N, N), F32),
                         jax.ShapeDtypeStruct((bsz, h, n_chunks, N), F32),
                         jax.ShapeDtypeStruct((bsz, h, n_chunks, P, N), F32)]
        R, Y, A, d, H, *bonus = common.call(
            lambda *refs: _factor_kernel(*refs, L=L, rwkv7=rwkv7), grid=(bsz, h, n_chunks),
            in_specs=[chunk_keys, chunk_keys, chunk_keys, chunk_values, chunk_keys,
                      *(extra_key_specs if rwkv7 else [chunk_keys])],
            out_specs=[chunk_keys, chunk_values,
                       pl.BlockSpec((None, None, None, N, N), lambda i, j, c: (i, j, c, 0, 0)),
                       pl.BlockSpec((None, None, None, N), lambda i, j, c: (i, j, c, 0)),
                       pl.BlockSpec((None, None, None, P, N), lambda i, j, c: (i, j, c, 0, 0)),
                       *([pl.BlockSpec((None, L, None), lambda i, j, c: (i, c, j))] if rwkv7 else [])],
            out_shape=[*factor_shapes, *([jax.ShapeDtypeStruct((bsz, T, h), F32)] if rwkv7 else [])],
            blocks=blocks, interpret=interpret, name="wkv7_chunk_factors",
        )(rp, lwp, kp, vp, ap, *extra_args)
        bonus = bonus[0] if bonus else None

        def factor_specs(value_block):
            return [pl.BlockSpec((None, None, n_chunks, N, N), lambda i, j, z, s: (i, j, 0, 0, 0)),
                    pl.BlockSpec((None, None, n_chunks, N), lambda i, j, z, s: (i, j, 0, 0)),
                    pl.BlockSpec((None, None, n_chunks, pb, N), lambda i, j, z, s: (i, j, 0, value_block(z), 0))]

        segment_kernel = functools.partial(_factored_segment_kernel, chunks=chunks, value_blocks=vb)
        segment_args, segment_specs = (A, d, H), factor_specs(transition_block)
        walk_kernel = functools.partial(_factored_kernel, L=L, chunks=chunks, segments=segments, in_place=in_place)
        walk_args, walk_specs = (R, Y, A, d, H), [keys, values, *factor_specs(lambda z: z)]
        walk_outs, walk_shapes = [], []
    else:
        segment_kernel = functools.partial(_segment_state_kernel, L=L, chunks=chunks, value_blocks=vb, rwkv7=rwkv7)
        segment_args = (lwp, kp, vp, ap, *extra_args)
        transition_values = pl.BlockSpec((None, T, None, pb), lambda i, j, z, s: (i, 0, j, transition_block(z)))
        segment_specs = [keys, keys, transition_values, keys, *extra_key_specs]
        walk_kernel = functools.partial(_kernel, L=L, chunks=chunks, segments=segments, rwkv7=rwkv7, in_place=in_place)
        walk_args, walk_specs = (rp, lwp, kp, vp, ap, *extra_args), [keys, keys, keys, values, keys, *extra_key_specs]
        # with rwkv7, the bonus weight per token and head, one column per value block (each program
        # writes its own; they are equal)
        walk_outs = [pl.BlockSpec((None, T, None, None), lambda i, j, z, s: (i, 0, j, z))] if rwkv7 else []
        walk_shapes = [jax.ShapeDtypeStruct((bsz, T, h, vb), F32)] if rwkv7 else []
    seg_specs, seg_args = [], []
    if segments > 1:
        rows = P + transition_blocks * pb  # [H; T] per segment, T's rows padded to whole blocks
        own = common.call(
            segment_kernel, grid=(bsz, h, vb + transition_blocks, segments - 1), in_specs=segment_specs,
            out_specs=pl.BlockSpec((None, None, None, pb, N), lambda i, j, z, s: (i, j, s, z, 0)),
            out_shape=jax.ShapeDtypeStruct((bsz, h, segments - 1, rows, N), F32), blocks=blocks, interpret=interpret,
            name="wkv7_segment_states",
        )(*segment_args)
        seg_specs = [pl.BlockSpec((None, None, segments - 1, N, N), lambda i, j, z, s: (i, j, 0, 0, 0)),
                     pl.BlockSpec((None, None, segments - 1, pb, N), lambda i, j, z, s: (i, j, 0, z, 0))]
        seg_args = [own[:, :, :, P:P + N], own]  # T (a small copy), and H read in place (rows below P)
    if in_place:  # the stack itself, aliased to the stack passed in
        ends_spec, ends_shape = pl.BlockSpec(), state_args[0].shape
    else:
        ends_spec, ends_shape = st, (bsz, h, P, N)
    y, *walk_out, ends = common.call(
        walk_kernel, grid=(bsz, h, vb, segments), in_specs=[*walk_specs, *state_specs, *seg_specs],
        out_specs=[values, *walk_outs, ends_spec],
        out_shape=[jax.ShapeDtypeStruct((bsz, T, h, P), v.dtype), *walk_shapes, jax.ShapeDtypeStruct(ends_shape, F32)],
        blocks=blocks, interpret=interpret, name="wkv7_chunked",
        input_output_aliases={len(walk_args): 1 + len(walk_outs)} if in_place else None,
    )(*walk_args, *state_args, *seg_args)
    end = StateSlot(ends, state.layer) if in_place else ends[:, :, :p, :n]
    if walk_out:  # the fused walk's bonus weights, one (equal) column per value block
        bonus = walk_out[0][..., 0]
    return y[:, :t, :, :p], (bonus[:, :t, :] if rwkv7 else None), end


@common.cached
def _differentiable(chunk_size, blocks, interpret):
    def forward(r, w_logit, k, v, a, b, state):
        y, _, end = _forward(r, w_logit, k, v, a, (b,), state, rwkv7=False, blocks=blocks, interpret=interpret)
        return y, end

    def reference(r, w_logit, k, v, a, b, state):
        return through_slot(ref.chunked, r, w_logit, k, v, a, b, chunk_size=chunk_size, initial_state=state)

    return common.with_reference_vjp(forward, reference)


@common.cached
def _differentiable_rwkv7(chunk_size, blocks, interpret):
    def forward(r, w_logit, k, v, a_lora, a0, k_k, k_a, r_k, state):
        return _forward(r, w_logit, k, v, a_lora, (a0, k_k, k_a, r_k), state, rwkv7=True, blocks=blocks,
                        interpret=interpret)

    def reference(r, w_logit, k, v, a_lora, a0, k_k, k_a, r_k, state):
        return through_slot(ref.rwkv7_chunked, r, w_logit, k, v, a_lora, a0, k_k, k_a, r_k, chunk_size=chunk_size,
                            initial_state=state)

    return common.with_reference_vjp(forward, reference)


def _checked_blocks(chunk_size, blocks, key_dim, value_dim):
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or not 1 <= chunk_size <= ref.MAX_CHUNK:
        raise ValueError(f"chunk_size must be an int in [1, {ref.MAX_CHUNK}], got {chunk_size!r}")
    if blocks is None:
        blocks = common.heuristic("wkv7", key_dim=key_dim, value_dim=value_dim)
    blocks = common.check_blocks(blocks, value_dim, kernel="wkv7")
    if blocks.chunk > ref.MAX_CHUNK:
        raise ValueError(f"BlockSizes.chunk = {blocks.chunk} exceeds {ref.MAX_CHUNK}, the largest chunk whose "
                         "factored decays stay inside float32's range")
    return blocks


def chunked(r, w_logit, k, v, a, b, *, chunk_size: int, initial_state=None, blocks: common.BlockSizes | None = None,
            interpret: bool = False):
    """`ops.wkv7.chunked` computed by the Pallas kernel; gradients are `jax.vjp` of the reference
    (run with chunk_size). Returns (y [b, t, h, p] in v's dtype, final state [b, h, p, n] float32)."""
    state = ref._check(r, w_logit, k, v, a, b, initial_state)
    blocks = _checked_blocks(chunk_size, blocks, r.shape[-1], v.shape[-1])
    return _differentiable(chunk_size, blocks, bool(interpret))(r, w_logit, k, v, a, b, state)


def rwkv7_chunked(r, w_logit, k, v, a_lora, a0, k_k, k_a, r_k, *, chunk_size: int, initial_state=None,
                  blocks: common.BlockSizes | None = None, interpret: bool = False):
    """`ops.wkv7.rwkv7_chunked` computed by the Pallas kernel, which derives RWKV7's key, a, b and
    bonus weight from k and a's LoRA output per tile (`_key_tiles`); gradients are `jax.vjp` of the
    reference. Returns (y [b, t, h, p] in v's dtype, bonus weight [b, t, h] float32, final state)."""
    state = ref._check(r, w_logit, k, v, a_lora, a_lora, initial_state)
    ref.check_head_params(r, a0=a0, k_k=k_k, k_a=k_a, r_k=r_k)
    blocks = _checked_blocks(chunk_size, blocks, r.shape[-1], v.shape[-1])
    return _differentiable_rwkv7(chunk_size, blocks, bool(interpret))(r, w_logit, k, v, a_lora, a0, k_k, k_a, r_k,
                                                                       state)
