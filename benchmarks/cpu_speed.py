"""CPU speed check: jaxembed (horizontal and vertical) against mamba2-jax and transformers' PyTorch path.

One process times every method on the same random ids with the same threads, fp32, batch 1,
T = 2048 by default, on the 12-layer d_model-768 config with random weights. Each method is
compiled / warmed up first; the timed repeats then go round-robin over the methods, so a
change in background load hits all of them alike. Reported: min and mean seconds, tokens/s
(from the min), speed ratios against each peer, and, from an analytical FLOP count of the
Mamba2 forward, the fraction of this CPU's measured fp32 matmul rate that each method reaches.
The matmul rate (jnp fp32, the model's in_proj shape and a large square) is timed inside the
same round-robin, so it sees the same background load; the best of all its timings is used.

    .venv/bin/python benchmarks/cpu_speed.py                       # the issue's settings
    .venv/bin/python benchmarks/cpu_speed.py --length 1024 --repeats 1 --vertical 512
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

HERE = Path(__file__).resolve().parent
DEFAULT_CONFIG = common.CONFIGS / "bench-cpu-12l-768.yaml"
DEFAULT_CSV = HERE / "results" / "cpu_speed.csv"


def mamba2_forward_flops(cfg, seq_len: int, batch: int = 1, chunk_size: int | None = None) -> dict[str, int]:
    """Analytical FLOPs of one Mamba2 forward pass (all layers), counting a multiply-add as 2 FLOPs.

    Only the matrix products are counted (the work that can run at matmul speed); the
    elementwise work (conv, norms, gates, softplus, the exp of the decay matrices, the
    embedding gather) is left out, so the "fraction of matmul peak" is a model-FLOP
    utilisation in the usual sense. The chunked SSD terms are counted as the chunked
    algorithm computes them, on the sequence padded to c = ceil(T / Q) chunks of Q tokens
    (Q = min(chunk_size, T)), with full Q x Q blocks (no triangular saving).

    With b batch, T tokens, d = d_model, e = d_inner, h heads of size p, g groups, n state,
    per layer:

      in_proj       2 b T d d_in_proj           (d_in_proj = 2e + 2 g n + h: z, xBC, dt)
      out_proj      2 b T e d
      cb            2 b c g Q^2 n               C Bᵀ per group, shared by the group's heads
      diag_block    2 b c h Q^2 p               (L ∘ C Bᵀ)(dt x) inside each chunk
      chunk_states  2 b c h Q p n               Bᵀ diag(decay to chunk end)(dt x)
      inter_chunk   2 b c h p n                 h_c = exp(Σ a) h_{c-1} + h_intra
      out_correct   2 b c h Q p n               C h_{c-1}, scaled by the decay

    Returns the per-term totals over all layers and "total".
    """
    Q = min(chunk_size or cfg.chunk_size, seq_len)
    c = -(-seq_len // Q)
    b, T, L = batch, seq_len, cfg.n_layers
    d, e, h, p, g, n = cfg.d_model, cfg.d_inner, cfg.n_heads, cfg.head_dim, cfg.n_groups, cfg.d_state
    terms = {
        "in_proj": 2 * b * T * d * cfg.d_in_proj,
        "out_proj": 2 * b * T * e * d,
        "cb": 2 * b * c * g * Q * Q * n,
        "diag_block": 2 * b * c * h * Q * Q * p,
        "chunk_states": 2 * b * c * h * Q * p * n,
        "inter_chunk": 2 * b * c * h * p * n,
        "out_correct": 2 * b * c * h * Q * p * n,
    }
    terms = {k: L * v for k, v in terms.items()}
    terms["total"] = sum(terms.values())
    return terms


def build_matmul(m: int, k: int, n: int):
    """An fp32 jnp matmul [m, k] x [k, n] under jit; returns (run, flops)."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(1), (m, k), jnp.float32)
    b = jax.random.normal(jax.random.key(2), (k, n), jnp.float32)
    f = jax.jit(lambda x, y: x @ y)
    return (lambda: f(a, b).block_until_ready()), 2 * m * k * n


