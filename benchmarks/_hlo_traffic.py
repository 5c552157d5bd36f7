"""HBM traffic of a compiled XLA GPU program, read from its optimised HLO text (no jax needed).

Every launch outside the free ops (parameters, tuples, bitcasts, the loops themselves) is one
kernel: it reads its operands and writes its result. Its bytes are counted once per run of the
computation it sits in, that is times the known trip counts of the while loops around it, and
summed by kind: gemm (cuBLAS or a Triton GEMM fusion), kernel (a Pallas kernel), copy (a weight
slice copied out of the stacked layers: an XLA dynamic_slice_fusion of a slice alone, or an async
fusion-start of one) and glue (every other fusion). From jax 0.11 XLA folds the slice into the cuBLAS call itself (a
dynamic_slice_fusion holding the GEMM, which reads the layer's weights in place): a gemm.
Three refinements keep it from counting what is not moved: a fused parameter that is read only
through slices or gathers counts as what they return (overlapping static slices once), a
dynamic-update-slice result writes its update in place, and a Pallas kernel's operand aliased to
its result is a stack of per-layer states of which it reads and writes one layer's entry.
"""

from __future__ import annotations

import dataclasses
import re

ITEMSIZE = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1, "f64": 8, "s64": 8}
SHAPE = re.compile(r"\b(" + "|".join(ITEMSIZE) + r")\[([\d,]*)\]")
INSTRUCTION = re.compile(r"^(?:ROOT )?%(\S+) = (.*?) ([a-z][a-z\-]*)\((.*?)\)(, .*)?$")
FREE_OPS = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while", "conditional",
            "partition-id", "replica-id", "after-all", "fusion-done"}  # an async fusion is counted at its start
SLICING_OPS = {"slice", "dynamic-slice", "gather"}  # read only what they return from their first operand


