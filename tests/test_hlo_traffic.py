"""benchmarks/_hlo_traffic.py, which reads HBM traffic out of a compiled GPU program's HLO text
(benchmarks/gpu_program.py, issue #19), on a program written out by hand whose bytes are counted
here from the HLO semantics: a loop of 4 layers that copies its weight slice out of the stacked
array, runs a cuBLAS GEMM and a Pallas kernel, gates with a column slice of the GEMM's output and
writes its result into a stacked carry in place."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "_hlo_traffic", Path(__file__).resolve().parents[1] / "benchmarks" / "_hlo_traffic.py")
hlo_traffic = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(hlo_traffic)

MiB = 2**20
HLO = """\
HloModule jit_layers, is_scheduled=true

%fused_weight_slice (param_0: bf16[4,1024,2048], param_1: s32[]) -> bf16[1,1024,2048] {
  %param_0 = bf16[4,1024,2048]{2,1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  %ds = bf16[1,1024,2048]{2,1,0} dynamic-slice(%param_0, %param_1, %zero, %zero), dynamic_slice_sizes={1,1024,2048}
  ROOT %copy = bf16[1,1024,2048]{2,1,0} copy(%ds)
}

%fused_gate (param_0.1: bf16[256,2048], param_1.1: f32[256,512]) -> f32[256,512] {
  %param_0.1 = bf16[256,2048]{1,0} parameter(0)
  %convert = f32[256,2048]{1,0} convert(%param_0.1)
  %slice = f32[256,512]{1,0} slice(%convert), slice={[0:256], [0:512]}
  %param_1.1 = f32[256,512]{1,0} parameter(1)
  ROOT %multiply = f32[256,512]{1,0} multiply(%slice, %param_1.1)
}

%fused_store (param_0.2: f32[4,256,512], param_1.2: f32[256,512], param_2.2: s32[]) -> f32[4,256,512] {
  %param_0.2 = f32[4,256,512]{2,1,0} parameter(0)
  %param_1.2 = f32[256,512]{1,0} parameter(1)
  %bitcast.1 = f32[1,256,512]{2,1,0} bitcast(%param_1.2)
  %param_2.2 = s32[] parameter(2)
  %zero.1 = s32[] constant(0)
  ROOT %dus = f32[4,256,512]{2,1,0} dynamic-update-slice(%param_0.2, %bitcast.1, %param_2.2, %zero.1, %zero.1)
}

%fused_increment (param_0.3: s32[]) -> s32[] {
  %param_0.3 = s32[] parameter(0)
  %one = s32[] constant(1)
  ROOT %add = s32[] add(%param_0.3, %one)
}

%fused_cast (param_0.4: bf16[256,1024]) -> f32[256,1024] {
  %param_0.4 = bf16[256,1024]{1,0} parameter(0)
  ROOT %convert.1 = f32[256,1024]{1,0} convert(%param_0.4)
}

%body (arg: (s32[], bf16[4,1024,2048], f32[4,256,512], bf16[256,1024])) -> (s32[], bf16[4,1024,2048], f32[4,256,512], bf16[256,1024]) {
  %arg = (s32[], bf16[4,1024,2048]{2,1,0}, f32[4,256,512]{2,1,0}, bf16[256,1024]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %w = bf16[4,1024,2048]{2,1,0} get-tuple-element(%arg), index=1
  %acc = f32[4,256,512]{2,1,0} get-tuple-element(%arg), index=2
  %x = bf16[256,1024]{1,0} get-tuple-element(%arg), index=3
  %w_l = bf16[1,1024,2048]{2,1,0} fusion(%w, %i), kind=kCustom, calls=%fused_weight_slice, backend_config={"fusion_backend_config":{"kind":"__custom_fusion","custom_fusion_config":{"name":"dynamic_slice_fusion","kernel_index":0}}}
  %w_b = bf16[1024,2048]{1,0} bitcast(%w_l)
  %gemm = (bf16[256,2048]{1,0}, s8[4194304]{0}) custom-call(%x, %w_b), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %h = bf16[256,2048]{1,0} get-tuple-element(%gemm), index=0
  %y = f32[256,512]{1,0} custom-call(%x), custom_call_target="__gpu$xla.gpu.triton", backend_config={"name":"ssd_chunked"}
  %gated = f32[256,512]{1,0} fusion(%h, %y), kind=kLoop, calls=%fused_gate
  %stored = f32[4,256,512]{2,1,0} fusion(%acc, %gated, %i), kind=kLoop, calls=%fused_store
  %next = s32[] fusion(%i), kind=kLoop, calls=%fused_increment
  ROOT %out = (s32[], bf16[4,1024,2048]{2,1,0}, f32[4,256,512]{2,1,0}, bf16[256,1024]{1,0}) tuple(%next, %w, %stored, %x)
}

%cond (arg.1: (s32[], bf16[4,1024,2048], f32[4,256,512], bf16[256,1024])) -> pred[] {
  %arg.1 = (s32[], bf16[4,1024,2048]{2,1,0}, f32[4,256,512]{2,1,0}, bf16[256,1024]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%arg.1), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

ENTRY %main (w.1: bf16[4,1024,2048], x.1: bf16[256,1024]) -> f32[4,256,512] {
  %w.1 = bf16[4,1024,2048]{2,1,0} parameter(0)
  %x.1 = bf16[256,1024]{1,0} parameter(1)
  %x32 = f32[256,1024]{1,0} fusion(%x.1), kind=kLoop, calls=%fused_cast
  %acc0 = f32[4,256,512]{2,1,0} constant({...})
  %start = s32[] constant(0)
  %init = (s32[], bf16[4,1024,2048]{2,1,0}, f32[4,256,512]{2,1,0}, bf16[256,1024]{1,0}) tuple(%start, %w.1, %acc0, %x.1)
  %loop = (s32[], bf16[4,1024,2048]{2,1,0}, f32[4,256,512]{2,1,0}, bf16[256,1024]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"},"known_init_step":{"init":"0","step":"1"}}
  ROOT %result = f32[4,256,512]{2,1,0} get-tuple-element(%loop), index=2
}
"""


def test_bytes_by_kind_follow_the_loop_trip_count_slices_and_in_place_updates():
    t = hlo_traffic.traffic(HLO)
    layers = 4
    # the weight slice, read and written once each per layer
    assert t["copy"] == layers * 2 * (1024 * 2048 * 2)
    # the GEMM reads x and its weight slice and writes its result (cuBLAS's workspace is not traffic)
    assert t["gemm"] == layers * (256 * 1024 * 2 + 1024 * 2048 * 2 + 256 * 2048 * 2)
    assert t["kernel"] == layers * (256 * 1024 * 2 + 256 * 512 * 4)
    gate = 256 * 512 * 2 + 256 * 512 * 4 + 256 * 512 * 4  # a quarter of h's columns (bf16), y, the result
    store = 256 * 512 * 4 + 4 + 256 * 512 * 4  # gated and i read; one layer's slot written, the rest untouched
    increment = 4 + 4
    cast = 256 * 1024 * 2 + 256 * 1024 * 4  # outside the loop: once
    assert t["glue"] == layers * (gate + store + increment) + cast
    assert t["glue_launches"] == layers * 3 + 1
    assert [name for _, name, _, _ in t["top_glue"][:2]] == ["gated", "stored"]
    # 2 M N K per layer, and each launch's (FLOPs, bytes, runs) for a roofline
    assert t["gemm_flops"] == layers * 2 * 256 * 2048 * 1024
    assert t["gemms"] == [(2 * 256 * 2048 * 1024, t["gemm"] // layers, layers)]


def test_a_loop_without_a_known_trip_count_is_an_error_not_a_guess():
    hlo = HLO.replace(', backend_config={"known_trip_count":{"n":"4"},"known_init_step":{"init":"0","step":"1"}}', "")
    with pytest.raises(RuntimeError, match="no known trip count"):
        hlo_traffic.traffic(hlo)


SHIFTED = """\
HloModule jit_conv, is_scheduled=true

%fused_conv (param_0: bf16[64,96]) -> f32[64,32] {
  %param_0 = bf16[64,96]{1,0} parameter(0)
  %wide = f32[64,96]{1,0} convert(%param_0)
  %tap0 = f32[62,32]{1,0} slice(%wide), slice={[0:62], [32:64]}
  %zero = f32[] constant(0)
  %pad0 = f32[64,32]{1,0} pad(%tap0, %zero), padding=2_0x0_0
  %tap1 = f32[63,32]{1,0} slice(%wide), slice={[0:63], [32:64]}
  %pad1 = f32[64,32]{1,0} pad(%tap1, %zero), padding=1_0x0_0
  %tap2 = f32[64,32]{1,0} slice(%wide), slice={[0:64], [32:64]}
  %sum = f32[64,32]{1,0} add(%pad0, %pad1)
  ROOT %out = f32[64,32]{1,0} add(%sum, %tap2)
}

%fused_pick (param_0.1: f32[64,32], param_1.1: s32[2,1]) -> f32[2,32] {
  %param_0.1 = f32[64,32]{1,0} parameter(0)
  %param_1.1 = s32[2,1]{1,0} parameter(1)
  ROOT %rows = f32[2,32]{1,0} gather(%param_0.1, %param_1.1), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,32}
}

ENTRY %main (x: bf16[64,96], at: s32[2,1]) -> f32[2,32] {
  %x = bf16[64,96]{1,0} parameter(0)
  %at = s32[2,1]{1,0} parameter(1)
  %conv = f32[64,32]{1,0} fusion(%x), kind=kLoop, calls=%fused_conv
  ROOT %pick = f32[2,32]{1,0} fusion(%conv, %at), kind=kLoop, calls=%fused_pick
}
"""


def test_overlapping_shifted_slices_are_one_read_and_a_gather_reads_what_it_returns():
    t = hlo_traffic.traffic(SHIFTED)
    # the conv's three taps are the same 64 x 32 columns shifted by a row: one read of that box
    conv = 64 * 32 * 2 + 64 * 32 * 4
    pick = 2 * 32 * 4 + 2 * 4 + 2 * 32 * 4  # two rows gathered, the indices, the result
    assert t["glue"] == conv + pick


def test_the_union_of_slices_counts_each_element_once():
    union = hlo_traffic._union_elements
    assert union([[(0, 62), (32, 64)], [(0, 63), (32, 64)], [(0, 64), (32, 64)]]) == 64 * 32
    # two disjoint column ranges over different rows, and a box inside another
    assert union([[(0, 512), (2048, 4096)], [(0, 64), (0, 1024)], [(10, 20), (2100, 2200)]]) == 512 * 2048 + 64 * 1024
    # two boxes overlapping in a corner
    assert union([[(0, 4), (0, 4)], [(2, 6), (2, 6)]]) == 16 + 16 - 4


IN_PLACE = """\
HloModule jit_slot, is_scheduled=true

ENTRY %main (x: bf16[32,64], stack: f32[4,8,16], layer: s32[1]) -> (bf16[32,64], f32[4,8,16]) {
  %x = bf16[32,64]{1,0} parameter(0)
  %stack = f32[4,8,16]{2,1,0} parameter(1)
  %layer = s32[1]{0} parameter(2)
  ROOT %pallas_call = (bf16[32,64]{1,0}, f32[4,8,16]{2,1,0}) custom-call(%x, %stack, %layer), custom_call_target="__gpu$xla.gpu.triton", output_to_operand_aliasing={{1}: (1, {})}, backend_config={"name":"ssd_chunked"}
}
"""


def test_a_kernel_updating_a_stack_in_place_moves_one_entry():
    """A Pallas kernel whose result aliases its stack of per-layer states (a `StateSlot`) reads
    and writes one layer's entry of it, not the stack."""
    t = hlo_traffic.traffic(IN_PLACE)
    entry = 8 * 16 * 4
    assert t["kernel"] == (32 * 64 * 2 + entry + 4) + (32 * 64 * 2 + entry)
    # without the alias the whole stack counts both ways
    whole = hlo_traffic.traffic(IN_PLACE.replace("output_to_operand_aliasing={{1}: (1, {})}, ", ""))
    assert whole["kernel"] == t["kernel"] + 2 * 3 * entry


NORM_OVER_INPUT = """\
HloModule jit_norm, is_scheduled=true

ENTRY %main (y: bf16[32,64], z: bf16[32,64], w: f32[64]) -> bf16[32,64] {
  %y = bf16[32,64]{1,0} parameter(0)
  %z = bf16[32,64]{1,0} parameter(1)
  %w = f32[64]{0} parameter(2)
  ROOT %pallas_call = bf16[32,64]{1,0} custom-call(%y, %z, %w), custom_call_target="__gpu$xla.gpu.triton", output_to_operand_aliasing={{}: (0, {})}, backend_config={debug = false, grid_x = 4 : i32, name = "normed_in_place", num_warps = 4 : i32}
}
"""


def test_a_norm_written_over_its_input_moves_its_whole_buffer():
    """`kernels.normed_in_place` aliases its output to its input as a state stack's kernel does,
    but reads and writes the whole buffer: y, z and the weight read, the output written."""
    t = hlo_traffic.traffic(NORM_OVER_INPUT)
    assert t["kernel"] == 2 * (32 * 64 * 2) + 64 * 4 + 32 * 64 * 2


def test_a_gemm_reading_its_weight_slice_in_place_is_a_gemm_not_a_copy():
    """jax 0.11's XLA folds the weight's dynamic slice into the cuBLAS call (a dynamic_slice_fusion
    holding the GEMM): one GEMM reading the layer's slice in place, no copy, and its workspace is
    no traffic."""
    folded = HLO.replace("""  ROOT %copy = bf16[1,1024,2048]{2,1,0} copy(%ds)
}""", """  %ds_b = bf16[1024,2048]{1,0} bitcast(%ds)
  %param_2 = bf16[256,1024]{1,0} parameter(2)
  ROOT %gemm_in = (bf16[256,2048]{1,0}, s8[4194304]{0}) custom-call(%param_2, %ds_b), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
}""").replace("(param_0: bf16[4,1024,2048], param_1: s32[]) -> bf16[1,1024,2048]",
              "(param_0: bf16[4,1024,2048], param_1: s32[], param_2: bf16[256,1024]) -> (bf16[256,2048], s8[4194304])")
    folded = folded.replace("""  %w_l = bf16[1,1024,2048]{2,1,0} fusion(%w, %i)""", """  %gemm = (bf16[256,2048]{1,0}, s8[4194304]{0}) fusion(%w, %i, %x)""")
    folded = "\n".join(line for line in folded.splitlines()
                       if not line.lstrip().startswith(("%w_b =", "%gemm = (bf16[256,2048]{1,0}, s8[4194304]{0}) custom")))
    assert folded.count("%gemm =") == 1 and "copy(%ds)" not in folded
    t, before = hlo_traffic.traffic(folded), hlo_traffic.traffic(HLO)
    assert t["copy"] == 0
    # x, the layer's weight slice, the result; and the layer index it reads the slice at
    assert t["gemm"] == before["gemm"] + 4 * 4 == 4 * (256 * 1024 * 2 + 1024 * 2048 * 2 + 256 * 2048 * 2 + 4)
    assert (t["kernel"], t["glue"]) == (before["kernel"], before["glue"])
    assert t["gemm_flops"] == before["gemm_flops"]  # the FLOPs of the cuBLAS call inside the fusion


def test_an_async_weight_slice_copy_counts_once_as_a_copy():
    """jax 0.11 copies some weight slices by an async fusion (fusion-start ... fusion-done): one
    copy of the layer's slice, counted at its start; the done only waits for it."""
    lines = []
    for line in HLO.splitlines():
        if line.startswith("  ROOT %copy = bf16[1,1024,2048]"):
            lines[-1] = lines[-1].replace("%ds = ", "ROOT %ds = ")
            continue
        if line.lstrip().startswith("%w_l = "):
            line = ("  %w_s = ((bf16[4,1024,2048]{2,1,0}, s32[]), bf16[1,1024,2048]{2,1,0}, u32[]) fusion-start(%w, %i), "
                    "kind=kLoop, calls=%fused_weight_slice\n"
                    "  %w_l = bf16[1,1024,2048]{2,1,0} fusion-done(%w_s)")
        lines.append(line)
    t, before = hlo_traffic.traffic("\n".join(lines)), hlo_traffic.traffic(HLO)
    assert t["copy"] == before["copy"] == 4 * 2 * (1024 * 2048 * 2)
    assert (t["gemm"], t["kernel"], t["glue"], t["glue_launches"]) == (
        before["gemm"], before["kernel"], before["glue"], before["glue_launches"])
