"""Request bodies: parsed and checked against the server's limits before anything reaches the model.

The checks here are the ones HTTP owes its callers regardless of the model (shape, sizes, the caps in
`ServeConfig`); what a question *means* is checked once, by `Agent.prepare`, whose `ValueError` the app
turns into a 422 as well. Unknown body fields are refused rather than ignored, so a typo'd control is
told, not silently dropped.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from serving.config import ServeConfig
from serving.errors import ApiError, invalid

QUESTION_TYPES = ("choice", "score", "noul")
_BUDGETS = ("max_len", "head_max_len", "min_confidence")

# Fields each route accepts. The `/v1/systemone` routes also take the laya-serve controls that only make
# sense for its multi-checkpoint router (`model`, `task`, `lang`, `lang_guess`) and its batch shaping
# (`batch_size`, `sort_by_length`): one model is served here and the batcher shapes passes itself, so
# they are accepted for client compatibility and have no effect.
ROUTE_FIELDS = {
    "decide": {"state", "questions", "preset", *_BUDGETS},
    "decide_batch": {"states", "questions", "preset", *_BUDGETS},
    "systemone": {"state", "questions", "model", "task", "lang", "lang_guess", *_BUDGETS},
    "systemone_batch": {"states", "questions", "model", "task", "lang", "lang_guess", "batch_size",
                        "sort_by_length", *_BUDGETS},
}


@dataclass
class DecideRequest:
    states: list[Any]
    questions: dict[str, dict]
    budgets: dict[str, Any] = field(default_factory=dict)
    preset: str | None = None


def parse_json(data: bytes) -> Any:
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", "invalid_json") from None


def decide_request(body: Any, route: str, cfg: ServeConfig, presets: dict[str, dict],
                   default_questions: dict | None = None) -> DecideRequest:
    """`default_questions` answers a body with neither questions nor preset (a student's own questions)."""
    if not isinstance(body, dict):
        raise invalid("body", f"request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - ROUTE_FIELDS[route])
    if unknown:
        raise invalid(unknown[0], f"unknown field {unknown[0]!r}; this route takes "
                                  f"{', '.join(sorted(ROUTE_FIELDS[route]))}")
    if route.endswith("batch"):
        states = body.get("states")
        if not isinstance(states, list) or not states:
            raise invalid("states", "states must be a non-empty list of states")
        if len(states) > cfg.max_states:
            raise invalid("states", f"too many states ({len(states)} > {cfg.max_states})")
        for i, state in enumerate(states):
            check_state(state, f"states[{i}]", cfg)
    else:
        if "state" not in body or body["state"] is None:
            raise invalid("state", "state is required: a string, an object or a list of chat turns")
        states = [body["state"]]
        check_state(states[0], "state", cfg)
    questions, preset = _questions(body, presets, default_questions)
    check_questions(questions, cfg)
    return DecideRequest(states=states, questions=questions, budgets=_budgets(body, cfg), preset=preset)


def check_state(state: Any, where: str, cfg: ServeConfig) -> None:
    if not isinstance(state, str | dict | list):
        raise invalid(where, f"{where} must be a string, an object or a list, got {type(state).__name__}")
    text = state if isinstance(state, str) else json.dumps(state, ensure_ascii=False)
    if len(text) > cfg.max_state_chars:
        raise invalid(where, f"{where} is too long ({len(text)} > {cfg.max_state_chars} characters)")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        # A lone `\udXXX` escape is legal JSON the tokenizer cannot encode: the caller's mistake, not a 500.
        raise invalid(where, f"{where} contains an unpaired UTF-16 surrogate") from None


def check_questions(questions: Any, cfg: ServeConfig) -> None:
    if not isinstance(questions, dict):
        raise invalid("questions", "questions must be an object mapping a name to a question")
    if len(questions) > cfg.max_questions:
        raise invalid("questions", f"too many questions ({len(questions)} > {cfg.max_questions})")
    for qid, question in questions.items():
        where = f"questions.{qid}"
        if not isinstance(question, dict):
            raise invalid(where, f"question {qid!r} must be an object")
        kind = question.get("type")
        if kind not in QUESTION_TYPES:
            raise invalid(f"{where}.type", f"question {qid!r}: unknown type {kind!r}; use one of "
                                           f"{', '.join(QUESTION_TYPES)}")
        criteria = question.get("criteria")
        if kind == "choice" and not criteria:
            raise invalid(f"{where}.criteria", f"question {qid!r}: a choice question needs criteria "
                                               "(an object of label: description, or a list of labels)")
        if kind in ("choice", "score") and isinstance(criteria, dict | list) and len(criteria) > cfg.max_options:
            raise invalid(f"{where}.criteria", f"question {qid!r}: too many options "
                                               f"({len(criteria)} > {cfg.max_options})")


def _questions(body: dict, presets: dict[str, dict], default: dict | None) -> tuple[dict, str | None]:
    preset = body.get("preset")
    if preset is not None:
        if "questions" in body:
            raise invalid("preset", "give either questions or preset, not both")
        if not isinstance(preset, str) or preset not in presets:
            known = ", ".join(sorted(presets)) or "none loaded"
            raise invalid("preset", f"unknown preset {preset!r}; known presets: {known}")
        return presets[preset], preset
    if "questions" not in body:
        if default is not None:
            return default, None
        raise invalid("questions", "questions is required (or name a preset)")
    return body["questions"], None


def _budgets(body: dict, cfg: ServeConfig) -> dict[str, Any]:
    budgets: dict[str, Any] = {}
    for name in ("max_len", "head_max_len"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise invalid(name, f"{name} must be a positive integer, got {value!r}")
        if value > cfg.max_len_cap:
            raise invalid(name, f"{name} exceeds the server limit ({value} > {cfg.max_len_cap})")
        budgets[name] = value
    value = body.get("min_confidence")
    if value is not None:
        # A per-bucket object ({"choice:3-5": 0.6, "default": 0.5}) is the core's to check.
        if not isinstance(value, dict) and (isinstance(value, bool) or not isinstance(value, int | float)
                                            or not math.isfinite(value) or not 0.0 <= value <= 1.0):
            raise invalid("min_confidence", f"min_confidence must be a number in [0, 1], got {value!r}")
        budgets["min_confidence"] = value
    return budgets


_CORE_MESSAGE = re.compile(r"question '([^']+)'(?:: field '([^']+)')?")


def field_of(message: str) -> str:
    """JSON path for a core `ValueError`, whose text reads `question 'q': field 'f': ...` or `field: ...`."""
    match = _CORE_MESSAGE.search(message)
    if match:
        question, field_name = match.groups()
        if field_name in ("max_len", "head_max_len"):
            return field_name
        return f"questions.{question}.{field_name}" if field_name else f"questions.{question}"
    head = message.split(":", 1)[0].strip()
    return head if re.fullmatch(r"[\w.\[\]]+", head) else "questions"
