"""The gateway's own series: per upstream requests, errors by kind, latency, time to first byte, in-flight
and health; per group the routes taken and why; the time routing decisions take.

The core already counts every route's requests and latency as the client saw them
(`pagoda_requests_total{route}`); these say which upstream answered and how it behaved, which is what an
operator needs to find the slow or failing replica behind one route. Each upstream's series are bound to
its labels once, so a request pays no label lookups. `/stats` keeps p50/p99 windows of the same figures.
"""

from __future__ import annotations

import threading
from collections import Counter, deque

from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client import Counter as PCounter

from serving.metrics import LATENCY_BUCKETS, WINDOW, window_summary

ERROR_KINDS = ("connect", "timeout", "reset", "invalid_response")
DECISION_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        labels = ["group", "upstream"]
        self.requests = PCounter("pagoda_gateway_upstream_requests", "requests an upstream answered, by the status "
                                 "it answered", [*labels, "status"], registry=r)
        self.errors = PCounter("pagoda_gateway_upstream_errors", "requests an upstream did not answer, or whose "
                               "stream broke, by kind (connect, timeout, reset, invalid_response)",
                               [*labels, "kind"], registry=r)
        self.disconnects = PCounter("pagoda_gateway_client_disconnects", "requests (streamed or whole) the client "
                                    "left before the upstream finished (the upstream request was closed)", labels,
                                    registry=r)
        self.latency = Histogram("pagoda_gateway_upstream_latency_seconds", "request sent to its last byte "
                                 "received", labels, buckets=LATENCY_BUCKETS, registry=r)
        self.ttfb = Histogram("pagoda_gateway_upstream_ttfb_seconds", "request sent to the first byte of the "
                              "body (a stream's first event; a whole answer's headers)", labels,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge("pagoda_gateway_upstream_in_flight", "requests sent and not yet finished", labels,
                               registry=r)
        self.healthy = Gauge("pagoda_gateway_upstream_healthy", "1 while an upstream is in rotation", labels,
                             registry=r)
        self.routes = PCounter("pagoda_gateway_routes", "requests by the group they were sent to and why (rule, "
                               "default, explicit, fallback, decision_failed)", ["group", "reason"], registry=r)
        self.decision = Histogram("pagoda_gateway_decision_seconds", "time to ask the rules' questions about one "
                                  "request", buckets=DECISION_BUCKETS, registry=r)
        self._lock = threading.Lock()
        self._totals: Counter[tuple[str, str]] = Counter()
        self._windows: dict[tuple[str, str], deque[float]] = {}
        self._decision_ms: deque[float] = deque(maxlen=WINDOW)

    def upstream(self, group: str, url: str) -> UpstreamSeries:
        return UpstreamSeries(self, group, url)

    def observe_route(self, group: str, reason: str, decision_s: float | None) -> None:
        self.routes.labels(group, reason).inc()
        if decision_s is not None:
            self.decision.observe(decision_s)
            with self._lock:
                self._decision_ms.append(decision_s * 1000)

    def _window(self, key: tuple[str, str]) -> deque[float]:
        with self._lock:
            return self._windows.setdefault(key, deque(maxlen=WINDOW))

    def stats(self, upstreams: list) -> dict:
        with self._lock:
            out = []
            for u in upstreams:
                totals = {k[1]: v for k, v in self._totals.items() if k[0] == u.url}
                out.append({"group": u.group, "url": u.url, "up": u.up, "in_flight": u.in_flight,
                            "requests": totals.pop("requests", 0), "errors": totals,
                            "latency_ms": window_summary(self._windows.get((u.url, "latency"), ())),
                            "ttfb_ms": window_summary(self._windows.get((u.url, "ttfb"), ()))})
            return {"upstreams": out, "decision_ms": window_summary(self._decision_ms)}


class UpstreamSeries:
    """One upstream's series, bound once."""

    def __init__(self, metrics: GatewayMetrics, group: str, url: str) -> None:
        self.metrics, self.url, self.labels = metrics, url, (group, url)
        self.latency = metrics.latency.labels(group, url)
        self.ttfb = metrics.ttfb.labels(group, url)
        self.in_flight = metrics.in_flight.labels(group, url)
        self.healthy = metrics.healthy.labels(group, url)
        self.disconnects = metrics.disconnects.labels(group, url)
        self._errors = {kind: metrics.errors.labels(group, url, kind) for kind in ERROR_KINDS}
        self._latency_ms = metrics._window((url, "latency"))
        self._ttfb_ms = metrics._window((url, "ttfb"))

    def answered(self, status: int) -> None:
        self.metrics.requests.labels(*self.labels, str(status)).inc()
        with self.metrics._lock:
            self.metrics._totals[(self.url, "requests")] += 1

    def first_byte(self, seconds: float) -> None:
        self.ttfb.observe(seconds)
        self._ttfb_ms.append(seconds * 1000)

    def finished(self, seconds: float) -> None:
        self.latency.observe(seconds)
        self._latency_ms.append(seconds * 1000)

    def error(self, kind: str) -> None:
        self._errors[kind].inc()
        with self.metrics._lock:
            self.metrics._totals[(self.url, kind)] += 1
