"""Peak memory of `jaxembed convert` against the checkpoint's size.

Writes a random transformers-layout Mamba2 checkpoint in bfloat16 safetensors (Codestral-like
shapes scaled down: n_groups 8, untied head), then converts it in a fresh process and reports
that process's peak RSS next to the checkpoint size and the largest converted leaf. Conversion
streams tensors one at a time and hands each finished leaf to JAX, so the peak should be about
runtime + checkpoint + the largest leaf, not twice the checkpoint: that is what lets a 7B model
(14.5 GB in bfloat16, largest leaf 9.7 GB) convert within 24 GiB.

    .venv/bin/python benchmarks/convert_memory.py --layers 24 --d-model 2048
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def write_checkpoint(directory: Path, layers: int, d_model: int, vocab: int, groups: int) -> dict:
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    d_inner, d_state, head_dim = 2 * d_model, 128, 64
    heads = d_inner // head_dim
    conv_dim = d_inner + 2 * groups * d_state
    config = {
        "model_type": "mamba2", "vocab_size": vocab, "hidden_size": d_model, "num_hidden_layers": layers,
        "num_heads": heads, "head_dim": head_dim, "state_size": d_state, "n_groups": groups, "expand": 2,
        "conv_kernel": 4, "chunk_size": 256, "tie_word_embeddings": False,
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)
    bf16 = lambda *shape: rng.standard_normal(shape, np.float32).astype(ml_dtypes.bfloat16)
    # one shard per layer, as large checkpoints are sharded; written one at a time
    weight_map = {}
    for i in range(layers):
        shard = f"model-{i:05d}.safetensors"
        p = f"backbone.layers.{i}."
        tensors = {
            p + "norm.weight": bf16(d_model), p + "mixer.in_proj.weight": bf16(d_inner + conv_dim + heads, d_model),
            p + "mixer.conv1d.weight": bf16(conv_dim, 1, 4), p + "mixer.conv1d.bias": bf16(conv_dim),
            p + "mixer.dt_bias": bf16(heads), p + "mixer.A_log": bf16(heads), p + "mixer.D": bf16(heads),
            p + "mixer.norm.weight": bf16(d_inner), p + "mixer.out_proj.weight": bf16(d_model, d_inner),
        }
        save_file(tensors, directory / shard)
        weight_map.update({k: shard for k in tensors})
    tensors = {"backbone.embeddings.weight": bf16(vocab, d_model), "backbone.norm_f.weight": bf16(d_model),
               "lm_head.weight": bf16(vocab, d_model)}
    save_file(tensors, directory / "model-embed.safetensors")
    weight_map.update({k: "model-embed.safetensors" for k in tensors})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    size = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    largest = layers * (d_inner + conv_dim + heads) * d_model * 2
    return {"checkpoint_gib": size / 2**30, "largest_leaf_gib": largest / 2**30}


def worker(src: str, dst: str) -> None:
    from jaxembed.convert import convert

    t = time.perf_counter()
    convert(src, dst, progress=False)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(json.dumps({"peak_rss_gib": peak, "seconds": time.perf_counter() - t}))


def baseline() -> None:
    import jax.numpy as jnp  # the runtime alone: Python, jax, orbax, transformers imports

    import jaxembed.convert  # noqa: F401

    jnp.zeros(1).block_until_ready()
    print(json.dumps({"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--baseline", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(*args.worker)
        return 0
    if args.baseline:
        baseline()
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "src", Path(tmp) / "dst"
        sizes = write_checkpoint(src, args.layers, args.d_model, args.vocab, args.groups)
        run = lambda *a: json.loads(subprocess.run([sys.executable, __file__, *a], check=True, capture_output=True,
                                                   text=True).stdout.strip().splitlines()[-1])
        base = run("--baseline")
        out = run("--worker", str(src), str(dst))
    above = out["peak_rss_gib"] - base["peak_rss_gib"]
    print(f"checkpoint {sizes['checkpoint_gib']:.2f} GiB (bfloat16), largest leaf {sizes['largest_leaf_gib']:.2f} GiB")
    print(f"convert: peak RSS {out['peak_rss_gib']:.2f} GiB, runtime alone {base['peak_rss_gib']:.2f} GiB, "
          f"so {above:.2f} GiB for the model = {above / sizes['checkpoint_gib']:.2f} x checkpoint "
          f"({out['seconds']:.1f} s)")
    print(f"bound checked: checkpoint + largest leaf = {sizes['checkpoint_gib'] + sizes['largest_leaf_gib']:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
