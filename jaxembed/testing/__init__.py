"""Tiny random checkpoints and a tokenizer built offline, for tests, demos and benchmarks.

    python -m jaxembed.testing tiny-mamba2 DIR     # a random transformers Mamba2 + tokenizer in DIR

Builders for the other families live in jaxembed.testing.rwkv7 and jaxembed.testing.xlstm.

Everything here is made on the machine: a transformers Mamba2 with every parameter random
(including the ones its init sets to constants), the same weights written in the mamba_ssm and
Codestral layouts, and a byte-level BPE tokenizer trained on the Python standard library's
docstrings. Needs torch (pip install 'jaxembed[torch]').
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import numpy as np

# The smallest configs of each recurrent family that exercise every path (n_layers 2, Q 16): tests build
# them with `config_from_dict({**TINY_CONFIGS[family], ...overrides})`.
TINY_CONFIGS = {
    "mamba2": dict(architecture="mamba2", vocab_size=64, d_model=32, n_layers=2, d_state=8, head_dim=8, n_groups=1,
                   chunk_size=16),
    "rwkv7": dict(architecture="rwkv7", vocab_size=64, d_model=32, n_layers=2, head_size=16, decay_low_rank=8,
                  a_low_rank=8, v_low_rank=8, gate_low_rank=8, chunk_size=16),
    "xlstm": dict(architecture="xlstm", vocab_size=64, d_model=32, n_layers=2, n_heads=2, chunk_size=16),
}

def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def jaxpr_equations(jaxpr):
    """Every equation of a jaxpr, with those of the jaxprs inside it (custom_vjp calls, scans, pjit)."""
    from jax.extend.core import jaxprs_in_params

    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jaxprs_in_params(eqn.params):
            yield from jaxpr_equations(sub)


def make_hf_mamba2(seed: int = 0, *, vocab_size=96, hidden_size=64, head_dim=16, n_groups=1, state_size=16,
                   chunk_size=8, num_hidden_layers=2, tie_word_embeddings=False, time_step_limit=(0.0, float("inf")),
                   conv_kernel=4, use_bias=False, use_conv_bias=True, causal_lm=False):
    """A transformers Mamba2 with every parameter random, including the ones the default init
    sets to constants (norms, D, dt_bias, A_log, conv bias)."""
    import torch
    from transformers import Mamba2Config, Mamba2ForCausalLM, Mamba2Model

    torch.manual_seed(seed)
    cfg = Mamba2Config(
        vocab_size=vocab_size, hidden_size=hidden_size, num_heads=2 * hidden_size // head_dim, head_dim=head_dim,
        expand=2, n_groups=n_groups, state_size=state_size, chunk_size=chunk_size, num_hidden_layers=num_hidden_layers,
        tie_word_embeddings=tie_word_embeddings, time_step_limit=tuple(time_step_limit), conv_kernel=conv_kernel,
        use_bias=use_bias, use_conv_bias=use_conv_bias,
    )
    model = (Mamba2ForCausalLM if causal_lm else Mamba2Model)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith(("mixer.D", "mixer.dt_bias")):
                p.copy_(torch.randn_like(p))
            elif name.endswith("mixer.A_log"):
                p.copy_(torch.randn_like(p))  # A = -exp(A_log) spans ~0.1 .. 10
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
    return model


def hf_last_hidden(model, seqs) -> np.ndarray:
    """transformers' own final-norm output at the last position of each sequence, run alone."""
    import torch

    base = getattr(model, "backbone", model)
    with torch.no_grad():
        return np.stack(
            [base(input_ids=torch.tensor([list(s)])).last_hidden_state[0, -1].double().numpy() for s in seqs]
        )


def mamba_ssm_state_dict(model) -> dict:
    """The model's weights under mamba_ssm's names (backbone.embedding.weight, ...)."""
    base = getattr(model, "backbone", model)
    state = {f"backbone.{k}".replace("backbone.embeddings.", "backbone.embedding."): v.clone()
             for k, v in base.state_dict().items()}
    head = getattr(model, "lm_head", None)
    state["lm_head.weight"] = (head.weight if head is not None else base.embeddings.weight).detach().clone()
    return state


