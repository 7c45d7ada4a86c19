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
from dataclasses import dataclass
from typing import Any

import numpy as np
import requests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`pagoda serve FLAGS` on a free loopback port, its stderr kept for the error when it dies. A subclass
    starts another server (laya-serve, a llama.cpp peer) and names itself and the path that answers once
    it is ready."""

    label = "the server"
    ready_path = "/ready"
    command = "bench serve"  # the bench that started it, for its errors

    def __init__(self, flags: list[str], command: str | None = None):
        self.command = command or self.command
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "serving.cli", "serve", *self.argv(flags, self.port)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=self.log)

    @staticmethod
    def argv(flags: list[str], port: int = 0) -> list[str]:
        """The command line after `pagoda serve`: what a bench checks (`serving.app.check_serve_argv`) is what runs."""
        return ["--host", "127.0.0.1", "--port", str(port), "--no-access-log", *flags]

    def exited(self) -> str | None:
        """Why the process is gone (its exit code or signal, then the end of its stderr), or None while it runs."""
        code = self.proc.poll()
        if code is None:
            return None
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        self.log.seek(0)
        return f"{self.label} exited ({how}): {self.log.read().decode(errors='replace').strip()[-2000:]}"

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if why := self.exited():
                raise SystemExit(f"pagoda {self.command}: error: {why}")
            try:
                if requests.get(self.url + self.ready_path, timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.25)
        raise SystemExit(f"pagoda {self.command}: error: {self.label} was not ready within {timeout:.0f}s")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@dataclass
class Window:
    """The measured window of a closed-loop run: every call that ended after `start` (clients start none
    after `end`), as (time it ended, its result or None for a failure)."""

    start: float
    end: float
    calls: list[tuple[float, Any]]

    def inside(self) -> tuple[list[Any], int]:
        """Results of the calls that ended inside the window, and how many of those failed."""
        ended = [r for t, r in self.calls if t <= self.end]
        return [r for r in ended if r is not None], sum(r is None for r in ended)


def run_clients(call: Callable[[requests.Session, int, int], Any], clients: int, warmup: float,
                seconds: float, warm_each: bool = False) -> Window:
    """`clients` threads, one keep-alive session each, each calling `call(session, client, i)` the moment its
    last call returned (None or an exception is a failure), until `warmup + seconds` have passed.

    `warm_each`: every client first makes one unmeasured call and the clock starts when all have, so a server
    whose caches are per connection or per slot (llama.cpp's) is measured warm, as ours is."""
    calls: list[list[tuple[float, Any]]] = [[] for _ in range(clients)]
    clock: dict[str, float] = {}
    ready = threading.Barrier(clients, action=lambda: clock.update(
        measure=time.monotonic() + warmup, end=time.monotonic() + warmup + seconds))

    def client(c: int) -> None:
        i = 0
        with requests.Session() as session:
            if warm_each:
                try:
                    call(session, c, i)
                except requests.RequestException:
                    pass
                i += 1
            ready.wait()
            while time.monotonic() < clock["end"]:
                try:
                    result = call(session, c, i)
                except requests.RequestException:
                    result = None
                i += 1
                ended = time.monotonic()
                if ended >= clock["measure"]:
                    calls[c].append((ended, result))

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return Window(clock["measure"], clock["end"], [x for per in calls for x in per])


def closed_loop(url: str, body_for: Callable[[int, int], dict], clients: int, warmup: float, seconds: float) -> dict:
    """Closed-loop POSTs of `body_for(client, i)` to `url`; returns rps, p50/p99 ms, n ok and errors."""
    def call(session: requests.Session, c: int, i: int) -> float | None:
        started = time.monotonic()
        ok = session.post(url, json=body_for(c, i), timeout=120).status_code == 200
        return (time.monotonic() - started) * 1000 if ok else None

    flat, errors = run_clients(call, clients, warmup, seconds).inside()
    p50, p99 = np.percentile(flat, [50, 99]) if flat else (float("nan"), float("nan"))
    return {"rps": len(flat) / seconds, "p50": float(p50), "p99": float(p99), "n": len(flat), "errors": errors}


def plot_by_clients(path: str, levels: list[int], panels: list[tuple[str, str, dict[str, dict[int, float]]]]) -> None:
    """One panel per (title, y label, {side: {clients: value}}), sides as lines over the client counts; a side
    missing a level (a peer that died) is drawn over the levels it has."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.5))
    for ax, (title, ylabel, sides) in zip(np.atleast_1d(axes), panels):
        for label, by_level in sides.items():
            xs = [c for c in levels if c in by_level]
            ax.plot(xs, [by_level[c] for c in xs], marker="o", label=label)
        ax.set(xlabel="concurrent clients", ylabel=ylabel, xscale="log", title=title)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
