"""The first and last thing every request passes through: its id, its clock, its access line and metrics.

Before any view runs, `flask.g.request_id` (the client's `X-Request-ID` when it is a short token, else a
fresh one) and `flask.g.t0` (monotonic start) are set: APIs read them there for their deadlines, timing
and error messages. After the view, the id is echoed in `X-Request-ID`, the request is counted under its
route's rule (`/decide`, not the path a client typed) and one JSON line goes to stderr.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
import uuid
from collections.abc import Collection

from flask import Flask, Response, g, request
from werkzeug.exceptions import HTTPException

from serving.metrics import Metrics

access_log = logging.getLogger("pagoda.access")
REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")  # a client's X-Request-ID is kept when it is such a token
UNMATCHED = "unmatched"  # the route of a path no route matches
# app.extensions: how the HTTP front counts a request it refused before the app saw it (`count_refused`)
COUNT_REFUSED_KEY = "pagoda.count_refused"


def install(app: Flask, metrics: Metrics, api_blueprints: Collection[str], enabled: bool) -> None:
    """`api_blueprints`: the blueprints whose routes are an API's (their latencies are the ones `/stats`
    summarises; the server's own `/health` or `/metrics` would only dilute them)."""
    configure_logging()

    @app.before_request
    def start() -> None:
        g.t0 = time.monotonic()
        given = request.headers.get("X-Request-ID", "")
        g.request_id = given if REQUEST_ID.fullmatch(given) else uuid.uuid4().hex

    @app.after_request
    def finish(response: Response) -> Response:
        latency = time.monotonic() - g.get("t0", time.monotonic())
        request_id = g.get("request_id", "-")
        response.headers["X-Request-ID"] = request_id
        route = request.url_rule.rule if request.url_rule else UNMATCHED
        metrics.observe_request(route, response.status_code, latency, request.blueprint in api_blueprints)
        if enabled:
            access_log.info(json.dumps({
                "ts": round(time.time(), 3), "request_id": request_id, "method": request.method,
                "route": route, "path": request.path, "status": response.status_code,
                "latency_ms": round(latency * 1000, 3), "remote": request.remote_addr,
            }))
        return response


    routes = app.url_map.bind("localhost")

    def count_refused(method: str | None, path: str | None, status: int, latency_s: float) -> None:
        """A request the front refused (a body over the limit, a slow client, bad framing, the connection cap)
        is counted as the app counts its own: under the route its path would have reached, so an operator
        watching `/decide`'s errors sees its 413s too."""
        route = UNMATCHED
        if method is not None and path is not None:
            try:
                route = routes.match(path, method, return_rule=True)[0].rule
            except HTTPException:  # no such route, a wrong method, a redirect
                pass
        metrics.observe_request(route, status, latency_s, api_route=False)

    app.extensions[COUNT_REFUSED_KEY] = count_refused


def configure_logging() -> None:
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
