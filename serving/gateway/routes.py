"""`GatewayApi`: the gateway as the core's app factory mounts it, its routes and its part of the server's.

The routes are the generation API's (`/v1/chat/completions`, `/v1/completions`, `/v1/responses`, `/generate`) with the
generation API's error shapes (OpenAI's on `/v1/*`), so a client cannot tell the gateway from the server
behind it except by the `X-Pagoda-*` headers: `X-Pagoda-Route` (the group), `X-Pagoda-Route-Reason`,
`X-Pagoda-Upstream` (the server that answered) and, when a decision ran, `X-Pagoda-Decision-Ms`. The
core's `/v1/models` lists every healthy upstream's models and the groups a request may name; `/ready`
says which upstreams are up (503 while none is, or while the routing model loads).
"""

from __future__ import annotations

import json
import re
import threading
from functools import partial
from typing import Any

from flask import Blueprint, Response, g, request
from prometheus_client import CollectorRegistry

from serving.errors import PEER_GONE_KEY, ApiError, error_body
from serving.gateway import openapi
from serving.gateway.config import GatewayConfig
from serving.gateway.failures import Failure
from serving.gateway.metrics import GatewayMetrics
from serving.gateway.proxy import UpstreamFailed, exchange, request_headers
from serving.gateway.router import PROMPT_FIELDS, Decisions, Route, Router, read_body
from serving.gateway.rules import Rules
from serving.gateway.upstreams import Upstream, Upstreams
from serving.generate import openai
from serving.generate.streaming import DONE, sse

SEQUENCE_NUMBER = re.compile(rb'"sequence_number":\s*(\d+)')  # a Responses event's number, as the upstream wrote it


def openai_dialect(body: dict) -> dict:
    """OpenAI's error shape; an upstream that failed is the server's side of the exchange."""
    out = openai.error_dialect(body)
    if body["error"]["type"].startswith("upstream_") or body["error"]["type"] == "no_upstream":
        out["error"]["type"] = "server_error"
    return out


class GatewayApi:
    name = "gateway"

    def __init__(self, cfg: GatewayConfig, rules: Rules):
        """`rules`: the parsed route file (`Rules.load`), or `Rules.plain` without one."""
        self.cfg = cfg
        self.rules = rules
        self.upstreams: Upstreams | None = None
        self.router: Router | None = None
        self._reads_body = False
        self.metrics: GatewayMetrics | None = None
        self.decisions: Decisions | None = None
        self.loaded = threading.Event()
        self._checked = threading.Event()
        self.error_dialects = {"/v1/": openai_dialect}
        self.blueprint = Blueprint("gateway", __name__)
        for rule in PROMPT_FIELDS:
            self.blueprint.add_url_rule(rule, view_func=self.forward, methods=["POST"],
                                        endpoint=rule.strip("/").replace("/", "_"))
        # SGLang's RuntimeEndpoint (and our lang.HttpBackend) read this first, to pick a chat template by the
        # model's path; it has no prompt to route by, so the default group's upstream answers it
        self.blueprint.add_url_rule("/get_model_info", view_func=self.forward, methods=["GET"],
                                    endpoint="get_model_info")

    # What the app factory asks of every API.

    def start(self, registry: CollectorRegistry) -> None:
        self.metrics = GatewayMetrics(registry)
        self.upstreams = Upstreams(self.cfg, self.metrics)
        if self.rules.asks:
            self.decisions = Decisions(self.cfg, self.rules, registry)
            self.decisions.load_in_background()
        self.router = Router(self.rules, self.decisions)
        # Only what routing needs is parsed: one upstream group and no rules is a pure pass-through.
        self._reads_body = bool(self.rules.explicit or self.rules.asks or self.rules.policy.rules or self.cfg.retry
                                or len(self.upstreams.groups) > 1)
        threading.Thread(target=self._wait_loaded, name="pagoda-gateway-ready", daemon=True).start()
        self.upstreams.start_checks(self._checked.set)

    def _wait_loaded(self) -> None:
        self._checked.wait()
        if self.decisions is not None:
            while not self.decisions.loaded.wait(0.2):
                if self.decisions.error is not None:
                    return
        self.loaded.set()

    @property
    def error(self) -> str | None:
        return self.decisions.error if self.decisions is not None else None

    def status(self) -> dict:
        upstreams = [u.status() for u in self.upstreams.all]
        if not any(u["up"] for u in upstreams):
            raise ApiError(503, "no upstream is up: " + "; ".join(
                f"{u['group']} ({u['url']}): {u['error']}" for u in upstreams), "no_upstream",
                headers={"Retry-After": "1"})
        out: dict[str, Any] = {"upstreams": upstreams}
        if self.decisions is not None:
            out["routing_model"] = self.decisions.name
        return out

    def health(self) -> dict:
        """Which upstreams are in rotation (`/health` answers 200 either way: the gateway is up)."""
        return {"upstreams": [u.status() for u in self.upstreams.all]}

    def models(self) -> dict:
        merged: dict[str, dict] = {}
        for upstream in self.upstreams.all:
            if not upstream.up:
                continue
            for entry in upstream.refresh_models():
                seen = merged.setdefault(entry["id"], {**entry, "groups": []})
                if upstream.group not in seen["groups"]:
                    seen["groups"].append(upstream.group)
        groups = [{"id": name, "object": "model", "owned_by": "pagoda-gateway", "kind": "upstream_group",
                   "groups": [name]} for name in self.upstreams.groups if name in self.rules.explicit
                  and name not in merged]
        return {"data": [*merged.values(), *groups]}

    def stats(self) -> dict:
        out = {"gateway": self.metrics.stats(self.upstreams.all)}
        if self.decisions is not None:
            out["decisions"] = self.decisions.service.metrics.stats()
        return out

    def openapi(self) -> dict:
        return openapi.openapi()

    # The routes.

    def forward(self) -> Response:
        body = request.get_data(cache=False)
        parsed = read_body(body) if self._reads_body and request.method == "POST" else None
        route = self.router.route(request.path, parsed, g.request_id)
        group, members = self.upstreams.candidates(route.group, self.rules.fallback)
        reason = "fallback" if group != route.group else route.reason
        self.metrics.observe_route(group, reason, route.decision_s)
        extra = {"X-Pagoda-Route": group, "X-Pagoda-Route-Reason": reason}
        if route.decision_s is not None:
            extra["X-Pagoda-Decision-Ms"] = f"{route.decision_s * 1000:.3f}"
        retries = len(members) - 1 if self.cfg.retry and parsed is not None and parsed.get("stream") is not True else 0
        headers = request_headers(request.headers.items(), g.request_id)
        path = request.full_path if request.query_string else request.path
        on_break = partial(error_event, g.request_id, request.path)
        failed: list[UpstreamFailed] = []
        for upstream in members[:1 + retries]:
            sent = self._body_for(upstream, route, parsed, body)
            try:
                return exchange(upstream, request.method, path, sent, headers,
                                {**extra, "X-Pagoda-Upstream": upstream.url}, on_break,
                                request.environ.get(PEER_GONE_KEY))
            except UpstreamFailed as exc:
                failed.append(exc)
                if exc.failure.kind == "timeout":
                    break
        last = failed[-1]
        message = "; ".join(str(f) for f in failed)
        raise ApiError(last.failure.status, message, last.failure.type, headers={
            **extra, "X-Pagoda-Upstream": last.upstream.url})

    def _body_for(self, upstream: Upstream, route: Route, parsed: dict | None, body: bytes) -> bytes:
        """The body as sent, unless the gateway chose an upstream that does not serve its `model` (a group
        named in `model`, or a pick among groups serving different models): then `model` becomes the
        upstream's own (or goes, when the upstream did not list its models), so the upstream does not 404."""
        model = parsed.get("model") if parsed is not None else None
        if not isinstance(model, str) or model in upstream.model_ids:
            return body
        if route.reason != "explicit" and (len(self.upstreams.groups) == 1 or not upstream.model_ids):
            return body  # nothing was chosen for the client, or nothing is known to put instead
        rewritten = {k: v for k, v in parsed.items() if k != "model"}
        if upstream.model_ids:
            rewritten = {**parsed, "model": upstream.model_ids[0]}
        return json.dumps(rewritten, ensure_ascii=False).encode()


def error_event(request_id: str, path: str, failure: Failure, upstream: Upstream, numbered: bytes) -> bytes:
    """The event that ends a stream the upstream broke, in the route's error shape, then `[DONE]`; on the
    Responses API its typed `error` event, which ends a stream there (no `[DONE]`), numbered after the last
    event the client got (`numbered`: the last whole events forwarded that carried numbers; a keep-alive comment
    after them has none). Bound to the request when it is sent: the stream runs after the request context is
    gone."""
    body = error_body(f"upstream {upstream.group} ({upstream.url}): the stream broke: {failure.words}",
                      failure.type, None, request_id)
    if path == "/v1/responses":
        err = openai_dialect(body)["error"]
        numbers = [int(n) for n in SEQUENCE_NUMBER.findall(numbered)]
        return sse({"type": "error", "code": err["code"], "message": err["message"], "param": None,
                    "sequence_number": max(numbers) + 1 if numbers else 0}, event="error").encode()
    return (sse(openai_dialect(body) if path.startswith("/v1/") else body) + DONE).encode()
