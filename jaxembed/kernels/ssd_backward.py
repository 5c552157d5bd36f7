"""The chunked SSD's backward as a Pallas kernel, for sequences of a few chunks (training texts).

Differentiating the SSD as `jax.vjp` of `ops.ssd.chunked` recomputes it in XLA and writes its
float32 [b x h, Q, Q] intra-chunk matrices and their cotangents to memory several times over: at
192 texts x 256 tokens (16 heads of 64, n = 128) it moves 14.4 GB, about two thirds of a Mamba2
training step's glue on the GPU (docs/benchmarks.md, "Training step"). This kernel keeps every
[L, L] product on chip, as the forward kernel does.

One program per (batch row b, block of heads of one group, block of head-dim columns) walks, for
each of its heads in turn, the chunks of L tokens in reverse, carrying dS, the cotangent of the
state leaving the chunk. For a chunk entered with the state S [pb, n], with a = dt A, cs its
cumulative sum within the chunk, L_ij = exp(cs_i - cs_j) (i >= j), M = L ∘ C Bᵀ, X̃ = dt ∘ x,
w_j = exp(cs_L - cs_j) and dy the output's cotangent:

    dX̃   = Mᵀ dy + w ∘ (B dSᵀ)                                       [l, pb]
    dM   = tril(dy X̃ᵀ),  P = dM ∘ M                                  [l, l]
    dC   = (dM ∘ L) B + exp(cs) ∘ (dy S)                             [l, n]
    dB   = (dM ∘ L)ᵀ C + w ∘ (X̃ dS)                                  [l, n]
    dcs  = rowsum P - colsum P - w ∘ rowsum(X̃ ∘ B dSᵀ) + exp(cs) ∘ rowsum(dy ∘ C Sᵀ),
           and the chunk's last token also Σ_j w_j X̃_j · (dS B_j) + exp(cs_L) (dS : S)
           (P's diagonal cancels and is left out; the w terms go to da as a prefix sum)
    dS  <- (exp(cs) ∘ dy)ᵀ C + exp(cs_L) dS                          [pb, n]

(S and dS are carried transposed, [n, pb], like the forward kernel's state: `ssd._state_step`.)

(docs/kernels.md derives them; tests/test_kernels.py checks them against `jax.vjp` of the
reference.) The state entering chunk c is recomputed from the initial state by the forward
kernel's state step over chunks 0 .. c-1, so nothing per chunk goes to memory; that is
quadratic in the chunk count, which is why sequences of more than MAX_CHUNKS chunks keep the
reference's backward. The program adds its heads' dB and dC up in its output block, and writes
dx = dt dX̃ + D dy and dt's share Σ_p x dX̃ itself (dX̃ never goes to memory). XLA then sums dB
and dC over the programs' head blocks and value blocks, turns dcs into da (a reverse cumulative
sum within each chunk) and chains dt's discretisation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxembed.kernels import common
from jaxembed.kernels.ssd import _rows, _state_step, conv_silu_tile  # the forward kernel's pieces
from jaxembed.ops import ssd as ref

F32 = jnp.float32
MAX_CHUNKS = 8  # longer sequences differentiate through the reference (see the module docstring)
VALUE_BLOCK = 32  # the backward carries S and dS (transposed, [n, pb]): half the forward's largest block
# The program's [L, L] and [L, n] float32 tiles (M, dM, P, decay, dB, dC, ...) live together: at
# Mamba2's training shapes (n = 128, 192 x 256 tokens) the forward's chunk of 64 with 4 warps spilled
# 2,440 bytes of registers per thread on an H100 (~1,000 local loads and stores per chunk); chunks of
# CHUNK tokens with NUM_WARPS warps spill 96 bytes, 28 accesses per chunk (benchmarks/kernel_registers.py)
CHUNK = 32
NUM_WARPS = 8
# A program walks up to MAX_HEADS_PER_PROGRAM heads of a group and sums their dB and dC itself (one
# float32 partial per head instead would be written and read back: 64x the size of dB at 16 heads
# of 2 value blocks), while the grid keeps at least MIN_PROGRAMS programs (~4 waves of an H100's
# 132 SMs at 2 programs each) so that its last wave is not mostly idle
MAX_HEADS_PER_PROGRAM = 8
MIN_PROGRAMS = 1024


def _kernel(x_ref, dy_ref, dt_ref, a_cum_ref, a_to_end_ref, B_ref, C_ref, D_ref, *refs, L, chunks, heads, head_width,
            pb, reads_state, reads_d_state, taps):
    """Without `reads_state` the initial state is zero (not read) and its cotangent is not written;
    without `reads_d_state` the final state's cotangent is zero (not read). With `taps` (Mamba2's
    layer), x_ref holds x raw, before the causal conv of `taps` taps + SiLU, which the kernel
    computes per chunk as the forward kernel does; chunk 0, whose window reaches into the conv
    state, comes convolved by XLA (the head block)."""
    conv_refs, refs = (refs[:3], refs[3:]) if taps else (None, refs)
    s0_ref, refs = (refs[0], refs[1:]) if reads_state else (None, refs)
    ds_ref, refs = (refs[0], refs[1:]) if reads_d_state else (None, refs)
    dx_ref, x_dxt_ref, dD_ref, dB_ref, dC_ref, dcs_ref, r_ref, *ds0_ref = refs
    zero_state = jnp.zeros((B_ref.shape[-1], pb), F32)  # Sᵀ and dSᵀ [n, pb], carried transposed as the forward does
    causal, strict = common.causal_masks(L)
    last = lax.broadcasted_iota(jnp.int32, (L,), 0) == L - 1
    value_block = pl.program_id(2)

    def x_of(c, cols):  # chunk c's x [l, pb]: as stored, or the causal conv + SiLU of raw x
        if not taps:
            return x_ref[_rows(c, L), cols]
        head_ref, w_ref, bias_ref = conv_refs

        def window(lag):  # (chunk 0's start is clipped: its rows come from the head block)
            return x_ref[pl.ds(jnp.maximum(c * L - lag, 0), L), cols]

        convolved = conv_silu_tile(window, lambda i: w_ref[i, cols], bias_ref[cols], taps=taps, dtype=x_ref.dtype)
        return jnp.where(c == 0, head_ref[:, cols], convolved)

    def head(j, carry):  # the program's j-th head: its value block's columns of x, dy, dx and D
        cols = pl.ds(pl.multiple_of(j * head_width + value_block * pb, pb), pb)
        D = D_ref[cols].astype(F32)
        first = j == 0

        def accumulate(ref, t, value):  # dB and dC summed over the program's heads on chip
            ref[t, :] = jnp.where(first, value, ref[t, :] + value)

        def entering(c):
            def step(k, S):
                t = _rows(k, L)
                return _state_step(S, x_of(k, cols), B_ref[t, :], dt_ref[j, t], a_cum_ref[j, t],
                                   a_to_end_ref[j, t])
            return lax.fori_loop(0, c, step, s0_ref[j].T if reads_state else zero_state)

        def chunk(i, carry):
            dST, dD = carry
            c = chunks - 1 - i
            t = _rows(c, L)
            ST = entering(c)
            x, dy = x_of(c, cols), dy_ref[t, cols]  # [l, pb]
            Bc, Cc = B_ref[t, :], C_ref[t, :]  # [l, n]
            dt, a_cum, a_to_end = dt_ref[j, t], a_cum_ref[j, t], a_to_end_ref[j, t]  # [l]
            cdt = x.dtype
            decay = jnp.where(causal, jnp.exp(jnp.minimum(a_cum[:, None] - a_cum[None, :], 0.0)), 0.0)  # L [l, s]
            M = common.dot(Cc, Bc, trans_b=True) * decay
            xdt = x.astype(F32) * dt[:, None]  # X̃
            w, e = jnp.exp(a_to_end), jnp.exp(a_cum)
            dSB = common.dot(Bc, dST.astype(Bc.dtype))  # [l, pb]: B_j dSᵀ
            dxt = common.dot(M.astype(cdt), dy.astype(cdt), trans_a=True) + w[:, None] * dSB  # dX̃
            # dx and dt's share Σ_p x dX̃ here, so that dX̃ (float32) never goes to memory
            dx_ref[t, cols] = (dt[:, None] * dxt + dy.astype(F32) * D[None, :]).astype(dx_ref.dtype)
            x_dxt_ref[j, t] = jnp.sum(x.astype(F32) * dxt, axis=1)
            dD = dD + jnp.sum(dy.astype(F32) * x.astype(F32), axis=0)
            # dy X̃ᵀ as (dy xᵀ) diag(dt): x enters the dot as stored, dt in float32 after it (the forward
            # folds dt into M the same way), so X̃ is never rounded to the activation dtype
            dM = jnp.where(causal, common.dot(dy.astype(cdt), x, trans_b=True) * dt[None, :], 0.0)
            dML = (dM * decay).astype(Bc.dtype)
            SC = common.dot(Cc, ST.astype(Cc.dtype))  # [l, pb]: S C_i
            accumulate(dC_ref, t, common.dot(dML, Bc)
                       + e[:, None] * common.dot(dy.astype(cdt), ST.astype(cdt), trans_b=True))
            accumulate(dB_ref, t, common.dot(dML, Cc, trans_a=True)
                       + (w * dt)[:, None] * common.dot(x, dST.astype(cdt), trans_b=True))
            # L_ii = 1 whatever cs is: the diagonal's row and column terms cancel exactly, so they are
            # left out rather than added and subtracted (under strong decay they dominate P, and their
            # float32 remainder piled up in da)
            P = jnp.where(strict, dM * M, 0.0)
            end = jnp.sum(jnp.where(last, e, 0.0))  # exp(cs_L), a scalar
            dcs = jnp.sum(P, axis=1) - jnp.sum(P, axis=0) + e * jnp.sum(dy.astype(F32) * SC, axis=1)
            dcs_ref[j, t] = jnp.where(last, dcs + end * jnp.sum(dST * ST), dcs)
            # w's terms, -r_i at every row and Σ r on the last, add up in da to an exclusive prefix sum
            # of r: written apart and summed that way by XLA, without the cancellation
            r_ref[j, t] = w * jnp.sum(xdt * dSB, axis=1)
            return common.dot(Cc, (e[:, None] * dy.astype(F32)).astype(Cc.dtype), trans_a=True) + end * dST, dD

        ds0, dD_ref[cols] = lax.fori_loop(0, chunks, chunk, (ds_ref[j].T if reads_d_state else zero_state,
                                                             jnp.zeros((pb,), F32)))
        if reads_state:
            ds0_ref[0][j] = ds0.T
        return carry

    lax.fori_loop(0, heads, head, 0)


def chunk_length(t: int, forward_chunk: int) -> int | None:
    """The backward's own chunk for t tokens (its math holds for any chunking): CHUNK (or the
    forward's, when smaller) while t fits in MAX_CHUNKS of them, else the forward's chunk while it
    fits; None when neither does (the reference's backward then)."""
    for L in (min(CHUNK, forward_chunk), forward_chunk):
        if -(-t // L) <= MAX_CHUNKS:
            return L
    return None


def can_convolve(*, t: int, chunk: int, head_dim: int, taps: int, offset: int) -> bool:
    """Whether `backward` can take x raw (`conv`): x's columns first in the projection (offset 0),
    whole chunks (no padded rows), a head dim that is a block multiple (no padded columns), and a
    conv window within one chunk."""
    return (offset == 0 and t % chunk == 0 and t <= MAX_CHUNKS * chunk and common.padded(head_dim) == head_dim
            and taps - 1 <= chunk)


def choose_heads_per_program(*, batch: int, heads: int, heads_per_group: int, value_blocks: int) -> int:
    """How many heads of one group a program walks, one after another, summing their dB and dC on
    chip: the most (a power of two dividing heads_per_group, at most MAX_HEADS_PER_PROGRAM) that
    leave the grid at least MIN_PROGRAMS programs; 1 when it has fewer to begin with."""
    R = 1
    while (2 * R <= MAX_HEADS_PER_PROGRAM and heads_per_group % (2 * R) == 0
           and batch * (heads // (2 * R)) * value_blocks >= MIN_PROGRAMS):
        R *= 2
    return R


def backward(x, dt, A, B, C, D, dt_bias, state, dy, d_state, *, dt_limit, chunk, interpret,
             heads_per_program: int | None = None, conv=None):
    """Cotangents of (x, dt, A, B, C, D, dt_bias, state) for `ops.ssd.chunked`'s (y, final state)
    given theirs (dy, d_state): shapes and dtypes as the inputs; a None state or d_state is zero,
    and a None state gets None for its cotangent. One chunk layout of `chunk` tokens; t <=
    MAX_CHUNKS * chunk. `heads_per_program` (default: `choose_heads_per_program`) must divide the
    heads of a group.

    conv (Mamba2's layer, `can_convolve`): (head [b, chunk, h p], conv weight [k, h p], bias [h p])
    and x the projection's output [b, t, ...] whose first h p columns are x raw, before the causal
    conv + SiLU that the kernel computes per chunk; head is chunk 0 convolved. x's cotangent is
    then that of the convolved x [b, t, h, p]."""
    b, t, h, p = dy.shape
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
    R = heads_per_program or choose_heads_per_program(batch=b, heads=h, heads_per_group=r, value_blocks=vb)
    if r % R:
        raise ValueError(f"heads_per_program ({R}) must divide the heads of a group ({r})")
    dt_eff, dt_vjp = jax.vjp(lambda d, bias: ref.discretize_dt(d, bias, dt_limit), dt, dt_bias)
    dt_eff = common.pad_axis(dt_eff, 1, T)  # padding tokens: dt = 0, no decay and no input
    a = (dt_eff * A.astype(F32)).reshape(b, chunks, L, h)
    a_cum = jnp.cumsum(a, axis=2).reshape(b, T, h)
    a_to_end = (lax.cumsum(a, axis=2, reverse=True) - a).reshape(b, T, h)

    def time_major(v, width):  # [b, t, k, d] -> [b, T, k * width]
        return common.pad_axis(common.pad_axis(v, 3, width), 1, T).reshape(b, T, -1)

    def head_major(v):  # [b, T, h] -> [b, h, T]: a head's positions contiguous
        return jnp.moveaxis(v, 2, 1)

    x3, dy3 = (x if conv else time_major(x, P)), time_major(dy.astype(x.dtype), P)
    B3, C3 = time_major(B, N), time_major(C, N)
    def state_tile_layout(v):  # [b, h, p, n] -> float32 [b, h, P, N]; None (zero) stays None
        return None if v is None else common.pad_axis(common.pad_axis(v.astype(F32), 2, P), 3, N)

    s0, ds = state_tile_layout(state), state_tile_layout(d_state)

    # D per channel [h * P] (a per-head D broadcast over the head's channels)
    D_channels = (jnp.broadcast_to(D.astype(F32)[:, None], (h, p)) if D.ndim == 1 else D.astype(F32))
    D_channels = common.pad_axis(D_channels, 1, P).reshape(h * P)

    # grid (batch row i, block j of R heads, value block k); a program indexes its heads' columns itself
    columns = pl.BlockSpec((None, T, R * P), lambda i, j, k: (i, 0, j))
    channels = pl.BlockSpec((R * P,), lambda i, j, k: (j,))
    row_channels = pl.BlockSpec((None, R * P), lambda i, j, k: (i, j))
    per_head = pl.BlockSpec((None, R, T), lambda i, j, k: (i, j, 0))
    group = pl.BlockSpec((None, T, N), lambda i, j, k: (i, 0, j * R // r))
    state_tiles = pl.BlockSpec((None, R, pb, N), lambda i, j, k: (i, j, k, 0))
    partial = pl.BlockSpec((None, None, None, T, N), lambda i, j, k: (i, j, k, 0, 0))
    per_position = pl.BlockSpec((None, R, None, T), lambda i, j, k: (i, j, k, 0))
    blocks = common.BlockSizes(chunk=L, value_block=pb, num_warps=NUM_WARPS, num_stages=1)
    per_position_shape = jax.ShapeDtypeStruct((b, h, vb, T), F32)
    # a None state (zero) is not read and gets no cotangent; a None d_state (zero) is not read
    states = [v for v in (s0, ds) if v is not None]
    state_shape = jax.ShapeDtypeStruct((b, h, P, N), F32)
    conv_inputs, conv_specs = [], []
    if conv:
        head, conv_weight, conv_bias = conv
        conv_inputs = [head, conv_weight, conv_bias]
        conv_specs = [pl.BlockSpec((None, L, R * P), lambda i, j, k: (i, 0, j)),
                      pl.BlockSpec((conv_weight.shape[0], R * P), lambda i, j, k: (0, j)), channels]
    dx, x_dxt, dD, dB, dC, dcs, r_terms, *ds0 = common.call(
        lambda *refs: _kernel(*refs, L=L, chunks=chunks, heads=R, head_width=P, pb=pb, reads_state=s0 is not None,
                              reads_d_state=ds is not None, taps=conv[1].shape[0] if conv else None),
        grid=(b, h // R, vb),
        in_specs=[columns, columns, per_head, per_head, per_head, group, group, channels] + conv_specs
        + [state_tiles] * len(states),
        out_specs=[columns, per_position, row_channels, partial, partial, per_position, per_position]
        + [state_tiles] * (s0 is not None),
        out_shape=[jax.ShapeDtypeStruct((b, T, h * P), x.dtype), per_position_shape,
                   jax.ShapeDtypeStruct((b, h * P), F32), jax.ShapeDtypeStruct((b, h // R, vb, T, N), F32),
                   jax.ShapeDtypeStruct((b, h // R, vb, T, N), F32), per_position_shape, per_position_shape]
        + [state_shape] * (s0 is not None),
        blocks=blocks, interpret=interpret, name="ssd_chunked_backward",
    )(x3, dy3, head_major(dt_eff), head_major(a_cum), head_major(a_to_end), B3, C3, D_channels, *conv_inputs, *states)

    dx = dx.reshape(b, T, h, P)[:, :t, :, :p]
    dt_eff = dt_eff[:, :t]
    dD = dD.sum(axis=0).reshape(h, P)[:, :p]
    dD = jnp.sum(dD, axis=-1) if D.ndim == 1 else dD

    def grouped(v):  # [b, h // R, vb, T, N] -> [b, t, g, n]
        v = v.sum(axis=2).reshape(b, g, r // R, T, N).sum(axis=2)
        return jnp.moveaxis(v, 1, 2)[:, :t, :, :n]

    def per_token(v):  # [b, h, vb, T] -> [b, T, h]
        return jnp.moveaxis(v.sum(axis=2), 1, 2)

    dcs, r_terms = (per_token(v).reshape(b, chunks, L, h) for v in (dcs, r_terms))
    # cs = cumsum(a) within the chunk: da_k = Σ_{i >= k} dcs_i, and w's terms Σ_{i < k} r_i
    da = lax.cumsum(dcs, axis=2, reverse=True) + jnp.cumsum(r_terms, axis=2) - r_terms
    da = da.reshape(b, T, h)[:, :t]
    d_dt_eff = per_token(x_dxt)[:, :t] + da * A.astype(F32)
    dA = jnp.sum(da * dt_eff, axis=(0, 1))
    d_dt, d_bias = dt_vjp(d_dt_eff)
    return (dx.astype(x.dtype), d_dt.astype(dt.dtype), dA.astype(A.dtype), grouped(dB).astype(B.dtype),
            grouped(dC).astype(C.dtype), dD.astype(D.dtype), d_bias.astype(dt_bias.dtype),
            ds0[0][:, :, :p, :n].astype(state.dtype) if state is not None else None)
