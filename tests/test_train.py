"""The trainer's parts against references it did not write: bitsandbytes' NF4, the LoRA and
InfoNCE formulas written out in numpy float64, and the full-batch gradient for GradCache.
The end-to-end runs (sharding, processes, resume, learning) are in test_train_runs.py."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import jaxpr_equations, rel_err

from jaxembed import checkpoint, models, schedule
from jaxembed.config import Mamba2Config
from jaxembed.errors import ConfigError
from jaxembed.models.transformer import TransformerConfig
from jaxembed.train import lora as lora_lib
from jaxembed.train.loss import info_nce
from jaxembed.train.quant import nf4_levels, quantize_nf4
from jaxembed.train.step import StepConfig, cap_length_plans, length_plan, loss_and_grads
from jaxembed.weights import linear

ROOT = Path(__file__).resolve().parents[1]


def test_nf4_matches_bitsandbytes():
    """Codes bit for bit and block maxima exactly, for stacked matrices and a size that is not a
    multiple of the block; dequantised values within the 1-ulp difference of the two level tables."""
    torch = pytest.importorskip("torch")
    bnb = pytest.importorskip("bitsandbytes.functional")
    gen = torch.Generator().manual_seed(0)
    for shape in [(3, 40, 24), (37, 11)]:
        w = torch.randn(*shape, generator=gen) * 0.05
        ours = quantize_nf4(jnp.asarray(w.numpy()))
        matrices = w.reshape(-1, *shape[-2:])
        codes = np.asarray(ours.codes).reshape(len(matrices), -1)
        absmax = np.asarray(ours.absmax).reshape(len(matrices), -1)
        dense = np.asarray(ours.dense()).reshape(matrices.shape)
        for i, m in enumerate(matrices):
            q, state = bnb.quantize_4bit(m.contiguous(), blocksize=64, quant_type="nf4")
            np.testing.assert_array_equal(codes[i, : q.numel()], q.flatten().numpy())
            np.testing.assert_array_equal(absmax[i], state.absmax.numpy())
            ref = bnb.dequantize_4bit(q, state).numpy()
            assert np.abs(dense[i] - ref).max() <= 1e-6 * np.abs(ref).max()  # the level tables differ by 1 ulp
        np.testing.assert_allclose(nf4_levels(), state.code.numpy(), atol=2e-7)
    with pytest.raises(ValueError, match=r"NF4 quantises finite weights; this \(37, 11\) matrix has NaN"):
        quantize_nf4(jnp.asarray(w.numpy()).at[3, 4].set(jnp.nan))  # not a block of NaNs, silently


def test_lora_products_match_the_formula():
    """LoraWeight.matmul and .dense against x W + (alpha / r) (x A) B in float64, with a plain and an NF4 base."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 48)).astype(np.float32)
    w = (0.1 * rng.normal(size=(48, 40))).astype(np.float32)
    a, b = rng.normal(size=(48, 4)).astype(np.float32), rng.normal(size=(4, 40)).astype(np.float32)
    scale = 16 / 4
    for base in (jnp.asarray(w), quantize_nf4(jnp.asarray(w))):
        w_ref = np.asarray(base.dense() if hasattr(base, "dense") else base, np.float64)
        weight = lora_lib.LoraWeight(base, jnp.asarray(a), jnp.asarray(b), scale)
        expected = x.astype(np.float64) @ w_ref + scale * (x.astype(np.float64) @ a) @ b
        with jax.default_matmul_precision("highest"):
            assert rel_err(linear(jnp.asarray(x), weight), expected) < 1e-6
            assert rel_err(weight.dense(), w_ref + scale * a.astype(np.float64) @ b) < 1e-6


def test_merging_into_bfloat16_rounds_small_updates_away():
    """merge_rounding: the share of s A B lost when W + s A B is cast back to bfloat16, against float64: an update
    1e-3 of W is almost all rounded away, one of 1e-1 barely (the export warns past MERGE_ROUNDING_WARN)."""
    from jaxembed.config import Mamba2Config

    cfg = Mamba2Config(vocab_size=64, d_model=32, n_layers=1, d_state=8, head_dim=8, chunk_size=8)
    params = models.family(cfg).init_params(cfg, jax.random.key(0))
    lora = lora_lib.LoraConfig(4, 4.0, ("out_proj",), ())
    adapters = lora_lib.init_adapters(cfg, params, lora, jax.random.key(1))
    w = np.asarray(params["layers"]["out_proj"], np.float64)
    bf16 = {**params, "layers": {**params["layers"], "out_proj": params["layers"]["out_proj"].astype(jnp.bfloat16)}}
    w16 = np.asarray(bf16["layers"]["out_proj"].astype(jnp.float32), np.float64)
    a = np.asarray(adapters["layers"]["out_proj"]["a"], np.float64)
    direction = np.random.default_rng(0).normal(size=adapters["layers"]["out_proj"]["b"].shape)
    for size, low, high in ((1e-3, 0.7, 1.0), (1e-1, 0.0, 0.05)):
        b = direction * size * np.linalg.norm(w) / np.linalg.norm(a @ direction)  # |A B| = size |W|
        ad = {"layers": {"out_proj": {"a": adapters["layers"]["out_proj"]["a"], "b": jnp.asarray(b, jnp.float32)}}}
        update = np.asarray(ad["layers"]["out_proj"]["a"], np.float64) @ np.asarray(b, np.float32).astype(np.float64)
        exact = w16 + update  # scale 1: alpha = rank
        rounded = exact.astype(np.float32).astype(jnp.bfloat16).astype(np.float64)
        expected = np.linalg.norm(rounded - exact) / np.linalg.norm(update)
        share = lora_lib.merge_rounding(bf16, ad, lora, cfg)["out_proj"]
        assert low <= share <= high and abs(share - expected) < 1e-3, (size, share, expected)
    assert lora_lib.merge_rounding(params, ad, lora, cfg) == {}  # float32 stored weights: nothing to round


