"""What the three Pallas kernels share: block sizes, padding, the `pallas_call` wrapper and the
`custom_vjp` whose backward is `jax.vjp` of the `ops/` reference (SSD's short sequences have a
backward kernel: `ssd_backward`).

Each kernel is one program per (batch row, head, block of value columns) that walks the
sequence chunk by chunk: the intra-chunk matrix work and the inter-chunk state update are fused
in one loop, so the state never leaves registers and no per-chunk intermediate (chunk states,
decay matrices) is written to memory. The loop over chunks is the inter-chunk recurrence (the
`lax.scan` of `ops/`), run inside the kernel: on a GPU that is one launch instead of one per
chunk, which matters when T / L is in the thousands. (Two opt-in splits trade that for work
parallel over chunks and per-chunk intermediates in memory: `BlockSizes.parallel_outputs` and
`parallel_factors`.) When that grid is too small to fill the GPU (batch 1), the kernels split
the sequence into segments walked by programs of their own: a first kernel computes each
segment's own end state from zero in parallel, and every program of the second enters its
segment with the initial state carried through the segments before it (a few multiply-adds of
[value block, n] tiles; WKV7 also carries each segment's n x n transition), then walks its
chunks as above.

The GPU lowering is Pallas' Triton backend (explicit `CompilerParams`), the one of jax 0.10-0.11
that lowers `BlockSpec` kernels with dots, reductions and `fori_loop` on any NVIDIA GPU and runs
the same kernel body in interpret mode on CPU. (Mosaic GPU, jax's default GPU lowering, wants
kernels written for Hopper's warpgroups through `plgpu.kernel`; see docs/kernels.md.)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxembed.ops.common import StateSlot

F32 = jnp.float32
MIN_DOT = 16  # Triton's smallest dot operand dimension


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of one kernel launch.

    chunk:       tokens per chunk L (the intra-chunk matrices are [L, L]); any L gives the same
                 result up to rounding, so this is free of the model's chunk_size Q.
    value_block: value columns per program; programs split the value dim (SSD's p, WKV7's p,
                 mLSTM's v), whose columns evolve independently.
    num_warps, num_stages: Triton's warps per program and software-pipelining depth.
    segments:    how many stretches of the sequence are walked by programs of their own (a power
                 of two; None: `sequence_segments` picks it from the grid). The kernels first
                 compute each segment's own end state in a parallel pass, then start every
                 segment from the combined state of those before it.
    parallel_outputs (mLSTM): the walk stores each chunk's entering state and a kernel parallel
                 over chunks computes the outputs from it.
    parallel_factors (WKV7): a kernel parallel over chunks computes each chunk's state-independent
                 factors (its triangular inverse and their products) and the walk reads them: two
                 products a chunk instead of the whole intra-chunk work.
    """

    chunk: int = 64
    value_block: int = 32
    num_warps: int = 4
    num_stages: int = 2
    segments: int | None = None
    parallel_outputs: bool = False
    parallel_factors: bool = False

    def __post_init__(self):
        for name in ("chunk", "value_block"):
            v = getattr(self, name)
            if not isinstance(v, int) or not _pow2(v) or not MIN_DOT <= v <= 256:
                raise ValueError(f"BlockSizes.{name} must be a power of two in [{MIN_DOT}, 256], got {v!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"BlockSizes.num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps!r}")
        if not isinstance(self.num_stages, int) or not 1 <= self.num_stages <= 6:
            raise ValueError(f"BlockSizes.num_stages must be an int in [1, 6], got {self.num_stages!r}")
        if self.segments is not None and (not isinstance(self.segments, int) or not _pow2(self.segments)
                                          or self.segments > MAX_SEGMENTS):
            raise ValueError(f"BlockSizes.segments must be None or a power of two in [1, {MAX_SEGMENTS}], "
                             f"got {self.segments!r}")
        for name in SPLITS.values():
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"BlockSizes.{name} must be a bool, got {getattr(self, name)!r}")


# Each kernel's optional split of its work over chunks, the `BlockSizes` field that asks for it.
SPLITS = {"mlstm": "parallel_outputs", "wkv7": "parallel_factors"}

