"""Shared by the serving tests: a real `pagoda serve` subprocess on an ephemeral loopback port."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

REPO = Path(__file__).resolve().parents[2]
# Committed by the Laya core tests: a tiny random BERT checkpoint (1024 positions) in the official layout.
TINY_BERT = REPO / "tests/fixtures/laya/bert-tiny"
BILLING_STATE = "Hi, we were billed twice for March. Please refund the duplicate today or we will cancel our plan."
API_KEY = "s3cret-test-key"
# The generation servers' engine: small blocks and pool, so prefix reuse and eviction show on short prompts.
GEN_ENGINE_FLAGS = ["--generate-block-size", "4", "--generate-num-blocks", "512", "--generate-torch-threads", "1"]
LONG_LLAMA_BLOCKS = ["--generate-num-blocks", "4096"]   # a pool for the 16k-position `long_llama` at block size 4


def heavy_questions(n: int = 40) -> dict:
    """Many distinct questions: with a long state and max_len 1000 they keep the model busy for a while
    (seconds on 2 shared cores, a fair fraction of one on an idle machine)."""
    return {f"q{i}": {"type": "noul", "instructions": f"Does the message mention item number {i}?"}
            for i in range(n)}


def routes_served_and_documented(app) -> tuple[set, set]:
    """(path, method) pairs the Flask app serves, in OpenAPI's spelling (`<model>` as `{model}`), and those its
    `/openapi.json` documents (a path item's `parameters` is not a method)."""
    served = {(re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule.rule), method.lower())
              for rule in app.url_map.iter_rules() if rule.endpoint != "static"
              for method in rule.methods - {"HEAD", "OPTIONS"}}
    doc = app.test_client().get("/openapi.json").get_json()
    documented = {(path, method) for path, item in doc["paths"].items() for method in item
                  if method in {"get", "post", "put", "delete", "patch"}}
    return served, documented


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`pagoda serve FLAGS` as a subprocess; `running()` (re)starts it, so a test may stop it for good."""

    def __init__(self, log_path: Path, flags: list[str], env: dict[str, str | None] | None = None,
                 port: int | None = None):
        """`port`: the one to listen on (a server redeployed where another was); otherwise a free one each start.
        `env`: variables to set, or to unset with None."""
        self.flags = flags
        self.fixed_port = port
        self.log_path = log_path
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("PAGODA_")}
        # Decision servers leave the LLM off (`--generate-model` flags win over this): loading it is the
        # generation tests' business, and the decision tests must not wait for it.
        self.env.update({"HF_HUB_OFFLINE": "1", "PAGODA_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1",
                         "TOKENIZERS_PARALLELISM": "false", "PAGODA_GENERATE_MODEL": "none", **(env or {})})
        self.env = {k: v for k, v in self.env.items() if v is not None}
        self.proc: subprocess.Popen | None = None
        self._ready = False
        self.start()

    def start(self) -> None:
        self.port = self.fixed_port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "serving.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
             *self.flags], cwd=REPO, env=self.env, stdout=self._log, stderr=subprocess.STDOUT)
        self._ready = False
        self.ready_statuses: list[int] = []  # what /ready answered while the model loaded

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def first_answer(self, timeout: float = 120.0) -> None:
        """Poll /ready until the process answers at all, recording what it said (503 while loading)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                self.ready_statuses.append(requests.get(self.url + "/ready", timeout=5).status_code)
                return
            except (requests.ConnectionError, requests.Timeout):
                time.sleep(0.05)

    def running(self, timeout: float = 240.0, headers: dict | None = None) -> ServerProcess:
        if self.proc.poll() is not None and self._ready:
            self.start()  # a test stopped it on purpose
        if self._ready:
            return self
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                status = requests.get(self.url + "/ready", headers=headers, timeout=5).status_code
                self.ready_statuses.append(status)
                if status == 200:
                    self._ready = True
                    return self
            except (requests.ConnectionError, requests.Timeout):
                pass
            time.sleep(0.25)
        pytest.fail(f"server not ready after {timeout}s:\n{self.log()[-3000:]}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


STUDENT_TASK = {  # the `student_folder` fixture's: a linear student over the tiny BERT, distilled in seconds
    "name": "serve-triage", "text_field": "text",
    "questions": {
        "department": {"type": "choice", "instructions": "Which department should handle this ticket?",
                       "criteria": {"billing": "invoices, payments, refunds", "technical": "bugs, outages",
                                    "other": "everything else"}},
        "churn": {"type": "noul", "instructions": "Does the user threaten to cancel or leave?"},
    },
    "gold": {"department": "department", "churn": "churn"},
    "labels": {"chunk_rows": 40, "batch_size": 16},
    "split": {"holdout": 0.25, "validation": 0.15},
    "student": {"kind": "linear", "max_len": 64, "baseline": False},
    "export": {"check_rows": 8},
    "report": {"singles": 1, "teacher_singles": 1, "batches": 1, "batch_size": 2},
}
