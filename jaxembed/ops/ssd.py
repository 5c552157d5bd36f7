"""The SSD (state space duality) layer of Mamba2 in three forms with one signature.

    h_t = exp(dt_t * A) h_{t-1} + dt_t * B_t x_tᵀ        (per head; A_t = a_t I with a_t = exp(dt_t A))
    y_t = C_tᵀ h_t + D x_t

`recurrent` is the sequential recurrence (paper eq. 1), `quadratic` the matrix form
M = L ∘ (C Bᵀ) (eq. 4) and `chunked` the chunked algorithm of Section 3.2.2: intra-chunk
matrix work (eqs. 6-7), the inter-chunk state recurrence as a `lax.scan` over chunks (eq. 8)
and the output correction (eq. 9). All three take the raw `dt` (before bias and softplus),
an optional initial state, and return `(y, final_state)`.

Shapes: b batch, t time, c chunks, l/s positions inside a chunk, h heads, p head dim,
g groups (heads are grouped as h = g * r, r = heads per group), n state size.

    x  [b, t, h, p]     dt [b, t, h]     A [h] (negative)     B, C [b, t, g, n]
    D  [h] or [h, p]    dt_bias [h]      state [b, h, p, n] (float32)

Decays, segment sums, exponentials and states are float32 whatever the activation dtype; the
matmuls take the activation dtype and accumulate in float32.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32


def discretize_dt(dt, dt_bias=None, dt_limit=(0.0, math.inf)):
    """softplus(dt + dt_bias), clipped to dt_limit, in float32.  [b, t, h] -> [b, t, h]"""
    dt = dt.astype(F32)
    if dt_bias is not None:
        dt = dt + dt_bias.astype(F32)
    dt = jax.nn.softplus(dt)
    lo, hi = dt_limit
    if lo > 0.0 or hi < math.inf:
        dt = jnp.clip(dt, lo, hi)
    return dt


def _d_skip(x, D):
    """D x with D per head [h] or per channel [h, p]."""
    if D is None:
        return 0.0
    D = D.astype(F32)
    return x.astype(F32) * (D[:, None] if D.ndim == 1 else D)


def _heads_per_group(x, B):
    h, g = x.shape[2], B.shape[2]
    if h % g:
        raise ValueError(f"heads ({h}) must be a multiple of groups ({g})")
    return h // g


def _check_state(initial_state, x, B):
    b, _, h, p = x.shape
    n = B.shape[-1]
    if initial_state is None:
        return jnp.zeros((b, h, p, n), F32)
    if initial_state.shape != (b, h, p, n):
        raise ValueError(f"initial_state has shape {initial_state.shape}, expected {(b, h, p, n)}")
    return initial_state.astype(F32)


def segsum(a):
    """Lower-triangular segment sums: out[..., i, j] = a[j+1] + ... + a[i] for i >= j, -inf above.

    Computed as a masked cumulative sum rather than cumsum[i] - cumsum[j], so no cancellation
    error grows with the sequence length (the quadratic form runs over the whole sequence).
    [..., l] -> [..., l, l]
    """
    l = a.shape[-1]
    strictly_lower = jnp.tril(jnp.ones((l, l), bool), k=-1)
    a_ij = jnp.where(strictly_lower, a[..., :, None], 0.0)  # row k holds a[k] for columns j < k
    seg = jnp.cumsum(a_ij, axis=-2)
    return jnp.where(jnp.tril(jnp.ones((l, l), bool)), seg, -jnp.inf)


def decay_matrix(a_cum):
    """L[..., i, j] = exp(a_cum[i] - a_cum[j]) for i >= j, else exactly 0.  [..., l] -> [..., l, l]

    Inside one chunk a difference of cumulative sums is accurate to eps * |a_cum| (the chunk's
    total log decay), the same as mamba_ssm's kernels; masking before `exp` means no inf or NaN
    however large dt is (the unmasked differences above the diagonal are positive).
    """
    l = a_cum.shape[-1]
    diff = a_cum[..., :, None] - a_cum[..., None, :]
    return jnp.exp(jnp.where(jnp.tril(jnp.ones((l, l), bool)), diff, -jnp.inf))


def recurrent(x, dt, A, B, C, *, D=None, dt_bias=None, dt_limit=(0.0, math.inf), initial_state=None):
    """Sequential recurrence, a `lax.scan` over time (eq. 1). Returns (y [b,t,h,p], state [b,h,p,n])."""
    r = _heads_per_group(x, B)
    state = _check_state(initial_state, x, B)
    dt = discretize_dt(dt, dt_bias, dt_limit)
    decay = jnp.exp(dt * A.astype(F32))  # [b, t, h]
    Bh = jnp.repeat(B.astype(F32), r, axis=2)  # [b, t, h, n]
    Ch = jnp.repeat(C.astype(F32), r, axis=2)

    def step(h, inputs):
        x_t, dt_t, decay_t, B_t, C_t = inputs  # [b,h,p] [b,h] [b,h] [b,h,n] [b,h,n]
        h = decay_t[..., None, None] * h + jnp.einsum("bhp,bhn->bhpn", x_t * dt_t[..., None], B_t)
        return h, jnp.einsum("bhpn,bhn->bhp", h, C_t)

    time_major = [jnp.moveaxis(v, 1, 0) for v in (x.astype(F32), dt, decay, Bh, Ch)]
    state, y = lax.scan(step, state, time_major)
    y = jnp.moveaxis(y, 0, 1) + _d_skip(x, D)
    return y.astype(x.dtype), state


def quadratic(x, dt, A, B, C, *, D=None, dt_bias=None, dt_limit=(0.0, math.inf), initial_state=None):
    """Full matrix form y = (L ∘ C Bᵀ) x (eq. 4), O(t²); plus the initial state's contribution."""
    r = _heads_per_group(x, B)
    state = _check_state(initial_state, x, B)
    dt = discretize_dt(dt, dt_bias, dt_limit)
    a = jnp.moveaxis(dt * A.astype(F32), 1, 2)  # [b, h, t]
    L = jnp.exp(segsum(a))  # [b, h, t, t]
    Bh = jnp.repeat(B.astype(F32), r, axis=2)
    Ch = jnp.repeat(C.astype(F32), r, axis=2)
    xdt = x.astype(F32) * dt[..., None]
    M = L * jnp.einsum("blhn,bshn->bhls", Ch, Bh)
    y = jnp.einsum("bhls,bshp->blhp", M, xdt)
    a_cum = jnp.cumsum(a, axis=-1)  # [b, h, t]: log decay from the start up to and including t
    y = y + jnp.einsum("blhn,bhpn,bhl->blhp", Ch, state, jnp.exp(a_cum))
    to_end = jnp.exp(a_cum[..., -1:] - a_cum)  # [b, h, t]
    final = jnp.exp(a_cum[..., -1])[..., None, None] * state + jnp.einsum("bshn,bhs,bshp->bhpn", Bh, to_end, xdt)
    return (y + _d_skip(x, D)).astype(x.dtype), final


