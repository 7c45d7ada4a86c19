"""The decision API's own series: what was decided and how the batcher shaped the forward passes.

Registered in the server's registry (so `/metrics` shows them beside the per-route request series) and
summarised for `/stats`; the batch-size histogram there counts question rows per forward pass, the figure
`pagoda bench serve` reads to show that requests really shared passes.
"""

from __future__ import annotations

import threading
from collections import Counter, deque

from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client import Counter as PCounter

from serving.metrics import LATENCY_BUCKETS, WINDOW, window_summary

_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class DecideMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry if registry is not None else CollectorRegistry()
        self.decisions = PCounter("pagoda_decisions", "states decided", registry=r)
        self.questions = PCounter("pagoda_questions", "questions answered", registry=r)
        self.tokens = PCounter("pagoda_tokens", "input tokens run through the model", registry=r)
        self.deferred = PCounter("pagoda_deferred_answers", "a student's answers the Laya model gave instead "
                                 "(--defer-below)", registry=r)
        self.deferral_errors = PCounter("pagoda_deferral_errors", "states whose unsure answers stayed the "
                                        "student's because the remote teacher (--defer-to) gave none", registry=r)
        self.queue_wait = Histogram("pagoda_queue_wait_seconds", "time a state waited for its forward pass",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.batch_rows = Histogram("pagoda_batch_questions", "question rows per forward pass",
                                    buckets=_BATCH_BUCKETS, registry=r)
        self.batch_states = Histogram("pagoda_batch_states", "states (from any requests) per forward pass",
                                      buckets=_BATCH_BUCKETS, registry=r)
        self.forward_seconds = Histogram("pagoda_forward_seconds", "model forward pass time",
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("pagoda_queue_depth", "states waiting for the model", registry=r)
        self.ready = Gauge("pagoda_ready", "1 once the decision model is loaded", registry=r)
        self._lock = threading.Lock()
        self._queue_ms: deque[float] = deque(maxlen=WINDOW)
        self._batch_sizes: Counter[int] = Counter()
        self._totals: Counter[str] = Counter()

    def observe_decisions(self, states: int, questions: int, tokens: int, deferred: int = 0,
                          deferral_errors: int = 0) -> None:
        self.decisions.inc(states)
        self.questions.inc(questions)
        self.tokens.inc(tokens)
        self.deferred.inc(deferred)
        self.deferral_errors.inc(deferral_errors)
        with self._lock:
            self._totals.update(decisions=states, questions=questions, tokens=tokens, deferred=deferred,
                                deferral_errors=deferral_errors)

    def observe_batch(self, states: int, rows: int, forward_s: float, queue_waits_s: list[float]) -> None:
        self.batch_rows.observe(rows)
        self.batch_states.observe(states)
        self.forward_seconds.observe(forward_s)
        for wait in queue_waits_s:
            self.queue_wait.observe(wait)
        with self._lock:
            self._batch_sizes[rows] += 1
            self._totals.update(batches=1)
            self._queue_ms.extend(w * 1000 for w in queue_waits_s)

    def stats(self) -> dict:
        with self._lock:
            return {
                "decisions": self._totals["decisions"],
                "questions": self._totals["questions"],
                "tokens": self._totals["tokens"],
                "deferred_answers": self._totals["deferred"],
                "deferral_errors": self._totals["deferral_errors"],
                "batches": self._totals["batches"],
                "batch_size_histogram": {str(k): v for k, v in sorted(self._batch_sizes.items())},
                "queue_ms": window_summary(self._queue_ms),
            }
