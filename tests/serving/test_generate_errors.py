"""Bad input of every kind gets a 4xx naming the field (OpenAI's shape on /v1/*, the server's own on SGLang's
routes), limits answer 503/504 as documented, and the server stays up through all of it."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import requests
from serving_support import GEN_ENGINE_FLAGS, LONG_LLAMA_BLOCKS, ServerProcess

JSON = {"Content-Type": "application/json"}  # a POST body must say it is JSON (415 otherwise)

MSG = [{"role": "user", "content": "hello"}]
LONG = "the quick brown fox jumps over the lazy dog " * 8  # over the tight server's 40 prompt tokens

CHAT_CASES = [
    ({"messages": MSG, "tools": [{"type": "function"}], "tool_choice": "required"}, "tools[0].function"),
    ({"messages": MSG, "tool_choice": "auto"}, "tool_choice"),
    ({"messages": MSG, "store": True}, "store"),
    ({"messages": MSG, "logit_bias": {"five": 1}}, "logit_bias"),
    ({"messages": MSG, "logit_bias": {"5": 101}}, "logit_bias"),
    ({"messages": MSG, "logit_bias": {"1000000000": 1}}, "logit_bias"),
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "hi", "name": 5}]}, "messages[0].name"),
    ({"messages": MSG, "stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"messages": MSG, "top_p": 0}, "top_p"),
    ({"messages": MSG, "temperature": "hot"}, "temperature"),
    ({"messages": MSG, "presence_penalty": 3}, "presence_penalty"),
    ({"messages": MSG, "max_tokens": 8001}, "max_tokens"),
    ({"messages": MSG, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": MSG, "n": 3}, "n"),
    ({"messages": MSG, "seed": 1.5}, "seed"),
    ({"messages": MSG, "stop": ["ok", 3]}, "stop"),
    ({"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": MSG, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": MSG, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": MSG, "response_format": {"type": "xml"}}, "response_format.type"),
    ({"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "no"}}},
     "response_format.json_schema.schema"),
    ({"messages": [{"role": "user", "content": LONG}]}, "messages"),
]
COMPLETION_CASES = [
    ({}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [10**6]}, "prompt"),
    ({"prompt": ["fine", LONG]}, "prompt[1]"),
    ({"prompt": ["a", 5]}, "prompt"),
    ({"prompt": "a", "suffix": "b"}, "suffix"),
    ({"prompt": "a", "logprobs": 21}, "logprobs"),
    ({"prompt": "a", "echo": True, "logprobs": 1, "stream": True}, "echo"),
    ({"prompt": "a", "best_of": 3}, "best_of"),
]
GENERATE_CASES = [
    ({}, "text"),
    ({"text": "a", "input_ids": [1]}, "text"),
    ({"text": ""}, "text"),
    ({"input_ids": [[]]}, "input_ids"),
    ({"text": "a", "sampling_params": "greedy"}, "sampling_params"),
    ({"text": "a", "sampling_params": {"top_p": 2}}, "sampling_params.top_p"),
    ({"text": "a", "sampling_params": {"min_new_tokens": 3, "max_new_tokens": 2}}, "sampling_params.min_new_tokens"),
    ({"text": "a", "sampling_params": {"max_new_tokens": 8001}}, "sampling_params.max_new_tokens"),
    ({"text": "a", "sampling_params": {"stop_regex": ["x+"]}}, "sampling_params.stop_regex"),
    ({"text": "a", "sampling_params": {"frobnicate": 1}}, "sampling_params.frobnicate"),
    ({"text": "a", "sampling_params": {"stop_token_ids": [10**9]}}, "sampling_params.stop_token_ids"),
    ({"text": "a", "return_logprob": True, "logprob_start_len": 99}, "logprob_start_len"),
    ({"text": "a", "image_data": "x"}, "image_data"),
    ({"text": LONG}, "text"),
]


def openai_error(r, status: int, param: str | None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == param and body["error"]["message"]
    if code:
        assert body["error"]["code"] == code
    return body["error"]


@pytest.mark.parametrize("body,param", CHAT_CASES, ids=[p for _, p in CHAT_CASES])
def test_chat_errors_name_the_param(tight, body, param):
    error = openai_error(requests.post(tight.url + "/v1/chat/completions", json=body, timeout=30), 400, param)
    assert error["type"] == "invalid_request_error"
    # the field is named once, by the name the client sent, not the engine's (SamplingParams.top_p)
    assert error["message"].startswith(param) and not error["message"].startswith(f"{param}: {param}")
    assert "SamplingParams" not in error["message"], error["message"]


def test_chat_takes_defaults_that_ask_for_nothing(tight):
    """Clients that send OpenAI's no-op values explicitly (no tool call, nothing stored) are served, and so is
    a participant's `name`."""
    body = {"messages": [{"role": "user", "content": "hello", "name": "bob"}], "max_tokens": 2,
            "tool_choice": "none", "store": False}
    r = requests.post(tight.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize("body,param", COMPLETION_CASES, ids=[p for _, p in COMPLETION_CASES])
def test_completion_errors_name_the_param(tight, body, param):
    openai_error(requests.post(tight.url + "/v1/completions", json=body, timeout=30), 400, param)


@pytest.mark.parametrize("body,field", GENERATE_CASES, ids=[f for _, f in GENERATE_CASES])
def test_generate_errors_name_the_field(tight, body, field):
    r = requests.post(tight.url + "/generate", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert set(r.json()) == {"error", "request_id"} and r.json()["error"]["field"] == field
    assert "SamplingParams" not in r.json()["error"]["message"], r.json()["error"]["message"]


def test_protocol_errors_in_each_dialect(tight):
    openai_error(requests.post(tight.url + "/v1/chat/completions", data=b"{nope", headers=JSON, timeout=30), 400, None, "invalid_json")
    openai_error(requests.get(tight.url + "/v1/chat/completions", timeout=30), 405, None, "method_not_allowed")
    openai_error(requests.post(tight.url + "/v1/chat/completions", json={"model": "gpt-4", "messages": MSG},
                               timeout=30), 404, "model", "model_not_found")
    openai_error(requests.post(tight.url + "/v1/pins", json={}, timeout=30), 400, "text")
    openai_error(requests.delete(tight.url + "/v1/pins/pin-404", timeout=30), 404, "pin")
    r = requests.post(tight.url + "/generate", data=b"[", headers=JSON, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_json"
    assert requests.post(tight.url + "/decide", json={"state": "x"}, timeout=30).status_code == 404  # generation only


def test_more_sequences_than_the_queue_holds_is_400_not_a_503_to_retry(tight):
    """The tight server's queue holds 1: n=2 could never be admitted, however long a client waited (a queue
    that is merely full now is 503 with Retry-After: generation/engine_loop's QueueFull)."""
    r = requests.post(tight.url + "/v1/chat/completions", json={"messages": MSG, "n": 2, "max_tokens": 2}, timeout=30)
    error = openai_error(r, 400, "n", "invalid_request")
    assert "--generate-max-waiting" in error["message"] and "Retry-After" not in r.headers
    r = requests.post(tight.url + "/generate", json={"text": ["a", "b"], "sampling_params": {"max_new_tokens": 1}},
                      timeout=30)
    assert r.status_code == 400 and r.json()["error"]["field"] == "text", r.text


def test_deadline_ends_answers_and_streams(tight):
    body = {"messages": MSG, "max_tokens": 8000, "temperature": 0, "ignore_eos": True}
    openai_error(requests.post(tight.url + "/v1/chat/completions", json=body, timeout=60), 504, None, "timeout")
    with requests.post(tight.url + "/v1/chat/completions", json={**body, "stream": True}, stream=True, timeout=60) as r:
        lines = [line for line in r.iter_lines(decode_unicode=True) if line]
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][len("data: "):])
    assert last["error"]["code"] == "timeout"
    r = requests.post(tight.url + "/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 8000,
                                                                                      "ignore_eos": True}}, timeout=60)
    assert r.status_code == 504 and r.json()["error"]["type"] == "timeout"
    # the Responses API: a 504 outside a stream; inside one an error event, then response.failed, and no [DONE]
    body = {"input": MSG[-1]["content"], "max_output_tokens": 8000, "temperature": 0, "ignore_eos": True}
    openai_error(requests.post(tight.url + "/v1/responses", json=body, timeout=60), 504, None, "timeout")
    with requests.post(tight.url + "/v1/responses", json={**body, "stream": True}, stream=True, timeout=60) as r:
        events = [json.loads(line[len("data: "):]) for line in r.iter_lines(decode_unicode=True)
                  if line.startswith("data: ")]
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"] and events[-2]["code"] == "timeout"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"  # OpenAI's codes have no timeout
    assert failed["error"]["message"].startswith("timeout: ")
    streamed = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert streamed and failed["output"][0]["content"][0]["text"] == streamed  # what it streamed, kept
    assert failed["output"][0]["status"] == "incomplete"


