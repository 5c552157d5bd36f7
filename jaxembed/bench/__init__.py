"""`jaxembed bench NAME`: the paper's inference experiments (Section 4.2, Appendix F) as named sweeps.

    chunk-size            runtime and memory versus length for intra-layer chunk sizes Q,
                          horizontal inference, batch 1 and 128 (the paper's chunk-size figure)
    vertical-chunk-size   vertical chunk sizes V at Q = 256, and horizontal, batch 1 and 32
    model-comparison      Mamba2, RWKV7 and xLSTM (vertical, the paper's V per batch) against
                          Mistral v0.1 (sliding window 4096) and v0.3 (full attention), batch 1 and 32

Specs live in `configs/bench/<name>.yaml`: the real 7B shapes on a GPU, proportionally
scaled-down shapes on a CPU. Each point runs in a fresh process, repeated (three times by
default) and reported as mean, min and max. Memory is the device allocator's peak on a GPU and
the fresh process's peak RSS on a CPU. Output: `results.csv`, `<name>.png` (the paper's layout)
and `README.md` (tables and the machine) in the output folder.
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

from jaxembed.bench.sweep import SpecError, available, load_sweep, run_sweep
from jaxembed.files import write_text_atomically

__all__ = ["SpecError", "available", "cmd_bench", "load_sweep", "run_sweep"]


def cmd_bench(args) -> int:
    from jaxembed.bench import plot
    from jaxembed.bench import sweep as sweeps

    if args.list:
        for name in available():
            s = load_sweep(name, "cpu")
            print(f"{name}: {s.title}")
        return 0
    if not args.sweep:
        raise SpecError("name a sweep (" + ", ".join(available()) + ") or a spec .yaml; --list shows them")
    _check_options(args)
    try:  # the figure is drawn after every point ran: a missing plotting library is named before
        import matplotlib  # noqa: F401
    except ImportError:
        raise SpecError("jaxembed bench draws its figure with matplotlib: pip install 'jaxembed[bench]'") from None
    found = sweeps.detect_platform()
    platform = args.platform if args.platform != "auto" else found
    sweep = _narrow(load_sweep(args.sweep, platform), args)
    if platform == "gpu" and found != "gpu":  # the spec is checked; its points could not run
        raise SpecError("--platform gpu: jax sees no GPU here (its backend is cpu); run it on a GPU machine")
    out_dir = Path(args.output or f"bench-results/{sweep.name}-{platform}")
    _clear_earlier_run(out_dir, sweep.name, overwrite=getattr(args, "overwrite", False))
    n_points = sum(len(v) for v in sweep.lengths.values()) * len(sweep.series)
    print(f"# {sweep.name} on {platform}: {len(sweep.series)} series x {n_points // len(sweep.series)} "
          f"(batch, length) points, {args.repeats or sweep.repeats} timed calls each, {sweep.dtype}; "
          f"each point in a fresh process (timeout {args.timeout:.0f} s) -> {out_dir}", flush=True)
    log = (lambda *_: None) if args.quiet else (lambda line: print(line, flush=True))
    rows = run_sweep(sweep, out_dir, repeats=args.repeats, timeout=args.timeout,
                     memory_limit_mib=args.memory_limit_mib, threads=args.threads, log=log)
    machine = sweeps.machine_line(rows, platform)
    date = datetime.date.today().isoformat()
    tables = sweeps.markdown_tables(rows, sweep)
    png = plot.figure(rows, sweep, out_dir / f"{sweep.name}.png", subtitle=f"{machine}, {sweep.dtype}, {date}")
    setup = (f"Machine: {machine}. Spec: `{sweep.path.name}`, dtype {sweep.dtype}, {args.repeats or sweep.repeats} "
             "timed calls per point after a compiling one, each point in a fresh process.")
    summary = [f"# {sweep.title}", "", f"`jaxembed bench {args.sweep}` on {platform}, {date}.", "", setup, "",
               f"![{sweep.name}]({png.name})", "", tables]
    flat = []
    for s in sweep.series:
        for batch in sweep.lengths:
            V = s.vertical_for(batch)
            ratio = sweeps.flatness(rows, s.label, batch, beyond=V or 0)
            if ratio is not None:
                where = f"beyond V={V}" if V else "over all lengths"
                flat.append(f"| {s.label} | {batch} | {where} | {ratio:.3f} |")
    if flat:
        summary += ["**peak memory, max/min across lengths**", "", "| series | batch | lengths | max/min |",
                    "|---|---|---|---|", *flat, ""]
    write_text_atomically(out_dir / "README.md", "\n".join(summary))
    print("\n" + tables)
    if flat:
        print("peak memory max/min across lengths:\n" + "\n".join(flat))
    print(f"\nwrote {out_dir / 'results.csv'}, {png}, {out_dir / 'README.md'}")
    failed = sum(r["status"] == "failed" for r in rows)  # an error, not a measured out-of-memory or timeout
    if failed:
        print(f"{failed} of {len(rows)} points failed with an error (the status and error columns)", file=sys.stderr)
        return 1
    if not any(r["status"] == "ok" for r in rows):
        print(f"none of the {len(rows)} points ran to the end (out of memory, timeout or skipped): nothing was "
              "measured", file=sys.stderr)
        return 1
    return 0


def _clear_earlier_run(out_dir: Path, name: str, *, overwrite: bool) -> None:
    """An earlier run's files in the output folder are replaced only on request, and then all of them at once:
    results.csv is written as the points run and README.md and the figure at the end, so a rerun cut short
    would otherwise leave a new CSV beside the old tables (and a narrowed rerun would replace a full CSV)."""
    earlier = [out_dir / f for f in ("results.csv", "README.md", f"{name}.png") if (out_dir / f).exists()]
    if earlier and not overwrite:
        raise SpecError(f"{out_dir} holds an earlier run ({', '.join(p.name for p in earlier)}); pass --overwrite "
                        "to replace it, or --output DIR")
    for path in earlier:
        path.unlink()

def _check_options(args) -> None:
    """The run's options, before any point runs: each one that cannot make a measurement is named."""
    for name, value, least in (("--repeats", args.repeats, 1), ("--threads", args.threads, 1)):
        if value is not None and value < least:
            raise SpecError(f"{name} must be at least {least}, got {value}")
    for name, value in (("--timeout", args.timeout), ("--memory-limit-mib", args.memory_limit_mib)):
        if value is not None and not value > 0:
            raise SpecError(f"{name} must be positive, got {value:g}")


