"""The HTTP layer under hostile clients, against a real `pagoda serve` on loopback (raw sockets for the slow ones).

Slow clients (headers trickled, bodies shorter than their Content-Length) and idle connections cost the server
a socket on its event loop, never a request thread, so good requests keep answering beside them; the front's own
refusals (bad framing, big headers, bodies over the limit, chunked or not, stalls) come in the JSON error shape.
Every wait here is bounded (socket timeouts, requests timeouts, fixed loop counts).
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from serving_support import API_KEY, BILLING_STATE, TINY_BERT, ServerProcess

AUTH = {"Authorization": f"Bearer {API_KEY}"}
DECIDE = {"state": BILLING_STATE, "preset": "support-triage"}
CAP = 260  # above the 200 idle or 70 slow connections of the tests that must not reach it


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    logs = tmp_path_factory.mktemp("front-logs")
    proc = ServerProcess(logs / "front.log", ["--model", str(TINY_BERT), "--header-timeout-s", "2",
                                              "--body-timeout-s", "2", "--keepalive-s", "30",
                                              "--max-connections", str(CAP), "--threads", "8"],
                         env={"PAGODA_API_KEY": API_KEY})
    proc.running(headers=AUTH)
    yield proc
    proc.stop()


def connect(server: ServerProcess, timeout: float = 10.0) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=timeout)
    return s


def release(socks: list[socket.socket], within_s: float = 10.0) -> None:
    """Close the client side of each socket and wait until the server has closed its own: a connection the
    server still holds counts against the cap in the next test, which then evicts that test's own idle
    connections (seen under load: 43 of the previous test's 70 sockets still open as the next one connected)."""
    for s in socks:
        try:
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass
    deadline = time.monotonic() + within_s
    for s in socks:
        try:
            while (left := deadline - time.monotonic()) > 0:
                s.settimeout(left)
                if not s.recv(65536):  # the server's close, after any answer it still had to send
                    break
        except OSError:  # reset by the server, or the deadline
            pass
        s.close()


def read_response(s: socket.socket, pending: bytearray | None = None) -> tuple[int, dict, bytes]:
    """One whole response off a raw socket (Content-Length framed, as every error answer is). `pending`
    carries bytes read past this response (pipelined answers can arrive in one segment) to the next call."""
    pending = bytearray() if pending is None else pending
    data = bytes(pending)
    pending.clear()
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a response head: {data!r}")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = s.recv(65536)
        if not chunk:
            break
        rest += chunk
    pending += rest[length:]
    return status, headers, rest[:length]


def assert_json_error(status: int, headers: dict, body: bytes, want_status: int, want_type: str) -> dict:
    assert status == want_status, body
    assert headers["content-type"].startswith("application/json")
    doc = json.loads(body)
    assert doc["error"]["type"] == want_type and doc["error"]["message"]
    assert doc["request_id"] == headers["x-request-id"]
    return doc


def good_requests(server: ServerProcess, n: int = 5) -> None:
    """Decisions and health answer while the hostile clients hold their sockets (a frozen server times out)."""
    with requests.Session() as http:
        for _ in range(n):
            r = http.post(server.url + "/decide", json=DECIDE, headers=AUTH, timeout=10)
            assert r.status_code == 200, r.text
            assert set(r.json()["answers"]) == {"department", "urgency", "churn_risk"}
            assert http.get(server.url + "/health", timeout=5).status_code == 200


def test_trickled_headers_do_not_freeze_the_server(front):
    slow = [connect(front) for _ in range(70)]
    request = f"POST /decide HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n".encode()
    stop = threading.Event()

    def trickle() -> None:
        for i in range(len(request)):  # one byte per connection every 0.5 s, for at most the whole head
            if stop.is_set():
                return
            for s in slow:
                try:
                    s.send(request[i:i + 1])
                except OSError:
                    pass
            time.sleep(0.5)

    t = threading.Thread(target=trickle)
    t.start()
    try:
        time.sleep(0.6)
        good_requests(front)
        # each trickler is cut off at the head deadline (2 s) with a JSON 408, whatever it still meant to send
        for s in slow[:5]:
            assert_json_error(*read_response(s), 408, "request_timeout")
    finally:
        stop.set()
        t.join(timeout=60)
        release(slow)


def test_bodies_shorter_than_their_length_do_not_hold_threads(front):
    # 70 short bodies against 8 request threads: with a thread per body the server would freeze
    head = (f"POST /decide HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n").encode()
    short = [connect(front) for _ in range(70)]
    try:
        for s in short:
            s.sendall(head + b'{"state": "')
        good_requests(front)
        doc = assert_json_error(*read_response(short[0]), 408, "request_timeout")
        assert "--body-timeout-s" in doc["error"]["message"]
    finally:
        release(short)


def test_idle_connections_do_not_delay_a_good_request(front):
    idle = [connect(front) for _ in range(200)]
    try:
        good_requests(front, n=3)
        idle[0].settimeout(0.2)
        with pytest.raises(TimeoutError):  # still open: under the cap, an idle connection waits its keepalive
            idle[0].recv(1)
    finally:
        release(idle)


SMALL_CAP = 12
HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.fixture(scope="module")
def capped(tmp_path_factory):
    """A server of its own for the cap: a small one, and a header timeout far past the test's length, so a begun
    request stays begun (with `front`'s 2 s, begun requests timed out under CI load and freed their slots). One
    request thread, so connections turn idle in the order their answers were sent: with two, a thread descheduled
    after sending let the next connection turn idle first, and the eviction took that one."""
    logs = tmp_path_factory.mktemp("capped-logs")
    proc = ServerProcess(logs / "capped.log", ["--model", str(TINY_BERT), "--header-timeout-s", "120",
                                                "--keepalive-s", "120", "--max-connections", str(SMALL_CAP),
                                                "--threads", "1"],
                         env={"PAGODA_API_KEY": API_KEY})
    proc.running(headers=AUTH)
    yield proc
    proc.stop()


def roundtrip(s: socket.socket, data: bytes) -> socket.socket:
    s.sendall(data)
    assert read_response(s)[0] == 200
    return s


def test_the_connection_cap_evicts_idle_connections_then_refuses(capped):
    # Each connection is made known to the server by a round trip before the next one opens, never by a sleep: a
    # socket whose connect() returned may still sit in the kernel's accept queue, and a connection the fixture's
    # readiness probe used may still be mid-answer (not idle, not evictable) as the first ones open.
    idle = [roundtrip(connect(capped), HEALTH) for _ in range(SMALL_CAP)]
    try:
        good_requests(capped, n=1)  # takes the place of the longest-idle connection
        idle[0].settimeout(10)
        assert idle[0].recv(1) == b""  # that one was closed for it
        for s in idle[1:]:  # and only that one
            roundtrip(s, HEALTH)
    finally:
        release(idle)
    # A health request pipelined with the first byte of the next: by the time its answer arrives, the server holds
    # that byte as a begun request, so the connection is never idle, never evictable.
    busy = [roundtrip(connect(capped), HEALTH + b"G") for _ in range(SMALL_CAP)]
    try:
        s = connect(capped)
        s.sendall(HEALTH)
        status, headers, body = read_response(s)
        assert_json_error(status, headers, body, 503, "overloaded")
        assert headers["retry-after"] == "1"
        s.close()
    finally:
        release(busy)
    good_requests(capped, n=1)


def test_a_chunked_body_over_the_limit_is_413(front):
    def chunks():
        yield json.dumps(DECIDE).encode()
        for _ in range(3):
            yield b" " * (1 << 20)

    r = requests.post(front.url + "/decide", data=chunks(), timeout=30,
                      headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 413, r.text
    assert r.json()["error"]["type"] == "payload_too_large"

    def small():
        yield json.dumps(DECIDE).encode()
        yield b" " * 1000

    r = requests.post(front.url + "/decide", data=small(), timeout=30,
                      headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 200, r.text  # a chunked body under the limit is read whole


def test_a_declared_length_over_the_limit_is_413_before_the_body(front):
    s = connect(front)
    s.sendall(f"POST /decide HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {5 << 20}\r\n\r\n".encode() + b"{" * 1000)
    assert_json_error(*read_response(s), 413, "payload_too_large")
    s.close()


def test_the_fronts_refusals_are_counted_under_their_route_and_keep_the_clients_id(front):
    """An operator counting `/decide`'s errors sees the 413s the front answered before the app did, and a client
    that sent its own X-Request-ID finds it on the refusal as on any other answer."""
    def counts() -> tuple[dict, str]:
        stats = requests.get(front.url + "/stats", headers=AUTH, timeout=10).json()["requests"]
        return stats, requests.get(front.url + "/metrics", headers=AUTH, timeout=10).text

    def sample(text: str, route: str, status: str) -> float:
        for family in text_string_to_metric_families(text):
            for one in family.samples:
                if one.name == "pagoda_requests_total" and one.labels == {"route": route, "status": status}:
                    return one.value
        return 0.0

    before, text_before = counts()
    s = connect(front)
    s.sendall(f"POST /decide HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Request-ID: mine-42\r\n"
              f"Content-Length: {5 << 20}\r\n\r\n".encode())
    status, headers, body = read_response(s)
    s.close()
    doc = assert_json_error(status, headers, body, 413, "payload_too_large")
    assert doc["request_id"] == "mine-42" and "(--max-body-bytes)" in doc["error"]["message"]
    s = connect(front)  # a path no route has: counted as unmatched, as the app counts its 404s
    s.sendall(b"POST /nowhere HTTP/1.1\r\nHost: x\r\nX-Request-ID: bad id with spaces\r\nContent-Length: abc\r\n\r\n")
    status, headers, body = read_response(s)
    s.close()
    assert assert_json_error(status, headers, body, 400, "bad_request")["request_id"] != "bad id with spaces"
    after, text_after = counts()
    assert after["by_status"].get("413", 0) == before["by_status"].get("413", 0) + 1
    assert after["by_route"]["/decide"] >= before["by_route"].get("/decide", 0) + 1
    assert sample(text_after, "/decide", "413") == sample(text_before, "/decide", "413") + 1
    assert sample(text_after, "unmatched", "400") == sample(text_before, "unmatched", "400") + 1


@pytest.mark.parametrize("raw, status, type_", [
    (b"POST /decide HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", 400, "bad_request"),
    (b"POST /decide HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
     400, "bad_request"),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n", 431, "headers_too_large"),
    # under one read (64 KiB) but over --max-header-bytes (16 KiB): the whole head arrives at once
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 30_000 + b"\r\n\r\n", 431, "headers_too_large"),
    (b"NOT HTTP AT ALL\r\n\r\n", 400, "bad_request"),
    (b"POST /decide HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", 501, "bad_request"),
])
def test_errors_of_the_http_layer_are_json(front, raw, status, type_):
    s = connect(front)
    s.sendall(raw)
    assert_json_error(*read_response(s), status, type_)
    s.close()
    good_requests(front, n=1)


def test_post_routes_require_json(front):
    body = json.dumps(DECIDE)
    for content_type in (None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        headers = {**AUTH, **({"Content-Type": content_type} if content_type else {})}
        r = requests.post(front.url + "/decide", data=body, headers=headers, timeout=10)
        assert r.status_code == 415, (content_type, r.text)
        assert r.json()["error"]["type"] == "unsupported_media_type"
        assert r.json()["error"]["field"] == "Content-Type"
    r = requests.post(front.url + "/decide", data=body, timeout=10,
                      headers={**AUTH, "Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200
    r = requests.post(front.url + "/nowhere", data=body, headers=AUTH, timeout=10)
    assert r.status_code == 404  # an unknown route says so, whatever its body
    r = requests.post(front.url + "/decide", headers=AUTH, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_json"  # no body: nothing to type
    # a body is read as sent: an encoded one is refused by the header's name, not misread as bytes that are not JSON
    for encoding, data in (("gzip", gzip.compress(body.encode())), ("br", body), ("deflate, gzip", body)):
        r = requests.post(front.url + "/decide", data=data, timeout=10,
                          headers={**AUTH, "Content-Type": "application/json", "Content-Encoding": encoding})
        assert r.status_code == 415, (encoding, r.text)
        assert r.json()["error"]["field"] == "Content-Encoding" and encoding in r.json()["error"]["message"]
    r = requests.post(front.url + "/decide", data=body, timeout=10,
                      headers={**AUTH, "Content-Type": "application/json", "Content-Encoding": "identity"})
    assert r.status_code == 200
    # a name given twice would lose one of the values without a word: refused, naming where
    twice = body[:-1] + ', "state": "and again"}'
    r = requests.post(front.url + "/decide", data=twice, timeout=10, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_json", r.text
    assert r.json()["error"]["field"] == "state"


def test_the_bearer_scheme_is_case_insensitive(front):
    for scheme in ("Bearer", "bearer", "BEARER", "bEaReR"):
        r = requests.get(front.url + "/ready", headers={"Authorization": f"{scheme} {API_KEY}"}, timeout=10)
        assert r.status_code == 200, scheme
    for value in (f"Basic {API_KEY}", "Bearer wrong", f"Bearer{API_KEY}", API_KEY, ""):
        r = requests.get(front.url + "/ready", headers={"Authorization": value}, timeout=10)
        assert r.status_code == 401, value
        assert r.json()["error"]["type"] == "unauthorized"


def test_keep_alive_pipelining_and_expect_continue(front):
    s = connect(front)
    one = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Request-ID: first\r\n\r\n"
    two = f"GET /ready HTTP/1.1\r\nHost: x\r\nX-Request-ID: second\r\nAuthorization: Bearer {API_KEY}\r\n\r\n"
    s.sendall(one + two.encode())  # two requests in one write: answered in order on one connection
    pending = bytearray()
    first, second = read_response(s, pending), read_response(s, pending)
    assert (first[0], first[1]["x-request-id"]) == (200, "first")
    assert (second[0], second[1]["x-request-id"]) == (200, "second")
    s.sendall(b"".join(f"GET /health HTTP/1.1\r\nHost: x\r\nX-Request-ID: p{i}\r\n\r\n".encode() for i in range(10)))
    answers = [read_response(s, pending) for _ in range(10)]
    assert [(a[0], a[1]["x-request-id"]) for a in answers] == [(200, f"p{i}") for i in range(10)]
    assert not pending
    body = json.dumps(DECIDE).encode()
    s.sendall(f"POST /decide HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\nExpect: 100-continue\r\n"
              f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode())
    interim = s.recv(1024)
    assert interim.startswith(b"HTTP/1.1 100 ")
    s.sendall(body)
    status, _, answer = read_response(s)
    assert status == 200 and "department" in json.loads(answer)["answers"]
    s.close()


def test_a_killed_worker_is_replaced(front):
    """SIGKILL the worker: the master forks a new one, which answers again (its load time: docs/operations.md)."""
    worker = int(subprocess.run(["pgrep", "-P", str(front.proc.pid)], capture_output=True, text=True,
                                check=True).stdout.split()[0])
    os.kill(worker, signal.SIGKILL)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if requests.get(front.url + "/ready", headers=AUTH, timeout=5).status_code == 200:
                break
        except requests.RequestException:
            pass
        time.sleep(0.2)
    else:
        pytest.fail(f"no worker answered after the kill:\n{front.log()[-3000:]}")
    good_requests(front, n=2)


def test_sighup_replaces_the_worker_gracefully(front):
    """gunicorn's reload: a new worker from the master (the preloaded code), the old one drained."""
    def workers() -> set[int]:
        out = subprocess.run(["pgrep", "-P", str(front.proc.pid)], capture_output=True, text=True).stdout
        return {int(p) for p in out.split()}

    before = workers()
    os.kill(front.proc.pid, signal.SIGHUP)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not workers() or workers() & before):
        time.sleep(0.2)
    assert workers() and not workers() & before, "the old worker is still there, or no new one came"
    front._ready = False
    front.running(headers=AUTH)
    good_requests(front, n=2)


def test_two_workers_answer_and_stop_cleanly(tmp_path):
    """Both workers fork from the preloading master, answer, and exit 0 on SIGTERM: nothing preloaded left a
    native thread whose handle a worker would inherit without the thread (that aborts a worker at exit). Run as a
    user runs it, without OMP_NUM_THREADS: numpy's OpenBLAS then starts its pool when serving imports numpy, and
    the master warned of it on every start, though that pool is not preload's and OpenBLAS handles a fork."""
    server = ServerProcess(tmp_path / "two.log", ["--model", str(TINY_BERT), "--workers", "2"],
                           env={"OMP_NUM_THREADS": None})
    idle = []
    try:
        server.running()
        workers_loaded(server, 2)
        good_requests(server, n=4)
        idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(4)]  # open at SIGTERM
        time.sleep(0.3)
    finally:
        code = server.stop()
        for sock in idle:
            sock.close()
    log = server.log()
    assert code == 0, log[-3000:]
    assert "terminate called" not in log and "SIGABRT" not in log and "native thread" not in log, log[-3000:]
    assert "Task was destroyed" not in log, log[-3000:]  # the connections SIGTERM closed, left pending on the loop


def workers_loaded(server: ServerProcess, n: int, timeout: float = 60.0) -> list[int]:
    """The pids of the workers that have said they loaded (serving/server.py's load watch), once n have."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = [int(pid) for pid in re.findall(r"worker (\d+) loaded, accepting", server.log())]
        if len(pids) >= n:
            return pids
        time.sleep(0.05)
    pytest.fail(f"{n} workers did not load within {timeout}s:\n{server.log()[-3000:]}")


def test_a_replacement_worker_takes_no_request_until_it_has_loaded(tmp_path):
    """A killed worker's replacement loads its model while the survivor serves. It must not accept meanwhile
    (serving/ready_board.py): before, it took its share of connections and answered them 503 not_ready."""
    server = ServerProcess(tmp_path / "replace.log", ["--model", str(TINY_BERT), "--workers", "2"])
    try:
        server.running()
        os.kill(workers_loaded(server, 2)[0], signal.SIGKILL)
        statuses: dict[int, int] = {}
        deadline, after = time.monotonic() + 60, 0
        while time.monotonic() < deadline and after < 20:
            status = requests.post(server.url + "/decide", json=DECIDE, headers=AUTH, timeout=10).status_code
            statuses[status] = statuses.get(status, 0) + 1
            if len(workers_loaded(server, 2)) >= 3:  # the replacement has loaded: a few more, then stop
                after += 1
        assert len(workers_loaded(server, 2)) >= 3, server.log()[-3000:]
        assert set(statuses) == {200}, statuses
        assert statuses[200] >= 20
    finally:
        server.stop()


def test_streams_keep_working_beside_slow_clients(gen):
    """SSE through the front: events arrive one by one and end with [DONE], while 50 clients trickle heads."""
    slow = [connect(gen) for _ in range(50)]
    try:
        for s in slow:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHo")
        with requests.post(gen.url + "/v1/chat/completions", stream=True, timeout=60, json={
                "model": "tiny-llama", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16,
                "stream": True}) as r:
            assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            events = [line for line in r.iter_lines() if line]
        assert events[-1] == b"data: [DONE]"
        chunks = [json.loads(e[len(b"data: "):]) for e in events[:-1]]
        assert len(chunks) >= 2 and all(c["object"] == "chat.completion.chunk" for c in chunks)
    finally:
        for s in slow:
            s.close()


@contextlib.contextmanager
def in_process_front(app, threads: int = 2, write_timeout_s: float = 5.0):
    """`serving.server.Front` over a WSGI `app` on a loopback port, its loop on a thread: what a test needs to
    time or count inside a response, which a server process would hide. Yields the port."""
    from serving.server import Front, Limits

    loop = asyncio.new_event_loop()
    front = Front(app, Limits(8, 5.0, 5.0, 5.0, write_timeout_s, 16384, 1 << 20), threads, loop, multiprocess=False)
    server = loop.run_until_complete(asyncio.start_server(front.connection, "127.0.0.1", 0))
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        async def shut() -> None:
            for _ in range(100):  # the client closed: its connection task sees EOF and ends
                if not front.open:
                    break
                await asyncio.sleep(0.05)
            server.close()
            await server.wait_closed()

        asyncio.run_coroutine_threadsafe(shut(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        runner.join(10)
        front.pool.shutdown(wait=True)
        loop.close()


def test_a_stream_is_closed_before_its_client_has_read_the_end():
    """A streamed answer's close() (which frees its thread slot, serving/threads.py) runs before the end of the
    message goes out: a client that has read the whole stream and asks again at once must find the slot free.
    The close here takes 0.3 s, so a front that sent the end first would let the client finish before it."""
    closed = threading.Event()

    class Body:
        def __iter__(self):
            yield b"data: 1\n\n"
            yield b"data: [DONE]\n\n"

        def close(self) -> None:
            time.sleep(0.3)
            closed.set()

    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/event-stream")])
        return Body()

    with in_process_front(app) as port:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/stream")
        response = conn.getresponse()
        assert response.read() == b"data: 1\n\ndata: [DONE]\n\n"
        assert closed.is_set()
        conn.close()


def test_a_fast_body_waits_for_a_client_that_reads_nothing_and_arrives_whole_and_in_order():
    """The request thread hands chunks to the loop without waiting for each write (`serving.server._Output`),
    so what holds a fast producer back is the client: while it reads nothing, the body may run ahead only by
    what the socket buffers and the front's bounded hand-over hold, not by the whole body; then every chunk
    arrives, in order."""
    chunk, count = 16 * 1024, 2048                       # a 32 MiB body, as fast as the thread can yield it
    yielded = [0]

    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "application/octet-stream")])

        def body():
            for i in range(count):
                yielded[0] += 1
                yield i.to_bytes(4, "big") * (chunk // 4)

        return body()

    with in_process_front(app) as port:
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        s.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(1.0)                                  # reading nothing
        ahead = yielded[0] * chunk
        got = bytearray()
        while not got.endswith(b"\r\n0\r\n\r\n"):      # the chunked body's last chunk
            data = s.recv(1 << 20)
            assert data, f"closed after {len(got)} bytes"
            got += data
        s.close()
    assert got.startswith(b"HTTP/1.1 200"), bytes(got[:200])
    assert ahead < 16 * 1024 * 1024, f"{ahead} bytes produced for a client that had read none"
    body = bytes(got[got.index(b"\r\n\r\n") + 4:])
    # chunked framing: each chunk is "4000\r\n" + 16 KiB + "\r\n"; the payload's words count up
    payload = b"".join(body[i + 6:i + 6 + chunk] for i in range(0, count * (chunk + 8), chunk + 8))
    assert len(payload) == count * chunk
    assert all(payload[i * chunk:i * chunk + 4] == i.to_bytes(4, "big") for i in range(count))


def _big_body_app(chunk: int, count: int, closed: list):
    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "application/octet-stream")])

        def body():
            try:
                for i in range(count):
                    yield bytes([i % 256]) * chunk
            finally:
                closed.append(time.monotonic())

        return body()

    return app


def _small_window_get(port: int) -> socket.socket:
    """A GET on a socket whose 16 KiB receive buffer makes the server's buffers fill soon."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
    s.settimeout(10)
    s.connect(("127.0.0.1", port))
    s.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
    return s


def _read_at(s: socket.socket, rate: float, limit_s: float) -> tuple[bytes, str]:
    """Read at about `rate` bytes/s until the chunked body ends, the server closes, or `limit_s` passes."""
    got, started = bytearray(), time.monotonic()
    while time.monotonic() - started < limit_s:
        data = s.recv(16384)
        if not data:
            return bytes(got), "closed"
        got += data
        if got.endswith(b"\r\n0\r\n\r\n"):
            return bytes(got), "complete"
        time.sleep(max(0.0, len(got) / rate - (time.monotonic() - started)))
    return bytes(got), "limit"


def test_a_slow_but_steady_reader_of_a_large_answer_gets_all_of_it():
    """`--write-timeout-s` drops a client that takes nothing for that long, not one that takes an answer slower
    than the timeout allows in all: a 4 MiB body read at 2 MB/s behind a 16 KiB receive buffer needs ~2 s, with
    a 0.3 s timeout. Until Dec 7 the front bounded each wait for the client by the timeout as a whole, and the
    reader got EOF after the ~3.7 MB the socket buffers held."""
    closed: list = []
    with in_process_front(_big_body_app(65536, 64, closed), write_timeout_s=0.3) as port:
        s = _small_window_get(port)
        got, how = _read_at(s, 2e6, 20)
        s.close()
    assert how == "complete", f"{how} after {len(got)} bytes"
    assert len(got) > 64 * 65536


def test_a_reader_that_stops_taking_a_large_answer_is_dropped_after_the_write_timeout():
    """The other side of that rule: the same body, the client reading nothing after its first bytes, is ended
    about --write-timeout-s after the socket buffers fill, and the body's close() runs (its thread is free)."""
    closed: list = []
    with in_process_front(_big_body_app(65536, 256, closed), write_timeout_s=0.3) as port:
        started = time.monotonic()
        s = _small_window_get(port)
        assert s.recv(1024).startswith(b"HTTP/1.1 200")
        for _ in range(100):
            if closed:
                break
            time.sleep(0.05)
        got, how = _read_at(s, 1e9, 10)
        s.close()
    assert closed and closed[0] - started < 3.0, closed
    assert how == "closed" and len(got) < 256 * 65536


def test_an_app_that_refills_one_buffer_between_chunks_is_sent_what_it_yielded():
    """The loop writes a chunk after the request thread has gone on (`serving.server._Output`), so the front
    copies any chunk that is not `bytes`: an app yielding one bytearray refilled each time (against PEP 3333's
    letter, but seen in the wild) would otherwise have later contents written for earlier chunks."""
    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "application/octet-stream")])

        def body():
            buffer = bytearray(8)
            for i in range(2000):
                buffer[:] = i.to_bytes(8, "big")
                yield buffer

        return body()

    with in_process_front(app) as port:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/refill")
        data = conn.getresponse().read()
        conn.close()
    assert data == b"".join(i.to_bytes(8, "big") for i in range(2000))


def test_a_stream_reader_is_dropped_only_when_it_takes_nothing():
    """`--write-timeout-s` for streams (`serving.server._Stall`): unsent bytes may grow while the client reads
    slower than the server writes (it is still taking some, and stays); nothing taken for the timeout ends it."""
    from serving.server import _Stall

    stall = _Stall(0.05)
    stall.check(100, 100)             # written, nothing taken yet
    time.sleep(0.06)
    stall.check(100, 150)             # 50 taken: a slow reader, not a stalled one
    time.sleep(0.06)
    with pytest.raises(TimeoutError, match="took none"):
        stall.check(100, 250)         # nothing more taken for longer than the timeout
    fresh = _Stall(0.05)
    time.sleep(0.06)
    fresh.check(100, 0)               # all taken: never a stall