def test_lora_bfloat16_output_and_cotangent():
    """A bfloat16 layer output: x W + s (x A) B written in bfloat16 (within bf16 rounding of the
    float64 formula), and the backward's cotangent stays bfloat16: no float32 array of the output's
    shape anywhere in the gradient's program."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(2, 5, 48)), jnp.bfloat16)
    w = jnp.asarray(0.1 * rng.normal(size=(48, 40)), jnp.bfloat16)
    a, b = jnp.asarray(rng.normal(size=(48, 4)), jnp.float32), jnp.asarray(0.1 * rng.normal(size=(4, 40)), jnp.float32)

    def product(x, a, b):
        return linear(x, lora_lib.LoraWeight(w, a, b, 4.0), out_dtype=jnp.bfloat16)

    y = product(x, a, b)
    assert y.dtype == jnp.bfloat16
    xf, wf = np.asarray(x, np.float64), np.asarray(w, np.float64)
    af = np.asarray(a.astype(jnp.bfloat16), np.float64)  # the adapters enter the GEMMs in the compute dtype
    down = np.asarray((4.0 * (x.astype(jnp.float32) @ a.astype(jnp.bfloat16))).astype(jnp.bfloat16), np.float64)
    expected = xf @ wf + down @ np.asarray(b.astype(jnp.bfloat16), np.float64)
    assert rel_err(y, expected) < 8e-3
    assert rel_err(y, xf @ wf + 4.0 * (xf @ af) @ np.asarray(b, np.float64)) < 2e-2
    grads = jax.make_jaxpr(lambda *args: jax.vjp(product, *args)[1](jnp.ones((2, 5, 40), jnp.bfloat16)))(x, a, b)
    shapes = [(v.aval.shape, v.aval.dtype) for eqn in jaxpr_equations(grads.jaxpr) for v in eqn.outvars]
    assert ((2, 5, 40), jnp.dtype(jnp.float32)) not in shapes, shapes


def test_float32_output_gemm_runs_its_backward_in_bfloat16():
    """A bfloat16 GEMM written in float32 (out_proj into a float32 residual): the forward is exact in
    float32, and the backward multiplies the cotangent rounded to bfloat16, as a bfloat16 Linear's
    grad_output is, writing dx and dW in bfloat16; its program has no float32 dot (autodiff of the
    einsum would multiply the float32 cotangent by the weight converted to float32). Against float64
    products of the bfloat16 operands."""
    from jaxembed.weights import dot

    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(2, 7, 48)), jnp.float32)
    w = jnp.asarray(0.1 * rng.normal(size=(48, 24)), jnp.float32)
    g = jnp.asarray(rng.normal(size=(2, 7, 24)), jnp.float32)

    def product(x, w):
        return dot(x, w, jnp.bfloat16, jnp.float32)

    def as64(v):
        return np.asarray(jnp.asarray(v, jnp.bfloat16), np.float64)

    y, vjp = jax.vjp(product, x, w)
    assert y.dtype == jnp.float32
    assert rel_err(y, as64(x) @ as64(w)) < 1e-6
    dx, dw = vjp(g)
    assert dx.dtype == dw.dtype == jnp.float32  # the primal inputs' dtypes, through the casts
    assert rel_err(dx, as64(g) @ as64(w).T) < 8e-3
    assert rel_err(dw, np.einsum("btd,bte->de", as64(x), as64(g))) < 8e-3
    grad_program = jax.make_jaxpr(lambda x, w, g: jax.vjp(product, x, w)[1](g))(x, w, g)
    operand_dtypes = [tuple(str(v.aval.dtype) for v in eqn.invars) for eqn in jaxpr_equations(grad_program.jaxpr)
                      if eqn.primitive.name == "dot_general"]
    assert operand_dtypes and all(d == ("bfloat16", "bfloat16") for d in operand_dtypes), operand_dtypes


@pytest.mark.parametrize("d, n", [(48, 24), (16, 40)])
def test_dot_sum_is_one_gemm_and_its_backward_against_float64(d, n):
    """`weights.dot_sum` (LoRA's x W + (s x A) B as [x | y] @ [w ; v]): the product and all four
    cotangents against float64 products of the bfloat16 operands (the cotangent rounded to bfloat16
    first, as `dot` does); one GEMM forward. With w frozen (LoRA's base) dw's GEMM is dropped: the
    backward is dx and dy in one GEMM and dv (n >= 2 d), or dx, dy and dv each in its own (n < 2 d:
    reading g twice costs less than copying dx out of the joint [dx | dy])."""
    from jaxembed.weights import dot_sum

    rng = np.random.default_rng(4)
    x, y = jnp.asarray(rng.normal(size=(2, 7, d)), jnp.float32), jnp.asarray(rng.normal(size=(2, 7, 4)), jnp.float32)
    w = jnp.asarray(0.1 * rng.normal(size=(d, n)), jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=(4, n)), jnp.float32)
    g = jnp.asarray(rng.normal(size=(2, 7, n)), jnp.float32)

    def as64(a):
        return np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64)

    def product(x, w, y, v):
        return dot_sum(x, w, y, v, jnp.bfloat16, jnp.float32)

    out, vjp = jax.vjp(product, x, w, y, v)
    assert out.dtype == jnp.float32
    assert rel_err(out, as64(x) @ as64(w) + as64(y) @ as64(v)) < 1e-6
    dx, dw, dy, dv = vjp(g)
    assert dx.shape == x.shape and dy.shape == y.shape
    assert rel_err(dx, as64(g) @ as64(w).T) < 8e-3
    assert rel_err(dy, as64(g) @ as64(v).T) < 8e-3
    assert rel_err(dw, np.einsum("btd,bte->de", as64(x), as64(g))) < 8e-3
    assert rel_err(dv, np.einsum("btd,bte->de", as64(y), as64(g))) < 8e-3
    forward = jax.make_jaxpr(product)(x, w, y, v)
    assert sum(eqn.primitive.name == "dot_general" for eqn in jaxpr_equations(forward.jaxpr)) == 1
    frozen_w = jax.jit(lambda x, y, v, g: jax.vjp(lambda x, y, v: product(x, w, y, v), x, y, v)[1](g))
    gemms = len(re.findall(r"= \S+ dot\(", frozen_w.lower(x, y, v, g).compile().as_text()))
    assert gemms == (3 if n < 2 * d else 2), gemms


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("adapted", [False, True])
def test_mamba2_gated_norm_and_out_proj_backward_against_float64(dtype, adapted):
    """Mamba2's tail, the grouped gated RMSNorm then out_proj (with a bias; as a LoRA weight or a
    dense one), with its written-out backward: the output and the cotangents of y, z, the norm's
    weight and every part of out_proj against float64 autodiff of the formula, 2 groups."""
    from jaxembed.models.mamba2 import gated_norm_project

    rng = np.random.default_rng(5)
    dt = jnp.dtype(dtype)

    def normal(*shape, scale=1.0, dtype=jnp.float32):
        return jnp.asarray(scale * rng.normal(size=shape), dtype)

    y, z, weight = normal(2, 5, 32, dtype=dt), normal(2, 5, 32, dtype=dt), normal(32)
    base, bias, d_out = normal(32, 24, scale=0.2, dtype=dt), normal(24, dtype=dt), normal(2, 5, 24)
    a, b = normal(32, 4, scale=0.3), normal(4, 24, scale=0.3)

    def out_weight(base, a, b):
        return lora_lib.LoraWeight(base, a, b, 2.0) if adapted else base

    def tail(y, z, weight, base, bias, a, b):
        return gated_norm_project(y, z, weight, out_weight(base, a, b), bias, eps=1e-5, group_size=16,
                                  norm_dtype=dt, out_dtype=jnp.float32)

    def formula(y, z, weight, base, bias, a, b):
        g = (y * z / (1 + jnp.exp(-z))).reshape(2, 5, 2, 16)
        n = (g / jnp.sqrt(jnp.mean(g * g, -1, keepdims=True) + 1e-5)).reshape(2, 5, 32) * weight
        return n @ (base + 2.0 * a @ b if adapted else base) + bias

    args = (y, z, weight, base, bias, a, b)
    out, vjp = jax.vjp(tail, *args)
    with jax.enable_x64(True):
        want, want_vjp = jax.vjp(formula, *(np.asarray(v, np.float64) for v in args))
        wants = [np.asarray(w) for w in want_vjp(np.asarray(d_out, np.float64))]
    tol = {"float32": 1e-6, "bfloat16": 8e-3}[dtype]
    assert out.dtype == jnp.float32 and rel_err(out, np.asarray(want)) < tol, rel_err(out, np.asarray(want))
    names = ("y", "z", "weight", "base", "bias", "a", "b")
    for name, got, w in zip(names, vjp(d_out), wants, strict=True):
        if name in ("a", "b") and not adapted:
            continue
        assert got.dtype == args[names.index(name)].dtype, name
        assert float(np.abs(w).max()) > 0 and rel_err(got, w) < tol, (name, rel_err(got, w))


def test_info_nce_matches_the_paper_equation():
    """Section 3.1: the negatives of query i are its own hard negatives and every positive and
    hard negative of the other queries; written out query by query."""
    rng = np.random.default_rng(1)
    B, k, d, tau = 5, 2, 16, 0.05

    def unit(*shape):
        v = rng.normal(size=(*shape, d))
        return v / np.linalg.norm(v, axis=-1, keepdims=True)

    q, p, n = unit(B), unit(B), unit(B, k)
    losses = []
    for i in range(B):
        negatives = [n[i, j] for j in range(k)] + [p[o] for o in range(B) if o != i] + \
                    [n[o, j] for o in range(B) if o != i for j in range(k)]
        pos = np.exp(q[i] @ p[i] / tau)
        losses.append(-np.log(pos / (pos + sum(np.exp(q[i] @ c / tau) for c in negatives))))
    got = info_nce(jnp.asarray(q, jnp.float32), jnp.asarray(p, jnp.float32), jnp.asarray(n, jnp.float32), tau)
    assert abs(float(got) - np.mean(losses)) / np.mean(losses) < 1e-6


TINY = {
    # config, params trained in full beside the adapters (PEFT's modules_to_save)
    "mamba2": (Mamba2Config(vocab_size=64, d_model=32, n_layers=2, d_state=8, head_dim=8, n_groups=1, chunk_size=8),
               ("embedding", "dt_bias")),
    "transformer": (TransformerConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48,
                                      sliding_window=6), ("embedding", "attn_norm")),
}


def _tiny_setup(seed=0, b=8, k=2, lengths=(21, 21, 21), architecture="mamba2"):
    cfg, saved = TINY[architecture]
    params = models.family(cfg).init_params(cfg, jax.random.key(seed))
    lora = lora_lib.LoraConfig(rank=4, alpha=8, modules_to_save=saved)
    adapters = lora_lib.init_adapters(cfg, params, lora, jax.random.key(seed + 1))
    # B starts at zero; give it values so every adapter gets a gradient that matters
    adapters = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(seed + 2), x.shape), adapters)
    rng = np.random.default_rng(seed)

    def ids(shape, t):
        return (jnp.asarray(rng.integers(0, cfg.vocab_size, (*shape, t)), jnp.int32),
                jnp.asarray(rng.integers(1, t + 1, shape), jnp.int32))

    (qi, ql), (pi, pl), (ni, nl) = ids((b,), lengths[0]), ids((b,), lengths[1]), ids((b, k), lengths[2])
    batch = dict(query_ids=qi, query_len=ql, pos_ids=pi, pos_len=pl, neg_ids=ni, neg_len=nl)
    return cfg, params, lora, adapters, batch


@pytest.mark.parametrize("architecture", TINY)
def test_grad_cache_equals_full_batch(architecture):
    """GradCache (sub-batches of 2 queries, remat on) against jax.grad of the one-pass batch loss;
    the transformer baseline trains through the same step (LoRA on its attention and MLP)."""
    cfg, params, lora, adapters, batch = _tiny_setup(architecture=architecture)
    f = jax.jit(loss_and_grads, static_argnums=3)
    loss_full, g_full = f(adapters, params, batch, StepConfig(cfg, lora, grad_cache_size=None, remat=False))
    loss_gc, g_gc = f(adapters, params, batch, StepConfig(cfg, lora, grad_cache_size=2, remat=True))
    assert abs(float(loss_gc) - float(loss_full)) <= 1e-6 * abs(float(loss_full))
    for path, full, gc in zip(jax.tree_util.tree_leaves_with_path(g_full), jax.tree.leaves(g_full),
                              jax.tree.leaves(g_gc), strict=True):
        assert float(jnp.linalg.norm(full)) > 0, jax.tree_util.keystr(path[0])
        assert rel_err(gc, full) < 1e-5, jax.tree_util.keystr(path[0])


def test_adapters_start_as_the_base_model_and_remat_changes_nothing():
    """Fresh adapters (B = 0, saved modules copied) leave every embedding as the base model's;
    remat only changes the backward. Merging writes the trained modules over the stored ones."""
    cfg, params, lora, trained, batch = _tiny_setup(seed=3, b=2, k=0, lengths=(9, 9, 9))
    fresh = lora_lib.init_adapters(cfg, params, lora, jax.random.key(0))
    ids, lengths = batch["query_ids"], batch["query_len"]
    base = schedule.embed(params, cfg, ids, lengths)
    adapted = schedule.embed(lora_lib.apply(params, fresh, lora, cfg), cfg, ids, lengths, remat=True)
    np.testing.assert_array_equal(np.asarray(adapted), np.asarray(base))
    merged = lora_lib.merge(params, trained, lora, cfg)
    np.testing.assert_array_equal(merged["embedding"], trained["saved"]["embedding"])
    np.testing.assert_array_equal(merged["layers"]["dt_bias"], trained["saved"]["layers"]["dt_bias"])
    np.testing.assert_array_equal(merged["layers"]["A_log"], params["layers"]["A_log"])


def test_lora_on_mamba2_is_one_rank_r_adapter_on_the_fused_in_proj():
    """PEFT's LoRA on mamba_ssm's in_proj: one A [d, r] and one B [r, e + conv_dim + h] whose columns
    the two params share out, so the merged [z_proj | xbcdt_proj] is in_proj + s A B (float64 here)."""
    cfg = Mamba2Config(vocab_size=64, d_model=32, n_layers=2, d_state=8, head_dim=8, n_groups=2, chunk_size=8)
    params = models.family(cfg).init_params(cfg, jax.random.key(0))
    lora = lora_lib.LoraConfig(rank=4, alpha=8)
    adapters = lora_lib.init_adapters(cfg, params, lora, jax.random.key(1))
    assert list(adapters["layers"]) == ["in_proj", "out_proj"]
    in_proj = adapters["layers"]["in_proj"]
    assert in_proj["a"].shape == (2, 32, 4) and in_proj["b"].shape == (2, 4, cfg.d_in_proj)
    in_proj["b"] = jax.random.normal(jax.random.key(2), in_proj["b"].shape)
    merged = lora_lib.merge(params, adapters, lora, cfg)
    fused = np.concatenate([np.asarray(params["layers"][k], np.float64) for k in ("z_proj", "xbcdt_proj")], -1)
    want = fused + 2.0 * np.asarray(in_proj["a"], np.float64) @ np.asarray(in_proj["b"], np.float64)
    got = np.concatenate([np.asarray(merged["layers"][k], np.float64) for k in ("z_proj", "xbcdt_proj")], -1)
    assert rel_err(got, want) < 1e-6
    # one part alone is an adapter of its own
    alone = lora_lib.LoraConfig(rank=4, targets=("z_proj",))
    assert {k: v["b"].shape for k, v in lora_lib.init_adapters(cfg, params, alone, jax.random.key(1))["layers"].items()
            } == {"z_proj": (2, 4, cfg.d_inner)}


@pytest.mark.parametrize("kernels", ["xla", "interpret"])
def test_lora_gradients_match_the_merged_dense_model(kernels):
    """The adapters' gradients through the LoRA path (x W + s (x A) B: one GEMM over [x | s x A] and
    [W ; B], in_proj's one adapter over z_proj and xbcdt_proj, [x | s x A] written by the norm: XLA's
    form, or the Pallas kernel run by the interpreter) against autodiff of the same embedding through
    the merged dense weights W + s A B, in float32, every adapter and saved module non-zero."""
    cfg = Mamba2Config(vocab_size=64, d_model=32, n_layers=2, d_state=8, head_dim=8, n_groups=2, chunk_size=8)
    params = models.family(cfg).init_params(cfg, jax.random.key(0))
    lora = lora_lib.LoraConfig(rank=4, alpha=8, modules_to_save=("dt_bias",))
    adapters = lora_lib.init_adapters(cfg, params, lora, jax.random.key(1))
    adapters = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(2), x.shape), adapters)
    rng = np.random.default_rng(3)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (3, 13)), jnp.int32)
    lengths, weights = jnp.asarray([13, 7, 10]), jnp.asarray(rng.normal(size=(3, cfg.d_model)), jnp.float32)

    def objective(weights_of):
        return lambda ad: jnp.sum(schedule.embed(weights_of(ad), cfg, ids, lengths, normalize=False,
                                                 kernels=kernels) * weights)

    # in_proj's down-projection s u A is computed once for both halves (and out_proj's once)
    program = jax.make_jaxpr(lambda ad: schedule.embed(lora_lib.apply(params, ad, lora, cfg), cfg, ids, lengths,
                                                       kernels=kernels))
    if kernels == "xla":
        downs = [eqn for eqn in jaxpr_equations(program(adapters).jaxpr)
                 if eqn.primitive.name == "dot_general" and eqn.outvars[0].aval.shape[-1] == lora.rank]
        assert len(downs) == 2, [eqn.outvars[0].aval.shape for eqn in downs]
    else:  # the norm before in_proj and the gated norm before out_proj write [u | s u A]
        names = [eqn.params.get("name") for eqn in jaxpr_equations(program(adapters).jaxpr)
                 if eqn.primitive.name == "pallas_call"]
        assert names.count("stacked_lora_input") == 2, names
    lora_grads = jax.grad(objective(lambda ad: lora_lib.apply(params, ad, lora, cfg)))(adapters)
    dense_grads = jax.grad(objective(lambda ad: lora_lib.merge(params, ad, lora, cfg)))(adapters)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(lora_grads), jax.tree.leaves(dense_grads),
                                 strict=True):
        assert float(jnp.abs(want).max()) > 0, jax.tree_util.keystr(path)
        assert rel_err(got, want) < 1e-5, (jax.tree_util.keystr(path), rel_err(got, want))


def test_lora_config_errors():
    cfg = Mamba2Config(vocab_size=64, d_model=32, n_layers=1, d_state=8, head_dim=8, chunk_size=8)
    with pytest.raises(ValueError, match="not linear layers of mamba2"):
        lora_lib.LoraConfig(targets=("out_proj", "conv_weight")).target_names(cfg)
    params = models.family(cfg).init_params(cfg, jax.random.key(0))
    with pytest.raises(ValueError, match="has no param 'embeddings'"):
        lora_lib.LoraConfig(modules_to_save=("embeddings",)).saved_paths(cfg, params)
    with pytest.raises(ValueError, match="'z_proj' \\('in_proj' is 'z_proj' and more\\) is also a LoRA target"):
        lora_lib.LoraConfig(modules_to_save=("in_proj",)).saved_paths(cfg, params)
    # mamba_ssm's (and PEFT configs') in_proj is two params here; naming it names both
    assert lora_lib.LoraConfig(targets=("in_proj",)).target_names(cfg) == ("z_proj", "xbcdt_proj")
    assert lora_lib.LoraConfig(targets=("out_proj",), modules_to_save=("in_proj",)).saved_paths(cfg, params) == (
        ("layers", "z_proj"), ("layers", "xbcdt_proj"))
    with pytest.raises(ValueError, match="rank must be a positive int"):
        lora_lib.LoraConfig(rank=0)
    with pytest.raises(ValueError, match="NF4 quantises matrices"):
        quantize_nf4(jnp.ones(7))


@pytest.mark.parametrize("grad_cache_size", [None, 2])
def test_length_groups_give_the_one_block_loss_and_gradient(grad_cache_size):
    """Texts sorted by length into 4 groups, each padded to its own bucket (short queries, long
    documents): loss and gradient equal the one-block step's (itself checked against jax.grad and
    the reference models), with and without GradCache. A text cut short by its group, or an
    embedding put back in the wrong row, would change the loss."""
    cfg, params, lora, adapters, batch = _tiny_setup(seed=5, lengths=(6, 21, 21))
    for key in ("query_ids", "pos_ids", "neg_ids"):  # one padded length, the longest's bucket, as batches have
        batch[key] = jnp.pad(batch[key], [(0, 0)] * (batch[key].ndim - 1) + [(0, 24 - batch[key].shape[-1])])
    lengths = np.concatenate([batch["query_len"], batch["pos_len"], np.asarray(batch["neg_len"]).reshape(-1)])
    plan = length_plan(lengths, 4, cfg.chunk_size)
    assert len(set(plan)) > 1 and plan[-1] == 24, plan
    f = jax.jit(loss_and_grads, static_argnums=3, static_argnames="plan")
    sc = StepConfig(cfg, lora, grad_cache_size=grad_cache_size, remat=grad_cache_size is not None)
    loss_one, g_one = f(adapters, params, batch, sc)
    loss_groups, g_groups = f(adapters, params, batch, sc, plan=plan)
    assert abs(float(loss_groups) - float(loss_one)) <= 1e-6 * abs(float(loss_one))
    for full, grouped in zip(jax.tree.leaves(g_one), jax.tree.leaves(g_groups), strict=True):
        assert rel_err(grouped, full) < 1e-5


def test_length_plan_and_its_checks():
    """Each of the equal groups of the sorted lengths padded to its longest text's bucket; a plan
    that does not fit the batch is an error, not texts dropped or cut."""
    lengths = np.array([3, 40, 9, 9, 17, 2, 33, 64])
    assert length_plan(lengths, 1, 16) == (64,)
    assert length_plan(lengths, 4, 16) == (16, 16, 48, 64)  # (2 3) (9 9) (17 33) (40 64); 16 at least
    assert length_plan(lengths, 2, 128) == (16, 64)
    with pytest.raises(ValueError, match="do not split into 3 equal length groups"):
        length_plan(lengths, 3, 16)
    cfg, params, lora, adapters, batch = _tiny_setup(b=4, k=1, lengths=(16, 16, 16))  # 12 texts
    sc = StepConfig(cfg, lora, remat=False)
    for plan in [(16, 16, 16, 16, 16), (16, 8), (8, 16, 32)]:  # 12 rows in 5 groups; decreasing; past the columns
        with pytest.raises(ValueError, match=rf"plan \({plan[0]}, .* does not fit a batch of 12 texts padded to 16"):
            loss_and_grads(adapters, params, batch, sc, plan=plan)


def test_a_run_compiles_at_most_eight_length_plans():
    """Past MAX_LENGTH_PLANS distinct plans, the 7 most frequent and the elementwise maximum are
    kept and every other plan runs padded up to the cheapest kept plan that covers it."""
    assert cap_length_plans([(16, 64), (32, 64), (16, 64)]) == {(16, 64): (16, 64), (32, 64): (32, 64)}
    plans = [(16, 256)] * 5 + [(32, 256)] * 4 + [(16, 128)] * 3 + [(64, 128)] * 2 + [(32, 128), (64, 64), (128, 128)]
    capped = cap_length_plans(plans, limit=4)  # keep (16, 256), (32, 256), (16, 128) and the cover (128, 256)
    assert set(capped.values()) == {(16, 256), (32, 256), (16, 128), (128, 256)}
    assert capped[(64, 128)] == capped[(128, 128)] == (128, 256)  # nothing smaller covers 64 or 128 in group 1
    assert capped[(32, 128)] == (32, 256) and capped[(64, 64)] == (128, 256)
    assert all(kept == plan for plan, kept in capped.items() if plan in [(16, 256), (32, 256), (16, 128)])


def test_length_groups_must_be_a_positive_int():
    from jaxembed.train.config import config_from_dict

    base = {"model": {"init": "configs/models/tiny-train-mamba2.yaml"}, "data": {"train": ["x.jsonl"]}}
    for value in (2.5, None, True, 0, "4"):
        with pytest.raises(ConfigError, match="train.length_groups"):
            config_from_dict({**base, "train": {"length_groups": value}})


def test_in_batch_negatives_only_train():
    """negatives_per_query 0 (the other queries' positives are the only negatives): the batch has
    neg_ids [B, 0, L]; GradCache equals the full batch, and AdamW steps on it lower the loss."""

    cfg, params, lora, adapters, batch = _tiny_setup(k=0)
    assert batch["neg_ids"].shape[:2] == (8, 0)
    f = jax.jit(loss_and_grads, static_argnums=3)
    loss_full, g_full = f(adapters, params, batch, StepConfig(cfg, lora, grad_cache_size=None, remat=False))
    loss_gc, g_gc = f(adapters, params, batch, StepConfig(cfg, lora, grad_cache_size=2, remat=True))
    assert abs(float(loss_gc) - float(loss_full)) <= 1e-6 * abs(float(loss_full))
    assert all(rel_err(gc, full) < 1e-5 for full, gc in zip(jax.tree.leaves(g_full), jax.tree.leaves(g_gc),
                                                               strict=True))
    losses, _ = _adam_steps(adapters, params, batch, StepConfig(cfg, lora, grad_cache_size=4, remat=True), 8)
    assert losses[-1] < 0.8 * losses[0], losses


def _adam_steps(trained, params, batch, sc, steps: int, check=None):
    """`steps` Adam updates of `trained` on one batch through loss_and_grads: (losses, trained)."""
    import optax

    f = jax.jit(loss_and_grads, static_argnums=3)
    optimizer = optax.adam(3e-3)
    state = optimizer.init(trained)
    losses = []
    for _ in range(steps):
        loss, grads = f(trained, params, batch, sc)
        if check:
            check(grads)
        updates, state = optimizer.update(grads, state, trained)
        trained = optax.apply_updates(trained, updates)
        losses.append(float(loss))
    return losses, trained


def test_full_parameter_training_lowers_the_loss():
    """`lora: null`: no adapters, every param a float32 master (LoraConfig.full); the loss falls, and
    the merged params are the trained masters cast back to the stored dtype."""

    cfg, params, _, _, batch = _tiny_setup(k=1)
    lora = lora_lib.LoraConfig.full(params)
    assert lora.target_names(cfg) == () and set(lora.modules_to_save) >= {"embedding", "z_proj", "xbcdt_proj", "norm_f"}
    trained = lora_lib.init_adapters(cfg, params, lora, jax.random.key(0))
    assert trained["layers"] == {} and set(trained["saved"]["layers"]) == set(params["layers"])
    def has_gradient(grads):
        assert float(jnp.linalg.norm(grads["saved"]["layers"]["z_proj"])) > 0

    losses, trained = _adam_steps(trained, params, batch, StepConfig(cfg, lora, grad_cache_size=4, remat=True), 6,
                                  check=has_gradient)
    assert losses[-1] < 0.8 * losses[0], losses
    merged = lora_lib.merge(params, trained, lora, cfg)
    assert float(jnp.abs(merged["layers"]["z_proj"] - params["layers"]["z_proj"]).max()) > 0


def test_config_values_out_of_range_are_named():
    from jaxembed.train.config import config_from_dict

    base = {"model": {"init": "configs/models/tiny-train-mamba2.yaml"}, "data": {"train": ["x.jsonl"]}}
    for section, values, message in [
        ("train", {"weight_decay": -0.1}, r"train.weight_decay must be a non-negative, finite number, got -0.1"),
        # NaN and inf passed `<= 0`: inf trained nothing (every logit 0) and exited 0, NaN "diverged"
        ("train", {"temperature": float("inf")}, r"train.temperature must be a positive, finite number, got inf"),
        ("train", {"learning_rate": float("nan")}, r"train.learning_rate must be a positive, finite number, got nan"),
        ("train", {"weight_decay": float("nan")}, r"train.weight_decay must be a non-negative, finite number"),
        ("lora", {"rank": 4, "alpha": float("nan")}, r"lora alpha must be a positive, finite number, got nan"),
        ("model", {"path": "m", "init": None, "init_options": {"A_init_range": [1, 2]}},
         "model.init_options applies to `init`"),
        ("model", {"chunk_size": 0}, r"model.chunk_size must be a positive int or null"),
        ("eval", {"max_queries": 5}, "eval.max_queries caps the held-out queries, and there is no data.heldout"),
        ("model", {"seed": -1}, r"train.seed and model.seed must be >= 0, got 0 and -1"),
        ("eval", {"k": 0}, r"eval.k must be positive, got 0"),
        ("eval", {"batch_size": 0}, r"eval.batch_size must be positive, got 0"),
        ("eval", {"max_queries": 0}, r"eval.max_queries must be positive or null, got 0"),
        ("eval", {"every": -1}, r"eval.every must be >= 0"),
        ("data", {"instructions": {"code": 5}}, r"data.instructions maps source names to instruction strings; "
                                                r"not strings: \{'code': 5\}"),
    ]:
        with pytest.raises(ConfigError, match=message):
            config_from_dict({**base, section: {**base.get(section, {}), **values}})


def test_resume_refuses_another_base_schedule_or_a_damaged_checkpoint(tmp_path):
    """A checkpoint is resumed only by the run that wrote it: another base model (model.seed), total step
    count, learning rate or LoRA alpha is a ConfigError naming each difference (none needs a compiled step:
    the checkpoints are saved from the initial state). A damaged latest checkpoint names its directory and
    the one to fall back to. Up front: an `output` that is a file or the base model; instructions for a source
    nobody has; a source smaller than the batch is a warning; a held-out row's blank negative drops nothing."""
    import yaml

    from jaxembed.errors import CheckpointError
    from jaxembed.train.config import load_train_config
    from jaxembed.train.trainer import Trainer

    rows = [{"query": f"query {i} " * 3, "positive": f"the text of document {i} " * 4, "negatives": ["other " * 5]}
            for i in range(16)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "h.jsonl").write_text("".join(json.dumps({**r, "query": "held " + r["query"], "negatives": ["  "]})
                                              + "\n" for r in rows[:5]))
    raw = {"model": {"init": str(ROOT / "configs/models/tiny-train-mamba2.yaml"), "tokenizer": "stdlib-bpe:258"},
           "data": {"train": str(tmp_path / "d.jsonl"), "heldout": str(tmp_path / "h.jsonl"), "max_tokens": 64},
           "lora": {"rank": 4}, "train": {"batch_size": 8, "max_steps": 4, "epochs": 10},
           "checkpoint": {"directory": str(tmp_path / "ck"), "every": 1}}

    def trainer(**changes):
        config = {section: {**raw[section], **changes.get(section, {})} if isinstance(raw.get(section), dict)
                  else changes.get(section, raw.get(section)) for section in {*raw, *changes}}
        (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
        return Trainer(load_train_config(tmp_path / "c.yaml"), show_progress=False)

    with pytest.warns(UserWarning, match="eval.k=10 is at least the 5 held-out documents: recall@10 is 1"):
        first = trainer()
    assert len(first.heldout) == 5 and "held-out: read 5 rows, kept 5" in first.data_summary()
    # not "(negatives_per_query is 0)": the config's is 1, and held-out negatives are never used
    assert "5 rows had negatives, unused (held-out queries are ranked among the held-out positives)" in \
        first.data_summary()
    # the model FLOPs of a step: 4N with the base frozen (no weight gradients), 6N in full training
    assert first.flops_per_token == 4 * first.matmul_params
    full = Trainer(dataclasses.replace(load_train_config(tmp_path / "c.yaml"), lora=None), show_progress=False)
    assert full.flops_per_token == 6 * first.matmul_params
    # the untied LM head, read by no embedding, is neither trained (weight decay shrank it, and every logit of the
    # export) nor put on the device; the export keeps it as stored
    assert "lm_head" in full.stored_params and "lm_head" not in full.lora.modules_to_save
    assert "lm_head" not in full.base and "lm_head" not in first.base
    with pytest.raises(ConfigError, match="lora modules_to_save: 'lm_head' is read by no embedding"):
        trainer(lora={"rank": 4, "modules_to_save": ["lm_head"]})
    # eval.max_queries caps the queries, not the documents they are ranked among (a cut pool was easier)
    capped = trainer(eval={"max_queries": 2, "k": 3})
    assert "the first 2 queries evaluated against all 5" in capped.data_summary()
    assert capped.evaluate()["docs"] == 5
    for step in (1, 2):
        first.save(step, force=True)
    first.manager.wait_until_finished()
    for changes, message in [
        ({"model": {"seed": 5}}, "another base model"),
        ({"train": {"max_steps": 3}}, r"total steps \(epochs / max_steps\)=4, this run has 3"),
        ({"train": {"learning_rate": 1e-3}}, r"train.learning_rate=0.0004, this run has 0.001"),
        ({"lora": {"rank": 4, "alpha": 8.0}}, r"lora.alpha=16.0, this run has 8.0"),
        ({"eval": {"k": 3}}, r"another held-out evaluation \(data.heldout's rows, eval.max_queries or eval.k\)"),
    ]:
        with pytest.raises(ConfigError, match=f"checkpoint 2 was written with {message}.*use the config it was "
                                              "written with, or a new checkpoint directory"):
            trainer(**changes).restore()
    assert trainer().restore() == 2
    # dropping the held-out set is not changing it (no figures of two sets in one log): resumed, as adding one is
    assert trainer(data={"heldout": None}).restore() == 2
    # `output` is replaced only if it is this run's own export (it replaced any jaxembed model silently)
    own = first.export(tmp_path / "own")
    assert trainer(output=str(own)).restore() == 2
    other = checkpoint.save(tmp_path / "converted", first.config, first.stored_params, source="jaxembed convert (x)")
    with pytest.raises(ConfigError, match=r"output: .*converted holds another model \(written by jaxembed convert "
                                          r"\(x\)\), not this run's export"):
        trainer(output=str(other))
    with pytest.raises(ConfigError, match=r"the export directory: .*converted holds another model"):
        first.export(other)
    # the base model's own query template unless the config names one (the paper's was used: an E5-style model
    # was fine-tuned, and exported, under another prompt than its own)
    e5_settings = {"query_template": "Instruct: {prompt}\nQuery: ", "default_instruction": "Find the docs"}
    e5 = checkpoint.save(tmp_path / "e5", first.config, first.stored_params, embedder=e5_settings)
    from_e5 = {"path": str(e5), "init": None}
    tuned = trainer(model=from_e5, checkpoint={"directory": str(tmp_path / "ck-e5")})
    assert tuned.query_template == "Instruct: {prompt}\nQuery: "
    exported = checkpoint.load(tuned.export(tmp_path / "e5-tuned"))
    assert exported[2] == e5_settings  # the default instruction too
    np.testing.assert_array_equal(exported[1]["lm_head"], first.stored_params["lm_head"])
    assert trainer(model=from_e5, checkpoint={"directory": str(tmp_path / "ck-e5")},
                   data={"query_template": "Q {prompt}: "}).query_template == "Q {prompt}: "
    assert first.query_template == "Instruction: {prompt}\nQuery: "  # random weights: the paper's
    # one value of the latest checkpoint changed under its files (orbax's chunks carry no checksum: a flipped
    # byte restored silently): named by the digests recorded at save
    import orbax.checkpoint as ocp

    state_dir = tmp_path / "ck" / "2" / "state"
    with ocp.StandardCheckpointer() as io:
        state = jax.tree.map(np.array, io.restore(state_dir))
        leaf = next(iter(jax.tree_util.tree_leaves(state["adapters"])))
        leaf[(0,) * leaf.ndim] += 1e-3
        io.save(tmp_path / "edited", state)
    shutil.rmtree(state_dir)
    shutil.move(tmp_path / "edited", state_dir)
    with pytest.raises(CheckpointError, match=r"ck/2: checkpoint 2 is corrupt: 1 array\(s\) differ from the digests "
                                              r"recorded when it was written \(\.adapters.*resume from checkpoint 1"):
        trainer().restore()
    for item in state_dir.iterdir():  # the arrays of the latest checkpoint lost
        if item.is_dir():
            shutil.rmtree(item)
    with pytest.raises(CheckpointError, match=r"ck/2: checkpoint 2 is damaged or incomplete, its state could not be "
                                              r"read .* resume from checkpoint 1"):
        trainer().restore()
    (tmp_path / "model.bin").write_text("x")
    with pytest.raises(ConfigError, match="output: .*model.bin exists and is not a directory"):
        trainer(output=str(tmp_path / "model.bin"))
    # the paths the run writes are checked before the model loads and the data is tokenized, not at step 1
    (tmp_path / "logs").mkdir()
    with pytest.raises(ConfigError, match="log: .*logs is a directory; the metrics log is a file"):
        trainer(log=str(tmp_path / "logs"))
    with pytest.raises(ConfigError, match="log: .*model.bin/m.jsonl cannot be created: .*model.bin is a file"):
        trainer(log=str(tmp_path / "model.bin" / "m.jsonl"))
    with pytest.raises(ConfigError, match="tensorboard: .*model.bin exists and is not a directory"):
        trainer(tensorboard=str(tmp_path / "model.bin"))
    with pytest.raises(ConfigError, match="data.token_cache: .*model.bin/c/d cannot be created: .*model.bin is a"):
        trainer(data={"token_cache": str(tmp_path / "model.bin" / "c" / "d")})
    cfg = load_train_config(tmp_path / "c.yaml")
    model_dir = str(tmp_path / "base-model")
    with pytest.raises(ConfigError, match="output: .*base-model is model.path; the export would replace the base"):
        Trainer(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=model_dir, init=None),
                                    output=model_dir + "/"), show_progress=False)
    with pytest.raises(ConfigError, match="data.instructions: no training or held-out record has source smal; the "
                                          "sources are d, h"):
        trainer(data={"instructions": {"smal": "find it"}})
    # held-out rows that are trained on: the file among the training files (data/*.jsonl matches the corpus's
    # heldout.jsonl), or a held-out (query, positive) pair in a training file; both were evaluated as unseen
    with pytest.raises(ConfigError, match=r"data.heldout .*h.jsonl is also a training file"):
        trainer(data={"train": str(tmp_path / "*.jsonl")})
    (tmp_path / "leak" / "d.jsonl").parent.mkdir()
    (tmp_path / "leak" / "d.jsonl").write_text((tmp_path / "d.jsonl").read_text() + json.dumps(
        {"query": "held " + rows[2]["query"], "positive": rows[2]["positive"], "negatives": ["other"]}) + "\n")
    with pytest.raises(ConfigError, match=r"data.heldout: 1 training row\(s\) hold a held-out \(query, positive\)"):
        trainer(data={"train": str(tmp_path / "leak" / "d.jsonl")})
    # a file named twice is read once; two files that are one source by name are said to be
    with pytest.warns(UserWarning, match=r"names 1 file\(s\) more than once, read once: .*d.jsonl \(also .*d.jsonl\)"):
        assert trainer(data={"train": [str(tmp_path / "d.jsonl"), str(tmp_path / "d.jsonl")]}).sizes == {"d": 16}
    (tmp_path / "other").mkdir()
    shutil.copy(tmp_path / "d.jsonl", tmp_path / "other" / "d.jsonl")
    with pytest.warns(UserWarning, match=r"are all source 'd' \(batched together, sharing data.instructions\)"):
        trainer(data={"train": [str(tmp_path / "d.jsonl"), str(tmp_path / "other" / "d.jsonl")]})
    # a prompt as long as max_tokens leaves nothing of the query: every query of the source one text
    with pytest.raises(ConfigError, match=r"data.max_tokens=16 leaves no room for the queries of source 'd': their "
                                          r"prompt .* is \d+ tokens"):
        trainer(data={"max_tokens": 16, "instructions": {"d": "Given a natural language query, find the function"}})
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
    with pytest.warns(UserWarning, match=r"source 's' \(3 rows\) has fewer rows than train.batch_size=8 and is "
                                         "never trained on"):
        small = trainer(data={"train": [str(tmp_path / "d.jsonl"), str(tmp_path / "s.jsonl")]})
    assert "3 kept rows left out of every epoch (each source's last partial batch: s 3)" in small.data_summary()


