"""`pagoda bench serve`: closed-loop HTTP clients against a real server, cross-request batching off vs on.

Each mode gets its own `pagoda serve` subprocess on a free loopback port; at each concurrency level, N
client threads (one keep-alive session each) send the next request as soon as the last one answered,
for `--seconds` after a `--warmup`. Figures are reported as ratios against the batching-off run made in
the same invocation, because absolute numbers on a shared machine are noise; the client threads share
the machine with the server, which flatters neither mode.
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
from pathlib import Path
from typing import TextIO

import requests

STATES = [
    "Hi, we were billed twice for March. Please refund the duplicate today or we will cancel our plan.",
    "The dashboard has been down since this morning and none of our team can log in. Please fix it.",
    "Could you tell me where to find the invoice for last month? No rush.",
    "I love the new release, thanks! One question: can I change the plan of my second account?",
    "Your app deleted my files AGAIN. This is the third time, I am moving to a competitor next week.",
    "Hello, I'd like to know whether you ship to Norway and how long delivery usually takes.",
]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    def __init__(self, args, batching: bool, threads: int):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "serving.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--threads", str(threads), "--batching" if batching else "--no-batching", "--no-access-log",
               "--torch-threads", str(args.torch_threads)]
        for flag, value in (("--model", args.model), ("--student", args.student),
                            ("--max-wait-ms", args.max_wait_ms)):
            if value is not None:
                cmd += [flag, str(value)]
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


def _rows_per_pass(url: str) -> tuple[int, int]:
    """(question rows, forward passes) so far, from the server's /stats histogram."""
    histogram = requests.get(url + "/stats", timeout=10).json()["batch_size_histogram"]
    return sum(int(k) * v for k, v in histogram.items()), sum(histogram.values())


def _closed_loop(url: str, body_for, clients: int, warmup: float, seconds: float) -> dict:
    latencies: list[list[float]] = [[] for _ in range(clients)]
    errors = [0] * clients
    t_measure = time.monotonic() + warmup
    t_end = t_measure + seconds

    def client(c: int) -> None:
        i = 0
        with requests.Session() as session:
            while True:
                started = time.monotonic()
                if started >= t_end:
                    return
                try:
                    ok = session.post(url, json=body_for(c, i), timeout=120).status_code == 200
                except requests.RequestException:
                    ok = False
                done = time.monotonic()
                i += 1
                if t_measure <= done <= t_end:  # closed loop: every completion inside the window counts
                    if ok:
                        latencies[c].append((done - started) * 1000)
                    else:
                        errors[c] += 1

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    flat = [x for per in latencies for x in per]
    return {"rps": len(flat) / seconds, "p50": _percentile(flat, 0.5), "p99": _percentile(flat, 0.99),
            "n": len(flat), "errors": sum(errors)}


def run_bench(args, levels: list[int], out: TextIO) -> int:
    if args.student:
        def body_for(c: int, i: int) -> dict:
            return {"state": f"{STATES[(c + i) % len(STATES)]} (#{c}-{i})"}
    else:
        def body_for(c: int, i: int) -> dict:
            return {"state": f"{STATES[(c + i) % len(STATES)]} (#{c}-{i})", "preset": args.preset}
    results: dict[bool, dict[int, dict]] = {}
    threads = max(64, 2 * max(levels))
    for batching in (False, True):
        server = _Server(args, batching, threads)
        try:
            server.wait_ready()
            results[batching] = {}
            for clients in levels:
                before = _rows_per_pass(server.url)
                results[batching][clients] = stats = _closed_loop(server.url + "/decide", body_for, clients,
                                                                  args.warmup, args.seconds)
                after = _rows_per_pass(server.url)
                passes = after[1] - before[1]
                rows = (after[0] - before[0]) / passes if passes else float("nan")
                print(f"batching {'on ' if batching else 'off'} clients {clients:>3}: {stats['rps']:8.1f} "
                      f"decisions/s  p50 {stats['p50']:7.1f} ms  p99 {stats['p99']:7.1f} ms  "
                      f"({stats['n']} ok, {stats['errors']} errors; {rows:.1f} question rows per forward)",
                      file=out, flush=True)
        finally:
            server.stop()
    off, on = results[False], results[True]
    if not args.student:
        print(_model_ceiling(args, 16 if 16 in levels else max(levels)), file=out)
    single_p50 = off[min(levels)]["p50"]
    print(f"\nmodel: {args.model or args.student or 'laya-mini (embedded default)'}; {args.seconds:g}s per cell; "
          f"single-client p50 (batching off, {min(levels)} client) {single_p50:.1f} ms", file=out)
    print("| clients | off dec/s | off p50 ms | off p99 ms | on dec/s | on p50 ms | on p99 ms | on/off dec/s "
          "| on p99 / single p50 |", file=out)
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|", file=out)
    def ratio(x: float, y: float) -> float:
        return x / y if y and y == y else float("nan")

    for c in levels:
        a, b = off[c], on[c]
        print(f"| {c} | {a['rps']:.1f} | {a['p50']:.1f} | {a['p99']:.1f} | {b['rps']:.1f} | {b['p50']:.1f} | "
              f"{b['p99']:.1f} | {ratio(b['rps'], a['rps']):.2f}x | {ratio(b['p99'], single_p50):.2f}x |", file=out)
    if args.plot:
        _plot(levels, off, on, Path(args.plot))
        print(f"plot: {args.plot}", file=out)
    return 0


def _model_ceiling(args, clients: int) -> str:
    """The most any batcher can gain on this model and machine: one forward over `clients` requests'
    rows against `clients` forwards of one request each, in this process, no HTTP."""
    import statistics

    import torch
    import yaml

    import laya

    torch.set_num_threads(args.torch_threads or torch.get_num_threads())
    agent = laya.load(args.model)
    questions = yaml.safe_load(Path(__file__).with_name("presets.yaml").read_text())[args.preset]
    prepared = [agent.prepare(f"{STATES[i % len(STATES)]} (#{i})", questions) for i in range(clients)]

    def timed(fn) -> float:
        fn()
        runs = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - t)
        return statistics.median(runs)

    one = timed(lambda: [agent.forward(p.rows) for p in prepared])
    together = timed(lambda: agent.forward([r for p in prepared for r in p.rows]))
    return (f"model-level ceiling: {clients} requests' rows in one forward take {together * 1000:.0f} ms vs "
            f"{one * 1000:.0f} ms one request at a time ({one / together:.2f}x): no batcher can gain more "
            f"on this model and machine")


def _plot(levels: list[int], off: dict, on: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    for label, data in (("batching off", off), ("batching on", on)):
        ax1.plot(levels, [data[c]["rps"] for c in levels], marker="o", label=label)
        ax2.plot(levels, [data[c]["p99"] for c in levels], marker="o", label=label)
    ax1.set(xlabel="concurrent clients", ylabel="decisions / s", xscale="log", title="throughput")
    ax2.set(xlabel="concurrent clients", ylabel="p99 latency (ms)", xscale="log", title="tail latency")
    for ax in (ax1, ax2):
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
