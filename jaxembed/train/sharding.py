"""Device mesh and shardings for training: a `Mesh` with "data" and "fsdp" axes.

* the batch is split over both axes (every device embeds its own rows);
* each parameter, adapter and optimizer-state leaf is split over "fsdp" along its largest
  axis that divides evenly (never the leading layer axis of stacked params, which the layer
  scan slices), or replicated when none does;
* arrays are assembled from host data with `jax.make_array_from_callback`, which works the
  same in one process and across many (`jax.distributed`), each process filling its own shards.

Nothing in the step depends on the device count: only these shardings do.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

BATCH_AXES = ("data", "fsdp")


def make_mesh(data: int = -1, fsdp: int = 1, devices=None) -> Mesh:
    """A (data, fsdp) mesh over all devices (of every process); -1 takes the remaining devices."""
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    for name, size in (("data", data), ("fsdp", fsdp)):
        if not isinstance(size, int) or size == 0 or size < -1:
            raise ValueError(f"mesh.{name} must be a positive int or -1, got {size!r}")
    if data == -1 and fsdp == -1:
        raise ValueError("at most one of mesh.data and mesh.fsdp may be -1")
    if data == -1:
        data = n // fsdp
    if fsdp == -1:
        fsdp = n // data
    if data * fsdp != n:
        raise ValueError(f"mesh data={data} x fsdp={fsdp} does not use the {n} devices available")
    return Mesh(np.asarray(devices).reshape(data, fsdp), ("data", "fsdp"))


def batch_shards(mesh: Mesh) -> int:
    return mesh.shape["data"] * mesh.shape["fsdp"]


def _fsdp_spec(shape, fsdp: int, first_axis: int) -> P:
    axes = [None] * len(shape)
    if fsdp > 1:
        candidates = [i for i in range(first_axis, len(shape)) if shape[i] % fsdp == 0]
        if candidates:
            axes[max(candidates, key=lambda i: shape[i])] = "fsdp"
    return P(*axes)


def param_shardings(tree, mesh: Mesh):
    """NamedShardings for a params-like pytree (arrays or ShapeDtypeStructs): matrices (ndim >= 2)
    over "fsdp", vectors and scalars replicated; leaves under a "layers" key keep their leading
    layer axis whole."""
    fsdp = mesh.shape["fsdp"]

    def spec(path, leaf):
        stacked = any(getattr(k, "key", None) == "layers" for k in path)
        if len(leaf.shape) < 2:
            return NamedSharding(mesh, P())
        return NamedSharding(mesh, _fsdp_spec(leaf.shape, fsdp, 1 if stacked else 0))

    return jax.tree_util.tree_map_with_path(spec, tree)


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Leading (batch) axis over data x fsdp, the rest whole."""
    return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def sub_batch_sharding(mesh: Mesh):
    """For GradCache's [n_sub, m, ...] blocks: the sub-batch axis m over data x fsdp when it divides
    evenly (else None: the compiler places it)."""
    def sharding(shape):
        if shape[1] % batch_shards(mesh):
            return None
        return NamedSharding(mesh, P(None, BATCH_AXES, *([None] * (len(shape) - 2))))
    return sharding


def row_sharding(mesh: Mesh):
    """For a step's length-group blocks [n, ...]: the rows over data x fsdp when n divides evenly
    (else None: the compiler places them)."""
    def sharding(shape):
        return None if shape[0] % batch_shards(mesh) else batch_sharding(mesh, len(shape))
    return sharding


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def global_array(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global jax.Array from the full host array, which every process holds (the data
    pipeline is deterministic); each process places only its addressable shards."""
    host = np.asarray(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def put(tree, shardings):
    """Host or device pytree -> global arrays with the given shardings."""
    return jax.tree.map(lambda x, s: global_array(np.asarray(x), s), tree, shardings)


def device_memory_bytes(mesh: Mesh) -> int:
    """The memory one device of the mesh can give a step: the allocator's limit on accelerators; on
    CPU (no allocator stats) the host's available memory shared by the local devices."""
    limits = [(d.memory_stats() or {}).get("bytes_limit") for d in mesh.devices.flat if d.process_index ==
              jax.process_index()]
    if limits and all(limits):
        return int(min(limits))
    from jaxembed.bench.measure import available_memory_mib

    return int(available_memory_mib() * 2**20 / max(1, jax.local_device_count()))


# Dense bfloat16 matmul peaks per device (datasheets, FLOP/s), by device kind: for model FLOP utilisation.
# dense bf16 tensor-core peaks per device (NVIDIA's datasheets, without sparsity), matched in device_kind
# longest name first: "NVIDIA H100 PCIe" is the PCIe card, "NVIDIA H100 80GB HBM3" the SXM one
PEAK_BF16_FLOPS = {"H100": 989e12, "H100 PCIe": 756e12, "H100 NVL": 835e12, "H200": 989e12, "GH200": 989e12,
                   "A100": 312e12, "L40S": 362e12, "L4": 121e12}


def peak_flops(mesh: Mesh) -> float | None:
    """The mesh's bfloat16 peak (all devices), or None for devices not in PEAK_BF16_FLOPS (CPUs)."""
    per_device = device_peak_flops(mesh.devices.flat[0].device_kind)
    return None if per_device is None else per_device * mesh.devices.size


def device_peak_flops(device_kind: str) -> float | None:
    """One device's dense bf16 peak from its device_kind, or None when unknown."""
    return next((v for k, v in sorted(PEAK_BF16_FLOPS.items(), key=lambda kv: -len(kv[0])) if k in device_kind),
                None)
