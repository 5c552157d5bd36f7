"""Chunked SSD (Mamba2) as one Pallas kernel; reference: `jaxembed.ops.ssd.chunked` (same signature).

One program per (batch row b, head h, block of head-dim columns) walks the chunks of L tokens.
For chunk c, entering with the state S [p, n] (float32, in registers, carried transposed as
Sᵀ [n, p]: see `_state_step`):

    M     = tril(C Bᵀ ∘ exp(a_cum_l - a_cum_s)) diag(dt)          [l, s]   (eq. 8)
    y     = M x + diag(exp(a_cum)) C Sᵀ + D x                    [l, p]   (eqs. 8, 11)
    Sᵀ    = exp(a_cum_L) Sᵀ + Bᵀ (x ∘ dt exp(a_to_end))           [n, p]   (eqs. 9, 10)

The diagonal block, the output correction and the chunk-boundary state are the three products
of one iteration; the loop is the inter-chunk recurrence. With `segments` > 1 (batch 1: too few
programs for the GPU) the grid gains a segment axis: `_segment_state_kernel` first computes each
segment's end state from a zero state, and segment k's program enters with
S_k = exp(a_{k-1}) S_{k-1} + S_{k-1}^own (a_k the segment's summed log decay, S_0 the initial
state), the same recurrence at segment granularity. Matmul operands are in the activation
dtype (the state is cast like `ops.ssd.chunk_output` does), accumulation and every decay,
exponential and the state are float32. Shapes as in `ops.ssd`: x [b, t, h, p], dt [b, t, h],
A [h], B and C [b, t, g, n], D [h] or [h, p], state [b, h, p, n].

`chunked_xbc` (reference `ops.ssd.chunked_xbc`) is the Mamba2 layer's entry: the kernel reads x,
B and C as column blocks of the packed conv output xbc [b, t, h*p + 2*g*n], and every operand is
time-major, so XLA keeps the layer's activations row-major with no transposes around the call.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxembed.kernels import common
from jaxembed.ops import common as ops_common
from jaxembed.ops import ssd as ref
from jaxembed.ops.common import STATE_SLOT_KEEPS_ITS_STATE, StateSlot, through_slot

F32 = jnp.float32


def _state_step(ST, x, Bc, dt, a_cum, a_to_end):
    """The state entering a chunk -> the state leaving it (eqs. 9, 10), carried transposed: Sᵀ [n, pb]
    float32. Transposed, every product of the chunk takes x (and w, made from x) as its right-hand
    operand in one layout. As S [pb, n], wᵀ B wanted x as a transposed left-hand operand, and Triton
    recomputed a convolved x (`XConv`) in each operand's layout: 2.4x the loop's instructions and 656
    bytes of register spills per thread at Codestral's shapes, 44 now (benchmarks/kernel_registers.py)."""
    w = (x.astype(F32) * (dt * jnp.exp(a_to_end))[:, None]).astype(x.dtype)  # [s, pb]
    chunk_decay = jnp.exp(jnp.min(a_cum))  # a_cum falls monotonically (A < 0, dt >= 0): min = last
    return chunk_decay * ST + common.dot(Bc, w, trans_a=True)


class XConv(NamedTuple):
    """Static layout of x read raw (before the causal conv) out of the projection's output: `taps` conv
    taps; `full` chunks lie wholly within the real tokens. Chunks 1 to full - 1 are read raw and
    convolved in the kernel. Chunk 0 (whose window reaches into the conv state) and the partial
    chunk past the last whole one come convolved by XLA, as the head and tail blocks of one chunk
    each, so no load leaves the real rows."""
    taps: int
    full: int


def conv_silu_tile(window, weight, bias, *, taps, dtype):
    """silu(Σ_i window(taps-1-i) w_i + bias) [l, pb] in dtype, computed in float32: the causal conv
    + SiLU of raw rows, window(lag) the [l, pb] rows lag tokens back and weight(i) tap i's [pb]
    weights, summed in `ops.ssd.causal_conv`'s order."""
    acc = None
    for i in range(taps):
        term = window(taps - 1 - i).astype(F32) * weight(i).astype(F32)[None, :]
        acc = term if acc is None else acc + term
    acc = acc + bias.astype(F32)[None, :]
    return (acc / (1.0 + jnp.exp(-acc))).astype(dtype)


