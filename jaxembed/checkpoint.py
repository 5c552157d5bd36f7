"""The converted-checkpoint directory: `jaxembed.json` (config + embedder settings), `params/`
(an orbax checkpoint of the params pytree) and the tokenizer files, if any."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import tempfile
import warnings
from pathlib import Path
from typing import NamedTuple

import orbax.checkpoint as ocp

from jaxembed.config import config_from_dict
from jaxembed.errors import ConversionError

MANIFEST = "jaxembed.json"
FORMAT_VERSION = 2  # 2: Mamba2's in_proj is two params, z_proj and xbcdt_proj (1 is read and split)
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json",
)


EMBEDDER_SETTINGS = ("query_template", "default_instruction")  # the manifest's `embedder` section
EMBEDDER_SETTINGS_FILE = "jaxembed_embedder.json"  # those settings beside an export's weights, for `convert`
# the source checkpoint's config.json, kept so `jaxembed export` writes back the fields jaxembed does not model
# (bos_token_id, max_position_embeddings, a second EOS id, fla-only fields)
SOURCE_CONFIG_FILE = "source_config.json"
CHECKSUM = "xxh3_128"  # per tensor, over its bytes in C order: fast enough to verify on every load


def is_converted(directory: Path) -> bool:
    return (Path(directory) / MANIFEST).exists()


def tensor_checksums(params) -> dict[str, str]:
    """{"layers/in_proj": hex digest, ...}: each leaf's bytes (C order, as stored) hashed."""
    import jax
    import numpy as np
    import xxhash

    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        arr = np.ascontiguousarray(np.asarray(leaf))
        out[name] = xxhash.xxh3_128_hexdigest(arr.view(np.uint8).reshape(-1).data)
    return out


def file_checksums(root: Path) -> dict[str, str]:
    """{"params/_METADATA": hex digest, ..., "tokenizer.json": ...} for every file under root/params and the
    tokenizer files at root."""
    import xxhash

    out = {}
    tokenizer_files = [root / name for name in TOKENIZER_FILES]
    for path in [*sorted((root / "params").rglob("*")), *tokenizer_files]:
        if path.is_file():
            digest = xxhash.xxh3_128()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 24), b""):
                    digest.update(block)
            out[path.relative_to(root).as_posix()] = digest.hexdigest()
    return out


def manifest_checksum(manifest: dict) -> str:
    """The manifest's own sections that change embeddings (config, embedder settings), hashed."""
    import xxhash

    what = {"config": manifest["config"], "embedder": manifest.get("embedder") or {}}
    return xxhash.xxh3_128_hexdigest(json.dumps(what, sort_keys=True).encode())


def fingerprint(config, checksums: dict[str, str]) -> str:
    """A model's identity: its config and every tensor's checksum, hashed (32 hex digits)."""
    import xxhash

    text = json.dumps({"config": config.to_dict(), "tensors": checksums}, sort_keys=True, default=str)
    return xxhash.xxh3_128_hexdigest(text.encode())


