"""The fine-tuning loop: `jaxembed train CONFIG.yaml` (Section 3.1 and Appendix G).

    trainer = Trainer(load_train_config("configs/train/stdlib-tiny.yaml"))
    trainer.run()        # resumes from the latest checkpoint if there is one
    trainer.export()     # merged weights, readable by jaxembed.load

One process per host; every process runs the same code on the same deterministic data plan
and fills only its own shards of each global batch. Only process 0 writes the log and the
progress bar; every process takes part in checkpoints (orbax) and in the export's gather.
"""

from __future__ import annotations

import dataclasses
import glob
import inspect
import json
import math
import os
import signal
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from tqdm import tqdm

from jaxembed import checkpoint, models
from jaxembed.config import ConfigError, load_config
from jaxembed.distributed import check_processes_agree
from jaxembed.embedder import QUERY_TEMPLATE, Embedder, bucket_length, load_tokenizer
from jaxembed.errors import CheckpointError, TrainingDivergedError
from jaxembed.files import write_text_atomically
from jaxembed.text import text_ids
from jaxembed.train import data as data_lib
from jaxembed.train import lora as lora_lib
from jaxembed.train import pipeline
from jaxembed.train import sharding as sh
from jaxembed.train.config import TrainConfig
from jaxembed.train.quant import NF4Weight
from jaxembed.train.step import (
    BATCH_KEYS,
    StepConfig,
    TrainState,
    cap_length_plans,
    length_plan,
    make_optimizer,
    train_step,
)

KILL_AFTER_STEP_ENV = "JAXEMBED_TRAIN_KILL_AFTER_STEP"  # test hook: SIGKILL this process after that step
MERGE_ROUNDING_WARN = 0.1  # the share of an adapter's update the export may round away before it warns


def state_digest(state) -> dict[str, int]:
    """A 32-bit digest per array of the training state, computed where the arrays live (sharded, across
    processes) and independent of the sharding: sum over elements of bits x an odd weight of the element's
    global index, mod 2^32, so any single flipped bit changes it. Leaf paths name the arrays."""
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    digests = _leaf_digests([leaf for _, leaf in leaves])
    return {jax.tree_util.keystr(path): int(np.asarray(d.addressable_data(0))) for (path, _), d in
            zip(leaves, digests, strict=True)}


@jax.jit
def _leaf_digests(leaves):
    def digest(x):
        unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
        bits = (x.astype(jnp.uint8) if x.dtype == jnp.bool_ else jax.lax.bitcast_convert_type(x, unsigned))
        index = jnp.zeros(x.shape, jnp.uint32)
        for axis, size in enumerate(x.shape):  # the global flat index, without a reshape that would move shards
            index = index * jnp.uint32(size) + jax.lax.broadcasted_iota(jnp.uint32, x.shape, axis)
        weight = index * jnp.uint32(0x9E3779B1) * jnp.uint32(2) + jnp.uint32(1)
        return jnp.sum(bits.astype(jnp.uint32) * weight, dtype=jnp.uint32)

    return [digest(x) for x in leaves]


def initialize_distributed(cfg: TrainConfig) -> None:
    """jax.distributed for multi-host runs (before any other jax call); a no-op without the section."""
    d = cfg.distributed
    if d is None:
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices (tests) talk over gloo
    jax.distributed.initialize(coordinator_address=d.coordinator, num_processes=d.num_processes,
                               process_id=d.process_id)


def load_model(cfg: TrainConfig):
    """(architecture config, params as stored, tokenizer, embedder settings, the params' identity, the source's
    config.json or None) for the model section. The identity: a converted checkpoint's `checkpoint.fingerprint`
    (from its manifest), a Hugging Face checkpoint's hashed from its tensors (xxh3, seconds for a 7B model),
    random weights' from what draws them (config, seed, init_options), not from device arrays copied to the
    host."""
    m = cfg.model
    settings, ident, source_config = {}, None, None
    if m.path is not None:
        config, params, settings, directory, ident = checkpoint.open_model(m.path)
        tokenizer = _tokenizer(m.tokenizer, directory)
        source_config = checkpoint.source_config_of(directory)  # the export writes its fields back
    else:
        config = load_config(m.init)
        params = init_params(config, m)
        tokenizer = _tokenizer(m.tokenizer, None)
        ident = checkpoint.fingerprint(config, {"seed": str(m.seed), "init_options": json.dumps(
            m.init_options, sort_keys=True, default=str)})
    if ident is None:
        ident = checkpoint.fingerprint(config, checkpoint.tensor_checksums(params))
    if tokenizer is None:
        raise ConfigError("model.tokenizer: the model has no tokenizer; name one (a path, a hub id or 'stdlib-bpe:N')")
    if len(tokenizer) > config.vocab_size:
        raise ConfigError(
            f"model.tokenizer has {len(tokenizer)} tokens but the model's vocabulary has {config.vocab_size}"
        )
    return config, params, tokenizer, settings, ident, source_config


def init_params(config, m):
    """Random weights for `model.init`, with `model.init_options` as the family's init keywords."""
    init = models.family(config).init_params
    if m.init_options and m.path is not None:
        raise ConfigError("model.init_options applies to `init` (random weights), not to a checkpoint `path`")
    accepted = {name for name, p in inspect.signature(init).parameters.items() if p.kind is p.KEYWORD_ONLY}
    unknown = sorted(set(m.init_options) - accepted)
    if unknown:
        raise ConfigError(f"model.init_options: {unknown} not understood by {config.architecture}; "
                          f"it takes {sorted(accepted) or 'none'}")
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in m.init_options.items()}
    return init(config, jax.random.key(m.seed), **options)


def _tokenizer(spec, directory):
    if isinstance(spec, str) and spec.startswith("stdlib-bpe:"):
        from jaxembed.testing import make_tokenizer
        from jaxembed.train.tokenizer import SPECIAL_TOKENS

        size, least = spec.split(":", 1)[1], 256 + len(SPECIAL_TOKENS)  # the byte alphabet and the special tokens
        if not size.isdigit() or int(size) < least:
            raise ConfigError(f"model.tokenizer: {spec!r}: stdlib-bpe:N takes a vocabulary size N of at least {least} "
                              f"(256 bytes and {len(SPECIAL_TOKENS)} special tokens)")
        return make_tokenizer(int(size))
    return load_tokenizer(spec, directory)


@dataclass
class Batch:
    arrays: dict  # BATCH_KEYS -> host numpy arrays
    source: str
    tokens: int  # real (unpadded) tokens
    truncated: int  # texts cut to max_tokens
    plan: tuple[int, ...]  # the step's length groups: each group's padded length (step.length_plan)
    padded_tokens: int  # tokens the step computes, padding included


