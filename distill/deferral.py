"""Deferring a student's unsure answers to its teacher: a dial between the student's speed and the teacher's answers.

Why: on hand-written text the support-triage student gives its teacher's answer on 0.88-0.96 of answers per
question (docs/distill.md), and its disagreements gather where its own calibrated `answer_confidence` is low.
Re-asking the teacher only those (state, question) pairs buys back agreement at the price of a teacher call on
the share of answers under the threshold, which the report and `pagoda bench distill --defer-below` measure.

The teacher is anything with laya's `predict_batch(states, questions)`, passed in by the caller: a `laya.load` agent
in the same process, or a `distill.remote_teacher.RemoteTeacher` (a Laya server, for students on the edge). This
module imports no model code, so `distill.runtime` stays torch-free. Each answer the teacher gives
replaces the student's whole answer (its probabilities, confidence and `action.act_probability`), and every
answer says who gave it (`answered_by`). A pair's answer does not depend on what shares its batch: the student's
does not, laya's does not, and laya answers each question of a state on a row of its own, so asking the teacher
fewer questions of a state cannot change the ones it does answer.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from distill.remote_teacher import RemoteTeacher, TeacherUnavailable
from laya.errors import InputError
from laya.layout import answers_digest


@dataclass(frozen=True)
class Deferral:
    """`teacher` answers a question of a state whenever the student's `answer_confidence` is under `below[q]`;
    questions absent from `below` stay the student's."""

    teacher: Any
    below: dict[str, float]

    @property
    def remote(self) -> bool:
        """Whether the teacher is across a network (a server waits on it outside its model worker)."""
        return isinstance(self.teacher, RemoteTeacher)

    def describe(self) -> dict[str, Any]:
        """The thresholds and what answers under them, for `/stats`."""
        if self.remote:
            return {"defer_below": self.below, "defer_to": self.teacher.describe()}
        engine = getattr(self.teacher, "engine", None)  # a laya Agent's; any object with predict_batch may teach
        return {"defer_below": self.below,
                "defer_to": engine.describe() if engine is not None else {"teacher": type(self.teacher).__name__}}


def recorded_teacher(meta: dict) -> str | None:
    """The answers digest (`laya.layout.answers_digest`) of the teacher a student (`meta`: its student.json) was
    distilled from; None for a student written before it was recorded."""
    return meta.get("provenance", {}).get("teacher_digest")


def teacher_mismatch(meta: dict, teacher_dir: str | os.PathLike) -> str | None:
    """Why the checkpoint at `teacher_dir` is not the teacher the student (`meta`: its student.json) copied, or
    None. The answers it takes over would be another model's, and the agreement the student's report measured
    would no longer describe what is served: a teacher rebuilt in place (a new laya-mini head) is the usual way.
    A student written before its teacher's digest was recorded is not checked."""
    recorded = recorded_teacher(meta)
    if recorded is None or not os.path.isdir(teacher_dir):
        return None
    found = answers_digest(teacher_dir)
    if found == recorded:
        return None
    return (f"the student was distilled from {meta['provenance'].get('teacher')} (answers digest {recorded}), "
            f"but the teacher here, {teacher_dir}, has digest {found}: it would answer as another model")


def parse_below(value: Any, questions: Iterable[str], field: str = "defer_below") -> dict[str, float]:
    """Thresholds per question from `0.7` (every question), `"department=0.7,urgency=0.8"` or a dict.

    A threshold is a number in [0, 1] (0 never defers; an answer's confidence is at most 1); a question the
    student does not answer is refused, naming `field`."""
    names = list(questions)
    if isinstance(value, str) and "=" not in value:
        try:
            value = float(value)
        except ValueError:
            raise InputError(f"{field}: expected a number or QUESTION=NUMBER,..., got {value!r}", field=field) from None
    if isinstance(value, str):
        pairs = {}
        for item in value.split(","):
            name, sep, number = item.strip().partition("=")
            if not sep or not name:
                raise InputError(f"{field}: expected QUESTION=NUMBER, got {item.strip()!r}", field=field)
            try:
                pairs[name] = float(number)
            except ValueError:
                raise InputError(f"{field}: {name}: expected a number, got {number!r}", field=field) from None
        value = pairs
    if isinstance(value, dict):
        value = {k.strip() if isinstance(k, str) else k: v for k, v in value.items()}
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise InputError(f"{field}: {unknown} not among the student's questions {sorted(names)}", field=field)
        out = {str(k): v for k, v in value.items()}
    else:
        out = {n: value for n in names}
    for name, t in out.items():
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or not 0.0 <= t <= 1.0:
            raise InputError(f"{field}: {name}: must be a number in [0, 1], got {t!r}", field=field)
    return {k: float(v) for k, v in out.items()}


def apply_deferral(deferral: Deferral, states: list[Any], results: list[dict[str, Any]],
                   definitions: dict[str, dict[str, Any]], budgets: dict[str, Any] | None = None,
                   deadline: float | None = None) -> None:
    """Replace, in place, each answer of `results` (the student's, one dict per state with `answers` and `usage`)
    under its threshold by the teacher's.

    `definitions` are the questions as the student was distilled for them: the teacher is asked exactly those, with
    the `budgets` it labelled under. States with the same set of unsure questions share one teacher call. Each
    state's usage gains `deferred_questions` (those the teacher answered), `teacher_input_tokens` and
    `deferral_error`: None, or why an unavailable teacher (`TeacherUnavailable`) left its unsure answers the
    student's.

    `deadline` (`time.monotonic()` seconds) bounds the calls to a remote teacher: a server passes its request's
    deadline, so that deferring cannot make a request outlive the timeout it was promised; a group of states whose
    call is not answered by then (all of its calls, when it needs several) stays the student's, with the reason."""
    extra = {"deadline": deadline} if deadline is not None and deferral.remote else {}
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, result in enumerate(results):
        low = [n for n, a in result["answers"].items()
               if n in deferral.below and a["answer_confidence"] < deferral.below[n]]
        for a in result["answers"].values():
            a["answered_by"] = "student"
        result["usage"].update(deferred_questions=[], teacher_input_tokens=0, deferral_error=None)
        if low:
            groups.setdefault(tuple(low), []).append(i)
    for names, idx in groups.items():
        try:
            answered = deferral.teacher.predict_batch([states[i] for i in idx], {n: definitions[n] for n in names},
                                                       **extra, **(budgets or {}))
        except TeacherUnavailable as exc:
            for i in idx:
                results[i]["usage"]["deferral_error"] = str(exc)
            continue
        for i, teacher in zip(idx, answered):
            for n in names:
                results[i]["answers"][n] = {**teacher["answers"][n], "answered_by": "teacher"}
            usage = results[i]["usage"]
            # a deferred answer was cut where the teacher's own reading was cut, not where the student's was
            cut = set(teacher["usage"].get("truncated_questions", []))
            usage["truncated_questions"] = [n for n in usage.get("truncated_questions", [])
                                            if n not in names or n in cut]
            usage.update(deferred_questions=list(names), teacher_input_tokens=teacher["usage"].get("input_tokens", 0))
