"""What the `ops/` references share."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

F32 = jnp.float32


def bmm(a, b, *, transpose_a: bool = False, transpose_b: bool = False):
    """Batched matmul, batch dims leading, float32 accumulation and output:
    [..., m, k] @ [..., k, n] -> [..., m, n]; transpose_a takes a as [..., k, m], transpose_b b as [..., n, k].

    A canonical dot_general, so XLA keeps row-major operands and output instead of transposing
    [l, s] decay matrices on the way in and the outputs on the way out.
    """
    nb = a.ndim - 2
    batch = tuple(range(nb))
    contract = ((nb if transpose_a else nb + 1,), (nb + 1 if transpose_b else nb,))
    return lax.dot_general(a, b, (contract, (batch, batch)), preferred_element_type=F32)


def initial_state(state, shape: tuple[int, ...]):
    """The initial state as float32: zeros of `shape` when None, else checked against `shape`."""
    if state is None:
        return jnp.zeros(shape, F32)
    if tuple(state.shape) != tuple(shape):
        raise ValueError(f"initial_state has shape {tuple(state.shape)}, expected {tuple(shape)}")
    return state.astype(F32)
