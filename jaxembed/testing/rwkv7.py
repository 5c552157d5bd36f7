"""Random RWKV7 checkpoints in BlinkDL's and fla-hub's layouts, and BlinkDL's rwkv package as reference.

`make_blinkdl_rwkv7` draws every tensor of an RWKV-x070 state dict at random (norm weights and
biases, token-shift mixes, w0, a0, v0, k_k, k_a, r_k and ln_x included), at scales that keep
activations O(1). `save_fla_layout` writes the same weights as fla-org's RWKV7ForCausalLM would
save them, following fla's utils/convert_from_rwkv7.py mapping (LoRA w1/w2 -> w_lora.lora.0/2
transposed, w0 -> w_lora.lora.2.bias, [1, 1, d] vectors squeezed except the attention's x_*).
Needs torch.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def make_blinkdl_rwkv7(seed: int = 0, *, vocab_size: int = 100, d_model: int = 128, n_layers: int = 3,
                       head_size: int = 64, d_ffn: int | None = None, decay_low_rank: int = 32, a_low_rank: int = 32,
                       v_low_rank: int = 16, gate_low_rank: int = 32, layer0_value_lora: bool = True) -> dict:
    """A random RWKV-x070 state dict {name: float32 torch tensor} under BlinkDL's names and shapes.

    layer0_value_lora: also write blocks.0.att.v0/v1/v2, which BlinkDL's files may hold and no
    implementation uses (drawn with a different rank, so a reader that used them would fail).
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    d, f = d_model, d_ffn or 4 * d_model
    h = d // head_size

    def normal(*shape, scale=1.0, mean=0.0):
        return mean + scale * torch.randn(*shape, generator=g)

    def uniform(*shape, lo=0.0, hi=1.0):
        return lo + (hi - lo) * torch.rand(*shape, generator=g)

    def vec(t):  # BlinkDL stores per-channel vectors as [1, 1, d]
        return t.reshape(1, 1, d)

    sd = {"emb.weight": normal(vocab_size, d)}
    for i in range(n_layers):
        b, att, ffn = f"blocks.{i}.", f"blocks.{i}.att.", f"blocks.{i}.ffn."
        norms = ("ln0", "ln1", "ln2") if i == 0 else ("ln1", "ln2")
        for ln in norms:
            sd[b + ln + ".weight"] = normal(d, scale=0.2, mean=1.0)
            sd[b + ln + ".bias"] = normal(d, scale=0.1)
        for x in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"):
            sd[att + x] = vec(uniform(d))
        sd[att + "w0"] = vec(uniform(d, lo=-6.0, hi=1.0))  # decays from ~0.999 to ~0.6 per token
        sd[att + "a0"] = vec(normal(d, scale=0.5))
        ranks = {"w": decay_low_rank, "a": a_low_rank, "g": gate_low_rank}
        if i > 0 or layer0_value_lora:
            ranks["v"] = v_low_rank if i > 0 else v_low_rank + 8
            sd[att + "v0"] = vec(normal(d, scale=0.5))
        for m, r in ranks.items():
            sd[att + m + "1"] = normal(d, r, scale=d**-0.5)
            sd[att + m + "2"] = normal(r, d, scale=0.5 * r**-0.5)
        sd[att + "k_k"] = vec(normal(d, scale=0.2, mean=0.8))
        sd[att + "k_a"] = vec(normal(d, scale=0.2, mean=1.0))
        sd[att + "r_k"] = normal(h, head_size, scale=0.3)
        for name in ("receptance", "key", "value"):
            sd[att + name + ".weight"] = normal(d, d, scale=d**-0.5)  # torch Linear [out, in]
        sd[att + "output.weight"] = normal(d, d, scale=(d * n_layers) ** -0.5)
        sd[att + "ln_x.weight"] = normal(d, scale=0.2, mean=1.0)
        sd[att + "ln_x.bias"] = normal(d, scale=0.1)
        sd[ffn + "x_k"] = vec(uniform(d))
        sd[ffn + "key.weight"] = normal(f, d, scale=d**-0.5)
        sd[ffn + "value.weight"] = normal(d, f, scale=(f * n_layers) ** -0.5)
    sd["ln_out.weight"] = normal(d, scale=0.2, mean=1.0)
    sd["ln_out.bias"] = normal(d, scale=0.1)
    sd["head.weight"] = normal(vocab_size, d, scale=d**-0.5)
    return {k: v.float().contiguous() for k, v in sd.items()}


def save_blinkdl_layout(state: dict, directory: Path, name: str = "rwkv7-random") -> Path:
    """torch.save the state dict as DIRECTORY/NAME.pth (no config, like BlinkDL's releases); returns the file."""
    import torch

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.pth"
    torch.save(state, path)
    return path


def write_random_blinkdl(cfg, directory: Path, *, seed: int = 0, name: str = "rwkv7-random") -> Path:
    """A random BlinkDL-layout .pth with the dimensions of `cfg` (an RWKV7Config); returns the file."""
    state = make_blinkdl_rwkv7(seed, vocab_size=cfg.vocab_size, d_model=cfg.d_model, n_layers=cfg.n_layers,
                               head_size=cfg.head_size, d_ffn=cfg.d_ffn, decay_low_rank=cfg.decay_low_rank,
                               a_low_rank=cfg.a_low_rank, v_low_rank=cfg.v_low_rank, gate_low_rank=cfg.gate_low_rank)
    return save_blinkdl_layout(state, directory, name)


