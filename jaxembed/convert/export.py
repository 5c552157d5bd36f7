"""jaxembed models -> the source layout transformers (or fla) reads, through the conversion tables in reverse.

    jaxembed export MODEL DST --format hf [--dtype float32|bfloat16] [--overwrite]

MODEL is a jaxembed directory (`jaxembed convert`, the trainer's export: adapters merged). DST gets
safetensors (sharded past `max_shard_bytes`, with transformers' index), config.json and MODEL's
tokenizer files. Each family's conversion module supplies `export_layout(cfg, lm_head=, dtype=)`: the
rules to run backwards (`Hook.invert`; a stacked leaf becomes one key per layer), the key each is
written under, and the config writer. Every written tensor is converted forward again and compared
with the param it came from, and every written key must normalise (the family's RENAMES) back to its
rule's key, so what is written is what `jaxembed convert` reads back into the same params.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path

import numpy as np

from jaxembed import checkpoint, models
from jaxembed.convert.core import Rule, _leaf, normalise_keys
from jaxembed.errors import ConversionError

FORMATS = ("hf",)
DTYPES = ("float32", "bfloat16")
MAX_SHARD_BYTES = 5 * 2**30  # transformers' usual shard size


@dataclasses.dataclass
class _Tensor:
    key: str  # as written
    parts: list[tuple[Rule, int | None]]  # (rule, layer) whose inverses make it, in rows order
    nbytes: int


def export(model, dst, *, format: str = "hf", dtype: str | None = None, overwrite: bool = False,
           max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write the jaxembed model directory `model` to `dst` in its family's source layout (format "hf":
    transformers' for Mamba2 and xLSTM, fla-hub's for RWKV7). Atomic: a temporary sibling renamed into
    place; an existing `dst` is replaced only with `overwrite`, and only if it is empty or a model
    directory (config.json + safetensors) holding nothing an export does not write. dtype: cast float
    weights (the family's FLOAT32_PARAMS stay float32, as jaxembed keeps them); None writes them as stored."""
    if format not in FORMATS:
        raise ConversionError(f"unknown export format {format!r}; supported: {', '.join(FORMATS)}")
    if dtype is not None and dtype not in DTYPES:
        raise ConversionError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    src = Path(model).expanduser()
    if not src.is_dir() or not checkpoint.is_converted(src):
        what = "no such directory" if not src.exists() else "not a directory" if not src.is_dir() else (
            f"not a jaxembed model directory (no {checkpoint.MANIFEST})")
        raise ConversionError(f"{model}: {what}; `jaxembed export` reads what `jaxembed convert` or the trainer's "
                              "export wrote")
    dst = _check_destination(Path(dst).expanduser(), src, overwrite)
    config, params, settings, _ = checkpoint.load(src)
    layouts = importlib.import_module(models.registration(config.architecture).conversion)
    if not hasattr(layouts, "export_layout"):
        raise ConversionError(f"{src}: no {format} export for {config.architecture} models yet")
    family = models.family(config)
    params = _host_params(family, params, dtype)
    written_dtype = _main_dtype(family, params)
    layout = layouts.export_layout(config, lm_head="lm_head" in params, dtype=written_dtype)
    tensors = _plan(params, layout, config.n_layers, layouts.RENAMES)

    dst.parent.mkdir(parents=True, exist_ok=True)
    checkpoint._clear_stale_temporaries(dst)
    tmp = checkpoint.temporary_sibling(dst)
    try:
        _write_tensors(tmp, tensors, params, max_shard_bytes)
        layout.write_config(tmp)
        _carry_source_fields(tmp, checkpoint.source_config_of(src), config, owned=layout.owned)
        if settings:  # the query template and default instruction: `jaxembed convert` of the export reads them back
            text = json.dumps({k: settings[k] for k in checkpoint.EMBEDDER_SETTINGS if k in settings}, indent=1)
            (tmp / checkpoint.EMBEDDER_SETTINGS_FILE).write_text(text + "\n", encoding="utf-8")
        if not checkpoint.copy_tokenizer(src, tmp):
            warnings.warn(f"{src} has no tokenizer files; the export has none either", stacklevel=2)
        checkpoint._fsync_tree(tmp)
        checkpoint._swap_into_place(tmp, dst)
        checkpoint._fsync_path(dst.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dst


# written from the export itself, whatever the source said: its classes, dtype and version; and the head, which
# xLSTM's reader ignores (its lm_head is always its own tensor)
_EXPORT_OWNED = ("architectures", "dtype", "torch_dtype", "transformers_version", "tie_word_embeddings")


def _carry_source_fields(directory: Path, source: dict | None, config, *, owned=()) -> list[str]:
    """Put back into directory/config.json the source config's fields that jaxembed does not model (a
    Mistral's bos_token_id and max_position_embeddings, a second EOS id, fla-only fields), so the export's
    config is its source's; the keys carried. A field is carried only if the config still reads back to
    `config` with it: a field jaxembed does model (the head count, a trained vocabulary) is the export's, and
    so are `_EXPORT_OWNED` and the layout's `owned` fields."""
    from jaxembed.convert import detect

    path = directory / "config.json"
    written = json.loads(path.read_text(encoding="utf-8"))
    if not source or source.get("model_type") != written.get("model_type"):
        return []  # another layout (mamba_ssm, Codestral, BlinkDL), or none: its fields mean nothing here
    carried: dict = {}
    for key, value in source.items():
        if key in _EXPORT_OWNED or key in owned or written.get(key, object()) == value:
            continue
        path.write_text(json.dumps({**written, **carried, key: value}, indent=2) + "\n", encoding="utf-8")
        try:
            same = detect(directory)[2] == config
        except ConversionError:
            same = False
        if same:
            carried[key] = value
    path.write_text(json.dumps({**written, **carried}, indent=2) + "\n", encoding="utf-8")
    if detect(directory)[2] != config:  # each field kept it; together they must too
        raise ConversionError(f"{directory}: the source config's fields {sorted(carried)} change the model read "
                              "back; this is a bug in jaxembed export")
    return sorted(carried)


def _check_destination(dst: Path, src: Path, overwrite: bool) -> Path:
    """Refuse, before any work, a destination that must not be replaced."""
    dst = dst.resolve()  # a symlink's target is what gets replaced
    if dst.exists() and not dst.is_dir():
        raise ConversionError(f"{dst}: exists and is not a directory")
    if dst == src.resolve() or dst in src.resolve().parents or src.resolve() in dst.parents:
        # inside it, the export's files would be the model's own (params/ is checked against its manifest)
        raise ConversionError(f"{dst}: the output directory must not be the model directory, hold it or be in it")
    if dst.is_dir() and any(dst.iterdir()):
        if not _is_model_dir(dst):
            raise ConversionError(f"{dst}: not empty and not a model directory (config.json + safetensors); "
                                  "refusing to replace it (choose a new or empty directory)")
        if not overwrite:
            raise ConversionError(f"{dst}: a model is already there; pass --overwrite to replace it")
        # the swap replaces the whole directory: anything an export would not write back would be lost
        foreign = sorted(p.name + ("/" if p.is_dir() else "") for p in dst.iterdir() if not _export_file(p))
        if foreign:
            shown = ", ".join(foreign[:8]) + (f" and {len(foreign) - 8} more" if len(foreign) > 8 else "")
            raise ConversionError(f"{dst}: --overwrite replaces the whole directory, and it holds files an export "
                                  f"does not write: {shown}; move them or choose another directory")
    return dst


def _export_file(path: Path) -> bool:
    """A file `export` writes (weights, index, config, tokenizer), so replacing it loses nothing."""
    return path.is_file() and (path.name in ("config.json", "model.safetensors", "model.safetensors.index.json",
                                             checkpoint.EMBEDDER_SETTINGS_FILE, *checkpoint.TOKENIZER_FILES)
                               or re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", path.name) is not None)


def _is_model_dir(directory: Path) -> bool:
    return (directory / "config.json").exists() and (
        (directory / "model.safetensors").exists() or (directory / "model.safetensors.index.json").exists())


def _host_params(family, params, dtype):
    """Params as numpy arrays, cast by the one casting rule (models.param_dtype)."""
    import jax

    def cast(path, leaf):
        arr = np.asarray(leaf)
        return arr.astype(models.param_dtype(family, str(getattr(path[-1], "key", "")), arr.dtype, dtype), copy=False)

    return jax.tree_util.tree_map_with_path(cast, params)


def _main_dtype(family, params) -> str:
    """The weights' dtype for the config (the family's FLOAT32_PARAMS aside)."""
    import jax

    found = {np.dtype(leaf.dtype).name for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
             if str(getattr(path[-1], "key", "")) not in family.FLOAT32_PARAMS}
    return found.pop() if len(found) == 1 else "float32"


def _paths(tree, prefix=""):
    for name, value in tree.items():
        if isinstance(value, dict):
            yield from _paths(value, f"{prefix}{name}/")
        else:
            yield f"{prefix}{name}"


def _plan(params, layout, n_layers: int, renames) -> list[_Tensor]:
    """Which keys are written, from which (rule, layer) parts, checked before anything is computed."""
    active = [r for r in layout.rules if _leaf(params, r.path) is not None]
    by_path: dict[str, Rule] = {}
    for rule in active:
        if rule.path in by_path:
            raise ConversionError(f"{layout.name}: two rules write params {rule.path} ({by_path[rule.path].key} "
                                  f"and {rule.key}); an export table has one per params path")
        by_path[rule.path] = rule
    uncovered = [p for p in _paths(params) if p not in by_path]
    if uncovered:
        raise ConversionError(f"{layout.name} has no place for params {', '.join(uncovered)}")
    not_invertible = sorted({f"{r.hook.name} ({r.path} <- {r.key})" for r in active if r.hook.invert is None})
    if not_invertible:
        raise ConversionError(f"cannot export to {layout.name}: these conversion hooks have no inverse: "
                              + "; ".join(not_invertible))
    tensors: dict[str, _Tensor] = {}
    normal_of: dict[str, str] = {}
    for rule in active:
        leaf = _leaf(params, rule.path)
        for i in range(n_layers) if rule.stacked else [None]:
            normal = rule.key.format(i=i)
            key = layout.key(normal)
            if key is None:  # a tensor the layout does not have (RWKV7's layer-0 value LoRA, never read)
                continue
            nbytes = leaf.nbytes // (n_layers if rule.stacked else 1)
            entry = tensors.setdefault(key, _Tensor(key, [], 0))
            entry.parts.append((rule, i))
            entry.nbytes += nbytes
            normal_of[key] = normal
    for entry in tensors.values():
        if len(entry.parts) > 1:
            rows = [rule.hook.rows for rule, _ in entry.parts]
            if any(r is None for r in rows):
                raise ConversionError(f"{layout.name}: several params map to {entry.key} without a row range each: "
                                      + ", ".join(rule.path for rule, _ in entry.parts))
            entry.parts.sort(key=lambda part: part[0].hook.rows[0])
            starts = [r[0] for r in sorted(rows)]
            ends = [r[0] + r[1] for r in sorted(rows)]
            if starts[0] != 0 or starts[1:] != ends[:-1] or ends[-1] != rows[0][2]:
                raise ConversionError(f"{layout.name}: the parts of {entry.key} do not tile its {rows[0][2]} rows: "
                                      f"{sorted(rows)}")
    # what is written must read back under the same rules: the family's RENAMES undo the naming
    back = normalise_keys(tensors, renames)
    wrong = [f"{key} -> {normal} (expected {normal_of[key]})" for normal, key in back.items()
             if normal != normal_of[key]]
    if wrong:
        raise ConversionError(f"{layout.name}: exported names do not read back: " + "; ".join(wrong[:6]))
    return list(tensors.values())


def _tensor(entry: _Tensor, params) -> np.ndarray:
    """The checkpoint tensor: each part's param run through its hook's inverse (slices of a fused
    tensor concatenated), then checked by running the hooks forward again."""
    pieces = []
    for rule, i in entry.parts:
        leaf = _leaf(params, rule.path)
        pieces.append(np.asarray(rule.hook.invert(leaf if i is None else leaf[i])))
    tensor = pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=0)
    tensor = np.ascontiguousarray(tensor)
    for rule, i in entry.parts:
        leaf = _leaf(params, rule.path)
        ours = leaf if i is None else leaf[i]
        back = np.asarray(rule.hook.apply(tensor))
        if tuple(rule.hook.shape(tensor.shape)) != ours.shape or not _same(back, ours):
            raise ConversionError(f"{entry.key}: the inverse of hook {rule.hook.name} does not give back "
                                  f"params {rule.path} (a bug in its inverse)")
    return tensor


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equal (NaNs and bfloat16 included)."""
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(
        np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8))


def _write_tensors(directory: Path, tensors: list[_Tensor], params, max_shard_bytes: int) -> None:
    """model.safetensors, or transformers' shards model-0000k-of-0000n.safetensors plus their index;
    one shard's tensors in memory at a time."""
    import json

    from safetensors.numpy import save_file

    shards: list[list[_Tensor]] = [[]]
    size = 0
    for entry in tensors:
        if shards[-1] and size + entry.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    mode = 0o666 & ~checkpoint._umask()
    for name, shard in zip(names, shards, strict=True):
        save_file({entry.key: _tensor(entry, params) for entry in shard}, directory / name, metadata={"format": "pt"})
        os.chmod(directory / name, mode)  # safetensors creates its files 0600: readable by their owner only
    if n > 1:
        index = {"metadata": {"total_size": sum(e.nbytes for e in tensors)},
                 "weight_map": {e.key: name for name, shard in zip(names, shards, strict=True) for e in shard}}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


# ---- CLI --------------------------------------------------------------------------------------


def add_parser(sub):
    """Register `jaxembed export` on the CLI's subparsers."""
    p = sub.add_parser("export", help="write a jaxembed model in its source layout (safetensors + config.json + "
                                      "tokenizer) for transformers / fla")
    p.add_argument("model", help="jaxembed model directory (jaxembed convert, or the trainer's export)")
    p.add_argument("dst", help="output directory")
    p.add_argument("--format", default="hf",
                   help="hf: transformers' layout (Mamba2, xLSTM, Mistral, Qwen2), fla-hub's (RWKV7)")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="cast weights (default: as stored)")
    p.add_argument("--overwrite", action="store_true", help="replace a model already at DST (atomically)")
    p.set_defaults(func=cmd_export)
    return p


def cmd_export(args) -> int:
    out = export(args.model, args.dst, format=args.format, dtype=args.dtype, overwrite=args.overwrite)
    print(f"exported {args.model} -> {out}")
    return 0
