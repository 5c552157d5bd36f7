"""Checks that the processes of one jax.distributed run were given the same run."""

from __future__ import annotations

import hashlib

import numpy as np


def check_processes_agree(parts: dict[str, str], *, error: type[Exception], advice: str) -> None:
    """Raise `error` on every process, naming the parts (name -> a text that identifies it) whose texts differ
    between processes. A 4-byte hash of each part is gathered from all processes (the same names everywhere)."""
    import jax
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return
    local, total = jax.local_device_count(), jax.device_count()
    if local * jax.process_count() != total:  # process_allgather (and every sharded step) needs as many on each
        raise error(f"the processes have different numbers of local devices ({local} here, {total} in all over "
                    f"{jax.process_count()} processes): give every process the same count")
    digests = np.array([int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little")
                        for text in parts.values()], np.uint32)
    every = np.asarray(multihost_utils.process_allgather(digests))  # [processes, parts]
    differ = [name for name, column in zip(parts, every.T, strict=True) if len(set(column.tolist())) > 1]
    if differ:
        others = [i for i in range(len(every)) if not np.array_equal(every[i], every[0])]
        raise error(f"the processes were given different runs: process(es) {others} differ from process 0 in "
                    f"{', '.join(differ[:6])}{', ...' if len(differ) > 6 else ''}; {advice}")
