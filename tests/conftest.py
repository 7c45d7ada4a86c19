"""Shared fixtures: tiny random Laya checkpoints in the official layout, built once per session."""

import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

# pytest puts tests/ first on sys.path, where tests/laya (no __init__.py) would shadow the real
# `laya` package as a namespace package; the repository root must come first.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def laya_checkpoint(tmp_path_factory):
    """`laya_checkpoint(**build_checkpoint_args) -> path`, each distinct argument set built once."""
    from laya.testing import build_checkpoint

    built: dict[str, str] = {}

    def build(**kwargs) -> str:
        key = json.dumps(kwargs, sort_keys=True)
        if key not in built:
            built[key] = build_checkpoint(tmp_path_factory.mktemp("laya"), **kwargs)
        return built[key]

    return build


@pytest.fixture(scope="session")
def laya_tiny_modernbert(laya_checkpoint) -> str:
    """Path of a tiny ModernBERT-encoder checkpoint (F16 weights, as released)."""
    return laya_checkpoint(arch="modernbert")


@pytest.fixture(scope="session")
def laya_tiny_bert(laya_checkpoint) -> str:
    """Path of a tiny BERT-encoder checkpoint (F32 weights)."""
    return laya_checkpoint(arch="bert", dtype="f32")


class _Canned(BaseHTTPRequestHandler):
    """Answers every POST, after `delay` seconds, with `status` and the JSON `body`."""

    delay = 0.0
    body = b"{}"
    status = 200
    arrived: threading.Event

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["Content-Length"]))
        self.arrived.set()
        time.sleep(self.delay)
        try:
            self.send_response(self.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(self.body)))
            self.end_headers()
            self.wfile.write(self.body)
        except OSError:
            pass   # the client gave up first

    def log_message(self, *args) -> None:
        pass


class CannedURL(str):
    """The canned server's base URL; `arrived` is set once a request has reached it."""

    arrived: threading.Event


@pytest.fixture
def canned_http():
    """`canned_http(delay, body, status=200) -> base URL`: a real HTTP server on loopback that answers any POST
    with `body` after `delay` seconds: a slow, failing or nonsensical upstream for the clients under test."""
    servers = []

    def start(delay: float, body: bytes, status: int = 200) -> CannedURL:
        arrived = threading.Event()
        handler = type("Handler", (_Canned,), {"delay": delay, "body": body, "status": status, "arrived": arrived})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        url = CannedURL(f"http://127.0.0.1:{server.server_address[1]}")
        url.arrived = arrived
        return url

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()
