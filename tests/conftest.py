"""Shared fixtures and the tolerance table. The checkpoint builders live in jaxembed.testing."""

from __future__ import annotations

import contextlib
import os
import warnings

import pytest

# The suite's models are tiny, so compiling is most of its time: XLA:CPU's backend optimisation level 0
# compiles about a third faster (subprocesses get it too: `suite_xla_flags`). Never over the user's own setting.
FAST_COMPILE_FLAG = "--xla_backend_optimization_level=0"
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE_FLAG}".strip()
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never download anything
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# no persistent compilation cache in ~/.cache from the suite (tests/test_warm_start.py checks it in subprocesses)
os.environ.setdefault("JAXEMBED_COMPILATION_CACHE", "off")
warnings.filterwarnings("ignore", message=".*falling back to its reference PyTorch implementation.*")

from jaxembed.testing import (  # noqa: E402,F401
    hf_last_hidden,
    jaxpr_equations,
    make_hf_mamba2,
    make_tokenizer,
    rel_err,
    save_codestral_layout,
    save_mamba_ssm_layout,
)


def suite_xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a test's subprocess: the suite's compile setting, and `devices` fake CPU devices."""
    return " ".join([FAST_COMPILE_FLAG] + ([f"--xla_force_host_platform_device_count={devices}"] if devices else []))


# Relative tolerance per dtype for parity with references (norm-wise: |out - ref| / |ref|).
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer(384)


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory, tokenizer):
    """A saved transformers Mamba2Model (ngroups 2, Q = 8) with a tokenizer beside it."""
    model = make_hf_mamba2(seed=1, vocab_size=len(tokenizer), n_groups=2, chunk_size=8)
    path = tmp_path_factory.mktemp("hf_mamba2")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model


@contextlib.contextmanager
def record_segments():
    """The segment counts the kernels pick (kernels.common.sequence_segments) while tracing inside."""
    from jaxembed.kernels import common

    chosen, pick = [], common.sequence_segments

    def spy(blocks, **kw):
        chosen.append(pick(blocks, **kw))
        return chosen[-1]

    common.sequence_segments = spy
    try:
        yield chosen
    finally:
        common.sequence_segments = pick


def split_over_chunks(monkeypatch, request, kernel: str, on: bool, module, stage: str) -> list:
    """Set `kernels.heuristic`'s tile of `kernel` with its split over chunks on or off (the 4th entry,
    `kernels.common.SPLITS`) for one test, and spy on `module.<stage>`, the split's own kernel body: the
    returned list is non-empty once it has been traced. The tile is not part of a compiled program's key:
    with the split on, jax's compiled programs are dropped before (to trace it) and after (so that no
    later test runs it in place of the default)."""
    import jax

    from jaxembed.kernels import common

    monkeypatch.setitem(common._TILES, kernel, (*common._TILES[kernel][:3], on))
    if on:
        jax.clear_caches()
        request.addfinalizer(jax.clear_caches)
    traced, body = [], getattr(module, stage)
    monkeypatch.setattr(module, stage, lambda *refs, **kw: (traced.append(1), body(*refs, **kw))[1])
    return traced

