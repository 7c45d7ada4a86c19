"""Decision data for training and calibration: JSONL examples -> one target per question -> encoder rows.

An example is `{"state", "questions": {name: definition}, "labels": {name: label | level | bool}}`
or, for soft targets, `"targets": {name: {option: p}}` (both may appear; a question takes one).
Every problem is reported as a `ValueError` naming the line, the question and the field, because
a training run that silently drops or mislabels questions is worse than one that refuses to start.

`encode` renders a question exactly as inference does (`laya.rows`), optionally with a random
option order and a random option subset, so the head must read its options instead of learning
which slot or which word tends to be right.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from typing import Any

from laya.checks import check_utf8
from laya.questions import Question, parse_question
from laya.rows import Budgets, Row, build_rows, check_state


@dataclass(frozen=True)
class Item:
    """One question of one example with its target distribution over the question's answer keys."""

    state: Any
    name: str
    qdef: dict
    question: Question
    target: tuple[float, ...]   # aligned with question.keys
    hard: bool                  # a single gold label (subsets may then drop other options)
    source: str = ""


def _key_of(question: Question, label: Any, where: str) -> int:
    """Index of `label` among the question's answer keys (noul: bools or "true"/"false")."""
    if question.type == "noul":
        if isinstance(label, bool):
            label = "true" if label else "false"
        elif isinstance(label, str) and label.lower() in ("true", "false"):
            label = label.lower()
        else:
            raise ValueError(f"{where}: a noul label must be true or false, got {label!r}")
    if question.type == "score":
        if isinstance(label, bool) or not isinstance(label, int):
            if isinstance(label, str) and label in question.legend:
                return question.legend.index(label)
            raise ValueError(f"{where}: a score label must be a level index 0..{len(question.keys) - 1} "
                             f"or a level text, got {label!r}")
    for i, key in enumerate(question.keys):
        if key == label and type(key) is type(label) or str(key) == str(label):
            return i
    raise ValueError(f"{where}: {label!r} is not one of the options {list(question.keys)}")


def items_from_example(ex: Any, where: str) -> list[Item]:
    """Validate one example; `where` (e.g. "train.jsonl:12") prefixes every error."""
    if not isinstance(ex, dict):
        raise ValueError(f"{where}: an example must be a JSON object, got {type(ex).__name__}")
    if "state" not in ex:
        raise ValueError(f"{where}: field 'state' is missing")
    try:
        check_state(ex["state"])
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    questions = ex.get("questions")
    if not isinstance(questions, dict) or not questions:
        raise ValueError(f"{where}: field 'questions' must be a non-empty object of name -> definition")
    labels = ex.get("labels") or {}
    targets = ex.get("targets") or {}
    if not isinstance(labels, dict) or not isinstance(targets, dict):
        raise ValueError(f"{where}: fields 'labels' and 'targets' must be objects keyed by question name")
    for name in list(labels) + list(targets):
        if name not in questions:
            raise ValueError(f"{where}: question {name!r}: has a label or target but no definition")
    items = []
    for name, qdef in questions.items():
        try:
            q = parse_question(name, qdef)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        at = f"{where}: question {name!r}: field"
        if name in labels and name in targets:
            raise ValueError(f"{at} 'labels': give a label or soft targets, not both")
        if name in labels:
            gold = _key_of(q, labels[name], f"{at} 'labels'")
            target = tuple(1.0 if i == gold else 0.0 for i in range(len(q.keys)))
            hard = True
        elif name in targets:
            target = _soft_target(q, targets[name], f"{at} 'targets'")
            hard = False
        else:
            raise ValueError(f"{at} 'labels': no label or target for this question")
        items.append(Item(ex["state"], name, qdef, q, target, hard, str(ex.get("source", ""))))
    return items


def _soft_target(q: Question, dist: Any, where: str) -> tuple[float, ...]:
    if not isinstance(dist, dict) or not dist:
        raise ValueError(f"{where}: expected an object of option -> probability")
    out = [0.0] * len(q.keys)
    for label, p in dist.items():
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not math.isfinite(p) or p < 0:
            raise ValueError(f"{where}: probability of {label!r} must be a number >= 0, got {p!r}")
        key = label
        if q.type == "score" and isinstance(label, str) and label.isdigit():
            key = int(label)
        out[_key_of(q, key, where)] += float(p)
    total = sum(out)
    if abs(total - 1.0) > 1e-3:
        raise ValueError(f"{where}: probabilities must sum to 1, got {total:.4f}")
    return tuple(p / total for p in out)


def read_jsonl(path: str, flag: str = "--data") -> list[Item]:
    """The file's items; `flag` names the file in every error about it (a command may read several)."""
    items = []
    try:
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    ex = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{flag}: {path}:{i}: not valid JSON ({exc.msg})") from None
                items.extend(items_from_example(ex, f"{flag}: {path}:{i}"))
    except UnicodeDecodeError:
        check_utf8(path, flag)   # names the flag and the byte's offset in the file, not in a read buffer
        raise
    except FileNotFoundError:
        raise ValueError(f"{flag}: {path} does not exist") from None
    if not items:
        raise ValueError(f"{flag}: {path} holds no examples")
    return items


@dataclass(frozen=True)
class Augment:
    """Per-use randomisation; probabilities in [0, 1]."""

    shuffle: float = 1.0   # draw a random option order
    subset: float = 0.0    # drop some wrong options of a hard-labelled choice (keeps >= 2)


def encode(tok: Any, item: Item, budgets: Budgets, rng: random.Random | None = None,
           augment: Augment | None = None) -> tuple[Row, list[float]]:
    """The row inference would build for this question, and the target in the row's slot order."""
    q, target, qdef = item.question, list(item.target), item.qdef
    if rng is not None and augment is not None:
        if q.type == "choice" and item.hard and len(q.keys) > 2 and rng.random() < augment.subset:
            gold = target.index(1.0)
            keep = sorted([gold] + rng.sample([i for i in range(len(q.keys)) if i != gold],
                                              rng.randint(1, len(q.keys) - 2)))
            crit = qdef["criteria"]
            if isinstance(crit, dict):
                names = list(crit)
                qdef = {**qdef, "criteria": {names[i]: crit[names[i]] for i in keep}}
            else:
                qdef = {**qdef, "criteria": [crit[i] for i in keep]}
            target = [target[i] for i in keep]
            q = parse_question(item.name, qdef)
        if rng.random() < augment.shuffle:
            order = list(range(len(q.keys)))
            rng.shuffle(order)
            q = parse_question(item.name, {**qdef, "option_order": order})
    row = build_rows(tok, item.state, [q], budgets)[0]
    return row, [target[i] for i in q.slots]
