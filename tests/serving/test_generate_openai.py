"""The OpenAI routes through the `openai` SDK against a real `pagoda serve` (decisions and generation in one
process): answers equal the engine's in-process ones, streams equal non-streams, n, stop, logprobs, seeds."""

from __future__ import annotations

import math

import openai
import pytest
import requests

from generation import SamplingParams

CHAT = [{"role": "system", "content": "the quick brown fox"}, {"role": "user", "content": "a radix tree finds"}]


@pytest.fixture
def client(gen) -> openai.OpenAI:
    return openai.OpenAI(base_url=gen.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def engine_answer(gen_engine, prompt, **kw):
    ids = gen_engine.tokenizer.encode(gen_engine.apply_chat_template(prompt)) if isinstance(prompt, list) and \
        isinstance(prompt[0], dict) else prompt
    (out,) = gen_engine.generate([ids], SamplingParams(**kw))
    return ids, out


def test_models_list_both_models(client):
    ids = {m.id: m for m in client.models.list().data}
    assert set(ids) == {"bert-tiny", "tiny-llama"}


def test_chat_greedy_equals_the_engine_and_reports_usage(client, gen_engine):
    ids, ref = engine_answer(gen_engine, CHAT, max_new_tokens=12, ignore_eos=True)
    r = client.chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.model == "tiny-llama"
    assert r.choices[0].message.content == ref.text and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 12
    again = client.chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=12, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert again.choices[0].message.content == ref.text
    assert again.usage.prompt_tokens_details.cached_tokens >= 4 * ((len(ids) - 1) // 4)  # whole blocks hit


def test_text_parts_equal_a_string(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]}]
    plain = [{"role": "user", "content": "hello\nworld"}]
    a, b = (client.chat.completions.create(model="tiny-llama", messages=m, max_tokens=6, temperature=0)
            for m in (parts, plain))
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def test_chat_stream_equals_non_stream_and_ends_with_usage(client):
    kw = dict(model="tiny-llama", messages=CHAT, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])


def test_raw_stream_is_sse_ending_with_done(gen):
    r = requests.post(gen.url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3, "stream": True},
                      stream=True, timeout=60)
    assert r.headers["Content-Type"].startswith("text/event-stream")
    lines = [line for line in r.iter_lines(decode_unicode=True) if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"


def test_n_choices_with_a_seed_are_reproducible_and_share_the_prompt(client):
    kw = dict(model="tiny-llama", messages=CHAT, max_tokens=8, temperature=1.0, n=2, seed=11)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.choices[0].message.content != a.choices[1].message.content  # two samples, not one copied
    other = client.chat.completions.create(**{**kw, "seed": 12, "n": 1})
    assert other.choices[0].message.content != a.choices[0].message.content
    one = client.chat.completions.create(**{**kw, "n": 1})
    assert a.usage.prompt_tokens == one.usage.prompt_tokens  # one prompt, counted once for its two choices
    assert one.choices[0].message.content == a.choices[0].message.content  # choice 0 is the seed's own sample


def test_n_streams_every_choice(client):
    chunks = list(client.chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=5, n=2, seed=3,
                                                 temperature=1.0, stream=True))
    texts = {0: "", 1: ""}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
    full = client.chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=5, n=2, seed=3, temperature=1.0)
    assert [texts[0], texts[1]] == [c.message.content for c in full.choices]


def test_stop_strings_cut_streams_and_answers_alike(client, gen_engine):
    _, free = engine_answer(gen_engine, CHAT, max_new_tokens=20, ignore_eos=True)
    stop = free.text[6:9]
    assert stop and free.text.find(stop) >= 1
    kw = dict(model="tiny-llama", messages=CHAT, max_tokens=20, temperature=0, stop=["\u2603never", stop],
              extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    assert full.choices[0].message.content == free.text[: free.text.find(stop)]
    assert full.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
                       if c.choices)
    assert streamed == full.choices[0].message.content


