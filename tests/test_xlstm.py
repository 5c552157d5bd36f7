"""xLSTM against transformers (fp32, native torch kernels): the mLSTM cell against transformers'
own kernel functions, whole models through `jaxembed.load(...).encode_ids` against
`xLSTMModel(...).last_hidden_state` at len-1 of each sequence run alone, and the converter."""

import json
from functools import partial
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from conftest import TOLERANCE, record_segments, rel_err, split_over_chunks
from safetensors.torch import load_file, save_file
from transformers.models.xlstm import configuration_xlstm as hf_config
from transformers.models.xlstm import modeling_xlstm as hf_kernels

import jaxembed
from jaxembed import checkpoint
from jaxembed.config import load_config
from jaxembed.convert import ConversionError, convert, read_checkpoint
from jaxembed.convert.xlstm import config_from_transformers
from jaxembed.models import xlstm
from jaxembed.ops import mlstm
from jaxembed.testing.xlstm import hf_xlstm_last_hidden, make_hf_xlstm

ROOT = Path(__file__).resolve().parents[1]
TOL = TOLERANCE["float32"]

# ---- the mLSTM cell ---------------------------------------------------------------------

FORMS = {  # jitted once per module: each distinct input shape compiles once
    "recurrent": jax.jit(mlstm.recurrent),
    "quadratic": jax.jit(mlstm.quadratic),
    "chunked_q8": jax.jit(partial(mlstm.chunked, chunk_size=8)),
    "chunked_q16": jax.jit(partial(mlstm.chunked, chunk_size=16)),
}


def cell_inputs(seed, t, *, b=2, h=3, dk=8, dv=16, f_shift=1.0, f_scale=2.0):
    """Random q, k, v [b,t,h,·], gate preactivations i, f [b,t,h] and a nonzero initial (C, n, m)."""
    rng = np.random.default_rng(seed)
    r = lambda *s: rng.standard_normal(s).astype(np.float32)
    return {"q": r(b, t, h, dk), "k": r(b, t, h, dk), "v": r(b, t, h, dv), "i": 3 * r(b, t, h),
            "f": f_scale * r(b, t, h) + f_shift, "state": mlstm.State(r(b, h, dk, dv), r(b, h, dk), r(b, h))}


def _torch(a, time_axis=True):
    """[b, t, h, ·] -> transformers' [b, h, t, ·] as float64 (the reference runs in double precision)."""
    a = np.moveaxis(a, 1, 2) if time_axis else a
    return torch.from_numpy(np.ascontiguousarray(a, np.float64))


def hf_cell(x, kernel: str, chunk_size=None):
    """transformers' native mLSTM kernels on the same inputs, float64: `sequence`
    (mlstm_recurrent_sequence_native), `chunkwise` (mlstm_chunkwise_native_autograd) or `step`
    (mlstm_recurrent_step_native, one token). Returns (h [b,t,h,v], (C, n, m))."""
    C0, n0, m0 = (_torch(np.asarray(a), time_axis=False) for a in x["state"])
    q, k, v, i, f = (_torch(x[name]) for name in "qkvif")
    with torch.no_grad():
        if kernel == "sequence":
            h, (C, n, m) = hf_kernels.mlstm_recurrent_sequence_native(
                q, k, v, i, f, c_initial=C0, n_initial=n0, m_initial=m0[..., None], return_last_states=True,
                eps=mlstm.EPS, dtype_state=torch.float64)
        elif kernel == "chunkwise":
            h, (C, n, m) = hf_kernels.mlstm_chunkwise_native_autograd(
                q, k, v, i, f, c_initial=C0, n_initial=n0, m_initial=m0[..., None], return_last_states=True,
                eps=mlstm.EPS, chunk_size=chunk_size)
        else:
            h, (C, n, m) = hf_kernels.mlstm_recurrent_step_native(
                q[:, :, 0], k[:, :, 0], v[:, :, 0], i, f, C0, n0, m0[..., None], eps=mlstm.EPS,
                dtype_state=torch.float64)
            h = h[:, :, None]
    return np.moveaxis(h.numpy(), 1, 2), (C.numpy(), n.numpy(), m.numpy()[..., 0])


def assert_cell_matches(out, ref):
    (h, state), (h_ref, state_ref) = out, ref
    assert np.all(np.isfinite(h)) and all(np.all(np.isfinite(s)) for s in state)
    state_errs = [rel_err(s, r) for s, r in zip(state, state_ref, strict=True)]
    errs = dict(zip(("h", "C", "n", "m"), [rel_err(h, h_ref)] + state_errs, strict=True))
    print("relative errors", {k: f"{e:.1e}" for k, e in errs.items()})
    assert max(errs.values()) < TOL, errs


def normaliser_branches(x):
    """(fraction of steps where |q̂·n_t| wins the normaliser max, fraction where exp(-m_t) wins), float64:
    a random case is only a test of the normaliser if both branches occur."""
    _, n, m = (np.asarray(a, np.float64) for a in x["state"])
    q = np.asarray(x["q"], np.float64) * x["q"].shape[-1] ** -0.5
    k, i, f = (np.asarray(x[name], np.float64) for name in "kif")
    qn_wins = []
    for t in range(q.shape[1]):
        logf = -np.logaddexp(0.0, -f[:, t])
        m_new = np.maximum(logf + m, i[:, t])
        n = np.exp(logf + m - m_new)[..., None] * n + np.exp(i[:, t] - m_new)[..., None] * k[:, t]
        m = m_new
        qn_wins.append(np.abs(np.sum(q[:, t] * n, -1)) > np.exp(-m))
    wins = np.mean(qn_wins)
    return wins, 1 - wins


@pytest.mark.parametrize("form", FORMS)
def test_cell_forms_match_transformers_sequence_kernel(form):
    """t = 37 (not a multiple of 8 or 16) from a nonzero state: outputs and final (C, n, m)."""
    x = cell_inputs(0, 37)
    qn, floor = normaliser_branches(x)
    assert qn > 0.2 and floor > 0.05, (qn, floor)
    out = FORMS[form](x["q"], x["k"], x["v"], x["i"], x["f"], initial_state=x["state"])
    assert_cell_matches(out, hf_cell(x, "sequence"))


@pytest.mark.parametrize("form", ["chunked_q16", "chunked_q8"])
def test_cell_matches_transformers_chunkwise_kernel(form):
    """t = 48 = 3 chunks of transformers' chunkwise kernel (Q = 16), from a nonzero state; ours with Q = 16 and 8."""
    x = cell_inputs(1, 48)
    out = FORMS[form](x["q"], x["k"], x["v"], x["i"], x["f"], initial_state=x["state"])
    assert_cell_matches(out, hf_cell(x, "chunkwise", chunk_size=16))


@pytest.mark.parametrize("form", ["recurrent", "chunked_q8"])  # at t = 1 every chunk size is one chunk of 1
def test_cell_single_token_matches_transformers_step_kernel(form):
    x = cell_inputs(2, 1)
    out = FORMS[form](x["q"], x["k"], x["v"], x["i"], x["f"], initial_state=x["state"])
    assert_cell_matches(out, hf_cell(x, "step"))


def test_cell_strong_decay_stays_finite_with_finite_gradients():
    """Forget-gate preactivations around -12 (log decay ~ -12 per token, ~ -190 over a chunk of 16, ~ -440 over
    the sequence): exp of the masked exponents above the diagonal overflows without the clamp, and 0 * inf would
    turn the gradient into NaN."""
    x = cell_inputs(3, 37, f_shift=-12.0, f_scale=3.0)
    ref = hf_cell(x, "sequence")
    for form in ("chunked_q16", "quadratic"):
        assert_cell_matches(FORMS[form](x["q"], x["k"], x["v"], x["i"], x["f"], initial_state=x["state"]), ref)

    def loss(i, f):
        h, (C, n, m) = mlstm.chunked(x["q"], x["k"], x["v"], i, f, chunk_size=16, initial_state=x["state"])
        return (h**2).sum() + (C**2).sum() + n.sum() + m.sum()

    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(x["i"], x["f"])
    assert all(np.all(np.isfinite(g)) and np.any(g != 0) for g in grads)


