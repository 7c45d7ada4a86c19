"""The routing rules file: Laya questions asked about each request, and rules that pick an upstream group.

```yaml
questions:                      # laya's question format, plus `input`: what of the request is the state
  needs_reasoning:
    type: noul
    instructions: Does answering this need several steps of reasoning, maths or code?
    input: last_user            # last_user (default) | conversation | field:<dotted.path>
routes:                         # in order; the first rule that is true picks the group it is named after
  frontier: needs_reasoning.noul > 0.7
default: edge                   # no rule true, or no decision (default: the first --upstream group)
fallback: edge                  # the picked group has no healthy upstream (default: none)
explicit: [edge, frontier]      # groups a request may name in `model` (true: all; default: none)
budgets: {max_len: 256}         # laya budgets for the questions (max_len, head_max_len, min_confidence)
```

Rules are the decision API's policy language (`serving.decide.policy`), one rule per group, so there is
one rules language in the project. Everything is checked when the gateway starts, before any worker
forks, and an error names the rule, the question or the key: laya's own parser checks the questions; each
rule's paths must read a question the file asks and a field its answer has (checked against a sample
answer from `laya.answers`, so this file holds no list of answer fields); every group named must be an
upstream group; a rule that compares a choice with a label it does not have, and a question no rule
reads, are refused too. A rule that could only ever be null (or constant) is a typo, and a typo found at
start is a deploy that did not happen rather than a route that silently never fires.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from laya.answers import answer, check_min_confidence, gate
from laya.errors import InputError
from laya.questions import parse_question
from laya.rows import Budgets
from serving.decide.mapping_file import read_mapping
from serving.decide.policy import Compare, Const, Lookup, Policy, PolicyError, Rule

INPUTS = ("last_user", "conversation")  # and field:<path>
FILE_KEYS = ("questions", "routes", "default", "fallback", "explicit", "budgets")
BUDGET_KEYS = ("max_len", "head_max_len", "min_confidence")
GATE_FIELDS = ("low_confidence", "abstention")


@dataclass(frozen=True)
class Ask:
    """The questions that read one input of a request: one decision per request and input."""

    input: str                           # "last_user", "conversation" or "field:<path>"
    questions: dict[str, dict]           # name -> laya definition (without `input`)


@dataclass
class Rules:
    asks: list[Ask]
    policy: Policy                       # its rules are named after the groups they pick, in file order
    default: str
    fallback: str | None = None
    explicit: frozenset[str] = frozenset()
    budgets: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def plain(cls, groups: list[str]) -> Rules:
        """No rules file: every request goes to the first group, unless its `model` names another."""
        return cls(asks=[], policy=Policy({}), default=groups[0],
                   explicit=frozenset(groups) if len(groups) > 1 else frozenset())

    @classmethod
    def load(cls, path: str, groups: list[str], positions: int | None = None) -> Rules:
        """`groups`: the upstream groups, in --upstream order; `positions`: the routing model's encoder positions
        where they are known before it loads (a budget past them fails here, not in a forked worker). Any
        mistake is a ValueError naming it."""
        data = read_mapping(path, "route")
        try:
            return cls._parse(data, groups, positions)
        except (ValueError, InputError) as exc:
            raise ValueError(f"route file {path}: {exc}") from None

    @classmethod
    def _parse(cls, data: dict, groups: list[str], positions: int | None = None) -> Rules:
        unknown = sorted(str(k) for k in set(data) - set(FILE_KEYS))
        if unknown:
            raise ValueError(f"unknown key {unknown[0]!r}; a route file has {', '.join(FILE_KEYS)}")
        budgets = _budgets(data.get("budgets"), positions)
        asks, parsed = _asks(data.get("questions") or {})
        routes = data.get("routes") or {}
        if not isinstance(routes, dict):
            raise ValueError(f"routes must be a mapping of group -> rule, got {type(routes).__name__}")
        try:
            policy = Policy(routes)
        except PolicyError as exc:
            raise ValueError(str(exc)) from None
        sample = _sample_answers(parsed, budgets)
        for rule in policy.rules:
            _check_rule(rule, groups, sample)
        default = _group(data.get("default", groups[0]), "default", groups)
        fallback = data.get("fallback")
        fallback = None if fallback is None else _group(fallback, "fallback", groups)
        explicit = data.get("explicit", False)
        if explicit is True:
            allowed = frozenset(groups)
        elif explicit is False or explicit is None:
            allowed = frozenset()
        elif isinstance(explicit, list):
            allowed = frozenset(_group(g, "explicit", groups) for g in explicit)
        else:
            raise ValueError(f"explicit must be true, false or a list of groups, got {explicit!r}")
        read = {path[0] for rule in policy.rules for path in rule.paths()}
        unread = [q.name for q in parsed if q.name not in read]
        if unread:  # it would cost a decision on every request and change no route
            raise ValueError(f"question {unread[0]!r} is read by no rule; a question is asked only for the routes")
        return cls(asks=asks, policy=policy, default=default, fallback=fallback, explicit=allowed, budgets=budgets)


def _asks(questions: Any) -> tuple[list[Ask], list]:
    if not isinstance(questions, dict):
        raise ValueError(f"questions must be a mapping of name -> question, got {type(questions).__name__}")
    by_input: dict[str, dict[str, dict]] = {}
    parsed = []
    for name, qdef in questions.items():
        if not isinstance(qdef, dict):
            raise ValueError(f"question {name!r}: definition must be a mapping, got {type(qdef).__name__}")
        qdef = dict(qdef)
        source = qdef.pop("input", "last_user")
        if not isinstance(source, str) or not (source in INPUTS or (
                source.startswith("field:") and all(source[6:].split(".")))):
            raise ValueError(f"question {name!r}: field 'input': must be one of {', '.join(INPUTS)} or "
                             f"field:<dotted.path>, got {source!r}")
        parsed.append(parse_question(name, qdef))
        by_input.setdefault(source, {})[name] = qdef
    return [Ask(source, qs) for source, qs in by_input.items()], parsed


def _budgets(budgets: Any, positions: int | None) -> dict[str, Any]:
    if budgets is None:
        return {}
    if not isinstance(budgets, dict):
        raise ValueError(f"budgets must be a mapping, got {type(budgets).__name__}")
    unknown = sorted(set(budgets) - set(BUDGET_KEYS))
    if unknown:
        raise ValueError(f"budgets: unknown key {unknown[0]!r}; budgets are {', '.join(BUDGET_KEYS)}")
    Budgets(**{k: v for k, v in budgets.items() if k != "min_confidence"})
    max_len = budgets.get("max_len")
    if positions is not None and isinstance(max_len, int) and max_len > positions:
        raise ValueError(f"budgets.max_len: {max_len} is more than the routing model's {positions} positions")
    check_min_confidence(budgets.get("min_confidence"))
    return dict(budgets)


def _sample_answers(questions: list, budgets: dict) -> dict[str, dict]:
    """An answer of the right shape for every question (uniform probabilities), through laya's own answer
    code: the paths a real answer has are exactly the paths this one has."""
    answers = {q.name: answer(q, np.full(len(q.keys), 1.0 / len(q.keys)), 0.5) for q in questions}
    if budgets.get("min_confidence") is not None:
        gate(answers, 1.0)  # every answer abstains: the gate's fields are all there
    return answers


def _check_rule(rule, groups: list[str], sample: dict[str, dict]) -> None:
    where = f"rule {rule.name!r} ({rule.text!r})"
    if rule.name not in groups:
        raise ValueError(f"{where}: no upstream group {rule.name!r}; a rule is named after the group it picks "
                         f"({', '.join(groups)})")
    for path in rule.paths():
        question = path[0]
        if question not in sample:
            asked = ", ".join(sample) or "none"
            raise ValueError(f"{where}: reads question {question!r}, which the file does not ask (asked: {asked})")
        value: Any = sample
        for part in path:
            value = value.get(part) if isinstance(value, dict) else None
        if value is None:
            kind = sample[question]["type"]
            hint = " (gate fields need budgets.min_confidence)" if path[1] in GATE_FIELDS else ""
            raise ValueError(f"{where}: {'.'.join(path)} is never in an answer of {kind} question {question!r}"
                             f"{hint}")
    for lookup, label in _labels_compared(rule):
        question = sample[lookup.parts[0]]
        if lookup.parts[1] == "choice" and label not in question["probabilities"]:
            labels = ", ".join(repr(k) for k in question["probabilities"])
            raise ValueError(f"{where}: {'.'.join(lookup.parts)} is never {label!r}; the question's labels are "
                             f"{labels}")
    result = rule.node.evaluate(sample)
    if result is not None and not isinstance(result, bool):
        raise ValueError(f"{where}: must be a condition (true or false); it gives {result!r}")


def _labels_compared(rule: Rule) -> list[tuple[Lookup, Any]]:
    """Every `q.choice == 'label'` (or `!=`, either way round) in a rule: a label the question does not have
    makes the comparison constant, a typo as sure as a path to a question the file does not ask."""
    return [(a, b.value) for node in rule.nodes() if isinstance(node, Compare) and node.op in ("==", "!=")
            for a, b in ((node.left, node.right), (node.right, node.left))
            if isinstance(a, Lookup) and len(a.parts) == 2 and isinstance(b, Const)]


def _group(name: Any, key: str, groups: list[str]) -> str:
    if name not in groups:
        raise ValueError(f"{key}: no upstream group {name!r} (groups: {', '.join(groups)})")
    return name
