"""The generation benchmark's harness against peer servers it starts: what it counts, and what it does when
a peer dies mid-run (llama-cpp-python built for a CPU feature the machine will not run segfaults on its first
request). The peers here are small real HTTP servers on loopback with the behaviour under test."""

from __future__ import annotations

import io
import sys
import textwrap
import threading
import time
from types import SimpleNamespace

import pytest

from serving.bench import ServerProcess, plot_by_clients, run_clients
from serving.gateway.bench import GatewayProcess
from serving.generate.bench import Peer, _measure_baseline, _table

PEER = textwrap.dedent('''
    import json, os, signal, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    MODE = sys.argv[2]
    if MODE == "exit":
        print("error: unknown model architecture", file=sys.stderr)
        sys.exit(3)

    class Peer(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_GET(self):
            body = json.dumps({"data": [{"id": "peer-model"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if MODE == "crash":
                print("ggml: illegal instruction in a kernel", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGSEGV)
            # every token but the last two sends a chunk: those two have no text (special tokens)
            n = request["max_tokens"]
            events = [{"choices": [{"index": 0, "delta": {"content": "x"}}]} for _ in range(n - 2)]
            events.append({"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": n,
                                                    "prompt_tokens_details": {"cached_tokens": 5}}})
            body = "".join(f"data: {json.dumps(e)}\\n\\n" for e in events) + "data: [DONE]\\n\\n"
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())

    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Peer).serve_forever()
''')


def _peer(tmp_path, mode: str) -> Peer:
    script = tmp_path / "peer.py"
    script.write_text(PEER)
    peer = Peer(f"{mode}-peer", lambda port: [sys.executable, str(script), str(port), mode], "/health")
    peer.wait_ready()
    return peer


def _measure(peer: Peer, levels: list[int], out: io.StringIO) -> dict:
    try:
        return _measure_baseline(peer.label, peer.url, "a system prompt", ARGS, levels, out, peer.exited)
    finally:
        peer.stop()


ARGS = SimpleNamespace(new_tokens=8, warmup=0.0, seconds=0.5)


def test_a_peer_that_dies_is_reported_with_its_cause_and_the_run_goes_on(tmp_path):
    out = io.StringIO()
    got = _measure(_peer(tmp_path, "crash"), [1, 4], out)
    assert got == {}
    assert "crash-peer clients   1: not measured: crash-peer exited (signal SIGSEGV)" in out.getvalue()
    assert "illegal instruction in a kernel" in out.getvalue()
    assert "clients   4" not in out.getvalue()  # its later levels are left out, not measured against a dead port


def test_a_peer_that_never_starts_says_why(tmp_path):
    with pytest.raises(SystemExit, match=r"exit-peer exited \(exit code 3\): error: unknown model"):
        _peer(tmp_path, "exit")


def test_a_server_that_exits_is_named_by_the_bench_that_started_it():
    """`bench soak` and `bench gateway` start servers too, and their errors said `bench serve`. (Both servers
    refuse their flags before they bind a port.)"""
    with pytest.raises(SystemExit, match=r"^pagoda bench soak: error: the server exited \(exit code 2\): pagoda serve: "
                                         r"error: --workers / PAGODA_WORKERS must be in 1..256, got 0"):
        ServerProcess(["--workers", "0"], command="bench soak").wait_ready(timeout=120)
    with pytest.raises(SystemExit, match=r"^pagoda bench gateway: error: the gateway exited \(exit code 2\): pagoda "
                                         r"gateway: error: --upstream / PAGODA_UPSTREAM: 'nonsense' is not NAME=URL"):
        GatewayProcess(["--upstream", "nonsense"]).wait_ready(timeout=120)


def test_tokens_are_counted_from_usage_not_from_chunks(tmp_path):
    out = io.StringIO()
    got = _measure(_peer(tmp_path, "ok"), [2], out)
    stats = got[2]
    assert stats["errors"] == 0 and stats["n"] > 0
    assert stats["per_request"] == 8.0  # the usage's 8 tokens, though only 6 chunks carried text
    assert stats["hit"] == 0.5
    assert "8.0 tokens/request" in out.getvalue()


def test_warm_each_starts_the_clock_after_every_client_has_made_one_call():
    seen: list[tuple[int, int, float]] = []
    lock = threading.Lock()

    def call(session, c: int, i: int) -> int:
        time.sleep(0.05 * (c + 1) if i == 0 else 0.01)  # first calls of unequal length: the slowest sets the clock
        with lock:
            seen.append((c, i, time.monotonic()))
        return i

    window = run_clients(call, 3, 0.0, 0.3, warm_each=True)
    firsts = [t for c, i, t in seen if i == 0]
    assert len(firsts) == 3 and window.start >= max(firsts)
    assert all(i >= 1 for _, i in window.calls)  # no warm-up call is measured
    assert {c for c, i, _ in seen if i >= 1} == {0, 1, 2}


def test_the_plot_draws_a_peer_that_died_over_the_levels_it_has(tmp_path):
    path = tmp_path / "sub" / "generate.png"
    plot_by_clients(str(path), [1, 8, 32], [
        ("throughput", "output tokens / s", {"pagoda": {1: 18.0, 8: 58.0, 32: 150.0}, "llama.cpp": {1: 31.0}}),
        ("time to first token", "TTFT p50 (ms)", {"pagoda": {1: 124.0, 8: 404.0, 32: 1019.0}, "llama.cpp": {1: 255.0}})])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_table_leaves_transformers_out_when_it_was_not_measured():
    """`--hf-rounds 0` skips transformers (its batches take most of a run): the table and the goal line say so
    instead of dividing by rounds that never ran."""
    stats = {"tok_s": 100.0, "ttft_p50": 10.0, "ttft_p99": 20.0, "itl_p50": 5.0, "hit": 0.9}
    out = io.StringIO()
    _table({"pagoda": {1: stats, 8: stats}, "llama.cpp server": {1: {**stats, "tok_s": 50.0}}}, [1, 8], 0.97, 20.0, out)
    text = out.getvalue()
    assert "vs transformers" not in text and "| 1 | 100.0 | 10 / 20 | 5.0 | 0.90 | 50.0 | 2.00x |" in text
    assert "| 8 | 100.0 | 10 / 20 | 5.0 | 0.90 | failed | n/a |" in text
    assert "8 clients: transformers not measured (--hf-rounds 0)" in text