def test_remat_gradients_are_finite_and_equal_the_stored_ones():
    """Under remat the backward recomputes each row's stabiliser max; XLA:CPU at the suite's optimisation
    level 0 fused the recomputation with an FMA, one bit off the forward's, so jnp.max's gradient (x == max,
    divided by the match count) found no match in some rows: 0 / 0 and 111k NaN gradients in training.
    The stabiliser's gradient goes to its argmax (ops.mlstm.row_max): the same gradient as without remat."""
    from jaxembed import models, schedule

    cfg = load_config(ROOT / "configs/models/tiny-train-xlstm.yaml")
    params = models.family(cfg).init_params(cfg, jax.random.key(0))
    keys = iter(jax.random.split(jax.random.key(1), 100))
    params = jax.tree.map(lambda a: a + 1e-3 * jax.random.normal(next(keys), a.shape, a.dtype), params)
    ids = np.random.default_rng(0).integers(2, 256, size=(2, 32)).astype(np.int32)

    def loss(p, remat):
        return schedule.embed(p, cfg, ids, np.array([32, 20]), kernels="xla", remat=remat).sum()

    stored, recomputed = (jax.grad(loss)(params, remat) for remat in (False, True))
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(recomputed))
    assert rel_err(np.concatenate([np.ravel(g) for g in jax.tree.leaves(recomputed)]),
                   np.concatenate([np.ravel(g) for g in jax.tree.leaves(stored)])) < 1e-5


def test_cell_rejects_bad_shapes():
    x = cell_inputs(4, 5)
    with pytest.raises(ValueError, match=r"gate f must be \[b, t, h\]"):
        mlstm.chunked(x["q"], x["k"], x["v"], x["i"], x["f"][:, :4], chunk_size=8)
    with pytest.raises(ValueError, match=r"initial_state \(C, n, m\) has shapes"):
        mlstm.recurrent(x["q"], x["k"], x["v"], x["i"], x["f"], initial_state=x["state"]._replace(m=x["state"].m[:1]))
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        mlstm.chunked(x["q"], x["k"], x["v"], x["i"], x["f"], chunk_size=0)


# ---- whole models: encode_ids against transformers' xLSTMModel -------------------------------

CASES = {
    # xLSTMForCausalLM (backbone. prefix, untied lm_head), 4 heads of qk 8 / v 16, Q = 16
    "causal_lm_single_h4_q16": {"causal_lm": True, "chunk_size": 16},
    # fused projections with biases, 2 heads, qk_dim_factor 0.25, v 0.5, Q = 8, an active gate soft cap
    "fused_bias_h2_qk025_v05_q8_cap3": {"weight_mode": "fused", "use_bias": True, "num_heads": 2,
                                        "qk_dim_factor": 0.25, "v_dim_factor": 0.5, "chunk_size": 8,
                                        "gate_soft_cap": 3.0},
}
LENGTHS = (1, 7, 37, 129)


