"""An XLA:CPU setting jaxembed applies when it is imported: YNNPACK fusions off.

jaxlib 0.10 and 0.11 hand some of XLA:CPU's dots and reductions to YNNPACK ("ynn fusions").
With them on, a Mamba2 batch of 16 or more inputs that each fit one SSD chunk (T <= Q, the
common case of short texts) returns NaN embeddings in about one fresh process in three. The
optimised HLO is the same in the processes that give NaN and in those that do not, and with
the fusions off no process gives NaN (`benchmarks/xla_cpu_ynn_nan.py` counts both). Without
them the recurrent models run as fast or faster on the CPU, the transformers at batch 1 up to
12% slower (docs/benchmarks.md).

XLA reads XLA_FLAGS once, when JAX starts its first backend, and an unknown flag aborts the
process, so the flag is added only for jaxlib versions known to have it, only before a
backend has started, and never over a setting of the user's own. JAXEMBED_KEEP_XLA_CPU_YNN=1
leaves XLA_FLAGS untouched.
"""

from __future__ import annotations

import os
import warnings

YNN_FLAG = "--xla_cpu_experimental_ynn_fusion_type"
DISABLE_YNN = YNN_FLAG + "="  # an empty list of fusion types
OPT_OUT = "JAXEMBED_KEEP_XLA_CPU_YNN"
# jaxlib (major, minor) versions whose XLA knows the flag (checked in their libjax_common.so)
JAXLIB_WITH_FLAG = {(0, 10), (0, 11)}


def jaxlib_version() -> tuple[int, int]:
    import jaxlib

    return tuple(int(part) for part in jaxlib.__version__.split(".")[:2])


def plan(
    xla_flags: str, opt_out: bool, jaxlib_version: tuple[int, ...], backends_started: bool
) -> tuple[str, str | None]:
    """(what to do, the new XLA_FLAGS or None). What to do is one of "set", "kept: user flag",
    "kept: opt-out", "kept: jaxlib without the flag", "too late"."""
    if YNN_FLAG in xla_flags:
        return "kept: user flag", None
    if opt_out:
        return "kept: opt-out", None
    if tuple(jaxlib_version[:2]) not in JAXLIB_WITH_FLAG:
        return "kept: jaxlib without the flag", None
    if backends_started:
        return "too late", None
    return "set", f"{xla_flags} {DISABLE_YNN}".strip()


def apply() -> str:
    """Add the flag to os.environ["XLA_FLAGS"] where `plan` says so; warn when a CPU backend
    already runs without it. Returns what `plan` decided."""
    import jax
    import jaxlib
    from jax._src import xla_bridge  # no public API says whether a backend has started

    action, flags = plan(os.environ.get("XLA_FLAGS", ""), os.environ.get(OPT_OUT, "") not in ("", "0"),
                         jaxlib_version(), xla_bridge.backends_are_initialized())
    if flags is not None:
        os.environ["XLA_FLAGS"] = flags
    elif action == "too late" and jax.default_backend() == "cpu":
        warnings.warn(f"jaxembed was imported after JAX started its CPU backend, so XLA:CPU's YNN fusions stay on; "
                      f"with them jaxlib {jaxlib.__version__} can return NaN embeddings for batches of short "
                      f"inputs. Import jaxembed before running JAX code, or set XLA_FLAGS={DISABLE_YNN}",
                      RuntimeWarning, stacklevel=3)
    return action
