"""The pure API checks what it can see: ids out of the vocabulary are an error naming the id when
the ids are concrete (eagerly), in `embed` and `forward` alike."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxembed import models, schedule
from jaxembed.config import config_from_dict

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
