"""Chunked SSD (Mamba2) as one Pallas kernel; reference: `jaxembed.ops.ssd.chunked` (same signature).

One program per (batch row b, head h, block of head-dim columns) walks the chunks of L tokens.
For chunk c, entering with the state S [p, n] (float32, in registers):

    M     = tril(C Bᵀ ∘ exp(a_cum_l - a_cum_s)) diag(dt)          [l, s]   (eq. 8)
    y     = M x + diag(exp(a_cum)) C Sᵀ + D x                    [l, p]   (eqs. 8, 11)
    S     = exp(a_cum_L) S + (x ∘ dt exp(a_to_end))ᵀ B            [p, n]   (eqs. 9, 10)

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

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxembed.kernels import common
from jaxembed.ops import common as ops_common
from jaxembed.ops import ssd as ref

F32 = jnp.float32


def _state_step(S, x, Bc, dt, a_cum, a_to_end):
    """The state entering a chunk -> the state leaving it (eqs. 9, 10); S [pb, n] float32."""
    w = (x.astype(F32) * (dt * jnp.exp(a_to_end))[:, None]).astype(x.dtype)  # [s, pb]
    chunk_decay = jnp.exp(jnp.min(a_cum))  # a_cum falls monotonically (A < 0, dt >= 0): min = last
    return chunk_decay * S + common.dot(w, Bc, trans_a=True)


def _kernel(x_ref, dt_ref, a_cum_ref, a_to_end_ref, B_ref, C_ref, D_ref, s0_ref, *refs, L, chunks, segments):
    """Segment `program_id(3)` of the sequence (all of it when segments == 1): `chunks` chunks from
    the state entering the segment, which is the initial state carried through the segments before
    it by their own end states (`_segment_state_kernel`) and decays."""
    if segments > 1:
        seg_decay_ref, seg_state_ref, y_ref, s_ref = refs
    else:
        y_ref, s_ref = refs
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
        return _state_step(S, x, Bc, dt, a_cum, a_to_end)

    S, first = s0_ref[...], 0
    if segments > 1:
        segment = pl.program_id(3)
        S = lax.fori_loop(0, segment, lambda j, S: jnp.exp(seg_decay_ref[j]) * S + seg_state_ref[j], S)
        first = segment * chunks
    s_ref[...] = lax.fori_loop(first, first + chunks, chunk, S)


def _segment_state_kernel(x_ref, dt_ref, a_cum_ref, a_to_end_ref, B_ref, s_ref, *, L, chunks):
    """The end state of segment `program_id(3)` entered with a zero state: the state half of
    `_kernel`'s loop (one dot per chunk, no outputs per token)."""

    def chunk(c, S):
        t = pl.ds(pl.multiple_of(c * L, L), L)
        return _state_step(S, x_ref[t, :], B_ref[t, :], dt_ref[t], a_cum_ref[t], a_to_end_ref[t])

    first = pl.program_id(3) * chunks
    s_ref[...] = lax.fori_loop(first, first + chunks, chunk, jnp.zeros(s_ref.shape, F32))