class Trainer:
    def __init__(self, cfg: TrainConfig, *, show_progress: bool = True, devices=None,
                 memory_limit_bytes: int | None = None):
        """devices: the mesh's devices (default: all devices of all processes). memory_limit_bytes:
        the device memory the step must fit in (default: the device's own limit; checked when
        grad_cache_size is 'auto', or given here)."""
        self.cfg = cfg
        self.show_progress = show_progress and jax.process_index() == 0
        self.mesh = sh.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, devices)
        self.shards = sh.batch_shards(self.mesh)
        t = cfg.train
        out = Path(cfg.output).expanduser() if cfg.output else None
        if out is not None and out.exists() and not out.is_dir():
            raise ConfigError(f"output: {out} exists and is not a directory; the export would be refused at the end "
                              "of training (choose a new or empty directory)")
        if out is not None and out.is_dir() and any(out.iterdir()) and not checkpoint.is_converted(out):
            raise ConfigError(f"output: {out} is not empty and not a jaxembed checkpoint; the export would be refused "
                              "at the end of training (choose a new or empty directory)")
        if out is not None and cfg.model.path and out.resolve() == Path(cfg.model.path).expanduser().resolve():
            raise ConfigError(f"output: {out} is model.path; the export would replace the base model that this run's "
                              "checkpoints are adapters of (choose another directory)")
        # the export names its run by the checkpoint directory: an existing model is replaced only if it is this
        # run's own earlier export
        self.export_run = f"(checkpoints: {Path(cfg.checkpoint.directory).expanduser().resolve()})"
        self.export_source = f"jaxembed train of {cfg.model.path or cfg.model.init} {self.export_run}"
        problem = self._export_problem(out, "output") if out is not None and jax.process_index() == 0 else None
        if jax.process_count() > 1:  # process 0 exports; every process stops with it, none waits at a barrier
            from jax.experimental import multihost_utils

            if bool(multihost_utils.broadcast_one_to_all(np.int32(problem is not None))) and problem is None:
                problem = "output: process 0 refuses to export there (its error says why)"
        if problem:
            raise ConfigError(problem)
        _check_written_paths(cfg)
        if t.batch_size % self.shards:
            raise ConfigError(f"train.batch_size={t.batch_size} is not a multiple of the {self.shards} batch shards "
                              f"(mesh data x fsdp)")

        # model: the stored params are kept on the host for the export's merge
        self.config, self.stored_params, self.tokenizer, settings, model_ident, self.source_config = load_model(cfg)
        # what a checkpoint's state is only meaningful with: resuming under another base or schedule is refused
        self.base_identity = f"{model_ident}:{cfg.model.dtype}:{cfg.quantization}"
        self.family = models.family(self.config)
        self.chunk_size = cfg.model.chunk_size or self.config.chunk_size
        self.eos = int(self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None
                       else self.config.eos_token_id)
        # the base model's own template unless the config names one: an E5-style model fine-tuned under the paper's
        # template would learn, and export, another prompt than the one it was made for
        self.query_template = cfg.data.query_template or settings.get("query_template") or QUERY_TEMPLATE
        self.default_instruction = settings.get("default_instruction")  # the base's, kept by the export
        try:
            if cfg.lora is None:  # full-parameter training: every param trains, as a float32 master
                self.lora = lora_lib.LoraConfig.full(self.stored_params)
            else:
                self.lora = lora_lib.LoraConfig(cfg.lora.rank, cfg.lora.alpha, cfg.lora.targets,
                                                cfg.lora.modules_to_save)
            if ("lm_head",) in self.lora.saved_paths(self.config, self.stored_params):  # fail early on unknown names
                raise ValueError("lora modules_to_save: 'lm_head' is read by no embedding (the output at EOS is "
                                 "taken before it); training it would only decay it")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        # an untied LM head stays on the host, as stored, for the export: no embedding reads it
        base = models.cast_params(self.family, {k: v for k, v in self.stored_params.items() if k != "lm_head"},
                                  cfg.model.dtype)
        if cfg.quantization == "nf4":
            base = lora_lib.quantize_base(self.config, base, self.lora.target_names(self.config))
        self.base_shardings = sh.param_shardings(base, self.mesh)
        self.base = sh.put(base, self.base_shardings)

        # data
        train_files = expand_globs(cfg.data.train)
        self.sources, self.report = data_lib.load_triples(train_files, negatives_per_query=cfg.data.negatives_per_query)
        self.sizes = {name: len(ds) for name, ds in self.sources.items()}
        self.heldout = None
        self.heldout_report = None
        if cfg.data.heldout:  # checked against the training rows before the tokenizing
            heldout, self.heldout_report = data_lib.load_triples(cfg.data.heldout, negatives_per_query=0)
            self.heldout = [row for ds in heldout.values() for row in ds]
            _check_heldout_apart(train_files, cfg.data.heldout, self.sources, self.heldout)
        # the first eval.max_queries queries, each ranked among all held-out positives (a cut pool would be easier)
        self.heldout_queries = (self.heldout[: cfg.eval.max_queries] if self.heldout and cfg.eval.max_queries
                                else self.heldout)
        documents = len({r["positive"] for r in self.heldout or []})
        if self.heldout and cfg.eval.k >= documents:
            warnings.warn(f"eval.k={cfg.eval.k} is at least the {documents} held-out documents: recall@{cfg.eval.k} "
                          "is 1 whatever the model", UserWarning, stacklevel=2)
        self._check_room_for_queries()
        self.heldout_identity = self._heldout_identity()
        # every text tokenized once, up front (cached by content); the loop only gathers ids
        self.tokens = pipeline.tokenize_sources(
            self.sources, tokenizer=self.tokenizer, eos=self.eos, max_tokens=cfg.data.max_tokens,
            query_text=lambda instruction, query, source: self.query_text(
                {"instruction": instruction, "query": query}, source),
            settings=lambda source: {"query_template": self.query_template,
                                     "instruction": cfg.data.instructions.get(source, "")},
            cache_dir=cfg.token_cache_dir, negatives_per_query=cfg.data.negatives_per_query,
            show_progress=self.show_progress,
            legacy_settings={"query_template": self.query_template,
                             "instructions": sorted(cfg.data.instructions.items())})
        self.data_fingerprint = ",".join(f"{name}:{t.fingerprint}" for name, t in sorted(self.tokens.items()))
        self.legacy_data_fingerprint = ",".join(f"{name}:{t.legacy_fingerprint}"
                                                for name, t in sorted(self.tokens.items()))
        self.steps_per_epoch = sum(n // t.batch_size for n in self.sizes.values())
        if self.steps_per_epoch == 0:
            raise ConfigError(
                f"train.batch_size={t.batch_size} is larger than every source's kept examples {self.sizes}"
            )
        self.leftover = data_lib.leftover(self.sizes, t.batch_size)
        never = {name: n for name, n in self.sizes.items() if n < t.batch_size}
        if never:  # a batch draws from one source
            warnings.warn(f"data: {', '.join(f'source {name!r} ({n} rows)' for name, n in never.items())} has fewer "
                          f"rows than train.batch_size={t.batch_size} and is never trained on", UserWarning,
                          stacklevel=2)
        self.total_steps = t.epochs * self.steps_per_epoch
        if t.max_steps is not None:
            self.total_steps = min(self.total_steps, t.max_steps)
        _check_processes_agree(cfg, base=self.base_identity, data=self.data_fingerprint,
                               heldout=str(self.heldout_identity))
        self._plans = {}
        known = set(self.sources) | {row["source"] for row in self.heldout or []}
        unknown = sorted(set(cfg.data.instructions) - known)
        if unknown:
            raise ConfigError(f"data.instructions: no training or held-out record has source {', '.join(unknown)}; "
                              f"the sources are {', '.join(sorted(known))}")

        # optimizer and step
        self.optimizer, self.lr_schedule = make_optimizer(t.learning_rate, self.total_steps,
                                                          warmup_steps=t.warmup_steps, weight_decay=t.weight_decay)
        key = jax.random.key(t.seed)
        adapters = lora_lib.init_adapters(self.config, base, self.lora, key)
        state = TrainState(jnp.zeros((), jnp.int32), adapters, self.optimizer.init(adapters),
                           jax.random.key_data(jax.random.fold_in(key, 1)))
        self.state_shardings = sh.param_shardings(state, self.mesh)
        self.state = sh.put(state, self.state_shardings)
        self.step_bytes: dict = {}  # grad_cache_size -> device bytes of the step at the longest batch
        linear = {n: int(np.prod(self.stored_params["layers"][n].shape))
                  for n in self.family.LINEAR_PARAMS if n in self.stored_params["layers"]}
        self.matmul_params = sum(linear.values())
        # 2N forward + 2N for the activations' gradients + 2N for the weights' gradients of the trained matrices:
        # a frozen base (LoRA, QLoRA) has none of the last (the adapters' own FLOPs are negligible)
        trained = self.matmul_params if cfg.lora is None else sum(
            size for n, size in linear.items() if n in cfg.lora.modules_to_save)
        self.flops_per_token = 4 * self.matmul_params + 2 * trained
        self.peak_flops = sh.peak_flops(self.mesh)  # for model FLOP utilisation; None where unknown
        self.grad_cache_size = self._fit_grad_cache(t.grad_cache_size, memory_limit_bytes)
        self.length_groups = self._length_groups(self.grad_cache_size)
        # every step's length plan, decided up front from the run's batches (at most MAX_LENGTH_PLANS
        # compilations; a pure function of the data and config, so resuming pads each step as before)
        self.length_plans = cap_length_plans([self._raw_length_plan(step) for step in range(self.total_steps)])
        self.step_config = self._step_config(self.grad_cache_size)
        self._step_fns = {}  # length plan -> the step compiled for it
        _check_shared_directory(Path(cfg.checkpoint.directory).expanduser().absolute())
        self.manager = ocp.CheckpointManager(
            Path(cfg.checkpoint.directory).expanduser().absolute(),
            options=ocp.CheckpointManagerOptions(max_to_keep=cfg.checkpoint.keep,
                                                 save_interval_steps=cfg.checkpoint.every,
                                                 cleanup_tmp_directories=True),
            # declared, so that item_metadata can read a checkpoint's state before it is restored
            item_handlers={"state": ocp.StandardCheckpointHandler(), "data": ocp.JsonCheckpointHandler()},
        )
        self.truncated = 0
        if cfg.tensorboard:
            _TensorBoard.check_installed()

    # ---- the step and whether it fits ------------------------------------------------------
    def _step_config(self, grad_cache_size) -> StepConfig:
        t = self.cfg.train
        return StepConfig(self.config, self.lora, t.temperature, grad_cache_size, t.remat, self.cfg.model.kernels,
                          self.chunk_size)

    def _jit_step(self, sc: StepConfig, plan: tuple[int, ...]):
        return jax.jit(
            partial(train_step, sc=sc, optimizer=self.optimizer, lr_schedule=self.lr_schedule,
                    sub_batch_sharding=sh.sub_batch_sharding(self.mesh), plan=plan,
                    row_sharding=sh.row_sharding(self.mesh)),
            in_shardings=(self.state_shardings, self.base_shardings, None),
            out_shardings=(self.state_shardings, sh.replicated(self.mesh)),
            donate_argnums=0,
        )

    def _step_fn(self, plan: tuple[int, ...]):
        """The step for a length plan, jit-ed once per plan (at most MAX_LENGTH_PLANS in a run)."""
        if plan not in self._step_fns:
            self._step_fns[plan] = self._jit_step(self.step_config, plan)
        return self._step_fns[plan]

    def _length_groups(self, grad_cache_size) -> int:
        """train.length_groups, or the largest count below it that splits the batch's N = B (2 + k)
        texts into equal groups that split evenly into the GradCache sub-batches. Not the mesh: a
        run computes the same on any number of devices (groups whose rows do not split over the
        batch shards are placed by the compiler)."""
        b, k = self.cfg.train.batch_size, self.cfg.data.negatives_per_query
        n_sub = 1 if grad_cache_size is None else b // grad_cache_size
        return next(g for g in range(self.cfg.train.length_groups, 0, -1) if b * (2 + k) % (g * n_sub) == 0)

    def _step_bytes(self, grad_cache_size) -> int | None:
        """Device bytes the step needs at the longest batch (`memory_analysis` of the compiled step:
        temporaries + arguments + outputs), or None when compiling it already runs out of memory."""
        if grad_cache_size in self.step_bytes:
            return self.step_bytes[grad_cache_size]
        b, k = self.cfg.train.batch_size, self.cfg.data.negatives_per_query
        L = bucket_length(self.cfg.data.max_tokens, self.chunk_size)
        shapes = {"query_ids": (b, L), "query_len": (b,), "pos_ids": (b, L), "pos_len": (b,), "neg_ids": (b, k, L),
                  "neg_len": (b, k)}
        batch = {key: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sh.batch_sharding(self.mesh, len(shape)))
                 for key, shape in shapes.items()}
        try:
            plan = (L,) * self._length_groups(grad_cache_size)  # every group at the longest: the step's most
            compiled = self._jit_step(self._step_config(grad_cache_size), plan).lower(self.state, self.base,
                                                                                        batch).compile()
            mem = compiled.memory_analysis()
        except Exception as err:  # XLA refuses to compile a step that cannot fit
            if "RESOURCE_EXHAUSTED" in str(err) or "out of memory" in str(err).lower():
                self.step_bytes[grad_cache_size] = None
                return None
            raise
        need = 0 if mem is None else int(mem.temp_size_in_bytes + mem.argument_size_in_bytes
                                         + mem.output_size_in_bytes - mem.alias_size_in_bytes)
        self.step_bytes[grad_cache_size] = need  # what was measured, for the log and tests
        return need

    def _fit_grad_cache(self, wanted, memory_limit_bytes=None):
        """The GradCache size to run with. "auto": the largest divisor of the batch (a multiple of
        the batch shards) whose step fits the device's memory; an explicit size (or None, the whole
        batch) is checked the same way, and one that does not fit is an error naming one that does,
        before the first step (not an out-of-memory at compile time). On accelerators every run is
        checked; on CPU only "auto" or an explicit memory_limit_bytes."""
        b = self.cfg.train.batch_size
        if wanted != "auto" and memory_limit_bytes is None and jax.default_backend() == "cpu":
            return wanted  # host memory: the step is not checked (a compile more per run for little)
        limit = memory_limit_bytes if memory_limit_bytes is not None else sh.device_memory_bytes(self.mesh)
        candidates = [g for g in range(b, 0, -1) if b % g == 0 and g % self.shards == 0]
        smallest = candidates[-1]  # one query per batch shard, at the least
        if wanted != "auto":
            need = self._step_bytes(wanted)
            if need is not None and need <= limit:
                return wanted
            candidates = [g for g in candidates if g < (b if wanted is None else wanted)]  # smaller ones only
        for g in candidates:
            need = self._step_bytes(g)
            if need is not None and need <= limit:
                if wanted == "auto":
                    return None if g == b else g
                raise ConfigError(
                    f"train.grad_cache_size={wanted}: the step needs more than the device's {_gib(limit)}; "
                    f"grad_cache_size: {g} fits ({_gib(need)}), or set grad_cache_size: auto")
        raise ConfigError(f"train.batch_size={b}: even one sub-batch of {smallest} queries needs more than the "
                          f"device's {_gib(limit)}; lower data.max_tokens or use a smaller model")

    # ---- data -------------------------------------------------------------------------
    def _plan(self, epoch: int):
        if epoch not in self._plans:
            self._plans = {epoch: data_lib.plan_batches(self.sizes, self.cfg.train.batch_size, seed=self.cfg.train.seed,
                                                        epoch=epoch)}
        return self._plans[epoch]

    def _check_room_for_queries(self) -> None:
        """A query prompt (template + instruction) as long as data.max_tokens leaves nothing of the query after the
        cut: every query of its source would be the same text. Refused, naming the source and the prompt's size."""
        if not self.cfg.data.max_tokens:
            return
        for source, ds in self.sources.items():
            instructions = {row or self.cfg.data.instructions.get(source, "") for row in ds["instruction"]}
            for instruction in sorted(i for i in instructions if i):
                prompt = self.query_template.format(prompt=instruction)
                n = len(text_ids(self.tokenizer, prompt, add_special_tokens=True)["input_ids"])
                if n + 1 >= self.cfg.data.max_tokens:  # + EOS
                    raise ConfigError(
                        f"data.max_tokens={self.cfg.data.max_tokens} leaves no room for the queries of source "
                        f"{source!r}: their prompt (the query template with instruction {instruction[:60]!r}) is {n} "
                        "tokens, so the cut would leave every query the same text; raise data.max_tokens or shorten "
                        "the instruction")

    def _heldout_identity(self) -> str | None:
        """What the held-out figures are computed on (the query texts as embedded, their positives, the
        documents ranked, k): a resumed run on another held-out set would log figures of two sets as one."""
        if not self.heldout:
            return None
        import xxhash

        what = {"queries": [[self.query_text(r, r["source"]), r["positive"]] for r in self.heldout_queries],
                "documents": sorted({r["positive"] for r in self.heldout}), "k": self.cfg.eval.k}
        return xxhash.xxh3_128_hexdigest(json.dumps(what, sort_keys=True).encode())

    def query_text(self, row, source: str) -> str:
        instruction = row.get("instruction") or self.cfg.data.instructions.get(source, "")
        return (self.query_template.format(prompt=instruction) if instruction else "") + row["query"]

    def _rows_of_step(self, step: int):
        epoch, index = divmod(step, self.steps_per_epoch)
        return self._plan(epoch)[index]

    def _raw_length_plan(self, step: int) -> tuple[int, ...]:
        source, rows = self._rows_of_step(step)
        return length_plan(self.tokens[source].text_lengths(rows), self.length_groups, self.chunk_size)

    def batch(self, step: int) -> Batch:
        """The global batch of update `step` (0-based): a pure function of the config and the step."""
        source, rows = self._rows_of_step(step)
        plan = self.length_plans[self._raw_length_plan(step)]
        arrays, tokens, truncated = self.tokens[source].batch(rows, self.chunk_size, length=plan[-1])
        texts = arrays["query_len"].size + arrays["pos_len"].size + arrays["neg_len"].size
        return Batch(arrays, source, tokens, truncated, plan, texts // len(plan) * sum(plan))

    def _device_batch(self, batch: Batch):
        return {key: sh.global_array(batch.arrays[key], sh.batch_sharding(self.mesh, batch.arrays[key].ndim))
                for key in BATCH_KEYS}

    # ---- checkpoints ------------------------------------------------------------------
    def _data_position(self, step: int) -> dict:
        t = self.cfg.train
        return {"step": step, "epoch": step // self.steps_per_epoch, "batch_in_epoch": step % self.steps_per_epoch,
                "seed": t.seed, "batch_size": t.batch_size, "sizes": self.sizes,
                "data": self.data_fingerprint, "truncated": self.truncated, "base": self.base_identity,
                "heldout": self.heldout_identity,
                "schedule": {"total_steps": self.total_steps, "learning_rate": t.learning_rate,
                             "warmup_steps": t.warmup_steps, "weight_decay": t.weight_decay,
                             "temperature": t.temperature, "lora_alpha": None if self.cfg.lora is None
                             else self.cfg.lora.alpha}}

    def save(self, step: int, *, force: bool = False) -> None:
        if not (force or self.manager.should_save(step)):  # called every step: orbax decides, no device sync
            return
        # orbax's chunks carry no checksum of their own (a flipped byte restores as a different value)
        position = {**self._data_position(step), "state_digest": state_digest(self.state)}
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(self.state),
                                                        data=ocp.args.JsonSave(position)), force=force)

    def restore(self) -> int:
        """Load the latest complete checkpoint, if any; returns the step to continue from."""
        step = self.manager.latest_step()
        if step is None:
            return 0
        abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), self.state,
                                self.state_shardings)
        position = self._restore_item(step, data=ocp.args.JsonRestore())["data"]
        self._check_position(step, position)
        self._check_restorable(step, abstract)
        self.state = self._restore_item(step, state=ocp.args.StandardRestore(abstract))["state"]
        recorded = position.get("state_digest")  # absent from checkpoints written before it was recorded
        if recorded is not None:
            actual = state_digest(self.state)
            bad = [name for name in sorted(set(recorded) | set(actual)) if recorded.get(name) != actual.get(name)]
            if bad:
                raise self._damaged(step, f"is corrupt: {len(bad)} array(s) differ from the digests recorded when "
                                          f"it was written ({', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''})")
        self.truncated = position["truncated"]
        return step

    def _restore_item(self, step: int, **items):
        """orbax's restore of some items of checkpoint `step`; a damaged checkpoint is a CheckpointError naming
        its directory and the one before it, not orbax's or TensorStore's internals."""
        try:
            return self.manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as err:
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
            raise self._damaged(step, f"is damaged or incomplete, its {' and '.join(items)} could not be read "
                                      f"({type(err).__name__}: {first})") from None

    def _damaged(self, step: int, what: str) -> CheckpointError:
        """A CheckpointError naming checkpoint `step`'s directory and the one to fall back to."""
        earlier = [s for s in self.manager.all_steps() if s < step]
        directory = Path(self.cfg.checkpoint.directory).expanduser() / str(step)
        return CheckpointError(f"{directory}: checkpoint {step} {what}. "
                               + (f"Remove that directory to resume from checkpoint {max(earlier)}." if earlier else
                                  "There is no earlier checkpoint: remove it to start over."))

    def _check_position(self, step: int, position: dict) -> None:
        """The checkpoint's data position and settings are this run's, or a ConfigError names each difference."""
        expected = self._data_position(step)
        differences = []
        for key in ("seed", "batch_size", "sizes", "data", "base", "heldout"):
            if key in ("base", "heldout") and key not in position:
                continue  # written before this was recorded
            if key == "heldout" and None in (position[key], expected[key]):
                continue  # a held-out set added or dropped: the log still never mixes two sets' figures
            if key == "data" and position.get(key) == self.legacy_data_fingerprint:
                continue  # the same data, recorded under the earlier key scheme
            if position.get(key) != expected[key]:
                differences.append({
                    "data": "other training data or tokenization (texts, tokenizer, max_tokens, template, "
                            "instructions)",
                    "base": "another base model (model.path / init / seed / init_options, model.dtype or "
                            "quantization)",
                    "heldout": "another held-out evaluation (data.heldout's rows, eval.max_queries or eval.k)",
                }.get(key, f"{key}={position.get(key)}, this run has {expected[key]}"))
        stored = position.get("schedule") or {}
        differences += [f"train.{key}={stored[key]}, this run has {expected['schedule'][key]}"
                        .replace("train.lora_alpha", "lora.alpha")
                        .replace("train.total_steps", "total steps (epochs / max_steps)")
                        for key in sorted(stored) if stored[key] != expected["schedule"].get(key)]
        if differences:
            raise ConfigError(
                f"{self.cfg.checkpoint.directory}: checkpoint {step} was written with {'; '.join(differences)}. "
                "Resuming would not continue that run (its learning-rate schedule, loss, batches and held-out "
                "figures depend on these): use the config it was written with, or a new checkpoint directory (to "
                "train further, start a new run from the exported model)")

    def _check_restorable(self, step: int, abstract) -> None:
        """The checkpoint's state has this run's leaves and shapes, or a ConfigError names the difference
        (orbax's own error is a structure dump from inside its restore)."""
        try:
            stored = _shapes_by_path(self.manager.item_metadata(step)["state"])
        except Exception:  # no readable metadata: the restore itself reports what is wrong
            return
        if not stored:
            return
        wanted = _shapes_by_path(abstract)
        if stored == wanted:
            return
        differences = [(title, names) for title, names in (
            ("only in the checkpoint", sorted(set(stored) - set(wanted))),
            ("only in this run", sorted(set(wanted) - set(stored))),
            ("other shapes", [f"{k} {stored[k]} -> {wanted[k]}" for k in sorted(set(stored) & set(wanted))
                              if stored[k] != wanted[k]]),
        ) if names]
        raise ConfigError(f"{self.cfg.checkpoint.directory}: checkpoint {step} holds another training state than "
                          "this run's (another model layout, LoRA rank or targets, or lora: null): "
                          + "; ".join(f"{title}: {', '.join(names[:4])}" + (" ..." if len(names) > 4 else "")
                                      for title, names in differences)
                          + ". Use a new checkpoint directory, or the config it was written with")

    # ---- evaluation -------------------------------------------------------------------
    def embedder(self) -> Embedder:
        """The model as it is now (adapters applied, not merged), for encoding."""
        return Embedder(lora_lib.apply(self.base, self.state.adapters, self.lora, self.config), self.config,
                        tokenizer=self.tokenizer, chunk_size=self.chunk_size, query_template=self.query_template,
                        kernels=self.cfg.model.kernels)

    def evaluate(self) -> dict:
        """Held-out retrieval: recall@k of each query's positive among all held-out positives."""
        rows = self.heldout_queries
        model = self.embedder()
        kwargs = dict(batch_size=self.cfg.eval.batch_size, max_length=self.cfg.data.max_tokens, show_progress_bar=False)
        docs = sorted({r["positive"] for r in self.heldout})
        doc_index = {d: i for i, d in enumerate(docs)}
        with warnings.catch_warnings():  # truncation to data.max_tokens is the configured behaviour here
            warnings.simplefilter("ignore", UserWarning)
            q = model.encode([self.query_text(r, r["source"]) for r in rows], **kwargs)
            d = model.encode(docs, **kwargs)
        return retrieval_metrics(q @ d.T, np.array([doc_index[r["positive"]] for r in rows]), self.cfg.eval.k)

    # ---- the loop ---------------------------------------------------------------------
    def train_step(self, step: int) -> dict:
        """Update `step` (0-based) on its batch, synchronously; returns the log row (loss, lr, grad_norm,
        tokens/s, ...). `run` pipelines the same steps."""
        tick = time.perf_counter()
        batch = self.batch(step)
        self.truncated += batch.truncated
        metrics, compile_s = self._dispatch(batch)
        row = self._rows([(step, batch, metrics, self.truncated)], tick, 0.0, compile_s)[0]
        self._check_finite([row])
        return row

    def _check_finite(self, rows: list[dict]) -> None:
        """Stop at the first step whose loss, gradient norm or updated parameters' norm is not finite.
        Called before any later checkpoint is written: the parameters it produced are never saved,
        and every saved checkpoint holds finite parameters of norm below ~1e19 (the norm's squares
        overflow past that), from which a rerun resumes."""
        watched = ("loss", "grad_norm", "param_norm")
        for row in rows:
            bad = [name for name in watched if not math.isfinite(row[name])]
            if not bad:
                continue
            values = ", ".join(f"{name.replace('_', ' ')} {row[name]:.4g}" for name in watched)
            cause = ("the step's update made the parameters overflow" if bad == ["param_norm"]
                     else f"non-finite {' and '.join(name.replace('_', ' ') for name in bad)}")
            latest = self.manager.latest_step()
            saved = (f"the checkpoint of step {latest} holds finite parameters, and a rerun resumes from it"
                     if latest is not None else "no checkpoint was written before it")
            raise TrainingDivergedError(
                f"training diverged at step {row['step']}: {cause} ({values}; learning rate {row['lr']:.3g}). Its "
                f"parameters are not saved; {saved}. Lower train.learning_rate or lengthen train.warmup_steps"
                + (", or train in float32 (model.dtype) to see whether bf16 overflows"
                   if self.cfg.model.dtype == "bfloat16" else ""))

    def _dispatch(self, batch) -> tuple[dict, float]:
        """Start the step on `batch` (asynchronously): its device metrics, and the seconds spent
        compiling: the call's time when its length plan is new (jit traces and compiles before it
        dispatches), else 0."""
        new_plan = batch.plan not in self._step_fns
        tick = time.perf_counter()
        self.state, metrics = self._step_fn(batch.plan)(self.state, self.base, self._device_batch(batch))
        return metrics, time.perf_counter() - tick if new_plan else 0.0

    def _rows(self, pending, window_start: float, input_wait_s: float, compile_s: float) -> list[dict]:
        """Log rows of the steps in `pending` [(step, batch, device metrics, truncated so far)], their
        metrics read back in one transfer; throughput over the wall time from `window_start` until
        they are done (steps are dispatched asynchronously: the read-back is where they finish), less
        the `compile_s` spent compiling new length plans (reported on its own)."""
        values = jax.device_get([m for _, _, m, _ in pending])
        seconds = max(time.perf_counter() - window_start - compile_s, 1e-9)
        tokens = sum(b.tokens for _, b, _, _ in pending)
        flops = self.flops_per_token * tokens  # model FLOPs (forward + backward), no recompute counted
        window = {"tokens_per_s": tokens / seconds, "input_wait_share": input_wait_s / seconds,
                  "mfu": None if self.peak_flops is None else flops / seconds / self.peak_flops,
                  "compile_s": compile_s}
        return [{"step": step + 1, **{k: float(v) for k, v in m.items()}, "tokens": batch.tokens,
                 "padded_tokens": batch.padded_tokens, **window,
                 "source": batch.source, "truncated_total": truncated}
                for (step, batch, _, truncated), m in zip(pending, values, strict=True)]

    def _evaluates_at(self, step: int) -> bool:
        """Held-out metrics are computed every eval.every steps and after the last."""
        every = self.cfg.eval.every
        return bool(every and step % every == 0) or step == self.total_steps

    def _evaluation_lost(self, log, start: int) -> bool:
        """Whether a run stopped (killed, Ctrl-C) after step `start`'s checkpoint but before its evaluation
        was logged, the final one above all: then it is computed now. Process 0 reads the log; every
        process takes its answer, since the evaluation runs on all of them."""
        if not self._evaluates_at(start):
            return False
        lost = log is not None and start not in log.evaluated_steps
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            lost = bool(multihost_utils.broadcast_one_to_all(np.int32(lost)))
        return lost

    def run(self) -> list[dict]:
        """Train to the end (resuming from the latest checkpoint); returns this call's log rows."""
        log = board = pool = None
        rows = []
        try:  # every error, from the restore on, still waits for orbax's background work (a clean exit)
            start = self.restore()
            log = _Log(self.cfg.log_path, keep_through=start) if jax.process_index() == 0 else None
            # steps <= start are kept, as in the log
            board = (_TensorBoard(self.cfg.tensorboard, purge_step=start + 1)
                     if self.cfg.tensorboard and jax.process_index() == 0 else None)

            def record(row):
                rows.append(row)
                if log:
                    log.write(row)
                if board:
                    board.write(row)

            if log and start == 0:
                record({"event": "data", **self.report_dict()})
            if self.heldout and (start == 0 or self._evaluation_lost(log, start)):
                record({"step": start, **{f"eval/{k}": v for k, v in self.evaluate().items()}})
            kill_after = int(os.environ.get(KILL_AFTER_STEP_ENV, "0") or 0)
            bar = tqdm(total=self.total_steps, initial=start, desc="training", unit="step",
                       disable=not self.show_progress)
            # Input pipeline: texts were tokenized once (self.tokens); a thread gathers and pads step s+1's
            # batch while the devices run step s, and the (asynchronous) device put follows in this thread.
            # The wait for the host batch is the input-wait share. Metrics come back every
            # train.log_every steps, not once per step. Batches are still a pure function of the step, so
            # resuming stays exact.
            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jaxembed-batches")
            upcoming = pool.submit(self.batch, start) if start < self.total_steps else None
            pending, window_start, waited, compiling = [], time.perf_counter(), 0.0, 0.0

            def flush():
                nonlocal pending, window_start, waited, compiling
                if pending:
                    flushed = self._rows(pending, window_start, waited, compiling)
                    for row in flushed:
                        record(row)
                    self._check_finite(flushed)  # logged first, so metrics.jsonl shows the step that diverged
                    last = rows[-1]
                    bar.set_postfix(loss=f"{last['loss']:.4f}", lr=f"{last['lr']:.2e}",
                                    tok_s=f"{last['tokens_per_s']:.0f}", wait=f"{last['input_wait_share']:.0%}")
                pending, window_start, waited, compiling = [], time.perf_counter(), 0.0, 0.0

            for step in range(start, self.total_steps):
                tick = time.perf_counter()
                batch = upcoming.result()
                waited += time.perf_counter() - tick
                upcoming = pool.submit(self.batch, step + 1) if step + 1 < self.total_steps else None
                self.truncated += batch.truncated
                metrics, compile_s = self._dispatch(batch)
                compiling += compile_s
                pending.append((step, batch, metrics, self.truncated))
                bar.update(1)
                last = step + 1 == self.total_steps
                saving = self.manager.should_save(step + 1) or last
                evaluating = self.heldout and self._evaluates_at(step + 1)
                if len(pending) >= self.cfg.train.log_every or saving or evaluating or step + 1 == kill_after:
                    flush()
                self.save(step + 1, force=last)
                if saving:  # the save's device-to-host copy is not the steps' time (the window was flushed)
                    window_start = time.perf_counter()
                if evaluating:
                    record({"step": step + 1, **{f"eval/{k}": v for k, v in self.evaluate().items()}})
                    window_start = time.perf_counter()
                if kill_after and step + 1 == kill_after:
                    os.kill(os.getpid(), signal.SIGKILL)
            flush()
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
            if board:
                board.close()
            # also when a step fails: the last good checkpoint's background commit must complete
            self.manager.wait_until_finished()
        bar.close()
        return rows

    def data_summary(self) -> str:
        """One line: what was read and kept, what every epoch leaves out, the held-out set, the steps."""
        parts = [self.report.summary()]
        left = sum(self.leftover.values())
        if left:
            parts.append(f"{left} kept rows left out of every epoch (each source's last partial batch: "
                         + ", ".join(f"{name} {n}" for name, n in self.leftover.items() if n) + ")")
        if self.heldout_report is not None:
            heldout = self.heldout_report.summary(unused_because="held-out queries are ranked among the held-out "
                                                  "positives")
            parts.append(f"held-out: {heldout}"
                         + (f", the first {len(self.heldout_queries)} queries evaluated against all "
                            f"{len(self.heldout)} (eval.max_queries)"
                            if len(self.heldout_queries) < len(self.heldout) else ""))
        parts.append(f"{self.steps_per_epoch} steps per epoch, {self.total_steps} steps")
        return "; ".join(parts)

    def report_dict(self) -> dict:
        r = self.report
        return {"rows": r.rows, "kept": r.kept, "dropped_empty": r.dropped_empty,
                "dropped_few_negatives": r.dropped_few_negatives, "unused_negatives": r.unused_negatives,
                "leftover_partial_batches": self.leftover, "steps_per_epoch": self.steps_per_epoch,
                "length_groups": self.length_groups, "length_plans": sorted(set(self.length_plans.values())),
                "total_steps": self.total_steps}

    # ---- export -----------------------------------------------------------------------
    def merged_params(self):
        """The weights training ran on with the adapters folded in (float32 sum, cast back to each leaf's stored
        dtype): the stored weights, with QLoRA's quantised matrices as training saw them (`_export_base`). A
        stored dtype that rounds away much of an update (bfloat16) is warned about, naming the matrices."""
        from jax.experimental import multihost_utils

        adapters = jax.tree.map(jnp.asarray, multihost_utils.process_allgather(self.state.adapters, tiled=True))
        base = self._export_base()
        lost = {name: share for name, share in lora_lib.merge_rounding(base, adapters, self.lora, self.config).items()
                if share > MERGE_ROUNDING_WARN}
        if lost:
            warnings.warn("export: casting the merged weights back to their stored dtype rounds away part of the "
                          "adapters' update: " + ", ".join(f"{name} {share:.0%}" for name, share in lost.items())
                          + ". Train from a float32 copy of the base (model.dtype: bfloat16 still computes in "
                          "bf16) to export the update whole", UserWarning, stacklevel=2)
        return jax.tree.map(np.asarray, lora_lib.merge(base, adapters, self.lora, self.config))

    def _export_base(self):
        """The stored weights, each NF4-quantised matrix replaced by its dequantised values (what every step and
        evaluation multiplied by) in the stored dtype: the adapters were fitted to those, so merging them there
        exports the model that was trained and evaluated, not the float base that none of it saw."""
        from jax.experimental import multihost_utils

        stored = jax.tree.map(jnp.asarray, self.stored_params)
        if self.cfg.quantization != "nf4":
            return stored
        layers = dict(stored["layers"])
        for name, leaf in self.base["layers"].items():
            if isinstance(leaf, NF4Weight):
                nf4 = multihost_utils.process_allgather(leaf, tiled=True)
                layers[name] = jnp.asarray(nf4.dense()).astype(layers[name].dtype)
        return {**stored, "layers": layers}

    def export(self, directory=None) -> Path | None:
        """Write the merged model (orbax + jaxembed.json + tokenizer); `jaxembed.load` reads it."""
        directory = directory or self.cfg.output
        if directory is None:
            raise ConfigError("no export directory: set `output` in the config")
        params = self.merged_params()
        if jax.process_index() != 0:
            return None
        problem = self._export_problem(Path(directory).expanduser(), "the export directory")
        if problem:
            raise ConfigError(problem)
        # the run's own output: replaced (atomically) by each export
        embedder = {"query_template": self.query_template} | (
            {"default_instruction": self.default_instruction} if self.default_instruction else {})
        return checkpoint.save(directory, self.config, params, embedder=embedder,
                               source=self.export_source, tokenizer=self.tokenizer,
                               source_config=self.source_config, overwrite=True)

    def _export_problem(self, directory: Path, name: str) -> str | None:
        """A jaxembed model at `directory` is replaced only if this run (its checkpoint directory) wrote it."""
        if not checkpoint.is_converted(directory):
            return None
        try:
            source = json.loads((directory / checkpoint.MANIFEST).read_text()).get("source")
        except (OSError, ValueError, AttributeError):
            source = None
        if isinstance(source, str) and source.endswith(self.export_run):
            return None
        return (f"{name}: {directory} holds another model (written by {source or 'an unknown source'}), not this "
                "run's export; the export would replace it. Choose a new directory, or remove that one")