def _walk_x(x_ref, conv_refs, xconv, *, L, first, chunks, step, S):
    """S = step(c, x_c, S) for the chunks c in [first, first + chunks), x_c [L, pb] the chunk's x:
    a row block of x_ref, or with `xconv` the causal conv + SiLU of raw x computed here (tap i
    reads the inputs k-1-i tokens back, summed in `ops.ssd.causal_conv`'s order), chunk 0 and the
    chunks from `full` on being the head and tail blocks (`XConv`)."""
    if xconv is None:
        return lax.fori_loop(first, first + chunks, lambda c, S: step(c, x_ref[_rows(c, L), :], S), S)
    head_ref, tail_ref, w_ref, bias_ref = conv_refs
    k, full = xconv.taps, xconv.full

    def conv(window):
        return conv_silu_tile(window, lambda i: w_ref[i, :], bias_ref[...], taps=k, dtype=x_ref.dtype)

    def raw(c):
        return lambda lag: x_ref[pl.ds(c * L - lag, L), :]

    if isinstance(first, int):  # one segment: chunk 0 is the head
        x_first = head_ref[...]
    else:  # the head for chunk 0, the tail from `full` on, else the raw rows convolved
        x_first = tail_ref[...]
        if full > 0:  # with none, x_ref holds fewer than L rows: no load of it may be traced
            def clipped(lag):  # (clipped: the load happens whichever block is chosen)
                return x_ref[pl.ds(jnp.clip(first * L - lag, 0, x_ref.shape[0] - L), L), :]
            x_first = jnp.where(first >= full, x_first, conv(clipped))
        x_first = jnp.where(first == 0, head_ref[...], x_first)
    S = step(first, x_first, S)
    if full > 0:
        S = _for(first + 1, _min(first + chunks, full), lambda c, S: step(c, conv(raw(c)), S), S)
    return _for(_max(first + 1, full), first + chunks, lambda c, S: step(c, tail_ref[...], S), S)


def _rows(c, L):
    """Chunk c's rows; a traced start is marked as a multiple of L (Triton's aligned loads)."""
    return pl.ds(c * L if isinstance(c, int) else pl.multiple_of(c * L, L), L)


def _min(a, b):
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.minimum(a, b)


