"""RWKV7: the WKV7 operator against a float64 NumPy loop of the delta rule; the model against BlinkDL's
rwkv package (fp32, every parameter random, odd lengths, horizontal and vertical); the converter on
BlinkDL .pth and fla-hub files of the same weights, --verify, and the errors a broken checkpoint gets."""

import json
import re

import jax
import numpy as np
import pytest
import torch
from conftest import TOLERANCE, jaxpr_equations, record_segments, rel_err, split_over_chunks
from safetensors.torch import load_file, save_file

import jaxembed
from jaxembed import checkpoint
from jaxembed.config import ConfigError
from jaxembed.convert import ConversionError, convert, read_checkpoint
from jaxembed.models import rwkv7
from jaxembed.ops import wkv7
from jaxembed.runtime import Runtime
from jaxembed.testing.rwkv7 import (
    blinkdl_last_hidden,
    blinkdl_logits,
    fla_config,
    make_blinkdl_rwkv7,
    save_blinkdl_layout,
    save_fla_layout,
)

# float32 against a float64 loop: the observed round-off is below 1e-6 for every case here
OPS_RTOL = 5e-6

# BlinkDL's package is TorchScript, which torch 2.13 deprecates
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script:DeprecationWarning")

# one compilation per shape instead of one per operation
recurrent = jax.jit(wkv7.recurrent)
chunked = jax.jit(wkv7.chunked, static_argnames="chunk_size")


# ---- the operator ------------------------------------------------------------------------------


def delta_rule_loop(r, w_logit, k, v, a, b, S0):
    """S_t = S_{t-1} diag(w_t) + (S_{t-1} a_t) b_tᵀ + v_t k_tᵀ, y_t = S_t r_t, token by token in float64,
    with RWKV7's decay w = exp(-exp(-1/2) sigmoid(w_logit))."""
    r, w_logit, k, v, a, b = (np.asarray(x, np.float64) for x in (r, w_logit, k, v, a, b))
    log_w = -np.exp(-0.5) / (1 + np.exp(-w_logit))
    S = np.array(S0, np.float64)
    y = np.zeros(v.shape)
    for t in range(r.shape[1]):
        Sa = np.einsum("bhpn,bhn->bhp", S, a[:, t])
        S = (S * np.exp(log_w[:, t])[:, :, None, :] + Sa[..., None] * b[:, t][:, :, None, :]
             + v[:, t][..., None] * k[:, t][:, :, None, :])
        y[:, t] = np.einsum("bhpn,bhn->bhp", S, r[:, t])
    return y, S


def wkv_inputs(seed, t, *, batch=2, heads=2, n=64):
    """Inputs shaped like RWKV7's: the decay's logits, a = -kk, b = kk * sigmoid(.), |kk| = 1, plus a
    random nonzero initial state."""
    rng = np.random.default_rng(seed)

    def sigmoid(z):
        return 1 / (1 + np.exp(-z))

    shape = (batch, t, heads, n)
    kk = rng.standard_normal(shape)
    kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
    xs = dict(r=rng.standard_normal(shape), w_logit=3 * rng.standard_normal(shape),
              k=rng.standard_normal(shape), v=rng.standard_normal(shape), a=-kk,
              b=kk * sigmoid(rng.standard_normal(shape)))
    xs = {name: x.astype(np.float32) for name, x in xs.items()}
    return xs, rng.standard_normal((batch, heads, n, n)).astype(np.float32)


# 1 token; 64 = two whole chunks of 32; 129 = two chunks of 64 and 1 token; 300 = 18 chunks of 16 and 12 tokens
@pytest.mark.parametrize("t, chunk", [(1, 16), (64, 32), (129, 64), (300, 16)])
def test_wkv7_forms_equal_delta_rule_loop(t, chunk):
    xs, S0 = wkv_inputs(t * 100 + chunk, t)
    y_ref, S_ref = delta_rule_loop(*xs.values(), S0)
    for name, (y, S) in {"recurrent": recurrent(**xs, initial_state=S0),
                         f"chunked Q={chunk}": chunked(**xs, chunk_size=chunk, initial_state=S0)}.items():
        errs = rel_err(y, y_ref), rel_err(S, S_ref)
        print(f"t={t:3d} {name:>14s}: y {errs[0]:.1e}, final state {errs[1]:.1e}")
        assert max(errs) < OPS_RTOL, (name, errs)