def save(directory, config, params, *, embedder: dict | None = None, source: str | None = None,
         tokenizer=None, tokenizer_from: Path | None = None, source_config: dict | None = None,
         overwrite: bool = False) -> Path:
    """Write a converted checkpoint atomically: params (orbax), the manifest with a checksum per
    file and per tensor, the tokenizer (an object with `save_pretrained`, or the files of
    `tokenizer_from`) and the source's config.json (`source_config`, for `jaxembed export`), all into a
    temporary sibling that then takes `directory`'s place.

    An existing non-empty `directory` is refused unless `overwrite`, and even then only if it is a
    jaxembed checkpoint; it is swapped out atomically (Linux renameat2 RENAME_EXCHANGE), so a
    kill at any point leaves either the old checkpoint or the new one complete, never a mix.
    (Where the filesystem has no exchange, the old one is moved aside first and put back if the
    new one cannot be moved in.) An empty directory that cannot be replaced by a rename (a mount
    point, a parent not writable or on another device) is written in place: there is nothing old
    to lose, and the manifest, written last, marks the checkpoint complete.
    """
    from jaxembed.errors import ConversionError

    directory = Path(directory).expanduser().resolve()  # a symlink's target is what gets replaced
    empty = directory.is_dir() and not any(directory.iterdir())
    if directory.exists():
        if not directory.is_dir():
            raise ConversionError(f"{directory}: exists and is not a directory")
        if not empty:
            if not is_converted(directory):
                raise ConversionError(f"{directory}: not empty and not a jaxembed checkpoint; refusing to write into "
                                      "it (choose a new or empty directory)")
            if not overwrite:
                raise ConversionError(f"{directory}: a jaxembed checkpoint is already there; pass --overwrite "
                                      "(overwrite=True) to replace it")
    directory.parent.mkdir(parents=True, exist_ok=True)
    in_place = empty and not _renameable(directory)
    if not in_place and directory.exists() and not _renameable(directory):
        raise ConversionError(f"{directory}: cannot be replaced atomically (a mount point, or its parent is not "
                              "writable or on another device); remove its contents or choose another directory")
    _clear_stale_temporaries(directory)
    tmp = directory if in_place else temporary_sibling(directory)
    try:
        # a trainer's export is written by process 0 alone
        checkpointer = ocp.StandardCheckpointer(multiprocessing_options=_this_process_only())
        checkpointer.save(tmp / "params", params)
        checkpointer.wait_until_finished()
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        elif tokenizer_from is not None:
            copy_tokenizer(tokenizer_from, tmp)
        if source_config is not None:  # covered by the file checksums like every other file
            (tmp / SOURCE_CONFIG_FILE).write_text(json.dumps(source_config, indent=2) + "\n", encoding="utf-8")
        manifest = {
            "format_version": FORMAT_VERSION,
            "config": config.to_dict(),
            "embedder": embedder or {},
            "source": source,
        }
        # files: every byte orbax wrote and the tokenizer's, checked before reading; tensors: the model's
        # identity; manifest: its config and embedder sections (an edited norm eps or template is no such model)
        manifest["checksums"] = {"algorithm": CHECKSUM, "files": file_checksums(tmp),
                                 "tensors": tensor_checksums(params), "manifest": manifest_checksum(manifest)}
        _fsync_tree(tmp)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")  # last: marks it complete
        _fsync_tree(tmp)
        if not in_place:
            _swap_into_place(tmp, directory)
        _fsync_path(directory.parent)
    finally:
        if not in_place and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return directory


def _this_process_only():
    """orbax options for a model directory that one process writes or reads on its own: its barriers wait for this
    process only (under jax.distributed they would wait for processes that never come)."""
    import jax

    me = jax.process_index()
    return ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})


def _restore_on_host(path: Path) -> dict:
    """The params as numpy arrays, read whole by this process: the saved shardings are one process's, which
    orbax refuses to map onto another topology (every process of a jax.distributed run reads the model)."""
    import jax
    import numpy as np

    checkpointer = ocp.StandardCheckpointer(multiprocessing_options=_this_process_only())
    target = jax.tree.map(lambda meta: np.empty(meta.shape, meta.dtype), checkpointer.metadata(path).item_metadata)
    return checkpointer.restore(path, target)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _renameable(directory: Path) -> bool:
    """Whether a sibling directory can be renamed onto `directory` (same device, writable parent)."""
    parent = directory.parent
    return (not os.path.ismount(directory) and os.access(parent, os.W_OK)
            and (not directory.exists() or directory.stat().st_dev == parent.stat().st_dev))


def temporary_sibling(directory: Path) -> Path:
    """A new empty directory beside `directory` to write into before the swap, named for this host and
    process: a later write removes it if that process is gone (a 7B export killed midway leaves ~14 GB)."""
    tag = f"{socket.gethostname()}.{os.getpid()}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-{tag}-", dir=directory.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's 0700 would hide the model from other users
    return tmp