def test_every_choice_past_the_deadline_is_counted_as_one(long_llama, tmp_path):
    """A stream of n=4 past the deadline: the choices end in the same engine step and /stats counts four deadlines. Before,
    the request stopped at the first failed choice and counted the other three as aborts."""
    server = ServerProcess(tmp_path / "serve.log", [
        "--generate-model", str(long_llama), "--generate-name", "tiny-llama", "--generate-only", *GEN_ENGINE_FLAGS,
        *LONG_LLAMA_BLOCKS, "--generate-max-new-tokens", "8000", "--generate-deadline-s", "1"]).running()
    try:
        body = {"messages": MSG, "max_tokens": 8000, "temperature": 0, "ignore_eos": True, "n": 4, "stream": True}
        with requests.post(server.url + "/v1/chat/completions", json=body, stream=True, timeout=60) as r:
            lines = [line for line in r.iter_lines(decode_unicode=True) if line]
        assert json.loads(lines[-2][len("data: "):])["error"]["code"] == "timeout"
        finished = requests.get(server.url + "/stats", timeout=10).json()["generation"]["finished"]
        assert finished == {"chat": {"deadline": 4}}, finished
    finally:
        server.stop()


def test_thread_budget_refuses_a_third_stream_and_frees_up(tight):
    """Two streams hold the tight server's 2 generation threads until their 2 s deadline; a third request
    meanwhile gets 503 at once. (Under heavy load the two may not both be open in time: then try again.)"""
    body = {"messages": MSG, "max_tokens": 8000, "temperature": 0, "ignore_eos": True, "stream": True}

    def hold(started: threading.Event, statuses: list[int]) -> None:
        with requests.post(tight.url + "/v1/chat/completions", json=body, stream=True, timeout=60) as r:
            if r.status_code != 200:  # say why it was refused
                statuses.append((r.status_code, r.text))
                started.set()
                return
            statuses.append(r.status_code)
            lines = (line for line in r.iter_lines(decode_unicode=True) if line)
            # Two events: the first (the role) can go out before the engine takes the request off its queue, and a
            # second holder sent then met --generate-max-waiting 1 instead (seen on a loaded CI run)
            next(lines), next(lines)
            started.set()
            for _ in lines:  # read to the end (the deadline ends it)
                pass

    for _attempt in range(3):
        t0 = time.monotonic()
        holders, statuses = [], []
        for _ in range(2):
            started = threading.Event()
            holders.append(threading.Thread(target=hold, args=(started, statuses)))
            holders[-1].start()
            assert started.wait(30)
        r = requests.post(tight.url + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 1}, timeout=30)
        in_time = time.monotonic() - t0 < 1.5  # both holders were surely still streaming
        for t in holders:
            t.join(60)
        assert statuses == [200, 200], "a holder was refused: a finished stream still held its thread slot"
        if in_time:
            break
    assert in_time, "could not open two streams within 1.5 s"
    error = openai_error(r, 503, None, "overloaded")
    assert "request threads" in error["message"] and r.headers["Retry-After"] == "1"
    assert requests.post(tight.url + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 1},
                         timeout=30).status_code == 200


