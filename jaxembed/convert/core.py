"""Declarative conversion: a table of (params path, checkpoint key, hook) rules, applied
against the model's shape template (and in reverse by `jaxembed export`, convert/export.py).

Every tensor is checked before any is loaded: the error lists all missing, unexpected and
misshaped keys at once. Tensors are read one at a time into arrays stacked on a leading
layer axis, one params leaf at a time.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from tqdm import tqdm

from jaxembed.convert.sources import FLOAT_DTYPES, ConversionError, TensorSource


@dataclasses.dataclass(frozen=True)
class Hook:
    """A named, shape-aware transform from the checkpoint layout to ours, and back.

    `invert` (ours -> the checkpoint layout) is what `jaxembed export` runs; None where the
    transform cannot be undone, which the exporter reports by the hook's name. A hook that reads a
    slice of a fused checkpoint tensor names it in `rows`: (start, size, total) along the tensor's
    first axis; its inverse gives that slice, and the exporter puts the slices of one key together.
    """

    name: str
    shape: Callable[[tuple[int, ...]], tuple[int, ...]]
    apply: Callable[[np.ndarray], np.ndarray]
    invert: Callable[[np.ndarray], np.ndarray] | None = None
    rows: tuple[int, int, int] | None = None


IDENTITY = Hook("identity", lambda s: s, lambda a: a, lambda a: a)
# torch Linear weights are [out, in]; we multiply x @ W with W [in, out]
TRANSPOSE = Hook("transpose", lambda s: s[::-1], lambda a: np.ascontiguousarray(a.T),
                 lambda a: np.ascontiguousarray(a.T))
# torch depthwise Conv1d weight [channels, 1, k] -> [k, channels]
CONV1D_DEPTHWISE = Hook(
    "conv1d_depthwise",
    lambda s: (s[2], s[0]) if len(s) == 3 and s[1] == 1 else ("not [channels, 1, k]:", *s),
    lambda a: np.ascontiguousarray(a[:, 0, :].T),
    lambda a: np.ascontiguousarray(a.T[:, None, :]),
)


def fused_rows(fused: str, part: str, start: int, size: int, total: int, *, weight: bool) -> Hook:
    """Rows [start, start+size) of a fused torch Linear's weight [total, d] (transposed to [d, size])
    or bias [total]; the exporter puts a key's parts back together by their `rows`."""
    if weight:
        return Hook(
            f"{fused}[{start}:{start + size}]ᵀ ({part})",
            lambda s: (s[1], size) if len(s) == 2 and s[0] == total else (f"not [{total}, d]:", *s),
            lambda a: a[start : start + size].T.copy(),
            lambda a: np.ascontiguousarray(a.T),
            rows=(start, size, total),
        )
    return Hook(
        f"{fused}[{start}:{start + size}] ({part})",
        lambda s: (size,) if tuple(s) == (total,) else (f"not [{total}]:", *s),
        lambda a: a[start : start + size].copy(),
        lambda a: a,
        rows=(start, size, total),
    )


@dataclasses.dataclass(frozen=True)
class Rule:
    """params[path] <- hook(checkpoint[key]); `{i}` in key is the layer index for stacked layer params."""

    path: str
    key: str
    hook: Hook = IDENTITY
    optional: bool = False  # absent from some checkpoints on purpose (a base model has no lm_head)

    @property
    def stacked(self) -> bool:
        return "{i}" in self.key


@dataclasses.dataclass(frozen=True)
class ExportLayout:
    """How `jaxembed export` writes a family's checkpoint: which rules it runs in reverse (one per
    params path), the key each rule's (normalised) key is written under, and the config file."""

    name: str  # in messages, e.g. "transformers Mamba2ForCausalLM"
    rules: list[Rule]
    key: Callable[[str], str | None]  # normalised key -> written key; None: the layout has no such tensor
    write_config: Callable[[object], None]  # writes config.json into the given directory
    # config fields the export decides even where the source said otherwise (else the source's are written back)
    owned: tuple[str, ...] = ()


def _leaf(tree: Mapping, path: str):
    for part in path.split("/"):
        if not isinstance(tree, Mapping) or part not in tree:
            return None
        tree = tree[part]
    return tree


def _set(tree: dict, path: str, value) -> None:
    *parents, last = path.split("/")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[last] = value


def normalise_keys(keys, renames: list[tuple[str, str]]) -> dict[str, str]:
    """normalised key -> raw key, applying regex renames in order. Two raw keys landing on one name is an error."""
    out: dict[str, str] = {}
    for raw in keys:
        name = raw
        for pattern, replacement in renames:
            name = re.sub(pattern, replacement, name)
        if name in out:
            raise ConversionError(f"checkpoint keys {out[name]!r} and {raw!r} both map to {name!r}")
        out[name] = raw
    return out