def test_chat_logprobs_are_the_engines(client, gen_engine):
    ids, ref = engine_answer(gen_engine, CHAT, max_new_tokens=6, ignore_eos=True, logprobs=3)
    r = client.chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    for entry, rec in zip(content, ref.logprobs):
        assert math.isclose(entry.logprob, rec["logprob"], abs_tol=1e-4)
        assert bytes(entry.bytes) == gen_engine.tokenizer.token_bytes(rec["token_id"])
        assert [math.isclose(t.logprob, lp, abs_tol=1e-4) for t, (_, lp) in zip(entry.top_logprobs, rec["top"])] == [True] * 3
    assert b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace") == r.choices[0].message.content


def test_completions_batch_echo_and_logprobs(client, gen_engine):
    prompts = ["the quick brown", [5, 6, 7, 8]]
    r = client.completions.create(model="tiny-llama", prompt=prompts, max_tokens=4, temperature=0, echo=True,
                                  logprobs=2, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    for choice, prompt in zip(r.choices, prompts):
        ids = gen_engine.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        (ref,) = gen_engine.generate([ids], SamplingParams(max_new_tokens=4, ignore_eos=True, logprobs=2,
                                                           prompt_logprobs=2))
        echo = prompt if isinstance(prompt, str) else gen_engine.tokenizer.decode(prompt, skip_special_tokens=False)
        assert choice.text == echo + ref.text
        lp = choice.logprobs
        assert len(lp.tokens) == len(ids) + 4 and lp.token_logprobs[0] is None
        expected = [r_["logprob"] for r_ in ref.prompt_logprobs[1:]] + [r_["logprob"] for r_ in ref.logprobs]
        assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(lp.token_logprobs[1:], expected))
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert r.usage.prompt_tokens == len(gen_engine.tokenizer.encode(prompts[0])) + 4


def test_completions_stream_with_echo(client):
    kw = dict(model="tiny-llama", prompt="hello world", max_tokens=5, temperature=0, echo=True,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices)
    assert streamed == full and full.startswith("hello world")


def test_seeded_sampling_is_reproducible_and_seeds_matter(client):
    kw = dict(model="tiny-llama", prompt="numbers 0 1 2", max_tokens=10, temperature=1.0, top_p=0.9,
              extra_body={"ignore_eos": True})
    texts = [client.completions.create(**kw, seed=s).choices[0].text for s in (5, 5, 6)]
    assert texts[0] == texts[1] and texts[0] != texts[2]


def test_text_offsets_count_characters_when_tokens_split_them(client):
    """A byte-level token may hold part of a character: its offset must not count the U+FFFD it shows as a
    character of the text, or every later offset points past the text."""
    prompt = "é😀 ok"
    lp = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=0, echo=True,
                                   logprobs=1).choices[0].logprobs
    assert len(lp.tokens) > len(prompt)  # the two non-ASCII characters came as several byte tokens
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert lp.text_offset[-1] == len(prompt) - len(lp.tokens[-1])  # the last token is ASCII and ends the text


def test_an_echoed_token_prompt_keeps_its_special_tokens_where_its_offsets_count_them(client, gen_engine):
    """The echo was decoded without them while `tokens` and `text_offset` counted them: offsets pointed past it."""
    tok = gen_engine.tokenizer
    prompt = [tok.token_id("<|im_start|>"), *tok.encode("user hello")]
    lp = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=0, echo=True, logprobs=1).choices[0]
    assert lp.text.startswith("<|im_start|>user")
    for token, at in zip(lp.logprobs.tokens, lp.logprobs.text_offset):
        assert lp.text[at:].startswith(token), (token, at, lp.text)


def test_the_stopping_token_is_left_out_of_the_text_as_vllm_leaves_it(client, gen_engine):
    """A matched stop token's text stayed in the answer (and EOS's with skip_special_tokens false); vLLM leaves it
    out unless include_stop_str_in_output, which is taken at false only."""
    ids = gen_engine.tokenizer.encode("hello world")
    (ref,) = gen_engine.generate([ids], SamplingParams(max_new_tokens=8, ignore_eos=True))
    decode = gen_engine.tokenizer.decode
    k = next(i for i, t in enumerate(ref.token_ids) if ref.token_ids.index(t) == i  # a first use that adds text
             and decode(ref.token_ids[:i + 1]).rstrip("\ufffd") != decode(ref.token_ids[:i]).rstrip("\ufffd"))
    r = client.completions.create(model="tiny-llama", prompt="hello world", max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True, "stop_token_ids": [ref.token_ids[k]]}).choices[0]
    assert r.finish_reason == "stop" and r.text == decode(ref.token_ids[:k])
    with pytest.raises(openai.BadRequestError, match="include_stop_str_in_output"):
        client.completions.create(model="tiny-llama", prompt="hi", max_tokens=2,
                                  extra_body={"include_stop_str_in_output": True})


