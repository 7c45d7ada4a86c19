"""What the HTTP generation API needs from the engine: batches on one queue, typed errors, what ended a
stop, special tokens kept on request, exact token bytes, chat content parts, pins listed, cache flush."""

from __future__ import annotations

import pytest

from generation import (
    BatchHandle,
    Engine,
    EngineConfig,
    EngineLoop,
    InvalidParam,
    LogitsProcessor,
    QueueFull,
    SamplingParams,
)
from generation.engine import GenerationOutput, TokenEvent

GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return Engine(EngineConfig(model=str(tiny_llama), block_size=4, num_blocks=128, max_num_batched_tokens=32))


def test_a_batch_shares_one_queue_and_equals_its_solo_runs(engine):
    prompts = [[5, 6, 7, 8, 9], [5, 6, 7, 8, 9], [11, 12]]
    params = [GREEDY, SamplingParams(max_new_tokens=6, temperature=1.0, seed=7, ignore_eos=True), GREEDY]
    solo = [engine.generate([p], sp)[0] for p, sp in zip(prompts, params)]
    with EngineLoop(engine) as loop:
        batch = loop.submit_batch(prompts, params)
        assert isinstance(batch, BatchHandle) and len(set(batch.request_ids)) == 3
        events = list(batch)
        tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
        for ev in events:
            if isinstance(ev, TokenEvent):
                tokens[ev.index].append(ev.token_id)
        assert sum(isinstance(e, GenerationOutput) for e in events) == 3
        for i, out in enumerate(batch.outputs):
            assert out.index == i and out.token_ids == tokens[i] == solo[i].token_ids
        # the second copy of the prompt found the first one's full blocks computed (in-batch sharing)
        assert batch.outputs[1].cached_tokens >= 4


def test_a_batch_is_all_or_nothing(engine):
    with EngineLoop(engine, max_waiting=2) as loop:
        with pytest.raises(InvalidParam) as err:
            loop.submit_batch([[5, 6], [10**6]], GREEDY)
        assert err.value.field == "prompt"
        with pytest.raises(QueueFull):
            loop.submit_batch([[5], [6], [7]], GREEDY)  # three would pass max_waiting=2 at once
        assert loop.stats()["waiting_requests"] == 0
        batch = loop.submit_batch([[5], [6]], GREEDY)
        list(batch)
        assert [o.finish_reason for o in batch.outputs] == ["length", "length"]
        batch = loop.submit_batch([[5, 6, 7]], SamplingParams(max_new_tokens=300, ignore_eos=True))
        stream = iter(batch)
        next(stream)
        batch.abort()
        list(stream)
        assert batch.outputs[0].finish_reason == "abort"


@pytest.mark.parametrize("kwargs,field", [({"top_p": 0}, "top_p"), ({"temperature": -1}, "temperature"),
                                          ({"max_new_tokens": -1}, "max_new_tokens"), ({"logprobs": 21}, "logprobs"),
                                          ({"skip_special_tokens": "no"}, "skip_special_tokens")])
def test_invalid_params_name_their_field(kwargs, field):
    with pytest.raises(InvalidParam) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field and isinstance(err.value, ValueError)


def test_engine_input_errors_name_their_field(engine):
    for prompt, params, pin, field in (([], GREEDY, None, "prompt"), ([10**6], GREEDY, None, "prompt"),
                                       ("hi", {"x": 1}, None, "params"), ("hi", GREEDY, "pin-404", "pin")):
        with pytest.raises(InvalidParam) as err:
            engine.check_request(prompt, params, pin=pin)
        assert err.value.field == field


def test_matched_stop_says_what_ended_the_request(engine):
    (free,) = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert free.matched_stop is None and free.finish_reason == "length"
    token = free.token_ids[3]
    (by_token,) = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=12, stop_token_ids=[token]))
    assert by_token.finish_reason == "stop" and by_token.matched_stop == token
    stop = free.text[len(free.text) // 2:][:3]
    (by_text,) = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=12, ignore_eos=True, stop=["zzzq", stop]))
    assert by_text.matched_stop == stop and by_text.text == free.text[: free.text.find(stop)]


def test_special_tokens_kept_on_request(engine):
    end = engine.tokenizer.token_id("<|im_end|>")
    ids = [5, 6, 7]
    base = SamplingParams(max_new_tokens=1, ignore_eos=True, logits_processors=[Force(end)])
    (skipped,) = engine.generate([ids], base)
    (kept,) = engine.generate([ids], SamplingParams(max_new_tokens=1, ignore_eos=True, skip_special_tokens=False,
                                                     logits_processors=[Force(end)]))
    assert skipped.token_ids == kept.token_ids == [end]
    assert skipped.text == "" and kept.text == "<|im_end|>"


class Force(LogitsProcessor):
    """Allows only one token (enough to make a random model emit a special token)."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, prompt_ids, output_ids, logits):
        keep = logits[self.token].item()
        logits.fill_(float("-inf"))
        logits[self.token] = keep


def test_token_bytes_rebuild_the_text(engine):
    tok = engine.tokenizer
    for text in ("the quick brown fox", "héllo wörld!", "<|im_start|>user"):
        ids = tok.encode(text)
        assert b"".join(tok.token_bytes(i) for i in ids).decode("utf-8") == text


def test_chat_content_parts_render_like_strings(engine):
    tok = engine.tokenizer
    plain = tok.apply_chat_template([{"role": "user", "content": "hello\nworld"}])
    parts = tok.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "hello"},
                                                                   {"type": "text", "text": "world"}]}])
    assert parts == plain
    with pytest.raises(InvalidParam) as err:
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])
    assert err.value.field == "messages[0].content[0]"
    with pytest.raises(InvalidParam) as err:
        tok.apply_chat_template([{"role": "user", "content": 3}])
    assert err.value.field == "messages[0].content"


def test_pins_are_listed_and_flush_keeps_them(engine):
    with EngineLoop(engine, num_threads=1) as loop:
        pid = loop.pin(list(range(10, 27)))  # 17 tokens: 4 full blocks + 1
        assert loop.pins() == {pid: {"tokens": 17, "blocks": 5}}
        loop.submit(list(range(40, 60)), GREEDY).result(60)
        assert loop.stats()["cached_blocks"] > 0
        freed = loop.flush_cache()
        stats = loop.stats()
        assert freed > 0 and stats["free_blocks"] == stats["num_blocks"] - 5  # only the pin's blocks stay
        out = loop.submit(list(range(10, 27)) + [30], GREEDY, pin=None).result(60)
        assert out.cached_tokens == 16  # the pin's full blocks are still in the cache after the flush
        loop.unpin(pid)
        assert loop.pins() == {}
