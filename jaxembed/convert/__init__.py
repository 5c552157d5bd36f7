"""Hugging Face / PyTorch checkpoints -> jaxembed params, through declarative name tables.

    jaxembed convert SRC DST [--dtype bfloat16] [--verify]

SRC is a local directory or a hub id; DST gets an orbax checkpoint plus `jaxembed.json`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from jaxembed import checkpoint, models
from jaxembed.convert.core import convert_tensors
from jaxembed.convert.sources import ConversionError, TensorSource, fetch_weights, resolve, weight_files

# each family's conversion module (models._FAMILIES): detect(dir), rules_for(cfg), ignored_keys(cfg),
# RENAMES, EXPECTS (what detect looks for, in words), reference(checkpoint) (the PyTorch reference
# run by --verify)
LAYOUTS = tuple(models.conversion_layouts())


@dataclasses.dataclass
class Checkpoint:
    config: object
    params: dict  # numpy arrays
    layout: str  # "transformers", "mamba_ssm", "codestral", ...
    directory: Path
    files: list[Path]  # the tensor files read
    layouts: object  # the family's conversion module (name table, config readers, reference)

    @property
    def family(self):
        """The model family module (param shapes, float32 params) of this checkpoint's config."""
        return models.family(self.config)


def detect(directory: Path):
    """(conversion module, layout name, config, preferred weight files) for a checkpoint directory."""
    if checkpoint.is_converted(directory):
        raise ConversionError(f"{directory}: already a jaxembed model ({checkpoint.MANIFEST}); jaxembed.load reads it "
                              "as it is, and `jaxembed export` writes it back in its source layout")
    for layouts in LAYOUTS:
        found = layouts.detect(directory)
        if found is not None:
            return (layouts, *found)
    present = sorted(p.name for p in directory.iterdir())[:20]
    expected = "; ".join(layouts.EXPECTS for layouts in LAYOUTS)
    raise ConversionError(
        f"{directory}: not a checkpoint this version can read. Expected one of: {expected}. Found {present}"
    )


def _dtype_rule(config, dtype):
    family = models.family(config)

    def dtype_for(path: str, source_dtype):
        return models.param_dtype(family, path.rsplit("/", 1)[-1], source_dtype, dtype)

    return dtype_for


def read_checkpoint(src, *, dtype=None, progress: bool = False, revision: str | None = None) -> Checkpoint:
    """Read a Hugging Face-format checkpoint (any supported layout) into a params pytree of numpy arrays;
    revision: a hub id's branch, tag or commit."""
    directory, hub_id = resolve(src, revision)
    layouts, layout, config, preferred = detect(directory)
    if hub_id is not None:
        directory = fetch_weights(hub_id, directory, preferred, revision)
    files = weight_files(directory, preferred)
    source = TensorSource(files)
    params = convert_tensors(
        source,
        layouts.rules_for(config),
        models.family(config).param_shapes(config),
        config.n_layers,
        renames=layouts.RENAMES,
        ignore=layouts.ignored_keys(config),
        dtype_for=_dtype_rule(config, _parse_dtype(dtype)),
        progress=progress,
        zero_filled=getattr(layouts, "ZERO_FILLED", ()),
    )
    return Checkpoint(config, params, layout, directory, files, layouts)


def _parse_dtype(dtype):
    if dtype is None:
        return None
    import ml_dtypes

    names = {"float32": np.float32, "fp32": np.float32, "bfloat16": ml_dtypes.bfloat16, "bf16": ml_dtypes.bfloat16}
    if isinstance(dtype, str):
        if dtype not in names:
            raise ValueError(f"dtype must be one of {sorted(names)}, got {dtype!r}")
        return names[dtype]
    return dtype


__all__ = ["Checkpoint", "ConversionError", "read_checkpoint", "detect"]


def convert(src, dst, *, dtype=None, verify: bool = False, tokenizer=None, query_template=None,
            default_instruction=None, progress: bool = True, overwrite: bool = False,
            revision: str | None = None) -> Path:
    """Convert SRC (directory or hub id) into DST: orbax params, jaxembed.json and tokenizer files.

    With verify, the PyTorch reference runs first and nothing is written if it disagrees. The
    output is written atomically (`checkpoint.save`): an existing checkpoint at DST is replaced
    only with `overwrite`, and a kill at any point leaves the old one or the new one, complete.
    """
    from jaxembed import checkpoint
    from jaxembed.embedder import QUERY_TEMPLATE, check_query_template, load_tokenizer

    if query_template is not None:  # checked before the (long) read
        query_template = check_query_template(query_template, error=ConversionError)
    dst = Path(dst).expanduser()
    if dst.exists() and not dst.is_dir():
        raise ConversionError(f"{dst}: exists and is not a directory")
    if dst.is_dir() and any(dst.iterdir()) and not (overwrite and checkpoint.is_converted(dst)):
        why = "a jaxembed checkpoint is already there; pass --overwrite to replace it" if checkpoint.is_converted(
            dst) else "not empty and not a jaxembed checkpoint; choose a new or empty directory"
        raise ConversionError(f"{dst}: {why}")  # before the (long) read
    local = Path(src).expanduser()
    if local.exists() and (dst.resolve() == local.resolve() or dst.resolve() in local.resolve().parents):
        # the replaced directory would take the source with it
        raise ConversionError(f"{dst}: the output directory must not be the source directory or hold it")
    tok = load_tokenizer(tokenizer) if tokenizer is not None else None
    ck = read_checkpoint(src, dtype=dtype, progress=progress, revision=revision)
    if verify:
        from jaxembed.convert.verify import verify as run_verify

        worst, tolerance = run_verify(ck)
        if not worst <= tolerance:
            raise ConversionError(f"verification failed: max relative error {worst:.2e} > {tolerance:.0e} "
                                  f"against the PyTorch model; nothing was written")
    exported = checkpoint.exported_settings(ck.directory)  # what `jaxembed export` wrote; the options given win
    query_template = check_query_template(query_template or exported.get("query_template") or QUERY_TEMPLATE,
                                          error=ConversionError)
    default_instruction = default_instruction if default_instruction is not None else exported.get(
        "default_instruction")
    settings = {"query_template": query_template}
    if default_instruction:
        settings["default_instruction"] = default_instruction
    return checkpoint.save(dst, ck.config, ck.params, embedder=settings, source=f"{src} ({ck.layout} layout)",
                           tokenizer=tok, tokenizer_from=None if tok is not None else ck.directory,
                           source_config=checkpoint.source_config_of(ck.directory), overwrite=overwrite)
