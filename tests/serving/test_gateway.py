"""`pagoda gateway` as a real process in front of two real `pagoda serve` generation servers on loopback
(tiny random Llamas), driven by real clients (the `openai` SDK, requests, raw sockets): pass-through is
byte-identical to calling the upstream directly, streams are forwarded as they arrive, failures are
answered (502 / 504 / an SSE error event) while the other upstream keeps answering, health checks take
an upstream out and put it back, routing rules over Laya's answers pick the upstream and say so, and 64
concurrent streams come back whole and unmixed. Every wait is bounded in count and time."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import openai
import pytest
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families
from serving_support import GEN_ENGINE_FLAGS, LONG_LLAMA_BLOCKS, REPO, TINY_BERT, ServerProcess, free_port

CHAT = [{"role": "system", "content": "the quick brown fox"}, {"role": "user", "content": "a radix tree finds"}]
# What an upstream makes fresh for every request (ids, timestamps, timings): masked before comparing bytes.
FRESH = [(re.compile(rb'"(id|item_id|call_id)":"[^"]*"'), rb'"\1":"-"'),
         (re.compile(rb'"(created|created_at|completed_at)":\d+'), rb'"\1":0'),
         (re.compile(rb'"e2e_latency":[0-9.e-]+'), b'"e2e_latency":0')]


class Proc(ServerProcess):
    """A `pagoda serve` or `pagoda gateway` process in a session of its own (so a kill takes gunicorn's
    workers with its master), optionally on a fixed port (so a restarted upstream is the same URL)."""

    def __init__(self, log_path, command: str, flags: list[str], port: int | None = None):
        self.command, self.pinned = command, port
        super().__init__(log_path, flags)

    def start(self) -> None:
        self.port = self.pinned or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "serving.cli", self.command, "--host", "127.0.0.1", "--port", str(self.port),
             *self.flags], cwd=REPO, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True)
        self._ready = False
        self.ready_statuses = []

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._log.close()

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def masked(data: bytes) -> bytes:
    for pattern, mask in FRESH:
        data = pattern.sub(mask, data)
    return data


def until(check, seconds: float, what: str, step: float = 0.1):
    """Poll `check()` until it returns something truthy, for at most `seconds`."""
    deadline = time.monotonic() + seconds
    for _ in range(int(seconds / step) + 1):
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            break
        time.sleep(step)
    pytest.fail(f"not within {seconds}s: {what}")


def upstream_states(gateway) -> dict[str, bool]:
    health = requests.get(gateway.url + "/health", timeout=5).json()
    assert health["status"] == "ok" and set(health) == {"status", "upstreams"}  # the core's field and the gateway's part
    return {u["url"]: u["up"] for u in health["upstreams"]}


def metric(gateway, name: str, **labels: str) -> float:
    """One sample of the gateway's `/metrics` (0 when absent), read with prometheus_client's own parser."""
    text = requests.get(gateway.url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def running(server) -> int:
    return requests.get(server.url + "/stats", timeout=10).json()["generation"]["running_requests"]


# ---- the processes ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def procs(tmp_path_factory, tiny_llama, long_llama):
    """Three upstreams on the tiny Llama (`edge`, `frontier`, and `victim`, which tests kill and restart on
    its port) and the gateways in front of them, all started at once. `edge` runs the 16k-position variant:
    the timeout test needs an answer that takes seconds on any machine (1,000 tokens of the 1k-position
    model came back inside the 0.5 s upstream timeout in half the runs on a Zen 5)."""
    logs = tmp_path_factory.mktemp("gateway-logs")
    llm = ["--generate-only", *GEN_ENGINE_FLAGS, "--no-access-log"]
    model = {"edge": ["--generate-model", str(long_llama), *LONG_LLAMA_BLOCKS]}
    up = {name: Proc(logs / f"{name}.log", "serve", [*llm, *model.get(name, ["--generate-model", str(tiny_llama)]),
                                                     "--generate-name", f"{name}-llama"],
                     port=free_port() if name == "victim" else None) for name in ("edge", "frontier", "victim")}
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    watch = ["--health-interval-s", "0.2", "--health-timeout-s", "0.5", "--health-fails", "2", "--health-passes", "2"]
    gw = {
        # edge is the default; `model: frontier` or `model: victim` names the others
        "plain": Proc(logs / "plain.log", "gateway", ["--upstream", f"edge={up['edge'].url}",
                                                      "--upstream", f"frontier={up['frontier'].url}",
                                                      "--upstream", f"victim={up['victim'].url}", *watch]),
        # a group with a dead member, retried; a short upstream timeout. Health checks are (nearly) off here:
        # two failed checks before the first request would eject the dead member, and no request would meet it
        "retry": Proc(logs / "retry.log", "gateway", ["--upstream", f"pair={dead}", "--upstream",
                                                      f"pair={up['edge'].url}", "--retry",
                                                      "--upstream-timeout-s", "0.5", "--health-interval-s", "3600"]),
    }
    yield {**up, **{f"gw_{k}": v for k, v in gw.items()}, "dead": dead}
    for proc in [*gw.values(), *up.values()]:
        proc.stop()


@pytest.fixture(scope="module")
def edge(procs):
    return procs["edge"].running()


@pytest.fixture(scope="module")
def frontier(procs):
    return procs["frontier"].running()


@pytest.fixture
def victim(procs):
    server = procs["victim"]
    if server.proc.poll() is not None:  # a test killed it: the same port again
        server.start()
    return server.running()


@pytest.fixture(scope="module")
def gateway(procs, edge, frontier):
    gw = procs["gw_plain"].running()
    until(lambda: all(upstream_states(gw).values()) or None, 60, "every upstream up")
    return gw


@pytest.fixture
def client(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def post(url: str, path: str, body: dict, request_id: str, upstream, **kw) -> requests.Response:
    """The same request with the same id, on an upstream with an empty prefix cache (so `cached_tokens` and
    logprobs cannot differ between a direct call and one through the gateway)."""
    assert requests.post(upstream.url + "/flush_cache", timeout=30).status_code == 200
    return requests.post(url + path, json=body, headers={"X-Request-ID": request_id}, timeout=60, **kw)


# ---- pass-through -------------------------------------------------------------------------------------

@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"model": "edge-llama", "messages": CHAT, "max_tokens": 8, "temperature": 0}),
    ("/v1/completions", {"prompt": ["hello world", "the quick"], "max_tokens": 5, "temperature": 0,
                         "logprobs": 2}),
    ("/generate", {"text": "paged attention", "sampling_params": {"max_new_tokens": 6, "temperature": 0},
                   "return_logprob": True}),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
                       "instructions": "be brief", "max_output_tokens": 6, "temperature": 0}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 8, "top_p": 7}),   # the upstream's 400
    ("/v1/responses", {"input": "x", "previous_response_id": "resp_1"}),         # the upstream's 400
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": -1}}),     # SGLang's shape of it
])
def test_non_streamed_answers_are_the_upstreams_bytes(gateway, edge, path, body):
    direct = post(edge.url, path, body, "same-id-1", edge)
    through = post(gateway.url, path, body, "same-id-1", edge)
    assert through.status_code == direct.status_code
    # Byte for byte but for the fields a second answer must change (ids, clocks; `e2e_latency`'s digits vary).
    assert masked(through.content) == masked(direct.content)
    assert through.headers["Content-Type"] == direct.headers["Content-Type"]
    assert through.headers["X-Pagoda-Route"] == "edge" and through.headers["X-Pagoda-Upstream"] == edge.url
    assert through.headers["X-Request-ID"] == "same-id-1"


def test_the_gateway_adds_its_request_id_for_the_upstream(gateway):
    r = requests.post(gateway.url + "/v1/chat/completions", json={"messages": CHAT, "top_p": 7}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"  # the upstream's own answer
    r = requests.post(gateway.url + "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": -1}},
                      timeout=30)
    assert r.status_code == 400 and r.json()["request_id"] == r.headers["X-Request-ID"]  # the id it was sent


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 10, "temperature": 0, "stream": True,
                              "stream_options": {"include_usage": True}, "ignore_eos": True}),
    ("/v1/completions", {"prompt": "hello world", "max_tokens": 6, "temperature": 0, "stream": True, "logprobs": 2}),
    ("/generate", {"text": "the quick", "sampling_params": {"max_new_tokens": 6, "temperature": 0},
                   "stream": True}),
    ("/v1/responses", {"input": "hello world", "max_output_tokens": 6, "temperature": 0, "stream": True}),
])
def test_streamed_events_are_the_upstreams_bytes(gateway, edge, path, body):
    direct = post(edge.url, path, body, "same-id-2", edge, stream=True)
    a = direct.content  # read to its end before the next flush: a running request keeps its blocks cached
    through = post(gateway.url, path, body, "same-id-2", edge, stream=True)
    b = through.content
    assert through.headers["Content-Type"] == direct.headers["Content-Type"] == "text/event-stream; charset=utf-8"
    end = b'"type":"response.incomplete"' if path == "/v1/responses" else b"data: [DONE]\n\n"
    assert masked(b) == masked(a) and end in b[-2000:] and b.count(b"\n\n") > 3


def test_the_openai_sdk_through_the_gateway_equals_it_direct(client, edge):
    direct = openai.OpenAI(base_url=edge.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    kw = dict(model="edge-llama", messages=CHAT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    raw = client.chat.completions.with_raw_response.create(**kw)
    assert raw.headers["x-pagoda-route"] == "edge" and raw.headers["x-pagoda-route-reason"] == "default"
    r, d = raw.parse(), direct.chat.completions.create(**kw)
    assert r.choices[0].message.content == d.choices[0].message.content
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (d.usage.prompt_tokens, 12)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == d.choices[0].message.content
    assert len({c.id for c in chunks}) == 1 and chunks[-1].choices[0].finish_reason == "length"
    models = {m.id: m for m in client.models.list().data}
    assert {"edge-llama", "frontier-llama", "victim-llama"} <= set(models)
    assert models["frontier-llama"].model_extra["groups"] == ["frontier"]


def test_a_stream_is_forwarded_as_it_arrives_and_a_client_that_leaves_ends_it_upstream(gateway, edge):
    body = {"messages": CHAT, "max_tokens": 900, "temperature": 0, "stream": True, "ignore_eos": True}
    with requests.post(gateway.url + "/v1/chat/completions", json=body, stream=True, timeout=60) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        assert first.startswith(b"data: {")
        assert running(edge) >= 1  # the upstream is still generating: nothing waited for the whole answer
    # the client hung up (the response closed its socket): the upstream's request goes within a few tokens
    until(lambda: running(edge) == 0, 30, "the upstream request closed after the client left")
    assert metric(gateway, "pagoda_gateway_client_disconnects_total", group="edge") >= 1


@pytest.mark.parametrize("leave", ["close", "reset"])
def test_a_client_that_leaves_a_whole_answer_ends_it_upstream(gateway, edge, leave):
    """A non-streamed answer writes nothing until its end, so only the front's watch sees the client go; the
    gateway then cuts its upstream socket, and the upstream stops generating (without the cut it ran its three
    4,000-token choices to their end, 12 s on a 2-core Xeon, for nobody)."""
    before = metric(gateway, "pagoda_gateway_client_disconnects_total", group="edge")
    body = json.dumps({"prompt": "hello", "max_tokens": 4000, "n": 3, "ignore_eos": True, "temperature": 0}).encode()
    conn = socket.create_connection(("127.0.0.1", gateway.port), timeout=120)
    conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    until(lambda: running(edge) >= 1, 30, "the upstream generating", step=0.02)
    if leave == "reset":  # RST, as a killed client or a proxy's timeout sends
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()
    left = time.monotonic()
    until(lambda: running(edge) == 0, 30, "the upstream request ended after the client left", step=0.02)
    assert time.monotonic() - left < 3  # the whole answer takes 12 s on a 2-core Xeon
    until(lambda: metric(gateway, "pagoda_gateway_client_disconnects_total", group="edge") == before + 1, 10,
          "the departure counted once")
    assert metric(gateway, "pagoda_gateway_upstream_errors_total", upstream=edge.url, kind="reset") == 0
    # the pool's connections are still good: the next request through the same gateway is answered
    r = requests.post(gateway.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
    assert r.status_code == 200 and r.headers["X-Pagoda-Upstream"] == edge.url


SGLANG_PROGRAM = """
import json, sys
import sglang as sgl

