"""The batcher over the real tiny model: batched rows equal unbatched rows to the bit (unrounded logits and
act probabilities, `np.array_equal`), in-process and across real concurrent HTTP requests, and the
queue/deadline rules hold exactly (the model worker is held inside a real forward by a gate)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import requests
from serving_support import BILLING_STATE

from serving.config import ServeConfig
from serving.decide.backend import LayaBackend
from serving.decide.batcher import Batcher, BatchLimits, DeadlineExceeded, QueueFull
from serving.decide.metrics import DecideMetrics


def test_batched_rows_equal_unbatched(agent, billing_questions):
    backend = LayaBackend(agent, "tiny")
    metrics = DecideMetrics()
    # The worker waits for company only while requests are `arriving` (as the service marks them), up to
    # max_wait_ms: long enough for 12 threads on a loaded machine. Without `arriving` nothing waits, and
    # how many requests shared a pass was up to the thread scheduler (CI once saw at most 3).
    batcher = Batcher(backend.run, BatchLimits(max_wait_ms=1000), metrics)
    names = list(billing_questions)
    work = [backend.prepare(f"{BILLING_STATE[: 10 + 7 * i]} #{i}",
                            {n: billing_questions[n] for n in names[i % 3:]}, {}) for i in range(12)]
    outputs: dict[int, list] = {}

    all_arriving = threading.Barrier(len(work))

    def submit(i: int) -> None:
        with batcher.arriving():
            all_arriving.wait(30)
            outputs[i] = batcher.submit([work[i]], [backend.cost(work[i])], time.monotonic() + 60).wait()[0]

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(len(work))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    batcher.stop()
    assert max(int(k) for k in metrics.stats()["batch_size_histogram"]) > 3  # requests really shared passes
    for i, prepared in enumerate(work):
        assert_bit_equal_alone(agent, prepared, outputs[i])


def assert_bit_equal_alone(agent, prepared, outputs) -> None:
    """The rows a batch computed for one request equal, bit for bit, the rows of a pass over it alone."""
    alone = agent.forward(prepared.rows)
    assert len(outputs) == len(alone) == len(prepared.rows)
    for row, got, ref in zip(prepared.rows, outputs, alone):
        assert got.logits.dtype == ref.logits.dtype
        assert np.array_equal(got.logits, ref.logits), (row.question, np.abs(got.logits - ref.logits).max())
        assert np.array_equal(got.act_probabilities, ref.act_probabilities), row.question
    assert agent.finish(prepared, outputs) == agent.finish(prepared, alone)


class RecordingBackend(LayaBackend):
    """The real backend, keeping each request's unrounded rows as the batch handed them back, and how many
    requests shared each pass: HTTP only shows 4 decimals, the bit claim is about what is under them."""

    def __init__(self, agent, name):
        super().__init__(agent, name)
        self.finished: list[tuple] = []
        self.pass_sizes: list[int] = []
        self._lock = threading.Lock()

    def run(self, units):
        self.pass_sizes.append(len(units))
        return super().run(units)

    def finish(self, units, outputs, deadline):
        with self._lock:
            self.finished.extend(zip(units, outputs))
        return super().finish(units, outputs, deadline)


def test_concurrent_http_batches_are_bit_identical_to_alone(agent, billing_questions):
    """Real clients, concurrent POST /decide over loopback to the real app (the decision API, its batcher
    and model worker) in a threaded HTTP server; the model worker waits for company (max_wait_ms)."""
    from werkzeug.serving import make_server

    from serving.app import create_app
    from serving.decide.routes import DecideApi

    cfg = ServeConfig.from_sources({"max_wait_ms": 200.0, "generate_model": "none"}, env={})
    backend = RecordingBackend(agent, "tiny")
    app = create_app(cfg, apis=[DecideApi(cfg.decide, cfg.request_timeout_s, backend=backend)])
    http = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{http.server_port}/decide"
    names = list(billing_questions)
    bodies = [{"state": f"{BILLING_STATE[: 12 + 6 * i]} #{i}",
               "questions": {n: billing_questions[n] for n in names[i % 3:]}} for i in range(16)]
    answers: dict[int, requests.Response] = {}
    errors: dict[int, BaseException] = {}
    start = threading.Barrier(len(bodies))

    def client(i: int) -> None:
        try:
            start.wait(30)
            answers[i] = requests.post(url, json=bodies[i], timeout=120)
        except BaseException as exc:  # noqa: BLE001 -- a client that raised is a lost request, counted below
            errors[i] = exc

    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(bodies))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
    finally:
        http.shutdown()
    assert not errors, errors
    assert sorted(answers) == list(range(len(bodies)))
    assert max(backend.pass_sizes) > 1, backend.pass_sizes   # requests really shared forward passes
    assert len(backend.finished) == len(bodies)
    for prepared, outputs in backend.finished:
        assert_bit_equal_alone(agent, prepared, outputs)
    for i, body in enumerate(bodies):
        assert answers[i].status_code == 200, answers[i].text
        assert answers[i].json()["answers"] == agent.predict(body["state"], body["questions"])["answers"]


def test_queue_full_and_deadline_are_exact(agent, billing_questions):
    backend = LayaBackend(agent, "tiny")
    gate, entered = threading.Event(), threading.Event()

    def held_run(units):
        entered.set()
        gate.wait(30)
        return backend.run(units)

    batcher = Batcher(held_run, BatchLimits(max_queue=2, max_wait_ms=0), DecideMetrics())
    unit = backend.prepare(BILLING_STATE, billing_questions, {})
    cost = [backend.cost(unit)]
    first = batcher.submit([unit], cost, time.monotonic() + 60)
    assert entered.wait(30)  # the worker is inside the forward; the queue is empty
    queued = batcher.submit([unit], cost, time.monotonic() + 60)
    doomed = batcher.submit([unit], cost, time.monotonic() + 0.2)
    with pytest.raises(QueueFull):
        batcher.submit([unit], cost, time.monotonic() + 60)
    with pytest.raises(DeadlineExceeded):
        doomed.wait()
    # the abandoned request no longer holds a slot
    third = batcher.submit([unit], cost, time.monotonic() + 60)
    gate.set()
    expected = agent.predict(BILLING_STATE, billing_questions)
    for pending in (first, queued, third):
        assert agent.finish(unit, pending.wait()[0]) == expected
    batcher.stop()
