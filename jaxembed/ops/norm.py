"""RMSNorms, and LoRA's stacked GEMM input [u | s u A] built from one (the reference of
`kernels.norm`).

A LoRA layer's product u W + s (u A) B runs as one GEMM over [u | s u A] and [W ; B]
(`weights.dot_stacked`). `stacked_lora_input` builds that input from the norm that produces u:
here with XLA (u, then u A, then the concatenation), in `kernels.norm` as one Pallas kernel that
writes both halves.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxembed.ops.ssd import silu

F32 = jnp.float32


def rms_norm(x, weight, eps, group_size=None):
    """RMSNorm in float32 over the last axis, or over groups of `group_size` channels of it."""
    xf = x.astype(F32)
    if group_size is not None:
        xf = xf.reshape(*xf.shape[:-1], -1, group_size)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return xf.reshape(x.shape) * weight.astype(F32)


def gated_norm_terms(y, z, dn, weight, group_size):
    """(z, silu(z), sigmoid(z), the gated input grouped [..., groups, group_size], dn ∘ weight
    grouped), all float32."""
    zf = z.astype(F32)
    gate = silu(zf)
    grouped = (y.astype(F32) * gate).reshape(*y.shape[:-1], -1, group_size)
    dn_w = None if dn is None else (dn.astype(F32) * weight.astype(F32)).reshape(grouped.shape)
    return zf, gate, jax.nn.sigmoid(zf), grouped, dn_w


def gated_rms_norm(y, z, weight, *, eps, group_size, out_dtype):
    """rms_norm(y ∘ silu(z)) ∘ weight over groups of `group_size` channels, in float32, written in
    out_dtype (mamba_ssm's RMSNormGated with norm_before_gate=False)."""
    *_, g, _ = gated_norm_terms(y, z, None, weight, group_size)
    r = jax.lax.rsqrt(jnp.mean(g * g, axis=-1, keepdims=True) + eps)
    return ((g * r).reshape(y.shape) * weight.astype(F32)).astype(out_dtype)


def gated_norm_backward(y, z, dn, weight, *, eps, group_size, norm_dtype):
    """The gated norm n = rms_norm(y ∘ silu(z)) ∘ weight differentiated, given n's cotangent dn:
    (dy in y's dtype, dz in z's dtype, n in norm_dtype, 1/rms float32 [..., groups]). With
    g = y ∘ silu(z) per group, r = (mean g² + eps)^-1/2 and s = mean(dn ∘ weight ∘ g),
    dg = r (dn ∘ weight - g r² s). n (for the next GEMM's weight gradient) and r (for the weight's
    own gradient, sum over tokens of dn ∘ g r) come from the same pass.

    The two reductions read their own copies of y, z and dn (a barrier), so the elementwise pass
    recomputes its float32 terms rather than sharing theirs, which XLA would write out."""
    *_, g, dn_w = gated_norm_terms(*jax.lax.optimization_barrier((y, z, dn)), weight, group_size)
    r = jax.lax.rsqrt(jnp.mean(g * g, axis=-1, keepdims=True) + eps)
    s = jnp.mean(dn_w * g, axis=-1, keepdims=True)
    zf, gate, sig, g, dn_w = gated_norm_terms(y, z, dn, weight, group_size)
    dg = (r * (dn_w - g * (r * r) * s)).reshape(y.shape)
    dy = (dg * gate).astype(y.dtype)
    dz = (dg * y.astype(F32) * sig * (1.0 + zf * (1.0 - sig))).astype(z.dtype)
    n = ((g * r).reshape(y.shape) * weight.astype(F32)).astype(norm_dtype)
    return dy, dz, n, r[..., 0]


def normed(x, weight, gate, *, eps, group_size, out_dtype):
    """u: rms_norm(x) ∘ weight over groups of `group_size` channels, or with a gate z the gated
    norm of x ∘ silu(z), written in out_dtype."""
    if gate is None:
        return rms_norm(x, weight, eps, group_size).astype(out_dtype)
    return gated_rms_norm(x, gate, weight, eps=eps, group_size=group_size, out_dtype=out_dtype)


def stacked_lora_input(x, weight, a, gate=None, *, scale, eps, group_size, out_dtype):
    """[u | s u A] [b, t, d + r] in out_dtype, u = `normed(x, weight, gate)` [b, t, d] and A [d, r]:
    u A with both operands in out_dtype, accumulated in float32, scaled, then rounded (as
    `LoraWeight.matmul` computes it)."""
    u = normed(x, weight, gate, eps=eps, group_size=group_size, out_dtype=out_dtype)
    down = scale * _down_projection(u, a.astype(out_dtype))
    return jnp.concatenate([u, down.astype(out_dtype)], axis=-1)


@jax.custom_vjp
def _down_projection(u, a):
    """u A, accumulated and written in float32."""
    return jnp.einsum("btd,dr->btr", u, a, preferred_element_type=F32)


def _down_projection_fwd(u, a):
    return _down_projection(u, a), (u, a)


def _down_projection_bwd(residuals, g):
    u, a = residuals
    g = g.astype(u.dtype)
    # u's cotangent share in u's dtype, behind a barrier: XLA would add it to the GEMM input's
    # cotangent as the GEMM's epilogue (cuBLAS beta = 1), which needs that cotangent's u columns
    # copied out of [du | d(s u A)] first; apart, the add joins the norm's backward pass
    du = jax.lax.optimization_barrier(jnp.einsum("btr,dr->btd", g, a, preferred_element_type=u.dtype))
    return du, jnp.einsum("btd,btr->dr", u, g, preferred_element_type=a.dtype)


_down_projection.defvjp(_down_projection_fwd, _down_projection_bwd)
