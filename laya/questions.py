"""The official question format, validated once and rendered to option texts.

Validation lives here, ahead of tokenisation, so every malformed question fails with a
`InputError` (a `ValueError`) that names the question and the field instead of surfacing three frames down as a
`KeyError` or a wrong-shaped tensor. It is deliberately stricter than the official runtime where
the official runtime answers something meaningless (a one-level score, duplicate levels, more
options than the act head's k/255 feature can represent).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from laya.errors import InputError, question_error

QUESTION_TYPES = ("choice", "score", "noul")   # index = the type id the model embeds
QTYPES = {name: i for i, name in enumerate(QUESTION_TYPES)}
MAX_OPTIONS = 255
NOUL_DEFAULT_TEXT = {"false": "no, the statement does not hold", "true": "yes, the statement holds"}


@dataclass(frozen=True)
class Question:
    name: str
    type: str
    instructions: str          # rendered text (non-strings are JSON, as the official runtime does)
    keys: tuple[Any, ...]      # answer keys in option-index order (choice labels, score levels, false/true)
    options: tuple[str, ...]   # rendered option texts in option-index order
    legend: tuple[str, ...]    # score level texts (empty for other types)
    option_order: tuple[int, ...] | None = None

    @property
    def qtype(self) -> int:
        return QTYPES[self.type]

    @property
    def slots(self) -> tuple[int, ...]:
        """Which option sits in each [MASK] slot."""
        return self.option_order if self.option_order is not None else tuple(range(len(self.options)))


def render_criterion(value: Any) -> str:
    """Structured criteria read as single-line JSON (what the released models were trained on)."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "), default=str)


_fail = question_error


def parse_questions(questions: Any, option_order: dict[str, Any] | None = None) -> list[Question]:
    """Validate a `{name: definition}` mapping; `option_order` overrides per-question orders."""
    if not isinstance(questions, dict):
        raise InputError(f"questions: expected a dict of name -> definition, got {type(questions).__name__}",
                         field="questions")
    if option_order is not None:
        if not isinstance(option_order, dict):
            raise InputError("option_order: expected a dict of question name -> permutation, got "
                             f"{type(option_order).__name__}", field="option_order")
        unknown = [k for k in option_order if k not in questions]
        if unknown:
            raise InputError(f"option_order: names no question {unknown[0]!r}", field="option_order")
    out = []
    for name, qdef in questions.items():
        if option_order is not None and name in option_order:
            if not isinstance(qdef, dict):
                raise _fail(name, "type", f"definition must be a dict, got {type(qdef).__name__}")
            try:
                qdef = {**qdef, "option_order": option_order[name]}
                out.append(parse_question(name, qdef))
            except InputError as exc:  # the order came from the argument: point there
                if exc.field == "option_order":
                    raise InputError(str(exc), field="option_order", question=exc.question,
                                     at=f"option_order.{name}") from None
                raise
            continue
        out.append(parse_question(name, qdef))
    return out


def parse_question(name: Any, qdef: Any) -> Question:
    if not isinstance(name, str) or not name.strip():
        raise InputError(f"question name must be a non-empty string, got {name!r}", field="questions")
    if not isinstance(qdef, dict):
        raise InputError(f"question {name!r}: definition must be a dict, got {type(qdef).__name__}",
                         question=name)
    unknown = set(qdef) - {"type", "instructions", "criteria", "labels", "option_order"}
    if unknown:
        raise _fail(name, sorted(unknown)[0], "unknown field")
    qtype = qdef.get("type")
    if not isinstance(qtype, str) or qtype not in QTYPES:
        raise _fail(name, "type", f"unknown type {qtype!r}; use one of {sorted(QUESTION_TYPES)}")
    instructions = _instructions(name, qdef)
    crit = qdef.get("criteria")
    if "labels" in qdef and qtype != "noul":
        raise _fail(name, "labels", "only noul questions take labels")
    legend: tuple[str, ...] = ()
    if qtype == "choice":
        keys, options = _choice(name, crit)
    elif qtype == "score":
        keys, options, legend = _score(name, crit)
    else:
        keys, options = _noul(name, crit, qdef.get("labels"))
    if len(options) > MAX_OPTIONS:
        raise _fail(name, "criteria", f"{len(options)} options; at most {MAX_OPTIONS} are supported")
    order = None
    if "option_order" in qdef:
        order = _order(name, qdef["option_order"], len(options))
    return Question(name, qtype, instructions, tuple(keys), tuple(options), legend, order)


def _instructions(name: str, qdef: dict) -> str:
    if "instructions" not in qdef or qdef["instructions"] is None:
        raise _fail(name, "instructions", "missing; give the text the model should answer")
    ins = qdef["instructions"]
    if isinstance(ins, bool) or not isinstance(ins, (str, dict, list, int, float)):
        raise _fail(name, "instructions", f"must be a string (or a number, list or object, written as JSON), "
                                          f"got {type(ins).__name__}")
    if isinstance(ins, str):
        if not ins.strip():
            raise _fail(name, "instructions", "must not be empty")
        return ins
    if isinstance(ins, (dict, list)) and not ins:
        raise _fail(name, "instructions", "must not be empty")
    return json.dumps(ins, ensure_ascii=False)