# paths, whose files the identities compare instead (the model's, the data's tokens), or that only name where
# output goes
_PATHS_COMPARED_BY_CONTENT = (
    ("model", "path"), ("model", "init"), ("model", "tokenizer"), ("data", "train"), ("data", "heldout"),
    ("data", "token_cache"), ("checkpoint", "directory"), ("output", None), ("log", None), ("tensorboard", None))


def _check_processes_agree(cfg: TrainConfig, **identities: str) -> None:
    """Under jax.distributed every process must train the same run: a process with another learning rate, batch
    or data would update its own replica differently and the checkpoint would hold a mix. Each section of the
    config (all but `distributed`, paths aside) and each identity is compared; the differing ones are named."""
    if jax.process_count() == 1:
        return
    sections = dataclasses.asdict(cfg)
    for section, key in _PATHS_COMPARED_BY_CONTENT:  # hosts may mount shared storage under other names
        if isinstance(sections.get(section), dict):
            sections[section][key] = None
        elif key is None:
            sections[section] = None
    parts = {name: json.dumps(value, sort_keys=True, default=str) for name, value in sections.items()
             if name != "distributed"}
    parts.update({f"{name} (its content)": value for name, value in identities.items()})
    check_processes_agree(parts, error=ConfigError,
                          advice="every process must have the same config apart from `distributed`")