@sgl.function
def program(s):
    s += "the quick brown fox " + sgl.gen("a", max_tokens=6, temperature=0)
    s += " then " + sgl.select("b", choices=["jumps", "a radix tree"])

sgl.set_default_backend(sgl.RuntimeEndpoint(sys.argv[1], chat_template_name="chatml"))
state = program.run()
print(json.dumps({"a": state["a"], "b": state["b"]}))
"""


def test_sglangs_runtime_endpoint_works_through_the_gateway(gateway, edge, tmp_path):
    """RuntimeEndpoint reads /get_model_info before anything else; the gateway answered it 404, so no SGLang
    program could run through it. The default group's upstream answers it, and a program gives what it gives
    against that upstream directly."""
    r = requests.get(gateway.url + "/get_model_info", timeout=30)
    assert r.status_code == 200 and r.headers["X-Pagoda-Route"] == "edge"
    assert r.json() == requests.get(edge.url + "/get_model_info", timeout=30).json()
    python = REPO / ".sglvenv" / "bin" / "python"
    if not python.exists():
        pytest.skip("no .sglvenv (SGLang's frontend); make it with the recipe in docs/serving.md")
    script = tmp_path / "program.py"
    script.write_text(SGLANG_PROGRAM)
    results = []
    for url in (gateway.url, edge.url):
        proc = subprocess.run([str(python), str(script), url], capture_output=True, text=True, timeout=300, cwd="/tmp")
        assert proc.returncode == 0, proc.stderr[-3000:]
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert results[0] == results[1] and results[0]["a"]


def test_a_request_may_name_its_group_and_gets_that_upstreams_model(client):
    raw = client.chat.completions.with_raw_response.create(model="frontier", messages=CHAT, max_tokens=3)
    assert raw.headers["x-pagoda-route"] == "frontier" and raw.headers["x-pagoda-route-reason"] == "explicit"
    assert raw.parse().model == "frontier-llama"  # `model` became the upstream's own id


def test_a_group_named_on_a_server_that_also_decides_gets_its_generation_model(tmp_path, gen):
    """`pagoda serve` with decisions lists its Laya model in /v1/models beside the generation one: naming a
    group must put the generation model's id in the body, not the first listed."""
    gw = Proc(tmp_path / "both.log", "gateway", ["--upstream", f"a={gen.url}", "--upstream",
                                                 f"b={gen.url.replace('127.0.0.1', 'localhost')}",
                                                 "--no-access-log"])
    try:
        gw.running()
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        raw = client.chat.completions.with_raw_response.create(model="b", messages=CHAT, max_tokens=2)
        assert raw.headers["x-pagoda-route"] == "b" and raw.parse().model == "tiny-llama"
    finally:
        gw.stop()


