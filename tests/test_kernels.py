"""The Pallas kernels, run by Pallas' interpreter on CPU: each against its `ops/` reference on fresh
random inputs, forward and gradients, float32 and bfloat16, odd lengths and dims that are not
powers of two, with a random initial state. The interpreter fills every output with NaN before
the kernel runs (checked below), so an element the kernel never writes cannot pass.

One jit per (kernel, dtype) computes outputs and gradients together: interpret mode costs about
0.1 ms per grid step, so the grids stay small.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from jaxembed import kernels
from jaxembed.kernels import BlockSizes, heuristic
from jaxembed.ops import mlstm, ssd, wkv7
from jaxembed.testing import hf_last_hidden, rel_err

# Kernel vs reference on the same (rounded) inputs: float32 is exact up to summation order; bfloat16
# matmul operands (SSD's and mLSTM's decay-weighted matrices, the carried state) round to 8 bits.
KERNEL_TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2}
_draws = iter(np.random.SeedSequence(20261122).spawn(64))  # a fresh stream per test


def _normal(rng, shape, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)


def _ssd_case(rng, dtype):
    b, t, h, p, g, n = 2, 37, 6, 12, 3, 20  # 2 heads per group; p, n padded to 16, 32 inside
    args = (_normal(rng, (b, t, h, p)).astype(dtype), _normal(rng, (b, t, h)) - 1.0,
            -jnp.exp(_normal(rng, (h,))), _normal(rng, (b, t, g, n)).astype(dtype),
            _normal(rng, (b, t, g, n)).astype(dtype), _normal(rng, (h, p)), _normal(rng, (h,), 0.5),
            _normal(rng, (b, h, p, n)))

    def call(op, x, dt, A, B, C, D, dt_bias, s0, **kw):
        return op(x, dt, A, B, C, chunk_size=8, D=D, dt_bias=dt_bias, initial_state=s0, **kw)

    return args, call, ssd.chunked, kernels.ssd_chunked


def _wkv7_case(rng, dtype):
    b, t, h, n, p = 1, 37, 3, 24, 20
    kk = _normal(rng, (b, t, h, n))
    kk = kk / jnp.linalg.norm(kk, axis=-1, keepdims=True)
    gate = jax.nn.sigmoid(_normal(rng, (b, t, h, n)))
    args = tuple(a.astype(dtype) for a in (
        _normal(rng, (b, t, h, n)), -math.exp(-0.5) * jax.nn.sigmoid(_normal(rng, (b, t, h, n))),
        _normal(rng, (b, t, h, n), 0.5), _normal(rng, (b, t, h, p)), -kk, kk * gate)) + (
        _normal(rng, (b, h, p, n)),)

    def call(op, r, lw, k, v, a, bb, s0, **kw):
        return op(r, lw, k, v, a, bb, chunk_size=16, initial_state=s0, **kw)

    return args, call, wkv7.chunked, kernels.wkv7_chunked


def _mlstm_case(rng, dtype):
    b, t, h, dk, dv = 2, 37, 2, 24, 40
    args = (_normal(rng, (b, t, h, dk)).astype(dtype), _normal(rng, (b, t, h, dk)).astype(dtype),
            _normal(rng, (b, t, h, dv)).astype(dtype), _normal(rng, (b, t, h), 3.0), _normal(rng, (b, t, h), 2.0) + 2,
            _normal(rng, (b, h, dk, dv)), _normal(rng, (b, h, dk)), _normal(rng, (b, h)))

    def call(op, q, k, v, i, f, C0, n0, m0, **kw):
        return op(q, k, v, i, f, chunk_size=16, initial_state=mlstm.State(C0, n0, m0), **kw)

    return args, call, mlstm.chunked, kernels.mlstm_chunked


def _ssd_xbc_case(rng, dtype):
    """SSD reading x, B and C as column blocks of Mamba2's packed xbc (the layer's path)."""
    b, t, h, p, g, n = 2, 37, 4, 16, 2, 16  # packable: every head's and group's columns start on a block
    args = (_normal(rng, (b, t, h * p + 2 * g * n)).astype(dtype), _normal(rng, (b, t, h)) - 1.0,
            -jnp.exp(_normal(rng, (h,))), _normal(rng, (h,)), _normal(rng, (h,), 0.5), _normal(rng, (b, h, p, n)))

    def call(op, xbc, dt, A, D, dt_bias, s0, **kw):
        return op(xbc, dt, A, heads=h, head_dim=p, groups=g, state_size=n, chunk_size=8, D=D, dt_bias=dt_bias,
                  initial_state=s0, **kw)

    return args, call, ssd.chunked_xbc, kernels.ssd_chunked_xbc


CASES = {"ssd": _ssd_case, "ssd_xbc": _ssd_xbc_case, "wkv7": _wkv7_case, "mlstm": _mlstm_case}
SMALL_BLOCKS = BlockSizes(chunk=16, value_block=16)  # several chunks and value blocks per program grid


# ssd_xbc's backward is `split_xbc` + the SSD reference's, checked in bfloat16 by "ssd"; its bfloat16
# forward is checked in test_packed_xbc_reads_the_same_columns_as_split_inputs
@pytest.mark.parametrize("family, dtype", [(f, d) for f in CASES for d in ("float32", "bfloat16")
                                           if (f, d) != ("ssd_xbc", "bfloat16")])
def test_kernel_matches_reference_forward_and_gradients(family, dtype):
    rng = np.random.default_rng(next(_draws))
    args, call, reference, dispatch = CASES[family](rng, jnp.dtype(dtype))

    def kernel_fn(*a):
        return call(dispatch, *a, backend="interpret", blocks=SMALL_BLOCKS)

    def reference_fn(*a):  # the reference on the same rounded inputs, in float32
        return call(reference, *(x.astype(jnp.float32) for x in a))

    cot_seed = next(_draws)  # the same cotangents for both
    out, grads = jax.jit(lambda *a: _vjp(kernel_fn, a, cot_seed))(*args)
    ref_out, ref_grads = jax.jit(lambda *a: _vjp(reference_fn, a, cot_seed))(*args)

    tol = KERNEL_TOLERANCE[dtype]
    for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref_out), strict=True):
        assert bool(jnp.all(jnp.isfinite(o.astype(jnp.float32)))), f"{family}: unwritten (NaN) output elements"
        assert rel_err(o.astype(jnp.float32), r) < tol, (family, dtype, rel_err(o.astype(jnp.float32), r))
    for g, r in zip(grads, ref_grads, strict=True):
        assert bool(jnp.all(jnp.isfinite(g.astype(jnp.float32))))
        # the backward is the reference's; the cotangents differ only by the forward's rounding
        assert rel_err(g.astype(jnp.float32), r.astype(jnp.float32)) < tol


def test_packed_xbc_reads_the_same_columns_as_split_inputs():
    """The packed path is `packable` for the small case, and the kernel's column blocks of xbc give
    what the split arrays give (so a wrong block offset cannot hide behind the reference VJP)."""
    from jaxembed.kernels import ssd as kernel_ssd

    assert kernel_ssd.packable(heads=4, head_dim=16, groups=2, state_size=16, value_block=16)
    assert not kernel_ssd.packable(heads=4, head_dim=24, groups=2, state_size=16, value_block=16)  # p padded
    for dtype in ("float32", "bfloat16"):
        rng = np.random.default_rng(next(_draws))
        args, call, _, dispatch = _ssd_xbc_case(rng, jnp.dtype(dtype))
        packed = call(dispatch, *args, backend="interpret", blocks=SMALL_BLOCKS)
        xbc, dt, A, D, dt_bias, s0 = args
        x, B, C = ssd.split_xbc(xbc.astype(jnp.float32), heads=4, head_dim=16, groups=2, state_size=16)
        split = ssd.recurrent(x, dt, A, B, C, D=D, dt_bias=dt_bias, initial_state=s0)  # sequential, float32
        for o, r in zip(packed, split, strict=True):
            assert rel_err(o.astype(jnp.float32), r) < KERNEL_TOLERANCE[dtype], (dtype, rel_err(o, r))


def _kernel_entry(family):
    from jaxembed.kernels import mlstm as k_mlstm
    from jaxembed.kernels import ssd as k_ssd
    from jaxembed.kernels import wkv7 as k_wkv7

    entries = {"ssd": k_ssd.chunked, "ssd_xbc": k_ssd.chunked_xbc, "wkv7": k_wkv7.chunked, "mlstm": k_mlstm.chunked}
    return entries[family]


@pytest.mark.parametrize("family", list(CASES))
def test_kernels_lower_to_triton_for_the_gpu(family):
    """Each kernel at its default tiles goes through Pallas' Triton lowering for CUDA (cross-platform
    lowering, no GPU needed), so a BlockSpec or op that the GPU path rejects fails here, not on a
    user's GPU. (Triton's own compile to PTX happens on the GPU: benchmarks/kernels.py --only check.)"""
    rng = np.random.default_rng(next(_draws))
    args, call, _, _ = CASES[family](rng, jnp.bfloat16)
    entry = functools.partial(_kernel_entry(family), interpret=False)
    lowered = jax.jit(lambda *a: call(entry, *a)).trace(*args).lower(lowering_platforms=("cuda",))
    assert "xla.gpu.triton" in lowered.as_text()


def test_packed_ssd_lowers_at_codestral_shapes():
    """The layer's packed SSD call at Codestral Mamba 7B's dims (128 heads x 64, 8 groups, n 128) and
    an odd length, lowered for CUDA from shapes alone."""
    from jaxembed.kernels import ssd as k_ssd

    b, t, h, p, g, n = 2, 4099, 128, 64, 8, 128
    S = jax.ShapeDtypeStruct
    fn = functools.partial(k_ssd.chunked_xbc, heads=h, head_dim=p, groups=g, state_size=n, chunk_size=256)
    lowered = jax.jit(lambda xbc, dt, A, D: fn(xbc, dt, A, D=D, dt_bias=D)).trace(
        S((b, t, h * p + 2 * g * n), jnp.bfloat16), S((b, t, h), jnp.bfloat16), S((h,), jnp.float32),
        S((h,), jnp.float32)).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert text.count("xla.gpu.triton") == 1 and "tensor<2x4160x10240xbf16>" in text  # xbc read in place


def _vjp(fn, args, seed):
    rng = np.random.default_rng(seed)
    out, vjp = jax.vjp(fn, *args)
    cot = jax.tree.map(lambda o: jnp.asarray(rng.standard_normal(o.shape), jnp.float32).astype(o.dtype), out)
    return out, vjp(cot)


def test_interpreter_poisons_outputs():
    """What the NaN checks above rely on: elements a kernel leaves unwritten come back as NaN."""

    def half(x_ref, o_ref):
        o_ref[:8] = x_ref[:8]

    out = pl.pallas_call(half, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32), interpret=True)(
        jnp.ones(16, jnp.float32))
    assert np.all(np.asarray(out[:8]) == 1.0) and np.all(np.isnan(np.asarray(out[8:])))


def test_tail_and_single_token():
    """t = 1 and t just past a chunk boundary (padding inside the kernel) against the recurrence."""
    rng = np.random.default_rng(next(_draws))
    for t in (1, 17):
        x, dt = _normal(rng, (1, t, 2, 16)), _normal(rng, (1, t, 2))
        A, B, C = -jnp.exp(_normal(rng, (2,))), _normal(rng, (1, t, 1, 16)), _normal(rng, (1, t, 1, 16))
        y, s = kernels.ssd_chunked(x, dt, A, B, C, chunk_size=8, backend="interpret", blocks=SMALL_BLOCKS)
        y_ref, s_ref = ssd.recurrent(x, dt, A, B, C)
        assert rel_err(y, y_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5


def test_embed_with_interpreted_kernels_matches_transformers(hf_model_dir):
    """The model path through the dispatch: `kernels="interpret"` against transformers' Mamba2,
    horizontal and vertically chunked."""
    import jaxembed

    path, model = hf_model_dir
    emb = jaxembed.load(path, kernels="interpret")
    rng = np.random.default_rng(next(_draws))
    seqs = [list(rng.integers(0, 300, n)) for n in (5, 29)]
    ref = hf_last_hidden(model, seqs)
    for v in (None, 16):
        out = emb.encode_ids(seqs, normalize_embeddings=False, vertical_chunk_size=v, batch_size=2)
        assert rel_err(out, ref) < 1e-4, (v, rel_err(out, ref))


def test_runtime_is_static_and_checked():
    """The explicit runtime: hashable (a static jit argument), checked when made."""
    from jaxembed.runtime import Runtime

    assert hash(Runtime(64, "xla")) == hash(Runtime(64, "xla")) and Runtime(64) != Runtime(64, "interpret")
    with pytest.raises(ValueError, match="chunk_size"):
        Runtime(0)
    with pytest.raises(ValueError, match="kernels backend must be one of"):
        Runtime(64, "triton")
    with pytest.raises(TypeError, match="remat"):
        Runtime(64, remat=1)


def test_dispatch_and_block_checks(monkeypatch):
    assert kernels.resolve("auto") == ("pallas" if jax.default_backend() == "gpu" else "xla")
    assert kernels.resolve("interpret") == "interpret" and kernels.resolve("xla") == "xla"
    # no hidden state: every operator call names its backend, and nothing is read from the environment
    monkeypatch.setenv("JAXEMBED_KERNELS", "interpret")
    x = jnp.zeros((1, 4, 1, 16))
    with pytest.raises(TypeError, match="backend"):
        kernels.ssd_chunked(x, x[..., 0], jnp.ones(1), x, x, chunk_size=4)
    with pytest.raises(ValueError, match="kernels backend must be one of"):
        kernels.resolve("triton")
    if jax.default_backend() != "gpu":
        with pytest.raises(RuntimeError, match="needs a GPU"):
            kernels.resolve("pallas")
    with pytest.raises(ValueError, match="chunk must be a power of two"):
        BlockSizes(chunk=48)
    with pytest.raises(ValueError, match="num_warps"):
        BlockSizes(num_warps=3)
    with pytest.raises(ValueError, match="unknown kernel"):
        heuristic("lstm", key_dim=64, value_dim=64)
    assert heuristic("ssd", key_dim=128, value_dim=64) == BlockSizes(chunk=64, value_block=64, num_warps=4)
    assert heuristic("mlstm", key_dim=256, value_dim=512).value_block == 32  # state tile [256, 32]
    with pytest.raises(ValueError, match="exceeds"):
        x = jnp.zeros((1, 4, 1, 16))
        kernels.wkv7_chunked(x, x, x, x, x, x, chunk_size=16, backend="interpret", blocks=BlockSizes(chunk=128))
