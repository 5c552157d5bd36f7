"""The pure API checks what it can see: ids out of the vocabulary are an error naming the id when
the ids are concrete (eagerly), in `embed` and `forward` alike."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxembed import models, schedule
from jaxembed.config import config_from_dict
from jaxembed.testing import TINY_CONFIGS

CFG = config_from_dict(dict(architecture="mamba2", vocab_size=64, d_model=32, n_layers=2, d_state=8, head_dim=8,
                            n_groups=1, chunk_size=16))


@pytest.mark.parametrize("bad", [64, 1000, -1])
def test_concrete_ids_out_of_range_are_refused(bad):
    params = models.family(CFG).init_params(CFG, jax.random.key(0))
    ids = np.zeros((2, 7), np.int32)
    ids[1, 3] = bad
    with pytest.raises(ValueError, match=rf"ids must be in \[0, 64\).*ids\[1, 3\] = {bad}"):
        schedule.embed(params, CFG, ids, np.array([7, 7]))
    with pytest.raises(ValueError, match=r"ids\[1, 3\]"):
        schedule.forward(params, CFG, jnp.asarray(ids))
    ids[1, 3] = 63  # the largest valid id runs
    assert np.isfinite(np.asarray(schedule.embed(params, CFG, ids, np.array([7, 7])))).all()


def test_int64_ids_and_lengths_are_checked_before_the_int32_cast():
    """jnp.asarray makes int64 int32: 2**32 + 5 would be checked, and embedded, as id 5, and a length of
    2**32 + 3 pool at position 2. The values as given are checked; empty batches and a non-bool normalize
    are named too."""
    params = models.family(CFG).init_params(CFG, jax.random.key(0))
    ids = np.ones((1, 7), np.int64)
    with pytest.raises(ValueError, match=r"lengths must be in \[1, 7\] .* got \[4294967299\]"):
        schedule.embed(params, CFG, ids, np.array([2**32 + 3]))
    ids[0, 2] = 2**32 + 5
    with pytest.raises(ValueError, match=r"ids\[0, 2\] = 4294967301"):
        schedule.embed(params, CFG, ids, np.array([7]))
    with pytest.raises(ValueError, match=r"ids of shape \(0, 4\): embed needs at least one row"):
        schedule.embed(params, CFG, np.zeros((0, 4), np.int32), np.zeros(0, np.int32))
    with pytest.raises(ValueError, match="ids must be a rectangular array"):
        schedule.embed(params, CFG, [[1, 2, 3], [4]], [3, 1])
    with pytest.raises(TypeError, match="normalize must be True or False, got str 'no'"):
        schedule.embed(params, CFG, np.ones((1, 7), np.int32), np.array([7]), normalize="no")


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_vertical_program_holds_one_copy_of_the_layer_states(family):
    """The paper's constant memory is one state per layer: each layer more costs the vertical program
    one layer's state more than it costs the horizontal one (compiled temporaries, same tokens in
    flight). As a scan's xs and ys they cost two; one copy is 8.8 GB at batch 32 for a 64-layer
    Codestral."""
    b, V = 16, 32

    def temp_bytes(n_layers, t, vertical_chunk_size):
        cfg = config_from_dict({**TINY_CONFIGS[family], "n_layers": n_layers})
        params = jax.eval_shape(lambda: models.family(cfg).init_params(cfg, jax.random.key(0)))
        compiled = jax.jit(lambda p, ids, n: schedule.embed(p, cfg, ids, n, vertical_chunk_size=vertical_chunk_size)
                           ).lower(params, jax.ShapeDtypeStruct((b, t), jnp.int32),
                                   jax.ShapeDtypeStruct((b,), jnp.int32)).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    vertical = {n: temp_bytes(n, 3 * V, V) for n in (2, 6)}
    horizontal = {n: temp_bytes(n, V, None) for n in (2, 6)}
    cfg = config_from_dict({**TINY_CONFIGS[family], "n_layers": 2})
    state = jax.eval_shape(lambda: models.family(cfg).init_state(cfg, b))
    state_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(state))
    extra_per_layer = ((vertical[6] - vertical[2]) - (horizontal[6] - horizontal[2])) / 4
    # one copy, give or take what XLA keeps per layer in either program (a few KB at these sizes, e.g. RWKV7's
    # horizontal program holding 1 KB a layer less since its LoRA inputs are one GEMM); two copies would be 2x
    assert 0.95 * state_bytes <= extra_per_layer <= 1.1 * state_bytes, (extra_per_layer, state_bytes)
