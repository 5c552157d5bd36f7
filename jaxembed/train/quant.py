"""4-bit NormalFloat (NF4) base weights, as in QLoRA (Dettmers et al., 2023, Section 3).

Each matrix is flattened (row-major) and cut into blocks of 64 values; a block stores its
absolute maximum (float32) and, per value, the index of the nearest of 16 levels in [-1, 1]
after dividing by that maximum; two indices share a byte (the first in the high nibble). The
levels are quantiles of N(0, 1), built as in the paper (Appendix: 8 positive and 7 negative
quantiles plus an exact zero). This is bitsandbytes' `quantize_4bit(quant_type="nf4")`
layout, which the tests compare against bit for bit. Double quantisation of the block maxima
is not implemented: it saves 0.37 bits per weight (about 4% of a 4-bit model).

The matrix is dequantised at the matmul (`NF4Weight.matmul`), one layer at a time inside the
scheduler's layer scan.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from scipy.stats import norm

from jaxembed.weights import DerivedWeight

F32 = jnp.float32
BLOCK_SIZE = 64
_QLORA_OFFSET = 0.9677083  # QLoRA's choice: the outermost quantile sits at 1 - 1/2 (1/32 + 1/30)


@functools.cache
def nf4_levels() -> np.ndarray:
    """The 16 NF4 levels, ascending, float32, exactly -1, 0 and 1 included."""
    positive = norm.ppf(np.linspace(_QLORA_OFFSET, 0.5, 9)[:-1])  # 8 levels
    negative = -norm.ppf(np.linspace(_QLORA_OFFSET, 0.5, 8)[:-1])  # 7 levels
    levels = np.sort(np.concatenate([positive, [0.0], negative]))
    return (levels / np.abs(levels).max()).astype(np.float32)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["codes", "absmax"],
                   meta_fields=["matrix_shape", "dtype_name", "block_size"])
@dataclasses.dataclass(frozen=True)
class NF4Weight(DerivedWeight):
    """A [..., d_in, d_out] matrix in NF4. codes: uint8 [..., n_blocks * block_size / 2],
    absmax: float32 [..., n_blocks]; the leading axes (e.g. layers) are sliced like any leaf."""

    codes: jax.Array
    absmax: jax.Array
    matrix_shape: tuple[int, int]
    dtype_name: str
    block_size: int = BLOCK_SIZE

    @property
    def shape(self):
        return (*self.codes.shape[:-1], *self.matrix_shape)

    @property
    def dtype(self):
        return jnp.dtype(self.dtype_name)

    def dense(self):
        lead = self.codes.shape[:-1]
        index = jnp.stack([self.codes >> 4, self.codes & 15], axis=-1).reshape(*lead, -1)
        values = jnp.asarray(nf4_levels())[index.astype(jnp.int32)]
        values = values.reshape(*lead, -1, self.block_size) * self.absmax[..., None]
        n = self.matrix_shape[0] * self.matrix_shape[1]
        return values.reshape(*lead, -1)[..., :n].reshape(self.shape).astype(self.dtype)


def quantize_nf4(w, block_size: int = BLOCK_SIZE) -> NF4Weight:
    """NF4 of each [d_in, d_out] matrix in w [..., d_in, d_out] (blocks never span two matrices)."""
    w = jnp.asarray(w)
    if w.ndim < 2:
        raise ValueError(f"NF4 quantises matrices [..., d_in, d_out], got shape {w.shape}")
    if block_size <= 0 or block_size % 2:
        raise ValueError(f"block_size must be a positive even int, got {block_size}")
    try:  # a NaN would make its whole block NaN, silently (checked where the weights are concrete)
        finite = bool(jnp.isfinite(w).all())
    except jax.errors.ConcretizationTypeError:
        finite = True
    if not finite:
        raise ValueError(f"NF4 quantises finite weights; this {tuple(w.shape)} matrix has NaN or inf values")
    codes, absmax = _quantize(w, block_size)
    return NF4Weight(codes, absmax, tuple(w.shape[-2:]), w.dtype.name, block_size)


@functools.partial(jax.jit, static_argnums=1)
def _quantize(w, block_size):
    lead = w.shape[:-2]
    flat = w.astype(F32).reshape(*lead, -1)
    pad = -flat.shape[-1] % block_size
    flat = jnp.pad(flat, [(0, 0)] * len(lead) + [(0, pad)])
    blocks = flat.reshape(*lead, -1, block_size)
    absmax = jnp.max(jnp.abs(blocks), axis=-1)
    scaled = blocks / jnp.where(absmax == 0, 1.0, absmax)[..., None]
    # nearest level: count the midpoints below the value (levels are ascending)
    levels = jnp.asarray(nf4_levels())
    midpoints = (levels[1:] + levels[:-1]) / 2
    index = jnp.sum(scaled[..., None] > midpoints, axis=-1).astype(jnp.uint8)
    index = index.reshape(*lead, -1, 2)
    return (index[..., 0] << 4) | index[..., 1], absmax
