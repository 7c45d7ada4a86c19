"""Which upstream group takes a request: named in `model` (when the rules allow it), picked by a rule over
Laya's answers about the request, or the default.

The decision runs in the gateway on `serving.decide`'s service: the same model loading, cross-request
batcher and deadlines as `/decide`, so concurrent requests share forward passes here too. A decision that
cannot be made (the model still loading, its deadline passed, a state laya refuses) is not the client's
failure: the request takes the default group, and the reason says so.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from laya.errors import InputError
from serving.decide.metrics import DecideMetrics
from serving.decide.schema import DecideRequest
from serving.decide.service import Service
from serving.errors import ApiError, parse_json
from serving.gateway.config import GatewayConfig
from serving.gateway.rules import Rules

log = logging.getLogger("pagoda.gateway")

# The gateway's routes and the body field each reads its prompt from.
PROMPT_FIELDS = {"/v1/chat/completions": "messages", "/v1/completions": "prompt", "/v1/responses": "input",
                 "/generate": "text"}
CONVERSATIONS = {"/v1/chat/completions", "/v1/responses"}  # a list of messages (Responses: or a string)


@dataclass(frozen=True)
class Route:
    group: str
    reason: str                     # rule | default | explicit | decision_failed (| fallback, set later)
    decision_s: float | None = None


def read_body(body: bytes) -> dict | None:
    """The request as JSON when it is an object JSON can mean; anything else is the upstream's to refuse, in its
    own words. Read as strictly as `pagoda serve` reads it (`parse_json`): a body nested past the limit, one
    naming a key twice or holding 1e400 is forwarded untouched and never rewritten (a rewrite through a lenient
    parser would change what the upstream sees: the last duplicate kept, 1e400 sent as Infinity)."""
    try:
        parsed = parse_json(body)
    except ApiError:
        return None
    return parsed if isinstance(parsed, dict) else None


def bounded(state: Any, limit: int) -> Any:
    """`state` cut to `limit` characters of text, keeping what the routing model reads: a text's start, a
    conversation's end (laya keeps the end of a list state). Cutting the rest changes no answer while the
    model's max_len tokens fit in `limit` characters, and bounds what tokenising a huge prompt costs."""
    if isinstance(state, str):
        return state[:limit]
    kept: list[dict] = []
    for turn in reversed(state):
        if limit <= 0:
            break
        content = turn["content"][-limit:]
        kept.append({**turn, "content": content})
        limit -= len(content)
    return kept[::-1]


def request_state(source: str, path: str, body: dict) -> Any:
    """What a question with `input: source` reads in this request, or None when the request has none (then
    the question is not asked and rules over it are null)."""
    if source.startswith("field:"):
        value: Any = body
        for part in source[len("field:"):].split("."):
            if isinstance(value, dict):
                value = value.get(part)
            elif isinstance(value, list) and part.lstrip("-").isdigit() and -len(value) <= int(part) < len(value):
                value = value[int(part)]
            else:
                return None
        if isinstance(value, bool | int | float):
            return str(value)
        return value if value not in (None, "", [], {}) else None
    prompt = body.get(PROMPT_FIELDS[path])
    if path == "/v1/responses" and isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]  # one user message, as the Responses API reads it
    if path not in CONVERSATIONS:
        return _text(prompt)
    if not isinstance(prompt, list):
        return None
    turns = [m for m in prompt if isinstance(m, dict) and "role" in m]  # Responses: function calls have no role
    if source == "conversation":
        rendered = [{"role": m.get("role"), "content": _text(m.get("content"))} for m in turns]
        return [t for t in rendered if t["content"]] or None
    users = [m for m in turns if m.get("role") == "user"]
    return _text(users[-1].get("content")) if users else None


TEXT_PARTS = ("text", "input_text", "output_text")  # chat's text part; the Responses API's


def _text(content: Any) -> str | None:
    """A message's or prompt's text: a string, text parts (joined by newlines, as the generation API joins
    them), or a list of prompt strings; token ids have no text to ask about."""
    if isinstance(content, str):
        return content or None
    if isinstance(content, list):
        parts = [p if isinstance(p, str) else p.get("text") for p in content
                 if isinstance(p, str) or (isinstance(p, dict) and p.get("type") in TEXT_PARTS)]
        text = "\n".join(p for p in parts if isinstance(p, str))
        return text or None
    return None


class Decisions:
    """The decision model behind the rules' questions."""

    def __init__(self, cfg: GatewayConfig, rules: Rules, registry: CollectorRegistry):
        self.rules = rules
        self.max_chars = cfg.decision_max_chars
        self.service = Service(cfg.decide_config(), DecideMetrics(registry), cfg.decision_timeout_s)

    @property
    def loaded(self) -> threading.Event:
        return self.service.loaded

    @property
    def error(self) -> str | None:
        return self.service.error

    @property
    def name(self) -> str | None:
        return self.service.backend.name if self.service.backend else None

    def load_in_background(self) -> None:
        def load() -> None:
            from serving.decide.backend import load_backend

            try:
                started = time.monotonic()
                backend = load_backend(self.service.cfg)
                for ask in self.rules.asks:  # the model's own check of the questions (a student's are fixed)
                    backend.prepare("routing probe", ask.questions, self.rules.budgets)
                self.service.attach(backend)
                log.info("routing model %s ready in %.1fs", backend.name, time.monotonic() - started)
            except Exception as exc:  # noqa: BLE001 -- reported by /ready and the log; the worker exits on it
                self.service.error = f"{type(exc).__name__}: {exc}"
                log.exception("the routing model failed to load")

        threading.Thread(target=load, name="pagoda-routing-model-load", daemon=True).start()

    def answers(self, path: str, body: dict, request_id: str) -> dict[str, dict]:
        """Every question's answer about this request (questions whose input it lacks are left out)."""
        out: dict[str, dict] = {}
        for ask in self.rules.asks:
            state = request_state(ask.input, path, body)
            if state is None:
                continue
            state = bounded(state, self.max_chars)
            req = DecideRequest(states=[state], questions=ask.questions, budgets=self.rules.budgets)
            results, _ = self.service.decide(req, time.monotonic(), request_id, batch=False)
            out.update(results[0]["answers"])
        return out


class Router:
    def __init__(self, rules: Rules, decisions: Decisions | None):
        self.rules = rules
        self.decisions = decisions

    def route(self, path: str, body: dict | None, request_id: str) -> Route:
        rules = self.rules
        if body is None:
            return Route(rules.default, "default")
        model = body.get("model")
        if isinstance(model, str) and model in rules.explicit:
            return Route(model, "explicit")
        started = time.monotonic()
        try:  # no questions (rules over nothing, e.g. `true`): the rules still decide, over no answers
            answers = self.decisions.answers(path, body, request_id) if self.decisions is not None else {}
        except (ApiError, InputError) as exc:
            log.warning("request %s: no routing decision (%s); default route", request_id, exc)
            return Route(rules.default, "decision_failed", time.monotonic() - started)
        elapsed = time.monotonic() - started if answers else None  # no question had its input: none ran
        for rule in rules.policy.rules:
            if rule.node.evaluate(answers) is True:
                return Route(rule.name, "rule", elapsed)
        return Route(rules.default, "default", elapsed)
