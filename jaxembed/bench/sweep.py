"""Named sweeps: the paper's inference experiments (Section 4.2, Appendix F) as YAML specs.

A spec (`configs/bench/<name>.yaml`) holds, per platform, the dtype, the input lengths per batch
size, and the series (one line in the figures each):

    name: model-comparison
    title: ...
    repeats: 3
    platforms:
      cpu:                                   # proportionally scaled-down shapes
        dtype: float32
        lengths: {1: [512, 1k, ..., 32k], 32: [512, ..., 4k]}
        series:
          - label: Mamba2
            config: ../models/scaled-codestral-mamba-7b.yaml   # relative to the spec
            overrides: {n_layers: 8}         # optional dataclass fields
            chunk_size: 256                  # optional Q (default: the config's)
            vertical_chunk_size: {1: 4096, 32: 512}   # V per batch, one V, or null (horizontal)
      gpu: ...                               # the real 7B shapes

Every point runs in a fresh process (`jaxembed.bench.worker`) under a timeout and an RSS limit.
A point that runs out of memory or time is recorded as such, and the longer lengths of the same
series and batch are recorded as skipped (as the paper evaluates Mistral at batch 32 only up to
4096 tokens): nothing is silently left out.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from jaxembed.bench import measure
from jaxembed.errors import SpecError

SPEC_DIRS = (Path(__file__).resolve().parents[2] / "configs" / "bench",  # a checkout (editable install)
             Path("configs") / "bench")  # else the checkout the command runs in (the specs name its model configs)
PLATFORMS = ("cpu", "gpu")
CSV_FIELDS = ["sweep", "platform", "device", "series", "architecture", "config", "dtype", "batch", "length",
              "chunk_size", "vertical_chunk_size", "status", "mean_s", "min_s", "max_s", "times_s", "tokens_per_s",
              "memory_mib", "memory_kind", "peak_rss_mib", "run_peak_rss_mib", "peak_device_mib", "weights_mib",
              "first_call_s", "build_s", "wall_s", "repeats", "threads", "error"]


@dataclass(frozen=True)
class Series:
    label: str
    config: str  # absolute path
    overrides: dict
    chunk_size: int | None
    vertical_chunk_size: object  # None, an int, or {batch: V}

    def vertical_for(self, batch: int) -> int | None:
        v = self.vertical_chunk_size
        if isinstance(v, dict):
            if batch not in v:
                raise SpecError(f"series {self.label!r}: vertical_chunk_size has no entry for batch {batch} "
                                f"(has {sorted(v)})")
            return v[batch]
        return v


@dataclass(frozen=True)
class Sweep:
    name: str
    title: str
    path: Path
    platform: str
    dtype: str
    repeats: int
    lengths: dict  # batch -> [lengths]
    series: tuple


def spec_dir() -> Path | None:
    """Where the named sweeps are: the repository's configs/bench (beside the package, or in the working
    directory: a non-editable install has no configs of its own)."""
    return next((d for d in SPEC_DIRS if d.is_dir()), None)


def available() -> list[str]:
    directory = spec_dir()
    return [] if directory is None else sorted(p.stem for p in directory.glob("*.yaml"))


def spec_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise SpecError(f"sweep spec {path} does not exist")
        return path.resolve()
    directory = spec_dir()
    if directory is None:
        raise SpecError(f"no sweep named {name_or_path!r}: the named sweeps are the repository's configs/bench/*.yaml, "
                        "and there is none beside this installation or in the working directory; run from a "
                        "checkout, or pass a spec .yaml")
    path = directory / f"{name_or_path}.yaml"
    if not path.is_file():
        raise SpecError(f"no sweep named {name_or_path!r}; named sweeps: {', '.join(available())} "
                        f"(or pass a spec .yaml)")
    return path.resolve()


def load_sweep(name_or_path: str, platform: str) -> Sweep:
    path = spec_path(name_or_path)
    spec = yaml.safe_load(path.read_text())
    if not isinstance(spec, dict) or "platforms" not in spec:
        raise SpecError(f"{path}: a sweep spec needs a `platforms:` mapping")
    if platform not in spec["platforms"]:
        raise SpecError(f"{path}: no settings for platform {platform!r} (has {sorted(spec['platforms'])})")
    plat = spec["platforms"][platform]
    for key in ("dtype", "lengths", "series"):
        if key not in plat:
            raise SpecError(f"{path}: platforms.{platform} needs `{key}`")
    lengths = {}
    for batch, values in plat["lengths"].items():
        if not isinstance(batch, int) or batch < 1 or not isinstance(values, list) or not values:
            raise SpecError(f"{path}: lengths must map batch sizes to lists of lengths, got {batch!r}: {values!r}")
        try:
            lengths[batch] = sorted(measure.parse_length(v) for v in values)
        except ValueError as err:
            raise SpecError(f"{path}: {err}") from None
        if lengths[batch][0] < 1:
            raise SpecError(f"{path}: every length must be a positive number of tokens, got {values!r}")
    series = []
    for i, entry in enumerate(plat["series"]):
        missing = {"label", "config"} - set(entry)
        if missing:
            raise SpecError(f"{path}: platforms.{platform}.series[{i}] lacks {sorted(missing)}")
        config = (path.parent / entry["config"]).resolve()
        if not config.is_file():
            raise SpecError(f"{path}: series {entry['label']!r}: model config {config} does not exist")
        series.append(Series(entry["label"], str(config), dict(entry.get("overrides") or {}),
                             entry.get("chunk_size"), entry.get("vertical_chunk_size")))
    repeats = spec.get("repeats", 3)
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:  # each point would fail
        raise SpecError(f"{path}: repeats must be a positive int, got {repeats!r}")
    if plat["dtype"] not in ("float32", "bfloat16"):
        raise SpecError(f"{path}: platforms.{platform}.dtype must be float32 or bfloat16, got {plat['dtype']!r}")
    return Sweep(spec.get("name", path.stem), spec.get("title", path.stem), path, platform, plat["dtype"],
                 repeats, lengths, tuple(series))


def detect_platform() -> str:
    """Asked of a child process: a backend started here would hold device memory (jax takes 75% of a GPU
    up front) for the whole sweep, and every point's worker would run in what is left."""
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    out = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"], env=env,
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SpecError(f"jax could not start a backend here: {(out.stderr.strip().splitlines() or ['?'])[-1]}")
    return "gpu" if out.stdout.strip().splitlines()[-1] == "gpu" else "cpu"


