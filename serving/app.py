"""The app factory: the server's own routes and hooks, with every API mounted beside them.

The core is what every API shares: the request id and access line (`access_log`), bearer auth (`auth`),
the error shape (`errors`), the metrics registry (`metrics`), the OpenAPI document (`openapi`), and the
routes that describe the whole server (`/health`, `/ready`, `/v1/models`, `/stats`, `/metrics`,
`/openapi.json`). An API is an object with the members of `Api` below, built from its settings section
in `build_apis`: the decision API and the generation API today; the co-deploy gateway will be a sibling.
Each API's routes hold at most their budget of request threads (`threads`).
"""

from __future__ import annotations

import argparse
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

from flask import Blueprint, Flask, Response, request
from prometheus_client import CollectorRegistry

from serving import access_log, auth, errors, openapi, threads
from serving.config import ServeConfig
from serving.errors import ApiError
from serving.metrics import Metrics


class Api(Protocol):
    """What the app factory needs from an API (`serving.decide.routes.DecideApi` is one).

    `name` is also its blueprint's name and picks its request-thread budget (`--<name>-threads`)."""

    name: str
    blueprint: Blueprint                                # its routes
    error_dialects: Mapping[str, Callable[[dict], dict]]  # URL prefix -> reshaping of the error body there

    def start(self, registry: CollectorRegistry) -> None:
        """Register its series in the server's registry, then begin loading its model (in the background)."""

    @property
    def loaded(self) -> threading.Event:
        """Set once it can answer."""

    @property
    def error(self) -> str | None:
        """Why it never will (its model failed to load); None while loading or loaded."""

    def status(self) -> dict:
        """What `/ready` says about it once loaded (model name, kind)."""

    def models(self) -> dict:
        """Its part of `/v1/models`: `{"data": [model entries], ...its own keys}`."""

    def stats(self) -> dict:
        """Its part of `/stats`."""

    def health(self) -> dict:
        """Its part of `/health`: cheap (load balancers poll it), never waiting on a model or a lock."""

    def openapi(self) -> dict:
        """Its part of `/openapi.json`: `{"paths": ..., "schemas": ...}`."""

    def close(self, timeout_s: float) -> None:
        """The worker is exiting: end its model thread, waiting at most `timeout_s`, so that no native op still
        runs while the interpreter tears down (that aborts the process: seen when --graceful-timeout-s cut streams
        mid-generation)."""


def build_apis(cfg: ServeConfig) -> list[Api]:
    """The APIs this server mounts. Cheap (no model loads), so `pagoda serve` calls it before gunicorn forks
    to refuse a bad presets or policy file by name. Decisions unless `--generate-only`; generation unless
    `--generate-model none` (or the default model cannot run in this install)."""
    apis: list[Api] = []
    if not cfg.generate.only:
        from serving.decide.routes import DecideApi

        apis.append(DecideApi(cfg.decide, cfg.request_timeout_s))
    model = cfg.generate.model_path()
    if model is not False:
        from serving.generate.routes import GenerateApi

        apis.append(GenerateApi(cfg.generate, model))
    if not apis:
        raise ValueError(f"nothing to serve: {cfg.generate.where('only')} with {cfg.generate.where('model')} none")
    return apis


def checked_config(flags: Mapping[str, object], env: Mapping[str, str] | None = None) -> ServeConfig:
    """`pagoda serve`'s settings with every check it makes before it forks, in one place so that a bench which
    starts servers can make them first, in its own process, and refuse a bad flag before any server starts."""
    cfg = ServeConfig.from_sources(flags, env)
    build_apis(cfg)  # reads presets and policies: a bad file stops us, named
    return cfg


def check_serve_argv(argv: list[str]) -> None:
    """Raise the `ValueError` `pagoda serve ARGV` would refuse to start with (its settings from these flags and
    the `PAGODA_*` variables it inherits). A bench calls it on each server it will start, before the first:
    a bad flag then costs no measurement first, and the bench's own error line names it."""
    parser = argparse.ArgumentParser(prog="pagoda serve")
    ServeConfig.add_arguments(parser)
    checked_config(vars(parser.parse_args(argv)))


def _thread_setting(cfg: ServeConfig, api: str) -> str:
    """The setting that bounds `api`'s request threads: its own (`--decide-threads`) where the config has one, as
    `thread_budgets` reads it, else the worker's `--threads`."""
    return cfg.where(f"{api}_threads" if hasattr(cfg, f"{api}_threads") else "threads")