# ---- failures -----------------------------------------------------------------------------------------

def test_an_upstream_killed_mid_stream_ends_it_with_an_error_event(gateway, victim, edge):
    body = {"model": "victim", "messages": CHAT, "max_tokens": 900, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with requests.post(gateway.url + "/v1/chat/completions", json=body, stream=True, timeout=60) as r:
        assert r.headers["X-Pagoda-Upstream"] == victim.url
        events = r.iter_lines()
        seen = [next(e for e in events if e) for _ in range(3)]
        victim.kill()
        killed = time.monotonic()
        rest = [e for e in events if e]
        took = time.monotonic() - killed
    assert took < 1.0, f"the error event came {took:.2f}s after the kill"
    assert rest[-1] == b"data: [DONE]"
    error = json.loads(rest[-2][len(b"data: "):])["error"]
    assert error["code"] == "upstream_reset" and victim.url in error["message"] and "victim" in error["message"]
    assert all(json.loads(e[len(b"data: "):])["object"] == "chat.completion.chunk" for e in [*seen, *rest[:-2]])
    # and the other upstream answers all along
    assert requests.post(gateway.url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2},
                         timeout=30).status_code == 200


def test_an_upstream_that_is_down_gets_502_naming_it_then_is_ejected_and_restored(gateway, procs, edge):
    victim = procs["victim"]
    if victim.proc.poll() is None:
        victim.running().kill()
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    for stream in (False, True):
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(model="victim", messages=CHAT, max_tokens=2, stream=stream)
        assert time.monotonic() - started < 1.0
        assert err.value.status_code == 502
        assert err.value.body["code"] == "upstream_unreachable" and victim.url in err.value.body["message"]
        assert err.value.response.headers["x-pagoda-route"] == "victim"
    assert client.chat.completions.create(model="edge", messages=CHAT, max_tokens=2).model == "edge-llama"
    until(lambda: upstream_states(gateway)[victim.url] is False, 10, "the dead upstream taken out of rotation")
    ready = requests.get(gateway.url + "/ready", timeout=5).json()
    assert {u["url"]: u["up"] for u in ready["upstreams"]}[victim.url] is False
    assert metric(gateway, "pagoda_gateway_upstream_healthy", upstream=victim.url) == 0
    assert metric(gateway, "pagoda_gateway_upstream_errors_total", upstream=victim.url, kind="connect") >= 2
    victim.start()  # the same port
    victim.running()
    until(lambda: upstream_states(gateway)[victim.url], 10, "the restarted upstream back in rotation")
    assert client.chat.completions.create(model="victim", messages=CHAT, max_tokens=2).model == "victim-llama"