def test_device_peaks_take_the_most_specific_name():
    from jaxembed.train.sharding import device_peak_flops

    assert device_peak_flops("NVIDIA H100 80GB HBM3") == 989e12 and device_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert device_peak_flops("NVIDIA H100 NVL") == 835e12 and device_peak_flops("NVIDIA GH200 480GB") == 989e12
    assert device_peak_flops("NVIDIA L40S") == 362e12 and device_peak_flops("NVIDIA L4") == 121e12
    assert device_peak_flops("cpu") is None


def test_full_training_config():
    from jaxembed.train.config import config_from_dict

    base = {"model": {"init": "configs/models/tiny-train-mamba2.yaml"}, "data": {"train": ["x.jsonl"]}}
    assert config_from_dict({**base, "lora": None}).lora is None
    with pytest.raises(ConfigError, match="with lora: null .* set quantization: null"):
        config_from_dict({**base, "lora": None, "quantization": "nf4"})


def test_a_stdlib_bpe_size_that_is_not_a_number_is_named():
    from jaxembed.train.trainer import _tokenizer

    for spec in ("stdlib-bpe:abc", "stdlib-bpe:", "stdlib-bpe:0", "stdlib-bpe:-5", "stdlib-bpe:256"):
        # 256 gave 258 tokens (bytes and two special tokens) without a word, which the model then refused
        with pytest.raises(ConfigError, match=f"model.tokenizer: '{spec}': stdlib-bpe:N takes a vocabulary size N "
                                              "of at least 258"):
            _tokenizer(spec, None)


