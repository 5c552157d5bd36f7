"""The SSD (state space duality) layer of Mamba2 in three forms with one signature.

    h_t = exp(dt_t * A) h_{t-1} + dt_t * B_t x_tᵀ        (per head; A_t = a_t I with a_t = exp(dt_t A))
    y_t = C_tᵀ h_t + D x_t

`recurrent` is the sequential recurrence (the paper's eq. 3, `eq:mamba2`), `quadratic` the
matrix form M = L ∘ (C Bᵀ) (eq. 6, `eq:ssm-matrix-vectorized`) and `chunked` the chunked
algorithm of Section 3.2.2: intra-chunk matrix work (eqs. 8-9), the inter-chunk state
recurrence as a `lax.scan` over chunks (eq. 10) and the output correction (eqs. 11-12).
In the paper's notation x_t is our dt_t * x_t and a_t = exp(dt_t * A). All three take the raw `dt`
(before bias and softplus), an optional initial state, and return `(y, final_state)`.

Shapes: b batch, t time, c chunks, l/s positions inside a chunk, h heads, p head dim,
g groups (heads are grouped as h = g * r, r = heads per group), n state size.

    x  [b, t, h, p]     dt [b, t, h]     A [h] (negative)     B, C [b, t, g, n]
    D  [h] or [h, p]    dt_bias [h]      state [b, h, p, n] (float32)

`chunked_xbc` is `chunked` on Mamba2's packed conv output xbc [b, t, h*p + 2*g*n] (x, B and C side
by side, as the layer produces them): the Pallas kernel reads the three from that one array.
`conv_chunked` is the Mamba2 mixer between its input projection (xbcdt_proj) and the gated norm:
the causal conv + SiLU of the projection's raw x, B and C columns, then `chunked_xbc`; the Pallas
kernel reads raw x straight out of the projection and convolves it per chunk, so the conv output of
x is never written.

Decays, segment sums, exponentials and states are float32 whatever the activation dtype; the
matmuls take the activation dtype and accumulate in float32.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxembed.ops import common
from jaxembed.ops.common import bmm

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


def _heads_per_group(x, B, C=None):
    h, g = x.shape[2], B.shape[2]
    if C is not None and C.shape != B.shape:
        raise ValueError(f"B and C must have the same shape [b, t, g, n], got {B.shape} and {C.shape}")
    if h % g:
        raise ValueError(f"heads ({h}) must be a multiple of groups ({g})")
    return h // g


def check_decay_rates(A) -> None:
    """A [h] is a decay rate, A <= 0 (Mamba2's -exp(A_log)): the chunked forms clamp a decay's exponent at 0
    and take a chunk's decay as its smallest cumulative one, so A > 0 would give wrong outputs, not an error.
    Checked when A's values are known (a traced A, inside a model under jit, is the model's -exp(A_log))."""
    import numpy as np

    try:
        values = np.asarray(A)
    except jax.errors.TracerArrayConversionError:
        return
    if values.size and not (values <= 0).all():
        bad = values[~(values <= 0)]
        raise ValueError(f"A must be <= 0 (a decay rate, -exp(A_log)), got {bad.size} other value(s), e.g. "
                         f"{float(bad.reshape(-1)[0])!r}")


def _check_state(initial_state, x, B):
    b, _, h, p = x.shape
    return common.initial_state(initial_state, (b, h, p, B.shape[-1]))


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
    total log decay), as in mamba_ssm's kernels. The exponent is clamped at 0 before `exp`, so
    the entries above the diagonal (positive differences) never overflow to inf, and no NaN
    reaches the gradient of the masked entries however large dt is.
    """
    l = a_cum.shape[-1]
    diff = jnp.minimum(a_cum[..., :, None] - a_cum[..., None, :], 0.0)
    return jnp.where(jnp.tril(jnp.ones((l, l), bool)), jnp.exp(diff), 0.0)



