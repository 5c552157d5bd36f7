"""`jaxembed serve`: the OpenAI embeddings API in process (httpx's ASGI transport, the app's lifespan running
its batcher), against `Embedder.encode` / `encode_ids` and transformers; bad requests, limits, the queue, the
timeout, metrics; and the CLI on a real socket, drained by SIGTERM."""

import asyncio
import base64
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
from conftest import TOLERANCE, hf_last_hidden, rel_err
from prometheus_client.parser import text_string_to_metric_families

import jaxembed
from jaxembed.embedder import embed_jit
from jaxembed.serve import create_app

TEXTS = [
    "Return the sum of a list of numbers, starting from the given value, and raise a TypeError when an item is not a "
    "number.",
    "Serialize obj to a JSON formatted str, using the given separators and indentation, sorting the keys if asked to.",
    "Split the string at the last occurrence of the separator and return a tuple of the part before it, the separator "
    "and the rest.",
    "A longer document about JSON decoding, which goes on for a while so that it spans several chunks.",
]
# Few shapes, as each is a compilation: with Q = 8 every text is 56 to 64 tokens (with EOS), one length bucket, so
# one text alone runs as [1, 64] and any batch of them as [4, 64] in vertical chunks of V = 16; two queries (with
# the query prompt, 90 and 96 tokens) as [2, 96].


@pytest.fixture(scope="module")
def embedder(hf_model_dir):
    return jaxembed.load(hf_model_dir[0])


def serve(app, fn):
    """Run `fn(client)` against the app with its lifespan (the batcher's worker) running."""
    async def main():
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                         timeout=60) as client:
                return await fn(client)

    return asyncio.run(main())