def _narrow(sweep, args):
    """--batch, --lengths and --series restrict the spec (for quick checks)."""
    import dataclasses

    from jaxembed.bench.measure import parse_int_list

    lengths = sweep.lengths
    if args.batch:
        wanted = parse_int_list(args.batch)
        unknown = [b for b in wanted if b not in lengths]
        if unknown:
            raise SpecError(f"--batch {unknown} not in the spec's batch sizes {sorted(lengths)}")
        lengths = {b: lengths[b] for b in wanted}
    if args.lengths:
        chosen = parse_int_list(args.lengths)
        if not chosen or min(chosen) < 1:
            raise SpecError(f"--lengths {args.lengths!r}: every length must be a positive number of tokens")
        lengths = {b: chosen for b in lengths}
    series = sweep.series
    if args.series:
        names = split_labels(args.series, [s.label for s in series])
        series = tuple(s for s in series if s.label in names)
    return dataclasses.replace(sweep, lengths=lengths, series=series)


def split_labels(value: str, labels: list[str]) -> list[str]:
    """--series "A,B": the labels it names, comma-separated; a label may itself hold commas
    ("Mamba2 (Codestral, scaled)"), so pieces are joined back while they make no label."""
    names, current = [], None
    for piece in value.split(","):
        current = piece if current is None else f"{current},{piece}"
        if current.strip() in labels:
            names.append(current.strip())
            current = None
    if current is not None and current.strip():
        raise SpecError(f"--series {current.strip()!r} is not one of the spec's series {labels}")
    return names
