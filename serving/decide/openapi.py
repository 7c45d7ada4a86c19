"""The decision API's part of `/openapi.json`: its four routes and their schemas, from the live limits.

Request schemas are checked against `schema.ROUTE_FIELDS` when built, so the document cannot drift from
the parser; question types come from laya, the one place that defines them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from distill.remote_teacher import DIGEST_HEADER
from laya.answers import GATE_KEYS
from laya.questions import MAX_OPTIONS, QUESTION_TYPES
from serving.decide.config import DecideConfig
from serving.decide.schema import ROUTE_FIELDS
from serving.openapi import SCHEMAS, post, ref


def openapi(cfg: DecideConfig, positions: int | None = None, presets: Sequence[str] = (),
            student: dict[str, Any] | None = None) -> dict:
    """`positions`: the served model's encoder positions where they are known before it loads (a budget past them
    is a 422), so the advertised maximum is what it takes and not `--max-len-cap` alone. `presets`: the names a
    request may give (for a student, those of its own questions). `student`: a student's questions (student.json's),
    when a student answers: the document then offers what it takes (its questions, no budgets), not a Laya model's.
    A body the server answers validates against the document, and one it refuses does not, wherever a schema can
    say so (tests/serving/test_openapi.py holds it to a table of both)."""
    state = {"description": "text, a JSON object, or a list of chat turns",
             "oneOf": [{"type": "string", "maxLength": cfg.max_state_chars}, {"type": "object"}, {"type": "array"}]}
    top = min(cfg.max_len_cap, positions) if positions else cfg.max_len_cap
    bound = (f"at most the served model's {positions} positions and --max-len-cap ({cfg.max_len_cap})" if positions
             else f"at most --max-len-cap ({cfg.max_len_cap}) and the served model's positions (laya-mini: 512); past "
                  "either a 422 naming the field")
    budgets = {
        "max_len": {"type": ["integer", "null"], "minimum": 1, "maximum": top,
                    "description": f"tokens of a whole row (question and state), {bound}; null: the model's default"},
        "head_max_len": {"type": ["integer", "null"], "minimum": 1, "maximum": top,
                         "description": "tokens of a row's question part, a soft cap: the instructions keep at least 8 "
                                       f"tokens and each option 4 whatever it says (the official layout); {bound}; "
                                       "null: the model's default"},
    }
    fixed = set(budgets) if student is not None else set()   # a student's budgets are fixed at distillation: 422
    if student is not None:
        budgets = {}
    budgets["min_confidence"] = {
        "description": "abstain below this answer_confidence; a number or a per-bucket object such as "
                       "{\"choice:3-5\": 0.6, \"default\": 0.5}; null: no gate",
        "oneOf": [{"type": "number", "minimum": 0, "maximum": 1},
                  {"type": "object", "minProperties": 1, "propertyNames": {"enum": sorted(GATE_KEYS)},
                   "additionalProperties": {"type": "number", "minimum": 0, "maximum": 1}},
                  {"type": "null"}]}
    states = {"type": "array", "minItems": 1, "maxItems": cfg.max_states, "items": state}
    text_or_null = {"type": ["string", "null"]}
    compat_extras = {"model": {"description": "any value, accepted for compatibility (laya-serve reads it as text); "
                                              "one model is served"},
                     "task": text_or_null, "lang": text_or_null, "lang_guess": text_or_null}
    batch_extras = {"batch_size": {"type": ["integer", "null"], "minimum": 1, "description": "accepted for "
                                   "compatibility; the batcher shapes passes"},
                    "sort_by_length": {"type": ["boolean", "null"]}}
    preset = {"enum": [*presets, None], "description": "name of a question set from the presets file" +
              ("" if student is None else " (those of this student's questions); without questions or a preset, "
                                          "all of its questions")}
    # Not both questions and a preset (a null one is no preset); a Laya model needs one of them.
    one_source = {"anyOf": [{"not": {"required": ["questions"]}}, {"not": {"required": ["preset"]}},
                            {"properties": {"preset": {"type": "null"}}}]}
    needs_source = {"anyOf": [{"required": ["questions"]}, {"required": ["preset"], "properties": {"preset": {"type": "string"}}}]}
    sources = [one_source] if student is not None else [one_source, needs_source]

    def request_schema(route: str, props: dict, required: list[str], rules: list[dict] | None = None) -> dict:
        if set(props) | fixed != ROUTE_FIELDS[route]:  # the document must not drift from the parser
            raise RuntimeError(f"openapi: {route} documents {sorted(props)}, serves {sorted(ROUTE_FIELDS[route])}")
        schema = {"type": "object", "additionalProperties": False, "required": required, "properties": props}
        return {**schema, "allOf": rules} if rules else schema

    error = SCHEMAS["Error"]
    schemas = {
        **questions_schemas(cfg, student),
        "DecideRequest": request_schema("decide", {"state": state, "questions": ref("Questions"),
                                                   "preset": preset, **budgets}, ["state"], sources),
        "DecideBatchRequest": request_schema("decide_batch", {"states": states, "questions": ref("Questions"),
                                                              "preset": preset, **budgets}, ["states"], sources),
        "SystemOneRequest": request_schema("systemone", {"state": state, "questions": ref("SystemOneQuestions"),
                                                         **compat_extras, **budgets}, ["state", "questions"]),
        "SystemOneBatchRequest": request_schema(
            "systemone_batch", {"states": states, "questions": ref("SystemOneQuestions"), **compat_extras,
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


def questions_schemas(cfg: DecideConfig, student: dict[str, Any] | None) -> dict[str, dict]:
    """`Questions` (the decide routes: at least one), `SystemOneQuestions` (laya-serve answers `{}` with no answers,
    so a Laya model does too; a student refuses it) and, for a Laya model, a `Question` per type. A student takes
    only its own questions, each as it was distilled (or their names), or null for all of them."""
    if student is not None:
        own = {"type": "object", "minProperties": 1, "additionalProperties": False,
               "properties": {name: {"const": definition} for name, definition in student.items()},
               "description": "this student's own questions, each as it was distilled; null or absent: all of them"}
        names = {"type": "array", "minItems": 1, "items": {"enum": list(student)}, "description": "names of its "
                 "questions"}
        either = {"oneOf": [own, names, {"type": "null"}]}
        return {"Questions": either, "SystemOneQuestions": either}
    n_options = min(cfg.max_options, MAX_OPTIONS)
    text = {"type": "string", "pattern": "\\S"}   # not empty, not only spaces
    instructions = {"description": "the text the model answers; a number, list or object is written as JSON (as the "
                                   "official runtime does)",
                    "oneOf": [text, {"type": "number"}, {"type": "object", "minProperties": 1},
                              {"type": "array", "minItems": 1}]}
    label = {"oneOf": [text, {"type": ["number", "boolean"]}]}
    order = {"type": "array", "items": {"type": "integer", "minimum": 0}, "uniqueItems": True,
             "description": "the order the options are shown in, a permutation of their indices; answers keep the "
                            "caller's order"}

    def question(kind: str, criteria: dict, required: bool, **more: dict) -> dict:
        return {"type": "object", "additionalProperties": False,
                "required": ["type", "instructions", *(["criteria"] if required else [])],
                "properties": {"type": {"const": kind}, "instructions": instructions, "criteria": criteria,
                               "option_order": order, **more}}

    choice = question("choice", {"description": f"{{label: description}} or [labels], 1 to {n_options} options "
                                                "(one option is answered with probability 1, as the official "
                                                "runtime answers it)",
                                 "oneOf": [{"type": "object", "minProperties": 1, "maxProperties": n_options,
                                            "propertyNames": text},
                                           {"type": "array", "minItems": 1, "maxItems": n_options,
                                            "uniqueItems": True, "items": label}]}, True)
    score = question("score", {"description": f"[level descriptions], level 0 first, 2 to {n_options} levels",
                               "type": "array", "minItems": 2, "maxItems": n_options, "uniqueItems": True,
                               "items": {"oneOf": [text, {"type": ["number", "boolean", "object", "array"]}]}}, True)
    noul = question("noul", {"description": "optional {false, true} descriptions (keys in any case)",
                             "type": ["object", "null"], "maxProperties": 2,
                             "propertyNames": {"pattern": "^([Ff][Aa][Ll][Ss][Ee]|[Tt][Rr][Uu][Ee])$"}}, False,
                    labels={"type": "object", "description": "display labels for the false and true options",
                            "required": ["false", "true"], "additionalProperties": False,
                            "properties": {"false": text, "true": text}})
    if [kind for kind in QUESTION_TYPES] != ["choice", "score", "noul"]:  # one schema per laya question type
        raise RuntimeError(f"openapi: questions are documented for choice, score, noul; laya has {QUESTION_TYPES}")
    questions = {"type": "object", "maxProperties": cfg.max_questions, "propertyNames": text,
                 "additionalProperties": ref("Question")}
    return {"Question": {"oneOf": [choice, score, noul]}, "Questions": {**questions, "minProperties": 1},
            "SystemOneQuestions": questions}
