"""InfoNCE over cosine similarity (Section 3.1, the paper's loss).

For query i the candidates are every positive and every hard negative in the (global) batch:
its own positive, its own hard negatives, and the other queries' positives and hard negatives.

    L = mean_i  -log  exp(s(q_i, p_i) / tau) / sum_{c in candidates} exp(s(q_i, c) / tau)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


def info_nce(queries, positives, negatives, temperature: float = 0.02):
    """queries [B, d], positives [B, d], negatives [B, k, d] (k >= 0), all L2-normalised (so the dot
    product is the cosine similarity). Returns the mean loss over the B queries, float32."""
    b, d = queries.shape
    candidates = jnp.concatenate([positives, negatives.reshape(-1, d)], axis=0).astype(F32)  # [B (1 + k), d]
    logits = jnp.einsum("bd,cd->bc", queries.astype(F32), candidates,
                        precision=jax.lax.Precision.HIGHEST) / temperature  # [B, B (1 + k)]
    # the positive of query i is candidate i
    log_norm = jax.nn.logsumexp(logits, axis=-1)
    return jnp.mean(log_norm - logits[jnp.arange(b), jnp.arange(b)])
