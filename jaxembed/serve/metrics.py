"""The server's Prometheus metrics (prometheus_client), in a registry of the app's own, so that several apps
in one process (tests) count apart. Served as text at GET /metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_COUNTS = tuple(float(1 << k) for k in range(12))  # 1 .. 2048
_TOKENS = tuple(float(1 << k) for k in range(4, 22, 2))  # 16 .. 1M


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("jaxembed_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.request_seconds = Histogram("jaxembed_request_seconds",
                                         "POST /v1/embeddings latency, body read to response, by status code",
                                         ["status"], buckets=_SECONDS, registry=r)
        self.in_flight = Gauge("jaxembed_requests_in_flight", "POST /v1/embeddings requests being handled",
                               registry=r)
        self.inputs = Counter("jaxembed_inputs", "inputs embedded", registry=r)
        self.tokens = Counter("jaxembed_tokens", "tokens embedded (EOS and query prompts included)", registry=r)
        self.queue_depth = Gauge("jaxembed_queue_depth", "requests waiting for a batch", registry=r)
        self.queue_seconds = Histogram("jaxembed_queue_seconds", "time a request waited for its batch to start",
                                       buckets=_SECONDS, registry=r)
        self.batches = Counter("jaxembed_batches", "merged batches run by the worker", registry=r)
        self.batch_requests = Histogram("jaxembed_batch_requests", "requests merged into a batch",
                                        buckets=_COUNTS, registry=r)
        self.batch_inputs = Histogram("jaxembed_batch_inputs", "inputs in a merged batch", buckets=_COUNTS,
                                      registry=r)
        self.batch_tokens = Histogram("jaxembed_batch_tokens", "tokens in a merged batch", buckets=_TOKENS,
                                      registry=r)
        self.batch_seconds = Histogram("jaxembed_batch_seconds", "time the worker spent on a merged batch",
                                       buckets=_SECONDS, registry=r)

    def observe_batch(self, jobs, n_inputs: int, started: float, ended: float) -> None:
        self.batches.inc()
        self.batch_requests.observe(len(jobs))
        self.batch_inputs.observe(n_inputs)
        self.batch_tokens.observe(sum(job.tokens for job in jobs))
        self.batch_seconds.observe(ended - started)
        for job in jobs:
            self.queue_seconds.observe(started - job.enqueued)