def convert_tensors(
    source: TensorSource,
    rules: list[Rule],
    shapes: Mapping,
    n_layers: int,
    *,
    renames: list[tuple[str, str]],
    ignore: list[str] = (),
    dtype_for: Callable[[str, np.dtype], np.dtype],
    progress: bool = False,
    zero_filled: tuple[str, ...] = (),
) -> dict:
    """Apply `rules` to `source`, checked against `shapes` (the params shape template).

    Rules whose path is not in the template are inactive (an untied lm_head, absent biases);
    keys matching `ignore` (regexes on normalised keys) are dropped on purpose. `zero_filled`: stacked
    params whose layers without a tensor are zeros by design (RWKV7's value residual in layer 0), made
    zeros also when no layer has one.
    """
    names = normalise_keys(source.keys(), renames)
    active = [r for r in rules if _leaf(shapes, r.path) is not None]
    plan: list[tuple[Rule, int | None, str]] = []  # (rule, layer index, raw key)
    missing, misshaped, not_float, matched = [], [], [], set()
    for rule in active:
        expected = tuple(_leaf(shapes, rule.path))
        per_key = expected[1:] if rule.stacked else expected
        for i in range(n_layers) if rule.stacked else [None]:
            key = rule.key.format(i=i)
            if key not in names:
                if not rule.optional and key not in missing:  # two rules may read one key (a split tensor)
                    missing.append(key)
                continue
            raw = names[key]
            matched.add(raw)
            got = tuple(rule.hook.shape(source.shape(raw)))
            if got != per_key:
                misshaped.append(f"{raw}: shape {source.shape(raw)} ({rule.hook.name} -> {got}), expected {per_key}")
                continue
            if source.dtype(raw) not in FLOAT_DTYPES:  # weights are real numbers: an int tensor is not the model's
                not_float.append(f"{raw}: dtype {source.dtype(raw)}, expected a float type ({', '.join(FLOAT_DTYPES)})")
                continue
            plan.append((rule, i, raw))
    unexpected = [
        raw for name, raw in names.items() if raw not in matched and not any(re.fullmatch(p, name) for p in ignore)
    ]
    if missing or unexpected or misshaped or not_float:
        lines = []
        for title, items in (("missing", missing), ("unexpected", unexpected), ("misshaped", misshaped),
                             ("non-float", not_float)):
            if items:
                shown = items[:20] + ([f"... and {len(items) - 20} more"] if len(items) > 20 else [])
                lines.append(f"{len(items)} {title} key(s):\n    " + "\n    ".join(shown))
        held = _layers_held(names, active)
        if held and held != set(range(n_layers)):  # the usual cause of a long list: a layer count edited
            lines.insert(0, f"the config has {n_layers} layer{'s' * (n_layers != 1)}, the weights hold layer(s) "
                            f"{_ranges(sorted(held))} ({len(held)})")
        raise ConversionError("checkpoint does not match the model:\n  " + "\n  ".join(lines))

    # One leaf at a time: each layer's tensor is written in place into a device buffer (donated,
    # so never copied), and the next tensor is read only after. Peak memory is the converted
    # params plus one tensor, never two copies of the model (orbax would copy NumPy leaves on save).
    by_rule: dict[Rule, list[tuple[int | None, str]]] = {}
    for rule, i, raw in plan:
        by_rule.setdefault(rule, []).append((i, raw))
    params: dict = {}
    with tqdm(total=len(plan), desc="converting", unit="tensor", disable=not progress) as bar:
        for rule, tensors in by_rule.items():
            leaf = None
            for i, raw in tensors:
                array = rule.hook.apply(source.get(raw))
                dtype = dtype_for(rule.path, array.dtype)
                if not rule.stacked:
                    leaf = jax.device_put(np.asarray(array, dtype))
                else:
                    if leaf is None:
                        leaf = jnp.zeros(_leaf(shapes, rule.path), dtype)
                    leaf = _write_layer(leaf, np.asarray(array, dtype), i)
                bar.update(1)
            _set(params, rule.path, leaf)
    for path in zero_filled:
        if _leaf(shapes, path) is not None and _leaf(params, path) is None:
            _set(params, path, jnp.zeros(_leaf(shapes, path), dtype_for(path, np.dtype(np.float32))))
    return params


def _layers_held(names: Mapping[str, str], rules: list[Rule]) -> set[int]:
    """The layer indices the checkpoint's (normalised) keys hold, read through the stacked rules' keys."""
    patterns = [re.compile(re.escape(r.key).replace(re.escape("{i}"), r"(\d+)")) for r in rules if r.stacked]
    return {int(m.group(1)) for name in names for pattern in patterns if (m := pattern.fullmatch(name))}


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


@partial(jax.jit, donate_argnums=0)
def _write_layer(stacked, layer, i):
    return lax.dynamic_update_index_in_dim(stacked, layer, i, 0)