@pytest.mark.parametrize("template, message", [
    ("Instruct: {prompt} {x}\nQuery: ", r"no other placeholder.*other placeholders: \{x\}"),
    ("Instruct: {prompt} {}\nQuery: ", r"other placeholders: \{\}"),
    ("Instruct: {prompt} {\nQuery: ", r"not a valid template .* write a literal brace as \{\{ or \}\}"),
    ("Instruct: {instruction}\nQuery: ", "must contain '{prompt}'"),
])
def test_a_query_template_with_other_placeholders_is_a_config_error(template, message):
    """A template is checked as what it is used for (`str.format(prompt=...)`), when the config is read: not a
    KeyError at the first query. `{{` and `}}` are literal braces, and {prompt} may appear twice."""
    from jaxembed.text import check_query_template
    from jaxembed.train.config import config_from_dict

    base = {"model": {"init": "configs/models/tiny-train-mamba2.yaml"}, "data": {"train": ["x.jsonl"]}}
    with pytest.raises(ConfigError, match="data.query_template .*" + message):
        config_from_dict({**base, "data": {**base["data"], "query_template": template}})
    with pytest.raises(ValueError, match="query_template .*" + message):
        check_query_template(template)
    assert check_query_template("{{json}} {prompt}: {prompt}\n") == "{{json}} {prompt}: {prompt}\n"


