"""`jaxembed convert --verify`: run the PyTorch reference and the JAX model on a few sequences.

The reference is built from the *source* tensors under transformers' own module names (only
the layout prefixes are stripped), not from our converted params, so a wrong entry in our name
table or a wrong hook shows up as a large error.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from jaxembed.convert.sources import ConversionError, TensorSource
from jaxembed.schedule import embed


TOLERANCE = 1e-4  # relative, float32 against float32: both sides hold the same (possibly rounded) weights


def reference_model(checkpoint):
    """transformers' Mamba2Model (float32) holding the source checkpoint's tensors, each rounded
    through the dtype its converted leaf has (bfloat16 after `--dtype bfloat16`), so the check
    measures the conversion, not the rounding the user asked for."""
    try:
        import torch
        from transformers import Mamba2Model
    except ImportError:
        raise ConversionError("--verify needs PyTorch: pip install 'jaxembed[torch]'") from None
    model = Mamba2Model(checkpoint.family.to_transformers_config(checkpoint.config)).float().eval()
    source = TensorSource(checkpoint.files)
    weights_dtype = checkpoint.params["embedding"].dtype
    keep_float32 = tuple("." + n for n in checkpoint.config_family.FLOAT32_PARAMS)
    state = {}
    for raw in source.keys():
        name = re.sub(r"^embedding\.", "embeddings.", re.sub(r"^(model\.)?(backbone\.)?", "", raw))
        if name.startswith("lm_head."):
            continue
        tensor = np.asarray(source.get(raw))
        if not name.endswith(keep_float32):
            tensor = tensor.astype(weights_dtype)
        state[name] = torch.from_numpy(tensor.astype(np.float32))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ConversionError(f"reference model: missing keys {missing}, unexpected keys {unexpected}")
    return model


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def verify(checkpoint, *, lengths=(7,), seed: int = 0) -> tuple[float, float]:
    """(max relative error, tolerance) of the final-norm output at the last token, horizontal
    and vertical (V = Q), on random sequences of a few odd lengths."""
    import torch

    cfg = checkpoint.config
    n_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(checkpoint.params))
    needed = 2 * 4 * n_params  # the PyTorch and the JAX model, both in float32
    available = _available_memory()
    if available is not None and needed > available:
        raise ConversionError(
            f"--verify runs the PyTorch and the JAX model side by side in float32 and needs about "
            f"{needed / 2**30:.1f} GiB; {available / 2**30:.1f} GiB is free. Convert without --verify here."
        )
    model = reference_model(checkpoint)
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), checkpoint.params)
    run = jax.jit(embed, static_argnums=1, static_argnames=("vertical_chunk_size", "normalize"))
    rng = np.random.default_rng(seed)
    q = cfg.chunk_size
    worst = 0.0
    for n in (*lengths, 2 * q + 3):
        ids = rng.integers(0, cfg.vocab_size, (1, n))
        with torch.no_grad():
            ref = model(input_ids=torch.from_numpy(ids)).last_hidden_state[0, -1].double().numpy()
        for v in (None, q):
            out = np.asarray(run(params, cfg, jnp.asarray(ids), jnp.array([n]), vertical_chunk_size=v, normalize=False))[0]
            err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
            mode = "horizontal" if v is None else f"vertical V={v}"
            print(f"  length {n:6d}  {mode:>16s}  relative error {err:.2e}")
            worst = max(worst, err)
    print(f"verify: max relative error {worst:.2e}")
    return worst, TOLERANCE
