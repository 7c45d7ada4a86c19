"""The batcher in-process over the real tiny model: batched rows equal unbatched rows to the bit, and the
queue/deadline rules hold exactly (the model worker is held inside a real forward by a gate)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from serving_support import BILLING_STATE

from serving.decide.backend import LayaBackend
from serving.decide.batcher import Batcher, BatchLimits, DeadlineExceeded, QueueFull
from serving.decide.metrics import DecideMetrics


def test_batched_rows_equal_unbatched(agent, billing_questions):
    backend = LayaBackend(agent, "tiny")
    metrics = DecideMetrics()
    batcher = Batcher(backend.run, BatchLimits(max_wait_ms=50), metrics)
    names = list(billing_questions)
    work = [backend.prepare(f"{BILLING_STATE[: 10 + 7 * i]} #{i}",
                            {n: billing_questions[n] for n in names[i % 3:]}, {}) for i in range(12)]
    outputs: dict[int, list] = {}

    def submit(i: int) -> None:
        outputs[i] = batcher.submit([work[i]], [backend.cost(work[i])], time.monotonic() + 60).wait()[0]

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(len(work))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    batcher.stop()
    assert max(int(k) for k in metrics.stats()["batch_size_histogram"]) > 3  # requests really shared passes
    worst = 0.0
    for i, prepared in enumerate(work):
        alone = agent.forward(prepared.rows)
        for got, ref in zip(outputs[i], alone):
            worst = max(worst, float(np.abs(got.logits - ref.logits).max()),
                        float(np.abs(got.act_probabilities - ref.act_probabilities).max()))
        assert agent.finish(prepared, outputs[i]) == agent.finish(prepared, alone)
    assert worst <= 1e-6, worst


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
