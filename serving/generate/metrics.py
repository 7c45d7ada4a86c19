"""The generation series: requests by route and finish reason, tokens, latencies, and the engine's state.

Latencies are measured where the client's view begins and ends, the request thread: time to first token
from the request's arrival, the gap between consecutive tokens of one choice, end to end. The engine's
own figures (running and waiting sequences, KV utilisation, cache savings) are read from the engine loop
when `/metrics` or `/stats` asks, between two steps, so they are never stale and cost nothing otherwise.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client import Counter as PCounter
from prometheus_client.core import GaugeMetricFamily

from serving.metrics import LATENCY_BUCKETS, WINDOW, window_summary

ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5.0)
E2E_BUCKETS = (*LATENCY_BUCKETS, 60.0, 120.0, 300.0)
ENGINE_GAUGES = {
    "running_requests": "sequences being computed (prefill or decode)",
    "waiting_requests": "requests waiting for the engine (never admitted, or preempted)",
    "kv_utilization": "share of the KV pool held by requests, pins and the prefix cache",
    "prefill_skip_ratio": "share of prompt tokens served from the prefix cache so far",
    "pins": "pinned KV prefixes",
    "pinned_bytes": "KV pool bytes pins hold (at most --generate-max-pinned-fraction of the pool)",
    "kv_pool_bytes": "the KV pool's size in bytes (allocated once)",
}


class EngineCollector:
    """Prometheus gauges read from the engine at scrape time (one `EngineLoop.stats` per scrape)."""

    def __init__(self, read: Callable[[], dict | None]):
        self.read = read

    def collect(self):
        stats = self.read()
        if stats is None:  # not loaded yet
            return
        for key, help_text in ENGINE_GAUGES.items():
            yield GaugeMetricFamily(f"pagoda_generation_{key}", help_text, value=float(stats[key]))


TOKEN_COUNTERS = {"prompt": "prompt tokens of answered requests",
                  "cached": "prompt tokens served from the prefix cache or a pin", "output": "tokens generated"}
LATENCIES = {"ttft": ("request arrival to its first generated token", E2E_BUCKETS),
             "inter_token": ("gap between consecutive tokens of one choice", ITL_BUCKETS),
             "e2e": ("request arrival to its last token", E2E_BUCKETS)}


class GenerateMetrics:
    def __init__(self, registry: CollectorRegistry, read_engine: Callable[[], dict | None]) -> None:
        self.requests = PCounter("pagoda_generation_requests", "generation choices ended, by route and finish reason",
                                 ["route", "finish_reason"], registry=registry)
        self.tokens = {k: PCounter(f"pagoda_generation_{k}_tokens", text, registry=registry)
                       for k, text in TOKEN_COUNTERS.items()}
        suffix = {"ttft": "ttft_seconds", "inter_token": "inter_token_seconds", "e2e": "e2e_seconds"}
        self.latency = {k: Histogram(f"pagoda_generation_{suffix[k]}", text, buckets=buckets, registry=registry)
                        for k, (text, buckets) in LATENCIES.items()}
        registry.register(EngineCollector(read_engine))
        self._lock = threading.Lock()
        self._ttft_ms: deque[float] = deque(maxlen=WINDOW)
        self._itl_ms: deque[float] = deque(maxlen=WINDOW)
        self._finished: Counter[str] = Counter()
        self._tokens: Counter[str] = Counter()

    def observe_request(self, route: str, finish_reasons: list[str], prompt_tokens: int, cached_tokens: int,
                        output_tokens: int, ttft_s: float | None, itl_s: list[float], e2e_s: float) -> None:
        for reason in finish_reasons:
            self.requests.labels(route, reason).inc()
        counts = {"prompt": prompt_tokens, "cached": cached_tokens, "output": output_tokens}
        for key, count in counts.items():
            self.tokens[key].inc(count)
        if ttft_s is not None:
            self.latency["ttft"].observe(ttft_s)
        for gap in itl_s:
            self.latency["inter_token"].observe(gap)
        self.latency["e2e"].observe(e2e_s)
        with self._lock:
            self._finished.update(f"{route} {reason}" for reason in finish_reasons)
            self._tokens.update(counts)
            if ttft_s is not None:
                self._ttft_ms.append(ttft_s * 1000)
            self._itl_ms.extend(gap * 1000 for gap in itl_s)

    def stats(self) -> dict:
        with self._lock:
            by_route: dict[str, dict[str, int]] = {}
            for key, count in sorted(self._finished.items()):
                route, reason = key.rsplit(" ", 1)
                by_route.setdefault(route, {})[reason] = count
            return {"finished": by_route, "prompt_tokens": self._tokens["prompt"],
                    "cached_tokens": self._tokens["cached"], "output_tokens": self._tokens["output"],
                    "ttft_ms": window_summary(self._ttft_ms), "inter_token_ms": window_summary(self._itl_ms)}
