"""The converted-checkpoint directory: `jaxembed.json` (config + embedder settings), `params/`
(an orbax checkpoint of the params pytree) and the tokenizer files, if any."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import orbax.checkpoint as ocp

from jaxembed.config import config_from_dict

MANIFEST = "jaxembed.json"
FORMAT_VERSION = 1
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json",
)


def is_converted(directory: Path) -> bool:
    return (Path(directory) / MANIFEST).exists()


def save(directory, config, params, *, embedder: dict | None = None, source: str | None = None) -> Path:
    """Write `params` with orbax and the manifest; returns the directory."""
    directory = Path(directory).expanduser().absolute()
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / "params"
    if target.exists():
        shutil.rmtree(target)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(target, params)
    checkpointer.wait_until_finished()
    manifest = {
        "format_version": FORMAT_VERSION,
        "config": config.to_dict(),
        "embedder": embedder or {},
        "source": source,
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return directory


def load(directory):
    """(config, params, embedder settings) from a converted directory, every tensor's shape checked."""
    from jaxembed import models
    from jaxembed.errors import ConfigError, ConversionError

    directory = Path(directory).expanduser().absolute()
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        if manifest.get("format_version") != FORMAT_VERSION:
            raise ConversionError(f"unsupported format_version {manifest.get('format_version')!r}")
        config = config_from_dict(manifest["config"])
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError, ConfigError, ConversionError) as err:
        raise ConversionError(f"{directory / MANIFEST}: not a valid jaxembed manifest ({err})") from None
    if not (directory / "params").is_dir():
        raise ConversionError(f"{directory}: no params/ checkpoint next to {MANIFEST}")
    try:
        params = ocp.StandardCheckpointer().restore(directory / "params")
    except Exception as err:
        raise ConversionError(f"{directory / 'params'}: could not restore the orbax checkpoint ({err})") from None
    problems = _shape_problems(params, models.family(config).param_shapes(config))
    if problems:
        raise ConversionError(f"{directory}: params do not match {MANIFEST}'s config:\n  " + "\n  ".join(problems))
    return config, params, manifest.get("embedder", {})


OPTIONAL_PARAMS = ("lm_head",)  # a base model without its language-model head embeds just the same


def open_model(path) -> tuple:
    """(config, params, embedder settings, directory) of a converted directory (`jaxembed convert`)
    or a Hugging Face-format checkpoint (a directory or hub id in any supported layout, converted
    in memory; no settings). The one way `jaxembed.load` and the trainer open a model."""
    from jaxembed.convert import read_checkpoint

    directory = Path(path).expanduser()
    if directory.is_dir() and is_converted(directory):
        config, params, settings = load(directory)
        return config, params, settings, directory
    ck = read_checkpoint(path)
    return ck.config, ck.params, {}, ck.directory


def _shape_problems(params, shapes, prefix="") -> list[str]:
    problems = []
    for name in sorted(set(params) | set(shapes)):
        path = f"{prefix}{name}"
        if name not in shapes:
            problems.append(f"unexpected {path}")
        elif name not in params:
            if name not in OPTIONAL_PARAMS:
                problems.append(f"missing {path}")
        elif isinstance(shapes[name], dict):
            problems += _shape_problems(params[name], shapes[name], path + "/")
        elif tuple(params[name].shape) != tuple(shapes[name]):
            problems.append(f"{path}: shape {tuple(params[name].shape)}, expected {tuple(shapes[name])}")
    return problems


def copy_tokenizer(src: Path, dst: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(src) / name).exists():
            shutil.copy2(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied

