"""The Flask app factory: routes, auth, the error shape, the access log, and the model's lifecycle.

The model loads in a background thread so the process answers `/health` at once and `/ready` says 503
until the model is in memory; a load failure keeps `/ready` at 503 with the reason. Each process holds
one backend and one `Batcher` (its model-worker thread); request threads only prepare and finish.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import sys
import threading
import time
import uuid
from typing import Any

from flask import Flask, Response, g, request
from werkzeug.exceptions import HTTPException

from serving import compat
from serving.batcher import Batcher, BatchLimits, DeadlineExceeded, ModelError, QueueFull
from serving.config import ServeConfig
from serving.errors import HTTP_ERROR_TYPES, ApiError, invalid
from serving.metrics import Metrics
from serving.openapi import openapi_document
from serving.policy import Policy
from serving.presets import load_presets
from serving.schema import DecideRequest, decide_request, field_of, parse_json

log = logging.getLogger("pagoda.serve")
access_log = logging.getLogger("pagoda.access")
_REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")


class Service:
    """The loaded model and its batcher, or why there is none yet."""

    def __init__(self, cfg: ServeConfig, metrics: Metrics):
        self.cfg = cfg
        self.metrics = metrics
        self.backend: Any = None
        self.batcher: Batcher | None = None
        self.error: str | None = None
        self.loaded = threading.Event()

    def attach(self, backend: Any) -> None:
        cfg = self.cfg
        limits = BatchLimits(cfg.max_batch_questions, cfg.max_batch_tokens, cfg.max_wait_ms, cfg.max_queue,
                             cfg.batching)
        self.batcher = Batcher(backend.run, limits, self.metrics)
        self.backend = backend
        self.metrics.ready.set(1)
        self.loaded.set()

    def load_in_background(self) -> None:
        def load() -> None:
            from serving.backend import load_backend

            try:
                started = time.monotonic()
                backend = load_backend(self.cfg)
                self.attach(backend)
                log.info("model %s ready in %.1fs", backend.name, time.monotonic() - started)
            except Exception as exc:  # noqa: BLE001 -- reported by /ready and the log, not a crash loop
                self.error = f"{type(exc).__name__}: {exc}"
                log.exception("model failed to load")

        threading.Thread(target=load, name="pagoda-model-load", daemon=True).start()

    def decide(self, req: DecideRequest, deadline: float, batch: bool) -> tuple[list[dict], float]:
        backend, batcher = self.backend, self.batcher
        if backend is None or batcher is None:
            raise ApiError(503, self.error or "the model is still loading", "not_ready",
                           headers={"Retry-After": "1"})
        with batcher.arriving():
            units = []
            for i, state in enumerate(req.states):
                try:
                    units.append(backend.prepare(state, req.questions, req.budgets))
                except ValueError as exc:
                    field = field_of(str(exc))
                    if field == "state" and batch:
                        field = f"states[{i}]"
                    raise invalid(field, str(exc)) from None
            try:
                ticket = batcher.submit(units, [backend.cost(u) for u in units], deadline)
            except QueueFull as exc:
                raise ApiError(503, f"server busy: {exc}", "overloaded", headers={"Retry-After": "1"}) from None
        try:
            outputs = ticket.wait()
        except DeadlineExceeded:
            raise ApiError(504, f"no answer within the {self.cfg.request_timeout_s:g}s deadline", "timeout") from None
        except ModelError as exc:
            log.error("request %s: model error (traceback above, from the model worker): %s", g.request_id, exc)
            raise ApiError(500, "the model failed on this request; see the server log for request "
                                f"{g.request_id}", "model_error") from None
        results = [backend.finish(u, o) for u, o in zip(units, outputs)]
        self.metrics.observe_decisions(len(results), sum(len(r["answers"]) for r in results),
                                       sum(r["usage"].get("input_tokens", 0) for r in results))
        return results, ticket.queue_ms


def create_app(cfg: ServeConfig | None = None, backend: Any = None) -> Flask:
    """`backend` injects an already-loaded model (tests, embedding); otherwise it loads from `cfg` in the
    background."""
    cfg = cfg or ServeConfig.from_sources()
    presets = load_presets(cfg.presets, cfg) if cfg.presets else {}
    policy = Policy.load(cfg.policy) if cfg.policy else None
    metrics = Metrics()
    service = Service(cfg, metrics)
    if backend is not None:
        service.attach(backend)
    else:
        service.load_in_background()
    _configure_logging()

    app = Flask("pagoda")
    app.config["MAX_CONTENT_LENGTH"] = cfg.max_body_bytes
    app.json.sort_keys = False
    app.extensions["pagoda"] = service
    expected_auth = f"Bearer {cfg.api_key}".encode() if cfg.api_key else None

    def reply(body: Any, status: int = 200, headers: dict | None = None) -> Response:
        return Response(json.dumps(body, ensure_ascii=False), status, headers, mimetype="application/json")

    @app.before_request
    def start() -> None:
        g.t0 = time.monotonic()
        given = request.headers.get("X-Request-ID", "")
        g.request_id = given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        if expected_auth is not None and request.path != "/health":
            supplied = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(supplied, expected_auth):
                raise ApiError(401, "missing or invalid bearer token", "unauthorized", "Authorization",
                               headers={"WWW-Authenticate": "Bearer"})

    @app.after_request
    def finish(response: Response) -> Response:
        latency = time.monotonic() - g.get("t0", time.monotonic())
        request_id = g.get("request_id", "-")
        response.headers["X-Request-ID"] = request_id
        route = request.url_rule.rule if request.url_rule else "unmatched"
        metrics.observe_request(route, response.status_code, latency)
        if cfg.access_log:
            access_log.info(json.dumps({
                "ts": round(time.time(), 3), "request_id": request_id, "method": request.method,
                "route": route, "path": request.path, "status": response.status_code,
                "latency_ms": round(latency * 1000, 3), "remote": request.remote_addr,
            }))
        return response

    def error_response(status: int, message: str, type_: str, field: str | None = None,
                       headers: dict | None = None) -> Response:
        body: dict[str, Any] = {"error": {"message": message, "type": type_, "field": field},
                                "request_id": g.get("request_id")}
        if request.path.startswith("/v1/systemone"):
            body["detail"] = message  # laya-serve clients read FastAPI's `detail`
        return reply(body, status, headers)

    @app.errorhandler(ApiError)
    def api_error(exc: ApiError) -> Response:
        return error_response(exc.status, exc.message, exc.type, exc.field, exc.headers)

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException) -> Response:
        status = exc.code or 500
        headers = {k: v for k, v in exc.get_headers() if k.lower() == "allow"}
        message = exc.description or exc.name
        if status == 413:
            message = f"request body over the {cfg.max_body_bytes} byte limit"
        elif status == 405:
            message = f"method {request.method} is not allowed on {request.path}"
        elif status == 404:
            message = f"no route {request.path}"
        return error_response(status, message, HTTP_ERROR_TYPES.get(status, "http_error"), None, headers)

    @app.errorhandler(Exception)
    def unexpected(exc: Exception) -> Response:
        log.exception("request %s failed", g.get("request_id"))
        return error_response(500, f"internal error; see the server log for request {g.get('request_id')}",
                              "internal_error")

    def read_request(route: str) -> DecideRequest:
        body = parse_json(request.get_data(cache=False))
        default = service.backend.default_questions if service.backend is not None else None
        return decide_request(body, route, cfg, presets, default)

    def deadline() -> float:
        return g.t0 + cfg.request_timeout_s

    def timing(queue_ms: float) -> dict:
        return {"latency_ms": round((time.monotonic() - g.t0) * 1000, 3), "queue_ms": queue_ms}

    def with_actions(result: dict) -> dict:
        return {**result, "actions": policy.evaluate(result["answers"])} if policy else result

    @app.get("/health")
    def health() -> Response:
        return reply({"status": "ok"})

    @app.get("/ready")
    def ready() -> Response:
        if service.backend is None:
            raise ApiError(503, service.error or "the model is still loading", "not_ready",
                           headers={"Retry-After": "1"})
        return reply({"status": "ready", "model": service.backend.name, "kind": service.backend.kind})

    @app.get("/v1/models")
    def models() -> Response:
        backend = service.backend
        data = [] if backend is None else [{
            "id": backend.name, "object": "model", "owned_by": "pagoda", "kind": backend.kind,
            "questions": sorted(backend.default_questions) if backend.default_questions else None,
        }]
        return reply({"object": "list", "data": data, "presets": sorted(presets)})

    @app.get("/stats")
    def stats() -> Response:
        return reply({**metrics.summary(), "batching": cfg.batching})

    @app.get("/metrics")
    def prometheus() -> Response:
        return Response(metrics.prometheus(), mimetype="text/plain; version=0.0.4")

    @app.get("/openapi.json")
    def openapi() -> Response:
        return reply(openapi_document(cfg))

    @app.post("/decide")
    def decide() -> Response:
        req = read_request("decide")
        results, queue_ms = service.decide(req, deadline(), batch=False)
        result = with_actions(results[0])
        result["usage"] = {**result["usage"], **timing(queue_ms)}
        return reply({**result, "request_id": g.request_id})

    @app.post("/decide/batch")
    def decide_batch() -> Response:
        req = read_request("decide_batch")
        results, queue_ms = service.decide(req, deadline(), batch=True)
        usage = {"input_tokens": sum(r["usage"].get("input_tokens", 0) for r in results),
                 "output_tokens": sum(r["usage"].get("output_tokens", 0) for r in results), **timing(queue_ms)}
        return reply({"results": [with_actions(r) for r in results], "usage": usage, "request_id": g.request_id})

    @app.post("/v1/systemone")
    def systemone() -> Response:
        results, _ = service.decide(read_request("systemone"), deadline(), batch=False)
        return reply(compat.systemone_result(results[0]))

    @app.post("/v1/systemone/batch")
    def systemone_batch() -> Response:
        results, _ = service.decide(read_request("systemone_batch"), deadline(), batch=True)
        return reply(compat.systemone_batch(results))

    return app


def _configure_logging() -> None:
    """Access lines are bare JSON on stderr; everything else under `pagoda.` gets a timestamped line."""
    _log_to_stderr(access_log, "%(message)s")
    _log_to_stderr(logging.getLogger("pagoda"), "%(asctime)s %(levelname)s %(name)s: %(message)s")


def _log_to_stderr(logger: logging.Logger, fmt: str) -> None:
    if not logger.handlers:  # gunicorn re-imports the app per worker: never stack handlers
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(fmt))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