def test_init_options_reach_the_family_init():
    """model.init_options are the family's init keywords (Mamba2: mamba_ssm's A_init_range, dt_min, ...);
    an option the family does not take is an error that lists the ones it does."""
    from jaxembed.train.config import config_from_dict
    from jaxembed.train.trainer import init_params

    base = {"model": {"init": "configs/models/tiny-train-mamba2.yaml", "init_options": {"A_init_range": [0.01, 1.0],
                                                                                        "D_init": 0.5}},
            "data": {"train": ["x.jsonl"]}}
    cfg = config_from_dict(base)
    from jaxembed.config import load_config

    arch = load_config(ROOT / cfg.model.init)
    params = init_params(arch, cfg.model)
    a = np.exp(np.asarray(params["layers"]["A_log"]))
    assert 0.01 <= a.min() and a.max() <= 1.0 and np.all(np.asarray(params["layers"]["D"]) == 0.5)
    bad = dataclasses.replace(cfg.model, init_options={"A_range": [1, 2]})
    with pytest.raises(ConfigError, match=r"\['A_range'\] not understood by mamba2; it takes \['A_init_range', 'D"):
        init_params(arch, bad)
    with pytest.raises(ConfigError, match="A_init_range must be 0 < low <= high"):
        init_params(arch, dataclasses.replace(cfg.model, init_options={"A_init_range": [2, 1]}))


