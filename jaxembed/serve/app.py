"""The ASGI app (Starlette): POST /v1/embeddings, GET /v1/models, GET /health, GET /metrics, over a `Batcher`
whose worker thread runs `Embedder.encode_ids` on merged requests. See jaxembed/serve/__init__.py and
docs/serving.md."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import math
import threading
import time

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jaxembed.errors import check_positive_int
from jaxembed.serve.api import (
    RequestError,
    check_token_limits,
    error_body,
    parse_request,
    render,
    request_ids,
    response_body,
)
from jaxembed.serve.batcher import Batcher, Closed, QueueFull
from jaxembed.serve.metrics import Metrics

log = logging.getLogger("jaxembed.serve")
INLINE_TOKENIZE_CHARS = 4096  # requests with at most this many characters of text are tokenized in the event loop
INLINE_RENDER_VALUES = 1 << 16  # responses with at most this many floats are written in the event loop

DEFAULT_LIMITS = dict(
    max_input_tokens=32768,  # tokens per input (EOS and prompt included)
    max_request_tokens=262144,  # tokens per request
    max_inputs=2048,  # inputs per request (OpenAI's limit)
    max_body_bytes=32 << 20,  # request body
    max_queue=256,  # requests waiting for a batch
    request_timeout=60.0,  # seconds from arrival to response
    batch_tokens=65536,  # tokens merged into one batch
    max_wait_ms=5.0,  # how long a batch waits for more requests
    batch_size=32,  # rows per device batch (encode_ids batch_size)
    max_tokens_per_batch=None,  # padded tokens per device batch (encode_ids; None: the embedder's)
    vertical_chunk_size="auto",
    warmup_max_length=None,  # compile every length bucket up to this many tokens at startup
)


def check_limits(limits: dict) -> dict:
    """Every limit checked (a ValueError naming it), defaults filled in."""
    unknown = sorted(set(limits) - set(DEFAULT_LIMITS))
    if unknown:
        raise TypeError(f"unknown limit(s) {', '.join(unknown)}; the limits are {', '.join(DEFAULT_LIMITS)}")
    out = {**DEFAULT_LIMITS, **limits}
    for name in ("max_input_tokens", "max_request_tokens", "max_inputs", "max_body_bytes", "max_queue",
                 "batch_tokens", "batch_size"):
        check_positive_int(name, out[name])
    for name in ("max_tokens_per_batch", "warmup_max_length"):
        check_positive_int(name, out[name], optional=True)
    timeout = out["request_timeout"]
    if not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise ValueError(f"request_timeout must be a positive, finite number of seconds, got {timeout!r}")
    wait = out["max_wait_ms"]
    if not isinstance(wait, (int, float)) or not 0 <= wait < timeout * 1000:
        # a batch that waits longer than a request may would only ever time out
        raise ValueError(f"max_wait_ms must be a number from 0 to below request_timeout ({timeout:g} s), got {wait!r}")
    return out


def create_app(embedder, *, model_name: str = "jaxembed", **limits) -> Starlette:
    """The embeddings server for `embedder` (a `jaxembed.Embedder`). limits: see DEFAULT_LIMITS."""
    limits = check_limits(limits)
    if not isinstance(model_name, str) or not model_name:
        raise ValueError(f"model_name must be a non-empty string, got {model_name!r}")
    metrics = Metrics()
    # a transformers fast tokenizer is not safe to call from several threads at once: one lock per copy, and a
    # copy of its own for long texts, so that one long request never holds up the short ones
    short_tokenizer, short_lock = embedder.tokenizer, threading.Lock()
    try:
        long_tokenizer, long_lock = copy.deepcopy(embedder.tokenizer), threading.Lock()
    except Exception:  # a tokenizer that cannot be copied: one for all, as before
        long_tokenizer, long_lock = short_tokenizer, short_lock
    if short_tokenizer is not None and hasattr(short_tokenizer, "__len__") and \
            len(short_tokenizer) > embedder.vocab_size:
        log.warning("the tokenizer has %d tokens, the model's vocabulary %d: a text that tokenizes to an id "
                    "beyond it is refused (500)", len(short_tokenizer), embedder.vocab_size)
    preparing = 0  # requests being read, checked and tokenized (not yet queued): at most max_queue
    created = int(time.time())

    def run(ids):
        """A merged batch, in the worker thread: one encode_ids call, whose `text.make_batches` keeps inputs of
        mixed lengths that merely arrived together from padding each other."""
        return embedder.encode_ids(ids, batch_size=limits["batch_size"], show_progress_bar=False,
                                   max_tokens_per_batch=limits["max_tokens_per_batch"],
                                   vertical_chunk_size=limits["vertical_chunk_size"])

    batcher = Batcher(run, batch_tokens=limits["batch_tokens"], max_wait=limits["max_wait_ms"] / 1000,
                      max_queue=limits["max_queue"], metrics=metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if limits["warmup_max_length"] is not None:
            start = time.perf_counter()
            log.info("warming up: compiling every batch shape for inputs up to %d tokens (or reading them from "
                     "the compilation cache)", limits["warmup_max_length"])
            shapes = await run_in_threadpool(
                embedder.warmup, limits["warmup_max_length"], batch_size=limits["batch_size"],
                max_tokens_per_batch=limits["max_tokens_per_batch"], vertical_chunk_size=limits["vertical_chunk_size"],
                partial_batches=True)
            log.info("warmed up %d batch shapes for inputs up to %d tokens in %.1f s", len(shapes),
                     limits["warmup_max_length"], time.perf_counter() - start)
        batcher.start()
        try:
            yield
        finally:
            # uvicorn has waited for the requests in flight; anything still queued is run before we return. After
            # request_timeout every request has had its answer (a 504 at the latest): no one waits for a batch
            await batcher.close(timeout=limits["request_timeout"])

    def error(status: int, body: dict, endpoint: str, headers=None) -> JSONResponse:
        response = JSONResponse(body, status_code=status, headers=headers)  # counted once it could be written
        metrics.requests.labels(endpoint, str(status)).inc()
        return response

    async def read_body(request: Request) -> bytes:
        limit = limits["max_body_bytes"]
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise RequestError(413, f"the body has {int(declared)} bytes, more than this server's limit of {limit}",
                               code="body_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise RequestError(413, f"the body is longer than this server's limit of {limit} bytes",
                                   code="body_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    async def tokenize(req) -> list[list[int]]:
        """Token ids: short texts right here (a thread hop costs more than they do), long ones in a thread so
        the event loop goes on accepting meanwhile, with their own tokenizer; short ones in a thread too while
        another short request holds theirs."""
        if req.ids is not None:
            return req.ids
        if sum(map(len, req.texts)) > INLINE_TOKENIZE_CHARS:
            return await run_in_threadpool(request_ids, embedder, req, long_tokenizer, long_lock)
        if short_lock.acquire(blocking=False):
            try:
                return request_ids(embedder, req, short_tokenizer)
            finally:
                short_lock.release()
        return await run_in_threadpool(request_ids, embedder, req, short_tokenizer, short_lock)

    async def client_gone(request: Request) -> None:
        """Returns when the client disconnects (the body has been read: what comes next is the disconnect)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass

    def remaining(start: float) -> float:
        return max(limits["request_timeout"] - (time.perf_counter() - start), 0.0)

    async def embeddings(request: Request) -> Response:
        nonlocal preparing
        start = time.perf_counter()
        status, job, prepared = 500, None, False
        metrics.in_flight.inc()
        try:
            try:
                # shed load before the costly part (reading, parsing, tokenizing), not after it
                if batcher.queued >= limits["max_queue"] or preparing >= limits["max_queue"]:
                    raise QueueFull(f"the request queue is full ({batcher.queued} requests waiting, {preparing} "
                                    f"being read); retry later")
                if batcher.stopped is not None:
                    raise Closed(f"the batch worker stopped ({batcher.stopped})")
                preparing += 1
                prepared = True
                try:
                    body = await asyncio.wait_for(read_body(request), remaining(start))
                except TimeoutError:
                    raise RequestError(408, f"the request body did not arrive within this server's timeout of "
                                            f"{limits['request_timeout']:g} s", code="timeout") from None
                req = parse_request(body, embedding_dim=embedder.embedding_dim, vocab_size=embedder.vocab_size,
                                    max_inputs=limits["max_inputs"])
                if req.model is not None and req.model != model_name:
                    raise RequestError(404, f"model {req.model!r} is not served here; this server serves "
                                            f"{model_name!r}", param="model", code="model_not_found")
                ids = await tokenize(req)
                tokens = check_token_limits(ids, max_input_tokens=limits["max_input_tokens"],
                                            max_request_tokens=limits["max_request_tokens"])
                preparing -= 1
                prepared = False
                job = batcher.submit(ids, tokens)
                watch = asyncio.ensure_future(client_gone(request))
                try:
                    done, _ = await asyncio.wait({job.future, watch}, timeout=remaining(start),
                                                 return_when=asyncio.FIRST_COMPLETED)
                finally:
                    watch.cancel()
                if job.future not in done:
                    batcher.cancel(job)  # its rows are no longer wanted: out of the queue, unless it is running
                    if watch in done:
                        raise ClientDisconnect()
                    raise TimeoutError()
                rows = job.future.result()
            except RequestError as err:
                status = err.status
                return error(status, err.body(), "embeddings")
            except QueueFull as err:
                status = 503
                return error(status, error_body(str(err), kind="server_busy", code="queue_full"), "embeddings",
                             headers={"Retry-After": "1"})
            except Closed as err:
                status = 503
                return error(status, error_body(str(err), kind="server_busy", code="shutting_down"), "embeddings")
            except TimeoutError:
                batcher.cancel(job)
                status = 504
                return error(status, error_body(f"the request did not finish within this server's timeout of "
                                                f"{limits['request_timeout']:g} s", kind="timeout", code="timeout"),
                             "embeddings")
            except ClientDisconnect:
                status = 499
                metrics.requests.labels("embeddings", "499").inc()
                return Response(status_code=499)
            except Exception as err:  # the batch failed (e.g. non-finite embeddings): say why, keep serving
                from jaxembed.cli import one_line

                log.exception("embedding batch failed")
                status = 500
                return error(status, error_body(f"embedding failed: {one_line(err)}", kind="server_error"),
                             "embeddings")
            # a long response is written in a thread: the event loop goes on accepting meanwhile
            body = response_body(rows, req, model_name, tokens)
            content = (render(body) if rows.size <= INLINE_RENDER_VALUES else await run_in_threadpool(render, body))
            status = 200
            metrics.requests.labels("embeddings", "200").inc()
            metrics.inputs.inc(len(ids))
            metrics.tokens.inc(tokens)
            return Response(content, media_type="application/json")
        except asyncio.CancelledError:  # the server stops waiting (shutdown): its rows are no longer wanted
            if job is not None:
                batcher.cancel(job)
            raise
        finally:
            if prepared:
                preparing -= 1
            metrics.in_flight.dec()
            metrics.request_seconds.labels(str(status)).observe(time.perf_counter() - start)

    async def models(request: Request) -> Response:
        metrics.requests.labels("models", "200").inc()
        return JSONResponse({"object": "list", "data": [
            {"id": model_name, "object": "model", "created": created, "owned_by": "jaxembed"}]})

    async def health(request: Request) -> Response:
        state = ("worker stopped" if batcher.stopped is not None else "shutting down" if batcher.closing
                 else "ok")
        status = 200 if state == "ok" else 503
        metrics.requests.labels("health", str(status)).inc()
        return JSONResponse({"status": state, "model": model_name, "embedding_dim": embedder.embedding_dim,
                             "queued": batcher.queued, "batches": batcher.batches}, status_code=status)

    async def metrics_endpoint(request: Request) -> Response:
        metrics.requests.labels("metrics", "200").inc()
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        """404 / 405 as OpenAI-style JSON errors."""
        return JSONResponse(error_body(f"{request.method} {request.url.path}: {exc.detail}",
                                       kind="invalid_request_error"), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    app = Starlette(routes=[
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/embeddings", embeddings, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
    ], lifespan=lifespan, exception_handlers={HTTPException: http_error})
    app.state.batcher = batcher
    app.state.metrics = metrics
    app.state.limits = limits
    app.state.model_name = model_name
    return app
