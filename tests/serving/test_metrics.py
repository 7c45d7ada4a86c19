"""Metrics are per route: each API route gets its own request counter and latency series, keyed by the
route's rule, in `/metrics` and in `/stats`; the decision API's own series sit in the same registry."""

from __future__ import annotations

import requests
from prometheus_client.parser import text_string_to_metric_families
from serving_support import BILLING_STATE


def samples(server) -> dict[str, list]:
    text = requests.get(server.url + "/metrics", timeout=10).text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def value(families, family: str, sample: str, **labels) -> float:
    return sum(s.value for s in families[family] if s.name == sample and s.labels == labels)


def test_each_route_has_its_own_series(server, billing_questions):
    before = samples(server)
    body = {"questions": billing_questions}
    for _ in range(2):
        assert requests.post(server.url + "/decide", json={"state": BILLING_STATE, **body}, timeout=60).ok
    assert requests.post(server.url + "/decide/batch", json={"states": [BILLING_STATE] * 3, **body}, timeout=60).ok
    assert requests.post(server.url + "/decide/batch", json={"states": 3, **body}, timeout=60).status_code == 422
    after = samples(server)

    def delta(family, sample, **labels):
        return value(after, family, sample, **labels) - value(before, family, sample, **labels)

    assert delta("pagoda_requests", "pagoda_requests_total", route="/decide", status="200") == 2
    assert delta("pagoda_requests", "pagoda_requests_total", route="/decide/batch", status="200") == 1
    assert delta("pagoda_requests", "pagoda_requests_total", route="/decide/batch", status="422") == 1
    assert delta("pagoda_request_latency_seconds", "pagoda_request_latency_seconds_count", route="/decide") == 2
    assert delta("pagoda_request_latency_seconds", "pagoda_request_latency_seconds_count", route="/decide/batch") == 2
    assert delta("pagoda_decisions", "pagoda_decisions_total") == 5  # the decision API's own series

    stats = requests.get(server.url + "/stats", timeout=10).json()
    by_route = stats["latency_ms"]["by_route"]
    assert by_route["/decide"]["window"] >= 2 and by_route["/decide/batch"]["window"] >= 1
    assert by_route["/decide/batch"]["p50"] > 0
    # the server's own routes are counted but are not an API's latency
    assert "/metrics" not in by_route and stats["requests"]["by_route"]["/metrics"] >= 2
    assert stats["latency_ms"]["window"] == sum(r["window"] for r in by_route.values())