def _writer_is_gone(name: str) -> bool:
    """Whether the temporary directory `name` (see `temporary_sibling`) was made on this host by a process
    that no longer runs. Other hosts' (a shared filesystem) and older unnamed ones are not known to be."""
    found = re.fullmatch(r".*\.tmp-(?P<host>.+)\.(?P<pid>\d+)-[^-]+", name)
    if found is None or found["host"] != socket.gethostname():
        return False
    try:
        os.kill(int(found["pid"]), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):  # alive under another user; or no such pid at all
        return False
    return False


def _clear_stale_temporaries(directory: Path) -> None:
    """Remove what killed writes of `directory` on this host left (their processes are gone); name the rest."""
    temporaries = sorted(directory.parent.glob(f".{directory.name}.tmp-*"))
    removed = [p.name for p in temporaries if _writer_is_gone(p.name)]
    for name in removed:
        shutil.rmtree(directory.parent / name, ignore_errors=True)
    stale = [p.name for p in temporaries if p.name not in removed] + sorted(
        p.name for p in directory.parent.glob(f".{directory.name}.old-*"))  # an .old- may be the only old copy
    if removed:
        warnings.warn(f"{directory.parent}: removed {len(removed)} temporary director(ies) left by killed writes of "
                      f"{directory.name}: {', '.join(removed[:4])}" + (" ..." if len(removed) > 4 else ""),
                      stacklevel=3)
    if stale:
        warnings.warn(f"{directory.parent}: left by interrupted writes of {directory.name} (safe to delete when no "
                      f"write is running): {', '.join(stale[:4])}" + (" ..." if len(stale) > 4 else ""), stacklevel=3)


def _fsync_tree(root: Path) -> None:
    """Flush every file under root, then the directories, so the rename publishes complete data."""
    for path in [*sorted(root.rglob("*"), reverse=True), root]:
        _fsync_path(path)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _swap_into_place(new: Path, target: Path) -> None:
    """Put the finished directory `new` at `target`: a plain rename when target is absent or empty,
    else an atomic exchange of the two, after which `new` holds the old checkpoint (then removed)."""
    try:
        os.rename(new, target)  # target absent, or an empty directory: replaced atomically
        return
    except OSError:
        pass
    if not _rename_exchange(new, target):  # no exchange here: move the old aside, and back on failure
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        os.rmdir(old)
        os.rename(target, old)
        try:
            os.rename(new, target)
        except OSError:
            os.rename(old, target)
            raise
        new = old
    shutil.rmtree(new, ignore_errors=True)