async def until(condition, timeout: float = 30.0):
    """Wait for a condition (a state of the server, not a duration)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.002)


def rows(response) -> np.ndarray:
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [d["index"] for d in data] == list(range(len(data)))
    return np.array([d["embedding"] for d in data], np.float32)


class Gated:
    """The embedder with its device work held until `gate` is set: which requests share a batch is then
    decided by the test, not by timing."""

    def __init__(self, inner):
        self._inner = inner
        self.gate = threading.Event()
        self.calls = []  # inputs per encode_ids call (one per merged batch)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def encode_ids(self, ids, **kwargs):
        self.calls.append(len(ids))
        assert self.gate.wait(30)
        return self._inner.encode_ids(ids, **kwargs)


def metric_values(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_embeddings_equal_encode(embedder, hf_model_dir, tokenizer):
    _, model = hf_model_dir

    async def run(c):
        single = await c.post("/v1/embeddings", json={"input": TEXTS[0], "model": "tiny", "user": "u1"})
        many = await c.post("/v1/embeddings", json={"input": TEXTS})
        b64 = await c.post("/v1/embeddings", json={"input": TEXTS, "encoding_format": "base64"})
        query = await c.post("/v1/embeddings", json={"input": TEXTS[:2], "input_type": "query",
                                                     "instruction": "Retrieve code for the query"})
        ids = await c.post("/v1/embeddings", json={"input": embedder.tokenize(TEXTS)})
        flat = await c.post("/v1/embeddings", json={"input": eos_less})
        dims = await c.post("/v1/embeddings", json={"input": TEXTS, "dimensions": 16})
        return single, many, b64, query, ids, flat, dims

    eos_less = embedder.tokenize([TEXTS[0]])[0][:-1]
    single, many, b64, query, ids, flat, dims = serve(create_app(embedder, model_name="tiny"), run)
    body = single.json()
    assert body["object"] == "list" and body["model"] == "tiny" and body["data"][0]["object"] == "embedding"
    n_single = len(embedder.tokenize([TEXTS[0]])[0])
    assert body["usage"] == {"prompt_tokens": n_single, "total_tokens": n_single}
    got = rows(single)[0]
    np.testing.assert_allclose(got, embedder.encode(TEXTS[0]), atol=1e-5)
    # and against transformers: its final-norm output at the EOS appended to the text
    ref = hf_last_hidden(model, [tokenizer(TEXTS[0])["input_ids"] + [tokenizer.eos_token_id]])[0]
    assert rel_err(got, ref / np.linalg.norm(ref)) < TOLERANCE["float32"]

    expected = embedder.encode(TEXTS)
    np.testing.assert_allclose(rows(many), expected, atol=1e-5)
    total = sum(len(s) for s in embedder.tokenize(TEXTS))
    assert many.json()["usage"] == {"prompt_tokens": total, "total_tokens": total}
    decoded = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in b64.json()["data"]])
    np.testing.assert_array_equal(decoded, rows(many))  # the same float32 values, either encoding

    np.testing.assert_allclose(rows(query), embedder.encode_query(TEXTS[:2], instruction="Retrieve code for the "
                                                                  "query"), atol=1e-5)
    prompt = "Instruction: Retrieve code for the query\nQuery: "
    assert query.json()["usage"]["prompt_tokens"] == sum(len(s) for s in embedder.tokenize([prompt + t for t in
                                                                                            TEXTS[:2]]))
    np.testing.assert_allclose(rows(ids), expected, atol=1e-5)  # ids that end in EOS: the texts' embeddings
    np.testing.assert_allclose(rows(flat), embedder.encode_ids([eos_less]), atol=1e-5)  # as given, no EOS added
    assert flat.json()["usage"]["prompt_tokens"] == len(eos_less)
    assert np.abs(rows(flat)[0] - got).max() > 1e-3  # without its EOS, another embedding

    cut = expected[:, :16] / np.linalg.norm(expected[:, :16], axis=1, keepdims=True)  # truncate, then normalise
    np.testing.assert_allclose(rows(dims), cut, atol=1e-5)


def test_concurrent_requests_share_a_batch(embedder):
    gated = Gated(embedder)
    app = create_app(gated, max_wait_ms=0)
    groups = [TEXTS[0], TEXTS[1:3], [TEXTS[3]]]

    async def run(c):
        blocker = asyncio.create_task(c.post("/v1/embeddings", json={"input": TEXTS[0]}))
        await until(lambda: gated.calls)  # the worker holds the first batch
        tasks = [asyncio.create_task(c.post("/v1/embeddings", json={"input": g})) for g in groups]
        await until(lambda: app.state.batcher.queued == len(groups))
        gated.gate.set()
        out = await asyncio.gather(blocker, *tasks)
        return out, (await c.get("/metrics")).text

    (blocker, *responses), text = serve(app, run)
    assert gated.calls == [1, 4]  # the three requests (four inputs) ran as one batch, one device batch
    np.testing.assert_allclose(rows(blocker)[0], embedder.encode(TEXTS[0]), atol=1e-5)
    expected = embedder.encode(TEXTS)
    np.testing.assert_allclose(rows(responses[0]), expected[:1], atol=1e-5)  # each caller its own rows
    np.testing.assert_allclose(rows(responses[1]), expected[1:3], atol=1e-5)
    np.testing.assert_allclose(rows(responses[2]), expected[3:], atol=1e-5)
    m = metric_values(text)
    assert m[("jaxembed_batches_total", ())] == 2
    assert m[("jaxembed_batch_requests_count", ())] == 2 and m[("jaxembed_batch_requests_sum", ())] == 4
    assert m[("jaxembed_batch_inputs_sum", ())] == 5
    assert m[("jaxembed_requests_total", (("endpoint", "embeddings"), ("status", "200")))] == 4


def test_bad_requests_get_4xx_naming_the_problem(embedder):
    app = create_app(embedder, model_name="tiny", max_input_tokens=64, max_request_tokens=130, max_inputs=4,
                     max_body_bytes=2000)
    long_text = "the quick brown fox " * 20
    n_long = len(embedder.tokenize([long_text])[0])
    mid = TEXTS[:3]
    n_mid = sum(len(s) for s in embedder.tokenize(mid))
    assert n_long > 64 and all(len(s) <= 64 for s in embedder.tokenize(mid)) and n_mid > 130
    cases = [
        (b'{"input": "a",', 400, "not valid JSON", None),
        (b'["a"]', 400, "must be a JSON object, got an array", None),
        ({}, 400, "'input' is required", "input"),
        ({"input": ""}, 400, "'input' is an empty string", "input"),
        ({"input": []}, 400, "'input' is an empty list", "input"),
        ({"input": ["a", 3]}, 400, "input[1] is an integer, not a string", "input"),
        ({"input": ["a", ""]}, 400, "input[1] is an empty string", "input"),
        ({"input": {"text": "a"}}, 400, "got an object", "input"),
        ({"input": [[1, 2], []]}, 400, "input[1] is an empty list of token ids", "input"),
        ({"input": [1, 2, 100000]}, 400, "input[2] = 100000 is not a token id", "input"),
        ({"input": [[1, True]]}, 400, "input[0][1] is a boolean, not a token id", "input"),
        ({"input": long_text}, 413, f"input[0] has {n_long} tokens", "input"),
        ({"input": mid}, 413, f"the request has {n_mid} tokens", "input"),
        ({"input": ["a"] * 5}, 400, "5 items, more than this server's limit of 4", "input"),
        ({"input": "a", "inputs": "b"}, 400, "unknown field 'inputs'", "inputs"),
        ({"input": "a", "encoding_format": "int8"}, 400, "'encoding_format' must be", "encoding_format"),
        ({"input": "a", "dimensions": 0}, 400, "'dimensions' must be an integer from 1 to 64", "dimensions"),
        ({"input": "a", "dimensions": 65}, 400, "got 65", "dimensions"),
        ({"input": "a", "instruction": "x"}, 400, "set 'input_type' to 'query'", "instruction"),
        ({"input": [1, 2], "input_type": "query"}, 400, "token ids are used as given", "input_type"),
        ({"input": "a", "input_type": "passage"}, 400, "'input_type' must be", "input_type"),
        ({"input": "a", "model": "gpt"}, 404, "model 'gpt' is not served here", "model"),
        ({"input": "a" * 3000}, 413, "limit of 2000", None),
        (b'{"input": ["ok", "a\\ud800b"]}', 400, "input[1] holds a lone surrogate (U+D800 at character 1)", "input"),
        (b'{"input": "a", "input_type": "query", "instruction": "x\\udfff"}', 400,
         "'instruction' holds a lone surrogate", "instruction"),
        (b'{"input": "a", "\\ud800x": 1}', 400, "unknown field '\\ud800x'", "\\ud800x"),  # was a 500
    ]

    async def run(c):
        out = []
        for body, *_ in cases:
            kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
            bad = await c.post("/v1/embeddings", headers={"content-type": "application/json"}, **kwargs)
            good = await c.post("/v1/embeddings", json={"input": TEXTS[0], "model": "tiny"})
            out.append((bad, good))
        flat = await c.post("/v1/embeddings", json={"input": [1, 2, 3, 4, 5]})  # one input of 5 ids: not 5 inputs
        return out, await c.get("/v1/embeddings"), (await c.get("/metrics")).text, flat

    results, wrong_method, text, flat = serve(app, run)
    assert flat.status_code == 200 and len(rows(flat)) == 1, flat.text
    expected = embedder.encode(TEXTS[0])
    for (body, status, message, param), (bad, good) in zip(cases, results, strict=True):
        assert bad.status_code == status, (body, bad.text)
        error = bad.json()["error"]
        assert message in error["message"], (body, error)
        assert error["param"] == param, (body, error)
        np.testing.assert_allclose(rows(good)[0], expected, atol=1e-5)  # and the server goes on
    assert wrong_method.status_code == 405 and "Method Not Allowed" in wrong_method.json()["error"]["message"]
    m = metric_values(text)
    by_status = {dict(k[1])["status"]: v for k, v in m.items()
                 if k[0] == "jaxembed_requests_total" and dict(k[1])["endpoint"] == "embeddings"}
    assert by_status == {"200": len(cases) + 1, "400": 22, "404": 1, "413": 3}


def test_queue_full_then_timeout(embedder):
    gated = Gated(embedder)
    app = create_app(gated, max_queue=1, max_wait_ms=0)

    async def run(c):
        first = asyncio.create_task(c.post("/v1/embeddings", json={"input": TEXTS[0]}))
        await until(lambda: gated.calls)
        second = asyncio.create_task(c.post("/v1/embeddings", json={"input": TEXTS[0]}))
        await until(lambda: app.state.batcher.queued == 1)
        full = await c.post("/v1/embeddings", json={"input": TEXTS[0]})  # refused at once: the worker is held
        gated.gate.set()
        return full, await first, await second, await c.post("/v1/embeddings", json={"input": TEXTS[0]})

    full, first, second, third = serve(app, run)
    assert full.status_code == 503 and full.headers["retry-after"] == "1"
    assert "queue is full (1 requests waiting, 0 being read)" in full.json()["error"]["message"]
    for r in (first, second, third):
        np.testing.assert_allclose(rows(r)[0], embedder.encode(TEXTS[0]), atol=1e-5)

    gated = Gated(embedder)
    app = create_app(gated, request_timeout=0.3, max_wait_ms=0)

    async def run_timeout(c):
        first = asyncio.create_task(c.post("/v1/embeddings", json={"input": TEXTS[0]}))
        await until(lambda: gated.calls)
        late = await c.post("/v1/embeddings", json={"input": TEXTS[0]})  # queued behind the held batch
        queued_after = app.state.batcher.queued
        gated.gate.set()
        return await first, late, queued_after, await c.post("/v1/embeddings", json={"input": TEXTS[0]})

    first, late, queued_after, third = serve(app, run_timeout)
    for r in (first, late):
        assert r.status_code == 504 and "timeout of 0.3 s" in r.json()["error"]["message"]
    assert queued_after == 0  # the request that gave up left the queue: it is never run
    assert gated.calls == [1, 1]  # the first (held), then the third; never the second
    np.testing.assert_allclose(rows(third)[0], embedder.encode(TEXTS[0]), atol=1e-5)


async def call_app(app, body_messages, disconnect: asyncio.Event | None = None):
    """The app called as uvicorn would, the body sent as `body_messages`; after them the client stays until
    `disconnect` is set (or forever). Returns the response's status."""
    messages = list(body_messages)
    sent = []

    async def receive():
        if messages:
            return messages.pop(0)
        await (disconnect or asyncio.Event()).wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/embeddings", "raw_path": b"/v1/embeddings", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1), "server": ("t", 80)}
    await app(scope, receive, send)
    return next(m["status"] for m in sent if m["type"] == "http.response.start")


