"""JAX's persistent compilation cache, on by default: a new process reuses the programs an earlier
one compiled (a one-shot `jaxembed embed` is otherwise mostly compilation).

`import jaxembed` calls `apply()`, which points JAX at a cache directory unless the user already chose:

- ``JAXEMBED_COMPILATION_CACHE=off`` (or ``0``, ``false``, ``none``): no persistent cache;
- ``JAXEMBED_COMPILATION_CACHE=DIR``: that directory;
- unset: ``$XDG_CACHE_HOME/jaxembed/xla`` (``~/.cache/jaxembed/xla``).

A cache directory set through JAX itself (``JAX_COMPILATION_CACHE_DIR`` or
``jax.config.update("jax_compilation_cache_dir", ...)``) is left alone. Programs that compile in under
`MIN_COMPILE_SECONDS` are not written (JAX's default is 1 s, which skips most embedding programs on a
CPU). Entries are keyed by JAX on the program, the compiler options and flags, and the jaxlib version,
so a cached program is only ever reused for the same computation.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "JAXEMBED_COMPILATION_CACHE"
MIN_COMPILE_SECONDS = 0.2
_OFF = {"off", "0", "false", "none", "no"}


def default_directory() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jaxembed" / "xla"


def apply() -> Path | None:
    """Point JAX's persistent compilation cache at jaxembed's directory (see the module docstring);
    returns the directory in use, or None when it is off."""
    import jax

    setting = os.environ.get(ENV)
    if setting is not None and setting.strip().lower() in _OFF:
        return None
    current = jax.config.jax_compilation_cache_dir
    if current:  # the user's own choice wins
        return Path(current)
    directory = Path(setting).expanduser() if setting else default_directory()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # an unwritable home must not stop embedding; programs are compiled as before
    if not os.access(directory, os.W_OK | os.X_OK):
        return None  # a read-only one (an image's, a shared home's): JAX would warn at every compilation
    jax.config.update("jax_compilation_cache_dir", str(directory))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    return directory
