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
    """(config, params, embedder settings) from a converted directory."""
    directory = Path(directory).expanduser().absolute()
    manifest = json.loads((directory / MANIFEST).read_text())
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{directory / MANIFEST}: unsupported format_version {manifest.get('format_version')}")
    config = config_from_dict(manifest["config"])
    params = ocp.StandardCheckpointer().restore(directory / "params")
    return config, params, manifest.get("embedder", {})


def copy_tokenizer(src: Path, dst: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(src) / name).exists():
            shutil.copy2(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied

