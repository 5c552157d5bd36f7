"""Cross-layer scheduling (Section 3.2.3): horizontal and vertically chunked inference.

One loop serves every architecture: it only calls the family's `init_state` and `layer`, passing
the `Runtime` (Q, kernels backend, remat) that `embed` / `forward` build from their arguments.

* horizontal: the whole sequence goes through one layer at a time (`lax.scan` over layers);
* vertical: a `lax.scan` over vertical chunks of V tokens, each a `lax.scan` over layers that
  carries one state per layer, so activations are O(V), not O(T). For T <= V it falls back to
  horizontal, which keeps no per-layer states at all.

Right padding needs no mask for last-token pooling: a causal model's output at len-1 never
sees the pads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxembed import models
from jaxembed.errors import check_bool, check_positive_int
from jaxembed.ops.common import StateSlot
from jaxembed.runtime import Runtime

F32 = jnp.float32


def check_chunk_sizes(vertical_chunk_size: int | None, chunk_size: int) -> None:
    """V must be a positive multiple of Q (the intra-layer chunk size)."""
    check_positive_int("chunk_size (Q)", chunk_size)
    check_positive_int("vertical_chunk_size (V)", vertical_chunk_size, optional=True)
    if vertical_chunk_size is None:
        return
    if vertical_chunk_size % chunk_size:
        raise ValueError(
            f"vertical_chunk_size V={vertical_chunk_size} is not a multiple of the chunk size Q={chunk_size}; "
            f"use e.g. V={-(-vertical_chunk_size // chunk_size) * chunk_size}"
        )


def init_states(cfg, batch: int):
    """Zero states for every layer, stacked on a leading [n_layers] axis."""
    one = models.family(cfg).init_state(cfg, batch)
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (cfg.n_layers, *a.shape)), one)


# Per-layer vectors (norms, biases, conv taps, decays) up to this size are gathered by a matmul on CPU.
SMALL_PARAM_ELEMENTS = 1 << 16


def _layer_param_slicer(layer_params):
    """Split stacked layer params into (scanned leaves, a function (scanned slice, i) -> params_l).

    On CPU, XLA fuses a scan's per-layer dynamic-slice into every elementwise consumer, which
    then computes the slice index per element and runs several times slower (the conv alone:
    7x). So small per-layer params are gathered once per layer with a one-hot matmul (exact:
    products with 1 and 0), which XLA materialises; large matrices feed matmuls and are scanned
    as usual. Elsewhere everything is scanned.
    """
    leaves, treedef = jax.tree.flatten(layer_params)
    n_layers = leaves[0].shape[0]
    small = [
        i for i, a in enumerate(leaves)
        if jax.default_backend() == "cpu" and a[0].size <= SMALL_PARAM_ELEMENTS
        and jnp.issubdtype(a.dtype, jnp.floating)
    ]
    tables = {}  # dtype -> (leaf indices, [n_layers, total] table)
    for i in small:
        tables.setdefault(leaves[i].dtype, []).append(i)
    tables = {dt: (idx, jnp.concatenate([leaves[i].reshape(n_layers, -1) for i in idx], axis=1))
              for dt, idx in tables.items()}
    scanned = [a for i, a in enumerate(leaves) if i not in small]

    def params_at(scanned_l, layer):
        out = [None] * len(leaves)
        it = iter(scanned_l)
        for i in range(len(leaves)):
            if i not in small:
                out[i] = next(it)
        for idx, table in tables.values():
            onehot = jax.nn.one_hot(layer, n_layers, dtype=table.dtype)
            row = jnp.dot(onehot, table, precision=lax.Precision.HIGHEST, preferred_element_type=table.dtype)
            offset = 0
            for i in idx:
                size = leaves[i][0].size
                out[i] = row[offset : offset + size].reshape(leaves[i].shape[1:])
                offset += size
        return jax.tree.unflatten(treedef, out)

    return scanned, params_at


def run_layers(cfg, layer_params, x, states=None, *, runtime: Runtime):
    """All layers on the stream x (the residual [b, t, d], or a pytree holding it): a `lax.scan`
    over the stacked layers. Returns (x, new states or None).

    states: one state per layer, stacked on [n_layers] (vertical chunks, streams). They are the
    scan's carry, each layer's read and written back in place, so the program holds one copy of
    them; as the scan's xs and ys it held two (the input and the stacked output), and one copy
    is 8.8 GB at batch 32 for a 64-layer Codestral. None: every layer starts from its
    zero state and its new state is dropped (horizontal), so no stack of states exists at all.

    runtime.remat rematerialises each layer in the backward pass (`jax.checkpoint` around the
    layer), so a gradient keeps one residual stream per layer instead of every layer's activations.
    """
    family = models.family(cfg)
    scanned, params_at = _layer_param_slicer(layer_params)
    n_layers = jax.tree.leaves(layer_params)[0].shape[0]

    def apply_layer(x, scanned_l, layer, state_l):
        return family.layer(cfg, params_at(scanned_l, layer), x, state_l, runtime=runtime, index=layer)

    if runtime.remat:
        apply_layer = jax.checkpoint(apply_layer, prevent_cse=False)  # inside a scan CSE cannot defeat the remat

    if states is None:
        batch = models.hidden(cfg, x).shape[0]
        # a family's fresh_state (Mamba2) lets its kernels skip the zero state and the dropped one
        fresh_state = getattr(family, "fresh_state", family.init_state)

        def fresh(x, inputs):
            x, _ = apply_layer(x, *inputs, fresh_state(cfg, batch))
            return x, None

        x, _ = lax.scan(fresh, x, (scanned, jnp.arange(n_layers)))
        return x, None

    in_place = family.STATES_IN_PLACE

    def carried(carry, inputs):
        x, states = carry
        scanned_l, layer = inputs
        # a field in STATES_IN_PLACE goes to the layer as its slot in the stack, and comes back as
        # the updated stack; every other one is copied out of its stack and back
        slots = [StateSlot(s, layer) for s in states]
        state_l = type(states)(*(slot if field in in_place else slot.read()
                                 for field, slot in zip(states._fields, slots, strict=True)))
        x, state_l = apply_layer(x, scanned_l, layer, state_l)
        states = type(states)(*(new.stacked if field in in_place else slot.write(new).stacked
                                for field, slot, new in zip(states._fields, slots, state_l, strict=True)))
        return (x, states), None

    (x, states), _ = lax.scan(carried, (x, states), (scanned, jnp.arange(n_layers)))
    return x, states


def _layers(config, params, ids, states, runtime: Runtime):
    family = models.family(config)
    return run_layers(config, params["layers"], family.embed_tokens(config, params, ids), states, runtime=runtime)


def _vertically(config, params, ids, V, runtime: Runtime, consume, extra):
    """Run ids [b, t] through all layers V tokens at a time, carrying one state per layer.

    The t // V full chunks are a `lax.scan`; the t % V remaining tokens run once more from the
    carried states, so an input is never padded up to a multiple of V. `consume(extra, x, start)`
    sees each chunk's last-layer output x [b, n, d] (n = V or the tail) starting at token
    `start`, and returns (extra, per-chunk output or None).
    """
    b, t = ids.shape
    full, tail = divmod(t, V)
    outputs = []

    def step(carry, chunk):
        states, extra = carry
        ids_k, start = chunk
        x, states = _layers(config, params, ids_k, states, runtime)
        extra, out = consume(extra, models.hidden(config, x), start)
        return (states, extra), out

    carry = (init_states(config, b), extra)
    if full:
        chunks = jnp.moveaxis(ids[:, : full * V].reshape(b, full, V), 1, 0)  # [k, b, V]
        carry, out = lax.scan(step, carry, (chunks, jnp.arange(full) * V))
        outputs.append(None if out is None else jnp.moveaxis(out, 0, 1).reshape(b, full * V, -1))
    if tail:
        carry, out = step(carry, (ids[:, full * V :], full * V))
        outputs.append(out)
    return carry[1], outputs


def _checked_ids(config, ids, vertical_chunk_size, runtime: Runtime):
    """What `embed` and `forward` check before they run: V against Q and the family, and the ids'
    shape, dtype and (when concrete) range. Returns ids as a jax array."""
    check_chunk_sizes(vertical_chunk_size, runtime.chunk_size)
    _check_vertical(config, vertical_chunk_size)
    concrete = _concrete("ids", ids)
    ids = jnp.asarray(ids)
    if ids.ndim != 2:
        raise ValueError(f"ids must be [batch, time], got shape {ids.shape}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"ids must be integers, got {ids.dtype}")
    if 0 in ids.shape:
        raise ValueError(f"ids of shape {ids.shape}: embed needs at least one row and one position "
                         "(Embedder.encode_ids([]) gives an empty [0, d])")
    if concrete is None:
        return ids  # traced under jit: in range is the caller's promise (`Embedder` always checks)
    bad = (concrete < 0) | (concrete >= config.vocab_size)
    if bad.any():
        row, col = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"ids must be in [0, {config.vocab_size}) (the vocabulary size); ids[{row}, {col}] = "
                         f"{int(concrete[row, col])} ({int(bad.sum())} out of range)")
    return ids


def _concrete(name: str, value) -> np.ndarray | None:
    """The values as given, for range checks: before jnp.asarray, which makes int64 int32 (2**32 + 5 would be
    checked, and embedded, as 5). None when traced under jit."""
    try:
        return np.asarray(value)
    except jax.errors.TracerArrayConversionError:
        return None
    except ValueError as err:  # ragged nested lists
        raise ValueError(f"{name} must be a rectangular array: {err}") from None


def forward(params, config, ids, *, vertical_chunk_size: int | None = None, chunk_size: int | None = None,
            kernels: str = "auto"):
    """Final-norm hidden states at every position, [b, t, d] float32 (for checks and mean pooling).

    Vertical mode returns the same values as horizontal, computed V tokens at a time; the
    output itself is O(t), the activations are O(V). `kernels` picks the chunked operators'
    backend (see `jaxembed.kernels`).
    """
    return _forward(params, config, ids, vertical_chunk_size, _runtime(config, chunk_size, kernels, False))


def _check_vertical(config, vertical_chunk_size) -> None:
    if vertical_chunk_size is not None and not models.family(config).VERTICAL:
        raise ValueError(f"{config.architecture} models have no constant-size state and run horizontally only; "
                         f"pass vertical_chunk_size=None (got {vertical_chunk_size})")


def _runtime(config, chunk_size, kernels, remat) -> Runtime:
    """The explicit runtime of one call; Q defaults to the config's."""
    chunk_size = config.chunk_size if chunk_size is None else chunk_size
    return Runtime(chunk_size=chunk_size, kernels=kernels, remat=remat)


def _forward(params, config, ids, vertical_chunk_size, runtime: Runtime):
    family = models.family(config)
    ids = _checked_ids(config, ids, vertical_chunk_size, runtime)
    if vertical_chunk_size is None or ids.shape[1] <= vertical_chunk_size:
        x, _ = _layers(config, params, ids, None, runtime)
        return family.final_norm(config, params, models.hidden(config, x))
    _, outputs = _vertically(config, params, ids, vertical_chunk_size, runtime,
                             lambda extra, x, start: (extra, family.final_norm(config, params, x)), None)
    return jnp.concatenate(outputs, axis=1)


def _pooling_positions(lengths, b: int, t: int):
    """lengths - 1 as int32 [b]; checked when the lengths are concrete (not traced under jit)."""
    concrete = _concrete("lengths", lengths)  # None when traced: the caller promises 1 <= lengths <= t
    lengths = jnp.asarray(lengths)
    if not jnp.issubdtype(lengths.dtype, jnp.integer):  # a float would pool at its truncation, silently
        raise TypeError(f"lengths must be ints, got dtype {lengths.dtype}")
    if lengths.shape != (b,):
        raise ValueError(f"lengths must have shape ({b},) for ids of shape ({b}, {t}), got {lengths.shape}")
    if concrete is not None and ((concrete < 1) | (concrete > t)).any():
        raise ValueError(f"lengths must be in [1, {t}] (the pooled position is lengths-1), got {concrete.tolist()}")
    return jnp.clip(lengths.astype(jnp.int32) - 1, 0, t - 1)


