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

import dataclasses
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
    """x @ w + y @ v (x [b, t, d], y [b, t, r]) as one GEMM, [x | y] @ [w ; v] (`dot_stacked`)."""
    x, y = x.astype(compute_dtype), y.astype(compute_dtype)
    return dot_stacked(jnp.concatenate([x, y], axis=-1), w, v, compute_dtype, out_dtype)


def dot_stacked(xy, w, v, compute_dtype, out_dtype=F32):
    """[x | y] @ [w ; v] (xy [b, t, d + r], w [d, n], v [r, n]) as one GEMM, operands in
    compute_dtype, accumulated in float32 and written once in out_dtype. For a LoRA product
    x W + (s x A) B this replaces a second GEMM that writes a whole [b, t, n] output, read back to
    be added; its backward takes the cotangent of [x | y] in one GEMM too, and rounds the cotangent
    to compute_dtype as `dot` does. xy is built by `dot_sum`'s concatenation, or by the norm that
    produces x (`normed_input`)."""
    xy, w, v = (a.astype(compute_dtype) for a in (xy, w, v))
    return _dot_stacked(xy, w, v, jnp.dtype(out_dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _dot_stacked(xy, w, v, out_dtype):
    return jnp.einsum("btd,de->bte", xy, jnp.concatenate([w, v], axis=0), preferred_element_type=out_dtype)


def _dot_stacked_fwd(xy, w, v, out_dtype):
    return _dot_stacked(xy, w, v, out_dtype), (xy, w, v)


def _dot_stacked_bwd(out_dtype, residuals, g):
    xy, w, v = residuals
    g = g.astype(xy.dtype)
    d, n = w.shape
    x, y = xy[..., :d], xy[..., d:]
    if n < 2 * d:
        # dx in a GEMM of its own: XLA adds the LoRA down-projection's dx into it (cuBLAS beta = 1),
        # which from the joint GEMM's [dx | dy] took a copy of the dx columns first (4 d bytes a token,
        # against 2 n for reading g twice)
        dxy = jnp.concatenate([jnp.einsum("bte,de->btd", g, w, preferred_element_type=xy.dtype),
                               jnp.einsum("bte,de->btd", g, v, preferred_element_type=xy.dtype)], axis=-1)
    else:
        dxy = jnp.einsum("bte,de->btd", g, jnp.concatenate([w, v], axis=0), preferred_element_type=xy.dtype)
    # a frozen w's cotangent (LoRA's base) is dropped by the caller, and its GEMM with it
    dw = jnp.einsum("btd,bte->de", x, g, preferred_element_type=w.dtype)
    dv = jnp.einsum("btd,bte->de", y, g, preferred_element_type=v.dtype)
    return dxy, dw, dv


_dot_stacked.defvjp(_dot_stacked_fwd, _dot_stacked_bwd)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["xy"], meta_fields=["width", "adapter"])
@dataclasses.dataclass(frozen=True)
class StackedInput:
    """A layer input x [b, t, d] beside its LoRA down-projection s x A [b, t, r], in one buffer
    xy = [x | s x A] [b, t, d + r] (`normed_input`): the GEMM input of every matrix adapted by
    `adapter`, which reads it whole (`dot_stacked`); any other matrix reads its x columns."""

    xy: jax.Array
    width: int  # d
    adapter: str  # the adapter whose A made the down-projection

    @property
    def shape(self):
        return (*self.xy.shape[:-1], self.width)

    @property
    def dtype(self):
        return self.xy.dtype

    @property
    def plain(self):
        return self.xy[..., :self.width]


def normed_input(x, norm_weight, ws, *, eps, out_dtype, backend, gate=None, group_size=None):
    """The input of the matrices ws: x's RMSNorm (over groups of `group_size` channels; with a gate z,
    of x ∘ silu(z)) times norm_weight, in out_dtype. When ws are all adapted by one LoRA adapter
    (Mamba2's z_proj and xbcdt_proj under in_proj's, or out_proj alone), a `StackedInput`
    [u | s u A] that the norm writes itself (`kernels.stacked_lora_input`: one Pallas kernel on the
    GPU), so u is not read again for u A and copied into a concatenation; else the plain array."""
    from jaxembed import kernels
    from jaxembed.ops import norm

    group_size = x.shape[-1] if group_size is None else group_size
    adapters = {getattr(w, "adapter", None) for w in ws}  # a LoraWeight's adapter: its A and scale
    if len(adapters) != 1 or None in adapters:
        return norm.normed(x, norm_weight, gate, eps=eps, group_size=group_size, out_dtype=out_dtype)
    xy = kernels.stacked_lora_input(x, norm_weight, ws[0].a, gate, scale=ws[0].scale, eps=eps,
                                    group_size=group_size, out_dtype=out_dtype, backend=backend)
    return StackedInput(xy, x.shape[-1], adapters.pop())


def linear(x, w, compute_dtype=None, bias=None, out_dtype=F32):
    """x [b, t, d_in] @ w [d_in, d_out] (+ bias) -> [b, t, d_out] in out_dtype (float32 by default).

    compute_dtype: the matmul operands' dtype (default: x's). w may be an array or a DerivedWeight.
    x may be a `StackedInput`: the GEMM input of w's LoRA adapter, or x's columns for any other w.
    out_dtype: the product is accumulated in float32 either way; a bfloat16 out_dtype makes the GEMM
    write bfloat16 (half the bytes), as a PyTorch bfloat16 Linear does.
    """
    compute_dtype = x.dtype if compute_dtype is None else compute_dtype
    if isinstance(x, StackedInput) and getattr(w, "adapter", None) != x.adapter:
        x = x.plain
    if isinstance(x, StackedInput):
        product = functools.partial(w.matmul_stacked, x.xy, compute_dtype)
    elif is_derived(w):
        product = functools.partial(w.matmul, x, compute_dtype)
    else:
        product = functools.partial(dot, x, w, compute_dtype)
    if bias is None:  # a derived weight writes out_dtype itself (under autodiff: a cotangent in out_dtype)
        return product(out_dtype)
    return (product(F32) + bias.astype(F32)).astype(out_dtype)


def lm_head(hidden, head):
    """Language-model logits: hidden [..., d] against head [vocab, d] (operands in head's dtype) ->
    [..., vocab] float32."""
    return jnp.einsum("...d,vd->...v", hidden.astype(head.dtype), head, preferred_element_type=F32)


def densify(tree):
    """Every DerivedWeight in `tree` replaced by its dense matrix (for export and checks)."""
    return jax.tree.map(lambda leaf: leaf.dense() if is_derived(leaf) else leaf, tree, is_leaf=is_derived)
