"""Speed and peak memory versus input length: jaxembed horizontal vs vertical, and the two peers.

Every (method, length) point runs in a fresh subprocess (this script with --worker), which
builds the model, calls it once (compiling), times --repeats calls, and reports its own peak
RSS from getrusage(RUSAGE_SELF).ru_maxrss. A fresh process per point means one point's
allocations never inflate another's peak. The parent enforces a per-point timeout and an RSS
limit; a point that fails, times out or runs out of memory is reported as such, and peer
points above --peer-max-length are reported as skipped.

Peak RSS includes the Python / jax (or torch) runtime, the weights and XLA's compilation, so
it does not go to zero with the length; what matters is how it grows. Vertical inference
should stay flat once T > V (the acceptance check: max/min peak RSS <= 1.10 over 8k..128k),
horizontal inference grows linearly in T.

    .venv/bin/python benchmarks/speed_memory.py                          # 8k..128k, all methods
    .venv/bin/python benchmarks/speed_memory.py --lengths 2048,4096 --repeats 1 --vertical 1024
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

from jaxembed.bench import measure
from jaxembed.bench.sweep import flatness

HERE = Path(__file__).resolve().parent
DEFAULT_CONFIG = common.CONFIGS / "bench-memory-4l-256.yaml"
FLATNESS_LIMIT = 1.10

CSV_FIELDS = ["method", "label", "vertical_chunk_size", "length", "batch", "status", "min_s", "mean_s", "times_s",
              "tokens_per_s", "peak_rss_mib", "baseline_rss_mib", "build_peak_rss_mib", "run_peak_rss_mib",
              "run_increase_rss_mib", "first_call_s", "build_s", "wall_s", "repeats", "threads", "config", "error"]


# ---- worker: one point, in a fresh process ----------------------------------------------------
def worker(args) -> int:
    env = common.pin_threads(args.threads)  # before jax / torch are imported
    result = {"env": env}
    build_peak = [0.0]  # ru_maxrss just before the VmHWM reset
    try:
        cfg = common.load_config(args.config)
        ids = common.random_ids(cfg.vocab_size, args.batch, args.length, args.seed)
        V = args.vertical_chunk_size or None
        t0 = time.perf_counter()
        run = common.build(args.method, cfg, ids, vertical_chunk_size=V, threads=env["threads"], seed=args.seed)
        result["build_s"] = time.perf_counter() - t0
        # resident now: runtime + weights + inputs, before anything ran on the inputs
        result["baseline_rss_mib"] = common.current_rss_mib()
        # Reset the kernel's high-water mark so that the run's own peak (compile + run) shows,
        # without the transient of building random weights. The reset also resets ru_maxrss,
        # so the peak so far is kept and the process peak is the max of both readings below.
        hwm_reset = False
        if not args.no_hwm_reset:
            build_peak[0] = result["build_peak_rss_mib"] = common.peak_rss_mib()
            hwm_reset = common.reset_peak_rss()
        timing = common.time_run(run, args.repeats, warmup=1)
        if hwm_reset:
            result["run_peak_rss_mib"] = common.hwm_rss_mib()
        result.update(status="ok", first_call_s=timing.first_s, times_s=timing.times_s, min_s=timing.min_s,
                      mean_s=timing.mean_s, tokens_per_s=args.batch * args.length / timing.min_s)
    except MemoryError as err:
        result.update(status="out of memory", error=f"MemoryError: {err}"[:300])
    except Exception as err:
        msg = f"{type(err).__name__}: {err}"
        status = "out of memory" if "RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower() else "failed"
        result.update(status=status, error=msg.splitlines()[0][:300])
    # ru_maxrss at the end (KiB on Linux), combined with the reading taken before the reset:
    # the process's lifetime peak, as ru_maxrss alone would report it without the reset
    result["peak_rss_mib"] = max(common.peak_rss_mib(), build_peak[0])
    measure.report(result)
    return 0 if result["status"] == "ok" else 1


# ---- parent --------------------------------------------------------------------------------------
def run_point(args, method: str, V: int | None, length: int) -> dict:
    """Run one point in a fresh process under the timeout and RSS limit; returns the result dict."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--method", method,
           "--length", str(length), "--vertical-chunk-size", str(V or 0), "--config", str(args.config),
           "--batch", str(args.batch), "--repeats", str(args.repeats), "--threads", str(args.threads),
           "--seed", str(args.seed)] + (["--no-hwm-reset"] if args.no_hwm_reset else [])
    return measure.run_fresh(cmd, timeout=args.timeout, memory_limit_mib=args.memory_limit_mib)