def test_grad_cache_auto_fits_the_step_in_memory(tmp_path, monkeypatch):
    """grad_cache_size: auto picks the largest GradCache size whose compiled step (memory_analysis)
    fits the device; an explicit size that does not fit is an error naming one that does."""
    import yaml

    from jaxembed.train.config import load_train_config
    from jaxembed.train.trainer import Trainer

    rows = [{"query": f"query {i} " * 3, "positive": f"the text of document {i} " * 4, "negatives": ["other " * 5]}
            for i in range(16)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw = {"model": {"init": str(ROOT / "configs/models/tiny-train-mamba2.yaml"), "tokenizer": "stdlib-bpe:258"},
           "data": {"train": str(tmp_path / "d.jsonl"), "negatives_per_query": 1, "max_tokens": 64},
           "lora": {"rank": 4}, "train": {"batch_size": 4, "grad_cache_size": "auto", "max_steps": 2},
           "checkpoint": {"directory": str(tmp_path / "ck")}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    cfg = load_train_config(tmp_path / "c.yaml")
    trainer = Trainer(cfg, show_progress=False, memory_limit_bytes=2**40)
    assert trainer.grad_cache_size is None  # the whole batch fits
    full, two = trainer.step_bytes[4], trainer._step_bytes(2)  # compiled steps, measured (and cached)
    assert two < full
    limit = (two + full) // 2
    chosen = trainer._fit_grad_cache("auto", limit)
    assert chosen == 2 and trainer.step_bytes[chosen] <= limit < full
    with pytest.raises(ConfigError, match=r"grad_cache_size=None: the step needs more .* grad_cache_size: \d+ fits"):
        trainer._fit_grad_cache(None, limit)
    # the smallest size there is, not fitting either: no smaller one to name, and the error says so
    measured, trainer._step_bytes = trainer._step_bytes, lambda g: 2**30
    with pytest.raises(ConfigError, match=r"even one sub-batch of 1 queries needs more than the device's 0.5 GiB"):
        trainer._fit_grad_cache(1, 2**29)
    trainer._step_bytes = measured
    # the pipelined run: one row per step, metrics read back per window, throughput and input wait in them
    steps = [r for r in trainer.run() if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(np.isfinite(r["loss"]) for r in steps)
    assert all(0 <= r["input_wait_share"] < 1 and r["tokens_per_s"] > 0 and r["mfu"] is None for r in steps)
    # the first window compiled the step: that time is its own field, not in the throughput
    assert steps[0]["compile_s"] > 0
    # save() is called every step and orbax decides: the state's digest (a device pass) only when it saves
    from jaxembed.train import trainer as trainer_module

    digests = []
    monkeypatch.setattr(trainer_module, "state_digest", lambda state: digests.append(1) or {})
    trainer.save(3)
    assert digests == [] and trainer.manager.latest_step() == 2
    tick = time.perf_counter()
    batch = trainer.batch(0)
    (row,) = trainer._rows([(0, batch, {"loss": 1.0}, 0)], tick - 100.0, 0.5, 99.0)
    elapsed = time.perf_counter() - tick + 1.0  # the window less its compilation: 1 s and this call
    assert batch.tokens / elapsed <= row["tokens_per_s"] <= batch.tokens and row["input_wait_share"] <= 0.5
    # resuming that checkpoint on other data (same row count, one text edited) is refused: the batches would differ
    rows[5]["positive"] += " edited"
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    other = Trainer(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, grad_cache_size=None)),
                    show_progress=False)
    with pytest.raises(ConfigError, match="checkpoint 2 was written with other training data or tokenization"):
        other.restore()
    # and with another LoRA rank, before orbax's restore: the leaves whose shapes differ are named
    rows[5]["positive"] = rows[5]["positive"].removesuffix(" edited")
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rank8 = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, rank=8),
                                train=dataclasses.replace(cfg.train, grad_cache_size=None))
    rank8 = Trainer(rank8, show_progress=False)
    with pytest.raises(ConfigError, match=r"checkpoint 2 holds another training state .* other shapes: "
                                          r"adapters/layers/in_proj/a \(2, 64, 4\) -> \(2, 64, 8\)"):
        rank8.restore()


