"""One benchmark point in a fresh process: `python -m jaxembed.bench.worker '<json point>'`.

The point names a model config (plus overrides), the intra-layer chunk size Q, the vertical
chunk size V (null: horizontal), batch, length, dtype, repeats and platform. The worker builds
random weights, compiles `jaxembed.embed` under `jax.jit` with one call, times `repeats` more
calls, and prints one result line (`measure.report`). Memory:

* GPU: the device allocator's `peak_bytes_in_use` (`jax.Device.memory_stats()`). The weights
  are drawn on the device (`device_params`), so the device never holds more than the weights
  and one float32 layer before the first call, the host holds nothing of the model's size,
  and the peak is the run's: weights plus activations.
* CPU: the process's peak RSS (`ru_maxrss`), which includes the Python/JAX runtime (~0.5 GiB)
  and the weights; `run_peak_rss_mib` is the peak while compiling and running only (VmHWM reset
  after the build).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

from jaxembed.bench import measure


def device_params(cfg, dtype: str, seed: int, device):
    """Random weights of cfg's shapes in `dtype`, drawn and stacked on `device`.

    One layer is drawn by the family's own `init_params` and repeated over the layers (speed and
    memory do not depend on the values; a 7B model's full random draw would take minutes per
    point). Nothing of the model's size passes through host memory, so on a GPU the host decides
    nothing: the device holds at most the weights while they are built. Decay
    parameters stay float32, as `Embedder` keeps them.
    """
    import jax
    import jax.numpy as jnp

    from jaxembed import models

    family = models.family(cfg)
    one_layer = dataclasses.replace(cfg, n_layers=1)

    def build(key):
        def place(path, leaf):
            leaf = leaf.astype(models.param_dtype(family, str(getattr(path[-1], "key", "")), leaf.dtype, dtype))
            if str(getattr(path[0], "key", "")) == "layers":
                leaf = jnp.broadcast_to(leaf, (cfg.n_layers, *leaf.shape[1:]))
            return leaf

        params = family.init_params(one_layer, key)
        params.pop("lm_head", None)  # as in `Embedder`: an embedder never reads it, so it is not on the device
        return jax.tree_util.tree_map_with_path(place, params)

    key = jax.device_put(jax.random.key(seed), device)
    treedef = jax.tree.structure(jax.eval_shape(build, key))
    shapes = jax.tree.leaves(jax.eval_shape(build, key))
    nbytes = [a.size * a.dtype.itemsize for a in shapes]
    # one jit per large leaf (XLA drops the other leaves' draws), largest first, and one for all
    # small leaves: a leaf's float32 draw is never more than what is still to be built, so the
    # build's peak stays at the weights
    groups = [[i] for i in sorted(range(len(shapes)), key=lambda i: -nbytes[i]) if nbytes[i] >= 2**26]
    groups.append([i for i in range(len(shapes)) if nbytes[i] < 2**26])
    leaves = [None] * len(shapes)
    for group in groups:
        built = jax.jit(lambda k, group=tuple(group): [jax.tree.leaves(build(k))[i] for i in group])(key)
        for i, leaf in zip(group, built, strict=True):
            leaves[i] = leaf
    return jax.tree.unflatten(treedef, leaves)


def load_point_config(point: dict):
    from jaxembed.config import load_config

    cfg = load_config(point["config"])
    overrides = point.get("overrides") or {}
    return dataclasses.replace(cfg, **overrides) if overrides else cfg


def run(point: dict) -> dict:
    gpu = point["platform"] == "gpu"
    if gpu:
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # allocate as used: the peak is the run's
        env = {"threads": None}
    else:
        os.environ["JAX_PLATFORMS"] = "cpu"
        env = measure.pin_threads(point.get("threads"))  # before jax starts its client
    result: dict = {"env": env}
    build_peak = 0.0
    try:
        import jax
        import numpy as np

        from jaxembed.schedule import embed

        device = jax.devices()[0]
        if gpu and device.platform != "gpu":
            raise RuntimeError(f"platform gpu asked for, but jax's device is {device.platform}")
        result["device"] = device.device_kind
        cfg = load_point_config(point)
        t0 = time.perf_counter()
        params = device_params(cfg, point["dtype"], point.get("seed", 0), device)
        rng = np.random.default_rng(point.get("seed", 0))
        ids = jax.device_put(rng.integers(0, cfg.vocab_size, (point["batch"], point["length"]), dtype=np.int32),
                             device)
        lengths = jax.device_put(np.full((point["batch"],), point["length"], np.int32), device)
        fn = jax.jit(lambda p, i, n: embed(p, cfg, i, n, vertical_chunk_size=point.get("vertical_chunk_size"),
                                           chunk_size=point.get("chunk_size")))
        jax.block_until_ready((params, ids, lengths))
        result["build_s"] = time.perf_counter() - t0
        result["weights_mib"] = sum(x.nbytes for x in jax.tree.leaves(params)) / 2**20
        result["baseline_rss_mib"] = measure.current_rss_mib()
        hwm_reset = False
        if not gpu:  # leave out the host transient of building the weights from the run's own peak
            build_peak = result["build_peak_rss_mib"] = measure.peak_rss_mib()
            hwm_reset = measure.reset_peak_rss()

        def call():
            return fn(params, ids, lengths).block_until_ready()

        timing = measure.time_run(call, point["repeats"])
        out = np.asarray(call())
        if not np.isfinite(out).all():
            raise FloatingPointError("the embeddings are not finite")
        if hwm_reset:
            result["run_peak_rss_mib"] = measure.hwm_rss_mib()
        if gpu:
            stats = device.memory_stats() or {}
            result["peak_device_mib"] = stats.get("peak_bytes_in_use", float("nan")) / 2**20
        result.update(status="ok", first_call_s=timing.first_s, times_s=timing.times_s, mean_s=timing.mean_s,
                      min_s=timing.min_s, max_s=timing.max_s)
    except Exception as err:
        result["status"], result["error"] = measure.classify_error(err)
    # ru_maxrss now, with the readings taken before the reset and of VmHWM (the kernel updates the
    # two counters lazily, so either may lag by a few hundred KiB): the process's lifetime peak
    result["peak_rss_mib"] = max(measure.peak_rss_mib(), build_peak, result.get("run_peak_rss_mib", 0.0))
    return result


def main(argv=None) -> int:
    measure.die_with_parent()
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m jaxembed.bench.worker '<json point>'")
    result = run(json.loads(argv[0]))
    measure.report(result)
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