def _triangular_sums(a):
    """(inclusive prefix sums, exclusive suffix sums) of a [..., l] along l, as matmuls with
    triangular 0/1 matrices at full float32 precision: exact sums of the same terms as a cumsum,
    and a single materialised result (XLA's cumsum on CPU is a reduce-window that consumers
    otherwise recompute element by element)."""
    l = a.shape[-1]
    k, j = jnp.arange(l)[:, None], jnp.arange(l)[None, :]
    prefix = jnp.einsum("...k,kj->...j", a, (k <= j).astype(a.dtype), precision=lax.Precision.HIGHEST)
    suffix = jnp.einsum("...k,kj->...j", a, (k > j).astype(a.dtype), precision=lax.Precision.HIGHEST)
    return prefix, suffix


def recurrent(x, dt, A, B, C, *, D=None, dt_bias=None, dt_limit=(0.0, math.inf), initial_state=None):
    """Sequential recurrence, a `lax.scan` over time (eq. 3). Returns (y [b,t,h,p], state [b,h,p,n])."""
    r = _heads_per_group(x, B, C)
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
    """Full matrix form y = (L ∘ C Bᵀ) x (eq. 6), O(t²); plus the initial state's contribution."""
    r = _heads_per_group(x, B, C)
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
    to_end = L[..., -1, :]  # decay from s to the end: the last row of L, exact (no cumsum difference)
    final = jnp.exp(a_cum[..., -1])[..., None, None] * state + jnp.einsum("bshn,bhs,bshp->bhpn", Bh, to_end, xdt)
    return (y + _d_skip(x, D)).astype(x.dtype), final


def _pad_time(v, pad):
    return jnp.pad(v, [(0, 0), (0, pad)] + [(0, 0)] * (v.ndim - 2)) if pad else v


def chunk_intra(x, dt, a, B, C):
    """Intra-chunk work for every chunk at once, assuming a zero incoming boundary state.

    Inputs are chunked: x [b,c,l,h,p], dt and a = dt*A [b,c,l,h] (float32), B, C [b,c,l,g,n].
    Returns
      y_intra [b,c,l,h,p]   (L ∘ C Bᵀ)(dt x) on the diagonal block                (eq. 8)
      h_intra [b,c,g,n,r*p] Bᵀ diag(L[Q, :])(dt x): the chunk's own end state       (eq. 9),
                            heads of a group side by side (see `states_to_heads`)
      a_cum   [b,c,l,h]     log decay from the chunk start through position l
    """
    b, c, l, h, p = x.shape
    g = B.shape[3]
    r = h // g
    cdt = x.dtype
    a_cum, a_to_end = _triangular_sums(jnp.moveaxis(a, 2, 3))  # [b,c,h,l]; a_to_end[s] = Σ_{k>s} a_k
    Bg, Cg = jnp.moveaxis(B, 3, 2), jnp.moveaxis(C, 3, 2)  # [b,c,g,l,n]
    CB = bmm(Cg, jnp.swapaxes(Bg, -1, -2))  # [b,c,g,l,s], per group: shared by its r heads
    M = (decay_matrix(a_cum).reshape(b, c, g, r, l, l) * CB[:, :, :, None]).astype(cdt)
    xdt = x.astype(F32) * dt[..., None]  # [b,c,l,h,p]
    xdt_heads = jnp.moveaxis(xdt.astype(cdt).reshape(b, c, l, g, r, p), 2, 4)  # [b,c,g,r,s,p]
    y_intra = jnp.moveaxis(bmm(M, xdt_heads), 4, 2).reshape(b, c, l, h, p)
    # the chunk state: all heads of a group in one matmul, Bᵀ [n, s] @ (dt x decay-to-end) [s, r*p]
    w = (xdt * jnp.exp(jnp.moveaxis(a_to_end, 3, 2))[..., None]).astype(cdt).reshape(b, c, l, g, r * p)
    h_intra = bmm(jnp.moveaxis(B, (2, 3), (4, 2)), jnp.moveaxis(w, 3, 2))  # [b,c,g,n,r*p]
    return y_intra, h_intra, jnp.moveaxis(a_cum, 3, 2)


