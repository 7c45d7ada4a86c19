"""`DecideApi`: the decision API as the app factory mounts it, its four routes and what it adds to the server.

Constructing it reads the presets and the policy (cheap, and a bad file must stop `pagoda serve` before
gunicorn forks); `start` registers its metrics and begins loading the model. The core answers `/ready`,
`/v1/models`, `/stats` and `/openapi.json` from what this class reports, and maps the exceptions the
routes raise (laya's `InputError`, `ApiError`) to the error shape, reshaped by the systemone dialect on
its routes.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from flask import Blueprint, g, request
from prometheus_client import CollectorRegistry

from distill.questions import select
from distill.remote_teacher import DIGEST_HEADER
from distill.student_folder import read_meta
from laya.errors import InputError
from laya.layout import checkpoint_positions
from laya.paths import default_model_dir
from serving.decide import systemone
from serving.decide.config import DecideConfig
from serving.decide.metrics import DecideMetrics
from serving.decide.openapi import openapi
from serving.decide.policy import Policy
from serving.decide.presets import load_presets
from serving.decide.schema import DecideRequest, decide_request
from serving.decide.service import Service
from serving.errors import parse_json


class DecideApi:
    name = "decide"

    def __init__(self, cfg: DecideConfig, request_timeout_s: float, backend: Any = None):
        """`backend` injects an already-loaded model (tests, embedding); otherwise `start` loads it."""
        self.cfg = cfg
        self.request_timeout_s = request_timeout_s
        self.presets = load_presets(cfg.presets, cfg) if cfg.presets else {}
        self.policy = Policy.load(cfg.policy) if cfg.policy else None
        self._backend = backend
        self.service: Service | None = None
        self.error_dialects = {"/v1/systemone": systemone.error_body}
        self.blueprint = Blueprint("decide", __name__)
        for rule, view in (("/decide", self.decide), ("/decide/batch", self.decide_batch),
                           ("/v1/systemone", self.systemone), ("/v1/systemone/batch", self.systemone_batch)):
            self.blueprint.add_url_rule(rule, view_func=view, methods=["POST"])
        self.blueprint.after_request(self._name_checkpoint)

    # What the app factory asks of every API.

    def start(self, registry: CollectorRegistry) -> None:
        self.service = Service(self.cfg, DecideMetrics(registry), self.request_timeout_s)
        if self._backend is not None:
            self.service.attach(self._backend)
        else:
            self.service.load_in_background()

    @property
    def loaded(self):
        return self.service.loaded

    @property
    def error(self) -> str | None:
        return self.service.error

    def status(self) -> dict:
        backend = self.service.backend
        return {"model": backend.name, "kind": backend.kind}

    def models(self) -> dict:
        backend = self.service.backend
        data = [] if backend is None else [{
            "id": backend.name, "object": "model", "created": self.service.created, "owned_by": "pagoda",
            "kind": backend.kind,
            "questions": sorted(backend.default_questions) if backend.default_questions else None,
            "answers_digest": backend.answers_digest,
        }]
        return {"data": data, "presets": self.answerable_presets()}

    def answerable_presets(self) -> list[str]:
        """The presets a request may name and get answers for: all of them for a Laya model (each was checked
        at startup); for a student, those of its own questions only (`distill.questions.select`)."""
        own = self._student_questions()
        return sorted(name for name, questions in self.presets.items() if own is None or _asks(own, questions))

    def _student_questions(self) -> dict | None:
        """A student's questions, read from its student.json before it loads (the document is built first); None
        for a Laya model."""
        if self._backend is not None:
            return self._backend.default_questions
        if not self.cfg.student:
            return None
        return read_meta(self.cfg.student)["questions"]

    def stats(self) -> dict:
        backend = self.service.backend
        return {**self.service.metrics.stats(), "batching": self.cfg.batching,
                "decision_engine": backend.describe() if backend is not None else None,
                "decision_caches": backend.caches() if backend is not None else None}

    def health(self) -> dict:
        """Its part of `/health`: the CPU's detected features at once, the engine once the model is loaded."""
        backend = self.service.backend if self.service else None
        return {"decide": {"cpu": self.cpu, "engine": backend.describe() if backend is not None else None}}

    @functools.cached_property
    def cpu(self) -> dict:
        """Read once: /proc/cpuinfo does not change under a process, and `/health` is polled."""
        from laya.precision import detect

        return detect().summary()

    def openapi(self) -> dict:
        return openapi(self.cfg, self._positions(), self.answerable_presets(), self._student_questions())

    def _positions(self) -> int | None:
        """The Laya model's encoder positions, read before it loads (the document is built first); None for a
        student (it refuses budgets) or where its folder cannot say."""
        agent = getattr(self._backend, "agent", None)
        if agent is not None:
            return getattr(agent, "max_positions", None)
        if self._backend is not None or self.cfg.student:
            return None
        return checkpoint_positions(self.cfg.model if self.cfg.model is not None else default_model_dir())

    def close(self, timeout_s: float) -> None:
        if self.service is not None and self.service.batcher is not None:
            self.service.batcher.stop(timeout_s)

    # The routes.

    def decide(self) -> dict:
        results, queue_ms = self.service.decide(self._read("decide"), g.t0, g.request_id, batch=False)
        result = self._with_actions(results[0])
        result["usage"] = {**result["usage"], **self._timing(queue_ms)}
        return {**result, "request_id": g.request_id}

    def decide_batch(self) -> dict:
        results, queue_ms = self.service.decide(self._read("decide_batch"), g.t0, g.request_id, batch=True)
        usage = {"input_tokens": sum(r["usage"].get("input_tokens", 0) for r in results),
                 "output_tokens": sum(r["usage"].get("output_tokens", 0) for r in results),
                 **self._timing(queue_ms)}
        return {"results": [self._with_actions(r) for r in results], "usage": usage, "request_id": g.request_id}

    def systemone(self) -> dict:
        results, _ = self.service.decide(self._read("systemone"), g.t0, g.request_id, batch=False)
        return systemone.result(results[0])

    def systemone_batch(self) -> dict:
        results, _ = self.service.decide(self._read("systemone_batch"), g.t0, g.request_id, batch=True)
        return systemone.batch(results)

    def _name_checkpoint(self, response):
        """Every decision says which checkpoint gave it, so a student deferring here can refuse another model's."""
        backend = self.service.backend if self.service else None
        if response.status_code == 200 and backend is not None and backend.answers_digest:
            response.headers[DIGEST_HEADER] = backend.answers_digest
        return response

    def _read(self, route: str) -> DecideRequest:
        body = parse_json(request.get_data(cache=False))
        # a student's own questions come from its student.json while it loads, so a body that leaves them out
        # is answered 503 (retry) like any other then, not 422 "questions is required"
        own = self._student_questions()
        presets = self.presets
        if own is not None:  # a student answers the presets of its own questions: those are the ones it knows
            presets = {n: self.presets[n] for n in self.answerable_presets()}
            name = body.get("preset") if isinstance(body, dict) else None
            if isinstance(name, str) and name in self.presets and name not in presets:
                raise InputError(f"preset {name!r} asks questions this student was not distilled for (it answers "
                                 f"{', '.join(sorted(own))}; its presets: {', '.join(sorted(presets)) or 'none'})",
                                 field="preset")
        return decide_request(body, route, self.cfg, presets, own)

    def _timing(self, queue_ms: float) -> dict:
        return {"latency_ms": round((time.monotonic() - g.t0) * 1000, 3), "queue_ms": queue_ms}

    def _with_actions(self, result: dict) -> dict:
        return {**result, "actions": self.policy.evaluate(result["answers"])} if self.policy else result


def _asks(own: dict, questions: dict) -> bool:
    """Whether a student with questions `own` answers `questions` (`select` refuses anything else)."""
    try:
        select(own, questions)
    except ValueError:  # InputError is one
        return False
    return True
