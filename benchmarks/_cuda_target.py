"""Compile for an NVIDIA GPU that this machine does not have (XLA's deviceless compilation).

jax's CUDA plugin can build a GPU topology from a target description alone
(`jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...)`), and a
program whose inputs carry a sharding on it is lowered and compiled by XLA's GPU compiler with
Pallas' Triton kernels and all. What comes out is the GPU's own executable: its
`memory_analysis()`, its optimised HLO (fusions, copies, layouts) and its Triton kernels built by
ptxas for sm_90. Nothing runs, so it gives no times. There is no autotuner either, so GEMMs go to
cuBLAS (`--xla_gpu_enable_triton_gemm=false`), as the H100's autotuner chose for these shapes on
2026-11-23 (the trace's GEMM kernels were cuBLAS's nvjet/sm90_xmma): whether XLA folds the residual
add into a GEMM (cuBLAS beta=1) depends on it.

Checked against the H100 on 2026-11-23 (main at 6ddd919, Codestral shapes, 2 layers, b=32 x 4k):
compiled temporaries 17.1 / 2.00 / 3.49 / 12.4 GiB here against 19.1 / 2.18 / 3.66 / 12.5 on the
GPU (horizontal, V=256, 512, 2048); per in-flight token, at 4 layers, 0-11% below the GPU's
horizontally and 4-17% below vertically, for all three families (docs/benchmarks.md).

Needs the CUDA plugin and NVIDIA's libraries, no GPU and no driver (~3 GB; not in
requirements-dev.txt, so CI never needs it):

    pip install "jax[cuda12]==$(python -c 'import jax; print(jax.__version__)')"

Call `setup()` before jax is imported, then `sharding(name)` for the replicated sharding on the
target whose `jax.ShapeDtypeStruct`s make `jit(...).lower(...)` compile for it.
"""

from __future__ import annotations

import os
import re

# XLA's GPU device descriptions (xla/tools/hlo_opt/gpu_specs), the fields the compiler reads.
_H100_SXM = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 84929347584 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
runtime_version { major: 12 minor: 8 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""
TARGETS = {
    "h100": _H100_SXM,
    "h200": _H100_SXM.replace("memory_bandwidth: 3352320000000", "memory_bandwidth: 4800000000000")
    .replace("device_memory_size: 84929347584", "device_memory_size: 150754820096")
    .replace("NVIDIA H100 80GB HBM3", "NVIDIA H200"),
}
BANDWIDTH = {"h100": 3.35e12, "h200": 4.8e12}  # bytes/s, the datasheet's HBM peak


def setup() -> None:
    """Environment for a deviceless CUDA compile; before `import jax`. The CPU stays jax's
    backend (there is no GPU to run on); the CUDA plugin only compiles."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"  # its check asks the driver for the device count
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if "xla_gpu_enable_triton_gemm" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_triton_gemm=false"


def sharding(name: str):
    """A replicated sharding on one GPU of type `name` ("h100" or "h200"), and from here on
    `jax.default_backend()` answers "gpu", so that jaxembed traces its GPU program (Pallas
    kernels, no CPU-only rewrites)."""
    import jax
    from jax.experimental import topologies

    if name not in TARGETS:
        raise SystemExit(f"unknown target {name!r}; known: {', '.join(TARGETS)}")
    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=TARGETS[name], topology="1x1x1")
    except Exception as err:
        raise SystemExit(f"deviceless CUDA compilation needs jax's CUDA plugin and NVIDIA's libraries "
                         f"(pip install \"jax[cuda12]=={jax.__version__}\"): {err}") from None
    mesh = topologies.make_mesh(topology, (1,), ("device",))
    jax.default_backend = lambda: "gpu"
    _declare_device(name)
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _declare_device(name: str) -> None:
    """jax 0.11's Pallas Triton lowering asks the current device which GPU it compiles for, and
    there is none here: an abstract mesh naming the target's device kind answers it, from here on
    (jax 0.10 reads the compute capability from the compile options and needs nothing)."""
    import jax
    from jax._src import mesh as mesh_lib

    if not hasattr(mesh_lib, "AbstractDevice"):
        return
    kind = re.search(r'device_description_str: "([^"]+)"', TARGETS[name]).group(1)
    cores = int(re.search(r"core_count: (\d+)", TARGETS[name]).group(1))
    device = mesh_lib.AbstractDevice(device_kind=kind, num_cores=cores, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("device",), axis_types=(jax.sharding.AxisType.Auto,),
                                     abstract_device=device)
    jax.sharding.use_abstract_mesh(mesh).__enter__()
