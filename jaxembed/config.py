"""Loading architecture configs. Each family's config class (a frozen, hashable dataclass: a
static jit argument) lives in its model module (`jaxembed.models.<family>.Config`).

Only architecture is in a config. Runtime choices (dtype, chunk size Q at inference, vertical
chunk size V, prompts) are arguments of `embed` / the embedder, not config fields.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxembed.errors import ConfigError


def __getattr__(name: str):
    if name == "Mamba2Config":  # its home is models/mamba2.py; kept importable from here
        from jaxembed.models.mamba2 import Mamba2Config

        return Mamba2Config
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
