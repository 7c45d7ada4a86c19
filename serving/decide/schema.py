"""Request bodies: their shape and the server's limits, checked before anything reaches the model.

Only what HTTP owes its callers regardless of the model lives here: the body is an object with the
route's fields (unknown ones are refused rather than ignored, so a typo'd control is told, not silently
dropped), and sizes and counts stay under the caps in `DecideConfig`. What a state or a question *means*
is laya's to check, once, in `Agent.prepare`; its `InputError` names the field and becomes the same 422.
Where a limit has to read a state it asks laya for the state's text, so laya's own check names the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from laya.errors import InputError
from laya.rows import state_text
from serving.decide.config import DecideConfig
from serving.errors import ApiError

_BUDGETS = ("max_len", "head_max_len", "min_confidence")

# Fields each route accepts. The `/v1/systemone` routes also take the laya-serve controls that only make
# sense for its multi-checkpoint router (`model`, `task`, `lang`, `lang_guess`) and its batch shaping
# (`batch_size`, `sort_by_length`): one model is served here and the batcher shapes passes itself, so
# they have no effect. Their types are checked as laya-serve checks them (`COMPAT_TYPES`), so a client
# whose body laya-serve refuses is refused here too; `model` is any value, as laya-serve reads it as text.
ROUTE_FIELDS = {
    "decide": {"state", "questions", "preset", *_BUDGETS},
    "decide_batch": {"states", "questions", "preset", *_BUDGETS},
    "systemone": {"state", "questions", "model", "task", "lang", "lang_guess", *_BUDGETS},
    "systemone_batch": {"states", "questions", "model", "task", "lang", "lang_guess", "batch_size",
                        "sort_by_length", *_BUDGETS},
}

# laya-serve's types for its controls (null is "not given" there, as here); batch_size must also be positive.
COMPAT_TYPES: dict[str, tuple[type, str]] = {
    "task": (str, "a task name"), "lang": (str, 'a language code string such as "de"'),
    "lang_guess": (str, 'a language code string such as "de"'), "batch_size": (int, "a positive integer"),
    "sort_by_length": (bool, "a boolean"),
}


@dataclass
class DecideRequest:
    states: list[Any]
    questions: Any
    budgets: dict[str, Any] = field(default_factory=dict)
    preset: str | None = None


def decide_request(body: Any, route: str, cfg: DecideConfig, presets: dict[str, dict],
                   default_questions: dict | None = None) -> DecideRequest:
    """`default_questions` answers a body with neither questions nor preset (a student's own questions)."""
    if not isinstance(body, dict):
        raise InputError(f"request body must be a JSON object, got {type(body).__name__}", field="body")
    unknown = sorted(set(body) - ROUTE_FIELDS[route])
    if unknown:
        raise InputError(f"unknown field {unknown[0]!r}; this route takes {', '.join(sorted(ROUTE_FIELDS[route]))}",
                         field=unknown[0])
    if route.endswith("batch"):
        states = body.get("states")
        if not isinstance(states, list) or not states:
            raise InputError("states must be a non-empty list of states", field="states")
        if len(states) > cfg.max_states:
            raise InputError(f"too many states ({len(states)} > {cfg.max_states}, {cfg.where('max_states')})",
                             field="states")
        for i, state in enumerate(states):
            check_state_size(state, f"states[{i}]", cfg)
    else:
        if body.get("state") is None:
            raise InputError("state is required: a string, an object or a list of chat turns", field="state")
        states = [body["state"]]
        check_state_size(states[0], "state", cfg)
    _check_compat(body)
    questions, preset = _questions(body, presets, default_questions, "preset" in ROUTE_FIELDS[route])
    if questions == {} and route.startswith("decide"):  # laya-serve answers `{}` on its routes: those keep it
        raise InputError("questions: empty; ask at least one question", field="questions")
    check_question_counts(questions, cfg)
    check_rows(len(states), questions, route.endswith("batch"), cfg)
    return DecideRequest(states=states, questions=questions, budgets=_budgets(body, cfg), preset=preset)


def check_state_size(state: Any, where: str, cfg: DecideConfig) -> None:
    text = state_text(state, where)
    if len(text) > cfg.max_state_chars:
        raise InputError(f"{where} is too long ({len(text)} > {cfg.max_state_chars} characters, "
                         f"{cfg.where('max_state_chars')})", field=where)


def check_rows(n_states: int, questions: Any, batch: bool, cfg: DecideConfig) -> None:
    """The first cost limit, before anything is tokenised: answers to compute (and to write back). The
    second, in encoder tokens, needs the rows themselves (`Service.decide`)."""
    rows = n_states * (len(questions) if isinstance(questions, dict) else 0)
    if rows > cfg.max_request_rows:
        raise too_large(f"{rows} question rows ({n_states} states x {len(questions)} questions)", cfg.max_request_rows,
                        cfg.where("max_request_rows"), "states" if batch else "questions")


def too_large(cost: str, limit: int, where: str, field: str, lower_max_len: bool = False) -> ApiError:
    """413 `request_too_large`: the body is small but what it asks for is more than one request may cost.
    `lower_max_len`: the cost is in tokens, which a lower max_len cuts (a count of rows it does not)."""
    return ApiError(413, f"this request needs {cost}, over the server's per-request limit of {limit} ({where}); "
                    "send fewer states or questions" + (", or a lower max_len" if lower_max_len else ""),
                    "request_too_large", field)


def check_question_counts(questions: Any, cfg: DecideConfig) -> None:
    """The caps on questions and options. Only counts: a malformed question passes here for laya to name."""
    if not isinstance(questions, dict):
        return
    if len(questions) > cfg.max_questions:
        raise InputError(f"too many questions ({len(questions)} > {cfg.max_questions}, {cfg.where('max_questions')})",
                         field="questions")
    for name, question in questions.items():
        criteria = question.get("criteria") if isinstance(question, dict) else None
        if isinstance(criteria, dict | list) and len(criteria) > cfg.max_options:
            raise InputError(f"question {name!r}: too many options ({len(criteria)} > {cfg.max_options}, "
                             f"{cfg.where('max_options')})",
                             field="criteria", question=str(name))


def _check_compat(body: dict) -> None:
    """The laya-serve controls' types, as laya-serve refuses them (a wrong type is a client's bug, never ignored)."""
    for name, (kind, what) in COMPAT_TYPES.items():
        value = body.get(name)
        if value is None:
            continue
        wrong = not isinstance(value, kind) or (kind is int and (isinstance(value, bool) or value < 1))
        if wrong:
            raise InputError(f"{name} must be {what} or null, got {value!r:.80}", field=name)


def _questions(body: dict, presets: dict[str, dict], default: dict | None,
               takes_preset: bool) -> tuple[Any, str | None]:
    preset = body.get("preset")
    if preset is not None:
        if "questions" in body:
            raise InputError("give either questions or preset, not both", field="preset")
        if not isinstance(preset, str) or preset not in presets:
            known = ", ".join(sorted(presets)) or "none loaded"
            raise InputError(f"unknown preset {preset!r}; known presets: {known}", field="preset")
        return presets[preset], preset
    if "questions" not in body:
        if default is not None:
            return default, None
        raise InputError("questions is required" + (" (or name a preset)" if takes_preset else ""), field="questions")
    return body["questions"], None


def _budgets(body: dict, cfg: DecideConfig) -> dict[str, Any]:
    """The budgets a request sets, under the server's cap; whether a value is a valid budget is laya's call."""
    budgets = {name: body[name] for name in _BUDGETS if body.get(name) is not None}
    for name in ("max_len", "head_max_len"):
        value = budgets.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > cfg.max_len_cap:
            raise InputError(f"{name} exceeds the server limit ({value} > {cfg.max_len_cap}, {cfg.where('max_len_cap')})",
                             field=name)
    return budgets
