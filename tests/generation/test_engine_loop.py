"""EngineLoop: many threads against one engine thread; abort, deadlines, back-pressure, pins, errors, shutdown."""

from __future__ import annotations

import contextlib
import random
import threading
import time

import pytest

from generation import Engine, EngineConfig, EngineLoop, LogitsProcessor, QueueFull, SamplingParams
from generation.config import InvalidParam
from generation.engine import GenerationOutput, TokenEvent

GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)


class Boom(LogitsProcessor):
    def __call__(self, prompt_ids, output_ids, logits):
        raise RuntimeError("matcher crashed")


@pytest.fixture
def engine(tiny_llama):
    return Engine(EngineConfig(model=str(tiny_llama), block_size=4, num_blocks=128, max_num_batched_tokens=32))


def clean(stats: dict) -> bool:
    return (stats["running_requests"] == stats["waiting_requests"] == 0
            and stats["free_blocks"] + stats["cached_blocks"] == stats["num_blocks"])


@contextlib.contextmanager
def held(loop: EngineLoop):
    """Keep the loop thread busy between two steps, so what is submitted meanwhile is added all at once."""
    gate, entered = threading.Event(), threading.Event()
    holder = threading.Thread(target=loop._call, args=(lambda e: (entered.set(), gate.wait(30)),))
    holder.start()
    assert entered.wait(30)
    try:
        yield
    finally:
        gate.set()
        holder.join(30)


def drain(handle) -> tuple[list[TokenEvent], GenerationOutput]:
    events = list(handle)
    return events, handle.output