def _check_shared_directory(directory: Path) -> None:
    """Under jax.distributed, every process must see the checkpoint directory process 0 writes (orbax's saves wait
    for files the primary process creates, and hung when a process had a directory of its own): process 0 writes
    a marker with a fresh token, and each process looks for it."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    token = int(multihost_utils.broadcast_one_to_all(np.frombuffer(os.urandom(4), np.uint32)[0]))
    marker = directory / f".jaxembed-shared-{token:08x}"
    if jax.process_index() == 0:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            marker.touch()
        except OSError:  # said on every process below: an error here alone would leave the others at the barrier
            pass
    multihost_utils.sync_global_devices("jaxembed train: the checkpoint directory's marker is written")
    sees = np.asarray(multihost_utils.process_allgather(np.array([marker.exists()], np.int32)))[:, 0]
    multihost_utils.sync_global_devices("jaxembed train: every process has looked for the marker")
    if jax.process_index() == 0:
        marker.unlink(missing_ok=True)
    blind = [i for i, seen in enumerate(sees.tolist()) if not seen]
    if 0 in blind:
        raise ConfigError(f"checkpoint.directory: process 0 cannot write in {directory}")
    if blind:
        raise ConfigError(f"checkpoint.directory: process(es) {blind} cannot see what process 0 writes in "
                          f"{directory}: it must be on storage that every process shares (the same directory)")


def _check_written_paths(cfg: TrainConfig) -> None:
    """The paths a run writes, checked before the model loads and the data is tokenized (minutes of work
    that a log path in a file's place would otherwise throw away at the first step)."""
    paths = [("log", cfg.log_path, "file"), ("data.token_cache", cfg.token_cache_dir, "dir"),
             ("checkpoint.directory", Path(cfg.checkpoint.directory).expanduser(), "dir")]
    if cfg.tensorboard:
        paths.append(("tensorboard", Path(cfg.tensorboard).expanduser(), "dir"))
    for what, path, kind in paths:
        if kind == "file" and path.is_dir():
            raise ConfigError(f"{what}: {path} is a directory; the metrics log is a file")
        if kind == "dir" and path.exists() and not path.is_dir():
            raise ConfigError(f"{what}: {path} exists and is not a directory")
        existing = next(p for p in path.absolute().parents if p.exists())  # what mkdir would create it under
        if not existing.is_dir():
            raise ConfigError(f"{what}: {path} cannot be created: {existing} is a file, not a directory")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ConfigError(f"{what}: {path} cannot be created: {existing} is not writable")


def _gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB"


def expand_globs(patterns) -> list[str]:
    """Each entry as given, or the sorted files matching it when it holds a glob pattern; a file named twice
    (by two patterns, or a link to it) once, with a warning: read twice, every row would be its own
    duplicate in training, a positive also a negative of its own query."""
    files, seen, twice = [], {}, []
    for pattern in patterns:
        if any(c in pattern for c in "*?["):
            matched = sorted(glob.glob(os.path.expanduser(pattern)))
            if not matched:
                raise ConfigError(f"data.train: no files match {pattern!r}")
        else:
            matched = [pattern]
        for name in matched:
            real = Path(name).expanduser().resolve()
            if real in seen:
                twice.append(f"{name} (also {seen[real]})")
                continue
            seen[real] = name
            files.append(name)
    if twice:
        warnings.warn(f"data.train names {len(twice)} file(s) more than once, read once: {', '.join(twice[:5])}",
                      UserWarning, stacklevel=2)
    by_stem: dict[str, list[str]] = {}
    for name in files:
        by_stem.setdefault(Path(name).stem, []).append(name)
    shared = {stem: names for stem, names in by_stem.items() if len(names) > 1}
    if shared:  # a source is its file's stem unless rows name their own
        warnings.warn("data.train: " + "; ".join(f"{', '.join(names)} are all source {stem!r}" for stem, names
                                                 in shared.items())
                      + " (batched together, sharing data.instructions); give rows a `source` field to keep them "
                        "apart", UserWarning, stacklevel=2)
    return files


def _check_heldout_apart(train_files: list[str], heldout_file: str, sources: dict, heldout_rows: list) -> None:
    """Held-out rows that are also trained on make the evaluation a measure of memorisation: a held-out file
    among the training files (`data/*.jsonl` matches the corpus's heldout.jsonl), or a held-out (query,
    positive) pair found in training, is refused."""
    held = Path(heldout_file).expanduser().resolve()
    if any(Path(name).expanduser().resolve() == held for name in train_files):
        raise ConfigError(f"data.heldout {heldout_file} is also a training file (data.train: "
                          f"{', '.join(train_files[:5])}): the held-out rows would be trained on")
    pairs = {(row["query"], row["positive"]) for row in heldout_rows}
    shared = [q for ds in sources.values() for q, p in zip(ds["query"], ds["positive"], strict=True) if (q, p) in pairs]
    if shared:
        raise ConfigError(f"data.heldout: {len(shared)} training row(s) hold a held-out (query, positive) pair, e.g. "
                          f"query {shared[0][:60]!r}: the evaluation would measure what was trained on; remove them "
                          "from one side")


def retrieval_metrics(scores: np.ndarray, targets: np.ndarray, k: int) -> dict:
    """recall@k, MRR@k and nDCG@k of each query's one relevant doc, its target column in scores [queries,
    docs] (ties count against)."""
    target_scores = scores[np.arange(len(targets)), targets]
    rank = (scores > target_scores[:, None]).sum(axis=1) + (scores == target_scores[:, None]).sum(axis=1) - 1
    hit = rank < k
    return {f"recall@{k}": float(hit.mean()), f"mrr@{k}": float(np.where(hit, 1.0 / (rank + 1), 0.0).mean()),
            f"ndcg@{k}": float(np.where(hit, 1.0 / np.log2(rank + 2), 0.0).mean()),
            "queries": int(len(targets)), "docs": int(scores.shape[1])}


class _TensorBoard:
    """The log's numeric fields as TensorBoard scalars (tensorboardX's writer). On resume from step s,
    TensorBoard hides the killed run's events after s (purge_step s + 1), as the jsonl drops them."""

    @staticmethod
    def check_installed() -> None:
        try:
            import tensorboardX  # noqa: F401
        except ImportError:
            raise ConfigError("tensorboard: needs the tensorboardX package (pip install 'jaxembed[tensorboard]')"
                              ) from None

    def __init__(self, directory: str, purge_step: int):
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(str(Path(directory).expanduser()), purge_step=purge_step)

    def write(self, row: dict) -> None:
        if "step" not in row:
            return
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key if "/" in key else f"train/{key}", value, row["step"])
        self.writer.flush()  # rows come every log_every steps; a killed run keeps what it logged

    def close(self) -> None:
        self.writer.close()


