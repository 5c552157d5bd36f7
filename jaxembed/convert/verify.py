"""`jaxembed convert --verify`: run the PyTorch reference and the JAX model on a few sequences.

Each layout module supplies `reference(checkpoint) -> run(ids [1, n] int64) -> [d]`, the
reference implementation's final-norm output at the last token. It is built from the *source*
tensors under the reference's own names (only layout prefixes stripped), not from our converted
params, so a wrong entry in our name table or a wrong hook shows up as a large error. Source
tensors are rounded through the dtype of their converted leaf (`rounded_source_tensors`), so the
check measures the conversion, not the rounding the user asked for.
"""

from __future__ import annotations

from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jaxembed.convert.sources import ConversionError, TensorSource
from jaxembed.schedule import embed

TOLERANCE = 1e-4  # relative, float32 against float32: both sides hold the same (possibly rounded) weights


def rounded_source_tensors(checkpoint) -> Iterator[tuple[str, np.ndarray]]:
    """(raw key, float32 tensor) for every source tensor, rounded through the converted weights'
    dtype, except the family's FLOAT32_PARAMS (matched by the key's last dotted name)."""
    source = TensorSource(checkpoint.files)
    dtypes = {np.dtype(a.dtype) for a in jax.tree.leaves(checkpoint.params)} - {np.dtype(np.float32)}
    weights_dtype = dtypes.pop() if dtypes else np.dtype(np.float32)
    keep_float32 = tuple(checkpoint.family.FLOAT32_PARAMS)
    for raw in source.keys():
        tensor = np.asarray(source.get(raw))
        if raw.rsplit(".", 1)[-1] not in keep_float32 and np.issubdtype(tensor.dtype, np.floating):
            tensor = tensor.astype(weights_dtype)
        yield raw, tensor.astype(np.float32)


def transformers_reference(model, checkpoint, prefix: str, **call_kwargs):
    """Load the source tensors (renamed: `prefix` regex stripped, embedding -> embeddings, no
    lm_head) into a float32 transformers `model` and return run(ids [1, n]) -> the last token's
    final-norm output, float64 [d]."""
    import re

    import torch

    state = {}
    for raw, tensor in rounded_source_tensors(checkpoint):
        name = re.sub(r"^embedding\.", "embeddings.", re.sub(prefix, "", raw))
        if not name.startswith("lm_head."):
            state[name] = torch.from_numpy(tensor)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ConversionError(f"reference model: missing keys {missing}, unexpected keys {unexpected}")

    def run(ids):
        with torch.no_grad():
            out = model(input_ids=torch.from_numpy(ids), **call_kwargs).last_hidden_state
        return out[0, -1].double().numpy()

    return run


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def verify(checkpoint, *, lengths=(7,), seed: int = 0) -> tuple[float, float]:
    """(max relative error, tolerance) of the final-norm output at the last token, horizontal
    and vertical (V = Q; horizontal only for attention), on random sequences of a few odd lengths."""
    cfg = checkpoint.config
    n_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(checkpoint.params))
    needed = 2 * 4 * n_params  # the PyTorch and the JAX model, both in float32
    available = _available_memory()
    if available is not None and needed > available:
        raise ConversionError(
            f"--verify runs the PyTorch and the JAX model side by side in float32 and needs about "
            f"{needed / 2**30:.1f} GiB; {available / 2**30:.1f} GiB is free. Convert without --verify here."
        )
    try:
        import torch  # noqa: F401
    except ImportError:
        raise ConversionError("--verify needs PyTorch: pip install 'jaxembed[torch]'") from None
    reference = checkpoint.layouts.reference(checkpoint)
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), checkpoint.params)
    run = jax.jit(embed, static_argnums=1, static_argnames=("vertical_chunk_size", "normalize"))
    rng = np.random.default_rng(seed)
    q = cfg.chunk_size
    worst = 0.0
    for n in (*lengths, 2 * q + 3):
        ids = rng.integers(0, cfg.vocab_size, (1, n))
        ref = np.asarray(reference(ids), np.float64)
        for v in (None, q) if checkpoint.family.VERTICAL else (None,):
            out = np.asarray(
                run(params, cfg, jnp.asarray(ids), jnp.array([n]), vertical_chunk_size=v, normalize=False)
            )[0]
            err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
            mode = "horizontal" if v is None else f"vertical V={v}"
            print(f"  length {n:6d}  {mode:>16s}  relative error {err:.2e}")
            worst = max(worst, err)
    print(f"verify: max relative error {worst:.2e}")
    return worst, TOLERANCE