def series_config(s: Series):
    """The model config of a series, overrides applied."""
    from jaxembed.bench.worker import load_point_config

    return load_point_config({"config": s.config, "overrides": s.overrides})


def check_points(sweep: Sweep) -> None:
    """Every series' config loads and every V is a multiple of Q, before anything runs."""
    from jaxembed.schedule import check_chunk_sizes

    for s in sweep.series:
        cfg = series_config(s)
        for batch in sweep.lengths:
            V = s.vertical_for(batch)
            try:
                check_chunk_sizes(V, s.chunk_size or cfg.chunk_size)
            except ValueError as err:
                raise SpecError(f"series {s.label!r}, batch {batch}: {err}") from None


def run_sweep(sweep: Sweep, out_dir: Path, *, repeats: int | None = None, timeout: float = 900.0,
              memory_limit_mib: float | None = None, threads: int | None = None, seed: int = 0,
              log=print) -> list[dict]:
    """Run every point in a fresh process; write `results.csv` as it goes; return the rows."""
    check_points(sweep)
    repeats = repeats or sweep.repeats
    if memory_limit_mib is None:
        memory_limit_mib = measure.default_memory_limit_mib(sweep.platform)
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path = out_dir / "results.csv"
    rows: list[dict] = []
    stopped: dict[tuple, str] = {}  # (label, batch) -> why longer lengths are skipped
    env = dict(os.environ)
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for batch, lengths in sweep.lengths.items():
            for length in lengths:
                for s in sweep.series:
                    cfg = series_config(s)
                    V = s.vertical_for(batch)
                    point = {"config": s.config, "overrides": s.overrides, "chunk_size": s.chunk_size,
                             "vertical_chunk_size": V, "batch": batch, "length": length, "dtype": sweep.dtype,
                             "repeats": repeats, "platform": sweep.platform, "threads": threads, "seed": seed}
                    row = {"sweep": sweep.name, "platform": sweep.platform, "series": s.label,
                           "architecture": cfg.architecture, "config": Path(s.config).name, "dtype": sweep.dtype,
                           "batch": batch, "length": length, "chunk_size": s.chunk_size or cfg.chunk_size,
                           "vertical_chunk_size": "" if V is None else V, "repeats": repeats}
                    if (s.label, batch) in stopped:
                        row.update(status="skipped", error=stopped[(s.label, batch)])
                    else:
                        cmd = [sys.executable, "-m", "jaxembed.bench.worker", json.dumps(point)]
                        res = measure.run_fresh(cmd, timeout=timeout, memory_limit_mib=memory_limit_mib, env=env)
                        row.update(_row_from_result(res, batch, length, sweep.platform))
                        if row["status"] in ("out of memory", "timeout"):
                            stopped[(s.label, batch)] = f"after {row['status']} at {measure.fmt_len(length)}"
                    rows.append(row)
                    writer.writerow(row)
                    f.flush()
                    log(_progress_line(row))
    return rows