def _pad_time(v, pad):
    return jnp.pad(v, [(0, 0), (0, pad)] + [(0, 0)] * (v.ndim - 2)) if pad else v


def chunk_intra(x, dt, a, B, C):
    """Intra-chunk work for every chunk at once, assuming a zero incoming boundary state.

    Inputs are chunked: x [b,c,l,h,p], dt and a = dt*A [b,c,l,h] (float32), B, C [b,c,l,g,n].
    Returns
      y_intra [b,c,l,h,p]  (L ∘ C Bᵀ)(dt x) on the diagonal block               (eq. 6)
      h_intra [b,c,h,p,n]  Bᵀ diag(L[Q, :])(dt x): the chunk's own end state      (eq. 7)
      a_cum   [b,c,l,h]    log decay from the chunk start through position l
    """
    b, c, l, h, p = x.shape
    g = B.shape[3]
    r = h // g
    cdt = x.dtype
    a_hl = jnp.moveaxis(a, 2, 3)  # [b, c, h, l]
    a_cum = jnp.cumsum(a_hl, axis=-1)
    # log decay from s to the chunk end, Σ_{k>s} a_k, summed directly (no cumsum difference)
    a_next = jnp.pad(a_hl[..., 1:], [(0, 0)] * 3 + [(0, 1)])
    to_end = jnp.exp(jnp.flip(jnp.cumsum(jnp.flip(a_next, -1), axis=-1), -1))  # [b, c, h, s]
    L = decay_matrix(a_cum).reshape(b, c, g, r, l, l)  # [b, c, g, r, l, s]
    xdt = x.astype(F32) * dt[..., None]  # [b, c, s, h, p]
    CB = jnp.einsum("bclgn,bcsgn->bcgls", C, B, preferred_element_type=F32)  # per group, shared by its heads
    M = (L * CB[:, :, :, None]).astype(cdt)
    y_intra = jnp.einsum(
        "bcgrls,bcsgrp->bclgrp", M, xdt.astype(cdt).reshape(b, c, l, g, r, p), preferred_element_type=F32
    ).reshape(b, c, l, h, p)
    xdt_to_end = (xdt * jnp.moveaxis(to_end, 3, 2)[..., None]).astype(cdt).reshape(b, c, l, g, r, p)
    h_intra = jnp.einsum("bcsgn,bcsgrp->bcgrpn", B, xdt_to_end, preferred_element_type=F32).reshape(b, c, h, p, -1)
    return y_intra, h_intra, jnp.moveaxis(a_cum, 3, 2)


