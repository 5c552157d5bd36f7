"""LoRA's stacked GEMM input [u | s u A] written by the norm that produces u: one Pallas kernel.

A LoRA layer runs u W + s (u A) B as one GEMM over [u | s u A] and [W ; B]
(`weights.dot_stacked`). Built by XLA (`ops.norm.stacked_lora_input`), that input costs passes of
its own beyond the norm's: a GEMM reads u for u A, and a concatenation reads u again and writes
[u | s u A]. In Mamba2's training step that is three times a layer (in_proj's input in the forward
and in the rematerialised forward, out_proj's once), ~20% of the step's glue bytes on the GPU
(docs/benchmarks.md, session 17). Here each program normalises a block of rows, one column chunk
at a time, writes u and accumulates u A on the tensor cores, then writes s u A beside it: the
norm's own reads, and one write of the stacked input.

`normed_in_place` is the same kernel without an adapter, its output written over its input:
Mamba2's gated norm at inference, whose n then takes y's buffer instead of being a third
[t, e] temporary beside y and z.

Differentiated as the reference (`common.with_reference_vjp`): the backward recomputes the norm
in XLA, as autodiff of the XLA form did.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jaxembed.kernels import common
from jaxembed.ops import norm as ref

F32 = jnp.float32
ROWS = 32  # rows per program
MAX_CHUNK = 256  # columns per step: [32, 256] float32 tiles, 64 registers a thread at 4 warps
BLOCKS = common.BlockSizes(num_warps=4, num_stages=2)
ONE_PASS_TILE = 8192  # float32 elements of a whole-group tile held at once: 64 registers a thread at 4 warps
BACKWARD_TILE = 4096  # the backward's: about six float32 tiles are live, 16 registers each at 8 warps
BACKWARD_BLOCKS = common.BlockSizes(num_warps=8, num_stages=1)


def _kernel(*refs, d, r, rp, group_size, rows_per_program, chunk, gated, eps, scale, n_rows):
    """Programs over blocks of rows. Per group of channels: the sum of squares over the group's
    column chunks, then each chunk normalised and written. With a LoRA adapter (r > 0) u A is
    accumulated on the tensor cores and s u A written after the row's d columns. A group held in
    one chunk is read once."""
    refs = list(refs)
    x_ref = refs.pop(0)
    z_ref = refs.pop(0) if gated else None
    w_ref = refs.pop(0)
    a_ref = refs.pop(0) if r else None
    (out_ref,) = refs
    first = pl.program_id(0) * rows_per_program
    rows = pl.ds(pl.multiple_of(first, rows_per_program), rows_per_program)
    row_ok = first + lax.broadcasted_iota(jnp.int32, (rows_per_program,), 0) < n_rows
    lane = lax.broadcasted_iota(jnp.int32, (chunk,), 0)
    steps = -(-group_size // chunk)

    def tile(g, k):
        """(columns, column mask, [rows, chunk] float32 norm input) of step k of group g; columns
        past the group (and rows past the array) read as zeros."""
        start = g * group_size + k * chunk
        col_ok = lane < group_size - k * chunk
        mask = row_ok[:, None] & col_ok[None, :]
        cols = pl.ds(start, chunk)
        v = plt.load(x_ref.at[rows, cols], mask=mask, other=0.0).astype(F32)
        if gated:
            zf = plt.load(z_ref.at[rows, cols], mask=mask, other=0.0).astype(F32)
            v = v * (zf / (1.0 + jnp.exp(-zf)))  # ops.ssd.silu
        return cols, col_ok, mask, v

    def inverse_rms(square_sum):
        return lax.rsqrt(square_sum / group_size + eps)

    def write(cols, col_ok, mask, v, inv, down):
        w = plt.load(w_ref.at[cols], mask=col_ok, other=0.0).astype(F32)
        u = (v * inv[:, None] * w[None, :]).astype(out_ref.dtype)
        plt.store(out_ref.at[rows, cols], u, mask=mask)
        if not r:
            return down
        a = plt.load(a_ref.at[cols, :], mask=col_ok[:, None], other=0.0)
        return down + common.dot(u, a)

    def group(g, down):
        if steps == 1:
            cols, col_ok, mask, v = tile(g, 0)
            return write(cols, col_ok, mask, v, inverse_rms(jnp.sum(v * v, axis=1)), down)

        def square_sum(k, acc):
            *_, v = tile(g, k)
            return acc + jnp.sum(v * v, axis=1)

        inv = inverse_rms(lax.fori_loop(0, steps, square_sum, jnp.zeros((rows_per_program,), F32)))
        return lax.fori_loop(0, steps, lambda k, down: write(*tile(g, k), inv, down), down)

    down = lax.fori_loop(0, d // group_size, group, jnp.zeros((rows_per_program, rp), F32))
    if not r:
        return
    down_ok = row_ok[:, None] & (lax.broadcasted_iota(jnp.int32, (rp,), 0) < r)[None, :]
    # a rank padded to rp columns reaches past the row's end: a traced start (the mask keeps the
    # store in the row) rather than a static slice, which the ref's bounds check would refuse
    down_cols = pl.ds(d + 0 * pl.program_id(0), rp) if rp > r else pl.ds(d, r)
    plt.store(out_ref.at[rows, down_cols], (scale * down).astype(out_ref.dtype), mask=down_ok)


@common.cached
def _build(scale: float, eps: float, group_size: int, out_dtype, interpret: bool):
    def forward(x, weight, a, gate):
        *lead, d = x.shape
        r = a.shape[-1]
        rp = common.padded(r)
        n_rows = x.size // d
        chunk = min(MAX_CHUNK, common.padded(group_size))
        inputs = [x.reshape(n_rows, d)] + ([] if gate is None else [gate.reshape(n_rows, d)])
        inputs += [weight, common.pad_axis(a.astype(out_dtype), 1, rp)]
        kernel = functools.partial(_kernel, d=d, r=r, rp=rp, group_size=group_size, rows_per_program=ROWS,
                                   chunk=chunk, gated=gate is not None, eps=eps, scale=scale, n_rows=n_rows)
        out = common.call(kernel, grid=(-(-n_rows // ROWS),), in_specs=[pl.BlockSpec()] * len(inputs),
                          out_specs=pl.BlockSpec(), out_shape=jax.ShapeDtypeStruct((n_rows, d + r), out_dtype),
                          blocks=BLOCKS, interpret=interpret, name="stacked_lora_input")(*inputs)
        return out.reshape(*lead, d + r)

    def reference(x, weight, a, gate):
        return ref.stacked_lora_input(x, weight, a, gate, scale=scale, eps=eps, group_size=group_size,
                                      out_dtype=out_dtype)

    return common.with_reference_vjp(forward, reference)


def stacked_lora_input(x, weight, a, gate=None, *, scale, eps, group_size, out_dtype, interpret=False):
    """`ops.norm.stacked_lora_input` as one kernel: [u | s u A] [b, t, d + r] in out_dtype, with u
    the RMSNorm of x [b, t, d] (of x ∘ silu(gate) with a gate) over groups of `group_size`
    channels, times weight [d], and A [d, r]."""
    d = x.shape[-1]
    if x.ndim != 3 or d % group_size or weight.shape != (d,) or a.ndim != 2 or a.shape[0] != d:
        raise ValueError(f"stacked_lora_input: x [b, t, d] needs weight [d], A [d, r] and a group size dividing d; "
                         f"got x {x.shape}, weight {weight.shape}, A {a.shape}, group size {group_size}")
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"stacked_lora_input: the gate's shape {gate.shape} is not x's {x.shape}")
    return _build(float(scale), float(eps), int(group_size), jnp.dtype(out_dtype), bool(interpret))(
        x, weight, a, gate)


@common.cached
def _build_in_place(eps: float, group_size: int, interpret: bool):
    def forward(x, weight, gate):
        *lead, d = x.shape
        n_rows = x.size // d
        group_tile = common.padded(group_size)
        if group_tile <= ONE_PASS_TILE:  # the whole group in registers: x and the gate read once
            rows_per_program, chunk = ONE_PASS_TILE // group_tile, group_tile
        else:
            rows_per_program, chunk = ROWS, MAX_CHUNK
        inputs = [x.reshape(n_rows, d)] + ([] if gate is None else [gate.reshape(n_rows, d)]) + [weight]
        kernel = functools.partial(_kernel, d=d, r=0, rp=0, group_size=group_size, rows_per_program=rows_per_program,
                                   chunk=chunk, gated=gate is not None, eps=eps, scale=0.0, n_rows=n_rows)
        out = common.call(kernel, grid=(-(-n_rows // rows_per_program),), in_specs=[pl.BlockSpec()] * len(inputs),
                          out_specs=pl.BlockSpec(), out_shape=jax.ShapeDtypeStruct((n_rows, d), x.dtype),
                          blocks=BLOCKS, interpret=interpret, name="normed_in_place",
                          input_output_aliases={0: 0})(*inputs)
        return out.reshape(x.shape)

    def reference(x, weight, gate):
        return ref.normed(x, weight, gate, eps=eps, group_size=group_size, out_dtype=x.dtype)

    return common.with_reference_vjp(forward, reference)


def normed_in_place(x, weight, gate=None, *, eps, group_size, interpret=False):
    """`ops.norm.normed(x, weight, gate)` in x's dtype, written over x [b, t, d] (its buffer is
    the output's when x is not used again): the norm adds no [b, t, d] temporary beside its
    input. Each program holds whole groups of a few rows (groups up to 8,192 channels) and reads x
    and the gate once."""
    d = x.shape[-1]
    if x.ndim != 3 or d % group_size or weight.shape != (d,):
        raise ValueError(f"normed_in_place: x [b, t, d] needs weight [d] and a group size dividing d; "
                         f"got x {x.shape}, weight {weight.shape}, group size {group_size}")
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"normed_in_place: the gate's shape {gate.shape} is not x's {x.shape}")
    return _build_in_place(float(eps), int(group_size), bool(interpret))(x, weight, gate)


def _backward_kernel(y_ref, z_ref, dn_ref, w_ref, dy_ref, dz_ref, n_ref, inv_ref, *, d, group_size, rows_per_program,
                     chunk, eps, n_rows):
    """`ops.norm.gated_norm_backward` for a block of rows, one whole group at a time: y, z and dn
    read once, the two per-group sums taken in registers, dy, dz and n written, and 1/rms stored
    [groups, rows]."""
    first = pl.program_id(0) * rows_per_program
    rows = pl.ds(pl.multiple_of(first, rows_per_program), rows_per_program)
    row_ok = first + lax.broadcasted_iota(jnp.int32, (rows_per_program,), 0) < n_rows
    col_ok = lax.broadcasted_iota(jnp.int32, (chunk,), 0) < group_size
    mask = row_ok[:, None] & col_ok[None, :]

    def group(g, carry):
        cols = pl.ds(g * group_size, chunk)
        y = plt.load(y_ref.at[rows, cols], mask=mask, other=0.0).astype(F32)
        zf = plt.load(z_ref.at[rows, cols], mask=mask, other=0.0).astype(F32)
        dn_w = plt.load(dn_ref.at[rows, cols], mask=mask, other=0.0).astype(F32)
        w = plt.load(w_ref.at[cols], mask=col_ok, other=0.0).astype(F32)[None, :]
        dn_w = dn_w * w
        e = jnp.exp(-zf)
        gate, sig = zf / (1.0 + e), 1.0 / (1.0 + e)  # ops.ssd.silu, sigmoid
        gated = y * gate
        inv = lax.rsqrt(jnp.sum(gated * gated, axis=1) / group_size + eps)[:, None]
        s = (jnp.sum(dn_w * gated, axis=1) / group_size)[:, None]
        dg = inv * (dn_w - gated * (inv * inv) * s)
        plt.store(dy_ref.at[rows, cols], (dg * gate).astype(dy_ref.dtype), mask=mask)
        plt.store(dz_ref.at[rows, cols], (dg * y * sig * (1.0 + zf * (1.0 - sig))).astype(dz_ref.dtype), mask=mask)
        plt.store(n_ref.at[rows, cols], (gated * inv * w).astype(n_ref.dtype), mask=mask)
        plt.store(inv_ref.at[g, rows], inv[:, 0], mask=row_ok)
        return carry

    lax.fori_loop(0, d // group_size, group, 0)


def gated_norm_backward(y, z, dn, weight, *, eps, group_size, norm_dtype, interpret=False):
    """`ops.norm.gated_norm_backward` as one pass: (dy, dz, n, 1/rms [..., groups]) from y, z and
    n's cotangent dn [b, t, d]. Each program holds whole groups (up to BACKWARD_TILE channels) of a
    few rows; XLA's form reads y, z and dn twice, once for the sums and once for the outputs."""
    *lead, d = y.shape
    group_tile = common.padded(group_size)
    if d % group_size or group_tile > BACKWARD_TILE or z.shape != y.shape or dn.shape != y.shape \
            or weight.shape != (d,):
        raise ValueError(f"gated_norm_backward: y, z and dn [..., d] need weight [d] and a group size dividing d of "
                         f"at most {BACKWARD_TILE} channels; got y {y.shape}, z {z.shape}, dn {dn.shape}, "
                         f"weight {weight.shape}, group size {group_size}")
    n_rows, groups = y.size // d, d // group_size
    rows_per_program = BACKWARD_TILE // group_tile
    kernel = functools.partial(_backward_kernel, d=d, group_size=group_size, rows_per_program=rows_per_program,
                               chunk=group_tile, eps=float(eps), n_rows=n_rows)
    flat = jax.ShapeDtypeStruct((n_rows, d), y.dtype)
    dy, dz, n, inv = common.call(
        kernel, grid=(-(-n_rows // rows_per_program),), in_specs=[pl.BlockSpec()] * 4, out_specs=[pl.BlockSpec()] * 4,
        out_shape=[flat, flat.update(dtype=z.dtype), flat.update(dtype=jnp.dtype(norm_dtype)),
                   jax.ShapeDtypeStruct((groups, n_rows), F32)],
        blocks=BACKWARD_BLOCKS, interpret=interpret, name="gated_norm_backward",
    )(y.reshape(n_rows, d), z.reshape(n_rows, d), dn.reshape(n_rows, d), weight)
    return dy.reshape(y.shape), dz.reshape(y.shape), n.reshape(y.shape), inv.T.reshape(*lead, groups)