def test_a_diverging_run_stops_before_saving_the_step(tmp_path):
    """A learning rate that overflows the params (1e38 from step 2, after one warm-up step at 0):
    the run stops at step 2, the step whose update did it (its loss is still finite; the updated
    params' norm is not), after logging it and before any checkpoint of it. The checkpoint of
    step 1 is complete and restorable, with finite params."""
    import yaml

    from jaxembed.errors import TrainingDivergedError
    from jaxembed.train.config import load_train_config
    from jaxembed.train.trainer import Trainer

    rows = [{"query": f"query {i} " * 3, "positive": f"the text of document {i} " * 4, "negatives": ["other " * 5]}
            for i in range(16)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw = {"model": {"init": str(ROOT / "configs/models/tiny-train-mamba2.yaml"), "tokenizer": "stdlib-bpe:258"},
           "data": {"train": str(tmp_path / "d.jsonl"), "negatives_per_query": 1, "max_tokens": 64},
           "lora": None, "train": {"batch_size": 8, "max_steps": 4, "learning_rate": 1e38, "warmup_steps": 1,
                                   "log_every": 2},
           "checkpoint": {"directory": str(tmp_path / "ck"), "every": 1}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    cfg = load_train_config(tmp_path / "c.yaml")
    with pytest.raises(TrainingDivergedError, match=r"diverged at step 2: the step's update made the parameters "
                                                    r"overflow .* checkpoint of step 1 holds finite parameters"):
        Trainer(cfg, show_progress=False).run()
    # strict JSON (no NaN / Infinity tokens): the diverged step's non-finite norm is null
    logged = [json.loads(line, parse_constant=lambda token: pytest.fail(f"{token} in metrics.jsonl"))
              for line in cfg.log_path.read_text().splitlines()]
    steps = [(r["step"], r["loss"] is not None, r["param_norm"] is not None) for r in logged if "loss" in r]
    assert steps == [(1, True, True), (2, True, False)]
    resumed = Trainer(cfg, show_progress=False)
    assert resumed.manager.all_steps() == [1] and resumed.restore() == 1
    assert all(bool(jnp.isfinite(leaf).all()) for leaf in jax.tree.leaves(resumed.state.adapters))


def test_an_evaluation_lost_to_an_interrupt_is_computed_on_resume(tmp_path, monkeypatch):
    """Ctrl-C (or a kill) during the held-out evaluation of step 2, after step 2's checkpoint: the resumed
    run starts at step 2 and evaluates it then (it went on to step 3, and step 2's figures were never
    logged). A finished run run again evaluates nothing more, and a log row torn by a kill is dropped."""
    import yaml

    from jaxembed.train.config import load_train_config
    from jaxembed.train.trainer import Trainer

    rows = [{"query": f"query {i:02d} " * 3, "positive": f"the text of document {i:02d} " * 4} for i in range(16)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[5:]))
    (tmp_path / "h.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:5]))
    raw = {"model": {"init": str(ROOT / "configs/models/tiny-train-mamba2.yaml"), "tokenizer": "stdlib-bpe:258"},
           "data": {"train": str(tmp_path / "d.jsonl"), "heldout": str(tmp_path / "h.jsonl"), "max_tokens": 32,
                    "negatives_per_query": 0},
           "lora": {"rank": 4}, "train": {"batch_size": 4, "max_steps": 4, "epochs": 10}, "eval": {"every": 2, "k": 3},
           "checkpoint": {"directory": str(tmp_path / "ck"), "every": 1}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    cfg = load_train_config(tmp_path / "c.yaml")
    evaluate, calls = Trainer.evaluate, []

    def interrupted_at_the_second(self):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return evaluate(self)

    monkeypatch.setattr(Trainer, "evaluate", interrupted_at_the_second)
    trainer = Trainer(cfg, show_progress=False)  # one object run again: it restores as a new process would
    with pytest.raises(KeyboardInterrupt):
        trainer.run()
    monkeypatch.setattr(Trainer, "evaluate", evaluate)

    def logged():
        rows = [json.loads(line) for line in cfg.log_path.read_text().splitlines()]
        return [(r["step"], "eval/mrr@3" in r) for r in rows if "step" in r]

    assert logged() == [(0, True), (1, False), (2, False)]
    trainer.run()
    assert logged() == [(0, True), (1, False), (2, False), (2, True), (3, False), (4, False), (4, True)]
    with open(cfg.log_path, "a") as f:
        f.write('{"step": 5, "lo')
    trainer.run()
    assert logged()[-2:] == [(4, False), (4, True)]


@pytest.mark.parametrize("path", sorted((ROOT / "configs/train").glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_training_configs_load(path):
    from jaxembed.train.config import load_train_config

    cfg = load_train_config(path)
    assert (ROOT / cfg.model.init).is_file() if cfg.model.init else cfg.model.path


def test_qlora_export_is_the_model_that_was_trained_and_evaluated(tmp_path):
    """With `quantization: nf4` the adapters are fitted to (and evaluated on) the dequantised NF4 weights: the
    export folds them in there, so it embeds as the live model does. (It folded them into the float weights
    none of training saw: 0.2-0.4 relative difference on these tiny models, where NF4's error is large.)"""
    import yaml

    import jaxembed
    from jaxembed.train.config import load_train_config
    from jaxembed.train.trainer import Trainer

    rows = [{"query": f"query {i} " * 3, "positive": f"the text of document {i} " * 4} for i in range(8)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw = {"model": {"init": str(ROOT / "configs/models/tiny-train-mamba2.yaml"), "tokenizer": "stdlib-bpe:258",
                     "dtype": "float32"},
           "data": {"train": str(tmp_path / "d.jsonl"), "negatives_per_query": 0, "max_tokens": 32},
           "lora": {"rank": 4, "targets": ["in_proj"]}, "quantization": "nf4",
           "train": {"batch_size": 4, "max_steps": 1}, "checkpoint": {"directory": str(tmp_path / "ck")},
           "output": str(tmp_path / "out")}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    trainer = Trainer(load_train_config(tmp_path / "c.yaml"), show_progress=False)
    keys = iter(jax.random.split(jax.random.key(2), 8))  # adapters as after training: B no longer zero
    adapters = jax.tree.map(lambda leaf: leaf + 0.05 * jax.random.normal(next(keys), leaf.shape, leaf.dtype),
                            trainer.state.adapters)
    trainer.state = trainer.state._replace(adapters=adapters)
    trainer.export()
    texts = ["def parse(text): return json.loads(text)", "Return the sum of a list"]
    live = trainer.embedder().encode(texts, normalize_embeddings=False)
    exported = jaxembed.load(tmp_path / "out").encode(texts, normalize_embeddings=False)
    assert max(rel_err(e, r) for e, r in zip(exported, live, strict=True)) < 1e-5