def heads_to_states(state, groups: int):
    """[..., h, p, n] -> [..., g, n, r*p], the grouped layout the chunk recurrence works in."""
    *lead, h, p, n = state.shape
    st = state.reshape(*lead, groups, h // groups, p, n)
    return jnp.moveaxis(st, -1, -3).reshape(*lead, groups, n, -1)


def states_to_heads(state, heads: int):
    """[..., g, n, r*p] -> [..., h, p, n], the public state layout (as in transformers)."""
    *lead, g, n, rp = state.shape
    st = state.reshape(*lead, g, n, heads // g, rp * g // heads)
    return jnp.moveaxis(st, -3, -1).reshape(*lead, heads, rp * g // heads, n)


def chunk_states(h_intra, chunk_decay, initial_state):
    """Inter-chunk recurrence h(c) = exp(Σ_chunk a) h(c-1) + h_intra(c) (eq. 10), a `lax.scan` over chunks.

    h_intra [b,c,g,n,r*p], chunk_decay [b,c,h] (log), initial_state [b,g,n,r*p] (float32).
    Returns (states entering each chunk [b,c,g,n,r*p], final state [b,g,n,r*p]).
    """
    b, c, g, n, rp = h_intra.shape
    h = chunk_decay.shape[-1]
    decay = jnp.repeat(jnp.exp(chunk_decay).reshape(b, c, g, 1, h // g), rp * g // h, axis=-1)  # [b,c,g,1,r*p]

    def step(state, inputs):
        h_c, decay_c = inputs
        return decay_c * state + h_c, state

    final, entering = lax.scan(step, initial_state, (jnp.moveaxis(h_intra, 1, 0), jnp.moveaxis(decay, 1, 0)))
    return jnp.moveaxis(entering, 0, 1), final


def chunk_output(C, entering, a_cum):
    """Output correction y_inter = diag(exp(a_cum)) C h(c-1) (eq. 11), all heads of a group in one matmul.

    C [b,c,l,g,n], entering [b,c,g,n,r*p], a_cum [b,c,l,h]  ->  [b,c,l,h,p] float32
    """
    b, c, l, g, n = C.shape
    h = a_cum.shape[-1]
    y = bmm(jnp.moveaxis(C, 3, 2), entering.astype(C.dtype))  # [b,c,g,l,r*p]
    y = jnp.moveaxis(y, 2, 3).reshape(b, c, l, h, -1)
    return y * jnp.exp(a_cum)[..., None]


def chunked(x, dt, A, B, C, *, chunk_size, D=None, dt_bias=None, dt_limit=(0.0, math.inf), initial_state=None):
    """Chunked SSD (Section 3.2.2): intra-chunk matrices, inter-chunk `lax.scan`, output correction.

    Any t works: the tail is padded to a multiple of chunk_size with dt = 0 (no decay, no input),
    which leaves the final state exactly as after the last real token.
    """
    _heads_per_group(x, B, C)
    check_decay_rates(A)
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
    entering, final = chunk_states(h_intra, a_cum[:, :, -1], heads_to_states(state, g))
    y = y_intra + chunk_output(Cc, entering, a_cum)
    y = y.reshape(b, c * chunk_size, h, p)[:, :t] + _d_skip(x, D)
    return y.astype(x.dtype), states_to_heads(final, h)


def split_xbc(xbc, *, heads: int, head_dim: int, groups: int, state_size: int):
    """xbc [b, t, h*p + 2*g*n] -> (x [b, t, h, p], B [b, t, g, n], C [b, t, g, n])."""
    b, t, width = xbc.shape
    e, gn = heads * head_dim, groups * state_size
    if width != e + 2 * gn:
        raise ValueError(f"xbc has {width} channels; heads x head_dim + 2 x groups x state_size = {e + 2 * gn}")
    x, B, C = jnp.split(xbc, [e, e + gn], axis=-1)
    return (x.reshape(b, t, heads, head_dim), B.reshape(b, t, groups, state_size),
            C.reshape(b, t, groups, state_size))


def chunked_xbc(xbc, dt, A, *, heads: int, head_dim: int, groups: int, state_size: int, chunk_size, D=None,
                dt_bias=None, dt_limit=(0.0, math.inf), initial_state=None):
    """`chunked` with x, B and C packed in one array xbc [b, t, h*p + 2*g*n]. Returns (y [b,t,h,p], state)."""
    x, B, C = split_xbc(xbc, heads=heads, head_dim=head_dim, groups=groups, state_size=state_size)
    return chunked(x, dt, A, B, C, chunk_size=chunk_size, D=D, dt_bias=dt_bias, dt_limit=dt_limit,
                   initial_state=initial_state)


def silu(x):
    """x * sigmoid(x) as one division: XLA materialises it once instead of recomputing its
    input (the conv) inside every consumer fusion, which costs ~20% on CPU."""
    return x / (1.0 + jnp.exp(-x))


def conv_state_after(xbc, conv_state):
    """The last k-1 conv inputs after xbc [b, t, c] (float32), continuing conv_state [b, k-1, c]."""
    km1, t = conv_state.shape[1], xbc.shape[1]
    x = xbc.astype(F32)
    return x[:, t - km1:] if t >= km1 else jnp.concatenate([conv_state[:, t:], x], axis=1)


def causal_conv(xbc, conv_state, weight, bias, out_dtype=F32):
    """Depthwise causal conv continuing from the previous k-1 inputs, then SiLU.

    xbc [b, t, c], conv_state [b, k-1, c] float32, weight [k, c], bias [c] or None.
    Returns (out [b, t, c] in out_dtype, computed in float32; new conv state float32).
    The backward is written out (`_conv_silu_bwd`).
    """
    bias = jnp.zeros(weight.shape[1:], F32) if bias is None else bias
    out = _conv_silu(xbc, conv_state, weight, bias, jnp.dtype(out_dtype))
    return out, conv_state_after(xbc, conv_state)


def _conv_silu_forward(xbc, conv_state, weight, bias, out_dtype):
    k, t = weight.shape[0], xbc.shape[1]
    x = xbc.astype(F32)

    def window(i):
        """Tap i's inputs, (k-1-i) tokens back: [conv_state ‖ x][:, i : i+t], built per tap. One
        concatenation read at k shifted offsets is written out by XLA:GPU (0.25 GB a Codestral
        layer per 4096-token vertical chunk, in float32); a concatenation per tap fuses into the conv."""
        from_state, from_x = conv_state[:, i : i + t], x[:, : max(0, i + t - (k - 1))]
        return from_x if from_state.shape[1] == 0 else jnp.concatenate([from_state, from_x], axis=1)

    out = sum(window(i) * weight[i].astype(F32) for i in range(k)) + bias.astype(F32)
    return silu(out).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _conv_silu(xbc, conv_state, weight, bias, out_dtype):
    return _conv_silu_forward(xbc, conv_state, weight, bias, out_dtype)


def _conv_silu_fwd(xbc, conv_state, weight, bias, out_dtype):
    return _conv_silu_forward(xbc, conv_state, weight, bias, out_dtype), (xbc, conv_state, weight, bias)


def _conv_silu_bwd(out_dtype, residuals, d_out):
    """With u = [conv_state ‖ x], pre_s = Σ_j w_j u_{s+j} + bias and d_pre = d_out ∘ silu'(pre):
    d u_r = Σ_i w_i d_pre_{r-i}. x's rows take d_pre at k shifts, each recomputed from u where it
    is read: autodiff (and a d_pre computed once) made XLA write d_pre out in float32 and read it
    back at every shift (4 + 4 bytes a channel, against 2 for reading u again)."""
    xbc, conv_state, weight, bias = residuals
    k, t = weight.shape[0], xbc.shape[1]
    w, bias_f = weight.astype(F32), bias.astype(F32)
    u = jnp.concatenate([conv_state.astype(F32), xbc.astype(F32)], axis=1)  # [b, k-1+t, c]
    u = jnp.pad(u, ((0, 0), (0, k - 1), (0, 0)))  # positions past t read zeros (their d_out is 0)
    g = jnp.pad(d_out.astype(F32), ((0, 0), (0, k - 1), (0, 0)))

    def d_pre(shift):  # d_pre at positions shift .. shift + t - 1
        pre = sum(u[:, shift + j : shift + j + t] * w[j] for j in range(k)) + bias_f
        sig = jax.nn.sigmoid(pre)
        return g[:, shift : shift + t] * sig * (1.0 + pre * (1.0 - sig))

    # x's row τ is u's row k-1+τ: Σ_i w_i d_pre_{k-1+τ-i}, i.e. shift k-1-i
    dx = sum(w[k - 1 - shift] * d_pre(shift) for shift in range(k))
    here = d_pre(0)  # d_pre at its own positions (the state, weight and bias cotangents; dropped if unused)
    head = jnp.pad(here, ((0, 0), (0, max(0, k - 1 - t)), (0, 0)))[:, : k - 1]
    d_state = jnp.stack([sum(w[i] * head[:, r - i] for i in range(r + 1)) for r in range(k - 1)], axis=1) \
        if k > 1 else jnp.zeros_like(conv_state, F32)
    dw = jnp.stack([jnp.sum(u[:, i : i + t] * here, axis=(0, 1)) for i in range(k)])
    return (dx.astype(xbc.dtype), d_state.astype(conv_state.dtype), dw.astype(weight.dtype),
            jnp.sum(here, axis=(0, 1)).astype(bias.dtype))


_conv_silu.defvjp(_conv_silu_fwd, _conv_silu_bwd)


def split_projection(proj, *, offset: int, heads: int, head_dim: int, groups: int, state_size: int):
    """The input projection's output [b, t, offset + conv_dim + h] -> (raw xbc [b, t, conv_dim],
    dt [b, t, h]); the `offset` columns before them (mamba_ssm's fused in_proj has z there) are not read."""
    conv_dim = heads * head_dim + 2 * groups * state_size
    if proj.ndim != 3 or proj.shape[2] != offset + conv_dim + heads:
        raise ValueError(f"expected the projection's output [b, t, {offset} + {conv_dim} + {heads}] (xBC, dt); "
                         f"got {proj.shape}")
    return proj[..., offset : offset + conv_dim], proj[..., offset + conv_dim :]


def conv_chunked(proj, A, conv_state, conv_weight, conv_bias, *, offset: int, heads: int, head_dim: int,
                 groups: int, state_size: int, chunk_size, D=None, dt_bias=None, dt_limit=(0.0, math.inf),
                 initial_state=None, final_state: bool = True):
    """The Mamba2 mixer from the input projection's output proj [b, t, offset + conv_dim + h] (raw x, B and C
    at column `offset`, then dt) to the SSD output: conv + SiLU of x, B and C (`causal_conv`, its
    output in proj's dtype), then `chunked_xbc`.
    Returns (y [b, t, h, p] in proj's dtype, new conv state float32, final SSD state float32, or
    None with final_state=False)."""
    xbc, dt = split_projection(proj, offset=offset, heads=heads, head_dim=head_dim, groups=groups,
                               state_size=state_size)
    xbc, conv_state = causal_conv(xbc, conv_state, conv_weight, conv_bias, out_dtype=proj.dtype)
    y, state = chunked_xbc(xbc, dt, A, heads=heads, head_dim=head_dim, groups=groups, state_size=state_size,
                           chunk_size=chunk_size, D=D, dt_bias=dt_bias, dt_limit=dt_limit,
                           initial_state=initial_state)
    return y, conv_state, state if final_state else None