def save_mamba_ssm_layout(model, directory: Path, *, pad_multiple: int = 16, unpadded_vocab: int | None = None,
                          d_has_hdim: bool = False) -> Path:
    """Write the model as a state-spaces/mamba2-* checkpoint: config.json (d_model, n_layer,
    ssm_cfg, pad_vocab_size_multiple) + pytorch_model.bin. ssm_cfg leaves d_conv and expand
    out, so the reader must take mamba_ssm's defaults (4 and 2) for them."""
    import torch

    c = model.config
    assert c.conv_kernel == 4 and c.expand == 2
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "d_model": c.hidden_size, "d_intermediate": 0, "n_layer": c.num_hidden_layers,
        "vocab_size": unpadded_vocab or c.vocab_size,
        "ssm_cfg": {"layer": "Mamba2", "d_state": c.state_size, "headdim": c.head_dim, "ngroups": c.n_groups,
                    "chunk_size": c.chunk_size, **({"D_has_hdim": True} if d_has_hdim else {})},
        "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True, "residual_in_fp32": True, "fused_add_norm": True,
        "pad_vocab_size_multiple": pad_multiple, "tie_embeddings": bool(c.tie_word_embeddings),
    }
    (directory / "config.json").write_text(json.dumps(config))
    state = mamba_ssm_state_dict(model)
    if d_has_hdim:
        for key in [k for k in state if k.endswith("mixer.D")]:
            state[key] = state[key].repeat_interleave(c.head_dim)
    torch.save(state, directory / "pytorch_model.bin")
    return directory


def save_codestral_layout(model, directory: Path) -> Path:
    """Write the model as Mistral's Codestral Mamba: params.json + consolidated.safetensors with
    `model.`-prefixed mamba_ssm keys. Everything but params.json's fields is mamba_ssm's default,
    so the model must have d_state=128, head_dim=64, chunk 256."""
    from safetensors.torch import save_file

    c = model.config
    assert (c.state_size, c.head_dim, c.chunk_size, c.expand, c.conv_kernel) == (128, 64, 256, 2, 4)
    directory.mkdir(parents=True, exist_ok=True)
    params = {"dim": c.hidden_size, "n_layers": c.num_hidden_layers, "vocab_size": c.vocab_size,
              "n_groups": c.n_groups, "rms_norm": True, "residual_in_fp32": True, "fused_add_norm": True,
              "pad_vocab_size_multiple": 1, "tie_embeddings": bool(c.tie_word_embeddings), "model_type": "mamba"}
    (directory / "params.json").write_text(json.dumps(params))
    state = {f"model.{k}": v.contiguous() for k, v in mamba_ssm_state_dict(model).items()}
    if c.tie_word_embeddings:
        state.pop("model.lm_head.weight")
    save_file(state, directory / "consolidated.safetensors")
    return directory


def local_corpus(limit_chars: int = 200_000) -> list[str]:
    """Real text available on every machine: the docstrings of the Python standard library."""
    import inspect
    import json as json_mod
    import textwrap

    texts = []
    for module in (json_mod, textwrap, inspect, os, warnings):
        for _, obj in inspect.getmembers(module):
            doc = inspect.getdoc(obj)
            if doc:
                texts.append(doc)
    corpus, total = [], 0
    for t in texts:
        corpus.append(t)
        total += len(t)
        if total > limit_chars:
            break
    return corpus


def make_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer trained here on standard-library docstrings, with <eos> = id 0."""
    from jaxembed.train.tokenizer import train_bpe

    return train_bpe(local_corpus(), vocab_size)


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m jaxembed.testing")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("tiny-mamba2", help="write a random transformers Mamba2 with a tokenizer")
    p.add_argument("directory", type=Path)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--chunk-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        import torch  # noqa: F401
    except ImportError:
        print("python -m jaxembed.testing builds the model with PyTorch: pip install 'jaxembed[torch]'",
              file=sys.stderr)
        return 2
    tokenizer = make_tokenizer(512)
    model = make_hf_mamba2(seed=args.seed, vocab_size=len(tokenizer), hidden_size=args.hidden_size,
                           num_hidden_layers=args.layers, chunk_size=args.chunk_size, n_groups=2)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(args.directory)
    tokenizer.save_pretrained(args.directory)
    print(f"wrote a random Mamba2 ({args.layers} layers, d_model {args.hidden_size}) and its tokenizer to "
          f"{args.directory}")
    return 0

