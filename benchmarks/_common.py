"""Shared pieces of the benchmark scripts: thread pinning, the three implementations, timing.

Import order matters: `pin_threads` must run before jax or torch is imported, so that every
method in a run sees the same CPUs (XLA sizes its thread pool from the process's CPU affinity,
torch from `torch.set_num_threads`, BLAS libraries from the *_NUM_THREADS variables).
Nothing here runs at import time.
"""

from __future__ import annotations

import os
import platform
import resource
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs" / "models"

# The implementations a benchmark can time, besides jaxembed (split by schedule in the scripts).
# Per architecture: the reference implementations users would otherwise run.
PEERS_BY_ARCH = {
    "mamba2": ("mamba2-jax", "torch"),  # PyPI mamba2-jax; transformers Mamba2Model (PyTorch path)
    "rwkv7": ("rwkv",),  # BlinkDL's pip `rwkv` (RWKV_V7_ON=1, strategy "cpu fp32")
    "xlstm": ("torch",),  # transformers xLSTMModel (native torch kernels)
}
PEERS = tuple(dict.fromkeys(p for peers in PEERS_BY_ARCH.values() for p in peers))
PEER_LABELS = {"mamba2-jax": "mamba2-jax", "torch": "transformers (PyTorch)", "rwkv": "rwkv (BlinkDL, PyTorch)"}


def peers_for(cfg) -> tuple[str, ...]:
    return PEERS_BY_ARCH[cfg.architecture]


# ---- environment --------------------------------------------------------------------------
def pin_threads(threads: int | None) -> dict:
    """Restrict this process (and its children) to `threads` CPUs, for jax, torch and BLAS alike.

    Call before importing jax or torch. Returns a description of the settings for the log.
    """
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads must be >= 1, got {threads}")
        if threads > len(cpus):
            print(f"warning: --threads {threads} > {len(cpus)} available CPUs; using {len(cpus)}")
            threads = len(cpus)
        cpus = cpus[:threads]
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cpus)
    n = len(cpus)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(n)
    return {
        "threads": n,
        "cpus": ",".join(map(str, cpus)),
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
        "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", ""),
    }


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _proc_status_mib(field: str, pid: int | str = "self") -> float:
    """A memory field of /proc/<pid>/status (VmRSS, VmHWM, ...) in MiB; NaN where unavailable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError):
        pass
    return float("nan")


def current_rss_mib(pid: int | str = "self") -> float:
    return _proc_status_mib("VmRSS", pid)


def reset_peak_rss() -> bool:
    """Reset the kernel's high-water mark VmHWM (not ru_maxrss) so that `hwm_rss_mib` measures
    the peak from now on. Linux only; returns False where it is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def hwm_rss_mib() -> float:
    """Peak RSS since the last `reset_peak_rss` (or since the start)."""
    return _proc_status_mib("VmHWM")


def available_memory_mib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError):
        pass
    return float("nan")


def versions() -> dict:
    out = {}
    for name in ("jax", "jaxlib", "torch", "transformers", "flax", "mamba2_jax", "rwkv"):
        try:
            mod = __import__(name)
            out[name] = getattr(mod, "__version__", "?")
        except Exception:
            out[name] = "unavailable"
    return out


def load_config(path):
    from jaxembed.config import load_config as _load

    return _load(path)


def random_ids(vocab_size: int, batch: int, length: int, seed: int = 0):
    import numpy as np

    return np.random.default_rng(seed).integers(0, vocab_size, size=(batch, length), dtype=np.int32)


# ---- the implementations ----------------------------------------------------------------
# Each builder returns a zero-argument `run()` that does one forward pass of the whole model
# over ids and waits for the result; the result is the last position's final-norm hidden state
# (the embedding), [batch, d].
def build_jaxembed(cfg, ids, vertical_chunk_size, seed: int = 0, params=None):
    """jaxembed's pure `embed` under jax.jit; V=None is horizontal, an int is vertical.

    `params` lets several schedules share one set of random weights.
    """
    import jax
    import jax.numpy as jnp

    from jaxembed import models
    from jaxembed.schedule import embed

    if params is None:
        params = models.family(cfg).init_params(cfg, jax.random.key(seed))
    fn = jax.jit(lambda p, i, n: embed(p, cfg, i, n, vertical_chunk_size=vertical_chunk_size))
    ids_d = jnp.asarray(ids)
    lens = jnp.full((ids.shape[0],), ids.shape[1], jnp.int32)
    jax.block_until_ready((params, ids_d, lens))

    def run():
        return fn(params, ids_d, lens).block_until_ready()

    return run


def build_mamba2_jax(cfg, ids, seed: int = 0):
    """The PyPI `mamba2_jax` package (Flax NNX), same shapes, called under nnx.jit."""
    import jax
    import jax.numpy as jnp
    import mamba2_jax
    from flax import nnx

    mcfg = mamba2_jax.Mamba2Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        state_size=cfg.d_state,
        head_dim=cfg.head_dim,
        chunk_size=cfg.chunk_size,
        num_hidden_layers=cfg.n_layers,
        expand=cfg.expand,
        conv_kernel=cfg.d_conv,
    )
    if cfg.n_groups != 1:
        raise ValueError("mamba2_jax supports n_groups=1 only")
    model = mamba2_jax.Mamba2Model(mcfg, rngs=nnx.Rngs(seed))

    @nnx.jit
    def fwd(model, input_ids):
        return model(input_ids=input_ids)["last_hidden_state"][:, -1]

    ids_d = jnp.asarray(ids)
    jax.block_until_ready(ids_d)

    def run():
        return fwd(model, ids_d).block_until_ready()

    return run


