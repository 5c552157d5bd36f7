"""The Mistral / Qwen2 baselines against transformers' MistralModel and Qwen2Model (fp32, eager
attention, random weights with randomised norms and biases): sliding window on and off, GQA,
head_dim != d_model / n_heads, odd lengths in one right-padded batch, through the converter."""

import numpy as np
import pytest
import torch
from conftest import TOLERANCE, rel_err

import jaxembed

LENGTHS = (1, 7, 37, 70)
LONG = 1100  # past two attention blocks (ops.attention.BLOCK = 512): the blockwise path
CASES = {
    # name: (model class, config kwargs); windows shorter than the sequences so they bind
    "mistral_window5_gqa": ("MistralModel", dict(num_key_value_heads=2, sliding_window=5)),
    "mistral_full_headdim24_causal_lm": ("MistralForCausalLM", dict(num_key_value_heads=4, sliding_window=None,
                                                                    head_dim=24)),
    "qwen2_bias_kv1": ("Qwen2Model", dict(num_key_value_heads=1, rope_theta=1e6)),
    # transformers slides layers >= max_window_layers: 0 is every layer, the default 28 none of these 2
    "qwen2_window4_every_layer": ("Qwen2Model", dict(num_key_value_heads=2, use_sliding_window=True, sliding_window=4,
                                                       max_window_layers=0)),
    "qwen2_window_from_layer_28": ("Qwen2Model", dict(num_key_value_heads=2, use_sliding_window=True,
                                                        sliding_window=4)),
}


def make_model(cls_name, seed, **kwargs):
    import transformers

    config_cls = transformers.MistralConfig if cls_name.startswith("Mistral") else transformers.Qwen2Config
    config = config_cls(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=96, rms_norm_eps=1e-6, tie_word_embeddings=False, **kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(config).float().eval()
    with torch.no_grad():  # away from the ones / zeros inits: norms, biases, everything random
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("name", CASES)
def test_transformer_matches_transformers(name, tmp_path):
    cls_name, kwargs = CASES[name]
    model = make_model(cls_name, seed=len(name), **kwargs)
    model.save_pretrained(tmp_path)
    emb = jaxembed.load(tmp_path)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 96, n).tolist() for n in LENGTHS]
    base = getattr(model, "model", model)
    with torch.no_grad():
        ref = [base(input_ids=torch.tensor([s])).last_hidden_state[0, -1].double().numpy() for s in seqs]
    out = emb.encode_ids(seqs, normalize_embeddings=False, batch_size=len(seqs))  # "auto": horizontal
    errs = [rel_err(o, r) for o, r in zip(out, ref, strict=True)]
    assert max(errs) < TOLERANCE["float32"], errs
    if cls_name == "MistralModel":
        with pytest.raises(ValueError, match="run horizontally only"):
            emb.encode_ids(seqs, vertical_chunk_size=64)
        with pytest.raises(ValueError, match="run horizontally only"):  # also when no input is longer than V
            emb.encode_ids([[1, 2, 3]], vertical_chunk_size=64)
    if cls_name == "Qwen2Model":  # `jaxembed convert --verify` builds its own reference from the source tensors
        from jaxembed.convert import convert

        convert(tmp_path, tmp_path / "converted", verify=True, progress=False)
        assert jaxembed.load(tmp_path / "converted").config == emb.config


def test_long_input_through_blockwise_attention(tmp_path):
    """Sliding window 300 over 1100 tokens (three query blocks, window across block edges)."""
    model = make_model("MistralModel", seed=3, num_key_value_heads=2, sliding_window=300)
    model.save_pretrained(tmp_path)
    emb = jaxembed.load(tmp_path)
    seqs = [np.random.default_rng(1).integers(0, 96, n).tolist() for n in (LONG, 613)]
    with torch.no_grad():
        ref = [model(input_ids=torch.tensor([s])).last_hidden_state[0, -1].double().numpy() for s in seqs]
    out = emb.encode_ids(seqs, normalize_embeddings=False, batch_size=2)
    errs = [rel_err(o, r) for o, r in zip(out, ref, strict=True)]
    assert max(errs) < TOLERANCE["float32"], errs


def _softmax_attention(q, k, v, window):
    """The definition, in float64 numpy: causal softmax(q kᵀ / sqrt(hd)) v with GQA head sharing."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    t, hd, group = q.shape[1], q.shape[3], q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
    i = np.arange(t)
    visible = i[None, :] <= i[:, None]
    if window is not None:
        visible &= i[None, :] > i[:, None] - window
    scores = np.where(visible, scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", probs / probs.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("t,window,block", [(37, 5, 8), (129, None, 16), (100, 40, 16), (50, 1, 16)])
def test_blockwise_attention_against_the_definition(t, window, block):
    """Values against the float64 definition; gradients against the dense XLA form (jax's own)."""
    import jax
    import jax.numpy as jnp

    from jaxembed.ops import attention

    rng = np.random.default_rng(t + block)
    q = rng.standard_normal((2, t, 4, 16)).astype(np.float32)
    k, v = (rng.standard_normal((2, t, 2, 16)).astype(np.float32) for _ in range(2))
    ref = _softmax_attention(q, k, v, window)
    loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)))
    value_and_grad = lambda f: jax.jit(jax.value_and_grad(loss(f), argnums=(0, 1, 2)))
    blockwise = lambda q, k, v: attention.blockwise(q, k, v, window, block)
    out = np.asarray(jax.jit(blockwise)(q, k, v))
    assert rel_err(out, ref) < TOLERANCE["float32"]
    _, grads = value_and_grad(blockwise)(q, k, v)
    _, dense = value_and_grad(lambda q, k, v: attention.dense(q, k, v, window))(q, k, v)
    for g, d in zip(grads, dense, strict=True):
        g, d = np.asarray(g), np.asarray(d)
        assert np.isfinite(g).all()
        if not np.abs(d).any():  # window 1: each token sees only itself, so q and k get no gradient
            assert np.abs(g).max() < 1e-6
            continue
        assert rel_err(g, d) < TOLERANCE["float32"]