def test_a_client_that_leaves_or_stalls_is_not_served(embedder):
    """A queued request whose client disconnects leaves the queue and never runs (it ran, and counted as a
    200); a body that stops arriving is a 408 within the request timeout (it held its slot forever)."""
    gated = Gated(embedder)
    app = create_app(gated, max_wait_ms=0, request_timeout=30)
    body = [{"type": "http.request", "body": b'{"input": "leaving"}', "more_body": False}]

    async def run(c):
        held = asyncio.create_task(c.post("/v1/embeddings", json={"input": TEXTS[0]}))
        await until(lambda: gated.calls)
        gone = asyncio.Event()
        leaving = asyncio.create_task(call_app(app, body, gone))
        await until(lambda: app.state.batcher.queued == 1)
        gone.set()
        status = await leaving
        queued = app.state.batcher.queued
        gated.gate.set()
        return await held, status, queued, (await c.get("/metrics")).text

    held, status, queued, text = serve(app, run)
    assert status == 499 and queued == 0
    assert gated.calls == [1]  # the held request only: the one whose client left never ran
    np.testing.assert_allclose(rows(held)[0], embedder.encode(TEXTS[0]), atol=1e-5)
    assert metric_values(text)[("jaxembed_requests_total", (("endpoint", "embeddings"), ("status", "499")))] == 1

    app = create_app(embedder, request_timeout=0.3)
    partial = [{"type": "http.request", "body": b'{"input": "sl', "more_body": True}]

    async def stalled(c):
        return await call_app(app, partial)

    assert serve(app, stalled) == 408