def method_label(method: str, V: int | None, tag: str = "") -> str:
    if method != "jaxembed":
        return method
    if V is None:
        return "jaxembed horizontal"
    return f"jaxembed vertical V={V}" + (f" ({tag})" if tag else "")


def as_sweep_rows(rows: list[dict], batch: int) -> list[dict]:
    """This script's rows in `jaxembed bench`'s schema, so its tables, flatness and figure are
    `jaxembed.bench`'s own (memory: the process peak RSS)."""
    out = []
    for r in rows:
        times = [float(t) for t in str(r.get("times_s") or "").split()]
        out.append({**r, "series": r["label"], "batch": batch, "memory_mib": r.get("peak_rss_mib"),
                    "memory_kind": "process peak RSS", "max_s": max(times) if times else r.get("min_s"),
                    "architecture": "mamba2" if r["label"].startswith("jaxembed") else "peer"})
    return out


def plot(rows: list[dict], labels: list[str], path: Path, title: str, batch: int) -> None:
    """`jaxembed.bench`'s figure (runtime with its min-max band above, peak RSS below)."""
    from types import SimpleNamespace

    from jaxembed.bench import plot as bench_plot

    lengths = sorted({int(r["length"]) for r in rows})
    sweep = SimpleNamespace(lengths={batch: lengths}, title=title,
                            series=[SimpleNamespace(label=label, vertical_for=lambda b: None) for label in labels])
    bench_plot.figure(as_sweep_rows(rows, batch), sweep, path)


