"""Per-state latency of anything that answers states: p50/p99 at batch 1 and per state at batch 32.

Shared by the report and `pagoda bench distill`. Figures on a shared machine are noisy, so callers
always measure a baseline in the same process and print ratios beside the absolute numbers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np


def measure(predict: Callable[[Any], Any], predict_batch: Callable[[list[Any]], Any], states: list[Any],
            singles: int = 100, batches: int = 4, batch_size: int = 32, warmup: int = 3) -> dict[str, float]:
    """ms per state: batch-1 p50/p99 over `singles` calls, batch-32 p50/p99 over `batches` calls (divided by 32).

    `b1_cpu_p50` is the process CPU time per batch-1 call: at 1 thread it is what the wall time would
    be on an idle core, which is the figure a shared, oversubscribed machine cannot otherwise give.
    """
    if not states:
        raise ValueError("states: need at least one state to time")
    for s in states[:warmup]:
        predict(s)
    one, cpu = [], []
    for i in range(singles):
        s = states[i % len(states)]
        c, t = time.process_time(), time.perf_counter()
        predict(s)
        one.append((time.perf_counter() - t) * 1000)
        cpu.append((time.process_time() - c) * 1000)
    many = []
    for i in range(batches):
        chunk = [states[(i * batch_size + j) % len(states)] for j in range(batch_size)]
        t = time.perf_counter()
        predict_batch(chunk)
        many.append((time.perf_counter() - t) * 1000 / batch_size)
    return {"b1_p50": float(np.percentile(one, 50)), "b1_p99": float(np.percentile(one, 99)),
            "b1_cpu_p50": float(np.percentile(cpu, 50)),
            "b32_p50": float(np.percentile(many, 50)), "b32_p99": float(np.percentile(many, 99))}


def student_latency(path, threads: int | None, precision: str | None, states: list[str], **kw: Any) -> dict[str, float]:
    from distill.runtime import Student

    s = Student(path, threads=threads, precision=precision)
    return measure(s.predict, s.predict_batch, states, **kw)


def teacher_latency(teacher: str | None, questions: dict, threads: int, states: list[str],
                    budgets: dict | None = None, **kw: Any) -> dict[str, float]:
    """The teacher (a checkpoint folder, None: laya-mini) loaded at `threads` intra-op threads.

    Loaded per thread count because laya's onnxruntime engine fixes its threads at load: an agent
    loaded once answered the "1 thread" rows on every core (CPU time twice its wall time), which made
    the students' 1-thread speed-ups look smaller than they are. torch's threads are set too, for the
    checkpoints laya runs on torch.
    """
    import torch

    import laya

    agent = laya.load(teacher, threads=threads)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        b = budgets or {}
        return measure(lambda s: agent.predict(s, questions, **b),
                       lambda ss: agent.predict_batch(ss, questions, batch_size=32, **b), states, **kw)
    finally:
        torch.set_num_threads(before)


def deferral_latency(path, teacher: str | None, below: Any, threads: int, states: list[str],
                     remote: str | None = None, api_key: str | None = None, model: str | None = None,
                     **kw: Any) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """The student with its unsure answers deferred to `teacher` (`distill.deferral`), both at `threads`:
    (latency as `measure` gives it, per question {agreement with the teacher alone, share deferred} on `states`).
    With `remote` (a Laya server's URL; `api_key` its key, `model` its checkpoint) the deferred answers come from
    there, and agreement is still counted against `teacher` in this process, so a server that runs another model
    shows as disagreement.

    At batch 1 a state either stays on the student or also waits for the teacher, so p50 and p99 part ways;
    the batch-32 figure is the mean cost per state."""
    import torch

    import laya
    from distill.deferral import Deferral, parse_below, recorded_teacher
    from distill.remote_teacher import RemoteTeacher, TeacherUnavailable
    from distill.runtime import Student
    from laya.answers import top_option

    s = Student(path, threads=threads)
    agent = laya.load(teacher, threads=threads)
    d = Deferral(RemoteTeacher(remote, api_key=api_key, model=model, teacher_digest=recorded_teacher(s.meta),
                               field="--defer-to") if remote else agent,
                 parse_below(below, s.questions, "--defer-below"))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        given = s.predict_batch(states, defer=d)
        failed = [g["usage"]["deferral_error"] for g in given if g["usage"]["deferral_error"]]
        if failed:
            raise TeacherUnavailable(f"no answer for {len(failed)} states: {failed[0]}")
        told = agent.predict_batch(states, s.questions, **s.teacher_budgets)
        fidelity = {q: {"agreement": float(np.mean([top_option(g["answers"][q]) == top_option(t["answers"][q])
                                                    for g, t in zip(given, told)])),
                        "deferred": float(np.mean([q in g["usage"]["deferred_questions"] for g in given]))}
                    for q in s.questions}
        return measure(lambda x: s.predict(x, defer=d), lambda xs: s.predict_batch(xs, defer=d), states, **kw), fidelity
    finally:
        torch.set_num_threads(before)
