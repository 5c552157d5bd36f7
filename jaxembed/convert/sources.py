"""Where checkpoint tensors come from: local directories or hub ids, safetensors or PyTorch .bin.

Tensors are read one at a time (safetensors memory-maps; .bin files are loaded with
`torch.load(mmap=True)`), so converting a 7B checkpoint never holds two copies of it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from jaxembed.errors import ConversionError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve(src: str | os.PathLike, revision: str | None = None) -> tuple[Path, str | None]:
    """(directory, hub id or None): a local directory as is; for a hub id, its config and
    tokenizer files only (the weights follow with `fetch_weights`, once the layout is known), at
    `revision` (a branch, tag or commit; default: main)."""
    path = Path(src).expanduser()
    if revision is not None and not isinstance(revision, str):
        raise ConversionError(f"revision must be a branch, tag or commit string, got {revision!r}")
    if revision is not None and path.exists():
        raise ConversionError(f"{src}: revision={revision!r} applies to Hugging Face hub ids, but this is a local "
                              "path (check out the revision there instead)")
    if path.is_dir():
        return path, None
    if path.is_file() and path.suffix == ".pth":  # a single-file checkpoint (BlinkDL's RWKV7); detect reads it
        return path, None
    if path.exists():
        raise ConversionError(f"{src}: expected a checkpoint directory, got a file")
    if not _HUB_ID.match(str(src)):
        raise ConversionError(f"{src}: no such directory (and it is not a Hugging Face hub id)")
    parent = Path(str(src).split("/", 1)[0])
    if parent.is_dir():  # "runs/modle" where ./runs exists: a mistyped local path, not an organisation
        raise ConversionError(f"{src}: no such directory in {parent}/ (not looked up on the Hugging Face hub, since "
                              f"./{parent} is a local directory; give the hub id from another directory if you "
                              "meant the hub)")
    from huggingface_hub import snapshot_download

    directory = _from_hub(str(src), lambda: snapshot_download(str(src), revision=revision,
                                                              allow_patterns=["*.json", "tokenizer*"]))
    return Path(directory), str(src)


def fetch_weights(repo_id: str, directory: Path, preferred: tuple[str, ...], revision: str | None = None) -> Path:
    """Download only the weight files the detected layout reads (a repository such as Codestral's
    holds both a transformers and a Mistral copy of the weights)."""
    from huggingface_hub import list_repo_files, snapshot_download

    files = set(_from_hub(repo_id, lambda: list_repo_files(repo_id, revision=revision)))
    wanted = [name for name in preferred if name in files][:1]
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if not wanted and (directory / index_name).exists():
            wanted = sorted(set(read_json(directory / index_name).get("weight_map", {}).values()))
    if not wanted:
        top = sorted(f for f in files if "/" not in f and f != "consolidated.safetensors")
        wanted = [f for f in top if f.endswith(".safetensors")] or [f for f in top if f.endswith(".bin")]
    return Path(_from_hub(repo_id, lambda: snapshot_download(repo_id, revision=revision, allow_patterns=wanted)))


def _from_hub(repo_id: str, call):
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    try:
        return call()
    except (LocalEntryNotFoundError, OfflineModeIsEnabled, OSError) as err:
        raise ConversionError(
            f"{repo_id}: not a local directory, and the Hugging Face Hub could not be reached to download it "
            f"(offline: HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', 'unset')}). "
            f"Download it on a machine with hub access and pass the local directory. ({type(err).__name__})"
        ) from None
    except Exception as err:  # repository not found, gated, ...
        raise ConversionError(f"{repo_id}: could not download from the Hugging Face Hub: {err}") from None


def read_json(path: Path) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as err:
        raise ConversionError(f"{path}: not valid JSON ({err})") from None


def weight_files(directory: Path, preferred: tuple[str, ...] = ()) -> list[Path]:
    """The checkpoint's tensor files, in transformers' order: named ones first, then model.safetensors, then
    a sharded safetensors index, then .bin. (save_pretrained leaves the other layout's files behind: a folder
    saved single-file then sharded holds both, and transformers reads the single file.)"""
    for name in (*preferred, "model.safetensors"):
        if (directory / name).exists():
            return [directory / name]
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = directory / index_name
        if index.exists():
            shards = sorted(set(read_json(index).get("weight_map", {}).values()))
            missing = [s for s in shards if not (directory / s).exists()]
            if missing:
                raise ConversionError(f"{index}: shard files missing: {missing}")
            return [directory / s for s in shards]
    for pattern in ("*.safetensors", "*.bin", "*.pt", "*.pth"):
        files = sorted(directory.glob(pattern))
        if files:
            return files
    raise ConversionError(f"{directory}: no weight files (*.safetensors, *.bin) found")


# safetensors' header dtype codes in numpy's spelling (torch's names match for the float types)
SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                      "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32",
                      "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
FLOAT_DTYPES = ("float64", "float32", "float16", "bfloat16")


class TensorSource:
    """Read-only mapping name -> numpy array over one or more checkpoint files, loaded lazily."""

    def __init__(self, files: list[Path]):
        self._where: dict[str, Path] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, str] = {}
        self._torch: dict[Path, dict] = {}
        for file in files:
            for name, shape, dtype in self._scan(file):
                if name in self._where:  # two copies (a stale file beside the model): which one is the model's?
                    raise ConversionError(f"tensor {name!r} is in both {self._where[name].name} and {file.name}: "
                                          "remove the file that is not the model's (or give an index that "
                                          "names one file per tensor)")
                self._where[name] = file
                self._shapes[name] = shape
                self._dtypes[name] = dtype

    def _scan(self, file: Path) -> Iterator[tuple[str, tuple[int, ...], str]]:
        """(name, shape, dtype name) of every tensor, from the file's header (safetensors) or the pickle."""
        if file.suffix == ".safetensors":
            from safetensors import safe_open

            try:
                with safe_open(file, framework="numpy") as f:
                    for name in f.keys():
                        tensor = f.get_slice(name)
                        yield name, tuple(tensor.get_shape()), SAFETENSORS_DTYPES.get(tensor.get_dtype(),
                                                                                      tensor.get_dtype())
            except Exception as err:
                raise ConversionError(f"{file}: not a readable safetensors file ({err})") from None
        else:
            state = self._torch_load(file)
            for name, tensor in state.items():
                if hasattr(tensor, "shape"):
                    yield name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch.")

    def _torch_load(self, file: Path) -> dict:
        if file not in self._torch:
            try:
                import torch
            except ImportError:
                raise ConversionError(
                    f"{file} is a PyTorch pickle; reading it needs torch (pip install 'jaxembed[torch]'), "
                    "or convert the checkpoint to safetensors first"
                ) from None
            try:
                state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
            except Exception as err:
                raise ConversionError(f"{file}: not a readable PyTorch checkpoint ({err})") from None
            if not isinstance(state, dict):
                raise ConversionError(f"{file}: expected a state dict, got {type(state).__name__}")
            self._torch[file] = state.get("state_dict", state)
        return self._torch[file]

    def keys(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def dtype(self, name: str) -> str:
        """The stored dtype's name (numpy's spelling: float32, bfloat16, int32, ...)."""
        return self._dtypes[name]

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> np.ndarray:
        file = self._where[name]
        if file.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(file, framework="numpy") as f:
                return f.get_tensor(name)
        return torch_to_numpy(self._torch_load(file)[name])


def torch_to_numpy(tensor) -> np.ndarray:
    """A CPU torch tensor as numpy, bfloat16 included (via ml_dtypes)."""
    import torch

    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()