def _per_head_decays(dt, A, dt_bias, *, dt_limit, L: int, T: int, segments: int):
    """dt [b, t, h] -> (dt, a_cum, a_to_end), each [b, T, h] float32, kept time-major like the
    in_proj output they come from (a [b, h, T] layout here would make XLA lay the whole in_proj
    output out feature-major and transpose every activation around the kernel), and the log decay
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


def _launch(x3, B3, C3, offsets, dt, A, D, dt_bias, state, *, t, h, p, g, n, dt_limit, blocks, interpret):
    """The kernel over column blocks of time-major arrays: x3 holds head j's values in columns
    [j*P, (j+1)*P) after `offsets[0]` blocks of value_block columns; B3 and C3 hold group gg's
    in columns [gg*N, (gg+1)*N) after offsets[1] / offsets[2] blocks of N columns. They may be
    one array (the packed xbc). Returns (y [b, t, h, p], final state [b, h, p, n])."""
    b = x3.shape[0]
    r = h // g
    L, pb = blocks.chunk, blocks.value_block
    P, N = common.padded(p), common.padded(n)
    vb = P // pb  # value blocks per head
    segments, chunks, T = common.segment_layout(blocks, programs=b * h * vb, t=t)
    dt, a_cum, a_to_end, segment_decay = _per_head_decays(dt, A, dt_bias, dt_limit=dt_limit, L=L, T=T,
                                                          segments=segments)
    x3, B3, C3 = (common.pad_axis(v, 1, T) for v in (x3, B3, C3))
    Dp = common.pad_axis(jnp.broadcast_to((D[:, None] if D.ndim == 1 else D).astype(F32), (h, p)), 1, P)
    s0 = common.pad_axis(common.pad_axis(state, 2, P), 3, N)
    x_off, B_off, C_off = offsets

    x_spec = pl.BlockSpec((None, T, pb), lambda i, j, k, s: (i, 0, x_off + j * vb + k))
    per_head = pl.BlockSpec((None, T, None), lambda i, j, k, s: (i, 0, j))
    B_spec = pl.BlockSpec((None, T, N), lambda i, j, k, s: (i, 0, B_off + j // r))
    C_spec = pl.BlockSpec((None, T, N), lambda i, j, k, s: (i, 0, C_off + j // r))
    st = pl.BlockSpec((None, None, pb, N), lambda i, j, k, s: (i, j, k, 0))
    seg_st = pl.BlockSpec((None, None, None, pb, N), lambda i, j, k, s: (i, j, s, k, 0))
    extra_specs, extra_args = [], []
    if segments > 1:
        seg_states = common.call(
            lambda *refs: _segment_state_kernel(*refs, L=L, chunks=chunks),
            grid=(b, h, vb, segments - 1), in_specs=[x_spec, per_head, per_head, per_head, B_spec], out_specs=seg_st,
            out_shape=jax.ShapeDtypeStruct((b, h, segments - 1, P, N), F32), blocks=blocks, interpret=interpret,
            name="ssd_segment_states",
        )(x3, dt, a_cum, a_to_end, B3)
        extra_specs = [pl.BlockSpec((None, segments - 1, None), lambda i, j, k, s: (i, 0, j)),
                       pl.BlockSpec((None, None, segments - 1, pb, N), lambda i, j, k, s: (i, j, 0, k, 0))]
        extra_args = [segment_decay, seg_states]
    y, ends = common.call(
        lambda *refs: _kernel(*refs, L=L, chunks=chunks, segments=segments),
        grid=(b, h, vb, segments),
        in_specs=[x_spec, per_head, per_head, per_head, B_spec, C_spec,
                  pl.BlockSpec((None, pb), lambda i, j, k, s: (j, k)), st, *extra_specs],
        # y time-major with the heads as column blocks [b, T, h*P], the layout of the gated norm that
        # reads it: written [b, T, h, P], XLA converted it to float32 in a pass of its own before the
        # norm (1.5 GB per Codestral layer at 32k tokens; benchmarks/gpu_program.py)
        out_specs=[pl.BlockSpec((None, T, pb), lambda i, j, k, s: (i, 0, j * vb + k)), seg_st],
        out_shape=[jax.ShapeDtypeStruct((b, T, h * P), x3.dtype), jax.ShapeDtypeStruct((b, h, segments, P, N), F32)],
        blocks=blocks, interpret=interpret, name="ssd_chunked",
    )(x3, dt, a_cum, a_to_end, B3, C3, Dp, s0, *extra_args)
    return y.reshape(b, T, h, P)[:, :t, :, :p], ends[:, :, -1, :p, :n]


def _forward(x, dt, A, B, C, D, dt_bias, state, *, dt_limit, blocks, interpret):
    b, t, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    P, N = common.padded(p), common.padded(n)
    x3 = common.pad_axis(x, 3, P).reshape(b, t, h * P)
    B3, C3 = (common.pad_axis(v, 3, N).reshape(b, t, g * N) for v in (B, C))
    return _launch(x3, B3, C3, (0, 0, 0), dt, A, D, dt_bias, state, t=t, h=h, p=p, g=g, n=n, dt_limit=dt_limit,
                   blocks=blocks, interpret=interpret)


def packable(*, heads: int, head_dim: int, groups: int, state_size: int, value_block: int) -> bool:
    """Whether the kernel can read x, B and C straight out of the packed xbc: every head's and
    group's columns must start on a block boundary and need no padding."""
    p, n = head_dim, state_size
    return (p == common.padded(p) and n == common.padded(n) and (heads * p) % n == 0
            and p % min(value_block, p) == 0)


