"""Model families. Each module supplies the same few functions, which is all the scheduler uses:

    Config                                               its frozen config dataclass
    init_state(cfg, batch) -> State                      one layer's zero state (a NamedTuple)
    layer(cfg, params_l, stream, state_l, *, chunk_size, index) -> (stream, state_l),
                                                         continuing from state_l; index is the layer number
    embed_tokens(cfg, params, ids) -> stream, final_norm(cfg, params, hidden),
    param_shapes(cfg), init_params(cfg, key), FLOAT32_PARAMS, LINEAR_PARAMS (the x @ W layer matrices)

`VERTICAL = False` where a family has no constant-size state (attention): it runs horizontally only.
And optionally `hidden(stream)`: the residual stream [b, t, d] when a family carries more than
that between layers (RWKV7 carries the first layer's values too); default: the stream itself.
"""

from __future__ import annotations

import importlib
from types import ModuleType

_FAMILIES: dict[str, str] = {
    "mamba2": "jaxembed.models.mamba2",
    "rwkv7": "jaxembed.models.rwkv7",
    "xlstm": "jaxembed.models.xlstm",
    "transformer": "jaxembed.models.transformer",  # Mistral / Qwen2 baselines (horizontal only)
}


def names() -> list[str]:
    return sorted(_FAMILIES)


def by_name(architecture: str) -> ModuleType:
    """The module implementing `architecture` (imported on first use)."""
    try:
        return importlib.import_module(_FAMILIES[architecture])
    except KeyError:
        raise ValueError(f"no model family for architecture {architecture!r}; supported: {names()}") from None


def family(cfg) -> ModuleType:
    """The module implementing `cfg`'s architecture."""
    return by_name(cfg.architecture)


def hidden(cfg, stream):
    """The residual stream [b, t, d] inside whatever the family carries between layers."""
    return getattr(family(cfg), "hidden", lambda s: s)(stream)
