"""Parity with transformers' PyTorch Mamba2 (fp32): encode_ids against last_hidden_state at
len-1 of each sequence run alone, in every layout the converter reads."""

import numpy as np
import pytest
from conftest import (
    TOLERANCE,
    hf_last_hidden,
    jaxpr_equations,
    make_hf_mamba2,
    rel_err,
    save_codestral_layout,
    save_mamba_ssm_layout,
)

import jaxembed
from jaxembed import checkpoint

CASES = {
    # n_groups, Q, state size and dt limits vary; lengths are odd and cross chunk boundaries
    "groups1_q8": dict(n_groups=1, chunk_size=8),
    "groups2_q16_state32_biases_conv3": dict(n_groups=2, chunk_size=16, state_size=32, use_bias=True,
                                             use_conv_bias=False, conv_kernel=3),
    "groups4_q8_headdim8_dtlimit_tied": dict(n_groups=4, chunk_size=8, head_dim=8, tie_word_embeddings=True,
                                             time_step_limit=(0.01, 3.0)),
}
LENGTHS = (1, 7, 37, 129)


def random_seqs(vocab, lengths, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


@pytest.mark.parametrize("name", CASES)
def test_transformers_layout(name, tmp_path):
    model = make_hf_mamba2(seed=hash(name) % 1000, **CASES[name])
    model.save_pretrained(tmp_path)
    emb = jaxembed.load(tmp_path)
    q = CASES[name]["chunk_size"]
    seqs = random_seqs(model.config.vocab_size, LENGTHS, seed=1)
    ref = hf_last_hidden(model, seqs)
    # all sequences in one right-padded batch, horizontal and vertical with V = Q, 2Q, 5Q
    for v in (None, q, 2 * q, 5 * q):
        out = emb.encode_ids(seqs, normalize_embeddings=False, vertical_chunk_size=v, batch_size=len(seqs))
        errs = [rel_err(o, r) for o, r in zip(out, ref, strict=True)]
        assert max(errs) < TOLERANCE["float32"], (v, errs)
    # each sequence in a batch of its own
    out = emb.encode_ids(seqs, normalize_embeddings=False, vertical_chunk_size=2 * q, batch_size=1)
    assert max(rel_err(o, r) for o, r in zip(out, ref, strict=True)) < TOLERANCE["float32"]


def test_causal_lm_layout_with_untied_head(tmp_path):
    """Mamba2ForCausalLM (backbone. prefix, untied lm_head): embeddings and the LM head's logits."""
    import jax.numpy as jnp
    import torch

    from jaxembed.models import mamba2

    model = make_hf_mamba2(seed=5, n_groups=2, chunk_size=8, causal_lm=True)
    model.save_pretrained(tmp_path)
    emb = jaxembed.load(tmp_path)
    seqs = random_seqs(model.config.vocab_size, (23,), seed=2)
    out = emb.encode_ids(seqs, normalize_embeddings=False, vertical_chunk_size=8)
    assert rel_err(out[0], hf_last_hidden(model, seqs)[0]) < TOLERANCE["float32"]
    with torch.no_grad():
        ref_logits = model(input_ids=torch.tensor(seqs)).logits[0, -1].double().numpy()
    assert "lm_head" not in emb.params  # an embedder never reads it: it stays off the device
    head = {"lm_head": checkpoint.open_model(tmp_path).params["lm_head"]}
    logits = mamba2.logits(emb.config, {**emb.params, **head}, jnp.asarray(out[0]))
    assert rel_err(logits, ref_logits) < TOLERANCE["float32"]


@pytest.mark.parametrize("tied, d_has_hdim", [(True, False), (False, True)])
def test_mamba_ssm_layout(tied, d_has_hdim, tmp_path):
    """The same weights written as a state-spaces/mamba2-* checkpoint (padded vocab, pytorch_model.bin,
    ssm_cfg without d_conv/expand so the defaults apply; D per head or per channel) give the same embeddings."""
    model = make_hf_mamba2(seed=7, vocab_size=112, n_groups=2, chunk_size=16, tie_word_embeddings=tied)
    save_mamba_ssm_layout(model, tmp_path, pad_multiple=16, unpadded_vocab=100, d_has_hdim=d_has_hdim)
    emb = jaxembed.load(tmp_path)
    assert emb.vocab_size == 112 and emb.config.tie_embeddings == tied
    seqs = random_seqs(100, (5, 37, 61), seed=3)
    ref = hf_last_hidden(model, seqs)
    for v in (None, 16, 32):
        out = emb.encode_ids(seqs, normalize_embeddings=False, vertical_chunk_size=v, batch_size=3)
        assert max(rel_err(o, r) for o, r in zip(out, ref, strict=True)) < TOLERANCE["float32"]


def test_codestral_layout(tmp_path):
    """Mistral's params.json + consolidated.safetensors (model.backbone.* keys, mamba_ssm defaults:
    d_state 128, head_dim 64, Q 256), with 2 groups like Codestral's 8."""
    model = make_hf_mamba2(seed=9, hidden_size=64, head_dim=64, state_size=128, n_groups=2, chunk_size=256)
    save_codestral_layout(model, tmp_path)
    emb = jaxembed.load(tmp_path)
    assert (emb.config.n_groups, emb.config.d_state, emb.config.chunk_size) == (2, 128, 256)
    seqs = random_seqs(model.config.vocab_size, (3, 300), seed=4)
    ref = hf_last_hidden(model, seqs)
    for v in (None, 256):
        out = emb.encode_ids(seqs, normalize_embeddings=False, vertical_chunk_size=v, batch_size=2)
        assert max(rel_err(o, r) for o, r in zip(out, ref, strict=True)) < TOLERANCE["float32"]


def test_bfloat16_close_to_float32_reference(hf_model_dir):
    path, model = hf_model_dir
    emb = jaxembed.load(path, dtype="bfloat16")
    assert emb.params["layers"]["xbcdt_proj"].dtype == np.dtype("bfloat16")
    assert emb.params["layers"]["A_log"].dtype == np.float32  # decays stay float32
    seqs = random_seqs(model.config.vocab_size, (9, 45), seed=5)
    out = emb.encode_ids(seqs, normalize_embeddings=False, vertical_chunk_size=16, batch_size=2)
    ref = hf_last_hidden(model, seqs)
    assert max(rel_err(o, r) for o, r in zip(out, ref, strict=True)) < TOLERANCE["bfloat16"]


@pytest.mark.parametrize("kernels", ["xla", "interpret"])
def test_training_gradients_match_pytorch_autograd(hf_model_dir, kernels):
    """The gradient the trainer follows: d(w . embedding)/d(params) of a right-padded batch through
    jaxembed.embed as the train step runs it (horizontal), against torch autograd of transformers' model
    on each sequence alone, for every parameter, mapped through the converter's own name table. With
    the Pallas kernels in the interpreter too: the SSD's backward kernel and the gated norm's."""
    import re

    import jax
    import jax.numpy as jnp
    import torch

    from jaxembed.convert import mamba2 as convert_mamba2

    path, model = hf_model_dir
    emb = jaxembed.load(path)
    seqs = random_seqs(model.config.vocab_size, (5, 19, 33), seed=6)
    weights = np.random.default_rng(7).standard_normal((len(seqs), emb.embedding_dim)).astype(np.float32)

    model.zero_grad()
    loss = sum((model(input_ids=torch.tensor([s])).last_hidden_state[0, -1] * torch.tensor(w)).sum()
               for s, w in zip(seqs, weights, strict=True))
    loss.backward()
    torch_grads = {}
    for name, p in model.named_parameters():
        for pattern, repl in convert_mamba2.RENAMES:
            name = re.sub(pattern, repl, name)
        torch_grads[name] = p.grad.double().numpy()

    ids = np.zeros((len(seqs), 40), np.int32)
    for row, s in enumerate(seqs):
        ids[row, : len(s)] = s
    lengths = jnp.asarray([len(s) for s in seqs])

    def objective(params):
        out = jaxembed.embed(params, emb.config, jnp.asarray(ids), lengths, normalize=False, vertical_chunk_size=None,
                             kernels=kernels)
        return jnp.sum(out * weights)

    grads = jax.grad(objective)(emb.params)
    if kernels == "interpret":  # the backward ran through the kernels, not the references' autodiff
        program = jax.make_jaxpr(jax.grad(objective))(emb.params)
        names = {eqn.params.get("name") for eqn in jaxpr_equations(program.jaxpr)
                 if eqn.primitive.name == "pallas_call"}
        assert {"ssd_chunked_backward", "gated_norm_backward"} <= names, names
    checked = 0
    for rule in convert_mamba2.rules_for(emb.config):
        leaf = grads
        for part in rule.path.split("/"):
            leaf = leaf.get(part) if isinstance(leaf, dict) else None
        if leaf is None:
            continue
        for i in range(emb.config.n_layers) if rule.stacked else [None]:
            ref = rule.hook.apply(torch_grads[rule.key.format(i=i)])
            out = leaf[i] if rule.stacked else leaf
            assert rel_err(out, ref) < TOLERANCE["float32"], (rule.path, i, rel_err(out, ref))
            checked += 1
    assert checked == 2 + 10 * emb.config.n_layers  # embedding, norm_f and the 10 tensors of every layer