def fla_state_dict(state: dict) -> dict:
    """The same weights under fla's RWKV7ForCausalLM names and shapes."""
    out = {}
    top = {"emb.weight": "model.embeddings.weight", "ln_out.weight": "model.norm.weight",
           "ln_out.bias": "model.norm.bias", "head.weight": "lm_head.weight"}
    norms = {"ln0": "pre_norm", "ln1": "attn_norm", "ln2": "ffn_norm"}
    projections = {"receptance": "r_proj", "key": "k_proj", "value": "v_proj", "output": "o_proj", "ln_x": "g_norm"}
    lora = {"1": "lora.0.weight", "2": "lora.2.weight", "0": "lora.2.bias"}
    for name, t in state.items():
        if name in top:
            out[top[name]] = t
            continue
        _, i, block, *rest = name.split(".")
        prefix = f"model.layers.{i}."
        if block in norms:
            out[prefix + f"{norms[block]}.{rest[0]}"] = t
        elif block == "ffn":  # ffn.x_k is a plain [d] vector in fla
            out[prefix + "ffn." + ".".join(rest)] = t.reshape(-1) if rest == ["x_k"] else t
        elif rest[0] in projections:
            out[prefix + f"attn.{projections[rest[0]]}.{rest[1]}"] = t
        elif len(rest) == 1 and len(rest[0]) == 2 and rest[0][0] in "wavg" and rest[0][1] in "012":
            if i == "0" and rest[0][0] == "v":
                continue  # fla's layer 0 has no v_lora
            m, which = rest[0]
            # Linear weights are [out, in]: w1 [d, r] -> lora.0.weight [r, d], w2 [r, d] -> lora.2.weight [d, r]
            out[prefix + f"attn.{m}_lora.{lora[which]}"] = t.reshape(-1) if which == "0" else t.t().contiguous()
        elif rest[0] in ("k_k", "k_a"):
            out[prefix + f"attn.{rest[0]}"] = t.reshape(-1)
        else:  # x_r ... x_g stay [1, 1, d]; r_k [h, n]
            out[prefix + "attn." + rest[0]] = t
    return {k: v.contiguous() for k, v in out.items()}


def fla_config(state: dict, *, eos_token_id: int = 0, norm_eps: float = 1e-5) -> dict:
    """config.json of fla's RWKV7ForCausalLM for these weights (the fields its RWKV7Config saves)."""
    vocab, d = state["emb.weight"].shape
    h, n = state["blocks.0.att.r_k"].shape
    n_layers = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("blocks."))
    f = state["blocks.0.ffn.key.weight"].shape[0]
    v_key = "blocks.1.att.v1" if n_layers > 1 else "blocks.0.att.v1"
    v_rank = state[v_key].shape[1] if v_key in state else 16  # one layer without layer 0's: any rank (never read)
    return {
        "model_type": "rwkv7", "architectures": ["RWKV7ForCausalLM"], "attn_mode": "chunk", "hidden_size": d,
        "hidden_ratio": f / d, "intermediate_size": f, "num_hidden_layers": n_layers, "head_dim": n, "num_heads": h,
        "decay_low_rank_dim": state["blocks.0.att.w1"].shape[1], "gate_low_rank_dim": state["blocks.0.att.g1"].shape[1],
        "a_low_rank_dim": state["blocks.0.att.a1"].shape[1], "v_low_rank_dim": v_rank,
        "hidden_act": "sqrelu", "max_position_embeddings": 2048, "norm_first": True, "norm_bias": True,
        "norm_eps": norm_eps, "attn": None, "use_cache": True, "pad_token_id": None, "bos_token_id": 0,
        "eos_token_id": eos_token_id, "tie_word_embeddings": False, "initializer_range": 0.02, "fuse_norm": True,
        "fuse_cross_entropy": True, "fuse_linear_cross_entropy": False, "use_l2warp": True, "vocab_size": vocab,
        "value_dim": [d] * n_layers, "torch_dtype": "float32",
    }


def save_fla_layout(state: dict, directory: Path, **config) -> Path:
    """Write the weights as an fla-hub checkpoint: config.json + model.safetensors."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(fla_config(state, **config), indent=2))
    save_file(fla_state_dict(state), directory / "model.safetensors")
    return directory


def blinkdl_last_hidden(state: dict, seqs) -> np.ndarray:
    """BlinkDL's rwkv package ("cpu fp32"): ln_out's output at the last token of each sequence run alone, [n, d]."""
    from jaxembed.convert.rwkv7 import blinkdl_reference

    run = blinkdl_reference(state)
    return np.stack([run(s) for s in seqs])


def blinkdl_logits(state: dict, seqs) -> np.ndarray:
    """BlinkDL's rwkv package's logits (its own head.weight) at the last token of each sequence. [n, v] float64."""
    from jaxembed.convert.rwkv7 import blinkdl_reference

    run = blinkdl_reference(state, identity_head=False)
    return np.stack([run(s) for s in seqs])


__all__ = ["blinkdl_last_hidden", "blinkdl_logits", "fla_config", "fla_state_dict", "make_blinkdl_rwkv7",
           "save_blinkdl_layout", "save_fla_layout", "write_random_blinkdl"]
