"""The OpenAPI 3.1 document served at `/openapi.json`, built from the live configuration.

Written by hand (Flask has no schema layer) and kept true by `tests/serving/test_openapi.py`: every
route the app serves is documented and nothing else is, request fields match what `serving.schema`
accepts, and real responses validate against the schemas below.
"""

from __future__ import annotations

from serving.config import ServeConfig
from serving.schema import QUESTION_TYPES, ROUTE_FIELDS

_REF = "#/components/schemas/"


def _ref(name: str) -> dict:
    return {"$ref": _REF + name}


def _json(schema: dict) -> dict:
    return {"content": {"application/json": {"schema": schema}}}


def _errors(*codes: int) -> dict:
    reasons = {400: "malformed JSON", 401: "missing or wrong bearer token", 404: "unknown route",
               405: "wrong method", 413: "body over the size limit", 422: "schema violation (see error.field)",
               500: "model error (carries request_id)", 503: "model not ready, or queue full (Retry-After)",
               504: "deadline passed while queued"}
    return {str(c): {"description": reasons[c], **_json(_ref("Error"))} for c in codes}


def openapi_document(cfg: ServeConfig) -> dict:
    state = {"description": "text, a JSON object, or a list of chat turns",
             "oneOf": [{"type": "string", "maxLength": cfg.max_state_chars}, {"type": "object"}, {"type": "array"}]}
    budgets = {
        "max_len": {"type": "integer", "minimum": 1, "maximum": cfg.max_len_cap},
        "head_max_len": {"type": "integer", "minimum": 1, "maximum": cfg.max_len_cap},
        "min_confidence": {"description": "abstain below this answer_confidence; a number or a per-bucket "
                                          "object such as {\"choice:3-5\": 0.6, \"default\": 0.5}",
                           "oneOf": [{"type": "number", "minimum": 0, "maximum": 1}, {"type": "object"}]},
    }
    questions = {"type": "object", "maxProperties": cfg.max_questions,
                 "additionalProperties": _ref("Question")}
    states = {"type": "array", "minItems": 1, "maxItems": cfg.max_states, "items": state}
    compat_extras = {"model": {"type": "string", "description": "accepted for compatibility; one model is served"},
                     "task": {"type": "string"}, "lang": {"type": "string"}, "lang_guess": {"type": "string"}}
    batch_extras = {"batch_size": {"type": "integer"}, "sort_by_length": {"type": "boolean"}}
    preset = {"type": "string", "description": "name of a question set from the presets file"}

    def request_schema(route: str, props: dict, required: list[str]) -> dict:
        if set(props) != ROUTE_FIELDS[route]:  # the document must not drift from the parser
            raise RuntimeError(f"openapi: {route} documents {sorted(props)}, serves {sorted(ROUTE_FIELDS[route])}")
        return {"type": "object", "additionalProperties": False, "required": required, "properties": props}

    schemas = {
        "Question": {
            "type": "object", "required": ["type", "instructions"],
            "properties": {
                "type": {"enum": list(QUESTION_TYPES)},
                "instructions": {"type": "string"},
                "criteria": {"description": "choice: {label: description} or [labels] (required, at most "
                                            f"{cfg.max_options}); score: [level descriptions]; noul: "
                                            "{false, true} descriptions",
                             "oneOf": [{"type": "object"}, {"type": "array"}]},
                "labels": {"type": "object", "description": "noul only: display labels for false/true"},
            },
        },
        "DecideRequest": request_schema("decide", {"state": state, "questions": _ref("Questions"),
                                                   "preset": preset, **budgets}, ["state"]),
        "DecideBatchRequest": request_schema("decide_batch", {"states": states, "questions": _ref("Questions"),
                                                              "preset": preset, **budgets}, ["states"]),
        "SystemOneRequest": request_schema("systemone", {"state": state, "questions": _ref("Questions"),
                                                         **compat_extras, **budgets}, ["state", "questions"]),
        "SystemOneBatchRequest": request_schema(
            "systemone_batch", {"states": states, "questions": _ref("Questions"), **compat_extras,
                                **batch_extras, **budgets}, ["states", "questions"]),
        "Questions": questions,
        "Answer": {
            "type": "object", "required": ["type", "confidence", "answer_confidence"],
            "properties": {
                "type": {"enum": list(QUESTION_TYPES)},
                "choice": {"type": "string"}, "score": {"type": "number"}, "noul": {"type": "number"},
                "probabilities": {"type": "object"}, "legend": {"type": "object"},
                "confidence": {"type": "number"}, "answer_confidence": {"type": "number"},
                "action": {"type": "object"}, "abstention": {"enum": ["passed", "abstained"]},
                "abstention_threshold": {"type": "number"}, "low_confidence": {"type": "boolean"},
                "x_jev_confidence": {"type": "number", "description": "/v1/systemone routes only"},
            },
        },
        "Usage": {"type": "object", "required": ["input_tokens", "output_tokens"],
                  "properties": {"input_tokens": {"type": "integer"}, "output_tokens": {"type": "integer"},
                                 "latency_ms": {"type": "number"}, "queue_ms": {"type": "number"}}},
        "Decision": {"type": "object", "required": ["model", "answers", "usage"],
                     "properties": {"model": {"type": "string"},
                                    "answers": {"type": "object", "additionalProperties": _ref("Answer")},
                                    "usage": _ref("Usage"),
                                    "actions": {"type": "object", "description": "policy rule results"},
                                    "request_id": {"type": "string"}}},
        "DecideBatchResponse": {"type": "object", "required": ["results", "usage", "request_id"],
                                "properties": {"results": {"type": "array", "items": _ref("Decision")},
                                               "usage": _ref("Usage"), "request_id": {"type": "string"}}},
        "SystemOneBatchResponse": {"type": "object", "required": ["results", "total_usage"],
                                   "properties": {"results": {"type": "array", "items": _ref("Decision")},
                                                  "total_usage": _ref("Usage")}},
        "Error": {"type": "object", "required": ["error", "request_id"],
                  "properties": {"error": {"type": "object", "required": ["message", "type", "field"],
                                           "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                                                          "field": {"type": ["string", "null"]}}},
                                 "request_id": {"type": ["string", "null"]},
                                 "detail": {"type": "string", "description": "/v1/systemone routes only"}}},
        "Object": {"type": "object"},
    }

    def post(summary: str, request: str, response: str) -> dict:
        return {"post": {"summary": summary, "requestBody": {"required": True, **_json(_ref(request))},
                         "responses": {"200": {"description": "answers", **_json(_ref(response))},
                                       **_errors(400, 401, 405, 413, 422, 500, 503, 504)}}}

    def get(summary: str, response: dict, *errors: int) -> dict:
        return {"get": {"summary": summary, "responses": {"200": {"description": "ok", **response},
                                                          **_errors(*errors)}}}

    paths = {
        "/decide": post("Decide one state: answers, request_id, usage.latency_ms/queue_ms, actions",
                        "DecideRequest", "Decision"),
        "/decide/batch": post(f"Decide up to {cfg.max_states} states against the same questions",
                              "DecideBatchRequest", "DecideBatchResponse"),
        "/v1/systemone": post("laya-serve compatible decision", "SystemOneRequest", "Decision"),
        "/v1/systemone/batch": post("laya-serve compatible batch", "SystemOneBatchRequest", "SystemOneBatchResponse"),
        "/health": get("the process answers (never needs auth)", _json(_ref("Object"))),
        "/ready": get("200 once the model is loaded", _json(_ref("Object")), 401, 503),
        "/v1/models": get("the served model and the loaded presets", _json(_ref("Object")), 401),
        "/stats": get("requests, decisions, batch sizes, queue wait and latency p50/p99, tokens",
                      _json(_ref("Object")), 401),
        "/metrics": get("Prometheus exposition", {"content": {"text/plain": {"schema": {"type": "string"}}}}, 401),
        "/openapi.json": get("this document", _json(_ref("Object")), 401),
    }
    doc = {
        "openapi": "3.1.0",
        "info": {"title": "pagoda decision service", "version": "0.1.0",
                 "description": "Laya decisions over HTTP with cross-request batching. Limits: body "
                                f"{cfg.max_body_bytes} bytes, {cfg.max_questions} questions, {cfg.max_states} states."},
        "paths": paths,
        "components": {"schemas": schemas},
    }
    if cfg.api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
        doc["paths"]["/health"]["get"]["security"] = []
    return doc
