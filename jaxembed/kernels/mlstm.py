"""Chunkwise mLSTM (xLSTM) as Pallas kernels; reference: `jaxembed.ops.mlstm.chunked` (same signature).

One program per (batch row b, head h, block of value columns) walks the chunks of L tokens
carrying the stabilised state (C [k, v], n [k], m) in registers. For one chunk, with bc the
in-chunk cumulative log forget gate and i the input gate preactivations (float32):

    m_t  = max(bc_t + m, max_{s<=t} (bc_t - bc_s + i_s))           the recurrent max state
    D    = tril(exp(bc_t - bc_s + i_s - m_t))                       [l, s]
    h_t  = ((q̂ kᵀ ∘ D) v + exp(bc_t + m - m_t) q̂ C)_t / (max(|den_t|, exp(-m_t)) + eps)
    C, n, m  <-  the chunk's own state (weights exp(bc_L - bc_s + i_s - m_loc)) merged with the
                 decayed entering one under m' = max(bc_L + m, m_loc)

exactly `ops.mlstm.chunk_output`, `chunk_local_states` and `chunk_states` fused per chunk. The
normaliser needs all of n, so every program keeps the full n [k] (a vector) next to its C block.

The intra-chunk scores q̂ kᵀ ∘ D do not depend on the value columns, and at xLSTM 7B's shapes
(v = 512, blocks of 32) each of 16 programs of a head computed them again: half the chunk loop's
instructions. `_scores_kernel` computes them once per (row, head, chunk), stabilised by the row's
own max m'_t = max_{s<=t} (bc_t - bc_s + i_s), and writes them in v's dtype with m' and their row
sums; the loop rescales by exp(m'_t - m_t) <= 1 after the product with v, as D = D' exp(m'_t - m_t).
Matmul operands are in the activation dtype (the carried C is cast for q̂ C); gates, the D
matrix, n, m and the accumulation are float32. The two products with n-sized vectors, q̂ n and
n's own update kᵀ w, run on the tensor cores at (near) float32 precision (`_matvec`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxembed.errors import check_positive_int
from jaxembed.kernels import common
from jaxembed.ops import mlstm as ref
from jaxembed.ops.common import StateSlot, through_slot

F32 = jnp.float32


def _merge(C, n, m, log_f, C_own, n_own, m_own):
    """The state (C, n, m) carried across a stretch whose summed log forget gate is log_f, merged
    with that stretch's own end state (entered from zero), under m' = max(log_f + m, m_own)."""
    m_new = jnp.maximum(log_f + m, m_own)
    old, new = jnp.exp(log_f + m - m_new), jnp.exp(m_own - m_new)
    return old * C + new * C_own, old * n + new * n_own, m_new


def _matvec(x, vec, *, trans: bool = False):
    """x vec (x [l, k], vec [k]) or, with trans, xᵀ vec (x [s, k], vec [s]), for a float32 vec ->
    float32. For bfloat16 x on the tensor cores: vec split into bfloat16 hi + lo (16 of float32's 24
    mantissa bits; their products with x are exact) as columns 0 and 1 of a [., 16] operand. As an
    elementwise product and sum, each use held a [64, 256] float32 tile in registers (with the
    scores still in the loop: 412 bytes of spills per thread at xLSTM 7B's shapes, 172 this way;
    benchmarks/kernel_registers.py)."""
    if x.dtype != jnp.bfloat16:  # a float32 dot would run as TF32 on the GPU, float16 lacks the range
        return jnp.sum(x.astype(F32) * (vec[:, None] if trans else vec[None, :]), axis=0 if trans else 1)
    hi = vec.astype(x.dtype)
    lo = (vec - hi.astype(F32)).astype(x.dtype)
    column = lax.broadcasted_iota(jnp.int32, (vec.shape[0], 16), 1)
    rhs = jnp.where(column == 0, hi[:, None], jnp.where(column == 1, lo[:, None], 0.0).astype(x.dtype))
    return jnp.sum(common.dot(x, rhs, trans_a=trans), axis=1)


def _state_step(carry, k, v, ig, bc):
    """The state entering a chunk -> the state leaving it: the chunk's own end state, stabilised
    by its own max, merged with the decayed entering one."""
    bc_end = jnp.min(bc)  # bc falls monotonically (log σ(f) <= 0): min = the chunk's last entry
    a = bc_end - bc + ig  # [s]
    m_loc = jnp.max(a)
    weight = jnp.exp(a - m_loc)  # [s]
    kw = (k.astype(F32) * weight[:, None]).astype(v.dtype)  # [s, k]
    return _merge(*carry, bc_end, common.dot(kw, v, trans_a=True), _matvec(k, weight, trans=True), m_loc)


def _scores_kernel(q_ref, k_ref, i_ref, bc_ref, S_ref, m_ref, den_ref, *, L, scale):
    """Chunk `program_id(2)`'s intra-chunk scores, which no value column changes: S' = (q kᵀ ∘ D')
    scale [l, s] in v's dtype, D' = tril(exp(bc_t - bc_s + i_s - m'_t)) stabilised by the row's own
    max m'_t = max_{s<=t} (bc_t - bc_s + i_s) (so D' <= 1), m' and the row sums of S' (float32)."""
    causal, _ = common.causal_masks(L)
    ig, bc = i_ref[...], bc_ref[...]
    log_d = bc[:, None] - bc[None, :] + ig[None, :]  # [l, s]
    m_intra = jnp.max(jnp.where(causal, log_d, -jnp.inf), axis=1)
    D = jnp.where(causal, jnp.exp(jnp.minimum(log_d - m_intra[:, None], 0.0)), 0.0)
    S = common.dot(q_ref[...], k_ref[...], trans_b=True) * (D * scale)
    S_ref[...] = S.astype(S_ref.dtype)
    m_ref[...] = m_intra
    den_ref[...] = jnp.sum(S, axis=1)


def _chunk_output(q, v, S, m_intra, den_intra, bc, C, n, m, *, scale, eps):
    """One chunk's h [l, vb] (float32) from the state entering it (C [k, vb], n [k], m) and its
    intra-chunk scores S' [l, s] (stabilised by their rows' own max m'_t, with row sums den'):
    the row max under the entering state is m_t = max(bc_t + m, m'_t), and the scores are
    rescaled by exp(m'_t - m_t) <= 1 after their product with v."""
    log_inter = bc + m
    m_row = jnp.maximum(log_inter, m_intra)
    intra = jnp.exp(m_intra - m_row)
    w = jnp.exp(log_inter - m_row) * scale  # the entering state's weight (<= 1) and q's scale
    num = intra[:, None] * common.dot(S, v) + w[:, None] * common.dot(q, C.astype(q.dtype))
    den = intra * den_intra + w * _matvec(q, n)
    return num / (jnp.maximum(jnp.abs(den), jnp.exp(-m_row)) + eps)[:, None]


def _kernel(q_ref, k_ref, v_ref, i_ref, bc_ref, C0_ref, *refs, L, chunks, segments, scale, eps, in_place, entering):
    """Segment `program_id(3)` of the sequence (all of it when segments == 1), `chunks` chunks,
    entered with the initial state merged with the own end states of the segments before it.
    `in_place`: the C refs are the stack of every layer's C, and `layer_ref` says whose entry
    (`common.state_tile`). Per chunk it writes the outputs (the intra-chunk scores come from
    `_scores_kernel`) or, with `entering` (`BlockSizes.parallel_outputs`), the state entering
    the chunk, from which `_output_kernel` computes them."""
    layer_ref, n0_ref, m0_ref, *refs = refs if in_place else (None, *refs)
    if segments > 1:
        seg_f_ref, seg_C_ref, seg_n_ref, seg_m_ref, *refs = refs
    if entering:
        C_in_ref, n_in_ref, m_in_ref, C_ref, n_ref, m_ref = refs
    else:
        S_ref, m_intra_ref, den_intra_ref, h_ref, C_ref, n_ref, m_ref = refs

    def chunk(c, carry):
        t = pl.ds(pl.multiple_of(c * L, L), L)
        k, v = k_ref[t, :], v_ref[t, :]  # [l, k] [l, vb]
        ig, bc = i_ref[t], bc_ref[t]  # [l]
        if entering:  # C [k, vb] in the dtype the output's product casts it to, n [k], m
            C_in_ref[c, :, :] = carry[0].astype(C_in_ref.dtype)
            n_in_ref[c, :] = carry[1]
            m_in_ref[pl.ds(c, 1)] = jnp.full((1,), carry[2], F32)
        else:
            h = _chunk_output(q_ref[t, :], v, S_ref[t, :], m_intra_ref[t], den_intra_ref[t], bc, *carry, scale=scale,
                              eps=eps)
            h_ref[t, :] = h.astype(h_ref.dtype)
        return _state_step(carry, k, v, ig, bc)

    tile = common.state_tile(layer_ref, v_ref.shape[-1], axis=3)  # [k, vb] of C [b, h, k, v]
    carry, first = (C0_ref[tile], n0_ref[...], m0_ref[...]), 0
    if segments > 1:
        segment = pl.program_id(3)
        carry = lax.fori_loop(0, segment, lambda j, carry: _merge(*carry, seg_f_ref[j], seg_C_ref[j], seg_n_ref[j],
                                                                  seg_m_ref[j]), carry)
        first = segment * chunks
    end = lax.fori_loop(first, first + chunks, chunk, carry)

    def store():
        C_ref[tile], n_ref[...], m_ref[...] = end

    common.at_sequence_end(segments, store)


def _output_kernel(q_ref, v_ref, bc_ref, S_ref, m_intra_ref, den_intra_ref, C_in_ref, n_in_ref, m_in_ref, h_ref, *,
                   scale, eps):
    """h of chunk `program_id(2)`, value block `program_id(3)`, from the state entering the chunk
    (written by `_kernel` with `entering`): no loop, one program per chunk."""
    h = _chunk_output(q_ref[...], v_ref[...], S_ref[...], m_intra_ref[...], den_intra_ref[...], bc_ref[...],
                      C_in_ref[...], n_in_ref[...], m_in_ref[...], scale=scale, eps=eps)
    h_ref[...] = h.astype(h_ref.dtype)


def _segment_state_kernel(k_ref, v_ref, i_ref, bc_ref, C_ref, n_ref, m_ref, *, L, chunks):
    """The end state of segment `program_id(3)` entered from zero (m = PAD_I: no weight): the state
    half of `_kernel`'s loop."""

    def chunk(c, carry):
        t = pl.ds(pl.multiple_of(c * L, L), L)
        return _state_step(carry, k_ref[t, :], v_ref[t, :], i_ref[t], bc_ref[t])

    first = pl.program_id(3) * chunks
    zero = (jnp.zeros(C_ref.shape, F32), jnp.zeros(n_ref.shape, F32), jnp.full(m_ref.shape, ref.PAD_I, F32))
    C_ref[...], n_ref[...], m_ref[...] = lax.fori_loop(first, first + chunks, chunk, zero)


def _forward(q, k, v, i, f, C0, n0, m0, *, eps, blocks, interpret):
    """The kernels; C0 may be a `StateSlot`, read and written in place in its stack where the
    kernel can address it (`common.addressable_slot`), else copied out and back (the final C is
    then the slot)."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    L = blocks.chunk
    K, V = common.padded(dk), common.padded(dv)
    vb = blocks.value_block
    nvb = V // vb
    segments, chunks, T = common.segment_layout(blocks, programs=b * h * nvb, t=t)
    in_place = common.addressable_slot(C0, segments=segments, padded=(K, V) != (dk, dv))
    if isinstance(C0, StateSlot) and not in_place:
        hh, (C, n, m) = _forward(q, k, v, i, f, C0.read().astype(F32), n0, m0, eps=eps, blocks=blocks,
                                 interpret=interpret)
        return hh, ref.State(C0.write(C), n, m)
    # padding tokens neither decay (log σ(f) = 0) nor write (i = PAD_I)
    ig = common.pad_axis(jnp.moveaxis(i.astype(F32), 1, 2), 2, T, ref.PAD_I)  # [b, h, T]
    logf = common.pad_axis(jnp.moveaxis(jax.nn.log_sigmoid(f.astype(F32)), 1, 2), 2, T)
    bc = jnp.cumsum(logf.reshape(b, h, T // L, L), axis=-1).reshape(b, h, T)
    qp, kp = (common.pad_axis(common.pad_axis(x, 1, T), 3, K) for x in (q, k))
    vp = common.pad_axis(common.pad_axis(v, 1, T), 3, V)
    n0p = common.pad_axis(n0, 2, K)

    keys = pl.BlockSpec((None, T, None, K), lambda x, y, z, s: (x, 0, y, 0))
    values = pl.BlockSpec((None, T, None, vb), lambda x, y, z, s: (x, 0, y, z))
    gates = pl.BlockSpec((None, None, T), lambda x, y, z, s: (x, y, 0))
    if in_place:
        C_args, C_specs = common.slot_inputs(C0)
    else:
        C_args = [common.pad_axis(common.pad_axis(C0, 2, K), 3, V)]
        C_specs = [pl.BlockSpec((None, None, K, vb), lambda x, y, z, s: (x, y, 0, z))]
    n_in = pl.BlockSpec((None, None, K), lambda x, y, z, s: (x, y, 0))
    m_in = pl.BlockSpec((None, None), lambda x, y, z, s: (x, y))
    # every value block computes the same n and m; each writes its own copy (no shared writes). The
    # final state is the last segment's; the segment-state kernel writes each segment's own
    C_out = pl.BlockSpec((None, None, K, vb), lambda x, y, z, s: (x, y, 0, z))
    n_out = pl.BlockSpec((None, None, None, K), lambda x, y, z, s: (x, y, z, 0))
    m_out = pl.BlockSpec((None, None, None), lambda x, y, z, s: (x, y, z))
    own_C_out = pl.BlockSpec((None, None, None, K, vb), lambda x, y, z, s: (x, y, s, 0, z))
    own_n_out = pl.BlockSpec((None, None, None, None, K), lambda x, y, z, s: (x, y, s, z, 0))
    own_m_out = pl.BlockSpec((None, None, None, None), lambda x, y, z, s: (x, y, s, z))
    extra_specs, extra_args = [], []
    if segments > 1:
        own = common.call(
            lambda *refs: _segment_state_kernel(*refs, L=L, chunks=chunks),
            grid=(b, h, nvb, segments - 1), in_specs=[keys, values, gates, gates],
            out_specs=[own_C_out, own_n_out, own_m_out],
            out_shape=[jax.ShapeDtypeStruct((b, h, segments - 1, K, V), F32),
                       jax.ShapeDtypeStruct((b, h, segments - 1, nvb, K), F32),
                       jax.ShapeDtypeStruct((b, h, segments - 1, nvb), F32)],
            blocks=blocks, interpret=interpret, name="mlstm_segment_states",
        )(kp, vp, ig, bc)
        segment_log_f = logf.reshape(b, h, segments, T // segments).sum(axis=-1)[..., :-1]
        extra_specs = [pl.BlockSpec((None, None, segments - 1), lambda x, y, z, s: (x, y, 0)),
                       pl.BlockSpec((None, None, segments - 1, K, vb), lambda x, y, z, s: (x, y, 0, 0, z)),
                       pl.BlockSpec((None, None, segments - 1, None, K), lambda x, y, z, s: (x, y, 0, z, 0)),
                       pl.BlockSpec((None, None, segments - 1, None), lambda x, y, z, s: (x, y, 0, z))]
        extra_args = [segment_log_f, *own]
    # the intra-chunk scores once per (row, head, chunk), not once per value block
    chunk_keys = pl.BlockSpec((None, L, None, K), lambda x, y, c: (x, c, y, 0))
    chunk_gates = pl.BlockSpec((None, None, L), lambda x, y, c: (x, y, c))
    scores = common.call(
        lambda *refs: _scores_kernel(*refs, L=L, scale=dk**-0.5), grid=(b, h, T // L),
        in_specs=[chunk_keys, chunk_keys, chunk_gates, chunk_gates],
        out_specs=[pl.BlockSpec((None, None, L, L), lambda x, y, c: (x, y, c, 0)), chunk_gates, chunk_gates],
        out_shape=[jax.ShapeDtypeStruct((b, h, T, L), v.dtype), jax.ShapeDtypeStruct((b, h, T), F32),
                   jax.ShapeDtypeStruct((b, h, T), F32)],
        blocks=blocks, interpret=interpret, name="mlstm_scores",
    )(qp, kp, ig, bc)
    score_specs = [pl.BlockSpec((None, None, T, L), lambda x, y, z, s: (x, y, 0, 0)), gates, gates]
    scale, walk_args = dk**-0.5, (qp, kp, vp, ig, bc, *C_args, n0p, m0, *extra_args)
    walk_specs = [keys, keys, values, gates, gates, *C_specs, n_in, m_in, *extra_specs]
    state_outs = [pl.BlockSpec() if in_place else C_out, n_out, m_out]
    state_shapes = [jax.ShapeDtypeStruct(C_args[0].shape if in_place else (b, h, K, V), F32),
                    jax.ShapeDtypeStruct((b, h, nvb, K), F32), jax.ShapeDtypeStruct((b, h, nvb), F32)]
    walk = dict(L=L, chunks=chunks, segments=segments, scale=scale, eps=eps, in_place=in_place)
    if blocks.parallel_outputs:
        # the walk writes the state entering every chunk; the outputs are a kernel of one program per
        # (row, head, chunk, value block)
        n_chunks = T // L
        C_in, n_in, m_in, C, n, m = common.call(
            lambda *refs: _kernel(*refs, **walk, entering=True), grid=(b, h, nvb, segments), in_specs=walk_specs,
            out_specs=[pl.BlockSpec((None, None, n_chunks, K, vb), lambda x, y, z, s: (x, y, 0, 0, z)),
                       pl.BlockSpec((None, None, n_chunks, None, K), lambda x, y, z, s: (x, y, 0, z, 0)),
                       pl.BlockSpec((None, None, n_chunks, None), lambda x, y, z, s: (x, y, 0, z)), *state_outs],
            out_shape=[jax.ShapeDtypeStruct((b, h, n_chunks, K, V), q.dtype),
                       jax.ShapeDtypeStruct((b, h, n_chunks, nvb, K), F32),
                       jax.ShapeDtypeStruct((b, h, n_chunks, nvb), F32), *state_shapes],
            blocks=blocks, interpret=interpret, name="mlstm_chunk_states",
            input_output_aliases={5: 3} if in_place else None,
        )(*walk_args)
        chunk_values = pl.BlockSpec((None, L, None, vb), lambda x, y, c, z: (x, c, y, z))
        chunk_gates = pl.BlockSpec((None, None, L), lambda x, y, c, z: (x, y, c))
        hh = common.call(
            lambda *refs: _output_kernel(*refs, scale=scale, eps=eps), grid=(b, h, n_chunks, nvb),
            in_specs=[pl.BlockSpec((None, L, None, K), lambda x, y, c, z: (x, c, y, 0)), chunk_values, chunk_gates,
                      pl.BlockSpec((None, None, L, L), lambda x, y, c, z: (x, y, c, 0)), chunk_gates, chunk_gates,
                      pl.BlockSpec((None, None, None, K, vb), lambda x, y, c, z: (x, y, c, 0, z)),
                      pl.BlockSpec((None, None, None, None, K), lambda x, y, c, z: (x, y, c, z, 0)),
                      pl.BlockSpec((None, None, None, None), lambda x, y, c, z: (x, y, c, z))],
            out_specs=chunk_values, out_shape=jax.ShapeDtypeStruct((b, T, h, V), v.dtype),
            blocks=blocks, interpret=interpret, name="mlstm_chunk_outputs",
        )(qp, vp, bc, *scores, C_in, n_in, m_in)
    else:
        hh, C, n, m = common.call(
            lambda *refs: _kernel(*refs, **walk, entering=False), grid=(b, h, nvb, segments),
            in_specs=[*walk_specs, *score_specs], out_specs=[values, *state_outs],
            out_shape=[jax.ShapeDtypeStruct((b, T, h, V), v.dtype), *state_shapes],
            blocks=blocks, interpret=interpret, name="mlstm_chunked", input_output_aliases={5: 1} if in_place else None,
        )(*walk_args, *scores)
    C = StateSlot(C, C0.layer) if in_place else C[:, :, :dk, :dv]
    return hh[:, :t, :, :dv], ref.State(C, n[:, :, 0, :dk], m[:, :, 0])


@common.cached
def _differentiable(chunk_size, eps, blocks, interpret):
    def forward(q, k, v, i, f, C0, n0, m0):
        return _forward(q, k, v, i, f, C0, n0, m0, eps=eps, blocks=blocks, interpret=interpret)

    def reference(q, k, v, i, f, C0, n0, m0):
        return through_slot(ref.chunked, q, k, v, i, f, chunk_size=chunk_size, initial_state=ref.State(C0, n0, m0),
                            eps=eps)

    return common.with_reference_vjp(forward, reference)


def chunked(q, k, v, i, f, *, chunk_size, initial_state=None, eps=ref.EPS, blocks: common.BlockSizes | None = None,
            interpret: bool = False):
    """`ops.mlstm.chunked` computed by the Pallas kernel; gradients are `jax.vjp` of the reference
    (run with chunk_size). Returns (h [b, t, h, v] in v's dtype, final State)."""
    state = ref._check(q, k, v, i, f, initial_state)
    check_positive_int("chunk_size", chunk_size)
    if q.shape[1] == 0:
        raise ValueError("chunked needs at least one token (t >= 1)")
    dv = v.shape[-1]
    if blocks is None:
        blocks = common.heuristic("mlstm", key_dim=q.shape[-1], value_dim=dv)
    blocks = common.check_blocks(blocks, dv, kernel="mlstm")
    return _differentiable(chunk_size, float(eps), blocks, bool(interpret))(q, k, v, i, f, *state)
