"""What the server counts, exposed two ways: Prometheus text at `/metrics`, a JSON summary at `/stats`.

The core counts requests and their latency per route, keyed by the route's rule, so every API's routes are
measured the same way without the core knowing any of them. Each API registers its own series (decisions,
batch sizes, tokens generated, ...) in the same registry and contributes its own part of `/stats`.

Prometheus histograms answer "how many under X ms"; an operator reading `/stats` wants p50/p99, which
histograms only approximate, so latencies are also kept in a bounded window of recent values per route.
Each gunicorn worker process counts its own traffic (the registry is per process, not multiprocess mode).
"""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict, deque
from collections.abc import Iterable

import numpy as np
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client import Counter as PCounter

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
WINDOW = 10000


def window_summary(values: Iterable[float]) -> dict:
    """p50/p99 of a window of milliseconds (None while empty) and how many values it holds."""
    values = list(values)
    if not values:
        return {"p50": None, "p99": None, "window": 0}
    p50, p99 = np.percentile(values, [50, 99])
    return {"p50": round(float(p50), 3), "p99": round(float(p99), 3), "window": len(values)}


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = PCounter("pagoda_requests", "HTTP requests answered", ["route", "status"], registry=r)
        self.latency = Histogram("pagoda_request_latency_seconds", "request latency", ["route"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self._lock = threading.Lock()
        self._latency_ms: defaultdict[str, deque[float]] = defaultdict(lambda: deque(maxlen=WINDOW))
        self._by_route: Counter[str] = Counter()
        self._by_status: Counter[int] = Counter()
        self.started = time.time()

    def observe_request(self, route: str, status: int, latency_s: float, api_route: bool) -> None:
        """`api_route`: the route is an API's (its successful latencies go into the `/stats` windows)."""
        self.requests.labels(route, str(status)).inc()
        self.latency.labels(route).observe(latency_s)
        with self._lock:
            self._by_route[route] += 1
            self._by_status[status] += 1
            if status == 200 and api_route:
                self._latency_ms[route].append(latency_s * 1000)

    def prometheus(self) -> bytes:
        return generate_latest(self.registry)

    def summary(self) -> dict:
        with self._lock:
            windows = {route: list(values) for route, values in sorted(self._latency_ms.items())}
            return {
                "uptime_s": round(time.time() - self.started, 1),
                "requests": {"total": sum(self._by_route.values()), "by_route": dict(self._by_route),
                             "by_status": {str(k): v for k, v in sorted(self._by_status.items())}},
                "latency_ms": {**window_summary(v for values in windows.values() for v in values),
                               "by_route": {route: window_summary(values) for route, values in windows.items()}},
            }