def shape_bytes(text: str) -> int:
    total = 0
    for dtype, dims in SHAPE.findall(text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * ITEMSIZE[dtype]
    return total


@dataclasses.dataclass
class Instruction:
    name: str
    shape: str
    op: str
    args: str  # the text between the op's parentheses
    attrs: str

    @property
    def operands(self) -> list[str]:
        return re.findall(r"%([\w.\-]+)", self.args)


def computations(hlo: str) -> dict[str, list[Instruction]]:
    """Optimised HLO text -> {computation name: its instructions}."""
    out, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%(\S+) \(", line)
        if head and line.rstrip().endswith("{"):
            name = head.group(1)
            out[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None:
            m = INSTRUCTION.match(line.strip())
            if m:
                out[name].append(Instruction(*m.groups()[:4], m.group(5) or ""))
    return out


def trip_multipliers(hlo: str, comps: dict) -> dict[str, int]:
    """{computation: how many times it runs per call} for ENTRY and every while body."""
    entry = re.search(r"^ENTRY %(\S+) ", hlo, re.M).group(1)
    mult, todo = {entry: 1}, [entry]
    while todo:
        comp = todo.pop()
        for ins in comps[comp]:
            if ins.op != "while":
                continue
            body = re.search(r"body=%([\w.\-]+)", ins.attrs).group(1)
            trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
            if trips is None:
                raise RuntimeError(f"while loop {ins.name} has no known trip count")
            mult[body] = mult[comp] * int(trips.group(1))
            todo.append(body)
    return mult


PASS_THROUGH = {"bitcast", "convert", "reshape", "copy", "transpose"}


def elements(shape: str) -> int:
    n = 1
    for d in filter(None, (SHAPE.search(shape) or [None, ""])[2].split(",")):
        n *= int(d)
    return n


def _static_window(ins: Instruction) -> list[tuple[int, int]] | None:
    """A unit-stride static slice's [start, end) per dimension; None for any other slice."""
    m = re.search(r"slice=\{(.*?)\}", ins.attrs)
    if ins.op != "slice" or m is None:
        return None
    window = []
    for dim in re.findall(r"\[([^\]]*)\]", m.group(1)):
        parts = [int(v) for v in dim.split(":")]
        if len(parts) == 3 and parts[2] != 1:
            return None
        window.append((parts[0], parts[1]))
    return window


def _param_slices(name: str, users: dict) -> list | None:
    """The slices a fused parameter is read through, when every path from it reaches one through
    element-wise re-typing/re-shaping ops only: [(elements, static window or None)]; None when
    some path uses it whole."""
    found = []
    for u in users.get(name, []):
        if u.op in SLICING_OPS and u.operands[0] == name:
            found.append((elements(u.shape), _static_window(u)))
        elif u.op in PASS_THROUGH:
            if not users.get(u.name):  # the fusion's result: the parameter is used whole
                return None
            sub = _param_slices(u.name, users)
            if sub is None:
                return None
            found += sub
        else:
            return None
    return found


def _union_elements(windows: list[list[tuple[int, int]]]) -> int:
    """Elements in the union of boxes (same rank), by cutting every axis at every box edge."""
    cuts = [sorted({v for w in windows for v in w[d]}) for d in range(len(windows[0]))]

    def count(d: int, boxes) -> int:
        if d == len(cuts):
            return 1 if boxes else 0
        total = 0
        for lo, hi in zip(cuts[d][:-1], cuts[d][1:], strict=True):
            inside = [w for w in boxes if w[d][0] <= lo and hi <= w[d][1]]
            if inside:
                total += (hi - lo) * count(d + 1, inside)
        return total

    return count(0, windows)


def _param_read(name: str, itemsize: int, users: dict) -> int | None:
    """Bytes a fused parameter is read by when it is read only through slices (`_param_slices`),
    at the parameter's width. Overlapping static windows (a conv's taps, each the input shifted by
    a token) count once: the kernel fetches those bytes once and its caches serve the overlap."""
    found = _param_slices(name, users)
    if found is None:
        return None
    windows = [w for _, w in found if w is not None]
    total = sum(n for n, w in found if w is None)
    if windows and all(len(w) == len(windows[0]) for w in windows):
        total += _union_elements(windows)
    else:
        total += sum(n for n, w in found if w is not None)
    return total * itemsize


def launch_bytes(ins: Instruction, shapes: dict, comps: dict) -> int:
    """HBM bytes a launch reads and writes. A fused parameter read through slices only (a layer's
    weights out of the stacked array, z out of the in_proj output) counts as its slices; a
    dynamic-update-slice root writes its update in place and does not read the buffer it updates."""
    fused = re.search(r"calls=%([\w.\-]+)", ins.attrs) if ins.op in ("fusion", "fusion-start") else None
    body = comps.get(fused.group(1), []) if fused else []
    by_name = {i.name: i for i in body}
    users: dict[str, list] = {}
    for i in body:
        for o in set(i.operands):
            users.setdefault(o, []).append(i)
    root = body[-1] if body else None
    roots = [by_name[o] for o in root.operands] if root is not None and root.op == "tuple" else [root]
    updated, written = set(), 0
    for r in roots:
        if r is not None and _is_cublas(r):  # its second result is the workspace, scratch rather than traffic
            written += shape_bytes(SHAPE.search(r.shape).group(0))
        elif r is not None and r.op == "dynamic-update-slice":
            written += shape_bytes(by_name[r.operands[1]].shape) if r.operands[1] in by_name else 0
            updated.add(r.operands[0])
        elif r is not None:
            written += shape_bytes(r.shape)
    if root is None:
        # a cuBLAS call's second result is its workspace, scratch rather than traffic
        written = shape_bytes(SHAPE.search(ins.shape).group(0) if kind(ins) == "gemm" else ins.shape)
    in_place = _entry_updates(ins, shapes)
    for out, _ in in_place.items():
        written -= _entry_share(SHAPE.findall(ins.shape)[out])
    params = {int(i.args): i.name for i in body if i.op == "parameter"}
    read = 0
    for k, operand in enumerate(ins.operands):
        full = shape_bytes(shapes.get(operand, ""))
        if k in in_place.values():
            full -= _entry_share(SHAPE.search(shapes.get(operand, "")).groups())
        pname = params.get(k)
        if pname is None:
            read += full
            continue
        if pname in updated:
            continue
        sliced = _param_read(pname, ITEMSIZE[SHAPE.search(by_name[pname].shape).group(1)], users)
        read += full if sliced is None else min(full, sliced)
    return read + written


def _entry_updates(ins: Instruction, shapes: dict) -> dict[int, int]:
    """{result index: operand index} of a Pallas kernel's results aliased to an operand that is the
    stack of every layer's states, which the kernel updates one entry of (`StateSlot`: the kernel
    also takes the layer's index, an s32[1]). Any other alias (a norm written over its input,
    `normed_in_place`) reads and writes the whole buffer."""
    if kind(ins) != "kernel" or not any(shapes.get(o, "").startswith("s32[1]") for o in ins.operands):
        return {}
    _, key, aliases = ins.attrs.partition("output_to_operand_aliasing=")
    aliases = aliases[: aliases.find(")}") + 2] if key else ""  # {{1}: (7, {}), ...}
    return {int(out or 0): int(operand) for out, operand in re.findall(r"\{(\d*)\}: \((\d+), \{\}\)", aliases)}


def _entry_share(dtype_dims: tuple[str, str]) -> int:
    """Bytes of a stack [n_layers, ...] beyond the one entry that an in-place update moves."""
    dims = [int(d) for d in dtype_dims[1].split(",") if d]
    n = 1
    for d in dims:
        n *= d
    return (n - n // dims[0]) * ITEMSIZE[dtype_dims[0]] if dims else 0


def _called(ins: Instruction, comps: dict | None) -> list[Instruction]:
    """The body of the computation a fusion calls ([] when there is none)."""
    called = re.search(r"calls=%([\w.\-]+)", ins.attrs)
    return (comps or {}).get(called.group(1) if called else "", [])


def _copied(ins: Instruction, comps: dict) -> str:
    """The shape a copy writes: its result, or an async copy's slice (its start's result is a tuple
    of its operands, the slice and a token)."""
    return _called(ins, comps)[-1].shape if ins.op == "fusion-start" else ins.shape


def _is_cublas(ins: Instruction) -> bool:
    return ins.op == "custom-call" and "cublas" in ins.attrs.lower()


def kind(ins: Instruction, comps: dict | None = None) -> str:
    """gemm, kernel (a Pallas kernel), copy (a weight slice copied out of the stacked layers) or
    glue. `comps` (the program's computations) tells a dynamic_slice_fusion around a cuBLAS call
    (a GEMM reading its weights in place) from one that only copies the slice."""
    a = ins.attrs
    if ins.op == "custom-call":
        if "__gpu$xla.gpu.triton" in a:
            return "kernel"
        return "gemm" if _is_cublas(ins) else "glue"
    if ins.op == "fusion-start":  # an async fusion: jax 0.11 copies some weight slices this way
        body = _called(ins, comps)
        return "copy" if body and body[-1].op == "dynamic-slice" else "glue"
    if ins.op == "fusion":
        if '"__triton_gemm"' in a or "calls=%gemm_fusion" in a or "cublas" in a.lower():
            return "gemm"
        if '"dynamic_slice_fusion"' in a:
            return "gemm" if any(_is_cublas(i) for i in _called(ins, comps)) else "copy"
    return "glue"


def _dims(shape: str) -> list[int]:
    return [int(d) for d in SHAPE.search(shape).group(2).split(",") if d]


def gemm_flops(ins: Instruction, shapes: dict, comps: dict) -> int:
    """2 x output elements x contracted size of a GEMM launch: a cuBLAS call, a fusion around one,
    or a Triton GEMM fusion (its dot)."""
    if _is_cublas(ins) or ins.op == "dot":
        if ins.op == "dot":
            contracted = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs).group(1).split(",")
        else:
            contracted = re.findall(r'"(\d+)"', re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]',
                                                          ins.attrs).group(1))
        lhs = _dims(shapes[ins.operands[0]])
        k = 1
        for axis in filter(None, contracted):
            k *= lhs[int(axis)]
        return 2 * elements(SHAPE.search(ins.shape).group(0)) * k
    body = _called(ins, comps)
    inner = {i.name: i.shape for i in body}
    return sum(gemm_flops(i, inner, comps) for i in body if _is_cublas(i) or i.op == "dot")


def traffic(hlo: str) -> dict:
    """HBM bytes per call by kind, glue launches per call, GEMM FLOPs per call, each GEMM launch's
    (FLOPs, bytes, runs per call), and the glue ops by bytes."""
    comps = computations(hlo)
    out = {"gemm": 0, "kernel": 0, "copy": 0, "glue": 0, "glue_launches": 0, "gemm_flops": 0, "gemms": []}
    glue_ops = []
    for comp, times in trip_multipliers(hlo, comps).items():
        shapes = {i.name: i.shape for i in comps[comp]}
        for ins in comps[comp]:
            if ins.op in FREE_OPS:
                continue
            k = kind(ins, comps)
            moved = 2 * shape_bytes(_copied(ins, comps)) if k == "copy" else launch_bytes(ins, shapes, comps)
            out[k] += moved * times
            if k == "gemm":
                flops = gemm_flops(ins, shapes, comps)
                out["gemm_flops"] += flops * times
                out["gemms"].append((flops, moved, times))  # per launch, for a roofline
            if k == "glue":
                out["glue_launches"] += times
                glue_ops.append((moved * times, ins.name, times, ins.shape.split("{")[0][:56]))
    out["top_glue"] = sorted(glue_ops, reverse=True)
    return out