def embed(params, config, ids, lengths, *, vertical_chunk_size: int | None = None, chunk_size: int | None = None,
          normalize: bool = True, kernels: str = "auto", remat: bool = False):
    """Pure, jit-compatible embedding: the final-norm output at position lengths-1 of each row.

    Args:
      params: the model's params pytree (layers stacked on a leading axis).
      config: the architecture config (static under jit).
      ids: int [b, t], right-padded token ids in [0, vocab_size). Pads may be any valid id. Checked
        when concrete (an id out of range is a ValueError naming it); under jit, in range is the
        caller's promise, as XLA's gather would clamp or give NaN.
      lengths: int [b], 1 <= lengths <= t: the pooled position is lengths-1 (the EOS for texts).
        Checked when concrete; under jit they are clipped into [1, t].
      vertical_chunk_size: None for horizontal inference, or V (a multiple of Q) for
        vertically chunked inference; t <= V falls back to horizontal.
      chunk_size: the intra-layer chunk size Q (default: the config's).
      normalize: L2-normalise the embeddings.
      kernels: the chunked operators' backend, "auto" (Pallas on GPU, XLA elsewhere), "pallas",
        "interpret" or "xla" (see `jaxembed.kernels`).
      remat: rematerialise each layer under differentiation (training); no effect on the value.
    Returns:
      [b, d] float32.
    """
    check_bool("normalize", normalize)
    return _embed(params, config, ids, lengths, vertical_chunk_size, normalize,
                  _runtime(config, chunk_size, kernels, remat))


def _embed(params, config, ids, lengths, vertical_chunk_size, normalize, runtime: Runtime):
    family = models.family(config)
    ids = _checked_ids(config, ids, vertical_chunk_size, runtime)
    b, t = ids.shape
    last = _pooling_positions(lengths, b, t)
    rows = jnp.arange(b)

    if vertical_chunk_size is None or t <= vertical_chunk_size:
        x, _ = _layers(config, params, ids, None, runtime)
        pooled = models.hidden(config, x)[rows, last]
    else:
        def consume(pooled, x, start):
            n = x.shape[1]
            local = last - start
            here = (local >= 0) & (local < n)
            return jnp.where(here[:, None], x[rows, jnp.clip(local, 0, n - 1)].astype(F32), pooled), None

        pooled, _ = _vertically(config, params, ids, vertical_chunk_size, runtime, consume,
                                jnp.zeros((b, config.hidden_size), F32))

    out = family.final_norm(config, params, pooled)
    if normalize:
        out = out * lax.rsqrt(jnp.maximum(jnp.sum(out * out, axis=-1, keepdims=True), 1e-24))
    return out
