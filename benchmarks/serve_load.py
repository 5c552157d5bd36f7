"""Load test of `jaxembed serve` (issue #22) on loopback: concurrent clients against the real HTTP server, every
embedding checked against a direct `Embedder.encode` of the same text, throughput compared with that direct
batched encode, latency percentiles, and the malformed-input checks.

    python benchmarks/serve_load.py                                  # 32 clients x 100 requests, 1 .. 8192 tokens
    python benchmarks/serve_load.py --clients 8 --requests 12 --max-tokens 2048 --hidden-size 128   # a small CPU

The server is uvicorn on 127.0.0.1 (any free port) in a thread of this process, the app `jaxembed.serve`'s,
with its startup warmup of every length bucket up to the longest input (so neither side compiles while timed;
programs compiled during the load are counted and reported). The model is `--model PATH`, or by default a random
transformers Mamba2 with a BPE tokenizer made by `jaxembed.testing` (`--hidden-size`, `--layers`,
`--chunk-size`, `--vocab-size`). Each request is one text (a string) or, with probability `--list-fraction`, a
list of 2 .. `--list-max` texts; text lengths are log-uniform in tokens from `--min-tokens` to `--max-tokens`
(EOS included), cut from this machine's standard-library docstrings; half the requests ask for base64.

Direct: `encode(all texts, batch_size, max_tokens_per_batch)` in one call, after one untimed call if that one
compiled anything, timed before the load and after each of `--rounds` served loads; the fastest direct and the
fastest served run count (on a shared machine the load varies; neither side is flattered). Served: the wall
time from the first request sent to the last response read, all clients together. Both count the same tokens;
the ratio is direct tokens/s over served tokens/s (1.0: no loss); the CPU-time ratio (this process's, all its
threads: server, clients and device work) is printed beside it. Bounded: `--time-limit` seconds for each load
phase (then it stops and reports the requests not done as errors).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_model, pin_threads


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: a random Mamba2 from jaxembed.testing)")
    p.add_argument("--hidden-size", type=int, default=256, help="random model: d_model (default 256)")
    p.add_argument("--layers", type=int, default=4, help="random model: layers (default 4)")
    p.add_argument("--chunk-size", type=int, default=64, help="random model: Q (default 64)")
    p.add_argument("--vocab-size", type=int, default=1024, help="random model: BPE vocabulary (default 1024)")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--requests", type=int, default=100, help="requests per client")
    p.add_argument("--min-tokens", type=int, default=2, help="shortest input, EOS included (default 2: one token)")
    p.add_argument("--max-tokens", type=int, default=8192, help="longest input, EOS included (default 8192)")
    p.add_argument("--list-fraction", type=float, default=0.3, help="share of requests that send a list")
    p.add_argument("--list-max", type=int, default=4, help="texts in a list request: 2 .. this")
    p.add_argument("--batch-size", type=int, default=32, help="rows per device batch, both sides")
    p.add_argument("--max-tokens-per-batch", type=int, default=8192,
                   help="padded tokens per device batch, both sides (default 8192)")
    p.add_argument("--batch-tokens", type=int, default=65536, help="server: tokens merged into one batch")
    p.add_argument("--max-wait-ms", type=float, default=5.0, help="server: wait for more requests to merge")
    p.add_argument("--time-limit", type=float, default=1800.0, help="seconds for the load phase (default 1800)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all)")
    p.add_argument("--rounds", type=int, default=1,
                   help="served loads, each followed by another direct encode; the fastest of each counts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    for name in ("clients", "requests", "min_tokens", "max_tokens", "list_max", "batch_size", "max_tokens_per_batch",
                 "batch_tokens", "hidden_size", "layers", "chunk_size", "vocab_size", "rounds"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if not 2 <= args.min_tokens <= args.max_tokens:
        raise SystemExit("need 2 <= --min-tokens <= --max-tokens (a text has at least one token and its EOS)")
    if args.list_max < 2 or not 0 <= args.list_fraction <= 1:
        raise SystemExit("need --list-max >= 2 and 0 <= --list-fraction <= 1")
    return args


def random_model(args, directory: Path) -> Path:
    from jaxembed.testing import make_hf_mamba2, make_tokenizer

    tokenizer = make_tokenizer(args.vocab_size)
    head_dim = min(64, args.hidden_size // 2)
    model = make_hf_mamba2(seed=args.seed, vocab_size=len(tokenizer), hidden_size=args.hidden_size,
                           head_dim=head_dim, num_hidden_layers=args.layers, chunk_size=args.chunk_size, n_groups=1,
                           state_size=64)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def make_workload(tokenizer, args):
    """Per client, its requests: a text or a list of texts, log-uniform lengths in tokens."""
    from jaxembed.testing import local_corpus

    rng = np.random.default_rng(args.seed)
    corpus_ids: list[int] = []
    for doc in local_corpus(limit_chars=1 << 30):
        corpus_ids.extend(tokenizer(doc, add_special_tokens=False)["input_ids"])
        if len(corpus_ids) > 4 * args.max_tokens:
            break
    corpus_ids = (corpus_ids * (1 + 4 * args.max_tokens // max(1, len(corpus_ids))))[: 4 * args.max_tokens]
    lo, hi = np.log(args.min_tokens - 1), np.log(args.max_tokens - 1)

    def text():
        n = int(np.clip(round(np.exp(rng.uniform(lo, hi))), args.min_tokens - 1, args.max_tokens - 1))
        start = int(rng.integers(0, len(corpus_ids) - n))
        return tokenizer.decode(corpus_ids[start: start + n]) or "x"

    workload = []
    for _ in range(args.clients):
        reqs = []
        for _ in range(args.requests):
            if rng.random() < args.list_fraction:
                reqs.append([text() for _ in range(int(rng.integers(2, args.list_max + 1)))])
            else:
                reqs.append(text())
        workload.append(reqs)
    return workload


def start_server(app):
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False,
                                           lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)  # not the main thread: no signal handlers
    thread.start()
    deadline = time.monotonic() + 3600  # startup compiles the warmup programs
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise SystemExit("the server did not start")
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, thread, f"http://127.0.0.1:{port}"


async def run_load(url: str, workload, time_limit: float):
    """Each client sends its requests one after another; returns per request (client, i, status, seconds, rows)."""
    import httpx

    results = []

    async def client(c, http):
        for i, inp in enumerate(workload[c]):
            fmt = "base64" if (c + i) % 2 else "float"
            start = time.perf_counter()
            try:
                r = await http.post(f"{url}/v1/embeddings", json={"input": inp, "encoding_format": fmt})
            except Exception as err:  # counted as an error below
                status, body = repr(err), None
            else:  # a reply that is not JSON (a proxy's or a crash's plain text) keeps its HTTP status
                status = r.status_code
                body = r.json() if r.headers.get("content-type", "").startswith("application/json") else None
            seconds = time.perf_counter() - start
            rows = None
            if status == 200:
                data = body["data"]
                rows = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") if fmt == "base64" else
                                 np.asarray(d["embedding"], np.float32) for d in data])
            results.append((c, i, status, seconds, rows, body["usage"]["prompt_tokens"] if status == 200 else 0))

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=len(workload))) as http:
        tasks = [asyncio.create_task(client(c, http)) for c in range(len(workload))]
        done, pending = await asyncio.wait(tasks, timeout=time_limit)
        for t in pending:
            t.cancel()
    return results


MALFORMED = [
    ("malformed JSON", b'{"input": "a",'),
    ("not an object", b'["a"]'),
    ("no input", {}),
    ("empty string", {"input": ""}),
    ("empty list", {"input": []}),
    ("a non-string in a list", {"input": ["a", 3]}),
    ("a list of lists with an empty one", {"input": [[1, 2], []]}),
    ("token id out of the vocabulary", {"input": [1, 2, 10 ** 9]}),
    ("unknown field", {"input": "a", "inputs": "b"}),
    ("bad encoding_format", {"input": "a", "encoding_format": "int8"}),
    ("dimensions too large", {"input": "a", "dimensions": 1 << 20}),
    ("input over max-input-tokens", "LONG"),
]


def malformed_checks(url: str, max_input_tokens: int, good_text: str, expected: np.ndarray):
    import httpx

    rows = []
    with httpx.Client(timeout=600) as http:
        for name, body in MALFORMED:
            if body == "LONG":
                body = {"input": "the quick brown fox " * (max_input_tokens // 2)}
            kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
            bad = http.post(f"{url}/v1/embeddings", headers={"content-type": "application/json"}, **kwargs)
            good = http.post(f"{url}/v1/embeddings", json={"input": good_text})
            ok = good.status_code == 200 and np.abs(np.asarray(good.json()["data"][0]["embedding"], np.float32)
                                                    - expected).max() <= 1e-5
            rows.append({"case": name, "status": bad.status_code,
                         "message": bad.json()["error"]["message"][:90], "next_good_request": "ok" if ok else "FAILED"})
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    pinned = pin_threads(args.threads)
    import jax

    import jaxembed
    from jaxembed.embedder import embed_jit
    from jaxembed.serve import create_app

    with tempfile.TemporaryDirectory(prefix="jaxembed-serve-load-") as tmp:
        path = Path(args.model) if args.model else random_model(args, Path(tmp))
        model = jaxembed.load(path)
        workload = make_workload(model.tokenizer, args)
    texts = list(dict.fromkeys(t for reqs in workload for inp in reqs for t in ([inp] if isinstance(inp, str) else
                                                                               inp)))
    lengths = [len(s) for s in model.tokenize(texts)]
    longest = max(lengths)
    n_requests = sum(len(r) for r in workload)
    print(f"# serve load: {args.clients} clients x {args.requests} requests ({n_requests} requests, "
          f"{sum(len(r) if isinstance(r, list) else 1 for reqs in workload for r in reqs)} inputs, {len(texts)} "
          f"distinct texts of {min(lengths)} .. {longest} tokens, {sum(lengths):,} tokens); model "
          f"{args.model or f'random Mamba2 d={args.hidden_size} L={args.layers} Q={args.chunk_size}'}; "
          f"{pinned['threads']} threads, {cpu_model()}, jax {jax.__version__} ({jax.default_backend()})",
          flush=True)

    limits = dict(batch_size=args.batch_size, max_tokens_per_batch=args.max_tokens_per_batch,
                  batch_tokens=args.batch_tokens, max_wait_ms=args.max_wait_ms, max_input_tokens=longest + 64,
                  max_request_tokens=max(262144, args.list_max * (longest + 64)), warmup_max_length=longest,
                  max_queue=4 * args.clients, request_timeout=args.time_limit)
    app = create_app(model, model_name="bench", **limits)
    tick = time.perf_counter()
    server, thread, url = start_server(app)
    warmup_s = time.perf_counter() - tick
    programs = embed_jit._cache_size()
    print(f"server up at {url}; warmup compiled {programs} programs in {warmup_s:.0f} s", flush=True)
    encode = dict(batch_size=args.batch_size, max_tokens_per_batch=args.max_tokens_per_batch, show_progress_bar=False)
    index = {t: i for i, t in enumerate(texts)}

    def timed(f):
        tick, cpu = time.perf_counter(), time.process_time()
        out = f()
        return out, time.perf_counter() - tick, time.process_time() - cpu

    direct, served = [], []  # (wall, cpu) per round
    try:
        reference, wall, cpu = timed(lambda: model.encode(texts, **encode))
        direct_compiled = embed_jit._cache_size() - programs
        if direct_compiled:  # its first call compiled (e.g. a last, smaller batch): not timed
            reference, wall, cpu = timed(lambda: model.encode(texts, **encode))
        direct.append((wall, cpu))
        print(f"direct encode: {wall:.1f} s ({direct_compiled} programs compiled by its first call)", flush=True)
        before = embed_jit._cache_size()
        all_results = []
        for r in range(args.rounds):  # direct, served, direct, served, ..., direct: the load on a shared machine varies
            results, wall, cpu = timed(lambda: asyncio.run(run_load(url, workload, args.time_limit)))
            served.append((wall, cpu))
            all_results.append(results)
            _, d_wall, d_cpu = timed(lambda: model.encode(texts, **encode))
            direct.append((d_wall, d_cpu))
            print(f"round {r + 1}: served {wall:.1f} s, direct again {d_wall:.1f} s", flush=True)
        served_compiled = embed_jit._cache_size() - before
        batcher = app.state.batcher
        busy_s = app.state.metrics.registry.get_sample_value("jaxembed_batch_seconds_sum")
        malformed = malformed_checks(url, limits["max_input_tokens"], texts[0], reference[0])
    finally:
        server.should_exit = True
        thread.join(60)

    errors, worst = 0, 0.0
    for results in all_results:
        errors += n_requests - sum(1 for r in results if r[2] == 200)
        for c, i, status, _, rows, _ in results:
            if status == 200:
                inp = workload[c][i]
                expected = reference[[index[t] for t in ([inp] if isinstance(inp, str) else inp)]]
                worst = max(worst, float(np.abs(rows - expected).max()))
    best = min(range(args.rounds), key=lambda r: served[r][0])
    results, (served_s, served_cpu) = all_results[best], served[best]
    direct_s, direct_cpu = min(w for w, _ in direct), min(c for _, c in direct)  # the fastest: nothing flattered
    served_tokens = sum(r[5] for r in results)
    request_tokens = sum(lengths[index[t]] for reqs in workload for inp in reqs
                         for t in ([inp] if isinstance(inp, str) else inp))
    direct_tps, served_tps = sum(lengths) / direct_s, served_tokens / served_s
    latency = np.array([r[3] for r in results if r[2] == 200])
    p50, p99 = (np.percentile(latency, [50, 99]) if latency.size else (float("nan"),) * 2)
    n_requests_all = n_requests * args.rounds
    summary = {
        "requests": n_requests_all, "errors": errors, "max_abs_diff": worst, "equal_within_1e-5": worst <= 1e-5,
        "direct_tokens": sum(lengths), "direct_s": direct_s, "direct_rounds": direct, "served_rounds": served,
        "direct_tokens_per_s": direct_tps,
        "served_tokens": served_tokens, "served_tokens_expected": request_tokens, "served_s": served_s,
        "served_tokens_per_s": served_tps, "ratio_direct_over_served": direct_tps / served_tps,
        "direct_cpu_s": direct_cpu, "served_cpu_s": served_cpu, "cpu_ratio_served_over_direct": served_cpu / direct_cpu,
        "latency_p50_s": float(p50), "latency_p99_s": float(p99), "batches": batcher.batches,
        "requests_per_batch": n_requests_all / max(1, batcher.batches), "worker_busy_s": busy_s,
        "programs_compiled_during_load": served_compiled,
        "warmup_programs": programs, "warmup_s": warmup_s, "malformed": malformed, "args": vars(args) | {
            "json": str(args.json) if args.json else None},
    }
    print("\n| | |\n|---|---|")
    print(f"| requests | {n_requests_all} in {args.rounds} round(s) ({errors} errors) |")
    print(f"| max abs difference, served vs direct encode | {worst:.2e} ({'within' if worst <= 1e-5 else 'OVER'} "
          f"1e-5) |")
    print(f"| direct `encode` (one call, {len(texts)} texts; fastest of {len(direct)}: "
          f"{' / '.join(f'{w:.1f}' for w, _ in direct)} s) | {direct_s:.1f} s, {direct_tps:,.0f} tokens/s |")
    print(f"| served ({args.clients} clients, loopback HTTP; fastest of {len(served)}: "
          f"{' / '.join(f'{w:.1f}' for w, _ in served)} s) | {served_s:.1f} s, {served_tps:,.0f} tokens/s "
          f"({served_tokens:,} tokens) |")
    print(f"| ratio direct / served throughput | **{direct_tps / served_tps:.2f}x** |")
    print(f"| CPU time (this process: server, clients, device) served / direct | {served_cpu:.1f} s / "
          f"{direct_cpu:.1f} s = {served_cpu / direct_cpu:.2f}x |")
    print(f"| latency p50 / p99 (fastest round) | {p50 * 1000:.0f} ms / {p99 * 1000:.0f} ms |")
    print(f"| merged batches | {batcher.batches} ({n_requests_all / max(1, batcher.batches):.1f} requests per "
          f"batch); the worker busy {busy_s:.1f} s of {sum(w for w, _ in served):.1f} |")
    print(f"| programs compiled during the load | {served_compiled} |")
    print("\n| malformed request | status | message | next good request |\n|---|---|---|---|")
    for m in malformed:
        print(f"| {m['case']} | {m['status']} | {m['message']} | {m['next_good_request']} |")
    if args.json:
        from jaxembed.files import write_text_atomically

        write_text_atomically(args.json, json.dumps(summary, indent=1) + "\n")
    bad = errors or worst > 1e-5 or any(m["status"] // 100 != 4 or m["next_good_request"] != "ok"
                                        for m in malformed)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
