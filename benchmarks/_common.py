"""Shared pieces of the benchmark scripts: thread pinning, the three implementations, timing.

Import order matters: `pin_threads` must run before jax or torch starts computing, so that every
method in a run sees the same CPUs (XLA sizes its thread pool from the process's CPU affinity,
torch from `torch.set_num_threads`, BLAS libraries from the *_NUM_THREADS variables).
Nothing here runs at import time.
"""

from __future__ import annotations

import os
from pathlib import Path

from jaxembed.bench import measure
from jaxembed.bench.measure import (  # noqa: F401 (re-exported for the scripts)
    Timing,
    available_memory_mib,
    cpu_model,
    current_rss_mib,
    fmt_len,
    hwm_rss_mib,
    parse_int_list,
    peak_rss_mib,
    reset_peak_rss,
    time_run,
)

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


# ---- environment, memory, timing: jaxembed.bench.measure (shared with `jaxembed bench`) ------
def pin_threads(threads: int | None) -> dict:
    """measure.pin_threads, on the CPU backend unless JAX_PLATFORMS says otherwise."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    return measure.pin_threads(threads)


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
    from transformers import Mamba2Model

    from jaxembed.convert.mamba2 import to_transformers_config

    warnings.filterwarnings("ignore", message=".*falling back.*")
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    model = Mamba2Model(to_transformers_config(cfg)).eval().to(torch.float32)
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
