"""What the batcher runs: a Laya agent or a distilled student, behind the same four operations.

`prepare` (request thread: validation, tokenisation; `InputError` → 422), `cost` (rows and tokens per
row, for the batch limits), `run` (model worker: ONE pass over units from many requests, split back per
unit) and `finish` (request thread: one request's answer JSONs, its units together); `describe` says what
computes. Heavy imports happen in `load_backend`, in the serving process, so the gunicorn master and `pagoda
--help` never import torch (and a Laya model on the CPU engines never does: `laya.load` picks the engine from
`--precision`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distill.deferral import Deferral, apply_deferral, parse_below, recorded_teacher
from distill.remote_teacher import RemoteTeacher
from distill.student_folder import read_meta
from laya.answers import check_min_confidence, gate
from laya.errors import InputError
from laya.layout import answers_digest
from laya.rows import state_text
from serving.decide.config import DecideConfig, student_precision


class LayaBackend:
    kind = "laya"

    def __init__(self, agent: Any, name: str):
        self.agent = agent
        self.name = name
        self.default_questions: dict | None = None
        # Which checkpoint answers, by what sets its answers (config, weights): a student deferring here checks
        # it is its own teacher (`distill.remote_teacher.DIGEST_HEADER`).
        self.answers_digest = answers_digest(agent.source) if agent.source else None

    def prepare(self, state: Any, questions: dict, budgets: dict) -> Any:
        return self.agent.prepare(state, questions, **budgets)

    def cost(self, prepared: Any) -> tuple[int, int]:
        return len(prepared.rows), max((row.n_tokens for row in prepared.rows), default=0)

    def run(self, units: list[Any]) -> list[list[Any]]:
        rows = [row for prepared in units for row in prepared.rows]
        outputs = self.agent.forward(rows) if rows else []
        split, offset = [], 0
        for prepared in units:
            split.append(outputs[offset:offset + len(prepared.rows)])
            offset += len(prepared.rows)
        return split

    def finish(self, units: list[Any], outputs: list[list[Any]], deadline: float) -> list[dict]:
        return [self.agent.finish(prepared, rows) for prepared, rows in zip(units, outputs)]

    def describe(self) -> dict:
        """The engine that answers (precision, backend, threads), for `/health` and `/stats`."""
        return self.agent.engine.describe()

    def caches(self) -> dict:
        """What the process caches and its bound, for `/stats` (a soak run reads it beside the RSS)."""
        return {"question_tokens": self.agent.question_cache.stats()}


@dataclass
class StudentUnit:
    state: Any
    names: list[str]
    chars: int
    min_confidence: Any = None  # the request's gate, applied after deferral as `Student.predict_batch` does


class StudentBackend:
    """A distilled student answers only the questions it was distilled for, all of them in one pass."""

    kind = "student"
    answers_digest = None   # not a Laya checkpoint: nothing deferring here is answered by its own teacher

    def __init__(self, student: Any, name: str, threads: int | None = None, deferral: Deferral | None = None):
        self.student = student
        self.name = name
        self.threads = threads
        self.deferral = deferral      # who takes the student's unsure answers, and when
        self.default_questions = dict(student.questions)

    def prepare(self, state: Any, questions: dict, budgets: dict) -> StudentUnit:
        fixed = sorted(set(budgets) - {"min_confidence"})
        if fixed:
            raise InputError(f"{fixed[0]}: not supported when serving a student (its budgets are fixed at "
                             "distillation)", field=fixed[0])
        threshold = check_min_confidence(budgets.get("min_confidence"))
        try:
            names = self.student.select(questions)
        except InputError:
            raise
        except ValueError as exc:  # distill.runtime names no field: every refusal of select is about `questions`
            raise InputError(str(exc), field="questions") from None
        return StudentUnit(state, names, len(state_text(state)), threshold)

    def cost(self, unit: StudentUnit) -> tuple[int, int]:
        # The student reads the state once for all its heads, at most `max_len` tokens of it; ~4 characters
        # per token is enough for a limit.
        return 1, max(1, min(unit.chars // 4, self.student.max_len))

    def run(self, units: list[StudentUnit]) -> list[dict]:
        # A local teacher computes here, in the model worker; a remote one is waited on in `finish`, on the
        # request's own thread, so a slow network never holds up other requests' passes.
        # The student answers every head in one pass; each request keeps the questions it asked before any
        # deferral, so a teacher is never asked (nor counted for) a question nobody asked.
        results = self.student.predict_batch([u.state for u in units])
        out = []
        for unit, result in zip(units, results):
            usage = dict(result["usage"])
            usage["truncated_questions"] = [n for n in usage.get("truncated_questions", []) if n in unit.names]
            out.append({**result, "answers": {n: result["answers"][n] for n in unit.names}, "usage": usage})
        if self.deferral is not None and not self.deferral.remote:
            apply_deferral(self.deferral, [u.state for u in units], out, self.student.questions,
                           self.student.teacher_budgets)
        return out

    def finish(self, units: list[StudentUnit], outputs: list[dict], deadline: float) -> list[dict]:
        """`deadline` (monotonic) is the request's: a remote teacher is waited on no longer."""
        if self.deferral is not None and self.deferral.remote:  # one call for the request's unsure states
            apply_deferral(self.deferral, [u.state for u in units], outputs, self.student.questions,
                           self.student.teacher_budgets, deadline)
        for unit, output in zip(units, outputs):
            if unit.min_confidence is not None:
                gate(output["answers"], unit.min_confidence)
        return outputs

    def describe(self) -> dict:
        out = {"precision": self.student.precision, "backend": "onnxruntime",
               "model_file": self.student.model_file.name, "threads": self.threads}
        if self.deferral is not None:
            out.update(self.deferral.describe())
        return out

    def caches(self) -> dict:
        return {}


def load_backend(cfg: DecideConfig) -> LayaBackend | StudentBackend:
    if cfg.student:
        from distill.runtime import Student

        models = read_meta(cfg.student)["models"]
        student = Student(cfg.student, precision=student_precision(cfg.precision, models),
                          threads=cfg.torch_threads or None)
        deferral = None
        if cfg.defer_below is not None:
            teacher = (RemoteTeacher(cfg.defer_to, timeout_s=cfg.defer_timeout_s, api_key=cfg.defer_api_key,
                                     max_states=cfg.defer_max_states, cooldown_s=cfg.defer_cooldown_s,
                                     model=cfg.defer_model,
                                     teacher_digest=None if cfg.defer_any_teacher else recorded_teacher(student.meta))
                       if cfg.defer_to else _load_laya(cfg))
            deferral = Deferral(teacher, parse_below(cfg.defer_below, student.questions, "defer_below"))
        return StudentBackend(student, f"student:{student.name}", cfg.torch_threads or None, deferral)
    return LayaBackend(_load_laya(cfg), _model_name(cfg.model))


def _load_laya(cfg: DecideConfig) -> Any:
    import laya

    return laya.load(cfg.model, device=cfg.device, precision=cfg.precision, threads=cfg.torch_threads or None,
                     question_cache_bytes=int(cfg.question_cache_mb * (1 << 20)))


def _model_name(path: str | None) -> str:
    if path is None:
        return "laya-mini"
    return Path(path).resolve().name