def _forward_xbc(xbc, dt, A, D, dt_bias, state, *, heads, head_dim, groups, state_size, dt_limit, blocks, interpret):
    h, p, g, n = heads, head_dim, groups, state_size
    if not packable(heads=h, head_dim=p, groups=g, state_size=n, value_block=blocks.value_block):
        x, B, C = ref.split_xbc(xbc, heads=h, head_dim=p, groups=g, state_size=n)
        return _forward(x, dt, A, B, C, D, dt_bias, state, dt_limit=dt_limit, blocks=blocks, interpret=interpret)
    e = h * p
    return _launch(xbc, xbc, xbc, (0, e // n, e // n + g), dt, A, D, dt_bias, state, t=xbc.shape[1], h=h, p=p, g=g,
                   n=n, dt_limit=dt_limit, blocks=blocks, interpret=interpret)


@common.cached
def _differentiable(chunk_size, dt_limit, blocks, interpret):
    def forward(x, dt, A, B, C, D, dt_bias, state):
        return _forward(x, dt, A, B, C, D, dt_bias, state, dt_limit=dt_limit, blocks=blocks, interpret=interpret)

    def reference(x, dt, A, B, C, D, dt_bias, state):
        return ref.chunked(x, dt, A, B, C, chunk_size=chunk_size, D=D, dt_bias=dt_bias, dt_limit=dt_limit,
                           initial_state=state)

    return common.with_reference_vjp(forward, reference)


@common.cached
def _differentiable_xbc(chunk_size, dims, dt_limit, blocks, interpret):
    h, p, g, n = dims

    def forward(xbc, dt, A, D, dt_bias, state):
        return _forward_xbc(xbc, dt, A, D, dt_bias, state, heads=h, head_dim=p, groups=g, state_size=n,
                            dt_limit=dt_limit, blocks=blocks, interpret=interpret)

    def reference(xbc, dt, A, D, dt_bias, state):
        return ref.chunked_xbc(xbc, dt, A, heads=h, head_dim=p, groups=g, state_size=n, chunk_size=chunk_size, D=D,
                               dt_bias=dt_bias, dt_limit=dt_limit, initial_state=state)

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


def chunked_xbc(xbc, dt, A, *, heads: int, head_dim: int, groups: int, state_size: int, chunk_size, D=None,
                dt_bias=None, dt_limit=(0.0, math.inf), initial_state=None, blocks: common.BlockSizes | None = None,
                interpret: bool = False):
    """`ops.ssd.chunked_xbc` computed by the Pallas kernel, which reads x, B and C as column blocks
    of xbc [b, t, h*p + 2*g*n] (no split copies) when `packable`, else from split copies."""
    b, t, width = xbc.shape
    if width != heads * head_dim + 2 * groups * state_size or dt.shape != (b, t, heads):
        raise ValueError(f"expected xbc [b, t, h*p + 2*g*n] = [{b}, {t}, {heads * head_dim + 2 * groups * state_size}] "
                         f"and dt [b, t, h] = [{b}, {t}, {heads}]; got xbc {xbc.shape}, dt {dt.shape}")
    if heads % groups:
        raise ValueError(f"heads ({heads}) must be a multiple of groups ({groups})")
    state = ops_common.initial_state(initial_state, (b, heads, head_dim, state_size))
    D = jnp.zeros((heads,), F32) if D is None else D
    dt_bias = jnp.zeros((heads,), F32) if dt_bias is None else dt_bias
    if blocks is None:
        blocks = common.heuristic("ssd", key_dim=state_size, value_dim=head_dim)
    blocks = common.check_blocks(blocks, head_dim)
    f = _differentiable_xbc(chunk_size, (heads, head_dim, groups, state_size), tuple(float(v) for v in dt_limit),
                            blocks, bool(interpret))
    return f(xbc, dt, A, D, dt_bias, state)
