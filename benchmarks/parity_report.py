"""Worst relative error of encode_ids against transformers' Mamba2Model (fp32), over random
tiny models (n_groups 1-4, odd chunk sizes and head dims), odd lengths, horizontal and
vertical inference, batched with mixed lengths, and the mamba_ssm layout of the same weights.

    .venv/bin/python benchmarks/parity_report.py
"""

import tempfile
import warnings
from pathlib import Path

import numpy as np

import jaxembed
from jaxembed.testing import hf_last_hidden, make_hf_mamba2, rel_err, save_mamba_ssm_layout

warnings.filterwarnings("ignore")
CASES = [
    dict(n_groups=1, chunk_size=8),
    dict(n_groups=2, chunk_size=16, state_size=32),
    dict(n_groups=4, chunk_size=8, head_dim=8),
    dict(n_groups=3, chunk_size=12, head_dim=12, hidden_size=72),
]
LENGTHS = (1, 7, 37, 129, 300)


def main() -> None:
    rng = np.random.default_rng(123)
    worst = {}
    for k, case in enumerate(CASES):
        model = make_hf_mamba2(seed=100 + k, **case)
        seqs = [rng.integers(0, model.config.vocab_size, n).tolist() for n in LENGTHS]
        ref = hf_last_hidden(model, seqs)
        q = case["chunk_size"]
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            emb = jaxembed.load(tmp)
            for v in (None, q, 2 * q, 5 * q):
                out = emb.encode_ids(seqs, normalize_embeddings=False, vertical_chunk_size=v, batch_size=len(seqs))
                worst[f"transformers {case} V={v}"] = max(rel_err(o, r) for o, r in zip(out, ref, strict=True))
        if case.get("hidden_size", 64) == 64:
            with tempfile.TemporaryDirectory() as tmp:
                save_mamba_ssm_layout(model, Path(tmp), pad_multiple=8)
                out = jaxembed.load(tmp).encode_ids(seqs, normalize_embeddings=False, vertical_chunk_size=2 * q)
                worst[f"mamba_ssm   {case} V={2 * q}"] = max(rel_err(o, r) for o, r in zip(out, ref, strict=True))
    for name, err in worst.items():
        print(f"{err:.2e}  {name}")
    print(f"worst relative error: {max(worst.values()):.2e} (lengths {LENGTHS}, one batch of mixed lengths)")


if __name__ == "__main__":
    main()