def build_torch(cfg, ids, threads: int, seed: int = 0):
    """transformers' model of the architecture in float32 on CPU (pure-PyTorch paths)."""
    if cfg.architecture == "xlstm":
        return build_torch_xlstm(cfg, ids, threads, seed)
    if cfg.architecture != "mamba2":
        raise ValueError(f"no transformers peer for {cfg.architecture}")
    import warnings

    import torch
    from transformers import Mamba2Config, Mamba2Model

    warnings.filterwarnings("ignore", message=".*falling back.*")
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    tcfg = Mamba2Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        state_size=cfg.d_state,
        num_heads=cfg.n_heads,
        head_dim=cfg.head_dim,
        n_groups=cfg.n_groups,
        expand=cfg.expand,
        conv_kernel=cfg.d_conv,
        chunk_size=cfg.chunk_size,
        num_hidden_layers=cfg.n_layers,
        use_cache=False,
    )
    model = Mamba2Model(tcfg).eval().to(torch.float32)
    ids_t = torch.from_numpy(ids).long()

    def run():
        with torch.no_grad():
            return model(input_ids=ids_t, use_cache=False).last_hidden_state[:, -1].clone()

    return run


def build_torch_xlstm(cfg, ids, threads: int, seed: int = 0):
    """transformers' xLSTMModel in float32 with its native torch kernels (what runs on a CPU)."""
    import torch
    from transformers import xLSTMModel

    from jaxembed.convert.xlstm import to_transformers_config

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    model = xLSTMModel(to_transformers_config(cfg)).eval().to(torch.float32)
    ids_t = torch.from_numpy(ids).long()

    def run():
        with torch.no_grad():
            return model(input_ids=ids_t).last_hidden_state[:, -1].clone()

    return run


def build_rwkv(cfg, ids, threads: int, seed: int = 0):
    """BlinkDL's `rwkv` package (RWKV_V7_ON=1, "cpu fp32") on a random BlinkDL-layout .pth.

    It runs one sequence per call (no batch axis), so a batch is a loop over rows.
    """
    import tempfile

    os.environ["RWKV_V7_ON"] = "1"
    import torch
    from rwkv.model import RWKV

    from jaxembed.testing.rwkv7 import write_random_blinkdl

    torch.set_num_threads(threads)
    directory = Path(tempfile.mkdtemp(prefix="rwkv_peer_"))
    path = write_random_blinkdl(cfg, directory, seed=seed)
    model = RWKV(str(path.with_suffix("")), "cpu fp32")
    model.z["head.weight"] = torch.eye(cfg.hidden_size)  # logits := final-norm output
    rows = [row.tolist() for row in ids]

    def run():
        return torch.stack([model.forward(row, None)[0] for row in rows])

    return run


def build(method: str, cfg, ids, *, vertical_chunk_size=None, threads: int = 1, seed: int = 0, params=None):
    if method == "jaxembed":
        return build_jaxembed(cfg, ids, vertical_chunk_size, seed, params)
    if method not in peers_for(cfg):
        raise ValueError(f"{method!r} is not a peer for {cfg.architecture}; peers: {peers_for(cfg)}")
    if method == "mamba2-jax":
        return build_mamba2_jax(cfg, ids, seed)
    if method == "torch":
        return build_torch(cfg, ids, threads, seed)
    if method == "rwkv":
        return build_rwkv(cfg, ids, threads, seed)
    raise ValueError(f"unknown method {method!r}")


# ---- timing -------------------------------------------------------------------------------
@dataclass
class Timing:
    warmup_s: float  # the first call: compilation (jax) plus one run
    times_s: list[float] = field(default_factory=list)

    @property
    def min_s(self) -> float:
        return min(self.times_s)

    @property
    def mean_s(self) -> float:
        return statistics.fmean(self.times_s)

    @property
    def std_s(self) -> float:
        return statistics.stdev(self.times_s) if len(self.times_s) > 1 else 0.0


def time_run(run, repeats: int, warmup: int = 1) -> Timing:
    """`warmup` untimed calls (the first one compiles), then `repeats` timed ones."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    t0 = time.perf_counter()
    run()
    first = time.perf_counter() - t0
    for _ in range(max(0, warmup - 1)):
        run()
    out = Timing(first)
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        out.times_s.append(time.perf_counter() - t0)
    return out


def parse_int_list(text: str) -> list[int]:
    """'8k,16384,1M' -> [8192, 16384, 1048576] (k = 1024)."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        mult = 1
        if part.endswith("k"):
            mult, part = 1024, part[:-1]
        elif part.endswith("m"):
            mult, part = 1024 * 1024, part[:-1]
        out.append(int(part) * mult)
    return out


def fmt_len(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)
