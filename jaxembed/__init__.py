"""jaxembed: linear-time, constant-memory text embeddings from recurrent language models.

    import jaxembed
    model = jaxembed.load("path/to/mamba2")          # converted or Hugging Face directory
    q = model.encode_query(["how do I sort a list"], instruction="Retrieve code for the query")
    d = model.encode_document(["sorted(xs) returns a new sorted list"])
    model.similarity(q, d)

`jaxembed.embed(params, config, ids, lengths, vertical_chunk_size=V)` is the pure,
jit-compatible function underneath.
"""

from __future__ import annotations

from jaxembed import xla_cpu

xla_cpu.apply()  # before any JAX backend starts: XLA:CPU's YNN fusions off (see xla_cpu.py)

from jaxembed import compile_cache  # noqa: E402

compile_cache.apply()  # JAX's persistent compilation cache in ~/.cache/jaxembed/xla unless set or turned off

from jaxembed.config import ConfigError, Mamba2Config, load_config  # noqa: E402
from jaxembed.embedder import QUERY_TEMPLATE, Embedder, load_tokenizer  # noqa: E402
from jaxembed.schedule import embed, forward  # noqa: E402
from jaxembed.stream import embed_sections, embed_stream  # noqa: E402

__version__ = "0.1.0"


def load(path, *, dtype=None, tokenizer=None, chunk_size=None, query_template=None, default_instruction=None,
         max_tokens_per_batch=None, kernels="auto", verify=True, revision=None) -> Embedder:
    """An `Embedder` from a converted directory (`jaxembed convert`) or a Hugging Face-format
    directory or hub id (transformers, mamba_ssm or Codestral layout, converted in memory).

    dtype: None (as stored), "float32" or "bfloat16" weights and activations; states and
    decays stay float32. tokenizer: a path, hub id or tokenizer object (default: the one in
    the directory). chunk_size: the intra-layer chunk size Q (default: the model's).
    kernels: "auto" (Pallas kernels on GPU, XLA elsewhere), "pallas", "interpret" or "xla".
    verify: check every file and every tensor of a converted checkpoint against the checksums
    recorded when it was written (a corrupt file is an error naming the file, a tensor that differs
    one naming the tensor); False skips the checks.
    revision: for a hub id, the branch, tag or commit to download (default: main).
    """
    from jaxembed import checkpoint

    if dtype is not None:
        import jax.numpy as jnp

        try:
            ok = jnp.dtype(dtype) in (jnp.float32, jnp.bfloat16)
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(f"dtype must be None, 'float32' or 'bfloat16', got {dtype!r}")
    config, params, settings, directory, fingerprint = checkpoint.open_model(path, verify=verify, revision=revision)
    return Embedder(
        params,
        config,
        fingerprint=fingerprint,
        tokenizer=load_tokenizer(tokenizer, directory),
        dtype=dtype,
        chunk_size=chunk_size,
        query_template=settings.get("query_template", QUERY_TEMPLATE) if query_template is None else query_template,
        default_instruction=settings.get("default_instruction") if default_instruction is None else default_instruction,
        max_tokens_per_batch=max_tokens_per_batch,
        kernels=kernels,
    )


__all__ = ["load", "load_config", "embed", "forward", "embed_sections", "embed_stream", "Embedder", "ConfigError",
           "Mamba2Config", "QUERY_TEMPLATE", "__version__"]
