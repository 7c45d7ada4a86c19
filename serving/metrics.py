"""What the server counts, exposed two ways: Prometheus text at `/metrics`, a JSON summary at `/stats`.

Prometheus histograms answer "how many under X ms"; an operator reading `/stats` wants p50/p99, which
histograms only approximate, so latencies are also kept in a bounded window of recent values. Each
gunicorn worker process counts its own traffic (the registry is per process, not multiprocess mode).
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client import Counter as PCounter

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
WINDOW = 10000


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return round(ordered[index], 3)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = PCounter("pagoda_requests", "HTTP requests answered", ["route", "status"], registry=r)
        self.decisions = PCounter("pagoda_decisions", "states decided", registry=r)
        self.questions = PCounter("pagoda_questions", "questions answered", registry=r)
        self.tokens = PCounter("pagoda_tokens", "input tokens run through the model", registry=r)
        self.latency = Histogram("pagoda_request_latency_seconds", "request latency", ["route"],
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("pagoda_queue_wait_seconds", "time a state waited for its forward pass",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.batch_rows = Histogram("pagoda_batch_questions", "question rows per forward pass",
                                    buckets=_BATCH_BUCKETS, registry=r)
        self.batch_requests = Histogram("pagoda_batch_states", "states (from any requests) per forward pass",
                                        buckets=_BATCH_BUCKETS, registry=r)
        self.forward_seconds = Histogram("pagoda_forward_seconds", "model forward pass time",
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("pagoda_queue_depth", "states waiting for the model", registry=r)
        self.ready = Gauge("pagoda_ready", "1 once the model is loaded", registry=r)
        self._lock = threading.Lock()
        self._latency_ms: deque[float] = deque(maxlen=WINDOW)
        self._queue_ms: deque[float] = deque(maxlen=WINDOW)
        self._batch_sizes: Counter[int] = Counter()
        self._by_route: Counter[str] = Counter()
        self._by_status: Counter[int] = Counter()
        self._totals = Counter()
        self.started = time.time()

    def observe_request(self, route: str, status: int, latency_s: float) -> None:
        self.requests.labels(route, str(status)).inc()
        self.latency.labels(route).observe(latency_s)
        with self._lock:
            self._by_route[route] += 1
            self._by_status[status] += 1
            if status == 200 and route.startswith(("/decide", "/v1/systemone")):
                self._latency_ms.append(latency_s * 1000)

    def observe_decisions(self, states: int, questions: int, tokens: int) -> None:
        self.decisions.inc(states)
        self.questions.inc(questions)
        self.tokens.inc(tokens)
        with self._lock:
            self._totals.update(decisions=states, questions=questions, tokens=tokens)

    def observe_batch(self, states: int, rows: int, forward_s: float, queue_waits_s: list[float]) -> None:
        self.batch_rows.observe(rows)
        self.batch_requests.observe(states)
        self.forward_seconds.observe(forward_s)
        for wait in queue_waits_s:
            self.queue_wait.observe(wait)
        with self._lock:
            self._batch_sizes[rows] += 1
            self._totals.update(batches=1)
            self._queue_ms.extend(w * 1000 for w in queue_waits_s)

    def prometheus(self) -> bytes:
        return generate_latest(self.registry)

    def summary(self) -> dict:
        with self._lock:
            latency, queue = list(self._latency_ms), list(self._queue_ms)
            return {
                "uptime_s": round(time.time() - self.started, 1),
                "requests": {"total": sum(self._by_route.values()), "by_route": dict(self._by_route),
                             "by_status": {str(k): v for k, v in sorted(self._by_status.items())}},
                "decisions": self._totals["decisions"],
                "questions": self._totals["questions"],
                "tokens": self._totals["tokens"],
                "batches": self._totals["batches"],
                "batch_size_histogram": {str(k): v for k, v in sorted(self._batch_sizes.items())},
                "queue_ms": {"p50": _percentile(queue, 0.5), "p99": _percentile(queue, 0.99), "window": len(queue)},
                "latency_ms": {"p50": _percentile(latency, 0.5), "p99": _percentile(latency, 0.99),
                               "window": len(latency)},
            }