def test_a_failing_batch_fails_only_its_culprit_and_a_stopped_worker_is_named():
    """Batcher alone: requests merged into a batch that fails are run again one at a time, so only the one
    that fails gets the error; a worker stopped by an error outside the model call fails what waits, refuses
    what comes, and /health would say so (batcher.stopped)."""
    from jaxembed.serve.batcher import Batcher, Closed

    calls, gate = [], threading.Event()

    def run(ids):
        calls.append([seq[0] for seq in ids])
        assert gate.wait(30)
        if any(seq[0] == 666 for seq in ids):
            raise FloatingPointError("non-finite embedding")
        return np.array([[float(seq[0])] for seq in ids], np.float32)

    async def main():
        batcher = Batcher(run, batch_tokens=100, max_wait=0.0, max_queue=8)
        batcher.start()
        first = batcher.submit([[1]], 1)
        await until(lambda: calls)
        bad, good = batcher.submit([[666]], 1), batcher.submit([[2], [3]], 2)
        gate.set()
        out = await first.future, await good.future
        with pytest.raises(FloatingPointError):
            await bad.future
        await batcher.close()
        return out

    first, good = asyncio.run(main())
    assert calls == [[1], [666, 2, 3], [666], [2, 3]]
    assert first.tolist() == [[1.0]] and good.tolist() == [[2.0], [3.0]]

    class BrokenMetrics:
        queue_depth = type("Gauge", (), {"set": lambda self, v: None})()

        def observe_batch(self, *args):
            raise RuntimeError("a metrics bug")

    async def stops():
        batcher = Batcher(run, batch_tokens=1, max_wait=0.0, max_queue=8, metrics=BrokenMetrics())
        batcher.start()
        first, waiting = batcher.submit([[1]], 1), batcher.submit([[2]], 1)  # two batches: the second waits
        for job in (first, waiting):
            with pytest.raises(Closed, match=r"the batch worker stopped \(RuntimeError: a metrics bug\)"):
                await job.future
        with pytest.raises(Closed, match="the batch worker stopped"):
            batcher.submit([[3]], 1)
        return batcher.stopped

    assert asyncio.run(stops()) == "RuntimeError: a metrics bug"

    # close() returns after its limit while a batch still runs (nobody can be waiting for it by then)
    stuck = threading.Event()

    async def closes():
        batcher = Batcher(lambda ids: stuck.wait(30) and np.zeros((len(ids), 1), np.float32), batch_tokens=10,
                          max_wait=0.0, max_queue=8)
        batcher.start()
        batcher.submit([[1]], 1)
        await until(lambda: batcher.queued == 0)
        start = time.monotonic()
        done = await batcher.close(timeout=0.2)
        return done, time.monotonic() - start

    done, waited = asyncio.run(closes())
    stuck.set()
    assert not done and 0.15 < waited < 5


