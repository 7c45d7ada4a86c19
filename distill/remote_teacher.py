"""A teacher on another machine: a Laya server's `/v1/systemone/batch` answers a student's unsure questions.

Why: a student is built for the edge (onnxruntime, tokenizers, numpy), where its teacher usually is not; the
teacher runs once, on a server, for every edge process. Deferring over HTTP keeps the edge install as it is:
urllib3 is already a base dependency (the gateway's pools), and this module imports no model code. It has laya's
`predict_batch(states, questions, **budgets)`, so `distill.deferral` treats it like a local agent.

Why the `/v1/systemone` dialect and not pagoda's own `/decide/batch`: both `pagoda serve` and the official
`laya-serve` (laya 0.4.15) speak it, with the answers laya gives plus `x_jev_confidence`, which is dropped here,
so a student can defer to either and get the answers its teacher gives in process. `model` names the checkpoint
a laya-serve should use (it routes between several); pagoda serves one and ignores it.

The network can fail where a local model does not. Every failure (no connection, a timeout, a non-200 answer,
a body that is not a batch of answers) raises `TeacherUnavailable`, whose message says which; `apply_deferral`
then keeps the student's answers and says why in `usage.deferral_error`. Nothing is retried: a state waits for
its teacher at most `timeout_s` (urllib3 already replaces a pooled connection the server has closed). A failure
that says the server is down or overloaded (no connection, a timeout, a 5xx) stops the asking for `cooldown_s`:
without that, a teacher host that drops packets would cost every unsure request the whole timeout. A caller with
a deadline of its own (a server's request timeout) passes it: each call then waits at most what is left of it,
and a call cut short by that deadline says so and pauses nothing, since it says nothing about the server.

A student's agreement figures hold for the teacher it was distilled from, and a server can be redeployed with another
model under the same URL. `pagoda serve` names the checkpoint behind every decision it returns (`DIGEST_HEADER`:
`laya.layout.answers_digest`, config and weights); given the digest the student recorded (`teacher_digest`), every
answer from a server that names another is refused, and the asking pauses as for a server that is down. The
official laya-serve names none: its answers are taken, and `describe` says they could not be checked.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import urllib3

from laya.answers import probabilities_from_answer
from laya.errors import InputError
from laya.questions import Question, parse_question

DIGEST_HEADER = "X-Pagoda-Answers-Digest"
"""Response header of pagoda's decision routes: the answers digest of the Laya checkpoint that answered."""


class TeacherUnavailable(RuntimeError):
    """The remote teacher gave no usable answer; the message names the URL and what went wrong."""


