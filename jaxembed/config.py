"""Architecture configs: frozen (hashable, so usable as static jit arguments) dataclasses.

Only architecture lives here. Runtime choices (dtype, chunk size Q at inference, vertical
chunk size V, prompts) are arguments of `embed` / the embedder, not config fields.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar


class ConfigError(ValueError):
    """A config file is missing fields or describes an unsupported model."""


@dataclasses.dataclass(frozen=True)
class Mamba2Config:
    """Mamba2 (SSD) language model, as in mamba_ssm's `Mamba2` block and transformers' `Mamba2Model`.

    Dimension letters used throughout: d = d_model, e = d_inner = expand * d_model,
    h = n_heads, p = head_dim, g = n_groups, n = d_state, k = d_conv.
    """

    architecture: ClassVar[str] = "mamba2"

    vocab_size: int
    d_model: int
    n_layers: int
    d_state: int = 128
    d_conv: int = 4
    expand: int = 2
    head_dim: int = 64
    n_groups: int = 1
    chunk_size: int = 256
    norm_eps: float = 1e-5
    dt_limit: tuple[float, float] = (0.0, math.inf)
    use_bias: bool = False
    use_conv_bias: bool = True
    residual_in_fp32: bool = True
    tie_embeddings: bool = False
    d_has_hdim: bool = False  # mamba_ssm's D_has_hdim: D is [h, p] instead of [h]
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "d_state", "d_conv", "expand", "head_dim", "n_groups",
                     "chunk_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        if len(self.dt_limit) != 2:
            raise ConfigError(f"dt_limit must be (low, high), got {self.dt_limit!r}")
        object.__setattr__(self, "dt_limit", tuple(float(v) for v in self.dt_limit))
        if self.d_inner % self.head_dim:
            raise ConfigError(
                f"d_inner = expand * d_model = {self.d_inner} is not a multiple of head_dim = {self.head_dim}"
            )
        if self.n_heads % self.n_groups:
            raise ConfigError(f"n_heads = {self.n_heads} is not a multiple of n_groups = {self.n_groups}")

    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model

    @property
    def n_heads(self) -> int:
        return self.d_inner // self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels through the causal conv: x, B and C."""
        return self.d_inner + 2 * self.n_groups * self.d_state

    @property
    def d_in_proj(self) -> int:
        """in_proj output: z, xBC, dt."""
        return self.d_inner + self.conv_dim + self.n_heads

    @property
    def hidden_size(self) -> int:
        """Embedding dimension."""
        return self.d_model

    def to_dict(self) -> dict[str, Any]:
        out = {"architecture": self.architecture, **dataclasses.asdict(self)}
        out["dt_limit"] = list(self.dt_limit)
        return out


def config_class(architecture: str) -> type:
    """The config dataclass of an architecture (each model family module defines its `Config`)."""
    from jaxembed import models

    try:
        return models.by_name(architecture).Config
    except ValueError:
        raise ConfigError(f"unknown architecture {architecture!r}; supported: {models.names()}") from None


def config_from_dict(data: dict[str, Any]):
    """Inverse of `to_dict` (the `jaxembed.json` written by the converter)."""
    data = dict(data)
    arch = data.pop("architecture", None)
    cls = config_class(arch) if isinstance(arch, str) else config_class(repr(arch))
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"unknown {arch} config fields: {unknown}")
    # JSON/YAML lists -> tuples: configs are hashable (static jit arguments)
    data = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
    try:
        return cls(**data)
    except TypeError as err:  # missing required fields
        raise ConfigError(f"incomplete {arch} config: {err}") from None


def load_config(path):
    """An architecture config from a YAML file (see configs/models/)."""
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of config fields")
    return config_from_dict(data)
