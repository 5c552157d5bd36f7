"""LoRA adapters (Hu et al., 2022) on a model's linear layers, as a params-pytree transform.

    adapters = init_adapters(config, params, LoraConfig(rank=16, alpha=16), key)
    adapted = apply(params, adapters, lora, config)  # LoraWeight leaves where the targets were
    jaxembed.embed(adapted, config, ids, lengths)    # the models multiply through them
    dense = merge(params, adapters, lora, config)    # for export: W + (alpha / r) A B

adapters = {"layers": {name: {"a": [n_layers, d_in, r], "b": [n_layers, r, d_out]}}}: the
trainable leaves, one per target or per fused group of targets (`adapter_groups`: Mamba2's in_proj
over z_proj and xbcdt_proj, B's columns split between them). A starts uniform in +-1/sqrt(d_in)
(PEFT's kaiming-uniform) and B at zero, so the adapted model starts as the base model. The base
may be NF4 (`quant.quantize_nf4`).

`modules_to_save` (PEFT's name) trains whole params beside the adapters, e.g. the token embedding
of a model trained from random init, where frozen random token vectors leave LoRA little to work
with. They live in adapters["saved"] = {"embedding": [V, d], "layers": {"A_log": [L, h]}, ...} as
float32 masters, cast to the stored dtype when applied, and replace the stored params on merge.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jaxembed import models
from jaxembed.errors import check_positive_int
from jaxembed.weights import DerivedWeight, densify, dot, dot_stacked, dot_sum

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    rank: int = 16
    alpha: float = 16.0
    targets: tuple[str, ...] | str = "all"  # "all": the family's LINEAR_PARAMS
    modules_to_save: tuple[str, ...] = ()  # params trained in full: top-level names or names under "layers"

    def __post_init__(self):
        check_positive_int("lora rank", self.rank)
        if not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool) or not 0 < self.alpha < math.inf:
            raise ValueError(f"lora alpha must be a positive, finite number, got {self.alpha!r}")
        if isinstance(self.targets, (list, tuple)):
            targets = tuple(self.targets)
            object.__setattr__(self, "targets", "all" if targets == ("all",) else targets)
        if isinstance(self.modules_to_save, str) or not all(isinstance(n, str) for n in self.modules_to_save):
            raise ValueError(f"lora modules_to_save must be a list of param names, got {self.modules_to_save!r}")
        object.__setattr__(self, "modules_to_save", tuple(self.modules_to_save))

    @property
    def scale(self) -> float:
        return float(self.alpha) / self.rank

    def target_names(self, config) -> tuple[str, ...]:
        linear_params = models.family(config).LINEAR_PARAMS
        if self.targets == "all":
            return tuple(linear_params)
        targets = _split_fused(config, self.targets)
        unknown = sorted(set(targets) - set(linear_params))
        if not targets and self.modules_to_save:
            return ()  # no adapters: the params in modules_to_save train in full (see `full`)
        if unknown or not targets:
            fused = list(getattr(models.family(config), "FUSED_PARAMS", {}))
            raise ValueError(f"lora targets {unknown or '[]'} are not linear layers of {config.architecture}; "
                             f"choose from {list(linear_params) + fused} or 'all'")
        return targets

    @classmethod
    def full(cls, params) -> LoraConfig:
        """Full-parameter training (`lora: null`): no adapters, every param a float32 master but an untied
        `lm_head`, which no embedding reads (weight decay alone would shrink it, every logit with it)."""
        names = [k for k in params if k not in ("layers", "lm_head")] + list(params["layers"])
        return cls(rank=1, alpha=1.0, targets=(), modules_to_save=tuple(names))

    def saved_paths(self, config, params) -> tuple[tuple[str, ...], ...]:
        """modules_to_save as paths into params: ("embedding",) or ("layers", "A_log")."""
        paths = []
        targets = set(self.target_names(config))
        for written in self.modules_to_save:
            for name in _split_fused(config, (written,)):
                if name in targets:
                    part = f" ({written!r} is {name!r} and more)" if name != written else ""
                    raise ValueError(f"lora modules_to_save: {name!r}{part} is also a LoRA target; train it one way")
                paths.append(self._path(config, params, name))
        return tuple(dict.fromkeys(paths))

    @staticmethod
    def _path(config, params, name) -> tuple[str, ...]:
        if name != "layers" and name in params:
            return (name,)
        if name in params["layers"]:
            return ("layers", name)
        known = sorted([k for k in params if k != "layers"] + list(params["layers"]))
        raise ValueError(f"lora modules_to_save: {config.architecture} has no param {name!r}; choose from {known}")


def _split_fused(config, names) -> tuple[str, ...]:
    """Names as the params they are here: a checkpoint's fused matrix that this family keeps as
    several params (`FUSED_PARAMS`: Mamba2's in_proj, as PEFT configs name it) stands for all of them."""
    fused = getattr(models.family(config), "FUSED_PARAMS", {})
    return tuple(dict.fromkeys(part for name in names for part in fused.get(name, (name,))))


@functools.partial(jax.tree_util.register_dataclass, data_fields=["base", "a", "b"],
                   meta_fields=["scale", "adapter"])
@dataclasses.dataclass(frozen=True)
class LoraWeight(DerivedWeight):
    """base + scale * a @ b, with base [..., d_in, d_out] an array or an NF4Weight."""

    base: jax.Array | DerivedWeight
    a: jax.Array  # [..., d_in, r] float32
    b: jax.Array  # [..., r, d_out] float32
    scale: float
    adapter: str | None = None  # the adapter's name: a fused group's parts share its A (`adapter_groups`)

    @property
    def shape(self):
        return tuple(self.base.shape)

    @property
    def dtype(self):
        return self.base.dtype

    def dense(self):
        base = densify(self.base)
        return (base.astype(F32) + self.scale * jnp.matmul(self.a, self.b)).astype(base.dtype)

    def matmul(self, x, compute_dtype, out_dtype=F32):
        """x W + s (x A) B as one GEMM, [x | s x A] @ [W ; B] (`weights.dot_sum`), accumulated in
        float32 and written once in out_dtype; under autodiff the cotangent stays in compute_dtype."""
        down = self.scale * dot(x, self.a, compute_dtype)
        return dot_sum(x, densify(self.base), down, self.b, compute_dtype, out_dtype)

    def matmul_stacked(self, xy, compute_dtype, out_dtype=F32):
        """The same product from xy = [x | s x A] as the adapter's norm wrote it
        (`weights.normed_input`)."""
        return dot_stacked(xy, densify(self.base), self.b, compute_dtype, out_dtype)


def adapter_groups(config, lora: LoraConfig) -> dict[str, tuple[str, ...]]:
    """{adapter name: the target matrices it adapts}. A checkpoint's fused matrix whose parts are all
    targets (Mamba2's in_proj: z_proj and xbcdt_proj) gets one adapter, A shared and B's columns
    split between the parts: PEFT's rank-r adapter on the fused matrix, not one per part."""
    targets = lora.target_names(config)
    fused = {f: parts for f, parts in getattr(models.family(config), "FUSED_PARAMS", {}).items()
             if set(parts) <= set(targets)}
    groups = {}
    for name in targets:  # in the targets' order, a group where its first part is
        group = next((f for f, parts in fused.items() if name in parts), None)
        groups.setdefault(group or name, fused[group] if group else (name,))
    return groups


def init_adapters(config, params, lora: LoraConfig, key) -> dict:
    """Fresh float32 adapters: A [.., d_in, r] uniform in ±1/√d_in, B [.., r, d_out] zero, one per
    adapter group (`adapter_groups`; d_out the group's summed widths)."""
    layers = params["layers"]
    out = {}
    groups = adapter_groups(config, lora)
    for (name, parts), key_n in zip(groups.items(), jax.random.split(key, len(groups)), strict=True):
        *lead, d_in, _ = layers[parts[0]].shape
        d_out = sum(layers[part].shape[-1] for part in parts)
        bound = d_in ** -0.5
        out[name] = {
            "a": jax.random.uniform(key_n, (*lead, d_in, lora.rank), F32, -bound, bound),
            "b": jnp.zeros((*lead, lora.rank, d_out), F32),
        }
    saved = {}
    for path in lora.saved_paths(config, params):
        leaf = params
        for key_p in path:
            leaf = leaf[key_p]
        _set(saved, path, densify(leaf).astype(F32))
    return {"layers": out, "saved": saved} if saved else {"layers": out}


def _set(tree: dict, path, value):
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def apply(params, adapters, lora: LoraConfig, config):
    """params with each adapted matrix replaced by a LoraWeight (the models multiply through it)."""
    layers = dict(params["layers"])
    groups = adapter_groups(config, lora) if adapters["layers"] else {}
    for name, ab in adapters["layers"].items():
        start = 0  # a fused group's parts each take their columns of B
        for part in groups[name]:
            width = layers[part].shape[-1]
            layers[part] = LoraWeight(layers[part], ab["a"], ab["b"][..., start:start + width], lora.scale, name)
            start += width
    params = {**params, "layers": layers}
    saved = adapters.get("saved", {})
    for name, value in saved.get("layers", {}).items():
        layers[name] = value.astype(layers[name].dtype)
    for name, value in saved.items():
        if name != "layers":
            params[name] = value.astype(params[name].dtype)
    return params


def merge(params, adapters, lora: LoraConfig, config):
    """Dense params with the adapters folded in (NF4 bases dequantised): what `jaxembed.load` reads."""
    return densify(apply(params, adapters, lora, config))


def merge_rounding(params, adapters, lora: LoraConfig, config) -> dict[str, float]:
    """For each adapted matrix stored below float32: the share of its update s A B that casting the merged
    float32 sum back to the stored dtype loses, |round(W + s A B) - (W + s A B)| / |s A B| (bfloat16 keeps
    8 bits of W: an update much smaller than W is mostly rounded away)."""
    out = {}
    for name, leaf in apply(params, adapters, lora, config)["layers"].items():
        if not isinstance(leaf, LoraWeight) or jnp.dtype(leaf.dtype) == F32:
            continue
        update = leaf.scale * jnp.matmul(leaf.a, leaf.b, precision="highest")
        exact = densify(leaf.base).astype(F32) + update
        norm = float(jnp.linalg.norm(update))
        if norm > 0:
            out[name] = float(jnp.linalg.norm(exact.astype(leaf.dtype).astype(F32) - exact)) / norm
    return out


def quantize_base(config, params, names=None, block_size: int | None = None):
    """params with the family's linear layer matrices (or `names`) in NF4."""
    from jaxembed.train.quant import BLOCK_SIZE, quantize_nf4

    names = models.family(config).LINEAR_PARAMS if names is None else names
    layers = dict(params["layers"])
    for name in names:
        layers[name] = quantize_nf4(layers[name], block_size or BLOCK_SIZE)
    return {**params, "layers": layers}