def random_seqs(vocab, lengths, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


@pytest.mark.parametrize("name", CASES)
def test_encode_ids_matches_transformers(name, tmp_path):
    """All sequences in one right-padded batch, horizontal and vertical with V = Q, 2Q, 5Q, against
    transformers' "inference" mode run on each sequence alone (its chunkwise kernel on the whole
    chunks of its Q, the recurrent sequence kernel on the rest, the step kernel for one token)."""
    model = make_hf_xlstm(seed=sum(map(ord, name)), **CASES[name])
    model.save_pretrained(tmp_path)
    emb = jaxembed.load(tmp_path)
    q = CASES[name]["chunk_size"]
    assert emb.config.chunk_size == q and emb.config.weight_mode == CASES[name].get("weight_mode", "single")
    seqs = random_seqs(model.config.vocab_size, LENGTHS, seed=1)
    ref = hf_xlstm_last_hidden(model, seqs)
    for v in (None, q, 2 * q, 5 * q):
        out = emb.encode_ids(seqs, normalize_embeddings=False, vertical_chunk_size=v, batch_size=len(seqs))
        errs = [rel_err(o, r) for o, r in zip(out, ref, strict=True)]
        print(f"{name} V={v}: worst relative error {max(errs):.2e}")
        assert max(errs) < TOL, (v, errs)
    if CASES[name].get("causal_lm"):  # the LM head with its logit soft cap, on the last token of the longest
        with torch.no_grad():
            ref_logits = model(input_ids=torch.tensor([seqs[-1]]), use_cache=False).logits[0, -1].double().numpy()
        head = {"lm_head": checkpoint.open_model(tmp_path).params["lm_head"]}  # not on the embedder's device
        logits = xlstm.logits(emb.config, {**emb.params, **head}, out[-1])
        assert rel_err(logits, ref_logits) < TOL


@pytest.mark.parametrize("name", CASES)
def test_bfloat16_close_to_float32_reference(name, tmp_path):
    """A bfloat16 model (bf16 weights and GEMM outputs; gates, the mLSTM state and the residual stream
    float32) against transformers' float32 model."""
    model = make_hf_xlstm(seed=sum(map(ord, name)), **CASES[name])
    model.save_pretrained(tmp_path)
    emb = jaxembed.load(tmp_path, dtype="bfloat16")
    assert {leaf.dtype for leaf in jax.tree.leaves(emb.params)} >= {np.dtype("bfloat16")}
    seqs = random_seqs(model.config.vocab_size, LENGTHS, seed=1)
    out = emb.encode_ids(seqs, normalize_embeddings=False, batch_size=len(seqs))
    errs = [rel_err(o, r) for o, r in zip(out, hf_xlstm_last_hidden(model, seqs), strict=True)]
    print(f"{name} bf16: relative error per length", [f"{e:.1e}" for e in errs])
    assert max(errs) < TOLERANCE["bfloat16"], errs


# ---- conversion ----------------------------------------------------------------------------


def test_convert_with_verify(tmp_path, capsys):
    model = make_hf_xlstm(seed=11, num_hidden_layers=1, chunk_size=8)
    model.save_pretrained(tmp_path / "src")
    dst = convert(tmp_path / "src", tmp_path / "dst", verify=True, progress=False)
    printed = capsys.readouterr().out
    assert float(printed.split("verify: max relative error")[1].split()[0]) < TOL
    converted, source = jaxembed.load(dst), read_checkpoint(tmp_path / "src")
    assert converted.config == source.config
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, converted.params), source.params)
    manifest = json.loads((dst / "jaxembed.json").read_text())
    assert manifest["config"]["architecture"] == "xlstm" and "transformers layout" in manifest["source"]


@pytest.mark.parametrize("weight_mode", ["single", "fused"])
def test_broken_checkpoint_names_its_keys(weight_mode, tmp_path):
    make_hf_xlstm(seed=12, weight_mode=weight_mode).save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    state = load_file(path)
    proj = "q" if weight_mode == "single" else "qkv_opreact"
    del state["blocks.1.mlstm_layer.multihead_norm.weight"]
    state["blocks.0.mlstm_layer.extra"] = torch.zeros(3)
    state[f"blocks.0.mlstm_layer.{proj}.weight"] = torch.zeros(5, 64)
    save_file(state, path)
    with pytest.raises(ConversionError) as err:
        read_checkpoint(tmp_path)
    text = str(err.value)
    assert "1 missing key(s)" in text and "blocks.1.mlstm_layer.multihead_norm.weight" in text
    assert "1 unexpected key(s)" in text and "blocks.0.mlstm_layer.extra" in text
    assert f"blocks.0.mlstm_layer.{proj}.weight: shape (5, 64)" in text