def create_app(cfg: ServeConfig | None = None, apis: Sequence[Api] | None = None) -> Flask:
    """`apis` injects already-built APIs (tests, embedding: e.g. a `DecideApi` around a loaded model)."""
    cfg = cfg or ServeConfig.from_sources()
    apis = list(apis) if apis is not None else build_apis(cfg)
    metrics = Metrics()
    app = Flask("pagoda")
    app.config["MAX_CONTENT_LENGTH"] = cfg.max_body_bytes
    app.json.sort_keys = False
    app.json.ensure_ascii = False
    app.extensions["pagoda.apis"] = apis
    access_log.install(app, metrics, {api.blueprint.name for api in apis}, cfg.access_log)
    auth.install(app, cfg.api_key)
    require_json(app)
    budgets = cfg.thread_budgets([api.name for api in apis])
    threads.install(app, {api.blueprint.name: (budgets[api.name], _thread_setting(cfg, api.name)) for api in apis})
    errors.install(app, cfg.max_body_bytes, {p: d for api in apis for p, d in api.error_dialects.items()})
    document = openapi.document([api.openapi() for api in apis], cfg.max_body_bytes, bool(cfg.api_key))

    @app.get("/health")
    def health() -> dict:
        return merged([{"status": "ok"}, *(api.health() for api in apis)])

    @app.get("/ready")
    def ready() -> dict:
        for api in apis:
            if not api.loaded.is_set():
                raise ApiError(503, api.error or "the model is still loading", "not_ready",
                               headers={"Retry-After": "1"})
        return {"status": "ready", **merged(api.status() for api in apis)}

    @app.get("/v1/models")
    def models() -> dict:
        parts = [api.models() for api in apis]
        return {"object": "list", "data": [m for part in parts for m in part["data"]],
                **merged({k: v for k, v in part.items() if k != "data"} for part in parts)}

    @app.get("/v1/models/<path:model>")
    def model(model: str) -> dict:
        """OpenAI's retrieve (`client.models.retrieve`): one entry of the list; a path, as ids may hold '/'."""
        for entry in models()["data"]:
            if entry["id"] == model:
                return entry
        raise ApiError(404, f"no model {model!r} is served here (GET /v1/models lists them)", "model_not_found",
                       "model")

    @app.get("/stats")
    def stats() -> dict:
        return merged([metrics.summary(), *(api.stats() for api in apis)])

    @app.get("/metrics")
    def prometheus() -> Response:
        return Response(metrics.prometheus(), mimetype="text/plain; version=0.0.4")

    @app.get("/openapi.json")
    def openapi_json() -> dict:
        return document

    for api in apis:
        app.register_blueprint(api.blueprint)
    # The model loads start only now, after every route is registered: werkzeug compiles each route with
    # `ast.parse`, and CPython 3.11.7's AST validator is not thread-safe (python/cpython gh-106905), so a
    # load thread compiling code (imports, dataclasses) at the same moment could fail startup with
    # "SystemError: AST constructor recursion depth mismatch" (seen once in CI).
    for api in apis:
        api.start(metrics.registry)
    return app


def require_json(app: Flask) -> None:
    """Every POST body is JSON and says so: `Content-Type: application/json` (any charset parameter). A POST
    with no body (SGLang's `/flush_cache`) needs no type: there is nothing to mistype.
    Beyond naming the mistake early, this closes a hole: without an API key, a web page could POST to a local
    server as a "simple" cross-origin request (text/plain, form types) that browsers send without a CORS
    preflight; application/json always needs one.
    A body is read as sent: one with a `Content-Encoding` (gzip, br, ...) is refused by that header's name,
    not misread as bytes that are not JSON. Decoding it would put a body's real size past `--max-body-bytes`,
    which the front checks on the bytes that arrive (a decompression bomb), and the servers this one stands in
    for (vLLM, SGLang, laya-serve) do not decode request bodies either."""

    @app.before_request
    def check_content_type() -> None:
        if request.method != "POST" or request.url_rule is None or not request.content_length:
            return  # 404 and 405 say more than 415 would; an empty body has no type to check
        encoding = request.headers.get("Content-Encoding", "").strip()
        if encoding and encoding.lower() != "identity":
            raise ApiError(415, f"request bodies are read as sent: Content-Encoding {encoding!r} is not supported; "
                                "send the JSON uncompressed", "unsupported_media_type", "Content-Encoding")
        if request.mimetype != "application/json":
            given = request.headers.get("Content-Type")
            raise ApiError(415, f"POST bodies must be sent as Content-Type: application/json, got "
                                f"{given!r}" if given else "POST bodies must be sent as Content-Type: "
                                "application/json (no Content-Type given)", "unsupported_media_type",
                           "Content-Type")


def merged(parts: Iterable[dict]) -> dict:
    """One body from the APIs' parts; two APIs claiming the same key is a bug to stop at, not to hide."""
    out: dict = {}
    for part in parts:
        clash = sorted(set(out) & set(part))
        if clash:
            raise RuntimeError(f"two parts of one response both set {clash[0]!r}")
        out.update(part)
    return out