def test_a_dead_replica_is_retried_on_the_other_and_a_timeout_is_504(procs, edge):
    gw = procs["gw_retry"].running()
    for _ in range(4):  # members are taken in turn: the dead one comes first about every other request
        r = requests.post(gw.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200 and r.headers["X-Pagoda-Upstream"] == edge.url
    started = time.monotonic()
    r = requests.post(gw.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 4000, "ignore_eos": True,
                                                        "temperature": 0}, timeout=30)
    assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"
    assert edge.url in r.json()["error"]["message"] and time.monotonic() - started < 10
    assert metric(gw, "pagoda_gateway_upstream_errors_total", upstream=procs["dead"], kind="connect") >= 1
    assert metric(gw, "pagoda_gateway_upstream_errors_total", upstream=edge.url, kind="timeout") == 1


NUMBERED = b"".join(b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"a",'
                    b'"sequence_number":%d}\n\n' % i for i in range(4))
WHOLE_EVENT = (b'data: {"id":"c","object":"text_completion","created":1,"model":"m","choices":[{"index":0,'
               b'"text":"hi","logprobs":null,"finish_reason":null}]}\n\n')


def trickle(conn: socket.socket) -> None:
    """A whole answer with a length, a byte every 0.2 s: each read gets a byte in time, the answer never does."""
    try:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 40\r\n\r\n")
        for _ in range(40):
            conn.sendall(b" ")
            time.sleep(0.2)
    except OSError:
        pass  # the gateway gave up and closed


