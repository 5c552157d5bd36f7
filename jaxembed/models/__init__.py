"""Model families. Each module supplies the same few functions, which is all the scheduler uses:

    init_state(cfg, batch) -> State                      one layer's zero state (a NamedTuple)
    layer(cfg, params_l, x, state_l, *, chunk_size)      -> (x, state_l), continuing from state_l
    embed_tokens(cfg, params, ids), final_norm(cfg, params, x), param_shapes(cfg), init_params(cfg, key)
"""

from __future__ import annotations

from types import ModuleType

from jaxembed.models import mamba2

_FAMILIES: dict[str, ModuleType] = {"mamba2": mamba2}


def family(cfg) -> ModuleType:
    """The module implementing `cfg`'s architecture."""
    try:
        return _FAMILIES[cfg.architecture]
    except KeyError:
        raise ValueError(f"no model family for architecture {cfg.architecture!r}") from None
