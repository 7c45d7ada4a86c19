"""Cross-request batching: one model-worker thread per process turns concurrent requests into padded batches.

Request threads prepare their work (validation, tokenisation) themselves and `submit` it; the worker
takes units from the front of one FIFO queue until the batch would pass `max_batch_questions` rows or
`max_batch_tokens` padded tokens, runs ONE forward pass and hands each unit its own slice back. It
waits (at most `max_wait_ms`) for company only while other requests are still being prepared
(`arriving`), so a lone client never pays the wait and a crowd fills the batch. Throughput then grows
with concurrency because a forward pass over many rows costs far less than that many passes of a few rows.

Safety properties the tests hold it to:
- A full queue refuses at submit (`QueueFull` → 503 + Retry-After) instead of growing without bound.
- A request past its deadline stops waiting (`DeadlineExceeded` → 504); the worker skips its units
  if they have not run yet, and nothing else in the queue moves.
- A forward pass that fails with several requests in it is re-run in halves, down to the request that
  fails alone, so one request's bad input fails only that request and every other one still gets its own
  answer. (Bad input should never get that far: laya refuses at `prepare` what a model cannot hold.)
With `batching=False` the worker runs exactly one request per pass: the baseline the benchmark compares to.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from serving.decide.metrics import DecideMetrics

log = logging.getLogger("pagoda.batcher")


class QueueFull(Exception):
    """No room for a request's states; `full` when the queue is at `BatchLimits.max_queue` (not stopping), so
    the caller can name the setting that bounds it."""

    def __init__(self, message: str, full: bool = False):
        super().__init__(message)
        self.full = full


class DeadlineExceeded(Exception):
    pass


class ModelError(Exception):
    pass


@dataclass(frozen=True)
class BatchLimits:
    max_questions: int = 256
    max_tokens: int = 65536
    max_wait_ms: float = 5.0
    max_queue: int = 1024
    batching: bool = True


class Pending:
    """One request's units in flight; `wait` returns their outputs in submission order."""

    def __init__(self, n_units: int, deadline: float):
        self.outputs: list[Any] = [None] * n_units
        self.remaining = n_units
        self.deadline = deadline
        self.enqueued = time.monotonic()
        self.started: float | None = None
        self.error: BaseException | None = None
        self.abandoned = False
        self._done = threading.Event()
        if n_units == 0:
            self._done.set()

    @property
    def queue_ms(self) -> float:
        return round(((self.started or self.enqueued) - self.enqueued) * 1000, 3)

    def wait(self) -> list[Any]:
        if not self._done.wait(timeout=max(0.0, self.deadline - time.monotonic())):
            self.abandoned = True  # the worker drops any of our units it has not run yet
            raise DeadlineExceeded()
        if self.error is not None:
            raise self.error
        return self.outputs

    def _start(self, now: float) -> None:
        if self.started is None:
            self.started = now

    def _deliver(self, index: int, output: Any) -> None:
        self.outputs[index] = output
        self.remaining -= 1
        if self.remaining == 0:
            self._done.set()

    def _fail(self, error: BaseException) -> None:
        if not self._done.is_set():
            self.error = error
            self._done.set()


@dataclass
class _Entry:
    pending: Pending
    index: int
    unit: Any
    rows: int
    width: int


