"""The upstream servers: a connection pool each, their health, and which one of a group takes a request.

Each upstream has one urllib3 pool sized to the gateway's request threads, so every request thread can hold
a kept-alive connection and no request waits for another's. Health is a small state machine fed by the
checker (`GET --health-path` every `--health-interval-s`) and by requests that could not connect:
`--health-fails` failures in a row take an upstream out of rotation, `--health-passes` passed checks in a
row put it back (only checks restore: an upstream out of rotation gets no requests to prove itself with).
Within a group the healthy member with the fewest requests in flight takes the next one, ties taken in
turn; a group with no healthy member gives way to the fallback group, and with none either its members
are tried anyway: a connection refused is a faster, truer answer than a guess that they are all down.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from itertools import count

import urllib3
from urllib3.exceptions import HTTPError

from serving.gateway.config import GatewayConfig, UpstreamSpec
from serving.gateway.cut import TrackedHTTPConnection, TrackedHTTPSConnection
from serving.gateway.failures import classify
from serving.gateway.metrics import GatewayMetrics

log = logging.getLogger("pagoda.gateway")


class Upstream:
    def __init__(self, spec: UpstreamSpec, cfg: GatewayConfig, metrics: GatewayMetrics):
        self.group = spec.group
        self.url = spec.url + spec.base_path
        self.base_path = spec.base_path
        self.cfg = cfg
        # block=False: past maxsize a request opens a connection of its own rather than waiting for one.
        self.pool = urllib3.connection_from_url(
            spec.url, maxsize=cfg.threads, block=False, retries=False,
            timeout=urllib3.Timeout(connect=cfg.connect_timeout_s, read=cfg.upstream_timeout_s))
        # connections a request's client can cut loose (`cut.Cut`)
        self.pool.ConnectionCls = TrackedHTTPSConnection if spec.url.startswith("https") else TrackedHTTPConnection
        self.series = metrics.upstream(self.group, self.url)
        self.up = True            # optimistic until the first check says otherwise
        self.error: str | None = None
        self.model_ids: tuple[str, ...] = ()
        self.in_flight = 0
        self._fails = 0
        self._passes = 0
        self._lock = threading.Lock()
        self.series.healthy.set(1)

    def __repr__(self) -> str:
        return f"{self.group} ({self.url})"

    def enter(self) -> None:
        with self._lock:
            self.in_flight += 1
        self.series.in_flight.inc()

    def leave(self) -> None:
        with self._lock:
            self.in_flight -= 1
        self.series.in_flight.dec()

    def passed(self, by_check: bool) -> None:
        with self._lock:
            self._fails = 0
            if self.up or not by_check:
                return
            self._passes += 1
            if self._passes < self.cfg.health_passes:
                return
            self.up, self.error, self._passes = True, None, 0
        self.series.healthy.set(1)
        log.warning("upstream %r is back in rotation", self)
        self.refresh_models()

    def failed(self, why: str) -> None:
        with self._lock:
            self._passes = 0
            self._fails += 1
            self.error = why
            if not self.up or self._fails < self.cfg.health_fails:
                return
            self.up = False
        self.series.healthy.set(0)
        log.warning("upstream %r taken out of rotation: %s", self, why)

    def check(self) -> None:
        try:
            resp = self.pool.urlopen("GET", self.base_path + self.cfg.health_path, retries=False, redirect=False,
                                     timeout=urllib3.Timeout(total=self.cfg.health_timeout_s))
        except (HTTPError, OSError) as exc:
            self.failed(f"health check: {classify(exc).words}")
            return
        if 200 <= resp.status < 300:
            self.passed(by_check=True)
        else:
            self.failed(f"health check answered {resp.status}")

    def models(self) -> list[dict]:
        """The upstream's `/v1/models` entries (none when it has no such route or does not answer)."""
        try:
            resp = self.pool.urlopen("GET", self.base_path + "/v1/models", retries=False, redirect=False,
                                     timeout=urllib3.Timeout(total=self.cfg.health_timeout_s))
            data = json.loads(resp.data) if resp.status == 200 else {}
        except (HTTPError, OSError, ValueError):
            return []
        entries = data.get("data") if isinstance(data, dict) else None
        return [e for e in entries if isinstance(e, dict) and isinstance(e.get("id"), str)] if isinstance(
            entries, list) else []

    def refresh_models(self) -> list[dict]:
        entries = self.models()
        # What a generation request may name here: a pagoda upstream also lists its decision model (kind laya
        # or student), which its chat route would answer with 404; other servers' entries carry no kind.
        generating = tuple(e["id"] for e in entries if e.get("kind", "generation") == "generation")
        if generating:
            self.model_ids = generating
        return entries

    def status(self) -> dict:
        return {"group": self.group, "url": self.url, "up": self.up, "in_flight": self.in_flight,
                "error": self.error}


class Upstreams:
    """The groups, in `--upstream` order, and the health checkers that watch their members."""

    def __init__(self, cfg: GatewayConfig, metrics: GatewayMetrics):
        self.cfg = cfg
        self.all = [Upstream(spec, cfg, metrics) for spec in cfg.upstreams]
        self.groups: dict[str, list[Upstream]] = {}
        for u in self.all:
            self.groups.setdefault(u.group, []).append(u)
        self._turn = {group: count() for group in self.groups}
        self._stop = threading.Event()

    def candidates(self, group: str, fallback: str | None) -> tuple[str, list[Upstream]]:
        """The group that takes a request (the fallback when `group` has no healthy member and it has one)
        and its members in the order to try them."""
        healthy = [u for u in self.groups[group] if u.up]
        if not healthy and fallback is not None and fallback != group:
            spare = [u for u in self.groups[fallback] if u.up]
            if spare:
                return fallback, self._ordered(fallback, spare)
        return group, self._ordered(group, healthy or self.groups[group])

    def _ordered(self, group: str, members: list[Upstream]) -> list[Upstream]:
        if len(members) == 1:
            return members
        start = next(self._turn[group])
        n = len(members)
        return sorted(members, key=lambda u: (u.in_flight, (members.index(u) - start) % n))

    def start_checks(self, on_first_round: Callable[[], None]) -> None:
        """One checker thread per upstream; `on_first_round` once every upstream was checked once."""
        remaining = [len(self.all)]
        lock = threading.Lock()

        def watch(upstream: Upstream) -> None:
            upstream.check()
            if upstream.up:
                upstream.refresh_models()
            with lock:
                remaining[0] -= 1
                if remaining[0] == 0:
                    on_first_round()
            while not self._stop.wait(self.cfg.health_interval_s):
                upstream.check()

        for u in self.all:
            threading.Thread(target=watch, args=(u,), name=f"pagoda-health-{u.group}", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