class RemoteTeacher:
    """`url` is the server's base URL (`http://host:8000`); `api_key` its key (`PAGODA_API_KEY`, `LAYA_API_KEY`),
    if it has one; `model` the checkpoint a laya-serve should answer with.

    `max_states` states go in one request (the server's `--max-states`, 64 by default, refuses more);
    `timeout_s` bounds each request, connecting included; for `cooldown_s` after the server seemed down (0: never
    wait) every call fails at once with the reason it was given. `teacher_digest`: the answers digest the answers
    must come from (the student's `provenance.teacher_digest`); None takes any model's."""

    def __init__(self, url: str, *, timeout_s: float = 10.0, api_key: str | None = None, max_states: int = 64,
                 cooldown_s: float = 5.0, model: str | None = None, teacher_digest: str | None = None,
                 field: str = "defer_to"):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise InputError(f"{field}: expected an http(s) URL such as http://host:8000, got {url!r}", field=field)
        if not timeout_s > 0:
            raise InputError(f"{field}: timeout must be positive, got {timeout_s!r}", field=field)
        if isinstance(max_states, bool) or not isinstance(max_states, int) or max_states < 1:
            raise InputError(f"{field}: max_states must be a positive integer, got {max_states!r}", field=field)
        if not cooldown_s >= 0:
            raise InputError(f"{field}: cooldown must be 0 or more, got {cooldown_s!r}", field=field)
        self.url = url.rstrip("/")
        self.timeout_s = float(timeout_s)
        self.max_states = max_states
        self.cooldown_s = float(cooldown_s)
        self.model = model
        self.teacher_digest = teacher_digest
        self._checked = "not asked yet" if teacher_digest else "off"   # what the last answer said of its model
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._down_reason = ""
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        # A server calls this from many request threads at once: keep up to 32 connections open, and past that
        # open one more rather than make a thread wait for a free one (block=False).
        self._pool = urllib3.PoolManager(maxsize=32, block=False, retries=False)  # each request sets its timeout

    def predict_batch(self, states: list[Any], questions: dict[str, dict], *, deadline: float | None = None,
                      **budgets: Any) -> list[dict[str, Any]]:
        """laya's `predict_batch`, plus `deadline` (`time.monotonic()` seconds): no call outlasts it."""
        out: list[dict[str, Any]] = []
        for start in range(0, len(states), self.max_states):
            out.extend(self._post(list(states[start:start + self.max_states]), questions, budgets, deadline))
        return out

    def _post(self, states: list[Any], questions: dict, budgets: dict,
              deadline: float | None) -> list[dict[str, Any]]:
        where = f"{self.url}/v1/systemone/batch"
        with self._lock:
            wait = self._down_until - time.monotonic()
            if wait > 0:
                raise TeacherUnavailable(f"{self._down_reason} (not asked again for {wait:.1f} s)")
        timeout = self.timeout_s
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TeacherUnavailable(f"{where}: not asked, the request's deadline had passed")
            timeout = min(timeout, left)
        body = json.dumps({"states": states, "questions": questions, **budgets,
                           **({"model": self.model} if self.model else {})}).encode()
        try:
            resp = self._pool.request("POST", where, body=body, headers=self._headers,
                                      timeout=urllib3.Timeout(total=timeout))
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            if timeout < self.timeout_s and _timed_out(exc):
                raise TeacherUnavailable(f"{where}: no answer in the {timeout:.2f} s left before the request's "
                                         f"deadline ({_reason(exc)})") from None
            raise self._down(f"{where}: {_reason(exc)}") from None
        try:
            data = json.loads(resp.data)
        except ValueError:
            data = None
        if resp.status != 200:
            error = data.get("error", data.get("detail")) if isinstance(data, dict) else None  # FastAPI: `detail`
            message = error.get("message") if isinstance(error, dict) else error if isinstance(error, str) else None
            reason = f"{where}: HTTP {resp.status}" + (f": {message}" if message else "")
            raise self._down(reason) if resp.status >= 500 else TeacherUnavailable(reason)
        self._check_teacher(where, resp.headers.get(DIGEST_HEADER))
        results = data.get("results") if isinstance(data, dict) else None
        if (not isinstance(results, list) or len(results) != len(states)
                or not all(isinstance(r, dict) and isinstance(r.get("answers"), dict)
                           and all(isinstance(r["answers"].get(n), dict) for n in questions) for r in results)):
            raise TeacherUnavailable(f"{where}: the answer is not {len(states)} results answering "
                                     f"{sorted(questions)}")
        student = next((r["model"] for r in results if str(r.get("model", "")).startswith("student:")), None)
        if student is not None:  # pagoda's student servers name no digest either: not to be taken as a teacher
            raise self._down(f"{where}: the server answers with a distilled student ({student}), not a Laya "
                             "teacher: its answers are what the student already gave")
        parsed = {n: parse_question(n, q) for n, q in questions.items()}
        for r in results:
            for n, q in parsed.items():
                problem = _answer_problem(q, r["answers"][n])
                if problem is not None:
                    raise TeacherUnavailable(f"{where}: the answer to {n!r} is not a {q.type} answer ({problem})")
        return [{"answers": {n: {k: v for k, v in r["answers"][n].items() if k != "x_jev_confidence"}
                             for n in questions},
                 "usage": r.get("usage", {})} for r in results]

    def _check_teacher(self, where: str, served: str | None) -> None:
        """Refuse an answer given by a model other than `teacher_digest`; note whether it could be checked."""
        if self.teacher_digest is None:
            return
        if served is None:
            self._checked = "unchecked: the server names no answers digest"
        elif served == self.teacher_digest:
            self._checked = "the student's teacher"
        else:
            self._checked = f"refused: answers digest {served}"
            raise self._down(f"{where}: the server answers with answers digest {served}, not the student's "
                             f"teacher ({self.teacher_digest}): its answers would be another model's")

    def _down(self, reason: str) -> TeacherUnavailable:
        with self._lock:
            self._down_until = time.monotonic() + self.cooldown_s
            self._down_reason = reason
        return TeacherUnavailable(reason)

    def describe(self) -> dict[str, Any]:
        """For `/stats`: where the teacher is, never its key."""
        return {"url": self.url, "model": self.model, "timeout_s": self.timeout_s, "max_states": self.max_states,
                "cooldown_s": self.cooldown_s, "teacher_digest": self.teacher_digest, "teacher_check": self._checked}


def _answer_problem(q: Question, answer: dict[str, Any]) -> str | None:
    """What keeps `answer` from being laya's answer to `q` (None when nothing does): a server that sends fewer
    fields, or other kinds of values, would hand clients answers missing what theirs carry, or fail the gate."""
    if answer.get("type") != q.type:
        return f"type {answer.get('type')!r:.40}"
    confidence = answer.get("answer_confidence")
    if isinstance(confidence, bool) or not isinstance(confidence, int | float) or not 0 <= confidence <= 1:
        return f"answer_confidence {confidence!r:.40}"
    try:
        p = probabilities_from_answer(q, answer)
    except (KeyError, TypeError, ValueError) as exc:
        return f"no probabilities of its options: {exc}"
    if not np.all(np.isfinite(p)):
        return "probabilities that are not numbers"
    return None


def _innermost(exc: BaseException) -> BaseException:
    while getattr(exc, "reason", None) is not None and isinstance(exc.reason, BaseException):
        exc = exc.reason
    return exc


def _timed_out(exc: BaseException) -> bool:
    return isinstance(_innermost(exc), (urllib3.exceptions.TimeoutError, TimeoutError))


def _reason(exc: BaseException) -> str:
    """urllib3 wraps the cause (a `MaxRetryError` around a `NewConnectionError` or a timeout): name the innermost."""
    exc = _innermost(exc)
    return f"{type(exc).__name__}: {exc}"
