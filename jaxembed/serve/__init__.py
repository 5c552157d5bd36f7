"""`jaxembed serve --model PATH`: an OpenAI-compatible embeddings server (Starlette on uvicorn, Prometheus
metrics by prometheus_client; `pip install 'jaxembed[serve]'`).

    POST /v1/embeddings   {"input": "text" | [...], "model": ..., "encoding_format": "float" | "base64",
                           "dimensions": k, "input_type": "query" | "document", "instruction": ...}
    GET  /v1/models, /health, /metrics

Requests are checked and tokenized as they arrive (jaxembed/serve/api.py), queued, and merged by one worker
thread into batches by a token budget and a maximum wait (jaxembed/serve/batcher.py); each batch is one
`Embedder.encode_ids` call, which sorts by length, pads to the length buckets and chunks long inputs
vertically. `create_app(embedder, **limits)` builds the ASGI app (jaxembed/serve/app.py). docs/serving.md has
the API, the flags, the limits and the metrics.
"""

from __future__ import annotations

import argparse
import logging
import math
from pathlib import Path

from jaxembed.errors import check_positive_int


def create_app(embedder, *, model_name: str = "jaxembed", **limits):
    """The ASGI app serving `embedder` (see jaxembed.serve.app.DEFAULT_LIMITS for the limits)."""
    from jaxembed.serve.app import create_app as _create_app

    return _create_app(embedder, model_name=model_name, **limits)


def _vertical(value: str):
    from jaxembed.cli import _vertical as parse

    return parse(value)


def add_parser(sub) -> argparse.ArgumentParser:
    """Register `jaxembed serve` on the CLI's subparsers."""
    p = sub.add_parser("serve", help="an OpenAI-compatible embeddings server (POST /v1/embeddings) with dynamic "
                                     "batching and Prometheus metrics")
    p.add_argument("--model", required=True, help="converted or Hugging Face directory")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080; 0: any free port)")
    p.add_argument("--served-model-name", default=None,
                   help="the name requests give as 'model' and responses carry (default: the model directory's name)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--tokenizer", default=None, help="tokenizer path (default: the one in the model directory)")
    g = p.add_argument_group("batching")
    g.add_argument("--batch-tokens", type=int, default=65536,
                   help="tokens of queued requests merged into one batch (default 65536; a larger request runs alone)")
    g.add_argument("--max-wait-ms", type=float, default=5.0,
                   help="how long a batch waits for more requests after its first arrived (default 5 ms)")
    g.add_argument("--batch-size", type=int, default=32, help="rows per device batch (default 32)")
    g.add_argument("--max-tokens-per-batch", type=int, default=None,
                   help="padded tokens per device batch (default: no cap beyond --batch-size rows)")
    g.add_argument("--vertical-chunk-size", type=_vertical, default="auto", help="'auto', 'none' or V")
    g.add_argument("--warmup-max-length", type=int, default=None,
                   help="before serving, compile the programs for inputs up to this many tokens (default: compile "
                        "on first use)")
    g = p.add_argument_group("limits")
    g.add_argument("--max-input-tokens", type=int, default=32768, help="tokens per input, EOS included (413 above)")
    g.add_argument("--max-request-tokens", type=int, default=262144, help="tokens per request (413 above)")
    g.add_argument("--max-inputs", type=int, default=2048, help="inputs per request (400 above)")
    g.add_argument("--max-body-mb", type=float, default=32.0, help="request body size, MiB (413 above)")
    g.add_argument("--max-queue", type=int, default=256, help="requests waiting for a batch (503 above)")
    g.add_argument("--request-timeout", type=float, default=60.0, help="seconds from arrival to response (504)")
    g.add_argument("--shutdown-timeout", type=int, default=30,
                   help="on SIGTERM / SIGINT, seconds to let requests in flight finish (default 30)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--no-access-log", action="store_true", help="no line per request")
    p.set_defaults(func=cmd_serve)
    return p


