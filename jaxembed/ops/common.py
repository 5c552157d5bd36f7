"""What the `ops/` references share."""

from __future__ import annotations

from typing import NamedTuple

import jax
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


class StateSlot(NamedTuple):
    """Layer `layer`'s state inside the states of every layer, stacked on a leading [n_layers] axis.

    The scheduler passes one for each state field that a family's kernel updates in place
    (`Family.STATES_IN_PLACE`): the kernel reads and writes the layer's entry of the stack
    itself, so the program copies no state out of the stack and none back (at batch 32 a
    Codestral layer's SSM state is 134 MB, copied twice per layer and vertical chunk before).
    Every other path takes the copy form, `read()` then `write(new)`.
    """
    stacked: jax.Array  # [n_layers, ...]
    layer: jax.Array  # int32 []

    @property
    def shape(self) -> tuple[int, ...]:
        """One layer's state shape."""
        return tuple(self.stacked.shape[1:])

    def read(self):
        return lax.dynamic_index_in_dim(self.stacked, self.layer, keepdims=False)

    def write(self, new) -> StateSlot:
        return StateSlot(lax.dynamic_update_index_in_dim(self.stacked, new.astype(self.stacked.dtype), self.layer, 0),
                         self.layer)


def _is_slot(x) -> bool:
    return isinstance(x, StateSlot)


STATE_SLOT_KEEPS_ITS_STATE = ("a StateSlot initial state gets its final state written back into its stack: "
                              "final_state=False does not apply to it")


def through_slot(fn, *args, initial_state=None, **kwargs):
    """fn(*args, initial_state=..., **kwargs), whose last output is the final state, for an
    initial state that is or holds `StateSlot`s (a state NamedTuple may have some fields in place):
    each slot's entry is read, and the matching part of the final state comes back written into
    it (a `StateSlot`)."""
    if not any(_is_slot(x) for x in jax.tree.leaves(initial_state, is_leaf=_is_slot)):
        return fn(*args, initial_state=initial_state, **kwargs)
    read = jax.tree.map(lambda x: x.read() if _is_slot(x) else x, initial_state, is_leaf=_is_slot)
    *out, state = fn(*args, initial_state=read, **kwargs)
    if state is None:
        raise ValueError(STATE_SLOT_KEEPS_ITS_STATE)
    return (*out, jax.tree.map(lambda x, new: x.write(new) if _is_slot(x) else new, initial_state, state,
                               is_leaf=_is_slot))


def initial_state(state, shape: tuple[int, ...]):
    """The initial state as float32: zeros of `shape` when None, else checked against `shape`. A
    `StateSlot` of that shape comes back as it is."""
    if state is None:
        return jnp.zeros(shape, F32)
    if tuple(state.shape) != tuple(shape):
        raise ValueError(f"initial_state has shape {tuple(state.shape)}, expected {tuple(shape)}")
    return state if isinstance(state, StateSlot) else state.astype(F32)
