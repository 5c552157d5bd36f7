"""How much of a random model's EOS embedding comes from the last few tokens (docs/training.md,
"Mamba2 from scratch"): mean cosine between the embedding of each held-out function and the
embedding of its last K tokens alone, for the model's init with and without `init_options`.

    python benchmarks/init_locality.py data/packages/heldout-2000.jsonl \\
        configs/models/small-train-mamba2.yaml configs/models/small-train-xlstm.yaml

Near 1: the embedding hardly depends on anything but the end of the text (contrastive training
from there tends to collapse); xLSTM's init is the comparison.
"""

from __future__ import annotations

import argparse
import json

import jax
import numpy as np

from jaxembed import models
from jaxembed.config import load_config
from jaxembed.embedder import Embedder
from jaxembed.testing import make_tokenizer

MAMBA2_OPTIONS = ({}, {"A_init_range": (0.01, 1.0)}, {"A_init_range": (0.01, 1.0), "D_init": 0.0})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("heldout", help="jsonl with a `positive` text per record")
    parser.add_argument("configs", nargs="+", help="model config yamls (configs/models/...)")
    parser.add_argument("--texts", type=int, default=64)
    parser.add_argument("--last", type=int, default=8, help="K: the tail embedded alone")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=4096, help="stdlib BPE size (the packages configs' tokenizer)")
    args = parser.parse_args()

    with open(args.heldout) as f:
        texts = [json.loads(line)["positive"] for line, _ in zip(f, range(args.texts), strict=False)]
    tokenizer = make_tokenizer(args.vocab)
    print(f"| model config | init_options | cos(embedding, embedding of the last {args.last} tokens) |")
    print("|---|---|---|")
    for path in args.configs:
        cfg = load_config(path)
        for options in MAMBA2_OPTIONS if cfg.architecture == "mamba2" else ({},):
            params = models.family(cfg).init_params(cfg, jax.random.key(0), **options)
            emb = Embedder(params, cfg, tokenizer=tokenizer)
            ids = emb.tokenize(texts, max_length=args.max_tokens)
            full = emb.encode_ids(ids, show_progress_bar=False)
            tail = emb.encode_ids([i[-args.last:] for i in ids], show_progress_bar=False)
            print(f"| {path} | {options or 'default'} | {float(np.mean(np.sum(full * tail, axis=1))):.3f} |")


if __name__ == "__main__":
    main()
