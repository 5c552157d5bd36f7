"""The training run's config: one YAML file, checked field by field (unknown keys are errors).

    model:       {path | init, tokenizer, dtype, kernels, chunk_size, seed}
    data:        {train, heldout, negatives_per_query, max_tokens, query_template, instructions, token_cache}
    lora:        {rank, alpha, targets, modules_to_save} | null (full-parameter training)
    quantization: null | nf4
    train:       {batch_size, grad_cache_size, remat, learning_rate, warmup_steps, weight_decay,
                  temperature, epochs, max_steps, seed, log_every, length_groups}
    mesh:        {data, fsdp}
    checkpoint:  {directory, every, keep}
    eval:        {every, k, max_queries, batch_size}
    distributed: null | {coordinator, num_processes, process_id}
    output:      where the merged model is exported (a directory `jaxembed.load` reads)
    log:         metrics jsonl (default: <checkpoint.directory>/../metrics.jsonl)
    tensorboard: null | a directory for TensorBoard event files (the same rows; needs tensorboardX)

See configs/train/*.yaml for complete examples, the paper's runs among them.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path

import yaml

from jaxembed.config import ConfigError
from jaxembed.embedder import check_query_template


@dataclasses.dataclass(frozen=True)
class ModelSection:
    path: str | None = None  # converted or Hugging Face directory
    init: str | None = None  # or a model config yaml (configs/models/...): random weights, for demos and tests
    tokenizer: str | None = None  # path or hub id; "stdlib-bpe:N" trains an N-token BPE on local text
    dtype: str = "bfloat16"  # activations and base weights; adapters and optimizer state are float32
    kernels: str = "auto"
    chunk_size: int | None = None
    seed: int = 0  # for `init`
    # keyword arguments of the family's init_params, e.g. Mamba2's {A_init_range: [0.01, 1]} (docs/training.md)
    init_options: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class DataSection:
    train: tuple[str, ...] = ()
    heldout: str | None = None
    negatives_per_query: int = 1
    max_tokens: int = 512
    query_template: str | None = None  # None: the model's (a converted or exported model's own), else the paper's
    instructions: dict = dataclasses.field(default_factory=dict)  # source -> instruction when a record has none
    token_cache: str | None = None  # tokenized data cache (default: <checkpoint.directory>/../token-cache)


@dataclasses.dataclass(frozen=True)
class LoraSection:
    rank: int = 16
    alpha: float = 16.0
    targets: tuple[str, ...] | str = "all"
    modules_to_save: tuple[str, ...] = ()  # params trained in full beside the adapters (e.g. [embedding])


@dataclasses.dataclass(frozen=True)
class TrainSection:
    batch_size: int = 2048
    # queries per GradCache sub-batch; None: whole batch at once; "auto": the largest that fits the device
    grad_cache_size: int | str | None = None
    remat: bool = True
    learning_rate: float = 4e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    temperature: float = 0.02
    epochs: int = 1
    max_steps: int | None = None  # the run is min(max_steps, epochs x steps per epoch) steps: raise epochs too
    seed: int = 0
    log_every: int = 10  # metrics read back from the device every N steps (no host sync per step)
    # the batch's texts sorted by length into this many equal groups, each padded to its own bucket
    # (fewer padded tokens for one compile per distinct plan; 1: everything padded to the longest)
    length_groups: int = 4


@dataclasses.dataclass(frozen=True)
class MeshSection:
    data: int = -1
    fsdp: int = 1


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
    directory: str = "runs/checkpoints"
    every: int = 100
    keep: int = 3


@dataclasses.dataclass(frozen=True)
class EvalSection:
    every: int = 0  # 0: only before the first and after the last step (when data.heldout is set)
    k: int = 10
    max_queries: int | None = None
    batch_size: int = 64


@dataclasses.dataclass(frozen=True)
class DistributedSection:
    coordinator: str | None = None  # host:port of process 0; None: jax's cluster auto-detection
    num_processes: int | None = None
    process_id: int | None = None


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    lora: LoraSection | None = LoraSection()  # null: full-parameter training (every param, float32 masters)
    quantization: str | None = None
    train: TrainSection = TrainSection()
    mesh: MeshSection = MeshSection()
    checkpoint: CheckpointSection = CheckpointSection()
    eval: EvalSection = EvalSection()
    distributed: DistributedSection | None = None
    output: str | None = None
    log: str | None = None
    tensorboard: str | None = None

    def __post_init__(self):
        if (self.model.path is None) == (self.model.init is None):
            raise ConfigError(
                "model: give exactly one of `path` (a checkpoint) and `init` (a model config for random weights)"
            )
        if not self.data.train:
            raise ConfigError("data.train: no training files given")
        if self.quantization not in (None, "nf4"):
            raise ConfigError(f"quantization must be null or 'nf4', got {self.quantization!r}")
        if self.lora is None and self.quantization is not None:
            raise ConfigError("quantization: nf4 (QLoRA) trains LoRA adapters on a frozen 4-bit base; with lora: null "
                              "(full-parameter training) set quantization: null")
        alpha = None if self.lora is None else self.lora.alpha
        if alpha is not None and (not isinstance(alpha, (int, float)) or isinstance(alpha, bool)
                                  or not 0 < alpha < math.inf):
            raise ConfigError(f"lora alpha must be a positive, finite number, got {alpha!r}")
        if self.model.init_options and self.model.path is not None:
            raise ConfigError("model.init_options applies to `init` (random weights), not to a checkpoint `path`")
        if self.model.chunk_size is not None and (not isinstance(self.model.chunk_size, int)
                                                  or isinstance(self.model.chunk_size, bool)
                                                  or self.model.chunk_size < 1):
            raise ConfigError(f"model.chunk_size must be a positive int or null (the model's), got "
                              f"{self.model.chunk_size!r}")
        if self.model.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"model.dtype must be float32 or bfloat16, got {self.model.dtype!r}")
        if self.data.query_template is not None:
            check_query_template(self.data.query_template, name="data.query_template", error=ConfigError)
        t = self.train
        for name in ("batch_size", "epochs", "warmup_steps", "log_every", "length_groups"):
            if getattr(t, name) < (0 if name == "warmup_steps" else 1):
                raise ConfigError(
                    f"train.{name} must be {'>= 0' if name == 'warmup_steps' else 'positive'}, got {getattr(t, name)}"
                )
        if isinstance(t.grad_cache_size, str) and t.grad_cache_size != "auto":
            raise ConfigError(f"train.grad_cache_size must be an int, null or 'auto', got {t.grad_cache_size!r}")
        if isinstance(t.grad_cache_size, int) and (t.grad_cache_size < 1 or t.batch_size % t.grad_cache_size):
            raise ConfigError(f"train.grad_cache_size={t.grad_cache_size} must divide train.batch_size={t.batch_size}")
        if t.max_steps is not None and t.max_steps < 1:
            raise ConfigError(f"train.max_steps must be positive or null, got {t.max_steps}")
        for name in ("temperature", "learning_rate", "weight_decay"):  # NaN and inf pass a plain `<= 0`
            value = getattr(t, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0 \
                    or (value == 0 and name != "weight_decay"):
                raise ConfigError(f"train.{name} must be a {'non-negative' if name == 'weight_decay' else 'positive'},"
                                  f" finite number, got {value!r}")
        if self.data.negatives_per_query < 0 or self.data.max_tokens < 2:
            raise ConfigError("data.negatives_per_query must be >= 0 and data.max_tokens >= 2")
        if self.checkpoint.every < 1 or self.checkpoint.keep < 1:
            raise ConfigError("checkpoint.every and checkpoint.keep must be positive")
        if t.seed < 0 or self.model.seed < 0:
            raise ConfigError(f"train.seed and model.seed must be >= 0, got {t.seed} and {self.model.seed}")
        e = self.eval
        for name, value in (("eval.k", e.k), ("eval.batch_size", e.batch_size), ("eval.max_queries", e.max_queries)):
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be positive{' or null' if name == 'eval.max_queries' else ''}, "
                                  f"got {value}")
        if e.max_queries is not None and not self.data.heldout:
            raise ConfigError("eval.max_queries caps the held-out queries, and there is no data.heldout")
        if e.every < 0:
            raise ConfigError(f"eval.every must be >= 0 (0: before the first and after the last step), got {e.every}")
        bad = {source: text for source, text in self.data.instructions.items()
               if not isinstance(source, str) or not isinstance(text, str)}
        if bad:
            raise ConfigError(f"data.instructions maps source names to instruction strings; not strings: {bad}")

    @property
    def token_cache_dir(self) -> Path:
        return Path(self.data.token_cache or Path(self.checkpoint.directory).parent / "token-cache").expanduser()

    @property
    def log_path(self) -> Path:
        return (Path(self.log) if self.log else Path(self.checkpoint.directory).parent / "metrics.jsonl").expanduser()


def _build(cls, raw, where: str):
    if raw is None:
        return cls()
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"{where + ': ' if where else ''}unknown key(s) {unknown}; known: {sorted(fields)}")
    hints = typing.get_type_hints(cls)
    values = {}
    for name, value in raw.items():
        values[name] = _coerce(hints[name], value, f"{where}.{name}" if where else name)
    try:
        return cls(**values)
    except TypeError as err:
        raise ConfigError(f"{where}: {err}") from None


def _coerce(hint, value, where):
    is_union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    options = typing.get_args(hint) if is_union else (hint,)
    if value is None:
        if type(None) in options:
            return None
        raise ConfigError(f"{where}: may not be null")
    errors = []
    for option in options:
        if option is type(None):
            continue
        if dataclasses.is_dataclass(option):
            return _build(option, value, where)
        origin = typing.get_origin(option)
        if origin is tuple:
            items = [value] if isinstance(value, str) else value
            if isinstance(items, list) and all(isinstance(v, str) for v in items):
                return tuple(items)
            errors.append("a list of strings")
        elif option is dict or origin is dict:
            if isinstance(value, dict):
                return dict(value)
            errors.append("a mapping")
        elif option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        elif option is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        elif option in (str, bool) and isinstance(value, option):
            return value
        else:
            errors.append(getattr(option, "__name__", str(option)))
    raise ConfigError(f"{where}: expected {' or '.join(errors)}, got {value!r}")


def load_train_config(path) -> TrainConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such training config file")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({err})") from None
    try:
        return _build(TrainConfig, raw or {}, "")
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None


def config_from_dict(raw: dict) -> TrainConfig:
    return _build(TrainConfig, raw, "")
