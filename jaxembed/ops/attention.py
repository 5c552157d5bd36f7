"""Causal (optionally sliding-window) grouped-query attention for the transformer baselines.

    dense(q, k, v, window)              one `jax.nn.dot_product_attention` call; XLA materialises
                                        the [b, h, t, t] scores (memory quadratic in t)
    blockwise(q, k, v, window, block)   FlashAttention's schedule in XLA: query blocks in a
                                        `lax.scan`, key blocks in an inner `lax.scan` that merges
                                        per-block results through their log-sum-exp; memory
                                        O(t * block), and key blocks outside the causal / window
                                        range are skipped (`lax.cond`), so a sliding window costs
                                        O(t * window) time, full attention O(t^2 / 2)
    flash(q, k, v, window)              cuDNN's flash attention (GPU, float16 / bfloat16)

The paper's baselines run FlashAttention-2, whose memory is linear in the length; `blockwise`
gives the CPU the same memory behaviour, so a benchmark compares schedules, not XLA's dense
attention. Token i sees keys max(0, i - window + 1) .. i (transformers' Mistral convention).

Shapes: b batch, t time, h query heads, kv key/value heads (h = kv * group), hd head dim.
    q [b, t, h, hd]     k, v [b, t, kv, hd]     ->  [b, t, h, hd]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32
BLOCK = 512  # query and key block length of `blockwise`


def _window(window):
    return None if window is None else (window - 1, 0)


def dense(q, k, v, window: int | None = None):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=_window(window))


def flash(q, k, v, window: int | None = None):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=_window(window),
                                        implementation="cudnn")


def _block(q, k, v, visible):
    """Softmax attention of one query block on one key block, normalised within the block, and
    its log-sum-exp, in float32 (differentiable through both, unlike `dot_product_attention`'s
    residual). q [b, l, h, hd], k/v [b, s, kv, hd], visible [l, s] -> o [b, l, h, hd], lse [b, l, h]."""
    b, l, h, hd = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, l, kv, h // kv, hd)
    scores = jnp.einsum("blkgd,bskd->blkgs", qg, k, preferred_element_type=F32) / jnp.sqrt(jnp.asarray(hd, F32))
    mask = visible[None, :, None, None, :]
    scores = jnp.where(mask, scores, -jnp.inf)
    lse = jax.nn.logsumexp(scores, axis=-1)
    probs = jnp.where(mask, jnp.exp(scores - jnp.where(jnp.isneginf(lse), 0.0, lse)[..., None]), 0.0)
    o = jnp.einsum("blkgs,bskd->blkgd", probs.astype(v.dtype), v, preferred_element_type=F32)
    return o.reshape(b, l, h, hd), lse.reshape(b, l, h)


def blockwise(q, k, v, window: int | None = None, block: int = BLOCK):
    b, t, h, hd = q.shape
    if t <= block:
        return dense(q, k, v, window)
    n = -(-t // block)
    pad = n * block - t  # trailing pads: causal masking keeps every real query off them
    q, k, v = (jnp.pad(a, ((0, 0), (0, pad), (0, 0), (0, 0))) for a in (q, k, v))
    qb = q.reshape(b, n, block, h, hd).swapaxes(0, 1)  # [n, b, block, h, hd]
    kb = k.reshape(b, n, block, *k.shape[2:]).swapaxes(0, 1)
    vb = v.reshape(b, n, block, *v.shape[2:]).swapaxes(0, 1)
    # key blocks a query block can see: itself and up to `slots - 1` before it
    slots = n if window is None else min(n, -(-(window - 1) // block) + 1)
    offsets = jnp.arange(block)

    def query_block(_, xs):
        i, q_i = xs
        q_pos = i * block + offsets

        def key_block(carry, s):
            out, lse = carry
            j = i - s

            def attend(_):
                k_pos = j * block + offsets
                visible = k_pos[None, :] <= q_pos[:, None]
                if window is not None:
                    visible &= k_pos[None, :] > q_pos[:, None] - window
                o_j, lse_j = _block(q_i, kb[j], vb[j], visible)
                new = jnp.logaddexp(lse, lse_j)
                # rows that see nothing yet keep (0, -inf), without 0 * inf or inf - inf
                safe = jnp.where(jnp.isneginf(new), 0.0, new)
                w_old = jnp.where(jnp.isneginf(lse), 0.0, jnp.exp(lse - safe))[..., None]
                w_new = jnp.where(jnp.isneginf(lse_j), 0.0, jnp.exp(lse_j - safe))[..., None]
                return out * w_old + o_j * w_new, new

            return lax.cond(j >= 0, attend, lambda _: (out, lse), None), None

        init = (jnp.zeros((b, block, h, hd), F32), jnp.full((b, block, h), -jnp.inf, F32))
        (out, _), _ = lax.scan(key_block, init, jnp.arange(slots))
        return None, out.astype(q.dtype)

    _, out = lax.scan(query_block, None, (jnp.arange(n), qb))
    return out.swapaxes(0, 1).reshape(b, n * block, h, hd)[:, :t]
