"""The Mistral / Qwen2 baselines against transformers' MistralModel and Qwen2Model (fp32, eager
attention, random weights with randomised norms and biases): sliding window on and off, GQA,
head_dim != d_model / n_heads, odd lengths in one right-padded batch, through the converter."""

import numpy as np
import pytest
import torch

import jaxembed
from conftest import TOLERANCE, rel_err

LENGTHS = (1, 7, 37, 70)
CASES = {
    # name: (model class, config kwargs); windows shorter than the sequences so they bind
    "mistral_window5_gqa": ("MistralModel", dict(num_key_value_heads=2, sliding_window=5)),
    "mistral_full_headdim24_causal_lm": ("MistralForCausalLM", dict(num_key_value_heads=4, sliding_window=None,
                                                                    head_dim=24)),
    "qwen2_bias_kv1": ("Qwen2Model", dict(num_key_value_heads=1, rope_theta=1e6)),
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
    errs = [rel_err(o, r) for o, r in zip(out, ref)]
    assert max(errs) < TOLERANCE["float32"], errs
    if cls_name == "MistralModel":
        with pytest.raises(ValueError, match="run horizontally only"):
            emb.encode_ids(seqs, vertical_chunk_size=64)
    if cls_name == "Qwen2Model":  # `jaxembed convert --verify` builds its own reference from the source tensors
        from jaxembed.convert import convert

        convert(tmp_path, tmp_path / "converted", verify=True, progress=False)
        assert jaxembed.load(tmp_path / "converted").config == emb.config
