"""Dynamic batching: requests queue up, and one worker thread merges them into batches by a token budget
and a maximum wait, runs each batch with one call (the embedder's `encode_ids`, which sorts by length,
buckets and chunks vertically), and hands every request its own rows.

The event loop only appends to the queue and awaits a future; the device work runs in the worker thread
(JAX releases the GIL while it computes), so the server keeps accepting requests while a batch runs. The
queue is bounded (`QueueFull`); a request that gives up waiting is taken out of the queue (`cancel`);
`close` stops taking new requests and returns once the worker has run every queued one, or after a limit. A merged batch
that fails is run again one request at a time, so only the request that fails gets the error. A worker
that stops on an unexpected error fails what is queued and refuses new requests (`stopped`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

log = logging.getLogger("jaxembed.serve")


class QueueFull(RuntimeError):
    """The queue holds its maximum of waiting requests."""


class Closed(RuntimeError):
    """The batcher is shutting down and takes no new requests."""


class Job:
    """One request's token-id sequences, waiting for its rows."""

    __slots__ = ("ids", "tokens", "future", "loop", "enqueued")

    def __init__(self, ids: Sequence[Sequence[int]], tokens: int, loop: asyncio.AbstractEventLoop):
        self.ids = ids
        self.tokens = tokens
        self.loop = loop
        self.future: asyncio.Future = loop.create_future()
        self.enqueued = time.monotonic()


def _resolve(future: asyncio.Future, rows, error) -> None:
    if future.done():  # the request timed out or its client went away
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(rows)


class Batcher:
    """run(ids) -> float32 [len(ids), d] is called in the worker thread with the merged id lists of a batch.

    batch_tokens: a batch takes queued requests, oldest first, while their tokens add up to at most this
    (a larger request runs alone). max_wait: seconds a batch waits, counted from its oldest request's
    arrival, for more requests to fill it; a busy worker merges whatever queued meanwhile without waiting.
    max_queue: requests that may wait (not yet in a running batch); one more raises QueueFull.
    """

    def __init__(self, run: Callable[[list], np.ndarray], *, batch_tokens: int, max_wait: float, max_queue: int,
                 metrics=None):
        self._run = run
        self.batch_tokens = batch_tokens
        self.max_wait = max_wait
        self.max_queue = max_queue
        self.metrics = metrics
        self._queue: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None
        self.stopped: str | None = None  # why the worker stopped, when it did on an error
        self.batches = 0  # merged batches run so far

    @property
    def queued(self) -> int:
        """Requests waiting for a batch."""
        return len(self._queue)

    @property
    def closing(self) -> bool:
        return self._closing

    def start(self) -> None:
        self._thread = threading.Thread(target=self._work, name="jaxembed-batcher", daemon=True)
        self._thread.start()

    def submit(self, ids: Sequence[Sequence[int]], tokens: int) -> Job:
        """Queue a request (from the event loop's thread); await `job.future` for its rows."""
        job = Job(ids, tokens, asyncio.get_running_loop())
        with self._cond:
            if self.stopped is not None:
                raise Closed(f"the batch worker stopped ({self.stopped})")
            if self._closing:
                raise Closed("the server is shutting down")
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"the request queue is full ({self.max_queue} requests waiting); retry later")
            self._queue.append(job)
            self._set_depth()
            self._cond.notify()
        return job

    def cancel(self, job: Job) -> None:
        """Drop a request that no longer waits for its rows, unless its batch has started."""
        with self._cond:
            try:
                self._queue.remove(job)
            except ValueError:
                pass
            self._set_depth()

    async def close(self, timeout: float | None = None) -> bool:
        """Take no new requests, run the queued ones, and return when the worker has stopped, or after `timeout`
        seconds with the worker still running a batch (False; the thread is a daemon and dies with the process)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is None:
            return True
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)
        if self._thread.is_alive():
            log.warning("the batch worker is still running after %.0f s; leaving it (%d request(s) still queued)",
                        timeout, self.queued)
            return False
        return True

    # ---- the worker thread ---------------------------------------------------------------
    def _set_depth(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(len(self._queue))

    def _take(self) -> list[Job] | None:
        """The next batch: the oldest request, then more while they fit the token budget, waiting up to
        max_wait from the oldest one's arrival for them. None once closing and the queue is empty."""
        with self._cond:
            while not self._queue:
                if self._closing:
                    return None
                self._cond.wait()
            first = self._queue.popleft()
            batch, tokens = [first], first.tokens
            deadline = first.enqueued + self.max_wait
            while tokens < self.batch_tokens:
                if self._queue:
                    if tokens + self._queue[0].tokens > self.batch_tokens:
                        break
                    job = self._queue.popleft()
                    batch.append(job)
                    tokens += job.tokens
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closing:
                    break
                self._cond.wait(remaining)
            self._set_depth()
            return batch

    def _work(self) -> None:
        batch: list[Job] = []
        try:
            while (batch := self._take()) is not None:
                ids = [seq for job in batch for seq in job.ids]
                started = time.monotonic()
                try:
                    out = self._run(ids)
                    bounds = np.cumsum([0] + [len(job.ids) for job in batch])
                    results = [(out[a:b], None) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
                except Exception as err:
                    # one request's inputs may be what failed: each runs alone, so the others still get their rows
                    results = [(None, err)] if len(batch) == 1 else [self._run_alone(job) for job in batch]
                self.batches += 1
                if self.metrics is not None:
                    self.metrics.observe_batch(batch, len(ids), started, time.monotonic())
                for job, (rows, error) in zip(batch, results, strict=True):
                    _answer(job, rows, error)
                batch = []
        except Exception as err:  # a bug outside the model call: fail what waits, refuse what comes
            log.exception("the batch worker stopped")
            with self._cond:
                self.stopped = f"{type(err).__name__}: {err}"
                waiting, batch = [*batch, *self._queue], []
                self._queue.clear()
                self._set_depth()
            for job in waiting:
                _answer(job, None, Closed(f"the batch worker stopped ({self.stopped})"))

    def _run_alone(self, job: Job):
        try:
            return self._run(list(job.ids)), None
        except Exception as err:
            return None, err


def _answer(job: Job, rows, error) -> None:
    try:
        job.loop.call_soon_threadsafe(_resolve, job.future, rows, error)
    except RuntimeError:  # its event loop has closed: nobody is waiting
        pass