# Per kernel: (chunk L, largest value block, warps[, its split (SPLITS)]), from `benchmarks/kernels.py
# --only sweep` on an H100 (docs/benchmarks.md). WKV7 takes 16-token chunks: the fastest in that sweep
# and the one tile that does not spill (1.2-1.9 KB a thread at L = 32 and 64, which its numerics would
# allow up to ops.wkv7.MAX_CHUNK; benchmarks/kernel_registers.py, session 21). SSD and mLSTM take
# mamba_ssm's 64-token tile.
_TILES = {"ssd": (64, 64, 4), "wkv7": (16, 32, 4), "mlstm": (64, 64, 8)}


def heuristic(kernel: str, *, key_dim: int, value_dim: int) -> BlockSizes:
    """The one rule: the kernel's tile, with a value block small enough that the carried state
    [key, value block] stays within 8K float32 values per program (registers, not spills)."""
    if kernel not in _TILES:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {sorted(_TILES)}")
    chunk, largest, warps, *split = _TILES[kernel]  # a 4th entry: the kernel's split (SPLITS)
    vb = min(padded(value_dim), largest, max(MIN_DOT, 8192 // padded(key_dim)))
    blocks = BlockSizes(chunk=chunk, value_block=vb, num_warps=warps, num_stages=2)
    return dataclasses.replace(blocks, **{SPLITS[kernel]: True}) if split and split[0] else blocks


# A program walks its chunks one after another, and each chunk's loads, dots and state update wait
# on the one before: at batch 1 the grid (b x h x value blocks: 128 programs for Codestral's SSD) is
# about one program per SM of an H100, latency-bound (docs/benchmarks.md). Splitting the sequence
# into segments multiplies the programs, but only programs resident at once can hide each other's
# latency: these kernels hold 220-255 registers a thread (ptxas, benchmarks/kernel_registers.py), so
# an SM's 65,536 registers hold 8 warps, two 4-warp programs or one 8-warp program. Programs past
# that run in a second wave and shorten nothing, while every segment past the first adds its share
# of the segment-state pass (for WKV7, n transition rows besides the value rows). So the grid is
# filled to one wave of resident programs and no further. A segment keeps at least
# MIN_SEGMENT_CHUNKS chunks so the extra pass and the padding stay small.
SMS = 132  # H100 and H200
RESIDENT_WARPS_PER_SM = 8
MIN_SEGMENT_CHUNKS = 4
MAX_SEGMENTS = 64


def resident_programs(num_warps: int) -> int:
    """Programs of `num_warps` warps an H100 or H200 holds at once at ~255 registers a thread."""
    return SMS * max(1, RESIDENT_WARPS_PER_SM // num_warps)


def sequence_segments(blocks: BlockSizes, *, programs: int, n_chunks: int) -> int:
    """How many segments the sequence is split into: `blocks.segments` when set, else the most (a
    power of two) that keep the grid within one wave of resident programs (`resident_programs`),
    each keeping >= MIN_SEGMENT_CHUNKS."""
    if blocks.segments is not None:
        return blocks.segments
    slots = resident_programs(blocks.num_warps)
    segments = 1
    while (programs * segments * 2 <= slots and segments < MAX_SEGMENTS
           and n_chunks >= 2 * segments * MIN_SEGMENT_CHUNKS):
        segments *= 2
    return segments


def segment_layout(blocks: BlockSizes, *, programs: int, t: int) -> tuple[int, int, int]:
    """(segments, chunks per segment, padded length T): t tokens padded to whole segments of whole
    chunks of blocks.chunk."""
    n_chunks = -(-t // blocks.chunk)
    segments = sequence_segments(blocks, programs=programs, n_chunks=n_chunks)
    chunks = -(-n_chunks // segments)
    return segments, chunks, segments * chunks * blocks.chunk


def padded(d: int) -> int:
    """Triton tiles are powers of two of at least 16: the size a feature dim is zero-padded to."""
    return max(MIN_DOT, 1 << (d - 1).bit_length())


def pad_axis(a, axis: int, size: int, value=0.0):
    """Pad `axis` of a at the end up to `size`."""
    extra = size - a.shape[axis]
    if extra == 0:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, extra)
    return jnp.pad(a, widths, constant_values=value)


def check_blocks(blocks: BlockSizes, value_dim: int, *, kernel: str) -> BlockSizes:
    if not isinstance(blocks, BlockSizes):
        raise TypeError(f"blocks must be a jaxembed.kernels.BlockSizes, got {type(blocks).__name__}")
    for owner, name in SPLITS.items():
        if getattr(blocks, name) and kernel != owner:
            raise ValueError(f"BlockSizes.{name} is an option of the {owner} kernel; the {kernel} kernel has no such "
                             "split")
    return dataclasses.replace(blocks, value_block=min(blocks.value_block, padded(value_dim)))


def call(kernel, *, grid, in_specs, out_specs, out_shape, blocks: BlockSizes, interpret: bool, name: str,
         input_output_aliases=None):
    """`pl.pallas_call` with the Triton lowering on GPU, or the interpreter."""
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as pl_triton

        params = pl_triton.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)
    return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                          interpret=interpret, compiler_params=params, name=name,
                          input_output_aliases=input_output_aliases or {})


def addressable_slot(state, *, segments: int, padded: bool) -> bool:
    """Whether a kernel reads and writes a `StateSlot` state in place in its stack: one sequence
    segment (the segment kernels keep per-segment states of their own), no padded state dim and a
    float32 stack. Otherwise the slot is read before the kernel and written back after it."""
    return isinstance(state, StateSlot) and segments == 1 and not padded and state.stacked.dtype == F32


def slot_inputs(slot: StateSlot):
    """An in-place state's kernel inputs, the stack and the layer index, and their specs: both
    whole, indexed by the kernel itself (`state_tile`). The kernel's final-state result is the
    stack again, aliased to the first."""
    return [slot.stacked, slot.layer.astype(jnp.int32)[None]], [pl.BlockSpec(), pl.BlockSpec()]


def state_tile(layer_ref, block: int, *, axis: int):
    """Where this program's state tile is in its state refs: the whole block (`...`) when
    layer_ref is None, else (an in-place `StateSlot`: the refs hold every layer's state
    [n_layers, b, h, d, d']) layer `layer_ref[0]`'s entry for batch row `program_id(0)`, head
    `program_id(1)`, and the `program_id(2)`-th block of `block` columns along state axis `axis`
    (2: d, 3: d')."""
    if layer_ref is None:
        return ...
    index = [layer_ref[0], pl.program_id(0), pl.program_id(1), slice(None), slice(None)]
    index[1 + axis] = pl.ds(pl.program_id(2) * block, block)
    return tuple(index)


def at_sequence_end(segments: int, store) -> None:
    """store() in the program of the sequence's last segment (grid axis 3) only: the final state
    is that segment's end state. The other segments' end states are never written, so the final
    state's output has no segment axis."""
    if segments > 1:
        pl.when(pl.program_id(3) == segments - 1)(store)
    else:
        store()


def with_reference_vjp(forward, reference, backward=None):
    """forward(*arrays) computed by the kernel, differentiated as `jax.vjp(reference)`.

    The backward recomputes the reference's forward from the saved inputs (no activations are
    kept), then runs XLA's reverse pass of it: exact gradients of the same function.
    `backward(args, cotangent)`, when given, computes the cotangents itself (a backward kernel),
    or returns None for inputs it does not take, which the reference then differentiates.
    """

    @jax.custom_vjp
    def f(*args):
        return forward(*args)

    def fwd(*args):
        return forward(*args), args

    def bwd(args, cotangent):
        grads = None if backward is None else backward(args, cotangent)
        if grads is None:
            _, vjp = jax.vjp(reference, *args)
            grads = vjp(cotangent)
        return grads

    f.defvjp(fwd, bwd)
    return f


def cached(fn):
    """lru_cache for the per-static-arguments builders (keeps one custom_vjp per configuration)."""
    return functools.lru_cache(maxsize=None)(fn)


def causal_masks(L: int):
    """(rows >= cols, rows > cols), [L, L] booleans built from iotas inside a kernel."""
    rows = jax.lax.broadcasted_iota(jnp.int32, (L, L), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (L, L), 1)
    return rows >= cols, rows > cols


_FULL_F32 = {"highest", "float32", "F32_F32_F32"}


def dot(a, b, *, trans_a: bool = False, trans_b: bool = False):
    """2-D matmul with float32 accumulation; trans_* contract over the operand's first/last dim.

    float32 operands follow jax's default_matmul_precision like XLA's own dots: TF32 on the
    tensor cores by default, exact float32 under `jax.default_matmul_precision("highest")`.
    """
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    precision = None
    if a.dtype == F32 and b.dtype == F32 and str(jax.config.jax_default_matmul_precision) in _FULL_F32:
        precision = jax.lax.Precision.HIGHEST
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=F32)
