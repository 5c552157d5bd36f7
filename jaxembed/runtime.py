"""How a model runs, as one explicit static value.

`Runtime(chunk_size, kernels, remat)` travels from `schedule.embed` / `forward` to every
family's `layer` and on to the chunked operators (`kernels.<op>(..., backend=runtime.kernels)`).
It is a frozen, hashable dataclass, so it is a static value under jit (like recurrentgemma's
`scan_type` on its config): nothing that decides how a program runs is read from a module
global or the environment while JAX traces.
"""

from __future__ import annotations

import dataclasses

from jaxembed.errors import check_positive_int
from jaxembed.kernels import check_backend


@dataclasses.dataclass(frozen=True)
class Runtime:
    """chunk_size: the intra-layer chunk size Q of the chunked operators (attention ignores it).
    kernels: the chunked operators' backend, "auto", "pallas", "interpret" or "xla" (`jaxembed.kernels`);
      it also picks cuDNN flash attention ("auto"/"pallas" on a GPU) for the transformer baselines.
    remat: rematerialise each layer under differentiation (training); no effect on values."""

    chunk_size: int
    kernels: str = "auto"
    remat: bool = False

    def __post_init__(self):
        check_positive_int("chunk_size (Q)", self.chunk_size)
        object.__setattr__(self, "chunk_size", int(self.chunk_size))
        check_backend(self.kernels)
        if not isinstance(self.remat, bool):
            raise TypeError(f"remat must be a bool, got {self.remat!r}")
