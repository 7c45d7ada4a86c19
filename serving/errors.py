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
import math
import re
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

from flask import Flask, g, request
from werkzeug.exceptions import HTTPException

from laya.errors import InputError
from laya.rows import is_text

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


# How deeply a request body may nest. Real bodies nest a few levels (a chat turn in a list in a field);
# anything near Python's recursion limit would fail in whichever recursive code read it first, as a 500.
MAX_JSON_DEPTH = 64


class _NotANumber:
    """Stands in, while parsing, for a number Python's `json` would read as something JSON has no value
    for: `NaN`/`Infinity` (not JSON at all), a float past double range (inf) or an integer over Python's
    digit limit. The walk after parsing finds it and names its path."""

    def __init__(self, text: str, why: str):
        self.text = text if len(text) <= 20 else f"{text[:8]}...{text[-4:]} ({len(text)} characters)"
        self.why = why


def _constant(text: str) -> _NotANumber:
    return _NotANumber(text, "is not JSON (JSON has no NaN or Infinity)")


def _float(text: str) -> float | _NotANumber:
    value = float(text)
    return value if math.isfinite(value) else _NotANumber(text, "is outside the range of a double")


def _int(text: str) -> int | _NotANumber:
    limit = sys.get_int_max_str_digits()
    if limit and len(text.lstrip("-")) > limit:
        return _NotANumber(text, f"has more than {limit} digits")
    return int(text)


def parse_json(data: bytes) -> Any:
    """A request body as JSON, or the 400 `invalid_json` every API answers for one it cannot read.

    Beyond syntax it refuses what would otherwise fail later as a 500 or leak into an answer: nesting past
    `MAX_JSON_DEPTH`, numbers JSON cannot hold (NaN, Infinity, 1e999, a 5000-digit integer) and strings
    (values or keys) with an unpaired UTF-16 surrogate (`"\\ud800"` is valid JSON but no text: it cannot
    be tokenised, nor written back in a UTF-8 response), and a name given twice in one object (the parser
    would keep the last value and drop the first without a word: an option, a question, a field lost).
    `field` is the JSON path of the offending value.
    """
    try:
        value = json.loads(data, parse_constant=_constant, parse_float=_float, parse_int=_int,
                           object_pairs_hook=_object)
    except RecursionError:
        raise _too_deep(_deep_field(data.decode(json.detect_encoding(data), errors="replace"))) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", "invalid_json") from None
    _check_values(value)
    return value


class _Repeated(dict):
    """An object that named `key` more than once: refused by `_check_values`, which knows where it stands."""

    key: str


def _object(pairs: list[tuple[str, Any]]) -> dict:
    out = dict(pairs)
    if len(out) == len(pairs):
        return out
    seen: set[str] = set()
    repeated = _Repeated(out)
    repeated.key = next(k for k, _ in pairs if k in seen or seen.add(k))
    return repeated


def _check_values(value: Any) -> None:
    """Walk the parsed body without recursion (it may be as deep as the parser allowed)."""
    stack: list[tuple[Any, tuple]] = [(value, ())]
    while stack:
        node, parts = stack.pop()
        if isinstance(node, dict | list):
            if len(parts) >= MAX_JSON_DEPTH:
                raise _too_deep(_json_path(parts, deep=True))
            if isinstance(node, _Repeated):
                where = _json_path(parts) if parts else "the body"
                raise ApiError(400, f"the name '{_printable(node.key)}' appears more than once in {where}: "
                               "the names of a JSON object must be unique", "invalid_json",
                               _json_path((*parts, node.key)))
            items = node.items() if isinstance(node, dict) else enumerate(node)
            for key, child in items:
                if isinstance(key, str) and not is_text(key):
                    raise ApiError(400, f"the name '{_printable(key)}' in {_json_path(parts)} "
                                   "contains an unpaired UTF-16 surrogate", "invalid_json",
                                   _json_path((*parts, key)))
                stack.append((child, (*parts, key)))
        elif isinstance(node, str):
            if not is_text(node):
                raise ApiError(400, f"{_json_path(parts)} contains an unpaired UTF-16 surrogate",
                               "invalid_json", _json_path(parts))
        elif isinstance(node, _NotANumber):
            raise ApiError(400, f"{_json_path(parts)}: the number {node.text} {node.why}",
                           "invalid_json", _json_path(parts))


def _too_deep(field: str) -> ApiError:
    return ApiError(400, f"{field}: nests deeper than the {MAX_JSON_DEPTH}-level limit of a request body",
                    "invalid_json", field)


def _printable(key: str) -> str:
    """A name as it can be written back: its surrogates as `\\udXXX` escapes."""
    return key.encode("utf-8", "backslashreplace").decode("utf-8")