def chunk_states(h_intra, chunk_decay, initial_state):
    """Inter-chunk recurrence h(c) = exp(Σ_chunk a) h(c-1) + h_intra(c) (eq. 8), a `lax.scan` over chunks.

    h_intra [b,c,h,p,n], chunk_decay [b,c,h] (log), initial_state [b,h,p,n].
    Returns (states entering each chunk [b,c,h,p,n], final state [b,h,p,n]).
    """

    def step(state, inputs):
        h_c, decay_c = inputs
        return jnp.exp(decay_c)[..., None, None] * state + h_c, state

    final, entering = lax.scan(step, initial_state, (jnp.moveaxis(h_intra, 1, 0), jnp.moveaxis(chunk_decay, 1, 0)))
    return jnp.moveaxis(entering, 0, 1), final


def chunk_output(C, entering, a_cum):
    """Output correction y_inter = diag(exp(a_cum)) C h(c-1) (eq. 9).  -> [b,c,l,h,p] float32"""
    b, c, l, g, n = C.shape
    h, p = entering.shape[2], entering.shape[3]
    r = h // g
    st = entering.reshape(b, c, g, r, p, n).astype(C.dtype)
    y = jnp.einsum("bclgn,bcgrpn->bclgrp", C, st, preferred_element_type=F32).reshape(b, c, l, h, p)
    return y * jnp.exp(a_cum)[..., None]


def chunked(x, dt, A, B, C, *, chunk_size, D=None, dt_bias=None, dt_limit=(0.0, math.inf), initial_state=None):
    """Chunked SSD (Section 3.2.2): intra-chunk matrices, inter-chunk `lax.scan`, output correction.

    Any t works: the tail is padded to a multiple of chunk_size with dt = 0 (no decay, no input),
    which leaves the final state exactly as after the last real token.
    """
    _heads_per_group(x, B)
    b, t, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    state = _check_state(initial_state, x, B)
    dt = discretize_dt(dt, dt_bias, dt_limit)
    chunk_size = min(chunk_size, t)  # a short input is one chunk of its own length: same result, no padding
    pad = -t % chunk_size
    xp, dtp, Bp, Cp = (_pad_time(v, pad) for v in (x, dt, B, C))
    c = (t + pad) // chunk_size
    xc = xp.reshape(b, c, chunk_size, h, p)
    dtc = dtp.reshape(b, c, chunk_size, h)
    ac = dtc * A.astype(F32)
    Bc = Bp.reshape(b, c, chunk_size, g, n)
    Cc = Cp.reshape(b, c, chunk_size, g, n)
    y_intra, h_intra, a_cum = chunk_intra(xc, dtc, ac, Bc, Cc)
    entering, final = chunk_states(h_intra, a_cum[:, :, -1], state)
    y = y_intra + chunk_output(Cc, entering, a_cum)
    y = y.reshape(b, c * chunk_size, h, p)[:, :t] + _d_skip(x, D)
    return y.astype(x.dtype), final
