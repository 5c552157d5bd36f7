"""Measuring one point honestly: pinned threads, wall-clock repeats, and peak memory of a fresh process.

Nothing here imports jax or torch at module level: `pin_threads` must run before either is
initialised, so that every method in a run sees the same CPUs (XLA sizes its thread pool from
the process's CPU affinity when its client starts, torch from `torch.set_num_threads`, BLAS
libraries from the *_NUM_THREADS variables).
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, field

RESULT_MARK = "@@JAXEMBED_BENCH_RESULT@@"  # the line a worker prints its result on


# ---- environment ---------------------------------------------------------------------------
def pin_threads(threads: int | None) -> dict:
    """Restrict this process (and its children) to `threads` CPUs, for jax, torch and BLAS alike.

    Call before jax's or torch's first computation. Returns the settings, for the log.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if threads > len(cpus):
            print(f"warning: {threads} threads asked for, {len(cpus)} CPUs available; using {len(cpus)}")
            threads = len(cpus)
        cpus = cpus[:threads]
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cpus)
    n = len(cpus)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(n)
    return {"threads": n, "cpus": ",".join(map(str, cpus)), "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
            "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "")}


def exit_on_sigterm() -> None:
    """SIGTERM (`timeout`'s signal) as SystemExit, so a script's `finally` writes the rows it has: a step cut
    at its time limit still returns what it measured (the handler runs once the current call returns)."""
    import signal

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ---- host memory ---------------------------------------------------------------------------
def peak_rss_mib() -> float:
    """Peak resident set size of this process so far (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _proc_field_mib(path: str, name: str) -> float:
    """A "Name:  N kB" field of a /proc file (status: VmRSS, VmHWM; meminfo: MemTotal, ...) in
    MiB; NaN where unavailable."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(name + ":"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError):
        pass
    return float("nan")


def _proc_status_mib(name: str, pid: int | str = "self") -> float:
    return _proc_field_mib(f"/proc/{pid}/status", name)


def current_rss_mib(pid: int | str = "self") -> float:
    return _proc_status_mib("VmRSS", pid)


def reset_peak_rss() -> bool:
    """Reset the kernel's high-water mark VmHWM (and with it ru_maxrss) so that `hwm_rss_mib`
    measures the peak from now on. Linux only; returns False where it is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def hwm_rss_mib() -> float:
    """Peak RSS since the last `reset_peak_rss` (or since the start)."""
    return _proc_status_mib("VmHWM")


def available_memory_mib() -> float:
    return _proc_field_mib("/proc/meminfo", "MemAvailable")


def total_memory_gib() -> float:
    return _proc_field_mib("/proc/meminfo", "MemTotal") / 1024.0


def default_memory_limit_mib(platform: str = "cpu") -> float:
    """The host RSS a worker may reach before it is stopped as out of memory.

    CPU: 60% of the memory available now, at most 16 GiB (the RSS is what a CPU point measures).
    GPU: 90% of the memory available now, no fixed cap: a GPU point is limited by the device's
    memory (XLA's RESOURCE_EXHAUSTED), and the host limit only keeps the machine from swapping.
    """
    avail = available_memory_mib()
    if avail != avail:  # no /proc/meminfo
        return 16384.0
    return 0.9 * avail if platform == "gpu" else min(16384.0, 0.6 * avail)


# ---- timing --------------------------------------------------------------------------------
@dataclass
class Timing:
    first_s: float  # the first call: compilation (jax) plus one run
    times_s: list[float] = field(default_factory=list)

    @property
    def min_s(self) -> float:
        return min(self.times_s)

    @property
    def max_s(self) -> float:
        return max(self.times_s)

    @property
    def mean_s(self) -> float:
        return statistics.fmean(self.times_s)

    @property
    def std_s(self) -> float:
        return statistics.stdev(self.times_s) if len(self.times_s) > 1 else 0.0


def time_run(run, repeats: int, warmup: int = 1) -> Timing:
    """`warmup` untimed calls (the first one compiles), then `repeats` timed ones."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    t0 = time.perf_counter()
    run()
    out = Timing(time.perf_counter() - t0)
    for _ in range(max(0, warmup - 1)):
        run()
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        out.times_s.append(time.perf_counter() - t0)
    return out


# ---- lengths -------------------------------------------------------------------------------
def parse_length(value) -> int:
    """512, '8k' (k = 1024), '1M' -> tokens."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    mult = {"k": 1024, "m": 1024 * 1024}.get(text[-1:], 1)
    try:
        return int(text[:-1] if mult > 1 else text) * mult
    except ValueError:
        raise ValueError(f"not a length: {value!r} (use e.g. 512, 8k, 1M)") from None


def parse_int_list(text: str) -> list[int]:
    """'8k,16384,1M' -> [8192, 16384, 1048576]."""
    return [parse_length(part) for part in text.split(",") if part.strip()]


def text_table(header: list, rows: list[list]) -> str:
    """A plain-text table: the first column left-aligned, the others right-aligned."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    lines = ["  ".join(str(h).ljust(w) for h, w in zip(header, widths, strict=True)),
             "  ".join("-" * w for w in widths)]
    for r in rows:
        lines.append("  ".join(str(x).rjust(w) if i else str(x).ljust(w)
                               for i, (x, w) in enumerate(zip(r, widths, strict=True))))
    return "\n".join(lines)


def fmt_len(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


# ---- one point in a fresh process -------------------------------------------------------------
PARENT_ENV = "JAXEMBED_BENCH_PARENT"  # the pid of the process that started a worker (`run_fresh`)


def die_with_parent() -> None:
    """Called first in a worker (Linux): SIGKILL when the process that started it dies, however it dies (a plain
    `kill PID` of the sweep would leave the worker running, holding the device). Set in the worker rather than
    in a preexec_fn, which is unsafe in a parent with threads; a parent gone before it was set ends it now."""
    import ctypes
    import signal

    parent = int(os.environ.get(PARENT_ENV, "0") or 0)
    if not parent:
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os._exit(1)

def run_fresh(cmd: list[str], *, timeout: float, memory_limit_mib: float | None, env: dict | None = None) -> dict:
    """Run a worker command in a fresh process under a wall-clock limit and an RSS limit.

    The worker prints its result as JSON on a line starting with RESULT_MARK. A worker that is
    killed or dies without reporting gets status "timeout", "out of memory" or "failed" and the
    RSS seen from outside; nothing is dropped.
    """
    t0 = time.perf_counter()
    env = {**(os.environ if env is None else env), PARENT_ENV: str(os.getpid())}  # see die_with_parent
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)  # never block on a full pipe
    reader.start()
    killed, observed_rss = None, 0.0
    try:
        while proc.poll() is None:
            time.sleep(0.1)
            rss = current_rss_mib(proc.pid)
            if rss == rss:  # not NaN (the child may just have exited)
                observed_rss = max(observed_rss, rss)
            if time.perf_counter() - t0 > timeout:
                killed = f"timeout (> {timeout:.0f} s)"
            elif memory_limit_mib and observed_rss > memory_limit_mib:
                killed = f"over the memory limit (RSS > {memory_limit_mib:.0f} MiB)"
            if killed:
                break
    finally:  # killed too when this process is stopped (SIGTERM, Ctrl-C): no orphan holding the device
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=5)
    out = {"wall_s": time.perf_counter() - t0}
    for line in lines:
        if line.startswith(RESULT_MARK):
            out.update(json.loads(line[len(RESULT_MARK):]))
    if killed:
        out.update(status="timeout" if killed.startswith("timeout") else "out of memory", error=killed,
                   peak_rss_mib=max(out.get("peak_rss_mib", 0.0), observed_rss))
    elif "status" not in out:  # died without reporting (the kernel's OOM killer, a crash)
        tail = " | ".join(ln.strip() for ln in lines[-3:] if ln.strip())
        status = "out of memory" if proc.returncode in (-9, 137) else "failed"
        out.update(status=status, error=f"exit code {proc.returncode}: {tail}"[:300], peak_rss_mib=observed_rss)
    return out


def report(result: dict) -> None:
    """The worker's side of `run_fresh`."""
    print(RESULT_MARK + json.dumps(result), flush=True)


def classify_error(err: BaseException) -> tuple[str, str]:
    """(status, one-line message) for an exception raised while measuring."""
    msg = f"{type(err).__name__}: {err}"
    oom = isinstance(err, MemoryError) or "RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower()
    return ("out of memory" if oom else "failed"), msg.splitlines()[0][:300]
