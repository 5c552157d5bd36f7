"""Pallas kernels for the chunked operators, and the one dispatch point between them and XLA.

    backend   what runs
    "auto"    the Pallas kernel on GPU, the XLA chunked form (`jaxembed.ops`) elsewhere
    "pallas"  the Pallas kernel (compiled for the GPU)
    "interpret" the same kernel run by Pallas' interpreter (any platform; slow, for tests)
    "xla"     the XLA chunked form

Every operator call names its backend (`backend=`, required): the models pass their
`jaxembed.runtime.Runtime`'s `kernels`, which `schedule.embed` / `forward` and
`Embedder(kernels=...)` take as a static argument, so a compiled program never silently keeps an
old choice and nothing is read from module state or the environment while JAX traces.
"""

from __future__ import annotations

import jax

from jaxembed.kernels import common
from jaxembed.kernels.common import BlockSizes, heuristic
from jaxembed.ops.common import through_slot

BACKENDS = ("auto", "pallas", "interpret", "xla")


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"kernels backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def resolve(backend: str) -> str:
    """What `backend` runs on this platform: 'pallas', 'interpret' or 'xla'."""
    check_backend(backend)
    if backend == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    if backend == "pallas" and jax.default_backend() != "gpu":
        raise RuntimeError(f"kernels='pallas' needs a GPU (jax's default backend is {jax.default_backend()!r}); "
                           "use 'interpret' to run the kernels on this platform, or 'xla'")
    return backend


def _dispatch(name: str, form: str = "chunked"):
    """The operator `form` of family `name`. An `initial_state` may be (or hold) an
    `ops.common.StateSlot`: every kernel takes it as it is (in place where it can address it), the
    XLA form gets it read and written back (`ops.common.through_slot`)."""
    import importlib

    def op(*args, backend: str, blocks: BlockSizes | None = None, **kwargs):
        chosen = resolve(backend)
        if chosen == "xla":
            return through_slot(getattr(importlib.import_module(f"jaxembed.ops.{name}"), form), *args, **kwargs)
        kernel = getattr(importlib.import_module(f"jaxembed.kernels.{name}"), form)
        return kernel(*args, blocks=blocks, interpret=chosen == "interpret", **kwargs)

    op.__name__ = f"{name}_{form}"
    op.__doc__ = f"`ops.{name}.{form}` or its Pallas kernel, as `resolve(backend)` decides."
    return op


ssd_chunked = _dispatch("ssd")
ssd_chunked_xbc = _dispatch("ssd", "chunked_xbc")
ssd_conv_chunked = _dispatch("ssd", "conv_chunked")
wkv7_chunked = _dispatch("wkv7")
wkv7_rwkv7_chunked = _dispatch("wkv7", "rwkv7_chunked")
mlstm_chunked = _dispatch("mlstm")


def stacked_lora_input(*args, backend: str, **kwargs):
    """`ops.norm.stacked_lora_input` or its Pallas kernel (`kernels.norm`), as `resolve(backend)`
    decides: LoRA's GEMM input [u | s u A] written by the norm that produces u."""
    from jaxembed.kernels import norm as kernel
    from jaxembed.ops import norm as reference

    chosen = resolve(backend)
    if chosen == "xla":
        return reference.stacked_lora_input(*args, **kwargs)
    return kernel.stacked_lora_input(*args, interpret=chosen == "interpret", **kwargs)


def normed_in_place(x, weight, gate=None, *, backend: str, eps, group_size):
    """`ops.norm.normed` in x's dtype, written over x by a Pallas kernel (`kernels.norm`), or by
    XLA as `resolve(backend)` decides."""
    from jaxembed.kernels import norm as kernel
    from jaxembed.ops import norm as reference

    chosen = resolve(backend)
    if chosen == "xla":
        return reference.normed(x, weight, gate, eps=eps, group_size=group_size, out_dtype=x.dtype)
    return kernel.normed_in_place(x, weight, gate, eps=eps, group_size=group_size, interpret=chosen == "interpret")


def gated_norm_backward(y, z, dn, weight, *, backend: str, eps, group_size, norm_dtype):
    """`ops.norm.gated_norm_backward` (dy, dz, n, 1/rms), or one Pallas pass of `kernels.norm` for
    groups it holds whole, as `resolve(backend)` decides."""
    from jaxembed.kernels import norm as kernel
    from jaxembed.ops import norm as reference

    chosen = resolve(backend)
    if chosen == "xla" or common.padded(group_size) > kernel.BACKWARD_TILE:
        return reference.gated_norm_backward(y, z, dn, weight, eps=eps, group_size=group_size, norm_dtype=norm_dtype)
    return kernel.gated_norm_backward(y, z, dn, weight, eps=eps, group_size=group_size, norm_dtype=norm_dtype,
                                      interpret=chosen == "interpret")


__all__ = ["BACKENDS", "BlockSizes", "heuristic", "resolve", "ssd_chunked", "ssd_chunked_xbc", "ssd_conv_chunked",
           "wkv7_chunked", "wkv7_rwkv7_chunked", "mlstm_chunked", "stacked_lora_input",
           "normed_in_place", "gated_norm_backward"]
