"""The decision API's part of `/openapi.json`: its four routes and their schemas, from the live limits.

Request schemas are checked against `schema.ROUTE_FIELDS` when built, so the document cannot drift from
the parser; question types come from laya, the one place that defines them.
"""

from __future__ import annotations

from distill.remote_teacher import DIGEST_HEADER
from laya.questions import QUESTION_TYPES
from serving.decide.config import DecideConfig
from serving.decide.schema import ROUTE_FIELDS
from serving.openapi import SCHEMAS, post, ref


def openapi(cfg: DecideConfig, positions: int | None = None) -> dict:
    """`positions`: the served model's encoder positions where they are known before it loads (a budget past them
    is a 422), so the advertised maximum is what it takes and not `--max-len-cap` alone."""
    state = {"description": "text, a JSON object, or a list of chat turns",
             "oneOf": [{"type": "string", "maxLength": cfg.max_state_chars}, {"type": "object"}, {"type": "array"}]}
    top = min(cfg.max_len_cap, positions) if positions else cfg.max_len_cap
    bound = (f"at most the served model's {positions} positions and --max-len-cap ({cfg.max_len_cap})" if positions
             else f"at most --max-len-cap ({cfg.max_len_cap}) and the served model's positions (laya-mini: 512); past "
                  "either a 422 naming the field")
    budgets = {
        "max_len": {"type": "integer", "minimum": 1, "maximum": top,
                    "description": f"tokens of a whole row (question and state), {bound}"},
        "head_max_len": {"type": "integer", "minimum": 1, "maximum": top,
                         "description": "tokens of a row's question part, a soft cap: the instructions keep at least 8 "
                                       f"tokens and each option 4 whatever it says (the official layout); {bound}"},
        "min_confidence": {"description": "abstain below this answer_confidence; a number or a per-bucket "
                                          "object such as {\"choice:3-5\": 0.6, \"default\": 0.5}",
                           "oneOf": [{"type": "number", "minimum": 0, "maximum": 1}, {"type": "object"}]},
    }
    states = {"type": "array", "minItems": 1, "maxItems": cfg.max_states, "items": state}
    compat_extras = {"model": {"type": "string", "description": "accepted for compatibility; one model is served"},
                     "task": {"type": "string"}, "lang": {"type": "string"}, "lang_guess": {"type": "string"}}
    batch_extras = {"batch_size": {"type": "integer"}, "sort_by_length": {"type": "boolean"}}
    preset = {"type": "string", "description": "name of a question set from the presets file"}

    def request_schema(route: str, props: dict, required: list[str]) -> dict:
        if set(props) != ROUTE_FIELDS[route]:  # the document must not drift from the parser
            raise RuntimeError(f"openapi: {route} documents {sorted(props)}, serves {sorted(ROUTE_FIELDS[route])}")
        return {"type": "object", "additionalProperties": False, "required": required, "properties": props}

    error = SCHEMAS["Error"]
    schemas = {
        "Question": {
            "type": "object", "required": ["type", "instructions"],
            "properties": {
                "type": {"enum": list(QUESTION_TYPES)},
                "instructions": {"type": "string"},
                "criteria": {"description": "choice: {label: description} or [labels] (required); score: "
                                            "[level descriptions]; noul: {false, true} descriptions; at most "
                                            f"{cfg.max_options} options",
                             "oneOf": [{"type": "object"}, {"type": "array"}]},
                "labels": {"type": "object", "description": "noul only: display labels for false/true"},
            },
        },
        "Questions": {"type": "object", "maxProperties": cfg.max_questions, "additionalProperties": ref("Question")},
        "DecideRequest": request_schema("decide", {"state": state, "questions": ref("Questions"),
                                                   "preset": preset, **budgets}, ["state"]),
        "DecideBatchRequest": request_schema("decide_batch", {"states": states, "questions": ref("Questions"),
                                                              "preset": preset, **budgets}, ["states"]),
        "SystemOneRequest": request_schema("systemone", {"state": state, "questions": ref("Questions"),
                                                         **compat_extras, **budgets}, ["state", "questions"]),
        "SystemOneBatchRequest": request_schema(
            "systemone_batch", {"states": states, "questions": ref("Questions"), **compat_extras,
                                **batch_extras, **budgets}, ["states", "questions"]),
        "Answer": {
            "type": "object", "required": ["type", "confidence", "answer_confidence"],
            "properties": {
                "type": {"enum": list(QUESTION_TYPES)},
                "choice": {"type": ["string", "number", "boolean"], "description": "the chosen label, as given in "
                                                                             "`criteria` (a number or a boolean too)"},
                "score": {"type": "number"}, "noul": {"type": "number"},
                "probabilities": {"type": "object"}, "legend": {"type": "object"},
                "confidence": {"type": "number"}, "answer_confidence": {"type": "number"},
                "action": {"type": "object", "description": "act_probability: the act head's, null for a student"},
                "abstention": {"enum": ["passed", "abstained"]},
                "abstention_threshold": {"type": "number"}, "low_confidence": {"type": "boolean"},
                "x_jev_confidence": {"type": "number", "description": "/v1/systemone routes only"},
                "answered_by": {"enum": ["student", "teacher"],
                                "description": "a student served with --defer-below: who gave this answer"},
            },
        },
        "Usage": {"type": "object", "required": ["input_tokens", "output_tokens"],
                  "properties": {"input_tokens": {"type": "integer"}, "output_tokens": {"type": "integer"},
                                 "latency_ms": {"type": "number"}, "queue_ms": {"type": "number"},
                                 "deferred_questions": {"type": "array", "items": {"type": "string"},
                                                        "description": "--defer-below: the questions the Laya "
                                                                       "model answered for this state"},
                                 "teacher_input_tokens": {"type": "integer"},
                                 "deferral_error": {"type": ["string", "null"],
                                                    "description": "--defer-to: why the remote teacher gave no "
                                                                   "answer (the student's stand); null when none"}}},
        "Decision": {"type": "object", "required": ["model", "answers", "usage"],
                     "properties": {"model": {"type": "string"},
                                    "answers": {"type": "object", "additionalProperties": ref("Answer")},
                                    "usage": ref("Usage"),
                                    "actions": {"type": "object", "description": "policy rule results"},
                                    "request_id": {"type": "string"}}},
        "DecideBatchResponse": {"type": "object", "required": ["results", "usage", "request_id"],
                                "properties": {"results": {"type": "array", "items": ref("Decision")},
                                               "usage": ref("Usage"), "request_id": {"type": "string"}}},
        "SystemOneBatchResponse": {"type": "object", "required": ["results", "total_usage"],
                                   "properties": {"results": {"type": "array", "items": ref("Decision")},
                                                  "total_usage": ref("Usage")}},
        "SystemOneError": {**error, "required": [*error["required"], "detail"],
                           "properties": {**error["properties"],
                                          "detail": {"type": "string", "description": "error.message again, "
                                                     "where laya-serve clients read it"}}},
    }
    paths = {
        "/decide": post("Decide one state: answers, request_id, usage.latency_ms/queue_ms, actions",
                        "DecideRequest", "Decision"),
        "/decide/batch": post(f"Decide up to {cfg.max_states} states against the same questions",
                              "DecideBatchRequest", "DecideBatchResponse"),
        "/v1/systemone": post("laya-serve compatible decision", "SystemOneRequest", "Decision", "SystemOneError"),
        "/v1/systemone/batch": post("laya-serve compatible batch", "SystemOneBatchRequest",
                                    "SystemOneBatchResponse", "SystemOneError"),
    }
    for route in paths.values():
        route["post"]["responses"]["200"]["headers"] = {DIGEST_HEADER: {
            "description": "the answers digest (config and weights) of the Laya checkpoint that answered; absent "
                           "when a student answers. A student deferring here refuses another checkpoint's answers",
            "schema": {"type": "string", "pattern": "^[0-9a-f]{16}$"}}}
    return {"paths": paths, "schemas": schemas}
