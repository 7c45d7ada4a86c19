"""The OpenAPI 3.1 document served at `/openapi.json`: the server's own routes plus what each API contributes.

Written by hand (Flask has no schema layer) and kept true by `tests/serving/test_openapi.py`: every route
the app serves is documented and nothing else is, and real responses validate against the schemas. An API
contributes `{"paths": ..., "schemas": ...}` built with the helpers below, so every route documents its
errors with the one `Error` schema; two APIs claiming the same path or schema name stop the server.
"""

from __future__ import annotations

from collections.abc import Iterable

_REF = "#/components/schemas/"
ERROR_REASONS = {400: "malformed JSON", 401: "missing or wrong bearer token", 404: "unknown route",
                 405: "wrong method", 413: "body or request cost over a limit", 422: "invalid input (see error.field)",
                 500: "model error (carries request_id)", 503: "model not ready, or queue full (Retry-After)",
                 504: "deadline passed while queued"}


def ref(name: str) -> dict:
    return {"$ref": _REF + name}


def json_content(schema: dict) -> dict:
    return {"content": {"application/json": {"schema": schema}}}


def error_responses(*codes: int, schema: str = "Error") -> dict:
    """`schema`: an API whose dialect reshapes error bodies names its own (a superset of `Error`)."""
    return {str(c): {"description": ERROR_REASONS[c], **json_content(ref(schema))} for c in codes}


def post(summary: str, request: str, response: str, error: str = "Error") -> dict:
    """A JSON POST route: the request and 200 schemas by name, and the errors any API route can answer."""
    return {"post": {"summary": summary, "requestBody": {"required": True, **json_content(ref(request))},
                     "responses": {"200": {"description": "answers", **json_content(ref(response))},
                                   **error_responses(400, 401, 405, 413, 422, 500, 503, 504, schema=error)}}}


def get(summary: str, response: dict, *errors: int) -> dict:
    return {"get": {"summary": summary, "responses": {"200": {"description": "ok", **response},
                                                      **error_responses(*errors)}}}


SCHEMAS = {
    "Error": {"type": "object", "required": ["error", "request_id"],
              "properties": {"error": {"type": "object", "required": ["message", "type", "field"],
                                       "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                                                      "field": {"type": ["string", "null"]}}},
                             "request_id": {"type": ["string", "null"]}}},
    "Object": {"type": "object"},
}

PATHS = {
    "/health": get("the process answers (never needs auth)", json_content(ref("Object"))),
    "/ready": get("200 once every API's model is loaded", json_content(ref("Object")), 401, 503),
    "/v1/models": get("the served models and what each API adds (e.g. the loaded presets)",
                      json_content(ref("Object")), 401),
    "/v1/models/{model}": {"parameters": [{"name": "model", "in": "path", "required": True,
                                           "schema": {"type": "string"}, "description": "a served model's id"}],
                           **get("one entry of /v1/models (OpenAI's retrieve)", json_content(ref("Object")), 401,
                                 404)},
    "/stats": get("requests, latency p50/p99 per route, and each API's own figures", json_content(ref("Object")),
                  401),
    "/metrics": get("Prometheus exposition", {"content": {"text/plain": {"schema": {"type": "string"}}}}, 401),
    "/openapi.json": get("this document", json_content(ref("Object")), 401),
}


def document(parts: Iterable[dict], max_body_bytes: int, secured: bool) -> dict:
    paths, schemas = dict(PATHS), dict(SCHEMAS)
    for part in parts:
        for mine, theirs, what in ((paths, part["paths"], "path"), (schemas, part["schemas"], "schema")):
            clash = sorted(set(mine) & set(theirs))
            if clash:
                raise RuntimeError(f"openapi: {what} {clash[0]!r} is documented twice")
            mine.update(theirs)
    doc = {
        "openapi": "3.1.0",
        "info": {"title": "pagoda", "version": "0.1.0",
                 "description": f"pagoda's HTTP APIs. Request bodies up to {max_body_bytes} bytes; each "
                                "route's own limits are in its schemas."},
        "paths": paths,
        "components": {"schemas": schemas},
    }
    if secured:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
        doc["paths"]["/health"] = {"get": {**doc["paths"]["/health"]["get"], "security": []}}
    return doc