def _choice(name: str, crit: Any) -> tuple[list, list[str]]:
    if isinstance(crit, list):
        seen: dict = {}
        for i, label in enumerate(crit):
            _check_label(name, i, label)
            if label in seen:
                raise _fail(name, "criteria", f"label {i} ({label!r}) duplicates label {seen[label]}")
            seen[label] = i
        crit = {label: None for label in crit}
    if not isinstance(crit, dict):
        raise _fail(name, "criteria", "a choice takes a dict of label -> description or a list of labels")
    if not crit:
        raise _fail(name, "criteria", "must not be empty")
    for i, label in enumerate(crit):
        _check_label(name, i, label)
    options = [str(k) if v is None or v == "" else f"{k}: {render_criterion(v)}" for k, v in crit.items()]
    return list(crit), options


def _check_label(name: str, i: int, label: Any) -> None:
    if label is None or not isinstance(label, (str, int, float, bool)):
        raise _fail(name, "criteria", f"label {i} must be a string or number, got {label!r}")
    if isinstance(label, str) and not label.strip():
        raise _fail(name, "criteria", f"label {i} is empty")


def _score(name: str, crit: Any) -> tuple[list, list[str], tuple[str, ...]]:
    if not isinstance(crit, list):
        raise _fail(name, "criteria", "a score takes a list of level descriptions, level 0 first")
    if len(crit) < 2:
        raise _fail(name, "criteria", f"a score needs at least 2 levels, got {len(crit)}")
    legend = []
    for i, level in enumerate(crit):
        if level is None or (isinstance(level, str) and not level.strip()):
            raise _fail(name, "criteria", f"level {i} is empty")
        text = render_criterion(level)
        if text in legend:
            raise _fail(name, "criteria", f"level {i} duplicates level {legend.index(text)}")
        legend.append(text)
    options = [f"level {i}: {text}" for i, text in enumerate(legend)]
    return list(range(len(crit))), options, tuple(legend)


def _noul(name: str, crit: Any, labels: Any) -> tuple[list, list[str]]:
    if crit is None:
        crit = {}
    if not isinstance(crit, dict):
        raise _fail(name, "criteria", "a noul takes a dict with optional 'false'/'true' descriptions")
    given: dict[str, Any] = {}
    for k in crit:  # keys are read in any case: two that differ only by it would silently keep one description
        key = str(k).lower()
        if key in given:
            raise _fail(name, "criteria", f"keys {given[key]!r} and {k!r} are both {key!r} (keys are read in any "
                                          "case); give one")
        given[key] = k
    crit = {str(k).lower(): v for k, v in crit.items()}
    if not set(crit) <= {"false", "true"}:
        raise _fail(name, "criteria", f"a noul's criteria are keyed only 'false'/'true', got {sorted(crit)}")
    if labels is None:
        labels = {"false": "false", "true": "true"}
    if (not isinstance(labels, dict) or set(labels) != {"false", "true"}
            or not all(isinstance(v, str) and v.strip() for v in labels.values())
            or labels["false"].strip() == labels["true"].strip()):
        raise _fail(name, "labels", "must map exactly 'false' and 'true' to distinct non-empty strings")
    options = []
    for key in ("false", "true"):
        text = crit.get(key)
        text = NOUL_DEFAULT_TEXT[key] if text in (None, "") else render_criterion(text)
        options.append(f"{labels[key].strip()}: {text}")
    return ["false", "true"], options


def _order(name: str, order: Any, n: int) -> tuple[int, ...]:
    ok = (isinstance(order, (list, tuple)) and len(order) == n
          and all(isinstance(i, int) and not isinstance(i, bool) for i in order)
          and sorted(order) == list(range(n)))
    if not ok:
        raise _fail(name, "option_order", f"must be a permutation of range({n}), got {order!r}")
    return tuple(order)


def check_answer_keys(questions: list[Question]) -> None:
    """Every choice label must be a key of its own in the answer JSON, and a value JSON has.

    Python tells `1` from `"1"` (and `True` from `"true"`), but the answer's `probabilities` object writes
    both as the key `"1"`: a response with duplicate keys, which JSON readers resolve differently. A NaN
    or infinite label would be written as a bare `NaN`, which is not JSON at all."""
    for q in questions:
        if q.type != "choice":
            continue
        seen: dict[str, int] = {}
        for i, key in enumerate(q.keys):
            if isinstance(key, float) and not math.isfinite(key):
                raise question_error(q.name, "criteria", f"label {i} ({key!r}) is not a finite number")
            text = key if isinstance(key, str) else json.dumps(key)
            if text in seen:
                raise question_error(q.name, "criteria", f"label {i} ({key!r}) and label {seen[text]} "
                                     f"({q.keys[seen[text]]!r}) are the same key {text!r} in the answer JSON")
            seen[text] = i
