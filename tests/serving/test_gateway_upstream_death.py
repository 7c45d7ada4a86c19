"""The gateway's promise when an upstream dies in the middle of a streamed answer, on the real model: a
`pagoda serve` process with the embedded SmolLM2-135M-Instruct behind a `pagoda gateway` process, three
clients streaming long answers through it at once (the `openai` SDK and raw bytes on the chat route,
raw bytes on SGLang's `/generate`), and the upstream's whole process group SIGKILLed once each client
holds its first events and the upstream is seen still generating all three. Each client must get every
complete event, then one error event in its route's shape, then `data: [DONE]`, and its stream must end
(no hang); the gateway must stay up, answer the next requests with a 502 JSON body naming the upstream,
and take the upstream back when it returns. `test_gateway.py` checks the same on the tiny random Llama;
this is the same promise where the answers are the real model's and long only because `ignore_eos` asks.
Slow: the GGUF is dequantised once per upstream start (twice here)."""

from __future__ import annotations

import json
import time

import openai
import pytest
import requests
from serving_support import free_port
from test_gateway import Proc, metric, until

pytestmark = pytest.mark.slow

STORY = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
LONG = 1500          # tokens: tens of seconds on any CPU, so the kill always comes mid-answer
BEFORE_KILL = 3      # events each raw client reads before the kill
AFTER_KILL_S = 5.0   # how long a client may wait, after the kill, for its stream to end


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """The upstream (on a fixed port, so a restart is the same URL) and a gateway with quick health checks."""
    logs = tmp_path_factory.mktemp("upstream-death")
    up = Proc(logs / "smol.log", "serve", ["--generate-only", "--generate-model", "default",
                                           "--generate-torch-threads", "1", "--no-access-log"], port=free_port())
    gw = Proc(logs / "gateway.log", "gateway", ["--upstream", f"smol={up.url}", "--no-access-log",
                                                "--health-interval-s", "0.2", "--health-timeout-s", "0.5"])
    up.running(timeout=300)
    gw.running()
    until(lambda: requests.get(gw.url + "/health", timeout=5).json()["upstreams"][0]["up"], 30, "the upstream up")
    yield up, gw
    gw.stop()
    up.stop()


class Events:
    """A streamed answer read as raw SSE events (the bytes between blank lines), chunk by chunk as they come."""

    def __init__(self, response: requests.Response):
        self.response = response
        self.chunks = response.iter_content(chunk_size=None)
        self.buffer = b""

    def take(self, n: int) -> list[bytes]:
        while self.buffer.count(b"\n\n") < n:
            self.buffer += next(self.chunks)
        *events, self.buffer = self.buffer.split(b"\n\n", n)
        return events

    def rest(self) -> list[bytes]:
        """Every event to the end of the stream; the stream must end (the read timeout bounds each wait)."""
        for chunk in self.chunks:
            self.buffer += chunk
        assert self.buffer.endswith(b"\n\n") or not self.buffer, self.buffer[-200:]  # whole events only
        return [e for e in self.buffer.split(b"\n\n") if e]


def data(event: bytes) -> dict:
    assert event.startswith(b"data: "), event
    return json.loads(event[len(b"data: "):])