def test_the_server_stays_up(tight):
    assert requests.get(tight.url + "/health", timeout=10).status_code == 200
    r = requests.post(tight.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 3}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3


def test_a_long_prompt_names_the_flag_that_limits_it(tight, gen):
    r = requests.post(tight.url + "/v1/completions", json={"prompt": LONG}, timeout=30)
    assert "(--generate-max-prompt-tokens)" in openai_error(r, 400, "prompt")["message"]
    r = requests.post(gen.url + "/v1/completions", json={"prompt": [5] * 1024}, timeout=30)  # 1,024 positions
    message = openai_error(r, 400, "prompt")["message"]
    assert "at most 1023" in message and "--generate-max-model-len" in message, message


def raw_answer(server, request: bytes) -> tuple[int, dict]:
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)


def test_the_http_fronts_refusals_on_v1_are_in_openais_shape_too(tight):
    """An oversized body or header block is refused before the app sees the request; on /v1/* it still answers
    in the shape an OpenAI client parses, and elsewhere in the server's own."""
    big_body = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 5242880\r\n\r\n{")
    big_head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n"
    for request, status, code in ((big_body, 413, "payload_too_large"), (big_head, 431, "headers_too_large")):
        got, body = raw_answer(tight, request)
        assert got == status and set(body) == {"error"}, body
        assert body["error"]["code"] == code and body["error"]["param"] is None and body["error"]["message"]
    got, body = raw_answer(tight, big_body.replace(b"/v1/chat/completions", b"/generate"))
    assert got == 413 and body["error"]["type"] == "payload_too_large" and "request_id" in body


def test_pins_that_fill_the_pool_make_requests_507_not_500(tmp_path, tiny_llama):
    """Pins hold KV for good: once they leave a request no room, it is told so (507, naming the pins), as a pin
    the pool cannot hold is, and not answered as a model failure; releasing them gives the room back. Pins may
    fill the pool here (`--generate-max-pinned-fraction 1`); by default they stop at half of it."""
    from serving_support import ServerProcess

    proc = ServerProcess(tmp_path / "pins.log", ["--generate-only", "--generate-model", str(tiny_llama),
                                                 "--generate-block-size", "4", "--generate-num-blocks", "24",
                                                 "--generate-torch-threads", "1", "--generate-max-pinned-fraction", "1"])
    server = proc.running()
    try:
        pins = []
        while True:
            r = requests.post(server.url + "/v1/pins", json={"text": f"pin number {len(pins)} holds this"}, timeout=30)
            if r.status_code != 200:
                break
            pins.append(r.json()["id"])
        assert r.status_code == 507 and pins, r.text
        body = {"messages": MSG, "max_tokens": 8, "ignore_eos": True}
        error = openai_error(requests.post(server.url + "/v1/chat/completions", json=body, timeout=30), 507, None,
                             "insufficient_storage")
        assert "pins hold" in error["message"], error
        r = requests.post(server.url + "/generate", json={"text": "hello", "sampling_params": {
            "max_new_tokens": 8, "ignore_eos": True}}, timeout=30)
        assert r.status_code == 507 and r.json()["error"]["type"] == "insufficient_storage", r.text
        for pin in pins:
            assert requests.delete(server.url + f"/v1/pins/{pin}", timeout=30).status_code == 200
        assert requests.post(server.url + "/v1/chat/completions", json=body, timeout=30).status_code == 200
    finally:
        proc.stop()


def test_a_v1_route_not_served_answers_in_openais_shape_and_systemone_keeps_its_own(gen):
    """An SDK's call to a route this server lacks (`/v1/embeddings`) got the core's error shape; the decision API's
    `/v1/systemone` beside it keeps laya-serve's (the longest prefix owns a path)."""
    r = requests.post(gen.url + "/v1/embeddings", json={"model": "tiny-llama", "input": "hi"}, timeout=30)
    assert r.status_code == 404 and set(r.json()) == {"error"}, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"} and r.json()["error"]["code"] == "not_found"
    r = requests.post(gen.url + "/v1/systemone", json={"state": "hi"}, timeout=30)
    assert r.status_code == 422 and "detail" in r.json() and "param" not in r.json()["error"], r.text