def limits_from_args(args) -> dict:
    for name in ("max_input_tokens", "max_request_tokens", "max_inputs", "max_queue", "batch_tokens", "batch_size"):
        check_positive_int("--" + name.replace("_", "-"), getattr(args, name))
    for name in ("max_tokens_per_batch", "warmup_max_length"):
        check_positive_int("--" + name.replace("_", "-"), getattr(args, name), optional=True)
    for name in ("max_body_mb", "request_timeout"):
        if not 0 < getattr(args, name) < math.inf:
            raise ValueError(f"--{name.replace('_', '-')} must be positive and finite, got {getattr(args, name)}")
    if int(args.max_body_mb * (1 << 20)) < 1:
        raise ValueError(f"--max-body-mb must be at least one byte (1e-6 MiB), got {args.max_body_mb}")
    if not 0 <= args.max_wait_ms < args.request_timeout * 1000:
        raise ValueError(f"--max-wait-ms must be from 0 to below --request-timeout ({args.request_timeout:g} s), "
                         f"got {args.max_wait_ms}")
    limits = dict(max_input_tokens=args.max_input_tokens, max_request_tokens=args.max_request_tokens,
                  max_inputs=args.max_inputs, max_body_bytes=int(args.max_body_mb * (1 << 20)),
                  max_queue=args.max_queue, request_timeout=args.request_timeout, batch_tokens=args.batch_tokens,
                  max_wait_ms=args.max_wait_ms, batch_size=args.batch_size,
                  max_tokens_per_batch=args.max_tokens_per_batch, vertical_chunk_size=args.vertical_chunk_size,
                  warmup_max_length=args.warmup_max_length)
    from jaxembed.serve.app import check_limits

    check_limits(limits)
    return limits


def cmd_serve(args) -> int:
    try:
        import uvicorn

        from jaxembed.serve.app import create_app as _create_app
    except ImportError as err:
        raise ValueError(f"jaxembed serve needs the serve extra: pip install 'jaxembed[serve]' ({err})") from None
    import jaxembed

    limits = limits_from_args(args)  # before loading a model
    handler = logging.StreamHandler()  # jaxembed.serve's lines (warmup, a stopped worker) beside uvicorn's
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
    logging.getLogger("jaxembed").addHandler(handler)
    logging.getLogger("jaxembed").setLevel(args.log_level.upper())
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be 0 to 65535, got {args.port}")
    check_positive_int("--shutdown-timeout", args.shutdown_timeout)
    sock = listening_socket(args.host, args.port)  # bound first: a port in use is a one-line error, before the load
    model = jaxembed.load(args.model, dtype=args.dtype, tokenizer=args.tokenizer)
    if args.vertical_chunk_size != "auto":
        model.resolve_vertical_chunk_size(args.vertical_chunk_size, args.batch_size)  # V a multiple of Q
    name = args.served_model_name or default_served_name(args.model)
    app = _create_app(model, model_name=name, **limits)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=not args.no_access_log, lifespan="on",
                            timeout_graceful_shutdown=args.shutdown_timeout)
    server = _server_class()(config)
    server.run(sockets=[sock])  # SIGTERM / SIGINT: stop accepting, finish the requests in flight, drain the batcher
    return 0 if server.started else 2


def default_served_name(model) -> str:
    """The model directory's own name, also for `.` or `runs/x/..` (which would name it "" or ".."); a hub id
    as given."""
    local = Path(str(model)).expanduser()
    return (local.resolve().name if local.exists() else str(model).rstrip("/")) or "jaxembed"


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server on a socket bound beforehand (`listening_socket`), logging where it listens as it does
        for the sockets it binds itself (for one it is handed, it leaves that to a process manager)."""

        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if self.started and sockets:
                host, port = sockets[0].getsockname()[:2]
                shown = f"[{host}]" if ":" in host else host
                logging.getLogger("uvicorn.error").info(
                    "Uvicorn running on http://%s:%d (Press CTRL+C to quit)", shown, port)

    return Server


def listening_socket(host: str, port: int):
    """A TCP socket bound to host:port, as uvicorn binds one (SO_REUSEADDR; IPv6 for a host with ':'); a
    ValueError naming the address and the reason when it cannot be."""
    import socket

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:  # in use, not this machine's address, not an address at all (gaierror)
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    return sock