def test_health_metrics_models_and_warmup(embedder):
    app = create_app(embedder, model_name="tiny", warmup_max_length=8, batch_size=1)

    async def run(c):
        health = await c.get("/health")
        models = await c.get("/v1/models")
        compiled = embed_jit._cache_size()
        r = await c.post("/v1/embeddings", json={"input": "x"})  # 2 tokens: the [1, 8] program
        new_programs = embed_jit._cache_size() - compiled
        return health, models, r, new_programs, await c.get("/metrics")

    health, models, r, new_programs, metrics = serve(app, run)
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "model": "tiny", "embedding_dim": 64, "queued": 0, "batches": 0}
    assert [m["id"] for m in models.json()["data"]] == ["tiny"]
    assert new_programs == 0  # warmed up: an input of at most 8 tokens compiles nothing new
    tokens = r.json()["usage"]["prompt_tokens"]
    assert metrics.headers["content-type"].startswith("text/plain")
    m = metric_values(metrics.text)
    assert m[("jaxembed_tokens_total", ())] == tokens and m[("jaxembed_inputs_total", ())] == 1
    assert m[("jaxembed_batch_tokens_sum", ())] == tokens
    for name in ("jaxembed_queue_seconds_count", "jaxembed_batch_seconds_count"):
        assert m[(name, ())] == 1
    assert m[("jaxembed_request_seconds_count", (("status", "200"),))] == 1
    assert m[("jaxembed_queue_depth", ())] == 0 and m[("jaxembed_requests_in_flight", ())] == 0


def test_json_the_parser_cannot_read_is_a_400():
    """Valid JSON that Python's parser refuses (an integer past its 4,300-digit limit, arrays nested past its
    recursion limit) is the client's problem, a 400 naming it, not a 500."""
    from jaxembed.serve.api import RequestError, parse_request

    for body, message in ((b'{"input": ' + b"1" * 5000 + b"}", "4300 digits"), (b"[" * 100_000, "recursion")):
        with pytest.raises(RequestError, match=f"the body is JSON this server does not read: .*{message}") as err:
            parse_request(body, embedding_dim=8, vocab_size=10, max_inputs=4)
        assert err.value.status == 400


def test_a_port_that_cannot_be_listened_on_is_one_line_before_the_model_loads(tmp_path, capsys):
    """A port in use or an address that is not this machine's: `jaxembed serve` says so in one line, exit 2,
    without loading the model first (the model path here does not even exist)."""
    from jaxembed.cli import main
    from jaxembed.serve import listening_socket

    taken = listening_socket("127.0.0.1", 0)
    try:
        taken.listen()
        port = taken.getsockname()[1]
        for host, reason in (("127.0.0.1", "Address already in use"), ("256.1.1.1", "")):
            assert main(["serve", "--model", str(tmp_path / "none"), "--host", host, "--port", str(port)]) == 2
            err = capsys.readouterr().err.strip()
            assert err.startswith(f"jaxembed serve: error: cannot listen on {host}:{port}: {reason}"), err
            assert "\n" not in err
    finally:
        taken.close()