class _Log:
    """metrics jsonl; on resume from step s, rows after s (from the killed run) are dropped first,
    so the file is one trajectory."""

    def __init__(self, path: Path, keep_through: int):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if keep_through and path.exists():
            lines = [line for line in path.read_text().splitlines() if line.strip()]
            for number, line in enumerate(lines, 1):
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    if number == len(lines):  # a row torn by a kill in the middle of its write
                        break
                    raise ValueError(f"{path}:{number}: not a JSON row; move the file away to start its log "
                                     "afresh") from None
                if row.get("step", 0) <= keep_through:
                    kept.append(row)
        # steps whose held-out evaluation is logged (a resumed run computes a lost one again)
        self.evaluated_steps = {row["step"] for row in kept if any(k.startswith("eval/") for k in row)}
        write_text_atomically(path, "".join(json.dumps(row, allow_nan=False) + "\n" for row in kept))

    def write(self, row: dict) -> None:
        # strict JSON: a diverged step's NaN / inf metrics are written as null
        row = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(row, allow_nan=False) + "\n")
            f.flush()
            os.fsync(f.fileno())


def _shapes_by_path(tree) -> dict[str, tuple]:
    """{"adapters/layers/in_proj/a": shape, ...}: a pytree's leaves by path, whether it is the live state
    (NamedTuples, attributes) or orbax's metadata of it (dicts, lists)."""
    def name(key):
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                return str(getattr(key, attr))
        return str(key)

    return {"/".join(name(k) for k in path): tuple(getattr(leaf, "shape", ()))
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}