def test_tiny_temperatures_are_greedy_and_top_k_minus_one_is_off(client):
    """Both were 400s: vLLM reads a temperature under 1e-5 as greedy and top_k -1 as no top-k."""
    kw = dict(model="tiny-llama", prompt="numbers 0 1 2", max_tokens=6, extra_body={"ignore_eos": True})
    greedy = client.completions.create(**kw, temperature=0).choices[0].text
    assert client.completions.create(**kw, temperature=1e-6).choices[0].text == greedy
    top_k = dict(kw, extra_body={"ignore_eos": True, "top_k": -1})
    assert client.completions.create(**top_k, temperature=0).choices[0].text == greedy


def test_one_model_is_retrieved_by_id(client):
    model = client.models.retrieve("tiny-llama")
    assert model.id == "tiny-llama" and model.object == "model" and isinstance(model.created, int)
    assert isinstance(client.models.retrieve("bert-tiny").created, int)
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4")
    assert err.value.body["param"] == "model" and err.value.body["code"] == "model_not_found"


def test_a_budget_past_the_context_is_refused_and_a_default_one_shrinks(gen):
    """1,024 positions: 700 prompt tokens leave room for 324 (the chat's 350 "x " take 700 and its template a few
    more). A budget the client set past that is refused
    naming its field (OpenAI, vLLM and SGLang refuse it too); the server's default shrinks to fit."""
    prompt = [5] * 700
    for path, body, field in (("/v1/completions", {"prompt": prompt, "max_tokens": 325}, "max_tokens"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 350}],
                                                        "max_completion_tokens": 500}, "max_completion_tokens"),
                              ("/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 325}},
                               "sampling_params.max_new_tokens")):
        r = requests.post(gen.url + path, json=body, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error.get("param", error.get("field")) == field and "1024" in error["message"], error
    r = requests.post(gen.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 324, "temperature": 0,
                                                         "ignore_eos": True}, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 324
    r = requests.post(gen.url + "/generate", json={"input_ids": [5] * 900, "sampling_params": {
        "temperature": 0, "ignore_eos": True}}, timeout=120)  # SGLang's default budget, 128, past the 124 left
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 124


def test_logit_bias_forces_a_token_on_both_routes_as_in_process(client, gen_engine):
    """OpenAI's `logit_bias` (token ids as decimal strings): +100 on a token the model would not pick makes
    greedy decoding pick it every step, the answer the engine gives in-process with `SamplingParams.logit_bias`."""
    prompt = gen_engine.tokenizer.encode("the quick brown fox")
    (free,) = gen_engine.generate([prompt], SamplingParams(max_new_tokens=5, ignore_eos=True))
    tok = next(t for t in range(3, 300) if t not in free.token_ids)
    ids, ref = engine_answer(gen_engine, CHAT, max_new_tokens=5, logit_bias={tok: 100})
    (ref_completion,) = gen_engine.generate([prompt], SamplingParams(max_new_tokens=5, logit_bias={tok: 100}))
    assert ref.token_ids == ref_completion.token_ids == [tok] * 5
    chat = client.chat.completions.create(model="tiny-llama", messages=CHAT, logit_bias={str(tok): 100},
                                          temperature=0, max_tokens=5, logprobs=True)
    assert chat.choices[0].message.content == ref.text and chat.usage.completion_tokens == 5
    assert [bytes(e.bytes) for e in chat.choices[0].logprobs.content] == [gen_engine.tokenizer.token_bytes(tok)] * 5
    completion = client.completions.create(model="tiny-llama", prompt=prompt, logit_bias={str(tok): 100},
                                           temperature=0, max_tokens=5, logprobs=0)
    assert completion.choices[0].text == ref_completion.text
    assert completion.choices[0].logprobs.tokens == [gen_engine.tokenizer.decode([tok])] * 5
    banned = client.completions.create(model="tiny-llama", prompt=prompt, logit_bias={str(free.token_ids[0]): -100},
                                       temperature=0, max_tokens=1)
    (ref_banned,) = gen_engine.generate([prompt], SamplingParams(max_new_tokens=1, logit_bias={free.token_ids[0]: -100}))
    assert banned.choices[0].text == ref_banned.text != gen_engine.tokenizer.decode(free.token_ids[:1])


@pytest.mark.parametrize(("bias", "needle"), [
    ({"x": 1}, "'x'"), ({"-5": 1}, "'-5'"), ({" 5": 1}, "' 5'"), ({"05": 1}, "'05'"), ({"5": "high"}, "'high'"),
    ({"5": True}, "True"), ({"5": 100.5}, "[-100, 100]"), ({"5": -101}, "[-100, 100]"),
    ({"1000000": 1}, "[1000000] outside the vocabulary"), ([5], "object")])
def test_a_bad_logit_bias_is_a_400_naming_it(client, bias, needle):
    """Keys are token ids in decimal, values numbers in [-100, 100] (OpenAI's range), ids inside the vocabulary:
    the parser checks the JSON, the engine the rest, and either way the error's `param` is `logit_bias`."""
    for create, kw in ((client.chat.completions.create, {"messages": CHAT}),
                       (client.completions.create, {"prompt": "hello"})):
        with pytest.raises(openai.BadRequestError) as err:
            create(model="tiny-llama", max_tokens=2, logit_bias=bias, **kw)
        assert err.value.body["param"] == "logit_bias" and needle in err.value.body["message"], err.value.body


def test_min_tokens_holds_off_the_stop_as_vllm_takes_it(client, gen_engine):
    """vLLM's `min_tokens` (sent through `extra_body`): EOS forced by a bias comes only after that many tokens, on
    both routes, as in-process; over `max_tokens`, or beside `response_format`, is a 400 naming it."""
    eos = min(gen_engine.eos_ids)
    prompt = gen_engine.tokenizer.encode("the quick brown fox")
    kw = dict(max_new_tokens=9, min_new_tokens=3, logit_bias={eos: 100}, trim_stop_token=True)
    (ref,) = gen_engine.generate([prompt], SamplingParams(**kw))
    _, ref_chat = engine_answer(gen_engine, CHAT, **kw)
    assert len(ref.token_ids) == len(ref_chat.token_ids) == 4
    extra = {"min_tokens": 3}
    c = client.completions.create(model="tiny-llama", prompt=prompt, logit_bias={str(eos): 100}, temperature=0,
                                  max_tokens=9, extra_body=extra)
    assert c.choices[0].text == ref.text and c.choices[0].finish_reason == "stop" and c.usage.completion_tokens == 4
    chat = client.chat.completions.create(model="tiny-llama", messages=CHAT, logit_bias={str(eos): 100},
                                          temperature=0, max_tokens=9, extra_body=extra)
    assert chat.choices[0].message.content == ref_chat.text and chat.usage.completion_tokens == 4
    for body in ({"max_tokens": 2, "extra_body": {"min_tokens": 3}}, {"extra_body": {"min_tokens": -1}},
                 {"extra_body": {"min_tokens": 2}, "response_format": {"type": "json_object"}}):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="tiny-llama", messages=CHAT, **body)
        assert err.value.body["param"] == "min_tokens", (body, err.value.body)


def test_min_tokens_past_what_the_context_leaves_is_a_400(client, gen_engine):
    """A chat without max_tokens gets the server's default budget, shrunk to what the context leaves; a min_tokens
    the context cannot hold is refused by name rather than cut short (the model's context here: 1024)."""
    long = [{"role": "user", "content": "fox " * 300}]
    n_prompt = len(gen_engine.encode(gen_engine.apply_chat_template(long)))
    room = gen_engine.max_model_len - n_prompt
    assert 0 < room < 512  # the server's default (--generate-max-new-tokens 512) does not fit
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-llama", messages=long, temperature=0,
                                       extra_body={"min_tokens": room + 1})
    assert err.value.body["param"] == "min_tokens" and "context" in err.value.body["message"]
    r = client.chat.completions.create(model="tiny-llama", messages=long, temperature=0,
                                       extra_body={"min_tokens": 2, "ignore_eos": True, "stop_token_ids": []})
    assert r.usage.completion_tokens == room and r.choices[0].finish_reason == "length"