def parse_vertical(text: str, batch: int, chunk_size: int) -> list[tuple[int, str]]:
    """'512,1024,default' -> [(512, ''), (1024, ''), (4096, 'default')], de-duplicated."""
    from jaxembed.embedder import default_vertical_chunk_size

    out: dict[int, str] = {}
    for part in (s.strip() for s in text.split(",")):
        if not part:
            continue
        if part in ("default", "auto"):
            v = default_vertical_chunk_size(batch, chunk_size)
            out[v] = "default"
        else:
            v = common.parse_int_list(part)[0]
            out.setdefault(v, "")
    return list(out.items())


def _row_label(method, V, tag, length):
    if method != "jaxembed":
        return method
    if V is None:
        return "jaxembed horizontal"
    label = f"jaxembed vertical V={V}"
    if tag:
        label += f" ({tag})"
    if length <= V:
        label += " [T<=V: runs horizontal]"
    return label


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(DEFAULT_CONFIG), help="model config YAML (default: %(default)s)")
    ap.add_argument("--length", "-T", type=str, default="2048", help="tokens per sequence (e.g. 2048 or 2k)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5,
                    help="timed repeats per method after warm-up (>= 3 for the report)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed calls per method (the first compiles)")
    ap.add_argument("--vertical", default="512,1024,default",
                    help="vertical chunk sizes V (multiples of Q); 'default' = jaxembed's policy for this batch")
    ap.add_argument("--no-horizontal", action="store_true", help="skip jaxembed horizontal")
    ap.add_argument("--methods", default="jaxembed,mamba2-jax,torch", help="comma list of jaxembed, mamba2-jax, torch")
    ap.add_argument("--threads", type=int, default=2, help="CPUs for every method (affinity, torch and BLAS threads)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--square-size", type=int, default=4096,
                    help="size of the square matmul for the peak rate (0 skips)")
    ap.add_argument("--settle", type=float, default=0.5,
                    help="seconds of idle before each timed call (OpenMP/Eigen threads spin after work)")
    ap.add_argument("--matmul-calls", type=int, default=3,
                    help="matmul timings per round (the rate is the best of all)")
    ap.add_argument("--csv", default=str(DEFAULT_CSV), help="output CSV (default: %(default)s)")
    args = ap.parse_args(argv)

    env = common.pin_threads(args.threads)  # before jax / torch are imported
    load_start = os.getloadavg()[0]
    if args.repeats < 3:
        print(f"note: --repeats {args.repeats} < 3: fine for checking the script, too few for the report")
    import jax

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        if m not in ("jaxembed", *common.PEERS):
            ap.error(f"unknown method {m!r}")
    T = common.parse_int_list(args.length)[0]
    cfg = common.load_config(args.config)
    if cfg.architecture != "mamba2":  # the params, the FLOP count and the peers are Mamba2's
        ap.error(f"--config must be a Mamba2 config, got {cfg.architecture} ({args.config})")
    ids = common.random_ids(cfg.vocab_size, args.batch, T, args.seed)
    flops = mamba2_forward_flops(cfg, T, args.batch)

    print(f"# cpu_speed: {Path(args.config).name}  L={cfg.n_layers} d={cfg.d_model} n={cfg.d_state} "
          f"p={cfg.head_dim} h={cfg.n_heads} Q={cfg.chunk_size}  batch={args.batch} T={T} fp32")
    print(f"# CPU: {common.cpu_model()}  threads={env['threads']} (cpus {env['cpus']})  "
          f"XLA_FLAGS={env['XLA_FLAGS']!r}  load avg {os.getloadavg()[0]:.2f}")
    print("# versions: " + ", ".join(f"{k} {v}" for k, v in common.versions().items()))
    print(f"# analytical FLOPs per forward: {flops['total'] / 1e9:.1f} GFLOP "
          + "(" + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in flops.items() if k != "total") + ")")

    # ---- matmul rate of this CPU: timed inside the round-robin below, best of all rounds ----------
    mm = [{"name": "matmul in_proj", "shape": (args.batch * T, cfg.d_model, cfg.d_in_proj)}]
    if args.square_size:
        s = args.square_size
        mm.append({"name": f"matmul square {s}", "shape": (s, s, s)})
    for r in mm:
        m_, k_, n_ = r["shape"]
        r["label"] = f"{r['name']} [{m_},{k_}]x[{k_},{n_}]"
        r["run"], r["flops"] = build_matmul(m_, k_, n_)
        r["run"]()  # compile
        r["times"] = []

    # ---- build every method ------------------------------------------------------------------
    variants = []  # (method, V, tag)
    if "jaxembed" in methods:
        if not args.no_horizontal:
            variants.append(("jaxembed", None, ""))
        for V, tag in parse_vertical(args.vertical, args.batch, cfg.chunk_size):
            variants.append(("jaxembed", V, tag))
    variants += [(m, None, "") for m in common.PEERS if m in methods]

    shared_params = None
    if "jaxembed" in methods:
        from jaxembed.models import mamba2

        shared_params = mamba2.init_params(cfg, jax.random.key(args.seed))

    results = []  # dicts
    for method, V, tag in variants:
        label = _row_label(method, V, tag, T)
        res = {"label": label, "method": method, "V": V, "error": "", "run": None}
        try:
            t0 = time.perf_counter()
            res["run"] = common.build(method, cfg, ids, vertical_chunk_size=V, threads=env["threads"],
                                      seed=args.seed, params=shared_params)
            res["build_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            res["run"]()  # compile + first run
            res["warmup_s"] = time.perf_counter() - t0
            for _ in range(args.warmup - 1):
                res["run"]()
            print(f"  built {label}: build {res['build_s']:.1f}s, first call {res['warmup_s']:.1f}s", flush=True)
        except Exception as err:  # a missing or broken peer is reported, not fatal
            res["error"] = f"{type(err).__name__}: {err}".splitlines()[0][:200]
            res["run"] = None
            print(f"  FAILED {label}: {res['error']}", flush=True)
        results.append(res)

    # ---- timed repeats, round-robin --------------------------------------------------------
    for res in results:
        res["times"] = []
    for rep in range(args.repeats):
        for r in mm:
            for _ in range(args.matmul_calls):
                t0 = time.perf_counter()
                r["run"]()
                r["times"].append(time.perf_counter() - t0)
        for res in results:
            if res["run"] is None:
                continue
            time.sleep(args.settle)  # let the previous method's spinning worker threads go idle
            try:
                t0 = time.perf_counter()
                res["run"]()
                res["times"].append(time.perf_counter() - t0)
            except Exception as err:  # its earlier timings are not a measurement of `repeats` calls
                res["error"] = f"{type(err).__name__}: {err}".splitlines()[0][:200]
                res["run"], res["times"] = None, []
        print(f"  repeat {rep + 1}/{args.repeats} done (load avg {os.getloadavg()[0]:.2f})", flush=True)

    # ---- report --------------------------------------------------------------------------------
    for r in mm:
        r["min_s"], r["mean_s"] = min(r["times"]), sum(r["times"]) / len(r["times"])
        r["gflops"] = r["flops"] / r["min_s"] / 1e9
        print(f"# {r['label']}: {r['gflops']:.1f} GFLOP/s (best of {len(r['times'])}, min {r['min_s'] * 1e3:.1f} ms)")
    peak = max(r["gflops"] for r in mm)
    print(f"# matmul rate used for the fraction (the best above): {peak:.1f} GFLOP/s")
    tokens = args.batch * T
    ok = [r for r in results if r["times"]]
    for r in ok:
        r["min_s"], r["mean_s"] = min(r["times"]), sum(r["times"]) / len(r["times"])
        r["tok_s"] = tokens / r["min_s"]
        r["gflops"] = flops["total"] / r["min_s"] / 1e9
        r["frac"] = r["gflops"] / peak
    peer_min = {r["method"]: r["min_s"] for r in ok if r["method"] in common.PEERS}

    header = ["method", "min s", "mean s", "tokens/s", "GFLOP/s", "% matmul peak"]
    header += [f"x vs {p}" for p in common.PEERS if p in peer_min]
    rows = []
    for r in results:
        if not r["times"]:
            rows.append([r["label"], "FAILED", r["error"][:60]] + [""] * (len(header) - 3))
            continue
        row = [r["label"], f"{r['min_s']:.3f}", f"{r['mean_s']:.3f}", f"{r['tok_s']:.0f}", f"{r['gflops']:.1f}",
               f"{100 * r['frac']:.1f}"]
        row += [f"{peer_min[p] / r['min_s']:.2f}" for p in common.PEERS if p in peer_min]
        rows.append(row)
    print()
    print(common.measure.text_table(header, rows))
    print("(x vs peer = peer's min time / this method's min time: > 1 means faster than the peer)")

    jx = [r for r in ok if r["method"] == "jaxembed"]
    if jx:
        best = min(jx, key=lambda r: r["min_s"])
        print(f"\njaxembed best: {best['label']}  {best['min_s']:.3f} s  {best['tok_s']:.0f} tokens/s  "
              f"{100 * best['frac']:.1f}% of the {peak:.0f} GFLOP/s matmul rate")
        for p, t in peer_min.items():
            print(f"  vs {p}: {t / best['min_s']:.2f}x ({'faster' if t > best['min_s'] else 'slower'}; "
                  f"{p} min {t:.3f} s)")
        for r in results:
            if r["method"] in common.PEERS and not r["times"]:
                print(f"  vs {r['method']}: not measured ({r['error']})")

    # ---- CSV --------------------------------------------------------------------------------------
    out = Path(args.csv)
    out.parent.mkdir(parents=True, exist_ok=True)
    fields = ["kind", "method", "label", "vertical_chunk_size", "config", "batch", "length", "threads", "repeats",
              "min_s", "mean_s", "times_s", "tokens_per_s", "gflop", "gflops", "fraction_of_matmul_peak",
              "speedup_vs_mamba2_jax", "speedup_vs_torch", "build_s", "first_call_s", "error", "cpu",
              "load_avg_start_end"]
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        base = {"config": Path(args.config).name, "batch": args.batch, "length": T, "threads": env["threads"],
                "repeats": args.repeats, "cpu": common.cpu_model(),
                "load_avg_start_end": f"{load_start:.2f}/{os.getloadavg()[0]:.2f}"}
        for r in mm:
            w.writerow({**base, "kind": "matmul", "method": "jnp.matmul", "label": r["label"],
                        "repeats": len(r["times"]), "min_s": f"{r['min_s']:.6f}", "mean_s": f"{r['mean_s']:.6f}",
                        "gflop": f"{r['flops'] / 1e9:.3f}", "gflops": f"{r['gflops']:.2f}",
                        "fraction_of_matmul_peak": f"{r['gflops'] / peak:.4f}"})
        for r in results:
            row = {**base, "kind": "forward", "method": r["method"], "label": r["label"],
                   "vertical_chunk_size": "" if r["V"] is None else r["V"], "gflop": f"{flops['total'] / 1e9:.3f}",
                   "build_s": f"{r.get('build_s', math.nan):.3f}", "first_call_s": f"{r.get('warmup_s', math.nan):.3f}",
                   "error": r["error"]}
            if r["times"]:
                row.update({"min_s": f"{r['min_s']:.6f}", "mean_s": f"{r['mean_s']:.6f}",
                            "times_s": " ".join(f"{t:.4f}" for t in r["times"]), "tokens_per_s": f"{r['tok_s']:.1f}",
                            "gflops": f"{r['gflops']:.2f}", "fraction_of_matmul_peak": f"{r['frac']:.4f}"})
                for p, key in (("mamba2-jax", "speedup_vs_mamba2_jax"), ("torch", "speedup_vs_torch")):
                    if p in peer_min:
                        row[key] = f"{peer_min[p] / r['min_s']:.4f}"
            w.writerow(row)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
