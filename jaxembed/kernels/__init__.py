"""Pallas kernels for the chunked operators, and the one dispatch point between them and XLA.

    backend   what runs
    "auto"    the Pallas kernel on GPU, the XLA chunked form (`jaxembed.ops`) elsewhere
    "pallas"  the Pallas kernel (compiled for the GPU)
    "interpret" the same kernel run by Pallas' interpreter (any platform; slow, for tests)
    "xla"     the XLA chunked form

The choice is made at trace time, from (first that is set) the `backend=` argument, the innermost
`with jaxembed.kernels.use(...)`, and the JAXEMBED_KERNELS environment variable; default "auto".
`schedule.embed` / `forward` and `Embedder(kernels=...)` take it as a static argument, so a
compiled program never silently keeps an old choice.
"""

from __future__ import annotations

import contextlib
import os

import jax

from jaxembed.kernels.common import BlockSizes, heuristic

BACKENDS = ("auto", "pallas", "interpret", "xla")
_stack: list[str] = []


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"kernels backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def resolve(backend: str | None = None) -> str:
    """The backend that runs now: 'pallas', 'interpret' or 'xla'."""
    if backend is None:
        backend = _stack[-1] if _stack else os.environ.get("JAXEMBED_KERNELS", "auto")
    check_backend(backend)
    if backend == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    if backend == "pallas" and jax.default_backend() != "gpu":
        raise RuntimeError(f"kernels='pallas' needs a GPU (jax's default backend is {jax.default_backend()!r}); "
                           "use 'interpret' to run the kernels on this platform, or 'xla'")
    return backend


@contextlib.contextmanager
def use(backend: str):
    """Run the operators traced inside this block with `backend`."""
    _stack.append(check_backend(backend))
    try:
        yield
    finally:
        _stack.pop()


def _dispatch(name: str, form: str = "chunked"):
    import importlib

    def op(*args, backend: str | None = None, blocks: BlockSizes | None = None, **kwargs):
        chosen = resolve(backend)
        if chosen == "xla":
            return getattr(importlib.import_module(f"jaxembed.ops.{name}"), form)(*args, **kwargs)
        kernel = importlib.import_module(f"jaxembed.kernels.{name}")
        return getattr(kernel, form)(*args, blocks=blocks, interpret=chosen == "interpret", **kwargs)

    op.__name__ = f"{name}_{form}"
    op.__doc__ = f"`ops.{name}.{form}` or its Pallas kernel, as `resolve(backend)` decides."
    return op


ssd_chunked = _dispatch("ssd")
ssd_chunked_xbc = _dispatch("ssd", "chunked_xbc")
wkv7_chunked = _dispatch("wkv7")
mlstm_chunked = _dispatch("mlstm")

__all__ = ["BACKENDS", "BlockSizes", "heuristic", "resolve", "use", "ssd_chunked", "ssd_chunked_xbc", "wkv7_chunked", "mlstm_chunked"]