def _rename_exchange(a: Path, b: Path) -> bool:
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def load(directory, *, verify: bool = True):
    """(config, params, embedder settings, fingerprint) from a converted directory.

    With `verify` (the default) every file of params/ is checked against the checksums recorded
    when it was written, before anything is read: a damaged, truncated, missing or extra file is
    an error that names it, never a model that embeds garbage. Then every tensor read is checked
    against its own recorded checksum, which is what the fingerprint is made of: params rewritten
    under a manifest whose file checksums were updated and tensor checksums not are refused by
    tensor name, not given the old model's identity. Every tensor's shape and dtype (a float type)
    is checked against the config, and the tokenizer files and the manifest's config and embedder
    sections against their checksums. With `verify=False` nothing is checked and the fingerprint is
    None (the embedder computes one from the params if it is asked for it).
    """
    from jaxembed import models
    from jaxembed.errors import ConfigError, ConversionError

    directory = Path(directory).expanduser().absolute()
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        version = manifest.get("format_version")
        if version not in (1, FORMAT_VERSION):
            raise ConversionError(f"unsupported format_version {manifest.get('format_version')!r}")
        config = config_from_dict(manifest["config"])
        settings = manifest.get("embedder") or {}
        if not isinstance(settings, dict):
            raise ConversionError(f"'embedder' must be a mapping, got {settings!r}")
        unknown = sorted(set(settings) - set(EMBEDDER_SETTINGS))
        if unknown:
            raise ConversionError(f"unknown 'embedder' settings {unknown}; known: {list(EMBEDDER_SETTINGS)}")
        unknown = sorted(set(manifest) - {"format_version", "config", "embedder", "source", "checksums"})
        if unknown:
            raise ConversionError(f"unknown manifest sections {unknown}")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError, ConfigError,
            ConversionError) as err:
        raise ConversionError(f"{directory / MANIFEST}: not a valid jaxembed manifest ({err})") from None
    if not (directory / "params").is_dir():
        raise ConversionError(f"{directory}: no params/ checkpoint next to {MANIFEST}")
    checksums = manifest.get("checksums") or {}
    if not isinstance(checksums, dict) or not all(isinstance(checksums.get(k, {}), dict) for k in ("files", "tensors")):
        raise ConversionError(f"{directory / MANIFEST}: 'checksums' must map 'files' and 'tensors' to digests")
    if checksums and checksums.get("algorithm") != CHECKSUM:
        raise ConversionError(f"{directory / MANIFEST}: checksums by {checksums.get('algorithm')!r}; this version "
                              f"of jaxembed checks {CHECKSUM!r}")
    if verify and version >= 2 and not (checksums.get("files") and checksums.get("tensors")):
        # every jaxembed that wrote format 2 recorded them: without them the manifest was edited
        raise ConversionError(f"{directory / MANIFEST}: format_version 2 with no checksums; the manifest has been "
                              "edited, so what it describes cannot be checked (convert the model again, or load with "
                              "verify=False)")
    # checkpoints written before the tokenizer files and the manifest were covered: params/ alone
    covers_all = "manifest" in checksums
    if verify and checksums.get("files"):
        _verify_files(directory, checksums["files"], params_only=not covers_all)
    try:
        params = _restore_on_host(directory / "params")
    except Exception as err:  # orbax/TensorStore errors carry a long spec: keep its first sentence
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConversionError(f"{directory / 'params'}: the checkpoint is damaged or incomplete, it could not be "
                              f"read ({type(err).__name__}: {first[:200]})") from None
    recorded = checksums.get("tensors")
    if recorded is not None and verify:  # the tensors themselves: the fingerprint is theirs
        actual = tensor_checksums(params)
        bad = [name for name in sorted(set(recorded) | set(actual)) if recorded.get(name) != actual.get(name)]
        if bad:
            raise ConversionError(f"{directory}: the checkpoint is corrupt: {len(bad)} tensor(s) differ from the "
                                  f"checksums recorded when it was written: {', '.join(bad[:6])}"
                                  + (" ..." if len(bad) > 6 else ""))
    params = _upgrade(config, params, version)
    problems = _shape_problems(params, models.family(config).param_shapes(config))
    if problems:
        raise ConversionError(f"{directory}: params do not match {MANIFEST}'s config:\n  " + "\n  ".join(problems))
    if verify and covers_all and checksums["manifest"] != manifest_checksum(manifest):
        raise ConversionError(f"{directory / MANIFEST}: its config or embedder settings differ from those written "
                              "with these weights (an edited manifest describes another model); convert again, or "
                              "pass settings such as query_template to jaxembed.load instead")
    if not verify:  # nothing checked: the recorded checksums vouch for nothing, the identity is computed if asked
        return config, params, settings, None
    if recorded is None:
        warnings.warn(f"{directory}: no checksums in {MANIFEST} (written by an older jaxembed); its integrity "
                      "cannot be checked; convert it again to add them", stacklevel=2)
        return config, params, settings, None
    # the identity is the stored tensors', so a format-1 checkpoint keeps its fingerprint (and its caches)
    return config, params, settings, fingerprint(config, recorded)


def _upgrade(config, params, version: int):
    """Params stored in format `version`, laid out as this format lays them out."""
    if version < 2 and config.architecture == "mamba2":
        layers, e = dict(params["layers"]), config.d_inner
        for suffix in ("", "_bias"):
            fused = layers.pop("in_proj" + suffix, None)
            if fused is not None and fused.shape[-1] == config.d_in_proj:  # else the shape check names it
                layers["z_proj" + suffix], layers["xbcdt_proj" + suffix] = fused[..., :e], fused[..., e:]
            elif fused is not None:
                layers["in_proj" + suffix] = fused
        params = {**params, "layers": layers}
    return params


