"""Warm starts: the persistent compilation cache jaxembed turns on (fresh processes: it is set when jax
starts) and `Embedder.warmup`, which compiles every length bucket ahead."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np

from jaxembed import models
from jaxembed.config import Mamba2Config
from jaxembed.embedder import Embedder, embed_jit

CHILD = r"""
import json, sys
import jax, jax.monitoring
hits = []
jax.monitoring.register_event_listener(lambda e, **_: hits.append(e) if e.endswith("/cache_hits") else None)
import jaxembed
from jaxembed import models
from jaxembed.config import Mamba2Config
cfg = Mamba2Config(vocab_size=64, d_model=32, n_layers=2, d_state=8, head_dim=8, chunk_size=8, eos_token_id=0)
params = models.family(cfg).init_params(cfg, jax.random.key(0))
out = jaxembed.embed(params, cfg, [[1, 2, 3, 0]], [4])
print(json.dumps({"dir": jax.config.jax_compilation_cache_dir, "hits": len(hits),
                  "min_seconds": jax.config.jax_persistent_cache_min_compile_time_secs,
                  "embedding": [float(x) for x in out[0]]}))
"""


def child(env_update: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("JAXEMBED_COMPILATION_CACHE", "JAX_COMPILATION_CACHE_DIR")}
    env.update(env_update)
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_persistent_compilation_cache_is_on_by_default_and_reused(tmp_path):
    home = tmp_path / "home"
    # The tiny program may compile faster than jaxembed's write threshold on a fast machine (CI failed so once):
    # the user's own JAX threshold, 0 here, must win, and makes the write independent of the machine's speed.
    env = {"XDG_CACHE_HOME": str(home), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    first = child(env)  # the default directory, under the user's cache home
    assert first["dir"] == str(home / "jaxembed" / "xla") and first["hits"] == 0 and first["min_seconds"] == 0
    assert any((home / "jaxembed" / "xla").iterdir())  # the program was written
    second = child(env)
    assert second["hits"] >= 1 and second["embedding"] == first["embedding"]  # read back, same result


def test_compilation_cache_switches(tmp_path, monkeypatch):
    """Off by the environment; a directory chosen through JAX itself is left alone; a directory named
    in JAXEMBED_COMPILATION_CACHE is used (in this process: the suite runs with the cache off)."""
    from jaxembed import compile_cache

    assert jax.config.jax_compilation_cache_dir is None
    min_seconds = jax.config.jax_persistent_cache_min_compile_time_secs
    monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", raising=False)
    monkeypatch.setenv(compile_cache.ENV, "off")
    assert compile_cache.apply() is None and jax.config.jax_compilation_cache_dir is None
    try:
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "own"))
        monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "ours"))
        assert compile_cache.apply() == tmp_path / "own" and not (tmp_path / "ours").exists()
        jax.config.update("jax_compilation_cache_dir", None)
        assert compile_cache.apply() == tmp_path / "ours" and (tmp_path / "ours").is_dir()
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "ours")
        # JAX's own 1 s threshold would skip most embedding programs on a CPU: jaxembed lowers it
        assert jax.config.jax_persistent_cache_min_compile_time_secs == compile_cache.MIN_COMPILE_SECONDS
        jax.config.update("jax_compilation_cache_dir", None)
        # an existing read-only directory (a read-only mount: root may write through a mode): off, not a JAX
        # warning at every compilation
        (tmp_path / "read-only").mkdir()
        monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "read-only"))
        monkeypatch.setattr(compile_cache.os, "access", lambda path, mode: Path(path) != tmp_path / "read-only")
        assert compile_cache.apply() is None and jax.config.jax_compilation_cache_dir is None
    finally:
        jax.config.update("jax_compilation_cache_dir", None)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", min_seconds)


def test_warmup_compiles_every_bucket_ahead(tokenizer):
    cfg = Mamba2Config(vocab_size=len(tokenizer), d_model=32, n_layers=2, d_state=8, head_dim=8, chunk_size=8,
                       eos_token_id=tokenizer.eos_token_id)
    model = Embedder(models.family(cfg).init_params(cfg, jax.random.key(1)), cfg, tokenizer=tokenizer, kernels="xla")
    shapes = model.warmup(40, batch_size=4)
    assert shapes == [(4, 8), (4, 16), (4, 24), (4, 32), (4, 48)]  # the buckets up to 40 tokens: 1, 2, 3, 4, 6 x Q
    texts = ["x" * n for n in (1, 3, 9, 17, 25, 33, 30, 12, 39, 2)]  # mixed lengths: partial batches too
    assert max(map(len, model.tokenize(texts))) <= 40
    before = embed_jit._cache_size()
    partial = model.warmup(40, batch_size=4, partial_batches=True)
    assert set(partial) == {(r, n) for _, n in shapes for r in (1, 2, 4)}
    assert embed_jit._cache_size() - before == 10  # 2 and 1 rows per bucket; a row alone shares V=None's program
    before = embed_jit._cache_size()
    out = model.encode(texts, batch_size=4, show_progress_bar=False)
    assert embed_jit._cache_size() == before  # nothing left to compile
    assert np.isfinite(out).all()
