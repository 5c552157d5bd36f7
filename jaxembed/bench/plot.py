"""The figures in the paper's layout: one column per batch size, runtime above and peak memory
below, input length on a log2 axis, each series the mean of its repeats with the min–max band.
Points that ran out of memory or time are named in the legend; the plotted values are the
measured ones from `results.csv`."""

from __future__ import annotations

import textwrap
from pathlib import Path

from jaxembed.bench.measure import fmt_len

STATUS_SHORT = {"out of memory": "OOM", "timeout": "timeout", "skipped": "skipped", "failed": "failed"}


def _not_measured(rows: list[dict]) -> str:
    first = {}
    for r in sorted(rows, key=lambda r: int(r["length"])):
        if r["status"] != "ok" and r["status"] != "skipped":
            first.setdefault(STATUS_SHORT.get(r["status"], r["status"]), int(r["length"]))
    return ", ".join(f"{k} at {fmt_len(n)}" for k, n in first.items())


def figure(rows: list[dict], sweep, path: Path, subtitle: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = list(sweep.lengths)
    width = max(7.5, 6.2 * len(batches))
    fig, axes = plt.subplots(2, len(batches), figsize=(width, 8.5), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    memory_kind = next((r.get("memory_kind") for r in rows if r.get("memory_kind")), "memory")
    for col, batch in enumerate(batches):
        t_ax, m_ax = axes[0, col], axes[1, col]
        for k, s in enumerate(sweep.series):
            mine = [r for r in rows if r["series"] == s.label and int(r["batch"]) == batch]
            ok = sorted((int(r["length"]), float(r["mean_s"]), float(r["min_s"]), float(r["max_s"]),
                         float(r["memory_mib"]) / 1024) for r in mine if r["status"] == "ok")
            label = s.label
            V = s.vertical_for(batch)
            if V is not None and "V=" not in label:
                label += f" (V={V})"
            missing = _not_measured(mine)
            if missing:
                label += f" [{missing}]"
            color = colors[k % len(colors)]
            style = "--" if mine and mine[0].get("architecture") == "transformer" else "-"
            if not ok:
                t_ax.plot([], [], style, color=color, marker="o", label=label)
                continue
            x, mean, lo, hi, mem = zip(*ok, strict=True)
            t_ax.plot(x, mean, style, color=color, marker="o", ms=3.5, label=label)
            t_ax.fill_between(x, lo, hi, color=color, alpha=0.2, linewidth=0)
            m_ax.plot(x, mem, style, color=color, marker="o", ms=3.5, label=label)
        lengths = sweep.lengths[batch]
        for ax, ylabel in ((t_ax, "runtime (s)"), (m_ax, f"peak memory (GiB, {memory_kind})")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(lengths, [fmt_len(n) for n in lengths], fontsize=8)
            ax.set_xlabel("input length (tokens)")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="major", alpha=0.3)
        if any(len(line.get_xdata()) for line in t_ax.get_lines()):  # log of nothing is an error
            t_ax.set_yscale("log")
        m_ax.set_ylim(bottom=0)
        t_ax.set_title(f"batch size {batch}")
        t_ax.legend(fontsize=7, loc="upper left")
    title = textwrap.fill(sweep.title, int(width * 13)) + "\n" + textwrap.fill(subtitle, int(width * 15))
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    from jaxembed.files import write_atomically

    write_atomically(path, lambda f: fig.savefig(f, dpi=120, format="png"))
    plt.close(fig)
    return path
