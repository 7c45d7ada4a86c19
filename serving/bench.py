"""What every `pagoda bench serve` mode shares: a real `pagoda serve` subprocess and closed-loop clients.

A mode (the decision API's batching off vs on, in `serving.decide.bench`; a generation mode next) starts
servers with its own flags, drives one of their routes with `closed_loop` and reports ratios against a
baseline measured in the same run, because absolute numbers on a shared machine are noise. The client
threads share the machine with the server, which flatters no mode.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import requests

T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`pagoda serve FLAGS` on a free loopback port, its stderr kept for the error when it dies."""

    def __init__(self, flags: list[str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "serving.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--no-access-log", *flags]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=self.log)

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise SystemExit(f"bench serve: the server exited: {self.log.read().decode()[-2000:]}")
            try:
                if requests.get(self.url + "/ready", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.25)
        raise SystemExit(f"bench serve: the server was not ready within {timeout:.0f}s")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def run_clients(call: Callable[[requests.Session, int, int], T | None], clients: int, warmup: float,
                seconds: float) -> tuple[list[T], int]:
    """`clients` threads, one keep-alive session each, each calling `call(session, client, i)` the moment its
    last call returned (None or an exception is an error); returns the results of the calls that ended
    inside the measured window (after `warmup`, for `seconds`) and how many of those failed."""
    results: list[list[T]] = [[] for _ in range(clients)]
    errors = [0] * clients
    t_measure = time.monotonic() + warmup
    t_end = t_measure + seconds

    def client(c: int) -> None:
        i = 0
        with requests.Session() as session:
            while time.monotonic() < t_end:
                try:
                    result = call(session, c, i)
                except requests.RequestException:
                    result = None
                i += 1
                if t_measure <= time.monotonic() <= t_end:
                    if result is None:
                        errors[c] += 1
                    else:
                        results[c].append(result)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for per in results for r in per], sum(errors)


def closed_loop(url: str, body_for: Callable[[int, int], dict], clients: int, warmup: float, seconds: float) -> dict:
    """Closed-loop POSTs of `body_for(client, i)` to `url`; returns rps, p50/p99 ms, n ok and errors."""
    def call(session: requests.Session, c: int, i: int) -> float | None:
        started = time.monotonic()
        ok = session.post(url, json=body_for(c, i), timeout=120).status_code == 200
        return (time.monotonic() - started) * 1000 if ok else None

    flat, errors = run_clients(call, clients, warmup, seconds)
    p50, p99 = np.percentile(flat, [50, 99]) if flat else (float("nan"), float("nan"))
    return {"rps": len(flat) / seconds, "p50": float(p50), "p99": float(p99), "n": len(flat), "errors": errors}