def _max(a, b):
    return max(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.maximum(a, b)


def _for(lo, hi, body, S):
    """fori_loop that runs no iteration when lo >= hi, static or traced."""
    if isinstance(lo, int) and isinstance(hi, int) and lo >= hi:
        return S
    return lax.fori_loop(lo, hi, body, S)


def _kernel(x_ref, dt_ref, a_cum_ref, a_to_end_ref, B_ref, C_ref, D_ref, *refs, L, chunks, segments, xconv,
            in_place, reads_state, writes_state):
    """Segment `program_id(3)` of the sequence (all of it when segments == 1): `chunks` chunks from
    the state entering the segment, which is the initial state carried through the segments before
    it by their own end states (`_segment_state_kernel`) and decays. `in_place`: the state refs are
    one buffer, the stack of every layer's state, and `layer_ref` says which layer's entry to use.
    Without `reads_state` the initial state is zero and not read; without `writes_state` the final
    state is not written (a fresh layer whose state is dropped: training, horizontal embedding)."""
    s0_ref, refs = (refs[0], refs[1:]) if reads_state else (None, refs)
    layer_ref, refs = (refs[0], refs[1:]) if in_place else (None, refs)
    conv_refs, refs = (refs[:4], refs[4:]) if xconv is not None else ((), refs)
    if segments > 1:
        seg_decay_ref, seg_state_ref, *refs = refs
    y_ref, s_ref = refs if writes_state else (refs[0], None)
    causal, _ = common.causal_masks(L)
    D = D_ref[...]  # [pb]

    def chunk(c, x, ST):  # x [l, pb], Sᵀ [n, pb] float32
        t = _rows(c, L)
        Bc, Cc = B_ref[t, :], C_ref[t, :]  # [l, n] [l, n]
        dt, a_cum, a_to_end = dt_ref[t], a_cum_ref[t], a_to_end_ref[t]  # [l] float32
        decay = jnp.exp(jnp.minimum(a_cum[:, None] - a_cum[None, :], 0.0))  # [l, s], clamped above the diagonal
        M = jnp.where(causal, common.dot(Cc, Bc, trans_b=True) * decay * dt[None, :], 0.0)
        y = common.dot(M.astype(x.dtype), x)
        y += jnp.exp(a_cum)[:, None] * common.dot(Cc, ST.astype(Cc.dtype))
        y += D[None, :] * x.astype(F32)
        y_ref[t, :] = y.astype(y_ref.dtype)
        return _state_step(ST, x, Bc, dt, a_cum, a_to_end)

    tile = common.state_tile(layer_ref, x_ref.shape[-1], axis=2)  # [pb, n] of [b, h, p, n]
    ST = s0_ref[tile].T if reads_state else jnp.zeros((B_ref.shape[-1], x_ref.shape[-1]), F32)
    first = 0
    if segments > 1:  # the segments' own end states come transposed, [segments - 1, n, pb]
        segment = pl.program_id(3)
        ST = lax.fori_loop(0, segment, lambda j, ST: jnp.exp(seg_decay_ref[j]) * ST + seg_state_ref[j], ST)
        first = segment * chunks
    end = _walk_x(x_ref, conv_refs, xconv, L=L, first=first, chunks=chunks, step=chunk, S=ST)
    if writes_state:
        common.at_sequence_end(segments, lambda: s_ref.__setitem__(tile, end.T))


def _segment_state_kernel(x_ref, dt_ref, a_cum_ref, a_to_end_ref, B_ref, *refs, L, chunks, xconv):
    """The end state of segment `program_id(3)` entered with a zero state, transposed [n, pb]: the
    state half of `_kernel`'s loop (one dot per chunk, no outputs per token)."""
    conv_refs, (s_ref,) = (refs[:4], refs[4:]) if xconv is not None else ((), refs)

    def chunk(c, x, ST):
        t = _rows(c, L)
        return _state_step(ST, x, B_ref[t, :], dt_ref[t], a_cum_ref[t], a_to_end_ref[t])

    s_ref[...] = _walk_x(x_ref, conv_refs, xconv, L=L, first=pl.program_id(3) * chunks, chunks=chunks, step=chunk,
                         S=jnp.zeros(s_ref.shape, F32))


def _per_head_decays(dt, A, dt_bias, *, dt_limit, L: int, T: int, segments: int):
    """dt [b, t, h] -> (dt, a_cum, a_to_end), each [b, T, h] float32, kept time-major like the
    projection they come from (a [b, h, T] layout here would make XLA lay the whole projection
    out feature-major and transpose every activation around the kernel), and the log decay
    of each segment but the last [b, segments - 1, h] (None for one segment)."""
    b, _, h = dt.shape
    # padding tokens have dt = 0: no decay, no input; the final state is that of the last real token
    dt = common.pad_axis(ref.discretize_dt(dt, dt_bias, dt_limit), 1, T)
    a = dt * A.astype(F32)
    chunks = a.reshape(b, T // L, L, h)
    a_cum = jnp.cumsum(chunks, axis=2)
    a_to_end = lax.cumsum(chunks, axis=2, reverse=True) - chunks  # Σ over the rest of the chunk, no cancellation
    segment_decay = a.reshape(b, segments, T // segments, h).sum(axis=2)[:, :-1] if segments > 1 else None
    return dt, a_cum.reshape(b, T, h), a_to_end.reshape(b, T, h), segment_decay


def _launch(x3, B3, C3, offsets, dt, A, D, dt_bias, state, *, t, h, p, g, n, dt_limit, blocks, interpret,
            x_conv=None, final_state=True):
    """The kernel over column blocks of time-major arrays: x3 holds head j's values in columns
    [j*P, (j+1)*P) after `offsets[0]` blocks of value_block columns; B3 and C3 hold group gg's
    in columns [gg*N, (gg+1)*N) after offsets[1] / offsets[2] blocks of N columns. They may be
    one array (the packed xbc). With `x_conv` = (head, tail, conv weight, conv bias), x3 is raw x
    of t rows, convolved in the kernel (`XConv`; head and tail, convolved, [b, L, h*p], weight
    [k, >= h*p], bias [>= h*p]). Returns (y [b, t, h, p], final state [b, h, p, n]). A `StateSlot` state is read
    and written in place in its stack when the kernel can address it there (one segment, no
    padding), else copied out and back; the final state is then the slot. A None state is zero
    and never read; with final_state=False no final state is written and None is returned for it."""
    b = x3.shape[0]
    r = h // g
    L, pb = blocks.chunk, blocks.value_block
    P, N = common.padded(p), common.padded(n)
    vb = P // pb  # value blocks per head
    segments, chunks, T = common.segment_layout(blocks, programs=b * h * vb, t=t)
    in_place = common.addressable_slot(state, segments=segments, padded=(P, N) != (p, n))
    if isinstance(state, StateSlot) and not final_state:
        raise ValueError(STATE_SLOT_KEEPS_ITS_STATE)
    if isinstance(state, StateSlot) and not in_place:
        y, end = _launch(x3, B3, C3, offsets, dt, A, D, dt_bias, state.read().astype(F32), t=t, h=h, p=p, g=g, n=n,
                         dt_limit=dt_limit, blocks=blocks, interpret=interpret, x_conv=x_conv)
        return y, state.write(end)
    dt, a_cum, a_to_end, segment_decay = _per_head_decays(dt, A, dt_bias, dt_limit=dt_limit, L=L, T=T,
                                                          segments=segments)
    B3, C3 = (common.pad_axis(v, 1, T) for v in (B3, C3))
    x3 = common.pad_axis(x3, 1, T) if x_conv is None else x3
    Dp = common.pad_axis(jnp.broadcast_to((D[:, None] if D.ndim == 1 else D).astype(F32), (h, p)), 1, P)
    reads_state = state is not None
    x_off, B_off, C_off = offsets

    x_spec = pl.BlockSpec((None, x3.shape[1], pb), lambda i, j, k, s: (i, 0, x_off + j * vb + k))
    xconv, conv_specs = None, []
    if x_conv is not None:
        _, _, weight, _ = x_conv
        xconv = XConv(taps=weight.shape[0], full=t // L)
        column = pl.BlockSpec((None, L, pb), lambda i, j, k, s: (i, 0, j * vb + k))
        conv_specs = [column, column, pl.BlockSpec((xconv.taps, pb), lambda i, j, k, s: (0, j * vb + k)),
                      pl.BlockSpec((pb,), lambda i, j, k, s: (j * vb + k,))]
    conv_args = list(x_conv or ())
    per_head = pl.BlockSpec((None, T, None), lambda i, j, k, s: (i, 0, j))
    B_spec = pl.BlockSpec((None, T, N), lambda i, j, k, s: (i, 0, B_off + j // r))
    C_spec = pl.BlockSpec((None, T, N), lambda i, j, k, s: (i, 0, C_off + j // r))
    st = pl.BlockSpec((None, None, pb, N), lambda i, j, k, s: (i, j, k, 0))
    if in_place:
        state_args, state_specs = common.slot_inputs(state)
    elif reads_state:
        state_args, state_specs = [common.pad_axis(common.pad_axis(state, 2, P), 3, N)], [st]
    else:
        state_args, state_specs = [], []
    extra_specs, extra_args = [], []
    if segments > 1:  # each segment's own end state, transposed [n, p] as the kernels carry it
        seg_states = common.call(
            lambda *refs: _segment_state_kernel(*refs, L=L, chunks=chunks, xconv=xconv),
            grid=(b, h, vb, segments - 1), in_specs=[x_spec, per_head, per_head, per_head, B_spec, *conv_specs],
            out_specs=pl.BlockSpec((None, None, None, N, pb), lambda i, j, k, s: (i, j, s, 0, k)),
            out_shape=jax.ShapeDtypeStruct((b, h, segments - 1, N, P), F32), blocks=blocks, interpret=interpret,
            name="ssd_segment_states",
        )(x3, dt, a_cum, a_to_end, B3, *conv_args)
        extra_specs = [pl.BlockSpec((None, segments - 1, None), lambda i, j, k, s: (i, 0, j)),
                       pl.BlockSpec((None, None, segments - 1, N, pb), lambda i, j, k, s: (i, j, 0, 0, k))]
        extra_args = [segment_decay, seg_states]
    # y time-major with the heads as column blocks [b, T, h*P], the layout of the gated norm that
    # reads it: written [b, T, h, P], XLA converted it to float32 in a pass of its own before the
    # norm (1.5 GB per Codestral layer at 32k tokens; benchmarks/gpu_program.py)
    y_spec = pl.BlockSpec((None, T, pb), lambda i, j, k, s: (i, 0, j * vb + k))
    y_shape = jax.ShapeDtypeStruct((b, T, h * P), x3.dtype)
    if final_state:
        out_specs = [y_spec, pl.BlockSpec() if in_place else st]
        out_shape = [y_shape, jax.ShapeDtypeStruct(state.stacked.shape if in_place else (b, h, P, N), F32)]
    else:
        out_specs, out_shape = [y_spec], [y_shape]
    y, *ends = common.call(
        lambda *refs: _kernel(*refs, L=L, chunks=chunks, segments=segments, xconv=xconv, in_place=in_place,
                              reads_state=reads_state, writes_state=final_state),
        grid=(b, h, vb, segments),
        in_specs=[x_spec, per_head, per_head, per_head, B_spec, C_spec,
                  pl.BlockSpec((None, pb), lambda i, j, k, s: (j, k)), *state_specs, *conv_specs, *extra_specs],
        out_specs=out_specs, out_shape=out_shape,
        blocks=blocks, interpret=interpret, name="ssd_chunked", input_output_aliases={7: 1} if in_place else None,
    )(x3, dt, a_cum, a_to_end, B3, C3, Dp, *state_args, *conv_args, *extra_args)
    y = y.reshape(b, T, h, P)[:, :t, :, :p]
    if not final_state:
        return y, None
    return (y, StateSlot(ends[0], state.layer)) if in_place else (y, ends[0][:, :, :p, :n])


def _forward(x, dt, A, B, C, D, dt_bias, state, *, dt_limit, blocks, interpret, final_state=True):
    b, t, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    P, N = common.padded(p), common.padded(n)
    x3 = common.pad_axis(x, 3, P).reshape(b, t, h * P)
    B3, C3 = (common.pad_axis(v, 3, N).reshape(b, t, g * N) for v in (B, C))
    return _launch(x3, B3, C3, (0, 0, 0), dt, A, D, dt_bias, state, t=t, h=h, p=p, g=g, n=n, dt_limit=dt_limit,
                   blocks=blocks, interpret=interpret, final_state=final_state)


def packable(*, heads: int, head_dim: int, groups: int, state_size: int, value_block: int) -> bool:
    """Whether the kernel can read x, B and C straight out of the packed xbc: every head's and
    group's columns must start on a block boundary and need no padding."""
    p, n = head_dim, state_size
    return (p == common.padded(p) and n == common.padded(n) and (heads * p) % n == 0
            and p % min(value_block, p) == 0)


def _forward_xbc(xbc, dt, A, D, dt_bias, state, *, heads, head_dim, groups, state_size, dt_limit, blocks, interpret,
                 final_state=True):
    h, p, g, n = heads, head_dim, groups, state_size
    if not packable(heads=h, head_dim=p, groups=g, state_size=n, value_block=blocks.value_block):
        x, B, C = ref.split_xbc(xbc, heads=h, head_dim=p, groups=g, state_size=n)
        return _forward(x, dt, A, B, C, D, dt_bias, state, dt_limit=dt_limit, blocks=blocks, interpret=interpret,
                        final_state=final_state)
    e = h * p
    return _launch(xbc, xbc, xbc, (0, e // n, e // n + g), dt, A, D, dt_bias, state, t=xbc.shape[1], h=h, p=p, g=g,
                   n=n, dt_limit=dt_limit, blocks=blocks, interpret=interpret, final_state=final_state)


@common.cached
def _differentiable(chunk_size, dt_limit, blocks, interpret, final_state=True):
    """The kernel, differentiated by the backward kernel (`ssd_backward`) for sequences of at most
    its MAX_CHUNKS chunks and a state passed as an array or None (training), else as `jax.vjp` of
    the reference. final_state=False: None in place of the final state, which is never written."""
    def forward(x, dt, A, B, C, D, dt_bias, state):
        return _forward(x, dt, A, B, C, D, dt_bias, state, dt_limit=dt_limit, blocks=blocks, interpret=interpret,
                        final_state=final_state)

    def reference(x, dt, A, B, C, D, dt_bias, state):
        y, end = through_slot(ref.chunked, x, dt, A, B, C, chunk_size=chunk_size, D=D, dt_bias=dt_bias,
                              dt_limit=dt_limit, initial_state=state)
        return y, end if final_state else None

    from jaxembed.kernels import ssd_backward  # it steps states with this module's `_state_step`

    def backward(args, cotangent):
        x, state = args[0], args[7]
        L = ssd_backward.chunk_length(x.shape[1], blocks.chunk)
        if isinstance(state, StateSlot) or L is None:
            return None
        return ssd_backward.backward(*args, *cotangent, dt_limit=dt_limit, chunk=L, interpret=interpret)

    return common.with_reference_vjp(forward, reference, backward)


@common.cached
def _differentiable_xbc(chunk_size, dims, dt_limit, blocks, interpret):
    h, p, g, n = dims

    def forward(xbc, dt, A, D, dt_bias, state):
        return _forward_xbc(xbc, dt, A, D, dt_bias, state, heads=h, head_dim=p, groups=g, state_size=n,
                            dt_limit=dt_limit, blocks=blocks, interpret=interpret)

    def reference(xbc, dt, A, D, dt_bias, state):  # the split in XLA, the SSD by the split form's kernels
        x, B, C = ref.split_xbc(xbc, heads=h, head_dim=p, groups=g, state_size=n)
        return _differentiable(chunk_size, dt_limit, blocks, interpret)(x, dt, A, B, C, D, dt_bias, state)

    return common.with_reference_vjp(forward, reference)


def chunked(x, dt, A, B, C, *, chunk_size, D=None, dt_bias=None, dt_limit=(0.0, math.inf), initial_state=None,
            blocks: common.BlockSizes | None = None, interpret: bool = False):
    """`ops.ssd.chunked` computed by the Pallas kernel; gradients by the backward kernel
    (`ssd_backward`) for sequences of at most 8 chunks (`ssd_backward.chunk_length`), else `jax.vjp` of the reference
    (run with chunk_size). Returns (y [b, t, h, p] in x's dtype, final state [b, h, p, n] float32)."""
    ref._heads_per_group(x, B, C)
    ref.check_decay_rates(A)
    if x.ndim != 4 or dt.shape != x.shape[:3] or B.shape[:2] != x.shape[:2]:
        raise ValueError(f"expected x [b, t, h, p], dt [b, t, h], B and C [b, t, g, n]; got x {x.shape}, "
                         f"dt {dt.shape}, B {B.shape}")
    h, p = x.shape[2], x.shape[3]
    state = ref._check_state(initial_state, x, B)
    D = jnp.zeros((h,), F32) if D is None else D
    dt_bias = jnp.zeros((h,), F32) if dt_bias is None else dt_bias
    if blocks is None:
        blocks = common.heuristic("ssd", key_dim=B.shape[3], value_dim=p)
    blocks = common.check_blocks(blocks, p, kernel="ssd")
    f = _differentiable(chunk_size, tuple(float(v) for v in dt_limit), blocks, bool(interpret))
    return f(x, dt, A, B, C, D, dt_bias, state)


def _packed_defaults(b, heads, head_dim, groups, state_size, initial_state, D, dt_bias, blocks):
    """The packed entries' shared checks and defaults: (initial state, D, dt_bias, block sizes)."""
    if heads % groups:
        raise ValueError(f"heads ({heads}) must be a multiple of groups ({groups})")
    # None stays None: the kernels start from a zero state without reading one
    state = None if initial_state is None else ops_common.initial_state(initial_state, (b, heads, head_dim, state_size))
    D = jnp.zeros((heads,), F32) if D is None else D
    dt_bias = jnp.zeros((heads,), F32) if dt_bias is None else dt_bias
    if blocks is None:
        blocks = common.heuristic("ssd", key_dim=state_size, value_dim=head_dim)
    return state, D, dt_bias, common.check_blocks(blocks, head_dim, kernel="ssd")


def chunked_xbc(xbc, dt, A, *, heads: int, head_dim: int, groups: int, state_size: int, chunk_size, D=None,
                dt_bias=None, dt_limit=(0.0, math.inf), initial_state=None, blocks: common.BlockSizes | None = None,
                interpret: bool = False):
    """`ops.ssd.chunked_xbc` computed by the Pallas kernel, which reads x, B and C as column blocks
    of xbc [b, t, h*p + 2*g*n] (no split copies) when `packable`, else from split copies."""
    b, t, width = xbc.shape
    ref.check_decay_rates(A)
    if width != heads * head_dim + 2 * groups * state_size or dt.shape != (b, t, heads):
        raise ValueError(f"expected xbc [b, t, h*p + 2*g*n] = [{b}, {t}, {heads * head_dim + 2 * groups * state_size}] "
                         f"and dt [b, t, h] = [{b}, {t}, {heads}]; got xbc {xbc.shape}, dt {dt.shape}")
    state, D, dt_bias, blocks = _packed_defaults(b, heads, head_dim, groups, state_size, initial_state, D, dt_bias,
                                                 blocks)
    f = _differentiable_xbc(chunk_size, (heads, head_dim, groups, state_size), tuple(float(v) for v in dt_limit),
                            blocks, bool(interpret))
    return f(xbc, dt, A, D, dt_bias, state)


def _convolved_by_xla(xbc, conv_state, conv_weight, conv_bias, *, e: int, L: int):
    """What XLA convolves for the kernels that convolve x themselves: B and C (the columns past x's
    e, read by every head of their group) and x's first L rows (chunk 0, whose window reaches into
    the conv state), in xbc's dtype."""
    bc, _ = ref.causal_conv(xbc[..., e:], conv_state[..., e:], conv_weight[:, e:], conv_bias[e:], out_dtype=xbc.dtype)
    head, _ = ref.causal_conv(xbc[:, :L, :e], conv_state[..., :e], conv_weight[:, :e], conv_bias[:e],
                              out_dtype=xbc.dtype)
    return bc, head


def _forward_conv(proj, A, conv_state, conv_weight, conv_bias, D, dt_bias, state, *, offset, dims, dt_limit, blocks,
                  interpret, final_state=True):
    h, p, g, n = dims
    e = h * p
    t, k, L, pb = proj.shape[1], conv_weight.shape[0], blocks.chunk, blocks.value_block
    xbc, dt = ref.split_projection(proj, offset=offset, heads=h, head_dim=p, groups=g, state_size=n)
    new_conv_state = ref.conv_state_after(xbc, conv_state)
    if not (packable(heads=h, head_dim=p, groups=g, state_size=n, value_block=pb) and offset % pb == 0
            and k - 1 <= L):  # x's column blocks must start on block boundaries; the head holds k-1 + L rows
        xbc, _ = ref.causal_conv(xbc, conv_state, conv_weight, conv_bias, out_dtype=proj.dtype)
        y, state = _forward_xbc(xbc, dt, A, D, dt_bias, state, heads=h, head_dim=p, groups=g, state_size=n,
                                dt_limit=dt_limit, blocks=blocks, interpret=interpret, final_state=final_state)
        return y, new_conv_state, state
    # B and C (2*g*n columns, read by every head of their group) are convolved here by XLA; x (h*p
    # columns, each read by one program) is convolved in the kernel, straight from the projection
    # chunk 0 and the partial chunk past the last whole one (when there is one), convolved here:
    # one chunk of rows each, and the kernel's loads stay inside the real rows
    bc, head = _convolved_by_xla(xbc, conv_state, conv_weight, conv_bias, e=e, L=L)
    raw_x, x_weight, x_bias = xbc[..., :e], conv_weight[:, :e], conv_bias[:e]
    head = common.pad_axis(head, 1, L)
    full = t // L
    tail = head
    if full and t % L:
        tail, _ = ref.causal_conv(raw_x[:, full * L:], raw_x[:, full * L - (k - 1):full * L], x_weight, x_bias,
                                  out_dtype=proj.dtype)
        tail = common.pad_axis(tail, 1, L)
    y, state = _launch(proj, bc, bc, (offset // pb, 0, g), dt, A, D, dt_bias, state, t=t, h=h, p=p, g=g, n=n,
                       dt_limit=dt_limit, blocks=blocks, interpret=interpret,
                       x_conv=(head, tail, conv_weight, conv_bias), final_state=final_state)
    return y, new_conv_state, state


@common.cached
def _differentiable_conv(chunk_size, offset, dims, dt_limit, blocks, interpret, final_state):
    h, p, g, n = dims

    def forward(proj, A, conv_state, conv_weight, conv_bias, D, dt_bias, state):
        return _forward_conv(proj, A, conv_state, conv_weight, conv_bias, D, dt_bias, state, offset=offset,
                             dims=dims, dt_limit=dt_limit, blocks=blocks, interpret=interpret,
                             final_state=final_state)

    def front(proj, conv_state, conv_weight, conv_bias):  # the split and the conv (XLA)
        xbc, dt = ref.split_projection(proj, offset=offset, heads=h, head_dim=p, groups=g, state_size=n)
        xbc, new_conv_state = ref.causal_conv(xbc, conv_state, conv_weight, conv_bias, out_dtype=proj.dtype)
        return xbc, dt, new_conv_state

    def reference(proj, A, conv_state, conv_weight, conv_bias, D, dt_bias, state):
        # `ops.ssd.conv_chunked`: the split and conv in XLA, the SSD by the split form's kernels
        # (forward and, for short sequences, backward: `_differentiable`)
        xbc, dt, new_conv_state = front(proj, conv_state, conv_weight, conv_bias)
        x, B, C = ref.split_xbc(xbc, heads=h, head_dim=p, groups=g, state_size=n)
        y, state = _differentiable(chunk_size, dt_limit, blocks, interpret, final_state)(x, dt, A, B, C, D, dt_bias,
                                                                                           state)
        return y, new_conv_state, state

    from jaxembed.kernels import ssd_backward

    def backward(args, cotangent):
        """Short sequences (training): the backward kernel convolves x raw out of proj per chunk, as
        the forward kernel does, so XLA writes no convolved x for it; B and C (and chunk 0 of x)
        come convolved by XLA. Then the conv's and the split's backward in XLA. Else None: `jax.vjp`
        of the reference, which runs the backward kernel on an XLA-convolved x."""
        proj, A, conv_state, conv_weight, conv_bias, D, dt_bias, state = args
        dy, d_conv_state, d_state = cotangent
        e, t = h * p, proj.shape[1]
        L = ssd_backward.chunk_length(t, blocks.chunk)
        if isinstance(state, StateSlot) or L is None or not ssd_backward.can_convolve(
                t=t, chunk=L, head_dim=p, taps=conv_weight.shape[0], offset=offset):
            return None
        xbc, dt = ref.split_projection(proj, offset=offset, heads=h, head_dim=p, groups=g, state_size=n)
        bc, head = _convolved_by_xla(xbc, conv_state, conv_weight, conv_bias, e=e, L=L)
        B, C = (v.reshape(*v.shape[:2], g, n) for v in jnp.split(bc, 2, axis=-1))
        dx, d_dt, dA, dB, dC, dD, d_bias, d_state0 = ssd_backward.backward(
            proj, dt, A, B, C, D, dt_bias, state, dy, d_state if final_state else None, dt_limit=dt_limit, chunk=L,
            interpret=interpret, conv=(head, conv_weight[:, :e], conv_bias[:e]))
        d_xbc = jnp.concatenate([v.reshape(*v.shape[:2], -1).astype(proj.dtype) for v in (dx, dB, dC)], axis=-1)
        _, front_vjp = jax.vjp(front, proj, conv_state, conv_weight, conv_bias)
        d_proj, d_cs, d_w, d_b = front_vjp((d_xbc, d_dt.astype(dt.dtype), d_conv_state))
        return d_proj, dA, d_cs, d_w, d_b, dD, d_bias, d_state0

    return common.with_reference_vjp(forward, reference, backward)


def conv_chunked(proj, A, conv_state, conv_weight, conv_bias, *, offset: int, heads: int, head_dim: int, groups: int,
                 state_size: int, chunk_size, D=None, dt_bias=None, dt_limit=(0.0, math.inf), initial_state=None,
                 final_state: bool = True, blocks: common.BlockSizes | None = None, interpret: bool = False):
    """`ops.ssd.conv_chunked` computed by the Pallas kernel: the projection's output proj [b, t, offset +
    conv_dim + h] -> (y [b, t, h, p], new conv state, final SSD state). x is read raw out of proj and
    convolved per chunk in the kernel (`XConv`; a conv state enters it in proj's dtype, exact for
    the states a model carries, which are earlier rows of proj); B and C are convolved by XLA. A
    None initial state is zero and never read; final_state=False returns None for the final state,
    which is then never written (a layer whose state is dropped: training, horizontal embedding)."""
    b, t, _ = proj.shape
    ref.check_decay_rates(A)
    conv_dim, k = heads * head_dim + 2 * groups * state_size, conv_weight.shape[0]
    if conv_weight.shape != (k, conv_dim) or conv_state.shape != (b, k - 1, conv_dim) or k < 1:
        raise ValueError(f"expected conv weight [k, {conv_dim}] and conv state [{b}, k-1, {conv_dim}]; got "
                         f"{conv_weight.shape} and {conv_state.shape}")
    state, D, dt_bias, blocks = _packed_defaults(b, heads, head_dim, groups, state_size, initial_state, D, dt_bias,
                                                 blocks)
    conv_bias = jnp.zeros((conv_dim,), F32) if conv_bias is None else conv_bias
    f = _differentiable_conv(chunk_size, offset, (heads, head_dim, groups, state_size),
                             tuple(float(v) for v in dt_limit), blocks, bool(interpret), bool(final_state))
    return f(proj, A, conv_state, conv_weight, conv_bias, D, dt_bias, state)
