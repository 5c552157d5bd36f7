"""The mLSTM cell of xLSTM in three forms with one signature.

Per head, with stabilised exponential gating (log-sigmoid forget gate, exponential input gate):

    m_t = max(log σ(f_t) + m_{t-1}, i_t)                                  max state
    C_t = exp(log σ(f_t) + m_{t-1} - m_t) C_{t-1} + exp(i_t - m_t) k_t v_tᵀ    [k, v]
    n_t = exp(log σ(f_t) + m_{t-1} - m_t) n_{t-1} + exp(i_t - m_t) k_t         [k]
    h_t = (q̂_tᵀ C_t) / (max(|q̂_tᵀ n_t|, exp(-m_t)) + eps),      q̂_t = q_t / sqrt(dk)

C and n are the unstabilised memory and normaliser scaled by exp(-m_t). The normaliser's
floor exp(-m_t) and the eps added after the max are those of transformers' native xLSTM
kernels (`mlstm_recurrent_step_native`, `mlstm_chunkwise_native_autograd`); because eps is
added to a stabilised quantity, h depends on m itself, so every form below uses exactly the
recurrent m_t, which unrolls to

    m_t = max(b_t + m_0, max_{s<=t} (b_t - b_s + i_s)),       b_t = Σ_{r<=t} log σ(f_r).

`recurrent` is the step above under `lax.scan`; `quadratic` the parallel form
h = ((S ∘ D) v + inter) / (...) with the full stabilised matrix D_ts = exp(b_t - b_s + i_s - m_t);
`chunked` the chunkwise form (xLSTM 7B's kernels, and Section 3.2.2 of the paper for SSD):
D-matrix work inside chunks of Q tokens, the (C, n, m) state carried across chunks by a
`lax.scan`, and the incoming state's contribution added to each chunk's outputs. All take
raw gate preactivations and an optional initial state and return `(h, final_state)`.

Shapes: b batch, t time, c chunks, l/s positions inside a chunk (query/key side), h heads,
k query/key head dim, v value head dim.

    q, k [b, t, h, k]    v [b, t, h, v]    i, f [b, t, h] (preactivations)
    state: C [b, h, k, v], n [b, h, k], m [b, h]   (float32)

Gates, cumulative log decays, exponentials and states are float32 whatever the input dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxembed.errors import check_positive_int
from jaxembed.ops.common import StateSlot, bmm

F32 = jnp.float32
EPS = 1e-6  # transformers' xLSTMConfig.eps default
# Input-gate preactivation of padding tokens: exp(PAD_I - m) is exactly 0 for any finite m, and
# unlike -inf it never meets another infinity (no inf - inf) in the max-state arithmetic.
PAD_I = -1e30


class State(NamedTuple):
    C: jax.Array  # [b, h, k, v] float32  memory, stabilised by exp(-m)
    n: jax.Array  # [b, h, k] float32     normaliser, stabilised by exp(-m)
    m: jax.Array  # [b, h] float32        max state (log scale)


def zero_state(b: int, h: int, dk: int, dv: int) -> State:
    """The state before the first token (m = 0, as transformers' kernels and cache start)."""
    return State(jnp.zeros((b, h, dk, dv), F32), jnp.zeros((b, h, dk), F32), jnp.zeros((b, h), F32))


def _check(q, k, v, i, f, initial_state) -> State:
    if q.ndim != 4 or q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape [b, t, h, k], got {q.shape} and {k.shape}")
    b, t, h, dk = q.shape
    if v.ndim != 4 or v.shape[:3] != (b, t, h):
        raise ValueError(f"v must be [b, t, h, v] = [{b}, {t}, {h}, v], got {v.shape}")
    for name, g in (("i", i), ("f", f)):
        if g.shape != (b, t, h):
            raise ValueError(f"gate {name} must be [b, t, h] = {(b, t, h)}, got {g.shape}")
    dv = v.shape[-1]
    if initial_state is None:
        return zero_state(b, h, dk, dv)
    C, n, m = initial_state
    expected = ((b, h, dk, dv), (b, h, dk), (b, h))
    if (C.shape, n.shape, m.shape) != expected:
        raise ValueError(f"initial_state (C, n, m) has shapes {(C.shape, n.shape, m.shape)}, expected {expected}")
    # C may be a `StateSlot` (the xLSTM layer's, updated in place by the kernel): it stays one
    return State(C if isinstance(C, StateSlot) else C.astype(F32), n.astype(F32), m.astype(F32))


def _normalise(num, den, m, eps):
    """h = num / (max(|den|, exp(-m)) + eps).  num [..., v], den and m [...]."""
    return num / (jnp.maximum(jnp.abs(den), jnp.exp(-m)) + eps)[..., None]


def recurrent(q, k, v, i, f, *, initial_state=None, eps=EPS):
    """The step recurrence as a `lax.scan` over time. Returns (h [b, t, h, v], final State)."""
    state = _check(q, k, v, i, f, initial_state)
    scale = q.shape[-1] ** -0.5

    def step(carry, inputs):
        C, n, m = carry
        q_t, k_t, v_t, i_t, f_t = inputs  # [b,h,k] [b,h,k] [b,h,v] [b,h] [b,h]
        logf = jax.nn.log_sigmoid(f_t)
        m_new = jnp.maximum(logf + m, i_t)
        decay = jnp.exp(logf + m - m_new)
        gain = jnp.exp(i_t - m_new)
        C = decay[..., None, None] * C + gain[..., None, None] * jnp.einsum("bhk,bhv->bhkv", k_t, v_t)
        n = decay[..., None] * n + gain[..., None] * k_t
        q_t = q_t * scale
        h_t = _normalise(jnp.einsum("bhk,bhkv->bhv", q_t, C), jnp.einsum("bhk,bhk->bh", q_t, n), m_new, eps)
        return State(C, n, m_new), h_t

    time_major = [jnp.moveaxis(a.astype(F32), 1, 0) for a in (q, k, v, i, f)]
    final, h = lax.scan(step, state, time_major)
    return jnp.moveaxis(h, 0, 1).astype(v.dtype), final


def _segsum(a):
    """out[..., t, s] = a[s+1] + ... + a[t] for s <= t (0 on the diagonal), 0 above.  [..., t] -> [..., t, t]

    A masked cumulative sum, not cumsum[t] - cumsum[s]: no cancellation error that grows with
    the distance from the sequence start (the quadratic form spans the whole sequence)."""
    t = a.shape[-1]
    lower = jnp.tril(jnp.ones((t, t), bool), k=-1)
    return jnp.cumsum(jnp.where(lower, a[..., :, None], 0.0), axis=-2)


def _log_gates(i, f):
    """(input-gate preactivation, log forget gate), float32, moved to [b, h, t]."""
    return jnp.moveaxis(i.astype(F32), 1, 2), jnp.moveaxis(jax.nn.log_sigmoid(f.astype(F32)), 1, 2)


def quadratic(q, k, v, i, f, *, initial_state=None, eps=EPS):
    """The parallel form over the whole sequence, O(t²): h = ((S ∘ D) v + inter) / normaliser.

    D_ts = exp(b_t - b_s + i_s - m_t) for s <= t, S = q̂ kᵀ, and the initial state enters each
    row with weight exp(b_t + m_0 - m_t). Returns (h [b, t, h, v], final State).
    """
    C0, n0, m0 = _check(q, k, v, i, f, initial_state)
    t = q.shape[1]
    qf = q.astype(F32) * q.shape[-1] ** -0.5
    kf, vf = k.astype(F32), v.astype(F32)
    ig, logf = _log_gates(i, f)  # [b, h, t]
    causal = jnp.tril(jnp.ones((t, t), bool))
    log_d = _segsum(logf) + ig[..., None, :]  # [b, h, t, s]
    b_cum = jnp.cumsum(logf, axis=-1)  # [b, h, t]: log decay of the initial state through t
    log_inter = b_cum + m0[..., None]
    m = jnp.maximum(log_inter, row_max(jnp.where(causal, log_d, -jnp.inf)))  # [b, h, t]
    # exponents are <= 0 on and below the diagonal; the clamp keeps the masked ones finite
    D = jnp.where(causal, jnp.exp(jnp.minimum(log_d - m[..., None], 0.0)), 0.0)
    w = jnp.exp(log_inter - m)  # [b, h, t]
    SD = jnp.einsum("bthk,bshk->bhts", qf, kf) * D
    num = jnp.einsum("bhts,bshv->bthv", SD, vf) + jnp.einsum("bthk,bhkv,bht->bthv", qf, C0, w)
    den = jnp.sum(SD, axis=-1) + jnp.einsum("bthk,bhk,bht->bht", qf, n0, w)
    h = _normalise(num, jnp.moveaxis(den, 1, 2), jnp.moveaxis(m, 1, 2), eps)
    # final state: the last row of D (weights of every token at t) and the decayed initial state
    m_T = m[..., -1]
    w_T = jnp.exp(log_inter[..., -1] - m_T)
    d_T = jnp.exp(jnp.minimum(log_d[..., -1, :] - m_T[..., None], 0.0))  # [b, h, s]
    C = w_T[..., None, None] * C0 + jnp.einsum("bhs,bshk,bshv->bhkv", d_T, kf, vf)
    n = w_T[..., None] * n0 + jnp.einsum("bhs,bshk->bhk", d_T, kf)
    return h.astype(v.dtype), State(C, n, m_T)


def row_max(x):
    """max over the last axis, its gradient sent to the first argmax. jnp.max's gradient finds the max by
    x == max(x) and divides by the count; a stabiliser recomputed under remat can differ from its first
    evaluation in the last bit (XLA:CPU fuses one of them with an FMA at --xla_backend_optimization_level=0),
    leaving a row with no match: 0 / 0, NaN gradients. A gather at the argmax has no equality to miss."""
    return jnp.take_along_axis(x, jnp.argmax(x, axis=-1)[..., None], axis=-1)[..., 0]


# ---- chunked form -----------------------------------------------------------------------
# Inside the chunked form every tensor is head-major, [b, c, h, l, ·], so each product is a
# canonical batched matmul over (b, c, h) and XLA adds no transposes around it.



def chunk_local_states(k, v, ig, b_cum):
    """Each chunk's own contribution to the state at its end, assuming a zero incoming state.

    k [b,c,h,l,k], v [b,c,h,l,v] (float32), ig and b_cum [b,c,h,l] (input gate and in-chunk
    cumulative log forget gate). Token s enters the chunk-end state with log weight
    a_s = b_L - b_s + i_s; the chunk stabilises with its own max m_loc = max_s a_s, so every
    weight is <= 1. Returns (C_loc [b,c,h,k,v], n_loc [b,c,h,k], m_loc [b,c,h]).
    """
    a = b_cum[..., -1:] - b_cum + ig  # [b,c,h,s]
    m_loc = row_max(a)
    kw = k * jnp.exp(a - m_loc[..., None])[..., None]  # [b,c,h,s,k]
    return bmm(jnp.swapaxes(kw, -1, -2), v), jnp.sum(kw, axis=-2), m_loc


def chunk_states(C_loc, n_loc, m_loc, chunk_decay, initial_state: State):
    """The inter-chunk recurrence, a `lax.scan` over chunks:

        m(c) = max(g_c + m(c-1), m_loc(c))
        C(c) = exp(g_c + m(c-1) - m(c)) C(c-1) + exp(m_loc(c) - m(c)) C_loc(c)      (n alike)

    with g_c = chunk_decay [b,c,h] the chunk's total log forget gate. m(c) is exactly the
    recurrent max state at the chunk's last token. Returns (the State entering each chunk,
    stacked on a chunk axis after the batch axis, and the final State).
    """

    def step(carry, inputs):
        C, n, m = carry
        C_c, n_c, m_c, g_c = inputs
        m_new = jnp.maximum(g_c + m, m_c)
        old, new = jnp.exp(g_c + m - m_new), jnp.exp(m_c - m_new)
        C_next = old[..., None, None] * C + new[..., None, None] * C_c
        n_next = old[..., None] * n + new[..., None] * n_c
        return State(C_next, n_next, m_new), carry

    if C_loc.shape[1] == 1:  # one chunk (t <= Q, e.g. every vertical chunk when V = Q): no loop to compile or run
        final, entering = step(initial_state, [a[:, 0] for a in (C_loc, n_loc, m_loc, chunk_decay)])
        return State(*(a[:, None] for a in entering)), final
    chunk_major = [jnp.moveaxis(a, 1, 0) for a in (C_loc, n_loc, m_loc, chunk_decay)]
    final, entering = lax.scan(step, initial_state, chunk_major)
    return State(*(jnp.moveaxis(a, 0, 1) for a in entering)), final


def chunk_output(q, k, v, ig, b_cum, entering: State, eps):
    """Outputs of every chunk from its own tokens (the stabilised D-matrix) plus the state entering it.

    q, k [b,c,h,l,k] (q already scaled), v [b,c,h,l,v], ig and b_cum [b,c,h,l], entering
    (C [b,c,h,k,v], n [b,c,h,k], m [b,c,h]). The stabiliser of row l is the recurrent m_t:
    max(b_l + m_entering, max_{s<=l} (b_l - b_s + i_s)). Returns h [b,c,h,l,v] float32.
    """
    L = q.shape[-2]
    causal = jnp.tril(jnp.ones((L, L), bool))
    # differences of in-chunk cumulative sums: accurate to eps * |chunk's total log decay|
    log_d = b_cum[..., :, None] - b_cum[..., None, :] + ig[..., None, :]  # [b,c,h,l,s]
    log_inter = b_cum + entering.m[..., None]  # [b,c,h,l]
    m = jnp.maximum(log_inter, row_max(jnp.where(causal, log_d, -jnp.inf)))
    # above the diagonal log_d - m can be large and positive: clamp before exp, then mask
    D = jnp.where(causal, jnp.exp(jnp.minimum(log_d - m[..., None], 0.0)), 0.0)
    SD = bmm(q, jnp.swapaxes(k, -1, -2)) * D  # [b,c,h,l,s]
    qw = q * jnp.exp(log_inter - m)[..., None]  # the incoming state's weight (<= 1) folded into q
    num = bmm(SD, v) + bmm(qw, entering.C)
    den = jnp.sum(SD, axis=-1) + bmm(qw, entering.n[..., None])[..., 0]
    return _normalise(num, den, m, eps)


def _pad_time(a, pad, value=0.0):
    return jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2), constant_values=value) if pad else a