def test_wkv7_chunked_continues_from_state():
    """Two calls carrying the state equal one call over both halves: what vertical inference relies on."""
    xs, S0 = wkv_inputs(5, 258)
    y_ref, S_ref = delta_rule_loop(*xs.values(), S0)
    first = {k: v[:, :129] for k, v in xs.items()}
    rest = {k: v[:, 129:] for k, v in xs.items()}
    y1, S1 = chunked(**first, chunk_size=64, initial_state=S0)  # the same program as the (129, 64) case
    y2, S2 = chunked(**rest, chunk_size=64, initial_state=S1)
    assert rel_err(np.concatenate([y1, y2], axis=1), y_ref) < OPS_RTOL
    assert rel_err(S2, S_ref) < OPS_RTOL


@pytest.mark.parametrize("decay", ["strongest", "none"])
def test_wkv7_chunked_at_the_decay_bounds(decay):
    """log w = -exp(-1/2) at every step (logits of +inf: the factored exponentials at their bound,
    exp(+-38.8) in a chunk of 64) and log w = 0 (logits of -inf, no decay): finite and equal to the loop."""
    xs, S0 = wkv_inputs(11, 129)
    xs["w_logit"] = np.full_like(xs["w_logit"], np.inf if decay == "strongest" else -np.inf)
    y_ref, S_ref = delta_rule_loop(*xs.values(), S0)
    y, S = chunked(**xs, chunk_size=64, initial_state=S0)
    assert np.isfinite(np.asarray(y)).all()
    assert rel_err(y, y_ref) < OPS_RTOL and rel_err(S, S_ref) < OPS_RTOL


def test_wkv7_rejects_bad_input():
    xs, S0 = wkv_inputs(0, 8)
    with pytest.raises(ValueError, match=r"chunk_size must be an int in \[1, 64\]"):
        wkv7.chunked(**xs, chunk_size=128)
    with pytest.raises(ValueError, match="initial_state has shape"):
        wkv7.chunked(**xs, chunk_size=16, initial_state=S0[:, :1])
    with pytest.raises(ValueError, match="k has shape"):
        wkv7.recurrent(**{**xs, "k": xs["k"][:, :4]})


# ---- the model against BlinkDL's rwkv package -------------------------------------------------------

LENGTHS = (1, 7, 37, 129)
Q = 16  # intra-layer chunk for the parity runs: V = Q, 2Q, 5Q all split a 129-token sequence


def random_seqs(vocab, lengths, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def blinkdl_model(tmp_path_factory):
    """A random 3-layer RWKV7 (d 128, 2 heads of 64, every tensor random) as a BlinkDL .pth, its reference outputs."""
    state = make_blinkdl_rwkv7(seed=1, vocab_size=100, d_model=128, n_layers=3, d_ffn=256)
    path = save_blinkdl_layout(state, tmp_path_factory.mktemp("rwkv7_blinkdl"))
    seqs = random_seqs(100, LENGTHS, seed=2)
    return path, state, seqs, blinkdl_last_hidden(state, seqs)


def test_chunk_size_past_the_kernels_limit_is_refused_at_load(blinkdl_model):
    """The WKV7 operator takes chunks of at most MAX_CHUNK tokens: a larger chunk_size asked of `load`
    is an error there, naming the limit, not one raised while tracing the first encode."""
    path = blinkdl_model[0]
    with pytest.raises(ValueError, match=f"chunk_size = 128 exceeds {wkv7.MAX_CHUNK}"):
        jaxembed.load(path.parent, chunk_size=128)


def test_parity_with_blinkdl_package(blinkdl_model):
    path, state, seqs, ref = blinkdl_model
    emb = jaxembed.load(path.parent, chunk_size=Q)
    assert emb.config == rwkv7.RWKV7Config(vocab_size=100, d_model=128, n_layers=3, d_ffn=256, decay_low_rank=32,
                                           a_low_rank=32, v_low_rank=16, gate_low_rank=32)
    # all sequences in one right-padded batch, horizontal and vertical with V = Q, 2Q, 5Q
    for v in (None, Q, 2 * Q, 5 * Q):
        out = emb.encode_ids(seqs, normalize_embeddings=False, vertical_chunk_size=v, batch_size=len(seqs))
        errs = [rel_err(o, r) for o, r in zip(out, ref, strict=True)]
        print(f"V={v}: relative error per length", {n: f"{e:.1e}" for n, e in zip(LENGTHS, errs, strict=True)})
        assert max(errs) < TOLERANCE["float32"], (v, errs)
    # the language-model head against the package's own logits
    head = {"lm_head": checkpoint.open_model(path.parent).params["lm_head"]}  # not on the embedder's device
    logits = rwkv7.logits(emb.config, {**emb.params, **head}, out[2])
    err = rel_err(logits, blinkdl_logits(state, seqs[2:3])[0])
    print(f"logits: relative error {err:.1e}")
    assert err < TOLERANCE["float32"]


def test_bfloat16_close_to_float32_reference(blinkdl_model):
    """A bfloat16 model against BlinkDL's float32 outputs: bf16 weights (the decay bias w0 float32),
    GEMMs that write bf16 as BlinkDL's and fla's bf16 modules do, except those that write float32: the
    decay LoRA's second matmul (it feeds the log decays), the two whose outputs are added to the
    float32 residual stream (time mix's `output`, channel mix's `ffn_value`), and the product for the
    token before the first of the one GEMM of the four LoRAs' first matrices on u, [(1 - mu) W | mu W]
    (`rwkv7._lora_inputs`), which itself writes bf16 (its two halves are added in float32)."""
    path, _, seqs, ref = blinkdl_model
    emb = jaxembed.load(path.parent, chunk_size=Q, dtype="bfloat16")
    layers = emb.params["layers"]
    assert layers["receptance"].dtype == np.dtype("bfloat16") and layers["w0"].dtype == np.dtype("float32")
    for v in (None, 2 * Q):
        out = emb.encode_ids(seqs, normalize_embeddings=False, vertical_chunk_size=v, batch_size=len(seqs))
        errs = [rel_err(o, r) for o, r in zip(out, ref, strict=True)]
        print(f"bf16 V={v}: relative error per length", {n: f"{e:.1e}" for n, e in zip(LENGTHS, errs, strict=True)})
        assert max(errs) < TOLERANCE["bfloat16"], (v, errs)
    # what the GEMMs (the dots with bf16 operands) write, in one layer
    cfg, b, t = emb.config, 1, 5
    one_layer = jax.tree.map(lambda x: x[0], layers)
    x = jax.numpy.zeros((b, t, cfg.d_model), jax.numpy.float32)
    state = rwkv7.init_state(cfg, b)
    jaxpr = jax.make_jaxpr(lambda p, x: rwkv7.layer(cfg, p, rwkv7.Stream(x, x), state, index=1,
                                                    runtime=Runtime(chunk_size=Q, kernels="xla")))(one_layer, x)
    # (with those inside custom_vjp calls: a GEMM writing float32, `weights.dot`)
    gemms = [eqn for eqn in jaxpr_equations(jaxpr.jaxpr) if eqn.primitive.name == "dot_general"
             and all(v.aval.dtype == jax.numpy.bfloat16 for v in eqn.invars)]
    firsts = [m for _, m in rwkv7.LORA_INPUTS]
    rank = sum(one_layer[m].shape[1] for m in firsts)
    assert sorted(e.invars[1].aval.shape for e in gemms) == sorted(
        [one_layer[n].shape for n in rwkv7.LINEAR_PARAMS if n not in firsts] + [(cfg.d_model, 2 * rank),
                                                                                (cfg.d_model, rank)])
    float32_out = sorted(e.invars[1].aval.shape for e in gemms if e.outvars[0].aval.dtype == jax.numpy.float32)
    assert float32_out == sorted([one_layer[n].shape for n in ("w2", "output", "ffn_value")]
                                 + [(cfg.d_model, rank)]), float32_out


def test_adapted_lora_matrices_take_each_mix_and_agree_with_the_one_gemm_of_u():
    """The four LoRAs' first matrices as one GEMM of u against [(1 - mu) W | mu W] with its second half
    shifted a token (`rwkv7._lora_inputs`, dense weights), and each mix written and multiplied as
    BlinkDL does (adapted matrices: `weights.DerivedWeight`), give the same layer: the merged dense
    params against the adapted ones, float32, from a random carried state (its shift state is the
    token before the GEMM's first row; `test_parity_with_blinkdl_package` runs the one-GEMM path
    through whole models, horizontally and in vertical chunks)."""
    from jaxembed.train import lora as lora_lib

    cfg = rwkv7.RWKV7Config(vocab_size=64, d_model=48, n_layers=2, head_size=16, d_ffn=80, decay_low_rank=8,
                            a_low_rank=8, v_low_rank=4, gate_low_rank=12, chunk_size=8)
    params = rwkv7.init_params(cfg, jax.random.key(0))
    lora = lora_lib.LoraConfig(rank=4, alpha=8, targets=tuple(m for _, m in rwkv7.LORA_INPUTS))
    adapters = lora_lib.init_adapters(cfg, params, lora, jax.random.key(1))
    adapters = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(jax.random.key(2), x.shape), adapters)
    second = lambda tree: jax.tree.map(lambda x: x[1], tree)  # layer 1: its value residual too
    adapted = second(lora_lib.apply(params, adapters, lora, cfg)["layers"])
    merged = second(lora_lib.merge(params, adapters, lora, cfg)["layers"])
    b, t = 2, 11
    keys = jax.random.split(jax.random.key(3), 5)
    x, v_first = (jax.random.normal(k, (b, t, cfg.d_model)) for k in keys[:2])
    state = rwkv7.State(jax.random.normal(keys[2], (b, cfg.d_model)),
                        0.1 * jax.random.normal(keys[3], (b, cfg.n_heads, cfg.head_size, cfg.head_size)),
                        jax.random.normal(keys[4], (b, cfg.d_model)))
    u = jax.numpy.ones((1, 3, cfg.d_model))
    assert rwkv7._lora_inputs(adapted, u, u[:, 0]) is None  # adapted: each mix on its own
    assert set(rwkv7._lora_inputs(merged, u, u[:, 0])) == {"w1", "a1", "v1", "g1"}

    def layer(p):
        return rwkv7.layer(cfg, p, rwkv7.Stream(x, v_first), state, index=1,
                           runtime=Runtime(chunk_size=8, kernels="xla"))

    got, want = jax.jit(layer)(merged), jax.jit(layer)(adapted)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert rel_err(g, w) < 1e-5, rel_err(g, w)


def test_fla_layout_and_pth_file_give_the_same_embeddings(blinkdl_model, tmp_path):
    """The same weights written as an fla-hub checkpoint, and the .pth path itself, load to the same model."""
    path, state, seqs, ref = blinkdl_model
    save_fla_layout(state, tmp_path)
    out = {}
    for name, src in {"blinkdl dir": path.parent, "fla": tmp_path, "blinkdl file": path}.items():
        emb = jaxembed.load(src, chunk_size=Q)
        out[name] = emb.encode_ids(seqs, normalize_embeddings=False, vertical_chunk_size=2 * Q, batch_size=4)
    assert jaxembed.load(tmp_path).config == jaxembed.load(path).config
    for name in ("fla", "blinkdl file"):
        err = max(rel_err(o, r) for o, r in zip(out[name], out["blinkdl dir"], strict=True))
        print(f"{name} vs blinkdl dir: {err:.1e}; vs the rwkv package: "
              f"{max(rel_err(o, r) for o, r in zip(out[name], ref, strict=True)):.1e}")
        assert err <= 1e-6


def test_convert_with_verify_both_layouts(blinkdl_model, tmp_path, capsys):
    path, state, seqs, ref = blinkdl_model
    fla_dir = save_fla_layout(state, tmp_path / "fla")
    worst = {}
    for name, src in {"blinkdl": path, "fla": fla_dir}.items():
        dst = convert(src, tmp_path / f"converted_{name}", verify=True, progress=False)
        printed = capsys.readouterr().out
        worst[name] = float(printed.split("verify: max relative error")[1].split()[0])
        assert worst[name] < TOLERANCE["float32"]
        manifest = json.loads((dst / "jaxembed.json").read_text())
        assert manifest["config"]["architecture"] == "rwkv7" and f"({name} layout)" in manifest["source"]
        out = jaxembed.load(dst, chunk_size=Q).encode_ids(seqs, normalize_embeddings=False, vertical_chunk_size=2 * Q,
                                                         batch_size=4)
        assert max(rel_err(o, r) for o, r in zip(out, ref, strict=True)) < TOLERANCE["float32"]
    print("--verify worst relative error per layout:", worst)


