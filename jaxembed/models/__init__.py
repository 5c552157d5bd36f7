"""Model families and their contract.

A family is a module that provides everything in `Family` below, which is all the scheduler,
the embedder, the converter, the trainer and the benchmarks use. Every family states every
member (no defaults read by `getattr`); `by_name` checks that on import.

Adding a family: one model module here (the members below; its `Config` dataclass with
`architecture`), one conversion table in `jaxembed/convert/`, one entry in `_FAMILIES` naming
both (and its chunked operator, whose kernel tiles are `kernels.common`'s), and a parity test
against a reference this project did not write (docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType
from typing import Any, ClassVar, Protocol

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Registration:
    model: str  # the model module (the Family contract)
    conversion: str  # its checkpoint layouts: detect(dir), rules_for(cfg), reference(checkpoint), ...
    operator: str | None  # its chunked operator in `jaxembed.kernels` (tiles: kernels.common.heuristic)


# The one registry of families: model, conversion layouts and chunked operator.
_FAMILIES: dict[str, Registration] = {
    "mamba2": Registration("jaxembed.models.mamba2", "jaxembed.convert.mamba2", "ssd"),
    "rwkv7": Registration("jaxembed.models.rwkv7", "jaxembed.convert.rwkv7", "wkv7"),
    "xlstm": Registration("jaxembed.models.xlstm", "jaxembed.convert.xlstm", "mlstm"),
    # Mistral / Qwen2 baselines (attention: horizontal only)
    "transformer": Registration("jaxembed.models.transformer", "jaxembed.convert.transformer", None),
}


class Family(Protocol):
    """The members of a family module (shapes: b batch, t time, d model width)."""

    Config: ClassVar[type]  # frozen, hashable config dataclass with `architecture`, `chunk_size`, `hidden_size`
    VERTICAL: ClassVar[bool]  # False where there is no constant-size state (attention): horizontal only
    # State fields that `layer` takes as an `ops.common.StateSlot` (its entry in the stack of every
    # layer's state) when the scheduler carries states, and returns updated in place; the others it
    # takes and returns as this layer's arrays.
    STATES_IN_PLACE: ClassVar[tuple[str, ...]]
    FLOAT32_PARAMS: ClassVar[tuple[str, ...]]  # leaf names kept float32 when the model is cast (decays)
    LINEAR_PARAMS: ClassVar[tuple[str, ...]]  # layer matrices used as x @ W [d_in, d_out] (LoRA / NF4 targets)

    def param_shapes(self, cfg) -> dict: ...  # every param's shape; layer leaves have a leading [n_layers]
    def init_params(self, cfg, key, dtype=...) -> dict: ...
    def init_state(self, cfg, batch: int) -> Any: ...  # one layer's zero state (a NamedTuple)

    def layer(self, cfg, params_l: dict, stream, state_l, *, runtime, index) -> tuple[Any, Any]:
        """One layer on the stream, continuing from state_l for any number of tokens; runtime is the
        `jaxembed.runtime.Runtime` (Q, kernels backend, remat), index the layer number."""

    def embed_tokens(self, cfg, params: dict, ids) -> Any: ...  # ids [b, t] -> the stream
    def hidden(self, stream) -> Any: ...  # the residual [b, t, d] inside what is carried between layers
    def final_norm(self, cfg, params: dict, x) -> Any: ...  # [.., d] -> [.., d] float32
    def logits(self, cfg, params: dict, hidden) -> Any: ...  # [.., d] -> [.., vocab] float32


_MEMBERS = ("Config", "VERTICAL", "STATES_IN_PLACE", "FLOAT32_PARAMS", "LINEAR_PARAMS", "param_shapes", "init_params",
            "init_state", "layer", "embed_tokens", "hidden", "final_norm", "logits")


def names() -> list[str]:
    return sorted(_FAMILIES)


def by_name(architecture: str) -> ModuleType:
    """The module implementing `architecture` (imported on first use), checked against `Family`."""
    try:
        module = importlib.import_module(_FAMILIES[architecture].model)
    except KeyError:
        raise ValueError(f"no model family for architecture {architecture!r}; supported: {names()}") from None
    missing = [m for m in _MEMBERS if not hasattr(module, m)]
    if missing:
        raise TypeError(f"model family {module.__name__} lacks {missing} of the family contract "
                        "(jaxembed.models.Family)")
    return module


def registration(architecture: str) -> Registration:
    if architecture not in _FAMILIES:
        raise ValueError(f"no model family for architecture {architecture!r}; supported: {names()}")
    return _FAMILIES[architecture]


def conversion_layouts() -> list[ModuleType]:
    """Every family's conversion module, in registry order (the converter tries each one's detect)."""
    return [importlib.import_module(r.conversion) for r in _FAMILIES.values()]


def family(cfg) -> ModuleType:
    """The module implementing `cfg`'s architecture."""
    return by_name(cfg.architecture)


def param_dtype(module: ModuleType, name: str, source_dtype, dtype=None) -> np.dtype:
    """The one casting rule (the embedder, the converter, the trainer and the benchmarks follow it):
    a param leaf called `name` of `source_dtype`, cast to `dtype`, becomes: itself if it is not
    floating; float32 if it is one of the family's FLOAT32_PARAMS (decays, whose precision the
    long recurrences need); else `dtype` (None: as stored)."""
    source_dtype = np.dtype(source_dtype)
    if not jnp.issubdtype(source_dtype, jnp.floating):  # jnp's: bfloat16 is floating too
        return source_dtype
    if name in module.FLOAT32_PARAMS:
        return np.dtype(np.float32)
    return source_dtype if dtype is None else np.dtype(dtype)


def cast_params(module: ModuleType, params, dtype=None):
    """Params as jax arrays cast by `param_dtype`; dtype None keeps them as stored, except that
    float16 (which overflows in long recurrences) runs in float32."""
    import jax

    if dtype is not None:
        dtype = jnp.dtype(dtype)
        if dtype not in (jnp.float32, jnp.bfloat16):
            raise ValueError(f"dtype must be float32 or bfloat16, got {dtype}")

    def cast(path, leaf):
        arr = jnp.asarray(leaf)
        return arr.astype(_cast_dtype(module, str(getattr(path[-1], "key", "")), arr.dtype, dtype))

    return jax.tree_util.tree_map_with_path(cast, params)


def cast_host_param(module: ModuleType, name: str, leaf, dtype=None) -> np.ndarray:
    """One top-level param cast as `cast_params` casts it, in host memory (numpy; ml_dtypes' bfloat16
    rounds to nearest even, as XLA does)."""
    arr = np.asarray(leaf)
    return arr.astype(_cast_dtype(module, name, arr.dtype, None if dtype is None else jnp.dtype(dtype)))


def _cast_dtype(module: ModuleType, name: str, source_dtype, dtype) -> np.dtype:
    if dtype is None and source_dtype == jnp.float16:
        return np.dtype(np.float32)
    return param_dtype(module, name, source_dtype, dtype)


def hidden(cfg, stream):
    """The residual stream [b, t, d] inside whatever the family carries between layers."""
    return family(cfg).hidden(stream)