def test_sliding_windows_are_read_as_transformers_reads_them(tmp_path):
    """Each layer's window as transformers' AutoConfig reads config.json (the reference): one window for every
    layer is taken, a window on some layers only is refused by name. A Mistral config without `sliding_window`
    has transformers' default 4096 (it was read as none), and one with `layer_types` is Ministral, whose entries
    decide (it was windowed on every layer)."""
    import json

    from transformers import AutoConfig

    from jaxembed.convert import ConversionError
    from jaxembed.convert.transformer import _config, _window

    def hf_windows(raw):
        (tmp_path / "config.json").write_text(json.dumps(raw))
        hf = AutoConfig.from_pretrained(tmp_path)
        types = getattr(hf, "layer_types", None) or ["sliding_attention"] * hf.num_hidden_layers
        return [hf.sliding_window if t == "sliding_attention" else None for t in types]

    mistral = dict(model_type="mistral", num_hidden_layers=4)
    qwen2 = dict(model_type="qwen2", num_hidden_layers=4, use_sliding_window=True, sliding_window=8)
    mixed = ["full_attention", "sliding_attention"] * 2
    cases = [mistral, {**mistral, "sliding_window": None}, {**mistral, "sliding_window": 8},
             {**mistral, "sliding_window": 8, "layer_types": ["full_attention"] * 4},
             {**mistral, "sliding_window": 8, "layer_types": ["sliding_attention"] * 4},
             {**mistral, "sliding_window": 8, "layer_types": mixed},
             {**qwen2, "max_window_layers": 0}, {**qwen2, "max_window_layers": 4}, {**qwen2, "max_window_layers": 1},
             {**qwen2, "use_sliding_window": False, "max_window_layers": 0},
             {**qwen2, "layer_types": ["sliding_attention"] * 4, "max_window_layers": 28},
             {**qwen2, "layer_types": ["full_attention"] * 3 + ["sliding_attention"]},
             {k: v for k, v in qwen2.items() if k != "sliding_window"} | {"max_window_layers": 0}]
    for raw in cases:
        expected = hf_windows(raw)
        if len(set(expected)) == 1:
            assert _window(raw, "x") == expected[0], raw
        else:
            sliding = sum(w is not None for w in expected)
            with pytest.raises(ConversionError, match=f"x: {raw['model_type']} with a sliding window on {sliding} of "
                                                      "its 4 layers .* is not supported"):
                _window(raw, "x")
    with pytest.raises(ConversionError, match="layer_types has 3 entries for 4 layers"):
        _window({**qwen2, "layer_types": ["full_attention"] * 3}, "x")
    # RoPE as AutoConfig reads it: a legacy rope_scaling over rope_parameters (a linear scaling was taken as plain
    # RoPE, 2.5e-1 off), the theta from the dict taken, else the top level
    for rope in (dict(rope_scaling={"rope_type": "default"}, rope_parameters={"rope_type": "default",
                                                                             "rope_theta": 5e5}),
                 dict(rope_scaling={"type": "default"}, rope_theta=2e5),
                 dict(rope_parameters={"rope_type": "default", "rope_theta": 5e5}, rope_theta=2e5),
                 dict(rope_scaling={"rope_type": "linear", "factor": 2.0},
                      rope_parameters={"rope_type": "default", "rope_theta": 5e5})):
        raw = {**mistral, "hidden_size": 32, "num_attention_heads": 4, "vocab_size": 64, "intermediate_size": 64,
               **rope}
        (tmp_path / "config.json").write_text(json.dumps(raw))
        expected = AutoConfig.from_pretrained(tmp_path).rope_parameters
        if expected.get("rope_type", expected.get("type")) == "default":
            assert _config(raw, "x").rope_theta == expected["rope_theta"], rope
        else:
            with pytest.raises(ConversionError, match="x: rope scaling 'linear' is not supported"):
                _config(raw, "x")
    with pytest.raises(ConversionError, match="x: rope_theta must be a positive number, got 'abc'"):
        _config({**raw, "rope_scaling": None, "rope_parameters": None, "rope_theta": "abc"}, "x")
    # transformers' "swish" is SiLU (it was refused); GELU is not

    base = dict(model_type="mistral", vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=64)
    assert _config({**base, "hidden_act": "swish"}, "x") == _config({**base, "hidden_act": "silu"}, "x")
    with pytest.raises(ConversionError, match="hidden_act='gelu'; only SiLU"):
        _config({**base, "hidden_act": "gelu"}, "x")