def _verify_files(directory: Path, recorded: dict[str, str], *, params_only: bool = False) -> None:
    from jaxembed.errors import ConversionError

    actual = {name: digest for name, digest in file_checksums(directory).items()
              if not Path(name).name.startswith(".")  # hidden files (.DS_Store, sync tools) are not the model's
              and (name.startswith("params/") or not params_only)}
    missing = sorted(set(recorded) - set(actual))
    extra = sorted(set(actual) - set(recorded))
    changed = sorted(name for name in set(recorded) & set(actual) if recorded[name] != actual[name])
    problems = ([f"changed: {', '.join(changed[:6])}"] if changed else []) + (
        [f"missing: {', '.join(missing[:6])}"] if missing else []) + ([f"unexpected: {', '.join(extra[:6])}"]
                                                                      if extra else [])
    if problems:
        raise ConversionError(f"{directory}: the checkpoint is corrupt: its files differ from the checksums recorded "
                              f"when it was written ({'; '.join(problems)})")


OPTIONAL_PARAMS = ("lm_head",)  # a base model without its language-model head embeds just the same


class OpenedModel(NamedTuple):
    config: object
    params: dict
    settings: dict  # the embedder settings: the manifest's, or a `jaxembed export`'s file beside HF weights
    directory: Path
    fingerprint: str | None  # identity of a converted checkpoint (None: computed when asked, from params)


def open_model(path, *, verify: bool = True, revision: str | None = None) -> OpenedModel:
    """A converted directory (`jaxembed convert`, checksums verified) or a Hugging Face-format
    checkpoint (a directory or hub id in any supported layout, converted in memory). The one way
    `jaxembed.load` and the trainer open a model."""
    from jaxembed.convert import read_checkpoint

    if path is None or not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"the model path must be a directory path or a hub id, got {path!r}")
    directory = Path(path).expanduser()
    if directory.is_dir() and is_converted(directory):
        if revision is not None:
            raise ConversionError(f"{path}: revision={revision!r} applies to Hugging Face hub ids, but this is a "
                                  "local jaxembed model")
        config, params, settings, ident = load(directory, verify=verify)
        return OpenedModel(config, params, settings, directory, ident)
    ck = read_checkpoint(path, revision=revision)
    return OpenedModel(ck.config, ck.params, exported_settings(ck.directory), ck.directory, None)


def source_config_of(directory) -> dict | None:
    """The Hugging Face config.json a model came from: a converted model's copy of it, or a Hugging Face
    directory's own (None: none, as for a BlinkDL .pth or a model trained from scratch)."""
    directory = Path(directory)
    path = directory / (SOURCE_CONFIG_FILE if is_converted(directory) else "config.json")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def exported_settings(directory) -> dict:
    """The embedder settings a `jaxembed export` left beside Hugging Face weights ({} when there are none):
    without them an exported model would embed queries with the default template, not the one it was trained
    with. A malformed file is refused, not skipped."""
    from jaxembed.text import check_query_template

    path = Path(directory) / EMBEDDER_SETTINGS_FILE
    if not path.is_file():
        return {}
    try:  # an editor's byte-order mark is not part of the JSON
        settings = json.loads(path.read_text(encoding="utf-8-sig"))
    except (ValueError, UnicodeDecodeError) as err:
        raise ConversionError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(settings, dict) or set(settings) - set(EMBEDDER_SETTINGS) or not all(
            isinstance(v, str) for v in settings.values()):
        raise ConversionError(f"{path}: expected a mapping of {list(EMBEDDER_SETTINGS)} to strings, got {settings!r}")
    if "query_template" in settings:
        check_query_template(settings["query_template"], name=f"{path}: query_template", error=ConversionError)
    return settings


def _shape_problems(params, shapes, prefix="") -> list[str]:
    import jax.numpy as jnp

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
        elif not jnp.issubdtype(params[name].dtype, jnp.floating):
            problems.append(f"{path}: dtype {params[name].dtype}, expected a float type")
    return problems


def copy_tokenizer(src: Path, dst: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(src) / name).exists():
            shutil.copy2(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied

