"""Thresholds and routing: named rules over a decision's answers, e.g. `escalate: churn_risk.noul > 0.7`.

Rules come from an operator's file, so they are parsed by the small recursive-descent parser below and
evaluated over a fixed AST — never `eval` — and every rule is parsed and checked when the server starts,
with an error naming the rule, so a typo stops the deploy instead of a request.

Grammar (lowest precedence first):

    expr   := and ('or' and)*
    and    := not ('and' not)*
    not    := 'not' not | cmp
    cmp    := atom (('<' | '<=' | '>' | '>=' | '==' | '!=') atom)?
    atom   := NUMBER | '-' NUMBER | STRING | 'true' | 'false' | 'null' | PATH | '(' expr ')'
    PATH   := question '.' field ('.' key)?

A value that is missing (the rule's question was not asked, or its answer has no such field) is `null`;
`low_confidence` on an answer that went through the confidence gate and passed is `false` (laya, as the
official runtime, writes the flag only when it is true; without a gate there is no verdict, so it is `null`),
and `null` propagates through comparisons and `not`; `and`/`or` return a definite result when one side
decides it. So a rule over questions a request did not ask answers `null`, never a made-up `false`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serving.decide.mapping_file import read_mapping

ANSWER_FIELDS = {"choice", "score", "noul", "confidence", "answer_confidence", "low_confidence", "abstention"}
KEYED_FIELDS = {"probabilities", "legend", "action"}
_COMPARISONS = ("<=", ">=", "==", "!=", "<", ">")
# Parentheses and `not`s a rule may nest: each level is a few frames of recursion when parsed and evaluated,
# and no real rule nests more than a handful.
MAX_RULE_DEPTH = 32
_KEYWORDS = {"and", "or", "not", "true", "false", "null"}
_TOKEN = re.compile(r"""\s*(?:
    (?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<string>'[^']*'|"[^"]*")
  | (?P<op><=|>=|==|!=|<|>|\(|\)|-)
  | (?P<name>[A-Za-z_][\w-]*(?:\.[\w-]+)*)
)""", re.VERBOSE)


class PolicyError(ValueError):
    pass


@dataclass(frozen=True)
class Const:
    value: Any

    def evaluate(self, answers: dict) -> Any:
        return self.value


@dataclass(frozen=True)
class Lookup:
    parts: tuple[str, ...]

    def evaluate(self, answers: dict) -> Any:
        value: Any = answers
        for part in self.parts:
            if isinstance(value, dict) and part not in value:
                # A label that is a number or a boolean is a key as the client reads it in the JSON answer
                # (`probabilities.1`, `probabilities.true`); the answer in hand still has the label's own type.
                value = {k if isinstance(k, str) else json.dumps(k): v for k, v in value.items()}
            if not isinstance(value, dict) or part not in value:
                if part == "low_confidence" and isinstance(value, dict) and "abstention" in value:
                    return False  # the gate ran and passed: laya writes the flag only when it is true
                return None
            value = value[part]
        return value


@dataclass(frozen=True)
class Not:
    operand: Any

    def evaluate(self, answers: dict) -> Any:
        value = self.operand.evaluate(answers)
        return None if value is None else not value


@dataclass(frozen=True)
class Logic:
    """`a and b and c ...` as ONE node over all its operands: a rule of 1500 terms is a loop, not 1500 nested
    calls (which ran out of Python's recursion limit at evaluation, failing every request)."""

    op: str  # "and" | "or"
    operands: tuple[Any, ...]

    def evaluate(self, answers: dict) -> Any:
        unknown = False
        for operand in self.operands:
            value = operand.evaluate(answers)
            if value is None:
                unknown = True
            elif bool(value) == (self.op == "or"):
                return self.op == "or"  # `and` meets a false operand, `or` a true one: decided
        return None if unknown else self.op == "and"


@dataclass(frozen=True)
class Compare:
    op: str
    left: Any
    right: Any

    def evaluate(self, answers: dict) -> Any:
        a, b = self.left.evaluate(answers), self.right.evaluate(answers)
        if a is None or b is None:
            return None
        if self.op == "==":
            return a == b
        if self.op == "!=":
            return a != b
        numeric = all(isinstance(x, int | float) and not isinstance(x, bool) for x in (a, b))
        if not (numeric or (isinstance(a, str) and isinstance(b, str))):
            return None  # ordering a label against a number has no meaning
        return {"<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b}[self.op]


class _Parser:
    def __init__(self, text: str):
        self.tokens = _tokenize(text)
        self.pos = 0
        self.depth = 0  # open parentheses and `not`s: each is a level of recursion, here and at evaluation

    def nested(self, parse):
        self.depth += 1
        if self.depth > MAX_RULE_DEPTH:
            raise PolicyError(f"nests deeper than {MAX_RULE_DEPTH} levels of parentheses and 'not'")
        try:
            return parse()
        finally:
            self.depth -= 1

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> tuple[str, str]:
        token = self.peek()
        if token is None:
            raise PolicyError("unexpected end of rule")
        self.pos += 1
        return token

    def accept(self, kind: str, text: str) -> bool:
        if self.peek() == (kind, text):
            self.pos += 1
            return True
        return False

    def parse(self):
        node = self.expr()
        if self.peek() is not None:
            raise PolicyError(f"unexpected {self.peek()[1]!r}")
        return node

    def expr(self):
        operands = [self.conjunction()]
        while self.accept("name", "or"):
            operands.append(self.conjunction())
        return operands[0] if len(operands) == 1 else Logic("or", tuple(operands))

    def conjunction(self):
        operands = [self.negation()]
        while self.accept("name", "and"):
            operands.append(self.negation())
        return operands[0] if len(operands) == 1 else Logic("and", tuple(operands))

    def negation(self):
        if self.accept("name", "not"):
            return Not(self.nested(self.negation))
        return self.comparison()

    def comparison(self):
        node = self.atom()
        token = self.peek()
        if token and token[0] == "op" and token[1] in _COMPARISONS:
            self.pos += 1
            node = Compare(token[1], node, self.atom())
        return node

    def atom(self):
        kind, text = self.take()
        if kind == "number":
            return Const(float(text) if any(c in text for c in ".eE") else int(text))
        if kind == "string":
            return Const(text[1:-1])
        if (kind, text) == ("op", "-"):
            kind, text = self.take()
            if kind != "number":
                raise PolicyError(f"expected a number after '-', got {text!r}")
            return Const(-(float(text) if any(c in text for c in ".eE") else int(text)))
        if (kind, text) == ("op", "("):
            node = self.nested(self.expr)
            if not self.accept("op", ")"):
                raise PolicyError("missing ')'")
            return node
        if kind == "name":
            if text in ("true", "false", "null"):
                return Const({"true": True, "false": False, "null": None}[text])
            if text in _KEYWORDS:
                raise PolicyError(f"unexpected {text!r}")
            return _path(text)
        raise PolicyError(f"unexpected {text!r}")


def _tokenize(text: str) -> list[tuple[str, str]]:
    tokens, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if not match or match.end() == pos:
            raise PolicyError(f"cannot read {text[pos:].strip()[:20]!r} at character {pos}")
        kind = match.lastgroup
        tokens.append((kind, match.group(kind)))
        pos = match.end()
    return tokens


def _path(text: str) -> Lookup:
    parts = tuple(text.split("."))
    if len(parts) < 2:
        raise PolicyError(f"{text!r} is not a question.field path")
    field = parts[1]
    if field in ANSWER_FIELDS and len(parts) == 2:
        return Lookup(parts)
    if field in KEYED_FIELDS and len(parts) == 3:
        return Lookup(parts)
    if field in KEYED_FIELDS:
        raise PolicyError(f"{text!r}: {field} takes one key, e.g. {parts[0]}.{field}.<label>")
    known = ", ".join(sorted(ANSWER_FIELDS | KEYED_FIELDS))
    raise PolicyError(f"{text!r}: unknown answer field {field!r}; use one of {known}")


@dataclass(frozen=True)
class Rule:
    name: str
    text: str
    node: Any

    def nodes(self) -> list[Any]:
        """Every node of the rule's tree, in the order written (without recursion: a rule may be long): what a
        caller that knows more than the rule checks it against."""
        found: list[Any] = []
        stack = [self.node]
        while stack:
            node = stack.pop()
            found.append(node)
            if isinstance(node, Logic):
                stack.extend(reversed(node.operands))
            else:
                stack.extend(getattr(node, side) for side in ("right", "left", "operand") if hasattr(node, side))
        return found

    def paths(self) -> list[tuple[str, ...]]:
        """The answer paths the rule reads, e.g. `("churn_risk", "noul")`, in the order written (the gateway
        refuses a rule over a question it never asks, which would only ever be null)."""
        return [node.parts for node in self.nodes() if isinstance(node, Lookup)]


class Policy:
    """Ordered named rules; `evaluate(answers)` gives `{rule: value}` for a decision's `answers`."""

    def __init__(self, rules: dict[str, str]):
        self.rules: list[Rule] = []
        for name, text in rules.items():
            if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][\w-]*", name):
                raise PolicyError(f"rule name {name!r} must be an identifier")
            if not isinstance(text, str) or not text.strip():
                raise PolicyError(f"rule {name!r}: the expression must be a non-empty string")
            try:
                node = _Parser(text).parse()
            except PolicyError as exc:
                shown = text if len(text) <= 80 else f"{text[:60]}...{text[-12:]}"
                raise PolicyError(f"rule {name!r}: {exc} in {shown!r}") from None
            self.rules.append(Rule(name, text, node))

    def evaluate(self, answers: dict) -> dict[str, Any]:
        return {rule.name: rule.node.evaluate(answers) for rule in self.rules}

    @classmethod
    def load(cls, path: str | Path) -> Policy:
        data = read_mapping(path, "policy")
        rules = data.get("rules", data) if isinstance(data.get("rules"), dict) else data
        try:
            return cls(rules)
        except PolicyError as exc:
            raise PolicyError(f"policy file {path}: {exc}") from None