def test_request_ids_with_a_tokenizer_copy_and_ids_beyond_the_vocabulary(embedder):
    """Long texts are tokenized with a copy of the tokenizer (so they never hold up short requests): the same
    ids. A tokenizer larger than the model's vocabulary fails the one request that reaches past it (a 500
    naming the input), before it is queued: it failed the whole merged batch, deep in the model."""
    import copy
    import json

    from jaxembed.serve.api import RequestError, parse_request, request_ids

    texts = ["a long text about parsing JSON, " * 200, "short"]
    req = parse_request(json.dumps({"input": texts}).encode(), embedding_dim=embedder.embedding_dim,
                        vocab_size=embedder.vocab_size, max_inputs=4)
    assert request_ids(embedder, req, copy.deepcopy(embedder.tokenizer), threading.Lock()) == embedder.tokenize(texts)

    class SmallVocabulary(Gated):
        vocab_size = 40

    with pytest.raises(RequestError, match=r"input\[0\] tokenizes to id \d+, outside this model's vocabulary of 40") \
            as err:
        request_ids(SmallVocabulary(embedder), req)
    assert err.value.status == 500 and err.value.kind == "server_error"


def test_limits_a_worker_cannot_keep_are_refused_up_front(embedder, tmp_path, capsys):
    """A batch wait past the request timeout (inf overflowed the worker's wait and stopped it: every request then
    timed out while /health said ok), an infinite or sub-byte body limit: one line naming the flag, exit 2."""
    from jaxembed.cli import main

    for flags, message in ((["--max-wait-ms", "inf"], "--max-wait-ms must be from 0 to below --request-timeout (60 s)"),
                           (["--max-wait-ms", "2000", "--request-timeout", "1"], "below --request-timeout (1 s)"),
                           (["--max-body-mb", "inf"], "--max-body-mb must be positive and finite, got inf"),
                           (["--max-body-mb", "1e-9"], "--max-body-mb must be at least one byte"),
                           (["--request-timeout", "inf"], "--request-timeout must be positive and finite")):
        assert main(["serve", "--model", str(tmp_path / "none"), *flags]) == 2
        assert message in capsys.readouterr().err, flags
    with pytest.raises(ValueError, match="max_wait_ms must be a number from 0 to below request_timeout"):
        create_app(embedder, max_wait_ms=float("inf"))


def test_cli_serves_on_loopback_and_drains_on_sigterm(embedder, hf_model_dir):
    """`jaxembed serve` in a subprocess: a request in flight when SIGTERM arrives still gets its embedding. The
    warmup (one shape here) says what it does and did: jaxembed's log lines had no handler and never showed."""
    proc = subprocess.Popen([sys.executable, "-m", "jaxembed.cli", "serve", "--model", str(hf_model_dir[0]),
                             "--port", "0", "--served-model-name", "tiny", "--no-access-log", "--batch-size", "1",
                             "--warmup-max-length", "1"],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    lines = []
    try:
        reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
        reader.start()
        deadline = time.monotonic() + 60
        port = None
        while port is None:
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            found = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", "".join(lines))
            port = found and int(found.group(1))
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}"
        result = {}
        request = threading.Thread(target=lambda: result.update(
            r=httpx.post(f"{url}/v1/embeddings", json={"input": TEXTS[0], "model": "tiny"}, timeout=60)))
        request.start()
        while True:  # until the server counts the request in flight (its first call compiles: seconds)
            m = metric_values(httpx.get(f"{url}/metrics", timeout=10).text)
            if m[("jaxembed_requests_in_flight", ())] == 1:
                break
            assert request.is_alive(), "the request finished before SIGTERM could be sent"
        proc.send_signal(signal.SIGTERM)
        request.join(60)
        assert proc.wait(60) == -signal.SIGTERM  # uvicorn re-raises the signal once it has shut down
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(10)
    log = "".join(lines)
    assert "Shutting down" in log and "Finished server process" in log, log
    assert "INFO:     warming up: compiling every batch shape for inputs up to 1 tokens" in log, log
    assert re.search(r"INFO:     warmed up 1 batch shapes for inputs up to 1 tokens in [\d.]+ s", log), log
    np.testing.assert_allclose(rows(result["r"])[0], embedder.encode(TEXTS[0]), atol=1e-5)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=5)


def test_the_default_served_name_is_the_model_directorys_own(tmp_path, monkeypatch):
    """`--model .` served the name "jaxembed" (the name of "." is ""); a hub id is served as given."""
    from jaxembed.serve import default_served_name

    (tmp_path / "codestral-embed" / "sub").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "codestral-embed")
    assert [default_served_name(m) for m in (".", "./", "sub/..", str(tmp_path / "codestral-embed") + "/")] == [
        "codestral-embed"] * 4
    assert default_served_name("org/some-model") == "org/some-model"
