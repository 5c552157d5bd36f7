"""RWKV7's WKV operator (the generalized delta rule) in two forms with one signature.

Per head, with a matrix state S [p, n] (value dim p, key dim n):

    S_t = S_{t-1} (diag(w_t) + a_t b_tᵀ) + v_t k_tᵀ
        = S_{t-1} diag(w_t) + (S_{t-1} a_t) b_tᵀ + v_t k_tᵀ
    y_t = S_t r_t

as in BlinkDL's `RWKV_x070_TMix_seq` (rwkv pip package, non-CUDA path), where the model sets
a = -kk, b = kk * a_gate and log w = -exp(-1/2) * sigmoid(w_logit). `recurrent` is the sequential
recurrence (a `lax.scan` over time); `chunked` does the intra-chunk work as matrix products and a
triangular solve (the WY/UT form of a product of diagonal-plus-rank-one transitions) and carries
the state between chunks with a `lax.scan`. Both take an optional initial state and return
`(y, final_state)`.

Shapes: b batch, t time, c chunks, l/s positions inside a chunk, h heads, n key dim, p value dim.

    r, w_logit, k, a, b [b, t, h, n]      v [b, t, h, p]      state [b, h, p, n] (float32)

The operator takes the decay's logits and applies RWKV7's map itself (`log_decay`): every input
then decays within [LOG_W_MIN, 0], the range the chunked form's exponent bound needs, and the
kernel computes log w as it loads a tile instead of reading a float32 log w written in a pass of
its own over [t, d].

Everything is computed in float32 whatever the input dtype, and y is returned in v's dtype (as
BlinkDL's kernel writes it: half the bytes of the output, which RWKV7 group-normalises next, in a
bfloat16 model); decays are carried in log space.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from jaxembed.ops import common
from jaxembed.ops.common import bmm

F32 = jnp.float32

# RWKV7's decay is w = exp(-exp(-1/2) * sigmoid(.)), so log w lies in [-exp(-1/2), 0] at every step.
LOG_W_MIN = -math.exp(-0.5)
# `chunked` factors exp(g_t - g_s) = exp(g_t) * exp(-g_s) with g the cumulative log decay from the
# chunk start. With |log w| <= exp(-1/2), |g| <= 64 * 0.6065 = 38.8 inside a chunk of 64, so
# exp(-g) <= 7e16 and exp(g) >= 1.4e-17: far inside float32's range (exp(+-88)), no overflow, no
# underflow, and every factor keeps full relative precision. Larger chunks would erode that margin.
MAX_CHUNK = 64


def log_decay(w_logit):
    """RWKV7's log decay, log w = LOG_W_MIN * sigmoid(w_logit) in [LOG_W_MIN, 0], float32 (an
    infinite logit gives the ends: +inf the strongest decay, -inf none)."""
    return LOG_W_MIN / (1.0 + jnp.exp(-w_logit.astype(F32)))


def _check(r, w_logit, k, v, a, b, initial_state):
    shape = r.shape
    if len(shape) != 4:
        raise ValueError(f"r must be [batch, time, heads, key_dim], got shape {shape}")
    for name, x in (("w_logit", w_logit), ("k", k), ("a", a), ("b", b)):
        if x.shape != shape:
            raise ValueError(f"{name} has shape {x.shape}, expected {shape} like r")
    if v.shape[:3] != shape[:3] or v.ndim != 4:
        raise ValueError(f"v must be [batch, time, heads, value_dim] matching r's {shape[:3]}, got {v.shape}")
    bsz, _, h, n = shape
    return common.initial_state(initial_state, (bsz, h, v.shape[-1], n))


def recurrent(r, w_logit, k, v, a, b, *, initial_state=None):
    """The recurrence, one token at a time (`lax.scan` over t). Returns (y [b,t,h,p] in v's dtype, state
    [b,h,p,n])."""
    state = _check(r, w_logit, k, v, a, b, initial_state)

    def step(S, inputs):
        r_t, lw_t, k_t, v_t, a_t, b_t = inputs  # [b,h,n] x5, v_t [b,h,p]
        Sa = jnp.einsum("bhpn,bhn->bhp", S, a_t)  # from the old state, like the reference
        S = S * jnp.exp(lw_t)[:, :, None, :] + Sa[..., None] * b_t[:, :, None, :] + v_t[..., None] * k_t[:, :, None, :]
        return S, jnp.einsum("bhpn,bhn->bhp", S, r_t)

    time_major = [jnp.moveaxis(x.astype(F32), 1, 0) for x in (r, log_decay(w_logit), k, v, a, b)]
    state, y = lax.scan(step, state, time_major)
    return jnp.moveaxis(y, 0, 1).astype(v.dtype), state





def _chunk_sums(x):
    """Inclusive prefix, exclusive prefix and exclusive suffix sums of x [..., l, n] along l.

    As products with 0/1 triangular matrices at full float32 precision: exact sums of the same
    terms as a cumsum (which XLA runs as a slow reduce-window on CPU), and the suffix sums come
    without the cancellation of a difference of prefix sums.
    """
    t, s = jnp.arange(x.shape[-2])[:, None], jnp.arange(x.shape[-2])[None, :]
    masks = jnp.stack([s <= t, s < t, s > t]).astype(x.dtype)  # [3, l(t), l(s)]
    sums = jnp.einsum("kts,...sn->k...tn", masks, x, precision=lax.Precision.HIGHEST)
    return sums[0], sums[1], sums[2]


def chunk_intra(r, log_w, k, v, a, b):
    """Everything inside each chunk that does not depend on the state entering it.

    Inputs chunked and head-major, float32: r, log_w, k, a, b [b,c,h,l,n], v [b,c,h,l,p].
    With g_t = Σ_{s<=t} log w_s from the chunk start, Γ_t = diag(exp(g_t)), and S_0 the state
    entering the chunk, unrolling the recurrence gives

        S_t = (S_0 + Σ_{s<=t} u_s b̂_sᵀ + v_s k̂_sᵀ) Γ_t,   b̂_s = exp(-g_s) b_s,  k̂_s = exp(-g_s) k_s,
        u_t = S_{t-1} a_t,

    so the rows of U = [u_t] solve the unit lower-triangular system (WY/UT form)

        (I - tril(Ã B̂ᵀ, -1)) U = Ã S_0ᵀ + tril(Ã K̂ᵀ, -1) V,      Ã = [exp(g_{t-1}) a_t].

    Solving for both right-hand sides at once gives U = U0 + W S_0ᵀ. Then

        y   = y0 + Qm S_0ᵀ,             y0 = Mrb U0 + Mrk V,    Qm = R̃ + Mrb W
        S_l = S_0 T + H,                T = Γ_l + Wᵀ B̄,         H = U0ᵀ B̄ + Vᵀ K̄

    with R̃ = [exp(g_t) r_t], Mrb = tril(R̃ B̂ᵀ), Mrk = tril(R̃ K̂ᵀ) and B̄, K̄ = b, k decayed to
    the chunk end (exp(g_l - g_s) <= 1). Returns (y0 [b,c,h,l,p], Qm [b,c,h,l,n], T [b,c,h,n,n],
    H [b,c,h,p,n]).

    Only the lower triangles of the matrices are kept (`jnp.where`, not a multiplication), so the
    large but finite entries above the diagonal, where exp(g_t - g_s) > 1, never reach a result.
    """
    l, n = r.shape[-2], r.shape[-1]
    # [b,c,h,l,n]: g = Σ_{s<=t} log w_s (through t), g_prev (through t-1), and Σ_{s>t} log w_s (t to the chunk end)
    g, g_prev, g_to_end = _chunk_sums(log_w)
    g_end = g[..., -1:, :]  # [b,c,h,1,n]
    a_dec = a * jnp.exp(g_prev)  # Ã
    r_dec = r * jnp.exp(g)  # R̃
    inv = jnp.exp(-g)  # <= exp(38.8) for chunks of <= 64 (see MAX_CHUNK)
    b_inv, k_inv = b * inv, k * inv  # B̂, K̂
    to_end = jnp.exp(g_to_end)  # <= 1
    b_end, k_end = b * to_end, k * to_end  # B̄, K̄

    # All four pair matrices in one product: [Ã; R̃] [B̂; K̂]ᵀ = [[ÃB̂ᵀ, ÃK̂ᵀ], [R̃B̂ᵀ, R̃K̂ᵀ]]   [b,c,h,2l,2l]
    pairs = bmm(jnp.concatenate([a_dec, r_dec], axis=-2), jnp.concatenate([b_inv, k_inv], axis=-2), transpose_b=True)
    i, j = jnp.arange(l)[:, None], jnp.arange(l)[None, :]
    M_ab = jnp.where(i > j, pairs[..., :l, :l], 0.0)  # strictly lower: u_t reads the state before step t
    M_ak = jnp.where(i > j, pairs[..., :l, l:], 0.0)
    M_r = jnp.where(jnp.concatenate([i >= j] * 2, axis=1), pairs[..., l:, :], 0.0)  # [Mrb | Mrk], inclusive

    rhs = jnp.concatenate([a_dec, bmm(M_ak, v)], axis=-1)  # [b,c,h,l,n+p]
    sol = lax.linalg.triangular_solve(jnp.eye(l, dtype=F32) - M_ab, rhs, left_side=True, lower=True,
                                      unit_diagonal=True)
    # sol = [W, U0]  [b,c,h,l,n+p]. One stacked matrix X = [[W, U0], [0, V]]  [b,c,h,2l,n+p] serves
    # both remaining products: [Mrb | Mrk] X = [Mrb W | Mrb U0 + Mrk V], Xᵀ [B̄; K̄] = [Wᵀ B̄; U0ᵀ B̄ + Vᵀ K̄]
    X = jnp.concatenate([sol, jnp.concatenate([jnp.zeros_like(a_dec), v], axis=-1)], axis=-2)
    out = bmm(M_r, X)  # [b,c,h,l,n+p]
    Qm, y0 = r_dec + out[..., :n], out[..., n:]
    ends = bmm(X, jnp.concatenate([b_end, k_end], axis=-2), transpose_a=True)  # [b,c,h,n+p,n]
    T = ends[..., :n, :] + jnp.exp(g_end[..., 0, :])[..., None] * jnp.eye(n, dtype=F32)  # [b,c,h,n,n]
    H = ends[..., n:, :]  # [b,c,h,p,n]
    return y0, Qm, T, H


def chunk_states(T, H, initial_state):
    """Inter-chunk recurrence S(c) = S(c-1) T(c) + H(c), a `lax.scan` over chunks.

    T [b,c,h,n,n], H [b,c,h,p,n], initial_state [b,h,p,n].
    Returns (states entering each chunk [b,c,h,p,n], final state [b,h,p,n]).
    """

    def step(S, inputs):
        T_c, H_c = inputs
        return bmm(S, T_c) + H_c, S

    final, entering = lax.scan(step, initial_state, (jnp.moveaxis(T, 1, 0), jnp.moveaxis(H, 1, 0)))
    return jnp.moveaxis(entering, 0, 1), final


def chunked(r, w_logit, k, v, a, b, *, chunk_size: int, initial_state=None):
    """Chunked WKV7: `chunk_intra` for all chunks at once, `chunk_states` across them, then
    y = y0 + Qm S_enteringᵀ. Returns (y [b,t,h,p] in v's dtype, final state [b,h,p,n] float32).

    Requires chunk_size <= MAX_CHUNK, which with log w in [LOG_W_MIN, 0] (`log_decay`) bounds the
    factored exponentials (see MAX_CHUNK).
    Any t works: the tail is padded with identity steps (log w = 0, a = b = k = v = r = 0),
    which leave the state exactly as after the last real token.
    """
    state = _check(r, w_logit, k, v, a, b, initial_state)
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or not 1 <= chunk_size <= MAX_CHUNK:
        raise ValueError(f"chunk_size must be an int in [1, {MAX_CHUNK}] (the bound that keeps the chunk's "
                         f"factored decays inside float32's range), got {chunk_size!r}")
    bsz, t, h, _ = r.shape
    p = v.shape[-1]
    chunk_size = min(chunk_size, t)  # a short input is one chunk of its own length
    pad = -t % chunk_size
    c = (t + pad) // chunk_size

    def chunks(x):  # [b, t, h, e] -> [b, c, h, l, e], float32, tail padded with zeros
        x = jnp.pad(x.astype(F32), [(0, 0), (0, pad), (0, 0), (0, 0)])
        return jnp.moveaxis(x.reshape(bsz, c, chunk_size, h, x.shape[-1]), 3, 2)

    y0, Qm, T, H = chunk_intra(*(chunks(x) for x in (r, log_decay(w_logit), k, v, a, b)))
    entering, final = chunk_states(T, H, state)
    y = y0 + bmm(Qm, entering, transpose_b=True)  # [b,c,h,l,p]
    y = jnp.moveaxis(y, 2, 3).reshape(bsz, c * chunk_size, h, p)[:, :t]
    return y.astype(v.dtype), final


def rwkv7_inputs(k, a_lora, a0, k_k, k_a, *, r=None, r_k=None):
    """RWKV7's delta-rule inputs from its projections, float32 over the last axis (one head's keys):
    the in-context learning rate a = sigmoid(a0 + a_lora), kk = k ∘ k_k normalised, and

        key k ∘ (1 + (a - 1) ∘ k_a),   a = -kk,   b = kk ∘ a,   bonus weight r · (key ∘ r_k)

    (the bonus weight, None without r, scales the token's own value added after the group norm).
    Elementwise and per-row, so the same function serves [b, t, h, n] arrays with [h, n] params
    and a kernel's [l, n] tiles with [n] params."""
    k = k.astype(F32)
    gate = 1.0 / (1.0 + jnp.exp(-(a0.astype(F32) + a_lora.astype(F32))))
    kk = k * k_k.astype(F32)
    kk = kk / jnp.maximum(jnp.sqrt(jnp.sum(kk * kk, axis=-1, keepdims=True)), 1e-12)  # torch's F.normalize
    key = k * (1.0 + (gate - 1.0) * k_a.astype(F32))
    bonus = None if r is None else jnp.sum(r.astype(F32) * key * r_k.astype(F32), axis=-1)
    return key, -kk, kk * gate, bonus


def check_head_params(r, **params):
    """RWKV7's per-head vectors must be [heads, key_dim] like r's last two axes."""
    for name, x in params.items():
        if tuple(x.shape) != tuple(r.shape[2:]):
            raise ValueError(f"{name} must be [heads, key_dim] = {tuple(r.shape[2:])}, got {tuple(x.shape)}")


def rwkv7_chunked(r, w_logit, k, v, a_lora, a0, k_k, k_a, r_k, *, chunk_size: int, initial_state=None):
    """RWKV7's time-mix operator from its projections: `chunked` on the inputs `rwkv7_inputs`
    derives (r, w_logit, k, a_lora [b, t, h, n], v [b, t, h, p], a0, k_k, k_a, r_k [h, n]). The
    Pallas kernel derives them per tile as it loads k and a_lora, so none is written to memory.
    Returns (y [b, t, h, p] in v's dtype, bonus weight [b, t, h] float32, final state)."""
    _check(r, w_logit, k, v, a_lora, a_lora, initial_state)
    check_head_params(r, a0=a0, k_k=k_k, k_a=k_a, r_k=r_k)
    key, a, b, bonus = rwkv7_inputs(k, a_lora, a0, k_k, k_a, r=r, r_k=r_k)
    y, state = chunked(r, w_logit, key, v, a, b, chunk_size=chunk_size, initial_state=initial_state)
    return y, bonus, state