def test_concurrent_threads_get_their_sequential_greedy_answers(engine):
    rng = random.Random(3)
    shared = [rng.randrange(3, 300) for _ in range(13)]
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(1, 20))] for _ in range(12)]
    prompts += [shared + [rng.randrange(3, 300) for _ in range(k)] for k in (1, 3, 6, 9)]
    ref = [engine.generate([p], GREEDY)[0] for p in prompts]  # one at a time
    engine.cache.evict(engine.blocks.num_blocks)
    results: dict[int, tuple[list[TokenEvent], GenerationOutput]] = {}
    with EngineLoop(engine) as loop:
        def worker(ids: list[int]) -> None:
            for i in ids:
                results[i] = drain(loop.submit(prompts[i], GREEDY))

        threads = [threading.Thread(target=worker, args=(list(range(t, len(prompts), 4)),)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        stats = loop.stats()
    assert sorted(results) == list(range(len(prompts)))
    for i, (events, out) in results.items():
        assert out.token_ids == ref[i].token_ids and [e.token_id for e in events] == out.token_ids
        assert "".join(e.text for e in events) == out.text == ref[i].text
        assert out.finish_reason == "length" and events[-1].finish_reason == "length"
    assert stats["decode_batch_factor"] > 1 and clean(stats)


def test_abort_mid_stream_returns_the_blocks(engine):
    with EngineLoop(engine) as loop:
        handle = loop.submit("the quick brown fox", SamplingParams(max_new_tokens=200, ignore_eos=True))
        stream = iter(handle)
        first = [next(stream), next(stream)]
        assert all(isinstance(e, TokenEvent) for e in first)
        handle.abort()
        rest = list(stream)
        assert handle.output.finish_reason == "abort" and len(handle.output.token_ids) < 200
        assert [e.token_id for e in first + rest] == handle.output.token_ids
        loop.abort("no-such-request")  # ignored
        assert clean(loop.stats())


def test_deadline_and_back_pressure(engine):
    with EngineLoop(engine, max_waiting=2) as loop:
        late = loop.submit("hello", SamplingParams(max_new_tokens=500, ignore_eos=True), deadline=time.monotonic() + 0.05)
        assert late.result(60).finish_reason == "deadline"
        with held(loop):  # submissions stay in the inbox, so they count as waiting
            queued = [loop.submit([5 + i], GREEDY) for i in range(2)]
            with pytest.raises(QueueFull):
                loop.submit([9], GREEDY)
        assert all(h.result(60).finish_reason == "length" for h in queued)
        assert loop.submit([9], GREEDY).result(60).finish_reason == "length"  # room again
        assert clean(loop.stats())


def test_bad_input_fails_in_the_callers_thread(engine):
    with EngineLoop(engine) as loop:
        with pytest.raises(ValueError, match="prompt"):
            loop.submit([10**6])
        with pytest.raises(ValueError, match="params"):
            loop.submit("hi", {"max_new_tokens": 3})
        with pytest.raises(ValueError, match="pin"):
            loop.submit("hi", pin="pin-404")
        with held(loop):
            loop.submit("a", GREEDY, request_id="mine")
            with pytest.raises(ValueError, match="request_id"):
                loop.submit("b", GREEDY, request_id="mine")
        # a deadline the loop thread could not compare with its clock ended every request and closed the loop
        for deadline in ("soon", float("nan"), True):
            with pytest.raises(InvalidParam, match="deadline") as err:
                loop.submit("hi", GREEDY, deadline=deadline)
            assert err.value.field == "deadline"
            with pytest.raises(InvalidParam, match="deadline"):
                loop.submit_batch(["hi"], GREEDY, deadline=deadline)
        for request_id in (123, ""):
            with pytest.raises(InvalidParam, match="request_id"):
                loop.submit("hi", GREEDY, request_id=request_id)
        assert loop.submit([9], GREEDY).result(60).finish_reason == "length"
    for max_waiting in ("5", -1, 2.5):
        with pytest.raises(InvalidParam, match="EngineLoop.max_waiting"):
            EngineLoop(engine, max_waiting=max_waiting)


def test_engine_errors_reach_the_affected_callers_and_the_loop_goes_on(engine, monkeypatch):
    with EngineLoop(engine) as loop:
        bad = loop.submit([5, 6, 7], SamplingParams(max_new_tokens=4, logits_processors=[Boom()]))
        good = loop.submit([5, 6, 7], GREEDY)
        assert bad.result(60).finish_reason == "error" and "matcher crashed" in bad.output.error
        assert good.result(60).finish_reason == "length"
        real_run = engine.runner.run
        calls = []

        def flaky(plan):
            calls.append(1)
            if len(calls) == 2:
                raise MemoryError("device out of memory")
            return real_run(plan)

        monkeypatch.setattr(engine.runner, "run", flaky)
        with held(loop):  # all three are in flight when the second forward fails
            hit = [loop.submit([20 + i] * 5, SamplingParams(max_new_tokens=6, ignore_eos=True)) for i in range(3)]
        outs = [h.result(60) for h in hit]
        assert all(o.finish_reason == "error" and "device out of memory" in o.error for o in outs)
        assert clean(loop.stats())
        after = loop.submit([5, 6, 7], GREEDY).result(60)
        assert after.token_ids == good.output.token_ids


def test_pins_and_prefill_only_requests_through_the_loop(engine):
    prefix = list(range(10, 33))
    with EngineLoop(engine) as loop:
        pid = loop.pin(prefix)
        outs = [loop.submit(s, GREEDY, pin=pid) for s in ([40], [41, 42])]
        assert all(h.result(60).cached_tokens == len(prefix) for h in outs)
        assert [h.output.token_ids for h in outs] == [o.token_ids for o in engine_free(engine, prefix)]
        loop.unpin(pid)
        with pytest.raises(ValueError, match="pin"):
            loop.unpin(pid)
        warm = loop.submit(list(range(60, 90)), SamplingParams(max_new_tokens=0)).result(60)
        assert warm.token_ids == [] and warm.finish_reason == "length"
        assert loop.submit(list(range(60, 91)), GREEDY).result(60).cached_tokens == 28
        assert loop.stats()["pins"] == 0


def engine_free(engine: Engine, prefix: list[int]) -> list:
    """The same continuations computed without a pin, on a separate engine of the same model."""
    other = Engine(EngineConfig(model=engine.config.model, block_size=4, num_blocks=64))
    return other.generate([prefix + [40], prefix + [41, 42]], GREEDY)


def test_shutdown_ends_every_request_and_refuses_new_ones(engine):
    loop = EngineLoop(engine)
    running = loop.submit("hello world", SamplingParams(max_new_tokens=400, ignore_eos=True))
    next(iter(running))
    loop.close()
    assert running.result(10).finish_reason == "abort"
    assert not loop._thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        loop.submit("again")
    with pytest.raises(RuntimeError, match="closed"):
        loop.stats()
    assert engine.num_unfinished == 0
    assert engine.blocks.num_free + engine.cache.num_cached_blocks == engine.blocks.num_blocks

    drained = EngineLoop(engine)
    handles = [drained.submit([5 + i], GREEDY) for i in range(3)]
    drained.close(drain=True)
    assert [h.result(10).finish_reason for h in handles] == ["length"] * 3