def test_layer0_value_lora_is_optional_and_ignored(blinkdl_model, tmp_path):
    """BlinkDL files may or may not hold layer 0's unused v0/v1/v2 (of any rank): the params are the same."""
    path, state, _, _ = blinkdl_model
    without = {k: v for k, v in state.items() if not re.fullmatch(r"blocks\.0\.att\.v[012]", k)}
    with_params = read_checkpoint(path).params
    without_params = read_checkpoint(save_blinkdl_layout(without, tmp_path)).params
    for name in ("v0", "v1", "v2"):
        np.testing.assert_array_equal(with_params["layers"][name], without_params["layers"][name])
        assert not np.asarray(with_params["layers"][name][0]).any()  # layer 0's slot: zeros, never read


@pytest.mark.parametrize("layout", ["blinkdl", "fla"])
def test_one_layer_model_matches_blinkdl(layout, tmp_path):
    """With one layer no tensor supplies the value-residual params (layer 0 never reads them): they are
    zeros, as in deeper models (they were missing, and encode failed with KeyError 'v1'). BlinkDL's file
    without layer 0's unused v0/v1/v2, fla's layout with them."""
    state = make_blinkdl_rwkv7(seed=4, vocab_size=90, d_model=64, n_layers=1, d_ffn=128,
                               layer0_value_lora=layout == "fla")
    (save_blinkdl_layout if layout == "blinkdl" else save_fla_layout)(state, tmp_path)
    emb = jaxembed.load(tmp_path, chunk_size=Q)
    assert not any(np.asarray(emb.params["layers"][name]).any() for name in ("v0", "v1", "v2"))
    seqs = random_seqs(90, (1, Q + 3), seed=5)
    out = emb.encode_ids(seqs, normalize_embeddings=False, batch_size=len(seqs))
    assert max(rel_err(o, r) for o, r in zip(out, blinkdl_last_hidden(state, seqs), strict=True)) < TOLERANCE["float32"]


# ---- broken checkpoints and configs ---------------------------------------------------------------


def test_broken_blinkdl_files_name_the_problem(blinkdl_model, tmp_path):
    _, state, _, _ = blinkdl_model
    broken = dict(state)
    del broken["blocks.1.att.k_k"]
    broken["blocks.2.att.receptance.weight"] = torch.zeros(128, 64)
    broken["blocks.0.att.extra"] = torch.zeros(3)
    with pytest.raises(ConversionError) as err:
        read_checkpoint(save_blinkdl_layout(broken, tmp_path / "a"))
    text = str(err.value)
    assert "1 missing key(s)" in text and "blocks.1.att.k_k" in text
    assert "1 unexpected key(s)" in text and "blocks.0.att.extra" in text
    assert "1 misshaped key(s)" in text and "blocks.2.att.receptance.weight: shape (128, 64)" in text

    no_lora = {k: v for k, v in state.items() if k != "blocks.2.att.v1"}
    with pytest.raises(ConversionError, match=r"1 missing key\(s\):\n    blocks\.2\.att\.v1$"):
        read_checkpoint(save_blinkdl_layout(no_lora, tmp_path / "b"))

    torch.save({"weight": torch.zeros(3)}, tmp_path / "other.pth")
    with pytest.raises(ConversionError, match="read as a BlinkDL RWKV7 checkpoint"):
        read_checkpoint(tmp_path / "other.pth")


def test_broken_fla_checkpoints_name_the_problem(blinkdl_model, tmp_path):
    _, state, _, _ = blinkdl_model
    directory = save_fla_layout(state, tmp_path)
    weights = load_file(directory / "model.safetensors")
    weights.pop("model.layers.1.attn.g_lora.lora.2.weight")
    weights["model.layers.0.ffn.key.weight"] = torch.zeros(100, 128)
    save_file(weights, directory / "model.safetensors")
    with pytest.raises(ConversionError, match=r"missing key\(s\):\n    layers\.1\.attn\.g_lora\.lora\.2\.weight$"):
        read_checkpoint(directory)
    weights["model.layers.1.attn.g_lora.lora.2.weight"] = torch.zeros(128, 32)
    save_file(weights, directory / "model.safetensors")
    with pytest.raises(ConversionError, match=r"model\.layers\.0\.ffn\.key\.weight: shape \(100, 128\)"):
        read_checkpoint(directory)

    (directory / "config.json").write_text(json.dumps({**fla_config(state), "attn": {"layers": [1]}}))
    with pytest.raises(ConversionError, match="unsupported RWKV7 variant: hybrid attention"):
        read_checkpoint(directory)


def test_config_checks():
    with pytest.raises(ConfigError, match="not a multiple of head_size"):
        rwkv7.RWKV7Config(vocab_size=10, d_model=100, n_layers=1)
    with pytest.raises(ConfigError, match="chunk_size = 128 exceeds 64"):
        rwkv7.RWKV7Config(vocab_size=10, d_model=128, n_layers=1, chunk_size=128)
    with pytest.raises(ConfigError, match="n_layers must be a positive int"):
        rwkv7.RWKV7Config(vocab_size=10, d_model=128, n_layers=0)
    cfg = rwkv7.RWKV7Config(vocab_size=10, d_model=128, n_layers=1)
    assert cfg.d_ffn == 512 and hash(cfg) == hash(rwkv7.RWKV7Config(**{k: v for k, v in cfg.to_dict().items()
                                                                         if k != "architecture"}))


@pytest.mark.parametrize("parallel_factors", [False, True])
def test_interpreted_kernel_with_sequence_segments_matches_blinkdl(parallel_factors, blinkdl_model, monkeypatch,
                                                                   request):
    """The model path through the WKV7 Pallas kernel (`kernels="interpret"`) on one sequence of 531
    tokens: 34 kernel chunks for a grid of 4 programs, so the kernel walks the sequence in segments
    (each segment's own end state and transition, then S_in T + H), against BlinkDL's package. With
    `parallel_factors` in the heuristic's tile, a kernel of one program per chunk computes every
    chunk's factors (which it must have traced) and the walks read them. Last in the file: with the
    split on, it drops jax's compiled programs, which the tests before it reuse."""
    from jaxembed.kernels import wkv7 as k_wkv7

    traced = split_over_chunks(monkeypatch, request, "wkv7", parallel_factors, k_wkv7, "_factor_kernel")
    path, state, _, _ = blinkdl_model
    emb = jaxembed.load(path.parent, chunk_size=Q, kernels="interpret")
    seqs = random_seqs(100, (531,), seed=3)
    with record_segments() as chosen:
        out = emb.encode_ids(seqs, normalize_embeddings=False, batch_size=1)
    err = rel_err(out[0], blinkdl_last_hidden(state, seqs)[0])
    print(f"segments {sorted(set(chosen))}: relative error {err:.1e}")
    assert chosen and max(chosen) > 1 and err < TOLERANCE["float32"]
    assert bool(traced) == parallel_factors
