"""The errors jaxembed raises for bad input, in one place. Each is a ValueError (or, for data that
is missing rather than wrong, a RuntimeError) whose message names the problem: the CLI reports
them as one line."""

from __future__ import annotations

import numbers
import sys
import warnings

import numpy as np


class ConfigError(ValueError):
    """A config file is missing fields or describes an unsupported model."""


class ConversionError(ValueError):
    """The source is not a checkpoint we can read, or its tensors do not match the model."""


class DataError(ValueError):
    """Training data that cannot be used: a missing or unsupported file, a malformed record, bad batch settings."""


class SpecError(ValueError):
    """A benchmark sweep spec that names something missing or misshaped."""


class MissingDataError(RuntimeError):
    """An evaluation task's dataset is neither local nor reachable."""


class CheckpointError(RuntimeError):
    """A training checkpoint that is damaged or incomplete: its directory is named, and the one to fall back to."""


class TrainingDivergedError(FloatingPointError):
    """A training step gave a non-finite loss or gradient norm: the run stops before saving it."""


class TruncationWarning(UserWarning):
    """Texts were cut to max_length; raised with `warn_every_time`."""


def warn_every_time(message: str, category: type[Warning], stacklevel: int = 1) -> None:
    """`warnings.warn`, every time: Python's default action shows a message once per call site, so a loop of
    encode calls would report only its first cut. The filters still apply ("ignore", "error", "once")."""
    frame = sys._getframe(stacklevel)
    # no module_globals: linecache would ask `python -c`'s or the REPL's __main__ loader for source, which raises
    warnings.warn_explicit(message, category, frame.f_code.co_filename, frame.f_lineno,
                           module=frame.f_globals.get("__name__"), registry=None)


def check_positive_int(name: str, value, *, optional: bool = False, error: type[Exception] = ValueError) -> None:
    """Raise `error` naming `name` unless value is a positive int (numpy ints count, bools do not),
    or None where `optional`."""
    if value is None and optional:
        return
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise error(f"{name} must be a positive int{' or None' if optional else ''}, got {value!r}")


def check_bool(name: str, value) -> None:
    """A TypeError naming `name` unless value is a bool (numpy's too): "no" or 0 would be read by truth value."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r:.40}")


def check_token_ids(config) -> None:
    """A config's special token ids (eos, pad) are ints in [0, vocab_size) or None."""
    for name in ("eos_token_id", "pad_token_id"):
        value = getattr(config, name, None)
        if value is None:
            continue
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or not 0 <= value < config.vocab_size:
            raise ConfigError(f"{name} must be a token id in [0, vocab_size = {config.vocab_size}) or null, "
                              f"got {value!r}")