def _json_path(parts: tuple, deep: bool = False) -> str:
    """`questions.q1.criteria[0]`, laya's dotted paths plus list indexes. `deep`: the path of a value nested
    too deeply, cut short (`state[0]`, not sixty `[0]`s): at a list in a list, at most 4 steps."""
    out = "body" if parts and isinstance(parts[0], int) else ""  # a body that is a list, not an object
    for i, part in enumerate(parts):
        if deep and (i >= 4 or (i and isinstance(part, int) and isinstance(parts[i - 1], int))):
            break
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + _printable(part)
    return out or "body"


_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{},]')


def _deep_field(text: str) -> str:
    """The path of the first value nested past the limit, read off the raw text: the parser gave up (its
    recursion limit) before there was a value to walk. Only on that failure, so its speed does not matter."""
    stack: list[list] = []  # per open container: [is_object, key or index]
    for match in _JSON_TOKEN.finditer(text):
        token = match.group()
        if token in "[{":
            if len(stack) >= MAX_JSON_DEPTH:
                break
            stack.append([token == "{", None if token == "{" else 0])
        elif token in "]}":
            if stack:
                stack.pop()
        elif token == ",":
            if stack:
                stack[-1][1] = None if stack[-1][0] else stack[-1][1] + 1
        elif stack and stack[-1][0] and stack[-1][1] is None:
            stack[-1][1] = json.loads(token)
    return _json_path(tuple(entry[1] for entry in stack if entry[1] is not None), deep=True)


def error_body(message: str, type_: str, field: str | None, request_id: str | None) -> dict[str, Any]:
    """The shape, for errors that cannot be a response of their own (an error event inside a stream)."""
    return {"error": {"message": message, "type": type_, "field": field}, "request_id": request_id}


def in_dialect(body: dict, path: str | None, dialects: Mapping[str, Dialect]) -> dict:
    """`body` as the API owning `path` words its errors: the handlers below and the HTTP front (which refuses
    an oversized body or header block before Flask sees the request) both answer through it. The longest prefix
    that matches owns it (`/v1/systemone` is the decision API's, the rest of `/v1/` the OpenAI API's)."""
    owners = [prefix for prefix in dialects if path is not None and path.startswith(prefix)]
    return dialects[max(owners, key=len)](body) if owners else body


DIALECTS_KEY = "pagoda.error_dialects"  # app.extensions: the front finds the dialects there
# environ: a `PeerGone` the front sets when the client closes its connection while its request runs
# (`serving.server.Front._watch_peer`), so work nobody will read can stop (`client_gone`)
PEER_GONE_KEY = "pagoda.peer_gone"


class PeerGone(threading.Event):
    """Set when a request's client has gone. The thread answering the request is blocked (on a generation
    run's event queue, on the gateway's upstream socket), so it registers a callback (`when_set`) that wakes it
    from the setter's thread at once, instead of polling."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._calls: dict[int, Callable[[], None]] = {}
        self._next = 0

    def set(self) -> None:
        with self._lock:
            super().set()
            calls, self._calls = list(self._calls.values()), {}
        for call in calls:
            try:
                call()
            except Exception:  # noqa: BLE001 -- the setter is the front's event loop: it must go on
                log.exception("a peer-gone callback failed")

    def when_set(self, call: Callable[[], None]) -> Callable[[], None]:
        """Run `call` once the client has gone (at once if it already has); returns what cancels it."""
        with self._lock:
            if not self.is_set():
                key = self._next
                self._next += 1
                self._calls[key] = call
                return lambda: self._cancel(key)
        call()
        return lambda: None

    def _cancel(self, key: int) -> None:
        with self._lock:
            self._calls.pop(key, None)


REASONS = {499: "Client Closed Request"}  # statuses outside the HTTP registry (werkzeug says UNKNOWN): nginx's name


def client_gone() -> ApiError:
    """The answer to a client that closed its connection first: nobody reads it, but the access log and the
    metrics do (nginx's 499)."""
    return ApiError(499, "the client closed the connection before the answer was ready", "client_closed")


def install(app: Flask, max_body_bytes: int, dialects: Mapping[str, Dialect]) -> None:
    app.extensions[DIALECTS_KEY] = dict(dialects)

    def respond(status: int, message: str, type_: str, field: str | None = None,
                headers: dict | None = None) -> tuple[dict, int | str, dict]:
        body = in_dialect(error_body(message, type_, field, g.get("request_id")), request.path, dialects)
        return body, f"{status} {REASONS[status]}" if status in REASONS else status, headers or {}

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
