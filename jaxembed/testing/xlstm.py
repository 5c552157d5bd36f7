"""Tiny random transformers xLSTM checkpoints for tests (needs torch).

Every parameter is drawn fresh, at scales where each part of the block matters: norms around 1,
gate weights and biases that spread the input gate over several units of log scale (so both
branches of the normaliser max(|q·n|, exp(-m)) occur) and the forget gate from strong to weak
decay, and nonzero biases when use_bias. transformers' own init (zero gate weights, constant
gate biases, unit norms) would leave most of that untested.
"""

from __future__ import annotations

import numpy as np


def make_hf_xlstm(seed: int = 0, *, vocab_size=96, hidden_size=64, num_heads=4, num_hidden_layers=2, chunk_size=16,
                  qk_dim_factor=0.5, v_dim_factor=1.0, ffn_proj_factor=1.3, ffn_round_up_to_multiple_of=16,
                  gate_soft_cap=15.0, use_bias=False, weight_mode="single", tie_word_embeddings=False,
                  causal_lm=False):
    """A transformers xLSTMModel (or xLSTMForCausalLM) in float32 with native torch kernels in
    "inference" mode, every parameter random. Built without transformers' weight init, whose
    fused-mode branch fails on mismatched bias shapes."""
    import torch
    from transformers import xLSTMConfig, xLSTMForCausalLM, xLSTMModel
    from transformers.initialization import no_init_weights

    cfg = xLSTMConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, embedding_dim=hidden_size, num_heads=num_heads,
        num_hidden_layers=num_hidden_layers, num_blocks=num_hidden_layers, chunk_size=chunk_size,
        qk_dim_factor=qk_dim_factor, v_dim_factor=v_dim_factor, ffn_proj_factor=ffn_proj_factor,
        ffn_round_up_to_multiple_of=ffn_round_up_to_multiple_of, gate_soft_cap=gate_soft_cap, use_bias=use_bias,
        weight_mode=weight_mode, tie_word_embeddings=tie_word_embeddings,
        chunkwise_kernel="chunkwise--native_autograd", sequence_kernel="native_sequence__native", step_kernel="native",
        mode="inference", autocast_kernel_dtype="float32", inference_state_dtype="float32",
    )
    with no_init_weights():
        model = (xLSTMForCausalLM if causal_lm else xLSTMModel)(cfg).float().eval()
    gen = torch.Generator().manual_seed(seed)
    h = num_heads

    def randn(shape, std=1.0, mean=0.0):
        return mean + std * torch.randn(shape, generator=gen)

    def gate_bias(n):
        """Input gate biases around 0 (spread 2), forget gate biases in [-1, 4] (decays from strong to weak)."""
        return torch.cat([randn((n,), 2.0), -1.0 + 5.0 * torch.rand((n,), generator=gen)])

    with torch.no_grad():
        for name, p in model.named_parameters():
            fan_in = p.shape[-1] if p.ndim == 2 else 1
            if "norm" in name and name.endswith("weight"):
                p.copy_(randn(p.shape, 0.3, 1.0))
            elif name.endswith("ifgate_preact.bias"):  # fused: [input gate; forget gate]
                p.copy_(gate_bias(h))
            elif name.endswith(("igate_preact.bias", "fgate_preact.bias")):
                p.copy_(gate_bias(h)[:h] if name.endswith("igate_preact.bias") else gate_bias(h)[h:])
            elif name.endswith("bias"):
                p.copy_(randn(p.shape, 0.3))
            elif "embeddings" in name:
                p.copy_(randn(p.shape))
            else:  # projections, gates and heads: unit-variance outputs for unit-RMS inputs
                p.copy_(randn(p.shape, fan_in**-0.5))
    return model


def hf_xlstm_last_hidden(model, seqs) -> np.ndarray:
    """transformers' own out_norm output at the last position of each sequence, each run alone.
    use_cache=False: transformers sizes its cache with the config's qk_dim rounded up to a multiple
    of 64, which does not fit these small layers."""
    import torch

    base = getattr(model, "backbone", model)
    with torch.no_grad():
        return np.stack([
            base(input_ids=torch.tensor([list(s)]), use_cache=False).last_hidden_state[0, -1].double().numpy()
            for s in seqs
        ])
