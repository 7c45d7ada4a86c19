"""The decision model in a serving process: its lifecycle, and one request's path through the batcher.

The model loads in a background thread so the process answers `/health` at once and `/ready` says 503
until the model is in memory; a load failure keeps it at 503 with the reason (and the gunicorn worker
exits, see `serving.server`). Each process holds one backend and one `Batcher` (its model-worker
thread); request threads only prepare and finish, so tokenisation runs in parallel with the model.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from laya.errors import InputError, in_batch
from serving.decide.batcher import Batcher, BatchLimits, DeadlineExceeded, ModelError, QueueFull
from serving.decide.config import DecideConfig
from serving.decide.metrics import DecideMetrics
from serving.decide.schema import DecideRequest, too_large
from serving.errors import ApiError

log = logging.getLogger("pagoda.serve")


class Service:
    """The loaded backend and its batcher, or why there is none yet."""

    def __init__(self, cfg: DecideConfig, metrics: DecideMetrics, request_timeout_s: float):
        self.cfg = cfg
        self.request_timeout_s = request_timeout_s
        self.metrics = metrics
        self.backend: Any = None
        self.batcher: Batcher | None = None
        self.error: str | None = None
        self.loaded = threading.Event()
        self.created = int(time.time())  # `/v1/models`' `created`: when this process took the model up

    def attach(self, backend: Any) -> None:
        cfg = self.cfg
        limits = BatchLimits(cfg.max_batch_questions, cfg.max_batch_tokens, cfg.max_wait_ms, cfg.max_queue,
                             cfg.batching)
        self.batcher = Batcher(backend.run, limits, self.metrics)
        self.backend = backend
        self.created = int(time.time())
        self.metrics.ready.set(1)
        self.loaded.set()

    def load_in_background(self) -> None:
        def load() -> None:
            from serving.decide.backend import load_backend

            try:
                started = time.monotonic()
                backend = load_backend(self.cfg)
                self.attach(backend)
                log.info("model %s ready in %.1fs", backend.name, time.monotonic() - started)
            except Exception as exc:  # noqa: BLE001 -- reported by /ready and the log, not a crash loop
                self.error = f"{type(exc).__name__}: {exc}"
                log.exception("model failed to load")

        threading.Thread(target=load, name="pagoda-model-load", daemon=True).start()

    def decide(self, req: DecideRequest, started: float, request_id: str, batch: bool) -> tuple[list[dict], float]:
        """Answers per state and the queue wait in ms, by `started` (monotonic) + the request timeout.
        `batch`: an error about a state names it `states[i]`."""
        deadline = started + self.request_timeout_s
        backend, batcher = self.backend, self.batcher
        if backend is None or batcher is None:
            raise ApiError(503, self.error or "the model is still loading", "not_ready",
                           headers={"Retry-After": "1"})
        with batcher.arriving():
            units, costs, tokens = [], [], 0
            for i, state in enumerate(req.states):
                try:
                    units.append(backend.prepare(state, req.questions, req.budgets))
                except InputError as exc:
                    if batch and exc.path == "state":
                        raise in_batch(exc, i) from None
                    raise
                costs.append(backend.cost(units[-1]))
                tokens += costs[-1][0] * costs[-1][1]
                if tokens > self.cfg.max_request_tokens:  # stop tokenising: the answer is already no
                    more = f" for its first {i + 1} of {len(req.states)} states" if i + 1 < len(req.states) else ""
                    raise too_large(f"{tokens} encoder tokens{more}", self.cfg.max_request_tokens,
                                    self.cfg.where("max_request_tokens"), "states" if batch else "questions",
                                    lower_max_len=True)
            pending = None
            if any(rows for rows, _ in costs):  # no rows (no questions, on the systemone routes): no model pass
                try:
                    pending = batcher.submit(units, costs, deadline)
                except QueueFull as exc:
                    where = f" ({self.cfg.where('max_queue')})" if exc.full else ""
                    raise ApiError(503, f"server busy: {exc}{where}", "overloaded",
                                   headers={"Retry-After": "1"}) from None
        try:
            # `run` over units without rows computes nothing (it splits an empty output), so it may run here
            outputs = pending.wait() if pending is not None else backend.run(units)
        except DeadlineExceeded:
            raise ApiError(504, f"no answer within the {self.request_timeout_s:g}s deadline", "timeout") from None
        except ModelError as exc:
            log.error("request %s: model error (traceback above, from the model worker): %s", request_id, exc)
            raise ApiError(500, f"the model failed on this request; see the server log for request {request_id}",
                           "model_error") from None
        results = backend.finish(units, outputs, deadline)
        self.metrics.observe_decisions(len(results), sum(len(r["answers"]) for r in results),
                                       sum(r["usage"].get("input_tokens", 0) for r in results),
                                       sum(len(r["usage"].get("deferred_questions", ())) for r in results),
                                       sum(r["usage"].get("deferral_error") is not None for r in results))
        return results, pending.queue_ms if pending is not None else 0.0