@pytest.mark.parametrize("change, message", [
    ({"add_out_norm": False}, "add_out_norm=false is not supported"),
    ({"weight_mode": "interleaved"}, "weight_mode must be 'single' or 'fused'"),
    ({"gate_soft_cap": None}, "gate_soft_cap must be a positive number"),
    ({"hidden_size": 64, "embedding_dim": 128}, "hidden_size=64 and embedding_dim=128 disagree"),
    ({"num_heads": 3}, r"qk_dim = int\(d_model \* qk_dim_factor\) = 32 must be a positive multiple of n_heads = 3"),
])
def test_unsupported_configs_are_named(change, message, tmp_path):
    config = {"model_type": "xlstm", "vocab_size": 96, "hidden_size": 64, "embedding_dim": 64,
              "num_hidden_layers": 2, "num_heads": 4, **change}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match=message):
        read_checkpoint(tmp_path)


def test_config_defaults_are_xlstm_7b():
    """A config.json that names nothing but the model type (and a Triton kernel, which transformers' own strict
    config class would reject) gets transformers' xLSTMConfig defaults, documented there as NX-AI/xLSTM-7b's;
    the bundled configs/models/xlstm-7b.yaml says the same."""
    cfg = config_from_transformers({"model_type": "xlstm", "chunkwise_kernel": "chunkwise--triton_xl_chunk"}, "7b")
    hf = hf_config.xLSTMConfig()
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.vocab_size) == (hf.hidden_size, hf.num_hidden_layers,
                                                                         hf.num_heads, hf.vocab_size)
    assert (cfg.qk_head_dim, cfg.v_head_dim) == (hf.qk_head_dim, hf.v_head_dim) == (256, 512)
    assert cfg.ffn_dim == hf_config.round_up_to_next_multiple_of(hf.hidden_size * hf.ffn_proj_factor,
                                                       hf.ffn_round_up_to_multiple_of) == 10944
    for ours, theirs in (("gate_soft_cap", "gate_soft_cap"), ("output_logit_soft_cap", "output_logit_soft_cap"),
                         ("norm_eps", "norm_eps"), ("eps", "eps"), ("chunk_size", "chunk_size"),
                         ("use_bias", "use_bias"), ("weight_mode", "weight_mode"),
                         ("tie_embeddings", "tie_word_embeddings"), ("eos_token_id", "eos_token_id")):
        assert getattr(cfg, ours) == getattr(hf, theirs), ours
    yaml_cfg = load_config(Path(__file__).parents[1] / "configs" / "models" / "xlstm-7b.yaml")
    assert yaml_cfg == cfg


@pytest.mark.parametrize("parallel_outputs", [False, True])
def test_interpreted_kernel_with_sequence_segments_matches_transformers(parallel_outputs, tmp_path, monkeypatch,
                                                                        request):
    """The model path through the mLSTM Pallas kernel (`kernels="interpret"`) on one sequence of
    531 tokens: 9 or more kernel chunks for a grid of a few programs, so the kernel walks the
    sequence in segments (each segment's own end state, merged into the entering state); with
    `parallel_outputs` in the heuristic's tile, the walk writes each chunk's entering state and
    the outputs kernel, one program per chunk, computes the outputs (which it must have traced). Last in
    the file: with the split on, it drops jax's compiled programs, which the tests before it reuse."""
    from jaxembed.kernels import mlstm as k_mlstm

    traced = split_over_chunks(monkeypatch, request, "mlstm", parallel_outputs, k_mlstm, "_output_kernel")
    model = make_hf_xlstm(seed=5, **CASES["causal_lm_single_h4_q16"])
    model.save_pretrained(tmp_path)
    emb = jaxembed.load(tmp_path, kernels="interpret")
    seqs = random_seqs(model.config.vocab_size, (531,), seed=2)
    with record_segments() as chosen:
        out = emb.encode_ids(seqs, normalize_embeddings=False, batch_size=1)
    assert chosen and max(chosen) > 1 and rel_err(out[0], hf_xlstm_last_hidden(model, seqs)[0]) < TOL
    assert bool(traced) == parallel_outputs