class Batcher:
    """`run(units) -> outputs` is the backend's one padded forward pass over any mix of units."""

    def __init__(self, run: Callable[[list[Any]], list[Any]], limits: BatchLimits, metrics: DecideMetrics):
        self._run = run
        self.limits = limits
        self.metrics = metrics
        self._queue: deque[_Entry] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._arriving = 0
        self._local = threading.local()
        self._thread = threading.Thread(target=self._loop, name="pagoda-model-worker", daemon=True)
        self._thread.start()

    def submit(self, units: Sequence[Any], costs: Sequence[tuple[int, int]], deadline: float) -> Pending:
        """Queue a request's units; `costs[i]` is `(rows, tokens per row)` of `units[i]`."""
        pending = Pending(len(units), deadline)
        with self._cv:
            if self._stopping:
                raise QueueFull("server is stopping")
            if len(self._queue) + len(units) > self.limits.max_queue:
                # Requests that gave up (504) or failed still sit here until the worker reaches them;
                # they must not hold capacity a live request could use.
                now = time.monotonic()
                self._queue = deque(e for e in self._queue if not (
                    e.pending.abandoned or e.pending.error is not None or now >= e.pending.deadline))
            if len(self._queue) + len(units) > self.limits.max_queue:
                raise QueueFull(f"queue full ({len(self._queue)} states waiting, limit {self.limits.max_queue})", full=True)
            for index, (unit, (rows, width)) in enumerate(zip(units, costs)):
                self._queue.append(_Entry(pending, index, unit, rows, width))
            if getattr(self._local, "arriving", False):  # this request has arrived: stop waiting for it
                self._local.arriving = False
                self._arriving -= 1
            self.metrics.queue_depth.set(len(self._queue))
            self._cv.notify()
        return pending

    @contextmanager
    def arriving(self) -> Iterator[None]:
        """Held by a request thread from before `prepare` until after `submit`: tells the worker that
        waiting a moment would add this request to the batch it is about to run."""
        with self._cv:
            self._arriving += 1
            self._local.arriving = True
        try:
            yield
        finally:
            with self._cv:
                if self._local.arriving:  # left without submitting (bad input, queue full)
                    self._local.arriving = False
                    self._arriving -= 1
                    self._cv.notify()

    def stop(self, timeout: float = 5.0) -> None:
        """Finish what is queued, then end the worker."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            batch = self._collect()
            if batch is None:
                return
            try:
                self._execute(batch)
            except Exception as exc:  # noqa: BLE001 -- the worker must outlive any one batch
                log.exception("model worker error")
                for entry in batch:
                    entry.pending._fail(ModelError(str(exc)))

    def _collect(self) -> list[_Entry] | None:
        limits = self.limits
        with self._cv:
            while not self._queue:
                if self._stopping:
                    return None
                self._cv.wait()
            batch: list[_Entry] = []
            rows = width = 0
            wait_until: float | None = None
            while True:
                full = False
                while self._queue:
                    entry = self._queue[0]
                    now = time.monotonic()
                    if entry.pending.abandoned or entry.pending.error is not None:
                        self._queue.popleft()
                        continue
                    if now >= entry.pending.deadline:
                        self._queue.popleft()
                        entry.pending._fail(DeadlineExceeded())
                        continue
                    if batch and not limits.batching and entry.pending is not batch[0].pending:
                        full = True
                        break
                    new_rows, new_width = rows + entry.rows, max(width, entry.width)
                    if batch and (new_rows > limits.max_questions or new_rows * new_width > limits.max_tokens):
                        full = True
                        break
                    self._queue.popleft()
                    batch.append(entry)
                    rows, width = new_rows, new_width
                    if rows >= limits.max_questions:
                        full = True
                        break
                if full or not limits.batching or self._stopping or not batch or not self._arriving:
                    break
                now = time.monotonic()
                wait_until = wait_until or now + limits.max_wait_ms / 1000
                if now >= wait_until:
                    break
                self._cv.wait(wait_until - now)
            self.metrics.queue_depth.set(len(self._queue))
            return batch

    def _execute(self, batch: list[_Entry]) -> None:
        batch = [e for e in batch if not e.pending.abandoned]  # gave up while the batch was collecting
        if not batch:
            return
        start = time.monotonic()
        for entry in batch:
            entry.pending._start(start)
        waits = [start - entry.pending.enqueued for entry in batch]
        try:
            outputs = self._run([entry.unit for entry in batch])
        except Exception as exc:  # noqa: BLE001 -- reported per request below, never lost
            requests = list(dict.fromkeys(id(e.pending) for e in batch))  # in queue order
            if len(requests) == 1:
                log.exception("model forward failed")
                batch[0].pending._fail(ModelError(str(exc)))
                return
            # Re-run each half of the requests, and so on down the failing halves, so only the request that
            # breaks the model fails: one such request among n costs ~2*log2(n) more passes, not n passes
            # of one request each (which cut throughput from 32 to 13 req/s when 10% of requests did it).
            first = set(requests[:len(requests) // 2])
            self._execute([e for e in batch if id(e.pending) in first])
            self._execute([e for e in batch if id(e.pending) not in first])
            return
        forward_s = time.monotonic() - start
        self.metrics.observe_batch(len(batch), sum(e.rows for e in batch), forward_s, waits)
        for entry, output in zip(batch, outputs):
            entry.pending._deliver(entry.index, output)