def parent(args) -> int:
    env = common.pin_threads(args.threads)  # children inherit the affinity and re-apply it
    if args.memory_limit_mib is None:
        args.memory_limit_mib = measure.default_memory_limit_mib()
    from jaxembed.embedder import default_vertical_chunk_size  # imports jax, but runs nothing

    lengths = common.parse_int_list(args.lengths)
    cfg = common.load_config(args.config)
    chunk_size = cfg.chunk_size
    peers = common.peers_for(cfg)
    methods = [m.strip() for m in (args.methods or ",".join(("jaxembed", *peers))).split(",") if m.strip()]
    for m in methods:
        if m not in ("jaxembed", *peers):
            raise SystemExit(f"unknown method {m!r} for {cfg.architecture}; use jaxembed, {', '.join(peers)}")
    vertical: dict[int, str] = {}
    for part in (s.strip() for s in args.vertical.split(",")):
        if part in ("default", "auto"):
            vertical[default_vertical_chunk_size(args.batch, chunk_size)] = "default"
        elif part:
            vertical.setdefault(common.parse_int_list(part)[0], "")
    for V in vertical:
        if V % chunk_size:
            raise SystemExit(f"V={V} is not a multiple of Q={chunk_size}")

    variants = []  # (method, V, label)
    if "jaxembed" in methods:
        if not args.no_horizontal:
            variants.append(("jaxembed", None, method_label("jaxembed", None)))
        variants += [("jaxembed", V, method_label("jaxembed", V, tag)) for V, tag in vertical.items()]
    variants += [(m, None, common.PEER_LABELS[m]) for m in peers if m in methods]

    print(f"# speed_memory: {Path(args.config).name} ({cfg.architecture})  batch={args.batch}"
          f"  lengths={','.join(map(common.fmt_len, lengths))}  repeats={args.repeats}  fp32")
    print(f"# CPU: {common.cpu_model()}  threads={env['threads']} (cpus {env['cpus']})  XLA_FLAGS={env['XLA_FLAGS']!r}"
          f"  load avg {os.getloadavg()[0]:.2f}")
    limit = f"{args.memory_limit_mib:.0f} MiB" if args.memory_limit_mib else "none"
    print(f"# per point: fresh process, timeout {args.timeout:.0f} s, RSS limit {limit}; "
          f"peers up to {common.fmt_len(args.peer_max_length)} tokens")

    csv_path = Path(args.csv)
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for length in lengths:
            for method, V, label in variants:
                row = {"method": method, "label": label, "vertical_chunk_size": V or "", "length": length,
                       "batch": args.batch, "repeats": args.repeats, "threads": env["threads"],
                       "config": Path(args.config).name}
                if method in common.PEERS and length > args.peer_max_length:
                    row.update(status="skipped", error=f"length > --peer-max-length {args.peer_max_length}")
                else:
                    res = run_point(args, method, V, length)
                    row.update(status=res.get("status", "failed"), error=res.get("error", ""))
                    for key in ("min_s", "mean_s", "tokens_per_s", "peak_rss_mib", "baseline_rss_mib",
                                "build_peak_rss_mib", "run_peak_rss_mib", "first_call_s", "build_s", "wall_s"):
                        if key in res:
                            row[key] = round(float(res[key]), 4)
                    if "times_s" in res:
                        row["times_s"] = " ".join(f"{t:.4f}" for t in res["times_s"])
                    if row["status"] == "ok" and "run_peak_rss_mib" in row:
                        row["run_increase_rss_mib"] = round(row["run_peak_rss_mib"] - row["baseline_rss_mib"], 1)
                rows.append(row)
                writer.writerow(row)
                f.flush()
                if row["status"] == "ok":
                    print(f"  {common.fmt_len(length):>6}  {label:<34} {row['tokens_per_s']:>10.0f} tok/s  "
                          f"peak RSS {row['peak_rss_mib']:8.0f} MiB  (min {row['min_s']:.3f} s, "
                          f"wall {row['wall_s']:.0f} s)", flush=True)
                else:
                    print(f"  {common.fmt_len(length):>6}  {label:<34} {row['status'].upper()}: {row['error']}",
                          flush=True)

    # ---- tables --------------------------------------------------------------------------------
    labels = [v[2] for v in variants]
    by = {(r["label"], r["length"]): r for r in rows}

    def cell(r, key, fmt):
        if r is None:
            return "-"
        if r["status"] != "ok":
            return {"skipped": "skip", "timeout": "TIMEOUT", "out of memory": "OOM"}.get(r["status"], "FAIL")
        return "-" if r.get(key) in (None, "") else fmt.format(r[key])

    header = ["method"] + [common.fmt_len(n) for n in lengths]
    print("\ntokens/s (from the min of the repeats)")
    print(measure.text_table(header, [[lab] + [cell(by.get((lab, n)), "tokens_per_s", "{:.0f}") for n in lengths]
                                for lab in labels]))
    print("\npeak RSS of the fresh process (MiB)")
    print(measure.text_table(header, [[lab] + [cell(by.get((lab, n)), "peak_rss_mib", "{:.0f}") for n in lengths]
                                for lab in labels]))
    if any("run_increase_rss_mib" in r for r in rows):
        print("\npeak RSS while compiling and running, minus the RSS just before (MiB): activations, "
              "compilation, workspace")
        print(measure.text_table(header, [[lab] + [cell(by.get((lab, n)), "run_increase_rss_mib", "{:.0f}")
                                             for n in lengths] for lab in labels]))
    failed = [r for r in rows if r["status"] not in ("ok", "skipped")]
    if failed:
        print("\nnot measured:")
        for r in failed:
            print(f"  {r['label']} at {common.fmt_len(r['length'])}: {r['status']} - {r['error']}")

    # ---- flatness of vertical memory -------------------------------------------------------------
    print(f"\nmax/min across lengths (vertical should be flat, <= {FLATNESS_LIMIT:.2f}, once T > V; "
          "horizontal grows)")
    print("  process peak RSS (ru_maxrss) | run-phase peak RSS (VmHWM reset after building the model)")
    swept = as_sweep_rows(rows, args.batch)
    for method, V, label in variants:
        ratio = flatness(swept, label, args.batch, beyond=V or 0)
        ratio_run = flatness(swept, label, args.batch, beyond=V or 0, key="run_peak_rss_mib")
        if ratio is None:
            print(f"  {label}: fewer than 2 successful points" + (f" with T > V={V}" if V else ""))
            continue
        measured = [int(r["length"]) for r in rows if r["label"] == label and r["status"] == "ok"
                    and int(r["length"]) > (V or 0)]
        lo, hi = min(measured), max(measured)
        verdict = ""
        if method == "jaxembed" and V is not None:
            verdict = "  PASS (flat)" if ratio <= FLATNESS_LIMIT else "  FAIL (not flat)"
        run_part = f" | {ratio_run:.3f}" if ratio_run else ""
        print(f"  {label}: {ratio:.3f}{run_part} over {common.fmt_len(lo)}..{common.fmt_len(hi)}{verdict}")

    print(f"\nwrote {csv_path}")
    if not args.no_plot:
        title = (f"{Path(args.config).stem}, batch {args.batch}, fp32, {env['threads']} threads "
                 f"({common.cpu_model()})")
        plot(rows, labels, Path(args.png), title, args.batch)
        print(f"wrote {args.png}")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(DEFAULT_CONFIG), help="model config YAML (default: %(default)s)")
    ap.add_argument("--lengths", default="8k,16k,32k,64k,128k", help="comma list of input lengths (k = 1024)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per point after the compiling one")
    ap.add_argument("--vertical", default="default,2048",
                    help="vertical chunk sizes V for jaxembed ('default' = jaxembed's policy for the batch size)")
    ap.add_argument("--no-horizontal", action="store_true", help="skip jaxembed horizontal")
    ap.add_argument("--methods", default=None,
                    help="comma list of jaxembed and the architecture's peers "
                         "(default: all; mamba2: mamba2-jax, torch; rwkv7: rwkv; xlstm: torch)")
    ap.add_argument("--peer-max-length", type=lambda s: common.parse_int_list(s)[0], default=128 * 1024,
                    help="longest input the peers are run at; longer points are reported as skipped (default 128k)")
    ap.add_argument("--timeout", type=float, default=600.0, help="per-point wall-clock limit in seconds")
    ap.add_argument("--memory-limit-mib", type=float, default=None,
                    help="kill a point whose RSS exceeds this (0: no limit; default: 60%% of the memory available "
                         "at the start, at most 16384)")
    ap.add_argument("--threads", type=int, default=2, help="CPUs for every method (affinity, torch and BLAS threads)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--csv", default=None, help="output CSV (default: results/speed_memory.csv for the default config, "
                                                "else results/speed_memory_<config name>.csv)")
    ap.add_argument("--png", default=None, help="output plot (default: like --csv, .png)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--no-hwm-reset", action="store_true",
                    help="do not reset VmHWM after the build (no run-phase peak; ru_maxrss read once at the end)")
    # worker mode (one point); used by the parent
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--method", help=argparse.SUPPRESS)
    ap.add_argument("--length", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--vertical-chunk-size", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not args.worker:
        default = Path(args.config).resolve() == DEFAULT_CONFIG.resolve()
        stem = "" if default else "_" + Path(args.config).stem
        args.csv = args.csv or str(HERE / "results" / f"speed_memory{stem}.csv")
        args.png = args.png or str(HERE / "results" / f"speed_memory{stem}.png")
    if args.worker:
        measure.die_with_parent()
        return worker(args)
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
