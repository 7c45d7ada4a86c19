"""The one error shape every route answers with: `{"error": {"message", "type", "field"}, "request_id"}`.

Three kinds of exception reach it, and none is recognised by its message text:
- `laya.errors.InputError`: the caller's mistake, 422 `invalid_request`, `field` = its `path` (the JSON path
  of the offending input). Laya raises it for what a question or a state means; an API's schema raises it
  for what HTTP limits (sizes, counts, unknown body fields), so a client sees one kind of 422.
- `ApiError`: everything else a handler decides (503 not ready, 504 deadline, 500 model error, ...).
- werkzeug's HTTP errors (404, 405, 413) and anything unexpected (500, logged with the request id).
An API may reshape the body on its own routes through a dialect (the laya-serve routes add `detail`; an
OpenAI-compatible API will want its `param`), keyed by URL prefix so even a 405 on those paths gets it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

from flask import Flask, g, request
from werkzeug.exceptions import HTTPException

from laya.errors import InputError

log = logging.getLogger("pagoda.serve")

Dialect = Callable[[dict], dict]

# werkzeug's status codes mapped to the `type` a client switches on.
HTTP_ERROR_TYPES = {
    400: "invalid_json",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
    500: "internal_error",
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str, field: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.field = field
        self.headers = headers or {}


def parse_json(data: bytes) -> Any:
    """A request body as JSON, or the 400 every API answers for one that is not."""
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", "invalid_json") from None


def error_body(message: str, type_: str, field: str | None, request_id: str | None) -> dict[str, Any]:
    """The shape, for errors that cannot be a response of their own (an error event inside a stream)."""
    return {"error": {"message": message, "type": type_, "field": field}, "request_id": request_id}


def install(app: Flask, max_body_bytes: int, dialects: Mapping[str, Dialect]) -> None:
    def respond(status: int, message: str, type_: str, field: str | None = None,
                headers: dict | None = None) -> tuple[dict, int, dict]:
        body = error_body(message, type_, field, g.get("request_id"))
        for prefix, dialect in dialects.items():
            if request.path.startswith(prefix):
                body = dialect(body)
        return body, status, headers or {}

    @app.errorhandler(InputError)
    def input_error(exc: InputError):
        return respond(422, str(exc), "invalid_request", exc.path)

    @app.errorhandler(ApiError)
    def api_error(exc: ApiError):
        return respond(exc.status, exc.message, exc.type, exc.field, exc.headers)

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException):
        status = exc.code or 500
        headers = {k: v for k, v in exc.get_headers() if k.lower() == "allow"}
        message = exc.description or exc.name
        if status == 413:
            message = f"request body over the {max_body_bytes} byte limit"
        elif status == 405:
            message = f"method {request.method} is not allowed on {request.path}"
        elif status == 404:
            message = f"no route {request.path}"
        return respond(status, message, HTTP_ERROR_TYPES.get(status, "http_error"), None, headers)

    @app.errorhandler(Exception)
    def unexpected(exc: Exception):
        log.exception("request %s failed", g.get("request_id"))
        return respond(500, f"internal error; see the server log for request {g.get('request_id')}",
                       "internal_error")
