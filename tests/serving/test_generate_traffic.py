"""Real traffic on one server: 32 concurrent streams each get their own sequential greedy answer (and share
the engine's batch), a client that hangs up mid-stream frees its blocks, pins hold under eviction."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time

import pytest
import requests

from generation import SamplingParams

SYSTEM = "paged attention keeps key value blocks in a shared pool"


def engine_stats(server) -> dict:
    return requests.get(server.url + "/stats", timeout=10).json()["generation"]


def read_stream(response) -> tuple[str, list[dict]]:
    text, chunks = "", []
    for line in response.iter_lines(decode_unicode=True):
        if not line:
            continue
        assert line.startswith("data: ")
        if line == "data: [DONE]":
            break
        chunk = json.loads(line[len("data: "):])
        chunks.append(chunk)
        for choice in chunk["choices"]:
            text += choice["delta"].get("content") or ""
    return text, chunks


def test_32_concurrent_streams_each_get_their_own_sequential_answer(gen, gen_engine):
    conversations = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"question number {i} ?"}]
                     for i in range(32)]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    expected = [gen_engine.generate([gen_engine.tokenizer.encode(gen_engine.apply_chat_template(c))], params)[0].text
                for c in conversations]  # one at a time, in-process
    before = engine_stats(gen)
    results: dict[int, str] = {}
    start = threading.Barrier(32, timeout=60)

    def client(i: int) -> None:
        start.wait()
        with requests.post(gen.url + "/v1/chat/completions", stream=True, timeout=120, json={
                "messages": conversations[i], "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                "stream": True}) as r:
            assert r.status_code == 200, r.text
            results[i] = read_stream(r)[0]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert sorted(results) == list(range(32))
    assert [results[i] for i in range(32)] == expected
    after = engine_stats(gen)
    forwards = after["forwards"] - before["forwards"]
    tokens = after["output_tokens"] - before["output_tokens"]
    assert tokens == 32 * 16 and forwards < tokens / 4  # the streams shared forwards: continuous batching
    assert after["running_requests"] == after["waiting_requests"] == 0


@pytest.mark.parametrize("read_events", [3, 0], ids=["mid-stream", "before-the-first-event"])
def test_a_client_that_hangs_up_aborts_and_frees_its_blocks(gen, read_events):
    before = engine_stats(gen)
    body = json.dumps({"prompt": "the quick brown fox", "max_tokens": 512, "temperature": 0, "ignore_eos": True,
                       "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", gen.port), timeout=30) as sock:  # a client that just goes away
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        received = b""
        while received.count(b"data: ") < read_events:
            chunk = sock.recv(4096)
            assert chunk, "the server closed the stream early"
            received += chunk
        assert received.startswith(b"HTTP/1.1 200") or not read_events
    # Wait for the request to be counted, not only for an idle engine: a client that hangs up before the first
    # event can be polled before the server has even submitted its request, when the engine is idle too (CI, Dec 5).
    counted = completions_counted(before)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = engine_stats(gen)
        if completions_counted(stats) > counted and stats["running_requests"] == stats["waiting_requests"] == 0:
            break
        time.sleep(0.05)
    assert completions_counted(stats) == counted + 1
    assert stats["running_requests"] == stats["waiting_requests"] == 0
    assert stats["free_blocks"] + stats["cached_blocks"] + pinned_blocks(gen) == stats["num_blocks"]
    assert stats["output_tokens"] - before["output_tokens"] < 512  # it was cut short, not run to the end
    assert stats["output_tokens"] - before["output_tokens"] >= read_events  # what it streamed is counted
    assert stats["finished"]["completions"].get("abort", 0) > before["finished"].get("completions", {}).get("abort", 0)


@pytest.mark.parametrize("path, body, route", [
    ("/v1/completions", {"prompt": "the quick brown fox", "max_tokens": 512, "temperature": 0, "ignore_eos": True},
     "completions"),
    ("/v1/responses", {"input": "the quick brown fox", "max_output_tokens": 512, "temperature": 0,
                       "ignore_eos": True}, "responses"),
    ("/generate", {"text": "the quick brown fox", "sampling_params": {"max_new_tokens": 512, "ignore_eos": True,
                                                                      "temperature": 0}}, "generate"),
])
@pytest.mark.parametrize("reset", [False, True], ids=["closed", "reset"])
def test_a_client_that_hangs_up_before_a_whole_answer_aborts_it_too(gen, path, body, route, reset):
    """A request answered whole writes nothing until its end, so no failed write tells the server its client
    left: the front watches the connection and the run stops within a poll (before, it ran all 512 tokens)."""
    before = engine_stats(gen)
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", gen.port), timeout=30) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
                     + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        deadline = time.monotonic() + 30
        while engine_stats(gen)["running_requests"] == 0:  # it is generating: then the client goes
            assert time.monotonic() < deadline
            time.sleep(0.01)
        if reset:  # RST instead of FIN, as a killed client or a proxy's timeout sends it
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = engine_stats(gen)
        aborted = stats["finished"].get(route, {}).get("abort", 0) > before["finished"].get(route, {}).get("abort", 0)
        if aborted and stats["running_requests"] == stats["waiting_requests"] == 0:
            break
        time.sleep(0.05)
    assert stats["finished"][route]["abort"] == before["finished"].get(route, {}).get("abort", 0) + 1
    assert stats["running_requests"] == stats["waiting_requests"] == 0
    assert stats["output_tokens"] - before["output_tokens"] < 512  # cut short, not run to the end
    assert requests.get(gen.url + "/health", timeout=10).status_code == 200


def test_a_client_that_half_closes_is_gone_and_can_read_why(gen):
    """shutdown(SHUT_WR) after the request: gone, as uvicorn reads it, but the socket can still take the 499."""
    data = json.dumps({"prompt": "the quick brown fox", "max_tokens": 512, "temperature": 0,
                       "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", gen.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 499 Client Closed Request\r\n"), answer[:200]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "client_closed"


def completions_counted(stats: dict) -> int:
    """/v1/completions requests the engine stats have counted as finished, whatever their reason."""
    return sum(stats["finished"].get("completions", {}).values())


def pinned_blocks(server) -> int:
    return sum(p["blocks"] for p in requests.get(server.url + "/v1/pins", timeout=10).json()["data"])


def test_pins_hit_fully_under_eviction_pressure(gen):
    # (a pin matches by tokens: a text pin ending in a space would merge with the next word, so this ends in ".")
    prefix = "a radix tree finds the longest cached prefix of every prompt."
    pin = requests.post(gen.url + "/v1/pins", json={"text": prefix}, timeout=60).json()
    assert pin["object"] == "pin" and pin["tokens"] > 0 and pin["blocks"] == -(-pin["tokens"] // 4)
    listed = requests.get(gen.url + "/v1/pins", timeout=10).json()["data"]
    assert pin in listed
    evictions = engine_stats(gen)["evictions"]
    # fill the 512-block pool several times over with other prompts (their blocks get evicted)
    noise = [f"numbers {i} {i + 1} {i + 2} and symbols ! ? . , ; : " * 6 for i in range(40)]
    for i in range(0, 40, 8):
        assert requests.post(gen.url + "/generate", timeout=60, json={
            "text": noise[i:i + 8], "sampling_params": {"max_new_tokens": 0}}).status_code == 200
    assert engine_stats(gen)["evictions"] > evictions
    r = requests.post(gen.url + "/v1/completions", timeout=60, json={
        "prompt": prefix + " the quick brown fox", "max_tokens": 2, "temperature": 0}).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == pin["tokens"]  # the pin's partial block too
    deleted = requests.delete(gen.url + f"/v1/pins/{pin['id']}", timeout=10)
    assert deleted.json() == {"id": pin["id"], "object": "pin", "deleted": True}
    again = requests.delete(gen.url + f"/v1/pins/{pin['id']}", timeout=10)
    assert again.status_code == 404 and again.json()["error"]["param"] == "pin"
    assert pin not in requests.get(gen.url + "/v1/pins", timeout=10).json()["data"]


def test_a_chat_extends_a_pinned_system_prompt(gen):
    system = [{"role": "system", "content": SYSTEM}]
    pin = requests.post(gen.url + "/v1/pins", json={"messages": system}, timeout=60).json()
    try:
        r = requests.post(gen.url + "/v1/chat/completions", timeout=60, json={
            "messages": [*system, {"role": "user", "content": "hello"}], "max_tokens": 2}).json()
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == pin["tokens"]
    finally:
        requests.delete(gen.url + f"/v1/pins/{pin['id']}", timeout=10)


def test_a_streaming_client_that_stops_reading_is_dropped_after_the_write_timeout(tmp_path, long_llama):
    """It keeps its socket open and reads nothing. Once its receive window is full nothing more leaves the
    server, and `--write-timeout-s` later the stream is aborted and its thread and blocks come back (the answer
    it asked for, 4,000 tokens, would have run on for many seconds more)."""
    from serving_support import GEN_ENGINE_FLAGS, LONG_LLAMA_BLOCKS, ServerProcess

    proc = ServerProcess(tmp_path / "stall.log", ["--generate-only", "--generate-model", str(long_llama),
                                                  *GEN_ENGINE_FLAGS, *LONG_LLAMA_BLOCKS, "--write-timeout-s", "1"])
    server = proc.running()
    try:
        body = json.dumps({"prompt": "the quick brown fox", "max_tokens": 4000, "temperature": 0,
                           "ignore_eos": True, "stream": True}).encode()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: it fills in a moment
        sock.connect(("127.0.0.1", server.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        started = time.monotonic()
        stats = engine_stats(server)
        while time.monotonic() - started < 30:
            stats = engine_stats(server)
            if stats["finished"].get("completions"):
                break
            time.sleep(0.2)
        assert stats["finished"].get("completions") == {"abort": 1}, stats["finished"]
        assert stats["running_requests"] == 0 and stats["free_blocks"] + stats["cached_blocks"] == stats["num_blocks"]
        r = requests.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200  # served meanwhile, the unread socket still open
        sock.close()
    finally:
        proc.stop()
