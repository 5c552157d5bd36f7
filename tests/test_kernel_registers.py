"""benchmarks/kernel_registers.py's readers of what ptxas was given and said (issue #19), on text
written out by hand: which tensor-core instructions each kernel's PTX issues, and ptxas's `-v`
report per kernel."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "kernel_registers", Path(__file__).resolve().parents[1] / "benchmarks" / "kernel_registers.py")
kernel_registers = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kernel_registers)

PTX = """\
.version 8.7
.target sm_90a
.visible .entry ssd_chunked(
\t.param .u64 ssd_chunked_param_0
)
{
\twgmma.fence.sync.aligned;
\twgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%f1, %f2}, %rd1, %rd2, 1, 1, 1, 0, 0;
}
.visible .entry wkv7_chunked(
\t.param .u64 wkv7_chunked_param_0
)
{
\tmma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%f1, %f2}, {%r1, %r2}, {%r5}, {%f5, %f6};
}
.visible .entry ssd_chunked_backward(
\t.param .u64 p
)
{
\twgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%f1}, %rd1, %rd2, 1, 1, 1, 0, 0;
\tmma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1, %f2}, {%r1, %r2}, {%r5}, {%f5, %f6};
}
.visible .entry normed_in_place(
\t.param .u64 p
)
{
\tfma.rn.f32 %f1, %f2, %f3, %f4;
}
.visible .entry loop_add_fusion(
\t.param .u64 p
)
{
\tmma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1, %f2}, {%r1, %r2}, {%r5}, {%f5, %f6};
}
"""


def test_each_kernel_gets_the_tensor_core_instructions_of_its_own_body():
    assert kernel_registers.mma_paths(PTX) == {
        "ssd_chunked": "wgmma", "wkv7_chunked": "mma.sync", "ssd_chunked_backward": "wgmma+mma.sync",
        "normed_in_place": "none",  # XLA's own fusions (loop_add_fusion) are not jaxembed kernels: not listed
    }


def test_ptxas_report_per_kernel():
    log = """\
ptxas info    : Compiling entry function 'ssd_chunked' for 'sm_90a'
ptxas info    : Function properties for ssd_chunked
    40 bytes stack frame, 40 bytes spill stores, 64 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 8 bytes cmem[0]
ptxas info    : Compiling entry function 'input_reduce_fusion' for 'sm_90a'
ptxas info    : Function properties for input_reduce_fusion
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 22 registers, used 1 barriers, 32 bytes smem
"""
    assert kernel_registers.ptxas_reports(log) == [("ssd_chunked", 255, 40, 64)]


def test_a_tile_override_reaches_the_embedding_compile_only():
    embed = kernel_registers.child_command("rwkv7:1x32k", "h100", ["wkv7=64,32,8"])
    assert embed[-1] == "--tile=wkv7=64,32,8" and "--families" in embed
    assert "--tile=wkv7=64,32,8" not in kernel_registers.child_command("train", "h100", ["wkv7=64,32,8"])
