"""Weights that stand in for a dense matrix inside the params pytree: a LoRA-adapted matrix, a
4-bit NF4 matrix, or both. The models' linear layers call `linear(x, w)`, which multiplies by
a plain array as always and lets a `DerivedWeight` do its own product, so

  * the LoRA path is computed as x W + s (x A) B, not as x (W + s A B): a bfloat16 W would
    round the small update s A B away before it reached the output;
  * an NF4 matrix is dequantised at the matmul, one layer at a time inside the layer scan, so
    no full-precision copy of the base model ever exists.

Derived weights are pytrees whose leaves keep the leading [n_layers] axis of stacked layer
params, so the scheduler's `lax.scan` slices them per layer like any other leaf.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

F32 = jnp.float32


class DerivedWeight:
    """A [..., d_in, d_out] matrix given by other arrays. Subclasses are registered pytrees."""

    @property
    def shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    @property
    def dtype(self):
        raise NotImplementedError

    def dense(self) -> jax.Array:
        """The matrix itself, in `self.dtype`."""
        raise NotImplementedError

    def matmul(self, x, compute_dtype, out_dtype=F32) -> jax.Array:
        """x [b, t, d_in] @ self -> [b, t, d_out] in out_dtype (accumulated in float32), operands in
        `compute_dtype`."""
        return dot(x, self.dense(), compute_dtype, out_dtype)


def is_derived(leaf) -> bool:
    return isinstance(leaf, DerivedWeight)


def dot(x, w, compute_dtype, out_dtype=F32):
    """x [b, t, d_in] @ w [d_in, d_out] with both operands in compute_dtype, accumulated in float32,
    written in out_dtype. An out_dtype wider than the operands (bfloat16 in, float32 out: a GEMM
    whose epilogue adds into a float32 residual) keeps the backward in the operands' dtype: the
    cotangent is rounded to compute_dtype first, as a bfloat16 Linear's grad_output is. Autodiff of
    the einsum would instead multiply the float32 cotangent by the weight converted to float32:
    float32 GEMMs reading twice the bytes."""
    x, w = x.astype(compute_dtype), w.astype(compute_dtype)
    if jnp.dtype(out_dtype).itemsize > jnp.dtype(compute_dtype).itemsize:
        return _widening_dot(x, w, jnp.dtype(out_dtype))
    return jnp.einsum("btd,de->bte", x, w, preferred_element_type=out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _widening_dot(x, w, out_dtype):
    return jnp.einsum("btd,de->bte", x, w, preferred_element_type=out_dtype)


def _widening_dot_fwd(x, w, out_dtype):
    return _widening_dot(x, w, out_dtype), (x, w)


def _widening_dot_bwd(out_dtype, residuals, g):
    x, w = residuals
    g = g.astype(x.dtype)
    # written in the operands' dtype by the GEMMs themselves (accumulated in float32 as any bfloat16
    # GEMM is): a float32 product cast down would be kept in float32 by XLA, which may drop a
    # float32 -> bfloat16 -> float32 round trip (excess precision)
    dx = jnp.einsum("bte,de->btd", g, w, preferred_element_type=x.dtype)
    dw = jnp.einsum("btd,bte->de", x, g, preferred_element_type=w.dtype)
    return dx, dw


_widening_dot.defvjp(_widening_dot_fwd, _widening_dot_bwd)


def dot_sum(x, w, y, v, compute_dtype, out_dtype=F32):
    """x @ w + y @ v (x [b, t, d], y [b, t, r]) as one GEMM, [x | y] @ [w ; v], operands in
    compute_dtype, accumulated in float32 and written once in out_dtype. For a LoRA product
    x W + (s x A) B this replaces a second GEMM that writes a whole [b, t, d_out] output, read back
    to be added, by a copy of x widened by r columns; its backward takes the cotangent of [x | y]
    in one GEMM too, and rounds the cotangent to compute_dtype as `dot` does."""
    x, w, y, v = (a.astype(compute_dtype) for a in (x, w, y, v))
    return _dot_sum(x, w, y, v, jnp.dtype(out_dtype))


def _stacked(x, w, y, v):
    return jnp.concatenate([x, y], axis=-1), jnp.concatenate([w, v], axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _dot_sum(x, w, y, v, out_dtype):
    xy, wv = _stacked(x, w, y, v)
    return jnp.einsum("btd,de->bte", xy, wv, preferred_element_type=out_dtype)


def _dot_sum_fwd(x, w, y, v, out_dtype):
    return _dot_sum(x, w, y, v, out_dtype), (x, w, y, v)


def _dot_sum_bwd(out_dtype, residuals, g):
    x, w, y, v = residuals
    g = g.astype(x.dtype)
    d, n = w.shape
    if n < 2 * d:
        # dx in a GEMM of its own: XLA adds the LoRA down-projection's dx into it (cuBLAS beta = 1),
        # which from the joint GEMM's [dx | dy] took a copy of the dx columns first (4 d bytes a token,
        # against 2 n for reading g twice)
        dx = jnp.einsum("bte,de->btd", g, w, preferred_element_type=x.dtype)
        dy = jnp.einsum("bte,de->btd", g, v, preferred_element_type=x.dtype)
    else:
        _, wv = _stacked(x, w, y, v)
        dxy = jnp.einsum("bte,de->btd", g, wv, preferred_element_type=x.dtype)
        dx, dy = dxy[..., :d], dxy[..., d:]
    # a frozen w's cotangent (LoRA's base) is dropped by the caller, and its GEMM with it
    dw = jnp.einsum("btd,bte->de", x, g, preferred_element_type=w.dtype)
    dv = jnp.einsum("btd,bte->de", y, g, preferred_element_type=v.dtype)
    return dx, dw, dy, dv


_dot_sum.defvjp(_dot_sum_fwd, _dot_sum_bwd)


def linear(x, w, compute_dtype=None, bias=None, out_dtype=F32, *, down=None):
    """x [b, t, d_in] @ w [d_in, d_out] (+ bias) -> [b, t, d_out] in out_dtype (float32 by default).

    compute_dtype: the matmul operands' dtype (default: x's). w may be an array or a DerivedWeight.
    out_dtype: the product is accumulated in float32 either way; a bfloat16 out_dtype makes the GEMM
    write bfloat16 (half the bytes), as a PyTorch bfloat16 Linear does.
    down: `shared_down`'s value for w, when w is one part of a LoRA adapter shared with others.
    """
    compute_dtype = x.dtype if compute_dtype is None else compute_dtype
    if bias is None and not is_derived(w):
        return dot(x, w, compute_dtype, out_dtype)
    extra = {} if down is None else {"down": down}
    if bias is None:  # a derived weight writes out_dtype itself (under autodiff: a cotangent in out_dtype)
        return w.matmul(x, compute_dtype, out_dtype, **extra)
    y = w.matmul(x, compute_dtype, **extra) if is_derived(w) else dot(x, w, compute_dtype)
    return (y + bias.astype(F32)).astype(out_dtype)


def shared_down(ws, x, compute_dtype=None):
    """LoRA's down-projection s x A, once for weights that are the parts of one adapter (A shared:
    Mamba2's z_proj and xbcdt_proj under in_proj's adapter), to pass to each `linear(..., down=)`;
    None for any other weights. Computed once, x is read once for it, and under autodiff dA and the
    down-projection's share of dx are one GEMM each for all the parts."""
    groups = {getattr(w, "adapter_group", None) for w in ws}
    if len(groups) != 1 or None in groups:
        return None
    return ws[0].down(x, x.dtype if compute_dtype is None else compute_dtype)


def lm_head(hidden, head):
    """Language-model logits: hidden [..., d] against head [vocab, d] (operands in head's dtype) ->
    [..., vocab] float32."""
    return jnp.einsum("...d,vd->...v", hidden.astype(head.dtype), head, preferred_element_type=F32)


def densify(tree):
    """Every DerivedWeight in `tree` replaced by its dense matrix (for export and checks)."""
    return jax.tree.map(lambda leaf: leaf.dense() if is_derived(leaf) else leaf, tree, is_leaf=is_derived)