def _row_from_result(res: dict, batch: int, length: int, platform: str) -> dict:
    row = {"status": res.get("status", "failed"), "error": res.get("error", ""), "device": res.get("device", ""),
           "threads": (res.get("env") or {}).get("threads") or ""}
    for key in ("mean_s", "min_s", "max_s", "first_call_s", "build_s", "wall_s", "peak_rss_mib", "run_peak_rss_mib",
                "peak_device_mib", "weights_mib"):
        if res.get(key) is not None:
            row[key] = round(float(res[key]), 5)
    if "times_s" in res:
        row["times_s"] = " ".join(f"{t:.5f}" for t in res["times_s"])
    if row["status"] == "ok":
        row["tokens_per_s"] = round(batch * length / res["mean_s"], 1)
    # memory_mib is a measurement only for a point that ran (a killed one's RSS stays in peak_rss_mib)
    if platform == "gpu":
        row["memory_kind"] = "device peak_bytes_in_use"
        if "peak_device_mib" in row and row["status"] == "ok":
            row["memory_mib"] = row["peak_device_mib"]
    else:
        row["memory_kind"] = "process peak RSS"
        if "peak_rss_mib" in row and row["status"] == "ok":
            row["memory_mib"] = row["peak_rss_mib"]
    return row


def _progress_line(row: dict) -> str:
    head = f"  b={row['batch']:<4} {measure.fmt_len(row['length']):>6}  {row['series']:<34}"
    if row["status"] != "ok":
        return f"{head} {row['status'].upper()}: {row['error']}"
    return (f"{head} {row['mean_s']:9.3f} s (min {row['min_s']:.3f}, max {row['max_s']:.3f})  "
            f"{row['memory_mib']:9.0f} MiB  (wall {row['wall_s']:.0f} s)")


# ---- tables ----------------------------------------------------------------------------------
def _cell(row: dict | None, kind: str) -> str:
    if row is None:
        return "-"
    if row["status"] != "ok":
        return {"skipped": "skip", "timeout": "timeout", "out of memory": "OOM"}.get(row["status"], "failed")
    if kind == "time":
        return f"{row['mean_s']:.3g} ({row['min_s']:.3g}–{row['max_s']:.3g})"
    return f"{row['memory_mib']:.0f}" if row.get("memory_mib") not in (None, "") else "-"


def markdown_tables(rows: list[dict], sweep: Sweep) -> str:
    """Per batch size: runtime (mean, min–max seconds) and peak memory (MiB), series x length."""
    out = []
    memory_kind = next((r.get("memory_kind") for r in rows if r.get("memory_kind")), "memory")
    for batch, lengths in sweep.lengths.items():
        by = {(r["series"], r["length"]): r for r in rows if r["batch"] == batch}
        header = "| series | " + " | ".join(measure.fmt_len(n) for n in lengths) + " |"
        rule = "|---|" + "---|" * len(lengths)
        for kind, caption in (("time", "runtime, s: mean (min–max) of the repeats"),
                              ("memory", f"peak memory, MiB ({memory_kind})")):
            out += [f"**batch {batch}, {caption}**", "", header, rule]
            for s in sweep.series:
                out.append(f"| {s.label} | " + " | ".join(_cell(by.get((s.label, n)), kind) for n in lengths) + " |")
            out.append("")
    return "\n".join(out)


def machine_line(rows: list[dict], platform: str) -> str:
    import platform as host

    import jax

    if platform == "gpu":
        device = next((r["device"] for r in rows if r.get("device")), "GPU")
        return f"{device}; jax {jax.__version__}, Python {host.python_version()}"
    threads = next((r["threads"] for r in rows if r.get("threads")), "?")
    return (f"{measure.cpu_model()}, {threads} threads, {measure.total_memory_gib():.0f} GiB RAM; "
            f"jax {jax.__version__}, "
            f"Python {host.python_version()}")


def flatness(rows: list[dict], label: str, batch: int, beyond: int = 0, key: str = "memory_mib") -> float | None:
    """max/min of `key` (memory) over one series' successful points longer than `beyond` tokens."""
    mem = [float(r[key]) for r in rows if r["series"] == label and int(r["batch"]) == batch
           and r["status"] == "ok" and int(r["length"]) > beyond and r.get(key) not in (None, "")]
    return max(mem) / min(mem) if len(mem) >= 2 else None