def test_an_upstream_sigkilled_mid_answer_ends_each_stream_with_an_error_event(smol):
    up, gw = smol
    sdk = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    stream = sdk.chat.completions.create(model="SmolLM2-135M-Instruct", messages=STORY, max_tokens=LONG,
                                         temperature=0, stream=True, extra_body={"ignore_eos": True})
    sdk_before = [next(stream) for _ in range(BEFORE_KILL)]
    chat_r = requests.post(gw.url + "/v1/chat/completions", stream=True, timeout=30, json={
        "messages": STORY, "max_tokens": LONG, "temperature": 0, "stream": True, "ignore_eos": True})
    native_r = requests.post(gw.url + "/generate", stream=True, timeout=30, json={
        "text": "Once upon a time", "stream": True,
        "sampling_params": {"max_new_tokens": LONG, "temperature": 0, "ignore_eos": True}})
    responses_r = requests.post(gw.url + "/v1/responses", stream=True, timeout=30, json={
        "input": "Tell me a story.", "max_output_tokens": LONG, "temperature": 0, "stream": True, "ignore_eos": True})
    assert chat_r.status_code == native_r.status_code == responses_r.status_code == 200
    assert chat_r.headers["X-Pagoda-Upstream"] == native_r.headers["X-Pagoda-Upstream"] == up.url
    chat, native, typed = Events(chat_r), Events(native_r), Events(responses_r)
    chat_before, native_before = chat.take(BEFORE_KILL), native.take(BEFORE_KILL)
    typed_before = typed.take(BEFORE_KILL + 2)  # created, in_progress, item and part added, text deltas
    # All four are mid-answer: the upstream is still generating each (none had its last event).
    assert requests.get(up.url + "/stats", timeout=10).json()["generation"]["running_requests"] == 4
    assert all(c.choices[0].finish_reason is None for c in sdk_before if c.choices)

    up.kill()  # SIGKILL to the upstream's process group (gunicorn's master and its worker)
    killed = time.monotonic()

    # The SDK: the chunks that were already on their way, then APIError from the error event (not a status
    # error: the stream's status was 200), and nothing more.
    late = 0
    with pytest.raises(openai.APIError) as raised:
        for chunk in stream:
            assert chunk.choices[0].finish_reason is None
            late += 1
    assert time.monotonic() - killed < AFTER_KILL_S
    err = raised.value
    assert not isinstance(err, openai.APIStatusError)
    assert err.body == {"message": err.message, "type": "server_error", "param": None, "code": "upstream_reset"}
    assert err.message.startswith(f"upstream smol ({up.url}): the stream broke: ")
    with pytest.raises(StopIteration):
        next(stream)

    # The same on the wire, on the chat route: whole chunks, then OpenAI's error shape, then [DONE].
    chat_after = chat.rest()
    assert time.monotonic() - killed < AFTER_KILL_S
    assert chat_after[-1] == b"data: [DONE]"
    error = data(chat_after[-2])
    assert set(error) == {"error"} and set(error["error"]) == {"message", "type", "param", "code"}
    assert error["error"]["type"] == "server_error" and error["error"]["code"] == "upstream_reset"
    assert f"upstream smol ({up.url}): the stream broke" in error["error"]["message"]
    for event in [*chat_before, *chat_after[:-2]]:
        chunk = data(event)
        assert chunk["object"] == "chat.completion.chunk" and chunk["choices"][0]["finish_reason"] is None

    # SGLang's /generate: its own error shape (the type is the code, the request's id beside it), then [DONE].
    native_after = native.rest()
    assert time.monotonic() - killed < AFTER_KILL_S
    assert native_after[-1] == b"data: [DONE]"
    assert data(native_after[-2]) == {"error": {"message": data(native_after[-2])["error"]["message"],
                                                "type": "upstream_reset", "field": None},
                                      "request_id": native_r.headers["X-Request-ID"]}
    assert f"upstream smol ({up.url}): the stream broke" in data(native_after[-2])["error"]["message"]
    for event in [*native_before, *native_after[:-2]]:
        assert data(event)["meta_info"]["finish_reason"] is None and "text" in data(event)

    # The Responses API: its typed events, then its own `error` event, which ends a stream there (no [DONE]).
    typed_after = typed.rest()
    assert time.monotonic() - killed < AFTER_KILL_S
    *whole, last = [e.split(b"\n", 1) for e in typed_before + typed_after]
    assert last[0] == b"event: error"
    assert data(last[1]) == {"type": "error", "code": "upstream_reset", "param": None,
                             "message": data(last[1])["message"], "sequence_number": len(whole)}
    assert [data(event)["sequence_number"] for _, event in whole] == list(range(len(whole)))
    assert f"upstream smol ({up.url}): the stream broke" in data(last[1])["message"]
    assert all(name == b"event: " + data(event)["type"].encode() for name, event in whole)
    assert {data(event)["type"] for _, event in whole} >= {"response.created", "response.output_text.delta"}
    assert not any(data(event)["type"] == "response.completed" for _, event in whole)

    # The gateway is still up and answers at once: 502 with a JSON body naming the upstream. The first
    # request may still reach the dying upstream's listening socket (the kernel accepts it, then resets it:
    # `upstream_reset`); once that is gone it is a refused connection (`upstream_unreachable`).
    started = time.monotonic()
    r = requests.post(gw.url + "/v1/chat/completions", json={"messages": STORY, "max_tokens": 2}, timeout=30)
    assert time.monotonic() - started < AFTER_KILL_S
    assert r.status_code == 502 and r.headers["Content-Type"] == "application/json"
    assert r.json()["error"]["code"] in {"upstream_reset", "upstream_unreachable"}, r.text
    assert up.url in r.json()["error"]["message"]

    def refused(path: str, body: dict) -> dict | None:
        """The 502's body when the upstream's connection was refused (None when it was reset)."""
        r = requests.post(gw.url + path, json=body, timeout=30)
        assert r.status_code == 502 and r.headers["Content-Type"] == "application/json", r.text
        kind = r.json()["error"]["code" if path.startswith("/v1/") else "type"]
        return {**r.json(), "X-Request-ID": r.headers["X-Request-ID"]} if kind == "upstream_unreachable" else None

    until(lambda: refused("/v1/chat/completions", {"messages": STORY, "max_tokens": 2}), 10, "connection refused")
    # a streamed request to a dead upstream is a 502 too (no stream began), and /generate in SGLang's shape
    assert refused("/v1/chat/completions", {"messages": STORY, "max_tokens": 2, "stream": True})
    body = refused("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}, "stream": True})
    assert body is not None and body["request_id"] == body["X-Request-ID"]
    assert requests.get(gw.url + "/health", timeout=5).status_code == 200
    assert metric(gw, "pagoda_gateway_upstream_errors_total", upstream=up.url, kind="reset") >= 4
    assert metric(gw, "pagoda_gateway_upstream_in_flight", upstream=up.url) == 0  # no relay left holding on

    # The upstream comes back on the same port: the gateway takes it back and a whole stream goes through.
    up.start()
    up.running(timeout=300)
    until(lambda: requests.get(gw.url + "/health", timeout=5).json()["upstreams"][0]["up"], 30, "the upstream back")
    whole = Events(requests.post(gw.url + "/v1/chat/completions", stream=True, timeout=60, json={
        "messages": STORY, "max_tokens": 8, "temperature": 0, "stream": True, "ignore_eos": True})).rest()
    assert whole[-1] == b"data: [DONE]" and data(whole[-2])["choices"][0]["finish_reason"] == "length"