def chunked(q, k, v, i, f, *, chunk_size, initial_state=None, eps=EPS):
    """Chunkwise mLSTM: D-matrix work inside chunks, (C, n, m) carried across chunks by a `lax.scan`.

    Any t works: the tail is padded to a multiple of chunk_size with tokens that neither decay
    (log σ(f) = 0) nor write (i = PAD_I), which leaves the final state exactly as after the last
    real token. Returns (h [b, t, h, v], final State).
    """
    state = _check(q, k, v, i, f, initial_state)
    check_positive_int("chunk_size", chunk_size)
    b, t, h, dk = q.shape
    if t == 0:
        raise ValueError("chunked needs at least one token (t >= 1)")
    dv = v.shape[-1]
    L = min(chunk_size, t)  # a short input is one chunk of its own length: same result, no padding
    pad = -t % L
    c = (t + pad) // L

    def heads_major(a, value=0.0):  # [b, t, h, ...] -> [b, c, h, l, ...]
        a = _pad_time(a, pad, value)
        return jnp.moveaxis(a.reshape(b, c, L, *a.shape[2:]), 2, 3)

    qc = heads_major(q.astype(F32) * dk**-0.5)
    kc, vc = heads_major(k.astype(F32)), heads_major(v.astype(F32))
    ig = heads_major(i.astype(F32), PAD_I)  # [b,c,h,l]
    logf = heads_major(jax.nn.log_sigmoid(f.astype(F32)))  # padding: log σ(f) = 0, no decay
    b_cum = jnp.cumsum(logf, axis=-1)
    C_loc, n_loc, m_loc = chunk_local_states(kc, vc, ig, b_cum)
    entering, final = chunk_states(C_loc, n_loc, m_loc, b_cum[..., -1], state)
    out = chunk_output(qc, kc, vc, ig, b_cum, entering, eps)  # [b,c,h,l,v]
    return jnp.moveaxis(out, 3, 2).reshape(b, c * L, h, dv)[:, :t].astype(v.dtype), final
