"""SGLang's native routes with `requests`, and SGLang's own frontend (`sglang.RuntimeEndpoint`, run by a
scratch venv's python) running a gen + select program against the same server."""

from __future__ import annotations

import json
import math
import subprocess
import threading
import time
from pathlib import Path

import pytest
import requests
from serving_support import ServerProcess

from generation import SamplingParams

REPO = Path(__file__).resolve().parents[2]
SGL_PYTHON = REPO / ".sglvenv" / "bin" / "python"


def post(server, body, **kw):
    return requests.post(server.url + "/generate", json=body, timeout=60, **kw)


def test_single_batch_and_ids_equal_the_engine(gen, gen_engine):
    texts = ["the quick brown fox", "hello world, this is"]
    sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    one = post(gen, {"text": texts[0], "sampling_params": sp}).json()
    batch = post(gen, {"text": texts, "sampling_params": sp}).json()
    by_ids = post(gen, {"input_ids": [gen_engine.tokenizer.encode(t) for t in texts], "sampling_params": sp}).json()
    refs = gen_engine.generate([gen_engine.tokenizer.encode(t) for t in texts],
                               SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert isinstance(one, dict) and isinstance(batch, list) and len(batch) == 2
    assert one["text"] == batch[0]["text"] == refs[0].text
    for answer, again, ref in zip(batch, by_ids, refs):
        assert answer["output_ids"] == again["output_ids"] == ref.token_ids
        meta = answer["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 6}
        assert meta["prompt_tokens"] == len(ref.prompt_token_ids) and meta["completion_tokens"] == 6


def test_stop_reports_what_matched(gen, gen_engine):
    ids = gen_engine.tokenizer.encode("the quick brown fox")
    (free,) = gen_engine.generate([ids], SamplingParams(max_new_tokens=10, ignore_eos=True))
    r = post(gen, {"input_ids": ids, "sampling_params": {"max_new_tokens": 10, "temperature": 0,
                                                          "stop_token_ids": [free.token_ids[2]]}}).json()
    first = free.token_ids.index(free.token_ids[2])
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": free.token_ids[2]}
    assert r["output_ids"] == free.token_ids[:first + 1]
    # SGLang leaves the matched token's text out (`no_stop_trim` false), and so do vLLM and the OpenAI routes
    before = gen_engine.tokenizer.decode(free.token_ids[:first])
    assert r["text"] == before != gen_engine.tokenizer.decode(free.token_ids[:first + 1])
    streamed = [json.loads(line[len("data: "):]) for line in post(gen, {"input_ids": ids, "stream": True, "sampling_params": {
        "max_new_tokens": 10, "temperature": 0, "stop_token_ids": [free.token_ids[2]]}}).iter_lines(decode_unicode=True)
        if line and line != "data: [DONE]"]
    assert streamed[-1]["text"] == before
    openai = requests.post(gen.url + "/v1/completions", json={"prompt": ids, "max_tokens": 10, "temperature": 0,
                                                              "stop_token_ids": [free.token_ids[2]]}, timeout=60)
    assert openai.json()["choices"][0]["text"] == before


def test_stream_sends_the_text_so_far(gen):
    body = {"text": "paged attention keeps", "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                                 "ignore_eos": True}}
    full = post(gen, body).json()
    events = []
    with post(gen, {**body, "stream": True}, stream=True) as r:
        for line in r.iter_lines(decode_unicode=True):
            if line:
                events.append(line)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative, never rewritten
    assert chunks[-1]["text"] == full["text"] and chunks[-1]["output_ids"] == full["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert len(chunks) == 8 and [len(c["output_ids"]) for c in chunks] == list(range(1, 9))  # one per token, as SGLang


@pytest.mark.parametrize("body,field", [
    ({"input_ids": "hello"}, "input_ids"),
    ({"input_ids": [[1, 2], "x"]}, "input_ids"),
    ({"text": ["Hi", "Yo", ""]}, "text[2]"),
    ({"text": ["Hi", "Yo"], "sampling_params": [{"max_new_tokens": 1}, {"top_p": 5}]}, "sampling_params[1].top_p"),
    ({"text": ["Hi", "Yo"], "sampling_params": [{}, {"stop_token_ids": [10**9]}]},
     "sampling_params[1].stop_token_ids"),
    ({"text": "Hi", "sampling_params": {"top_k": -2}}, "sampling_params.top_k"),
])
def test_errors_name_the_prompt_they_are_about(gen, body, field):
    r = post(gen, body)
    assert r.status_code == 400 and r.json()["error"]["field"] == field, r.text


def test_sampling_values_sglang_takes(gen):
    """What SGLang's SamplingParams accepts: a temperature under 1e-6 is greedy (and one under 1e-5 here, where
    SGLang samples at a temperature that picks the top token all the same), min_p up to 1, an empty regex or
    json_schema is no constraint."""
    greedy = post(gen, {"text": "the quick", "sampling_params": {"max_new_tokens": 5, "temperature": 0,
                                                                 "ignore_eos": True}}).json()["text"]
    for extra in ({"temperature": 1e-7}, {"temperature": 5e-6}, {"temperature": 0.7, "min_p": 1.0}, {"temperature": 0, "regex": ""},
                  {"temperature": 0, "json_schema": ""}):
        r = post(gen, {"text": "the quick", "sampling_params": {"max_new_tokens": 5, "ignore_eos": True, **extra}})
        assert r.status_code == 200 and r.json()["text"] == greedy, (extra, r.text)


def test_sampling_params_logit_bias_as_sglang_takes_it(gen, gen_engine):
    """SGLang's `sampling_params.logit_bias` (token id strings -> bias): the engine's answer in-process; errors name
    the field under `sampling_params`."""
    ids = gen_engine.tokenizer.encode("the quick brown fox")
    (free,) = gen_engine.generate([ids], SamplingParams(max_new_tokens=4, ignore_eos=True))
    tok = next(t for t in range(3, 300) if t not in free.token_ids)
    (ref,) = gen_engine.generate([ids], SamplingParams(max_new_tokens=4, ignore_eos=True, logit_bias={tok: 100}))
    r = post(gen, {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True,
                                                         "logit_bias": {str(tok): 100}}})
    assert r.status_code == 200 and r.json()["output_ids"] == ref.token_ids == [tok] * 4, r.text
    for bias in ({"tok": 1}, {"5": 200}, {"5": None}, {str(10**9): 1}):
        r = post(gen, {"input_ids": ids, "sampling_params": {"logit_bias": bias}})
        assert r.status_code == 400 and r.json()["error"]["field"] == "sampling_params.logit_bias", (bias, r.text)


def test_sampling_params_min_new_tokens_holds_off_the_stop(gen, gen_engine):
    """SGLang's `min_new_tokens`: EOS forced by a bias comes only after that many tokens, as in-process; more than
    `max_new_tokens`, or beside a constraint, is a 400 naming it."""
    ids = gen_engine.tokenizer.encode("the quick brown fox")
    eos = min(gen_engine.eos_ids)
    (ref,) = gen_engine.generate([ids], SamplingParams(max_new_tokens=9, min_new_tokens=3, logit_bias={eos: 100},
                                                       trim_stop_token=True))
    assert len(ref.token_ids) == 4 and ref.token_ids[-1] == eos
    sp = {"max_new_tokens": 9, "temperature": 0, "min_new_tokens": 3, "logit_bias": {str(eos): 100}}
    r = post(gen, {"input_ids": ids, "sampling_params": sp}).json()
    assert r["output_ids"] == ref.token_ids and r["text"] == ref.text and r["meta_info"]["finish_reason"]["type"] == "stop"
    assert post(gen, {"input_ids": ids, "sampling_params": {**sp, "min_new_tokens": 0}}).json()["output_ids"] == [eos]
    for bad in ({"min_new_tokens": 5, "max_new_tokens": 4}, {"min_new_tokens": -1}, {"min_new_tokens": 2, "regex": "a+"}):
        r = post(gen, {"input_ids": ids, "sampling_params": bad})
        assert r.status_code == 400 and r.json()["error"]["field"] == "sampling_params.min_new_tokens", (bad, r.text)


def test_max_new_tokens_zero_caches_the_prefix(gen):
    prefix = "a radix tree finds the longest cached prefix of every prompt and " * 2
    r = post(gen, {"text": prefix, "sampling_params": {"max_new_tokens": 0}}).json()
    assert r["text"] == "" and r["output_ids"] == [] and r["meta_info"]["finish_reason"]["type"] == "length"
    n = r["meta_info"]["prompt_tokens"]
    later = post(gen, {"text": prefix + "the quick", "sampling_params": {"max_new_tokens": 1}}).json()
    assert later["meta_info"]["cached_tokens"] >= 4 * ((n - 1) // 4)


def hf_logprobs(folder: Path, ids: list[int]):
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


@pytest.mark.parametrize("start", [0, 3])
def test_prompt_logprobs_match_a_transformers_forward(gen, gen_engine, tiny_llama, start):
    ids = gen_engine.tokenizer.encode("numbers 0 1 2 3 4 5 6 7 8 9 and symbols")
    post(gen, {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}})  # cached: scoring must recompute
    r = post(gen, {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0},
                   "return_logprob": True, "logprob_start_len": start, "top_logprobs_num": 2,
                   "return_text_in_logprobs": True}).json()
    meta = r["meta_info"]
    ref = hf_logprobs(tiny_llama, ids + r["output_ids"])
    inputs = meta["input_token_logprobs"]
    assert [e[1] for e in inputs] == ids[start:] and inputs[0][0] is None  # SGLang: the first is None
    for k, (logprob, token, text) in enumerate(inputs[1:], start=start + 1):
        assert math.isclose(logprob, float(ref[k - 1, token]), abs_tol=1e-4)
        assert text == gen_engine.tokenizer.decode([token], skip_special_tokens=False)
    outs = meta["output_token_logprobs"]
    for k, (logprob, token, _) in enumerate(outs, start=len(ids)):
        assert math.isclose(logprob, float(ref[k - 1, token]), abs_tol=1e-4)
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"]) == len(inputs)
    top = meta["output_top_logprobs"][0]
    assert len(top) == 2 and top[0][1] == outs[0][1]  # greedy: the chosen token is the most likely


def test_model_info_server_info_flush_health(gen):
    info = requests.get(gen.url + "/get_model_info", timeout=10).json()
    assert info["is_generation"] is True and info["served_model_name"] == "tiny-llama"
    assert Path(info["model_path"]).name.startswith("tiny-llama")
    server = requests.get(gen.url + "/server_info", timeout=10).json()
    assert server["engine"]["block_size"] == 4 and "prefill_skip_ratio" in server["internal_states"][0]
    post(gen, {"text": "the lazy dog jumps over the quick brown fox", "sampling_params": {"max_new_tokens": 0}})
    flushed = requests.post(gen.url + "/flush_cache", timeout=10)
    assert flushed.status_code == 200 and flushed.json()["flushed_blocks"] >= 1
    assert requests.get(gen.url + "/stats", timeout=10).json()["generation"]["cached_blocks"] == 0
    assert requests.get(gen.url + "/health_generate", timeout=30).status_code == 200


def test_sglang_frontend_runs_gen_and_select_unchanged(gen, gen_engine, tiny_llama):
    if not SGL_PYTHON.exists():
        pytest.skip("no .sglvenv (SGLang's frontend); make it with the recipe in docs/serving.md")
    question, choices = "what does the quick fox do", ["jumps over the lazy dog", "a radix tree", "hello world"]
    proc = subprocess.run([str(SGL_PYTHON), str(Path(__file__).with_name("sglang") / "program.py"), gen.url,
                           question, json.dumps(choices)], capture_output=True, text=True, timeout=300, cwd="/tmp")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    # gen: the same greedy answer /generate gives for the same text and stop
    prefix = f"Question: {question}\nAnswer: "
    ref = post(gen, {"text": prefix, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "stop": ["\n"]}}).json()
    assert got["answer"] == ref["text"]
    # select: the choice with the best mean log-probability, computed here with transformers
    before = f"{prefix}{got['answer']}\nPick: "
    tok = gen_engine.tokenizer
    start = max(len(tok.encode(before)) - 2, 0)
    scores = []
    for choice in choices:
        ids = tok.encode(before + choice)
        ref_lp = hf_logprobs(tiny_llama, ids)
        values = [float(ref_lp[k - 1, ids[k]]) for k in range(start + 1, len(ids))]  # SGLang: first is None
        scores.append(sum(values) / len(values))
    assert all(math.isclose(a, b, abs_tol=1e-3) for a, b in zip(got["normalized"], scores))
    assert got["pick"] == choices[max(range(len(choices)), key=scores.__getitem__)]


@pytest.fixture
def narrow(tmp_path, long_llama):
    """A server whose steps are small (8 tokens): a long prompt's prefill takes hundreds of steps; its pool
    (2,100 blocks of 4) holds two such prompts, and pins can fill it."""
    proc = ServerProcess(tmp_path / "narrow.log", [
        "--generate-only", "--generate-model", str(long_llama), "--generate-name", "tiny-llama",
        "--generate-block-size", "4", "--generate-num-blocks", "2100", "--generate-torch-threads", "1",
        "--generate-max-num-batched-tokens", "8", "--generate-health-timeout-s", "0.3",
        "--generate-max-pinned-fraction", "1"])  # pins may fill the pool here (the default stops them at half)
    yield proc.running()
    proc.stop()


def test_health_generate_tells_a_busy_engine_from_a_stuck_or_full_one(narrow):
    """A long prefill holds every step's budget, so the probe's token waits past its timeout; steps still end,
    so the engine is busy, not unhealthy (it was a 503 "no token", and a liveness probe restarted a working
    server). A pool that pins fill is a 503 that says so."""
    answers: list = []

    def long_prompt(k: int) -> None:  # 500 steps of 8 tokens each
        answers.append(requests.post(narrow.url + "/generate", timeout=120, json={
            "input_ids": [5 + (i * k) % 200 for i in range(4000)], "sampling_params": {"max_new_tokens": 1}}))

    workers = [threading.Thread(target=long_prompt, args=(k,)) for k in (1, 3)]
    for worker in workers:  # one prefilling, one waiting ahead of the probe (first come, first served)
        worker.start()
    for _ in range(200):
        stats = requests.get(narrow.url + "/stats", timeout=10).json()["generation"]
        if stats["running_requests"] + stats["waiting_requests"] == 2:
            break
        time.sleep(0.01)
    started = time.monotonic()
    r = requests.get(narrow.url + "/health_generate", timeout=30)
    busy = workers[1].is_alive()  # the prefills outlasted the probe's 0.3 s: the probe had to judge by steps
    for worker in workers:
        worker.join(120)
    assert [a.status_code for a in answers] == [200, 200]
    assert r.status_code == 200, r.text
    assert r.json()["status"] == ("busy" if busy else "ok") and time.monotonic() - started < 10
    assert busy, "the prefill ended before the probe's timeout: the test proves nothing on this machine"
    assert requests.get(narrow.url + "/health_generate", timeout=30).json()["status"] == "ok"  # idle again

    pins = []
    for i in range(30):  # 100 blocks each, till the pool is full
        p = requests.post(narrow.url + "/v1/pins", json={"input_ids": [5 + (j * (i + 7)) % 200 for j in range(400)]},
                          timeout=30)
        if p.status_code != 200:
            assert p.status_code == 507, p.text
            break
        pins.append(p.json()["id"])
    r = requests.get(narrow.url + "/health_generate", timeout=30)
    assert r.status_code == 503 and r.json()["error"]["type"] == "unhealthy"
    assert "pin" in r.json()["error"]["message"], r.text  # the cause, not "no token within"
    for pin in pins:
        requests.delete(narrow.url + f"/v1/pins/{pin}", timeout=30)
    assert requests.get(narrow.url + "/health_generate", timeout=30).json()["status"] == "ok"