@contextlib.contextmanager
def raw_upstream(reply: Callable[[socket.socket, bytes], None]) -> Iterator[int]:
    """A socket-level upstream on loopback for the misbehaviours no real server shows: each connection's whole
    request (head and body, which may come in separate reads) goes to `reply` on a thread of its own, and a
    health check (`GET`) is answered 200. Yields its port."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    stop = threading.Event()

    def handle(conn: socket.socket) -> None:
        with conn:
            data = conn.recv(65536)
            if data.startswith(b"GET"):
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                return
            while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < int(
                    re.search(rb"Content-Length: (\d+)", data, re.I).group(1)):
                data += conn.recv(65536)
            reply(conn, data)

    def serve() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()


def test_invalid_answers_and_resets_are_502_naming_the_upstream(tmp_path):
    """Upstreams that misbehave at the socket level: not HTTP, closing without an answer, a body short of its
    length, a stream that breaks in the middle of an event, a stream with a chunk that is not one, an answer
    that trickles in past the upstream timeout."""
    replies = {"garbage": b"SPEAKING NO HTTP\r\n\r\n", "close": b"",
               "short": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"a\"",
               # one whole event, then half of the next, then the connection closes
               "broken": b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                         + b"%X\r\n%s\r\n" % (len(WHOLE_EVENT), WHOLE_EVENT) + b"9\r\ndata: {\"i\r\n",
               "badchunk": b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                           b"\r\nZZZ\r\nhello\r\n",
               "trickle": trickle,
               # the Responses API's numbered events in one chunk, a keep-alive comment alone, then the end
               "numbered": b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                           + b"%X\r\n%s\r\n" % (len(NUMBERED), NUMBERED) + b"E\r\n: keep-alive\n\n\r\n"}

    def reply(conn: socket.socket, data: bytes) -> None:
        body = json.loads(data.split(b"\r\n\r\n", 1)[1])
        kind = replies[body.get("prompt") or body.get("input")]
        kind(conn) if callable(kind) else conn.sendall(kind)

    with raw_upstream(reply) as port:
        gw = Proc(tmp_path / "odd.log", "gateway", ["--upstream", f"odd=http://127.0.0.1:{port}", "--no-access-log",
                                                    "--upstream-timeout-s", "2"])
        try:
            gw.running()
            for prompt, code in (("garbage", "upstream_invalid_response"), ("close", "upstream_reset"),
                                 ("short", "upstream_reset")):
                r = requests.post(gw.url + "/v1/completions", json={"prompt": prompt}, timeout=30)
                assert r.status_code == 502, (prompt, r.text)
                assert r.json()["error"]["code"] == code and f"127.0.0.1:{port}" in r.json()["error"]["message"]
                assert r.json()["error"]["type"] == "server_error"
                r = requests.post(gw.url + "/generate", json={"prompt": prompt}, timeout=30)
                assert r.status_code == 502 and r.json()["error"]["type"] == code  # the server's own shape there
            r = requests.post(gw.url + "/v1/completions", json={"prompt": "broken", "stream": True}, timeout=30)
            events = [e for e in r.content.split(b"\n\n") if e]
            assert events[0] + b"\n\n" == WHOLE_EVENT and events[-1] == b"data: [DONE]" and len(events) == 3
            assert json.loads(events[1][len(b"data: "):])["error"]["code"] == "upstream_reset"  # the half event: gone
            r = requests.post(gw.url + "/v1/completions", json={"prompt": "badchunk", "stream": True}, timeout=30)
            events = [e for e in r.content.split(b"\n\n") if e]
            assert json.loads(events[0][len(b"data: "):])["error"]["code"] == "upstream_invalid_response", events
            started = time.monotonic()
            r = requests.post(gw.url + "/v1/completions", json={"prompt": "trickle"}, timeout=30)
            assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout", r.text
            assert time.monotonic() - started < 4  # the whole answer's limit (2 s), not each byte's
            client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30)
            stream = client.completions.create(model="m", prompt="broken", stream=True)
            assert next(stream).choices[0].text == "hi"
            with pytest.raises(openai.APIError, match="the stream broke"):
                next(stream)
            r = requests.post(gw.url + "/v1/responses", json={"input": "numbered", "stream": True}, timeout=30)
            events = [e for e in r.content.split(b"\n\n") if e]
            assert events[-1].startswith(b"event: error\n") and len(events) == 6, events  # the comment went through
            assert json.loads(events[-1].split(b"data: ", 1)[1])["sequence_number"] == 4  # after 0-3, not 0 again
            assert requests.get(gw.url + "/health", timeout=5).status_code == 200  # the gateway is fine
        finally:
            gw.stop()


def test_a_client_that_leaves_while_its_upstream_is_silent_cuts_the_upstream(tmp_path):
    """Whole answers and streams whose upstream sends nothing for a while: the gateway's request thread waits on
    the upstream socket and writes nothing, so only the front's watch sees the client go. The upstream must see
    its connection end at once, not when --upstream-timeout-s (60 s here) runs out."""
    first = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
             + b"%X\r\n%s\r\n" % (len(WHOLE_EVENT), WHOLE_EVENT))
    ended: dict[str, float] = {}

    def reply(conn: socket.socket, data: bytes) -> None:
        kind = "stream" if json.loads(data.split(b"\r\n\r\n", 1)[1]).get("stream") else "whole"
        if kind == "stream":
            conn.sendall(first)  # one event, then silence
        conn.settimeout(30)
        try:
            while conn.recv(65536):  # until the gateway closes its side
                pass
        except OSError:
            pass
        ended[kind] = time.monotonic()

    with raw_upstream(reply) as port:
        gw = Proc(tmp_path / "silent.log", "gateway", ["--upstream", f"quiet=http://127.0.0.1:{port}",
                                                       "--no-access-log", "--upstream-timeout-s", "60"])
        try:
            gw.running()
            for kind, body in (("whole", {"prompt": "p"}), ("stream", {"prompt": "p", "stream": True})):
                data = json.dumps(body).encode()
                conn = socket.create_connection(("127.0.0.1", gw.port), timeout=30)
                conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
                if kind == "stream":
                    got = b""
                    while WHOLE_EVENT not in got:  # the event the upstream sent reached the client
                        got += conn.recv(65536)
                else:
                    time.sleep(0.5)  # the request is with the upstream
                left = time.monotonic()
                conn.close()
                until(lambda k=kind: k in ended, 10, f"the upstream's {kind} connection closed by the gateway")
                assert ended[kind] - left < 5, kind
            assert metric(gw, "pagoda_gateway_client_disconnects_total", group="quiet") == 2
            assert requests.get(gw.url + "/health", timeout=5).status_code == 200
        finally:
            gw.stop()


# ---- routing by decision ------------------------------------------------------------------------------

MESSAGES = ["Prove that there are infinitely many primes, step by step.", "hi there!",
            "Write a Python function that merges two sorted lists and explain its complexity.",
            "thanks, that is all", "What is 17 * 23 + 4? Show your working.", "good morning"]
QUESTION = {"needs_reasoning": {"type": "noul", "instructions": "Does answering this need several steps of "
                                                               "reasoning, maths or code?"}}


def test_rules_over_laya_answers_route_each_request_and_say_so(tmp_path, edge, frontier):
    import laya

    agent = laya.load(str(TINY_BERT))
    noul = [agent.predict(m, QUESTION)["answers"]["needs_reasoning"]["noul"] for m in MESSAGES]
    values = sorted(set(noul))
    assert len(values) >= 2, noul  # a random model still tells these apart
    cut = (values[len(values) // 2 - 1] + values[len(values) // 2]) / 2
    rules = tmp_path / "routes.yaml"
    rules.write_text(yaml.safe_dump({"questions": {"needs_reasoning": {**QUESTION["needs_reasoning"],
                                                                       "input": "last_user"}},
                                     "routes": {"frontier": f"needs_reasoning.noul > {cut}"}, "default": "edge",
                                     "explicit": ["edge"]}, sort_keys=False))
    gw = Proc(tmp_path / "routed.log", "gateway", ["--upstream", f"edge={edge.url}", "--upstream",
                                                   f"frontier={frontier.url}", "--route", str(rules),
                                                   "--model", str(TINY_BERT)])
    try:
        gw.running()
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        for message, p in zip(MESSAGES, noul):
            expected = "frontier" if p > cut else "edge"
            raw = client.chat.completions.with_raw_response.create(
                model="edge-llama", messages=[{"role": "system", "content": "be brief"},
                                              {"role": "user", "content": message}], max_tokens=2)
            assert raw.headers["x-pagoda-route"] == expected, (message, p, cut)
            assert raw.headers["x-pagoda-route-reason"] == ("rule" if expected == "frontier" else "default")
            assert float(raw.headers["x-pagoda-decision-ms"]) > 0
            assert raw.parse().model == f"{expected}-llama"  # the rule's pick answered, under its own model id
        raw = client.chat.completions.with_raw_response.create(model="edge", messages=[
            {"role": "user", "content": MESSAGES[int(max(range(6), key=lambda i: noul[i]))]}], max_tokens=2)
        assert raw.headers["x-pagoda-route-reason"] == "explicit" and "x-pagoda-decision-ms" not in raw.headers
        n_frontier = sum(p > cut for p in noul)
        assert metric(gw, "pagoda_gateway_routes_total", group="frontier", reason="rule") == n_frontier
        assert metric(gw, "pagoda_gateway_routes_total", group="edge", reason="default") == 6 - n_frontier
        assert metric(gw, "pagoda_gateway_routes_total", group="edge", reason="explicit") == 1
        assert metric(gw, "pagoda_gateway_decision_seconds_count") == metric(gw, "pagoda_decisions_total") == 6
        assert requests.get(gw.url + "/ready", timeout=5).json()["routing_model"] == "bert-tiny"
        r = requests.post(gw.url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2}, timeout=30)
        assert r.status_code == 200 and r.headers["X-Pagoda-Route-Reason"] == "default"
        assert "X-Pagoda-Decision-Ms" not in r.headers  # token ids have no text: no question was asked
    finally:
        gw.stop()


# ---- many at once -------------------------------------------------------------------------------------

def test_64_concurrent_streams_are_each_whole_and_unmixed(gateway, edge, frontier):
    groups = ["edge", "frontier"]
    prompts = [[{"role": "user", "content": f"question number {i} about the lazy dog"}] for i in range(64)]
    kw = dict(max_tokens=12, temperature=0, ignore_eos=True)
    servers = {"edge": edge, "frontier": frontier}

    def direct(i: int) -> str:
        r = requests.post(servers[groups[i % 2]].url + "/v1/chat/completions",
                          json={"messages": prompts[i], **kw}, timeout=120)
        return r.json()["choices"][0]["message"]["content"]

    def through(i: int) -> tuple[str, set[str], str | None, str]:
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        raw = client.chat.completions.with_raw_response.create(model=groups[i % 2], messages=prompts[i], stream=True,
                                                               max_tokens=12, temperature=0,
                                                               extra_body={"ignore_eos": True})
        chunks = list(raw.parse())
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return text, {c.id for c in chunks}, chunks[-1].choices[0].finish_reason, raw.headers["x-pagoda-route"]

    expected = run_threads(direct, 64)
    results = run_threads(through, 64)
    for i, (text, ids, finish, route) in enumerate(results):
        assert route == groups[i % 2] and len(ids) == 1 and finish == "length"
        assert text == expected[i], i
    assert len({ids.pop() for _, ids, _, _ in results}) == 64  # 64 distinct streams, none shared
    assert len(set(expected)) > 8  # the prompts really differ in what they answer


def run_threads(fn, n: int) -> list:
    out: list = [None] * n
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            out[i] = fn(i)
        except BaseException as exc:  # noqa: BLE001 -- re-raised below, on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a client never finished"
    if errors:
        raise errors[0]
    return out


def test_stats_and_metrics_describe_each_upstream(gateway, edge):
    requests.post(gateway.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=30)
    stats = requests.get(gateway.url + "/stats", timeout=10).json()["gateway"]["upstreams"]
    mine = next(u for u in stats if u["url"] == edge.url)
    assert mine["requests"] >= 1 and mine["latency_ms"]["p50"] > 0 and mine["ttfb_ms"]["window"] >= 1
    assert metric(gateway, "pagoda_gateway_upstream_requests_total", upstream=edge.url, status="200") >= 1
    assert metric(gateway, "pagoda_gateway_upstream_latency_seconds_count", upstream=edge.url) >= 1
    assert metric(gateway, "pagoda_gateway_upstream_ttfb_seconds_count", upstream=edge.url) >= 1
    assert metric(gateway, "pagoda_gateway_upstream_healthy", upstream=edge.url) == 1
    assert metric(gateway, "pagoda_gateway_upstream_in_flight", upstream=edge.url) == 0
    paths = requests.get(gateway.url + "/openapi.json", timeout=10).json()["paths"]
    assert {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/generate", "/health", "/v1/models"} <= set(paths)


@pytest.mark.slow
def test_bench_gateway_runs_end_to_end(tiny_llama):
    """The benchmark command itself, decisions included (its figures are for docs/benchmarks.md, never
    asserted here): nothing else runs `pagoda bench gateway`, and a change to a helper it shares once broke it."""
    proc = subprocess.run([sys.executable, "-m", "serving.cli", "bench", "gateway", "--generate-model",
                           str(tiny_llama), "--requests", "3", "--rounds", "2", "--seconds", "0.5", "--streams", "2",
                           "--new-tokens", "2", "--model", TINY_BERT, "--student", "/nonexistent"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 streams x 2 tokens" in proc.stdout and "1 question" in proc.stdout, proc.stdout
