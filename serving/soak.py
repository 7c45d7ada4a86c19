"""`pagoda bench soak`: mixed decide and generate traffic for N minutes, without and then with hostile connections.

The claim under test is the HTTP front's (serving/server.py): slow and idle connections cost the server a socket,
never a request thread, so good requests keep their latency beside them and the worker's memory stays flat. One
server, two phases of `--minutes` each in the same run: `--clients` closed-loop clients alone (the baseline),
then the same clients plus `--slow` connections (a third trickling their headers a byte a second, a third
sending a body shorter than its Content-Length, a third idle), each reopened as soon as the server cuts it off.
It prints errors, p50/p99 of the good requests per route and the ratio to the baseline (the goal: 0 errors,
p99 within 2x), and the worker's RSS sampled through both phases (the goal: flat after warm-up).
"""

from __future__ import annotations

import itertools
import json
import select
import socket
import threading
import time
from pathlib import Path
from typing import TextIO

STATES = [
    "Hi, we were billed twice for March. Please refund the duplicate today or we will cancel our plan.",
    "The dashboard has been down since this morning and none of our team can log in. Please fix it.",
    "Could you tell me where to find the invoice for last month? No rush.",
    "Your app deleted my files AGAIN. This is the third time, I am moving to a competitor next week.",
]
PROMPTS = ["Write one sentence about the sea.", "Name a colour.", "Say hello to a customer.", "Count to five."]


def register(commands, bench) -> None:
    b = bench.add_parser("soak", help="mixed decide and generate traffic for N minutes at 32 clients, without and "
                                      "with 100 slow and idle connections: errors, p50/p99, worker RSS")
    b.add_argument("--minutes", type=float, default=1.0, help="length of each phase (baseline, then with slow clients)")
    b.add_argument("--clients", type=int, default=32, help="closed-loop clients sending good requests")
    b.add_argument("--slow", type=int, default=100, help="slow and idle connections held open in the second phase")
    b.add_argument("--generate-every", type=int, default=4,
                   help="every Nth request of a client is a chat completion (0: decisions only); half of them stream")
    b.add_argument("--new-tokens", type=int, default=8, help="tokens per chat completion")
    b.add_argument("--model", default=None, help="Laya checkpoint folder (default: the embedded laya-mini)")
    b.add_argument("--generate-model", default=None, help="HF folder or .gguf (default: the server's; none: off)")
    b.add_argument("--torch-threads", type=int, default=1, help="torch threads in the server")
    b.add_argument("--sample-s", type=float, default=10.0, help="seconds between worker RSS samples")
    b.set_defaults(func=run)


def run(args, out: TextIO | None = None) -> int:
    import sys

    import requests

    from serving.bench import ServerProcess
    out = out or sys.stdout
    for flag, ok, want in (("--clients", args.clients >= 1, "a positive count"),
                           ("--slow", args.slow >= 0, "a count >= 0"),
                           ("--minutes", args.minutes > 0, "a positive number"),
                           ("--generate-every", args.generate_every >= 0, "a count >= 0 (0: decisions only)"),
                           ("--new-tokens", args.new_tokens >= 1, "a positive count"),
                           ("--sample-s", args.sample_s > 0, "a positive number of seconds")):
        if not ok:
            print(f"pagoda bench soak: error: {flag}: expected {want}, got {getattr(args, flag[2:].replace('-', '_'))}",
                  file=sys.stderr)
            return 2
    flags = ["--torch-threads", str(args.torch_threads), "--threads", str(max(64, 2 * args.clients))]
    for flag, value in (("--model", args.model), ("--generate-model", args.generate_model)):
        if value is not None:
            flags += [flag, value]
    from serving.app import check_serve_argv

    check_serve_argv(ServerProcess.argv(flags))  # its refusal (a ValueError) is one line from main, naming us
    server = ServerProcess(flags, command="bench soak")
    try:
        server.wait_ready()
        generate = args.generate_every > 0 and "/v1/chat/completions" in requests.get(
            server.url + "/openapi.json", timeout=10).json()["paths"]
        seconds = args.minutes * 60
        rss = RssSampler(server.proc.pid, args.sample_s)
        rss.start()
        warm = min(10.0, seconds / 6)
        print(f"pagoda bench soak: {args.clients} clients, "
              f"{'1 in ' + str(args.generate_every) + ' a chat completion' if generate else 'decisions only'}, "
              f"{seconds:.0f} s per phase after {warm:.0f} s warm-up, then {args.slow} slow/idle connections",
              file=out, flush=True)
        baseline = _phase(server, args, generate, warm, seconds, "baseline")
        rss.mark("slow clients on")
        hostile = Hostile(server.port, args.slow)
        hostile.start()
        try:
            soak = _phase(server, args, generate, 2.0, seconds, f"+{args.slow} slow/idle")
        finally:
            hostile.stop()
        rss.stop()
        _report(out, baseline, soak, hostile, rss, generate)
    finally:
        server.stop()
    return 0


def _phase(server, args, generate: bool, warm: float, seconds: float, name: str) -> dict:
    """Closed-loop clients for `warm + seconds`; results per route inside the measured window."""
    from tqdm import tqdm

    from serving.bench import run_clients

    decide_url, chat_url = server.url + "/decide", server.url + "/v1/chat/completions"

    def call(session, c: int, i: int):
        started = time.monotonic()
        if generate and i % args.generate_every == args.generate_every - 1:
            stream = (i // args.generate_every) % 2 == 1
            body = {"messages": [{"role": "user", "content": PROMPTS[(c + i) % len(PROMPTS)]}],
                    "max_tokens": args.new_tokens, "stream": stream}
            with session.post(chat_url, json=body, timeout=300, stream=stream) as r:
                ok = r.status_code == 200 and (not stream or r.content.rstrip().endswith(b"data: [DONE]"))
            route = "chat stream" if stream else "chat"
        else:
            r = session.post(decide_url, json={"state": STATES[(c + i) % len(STATES)], "preset": "support-triage"},
                             timeout=300)
            ok, route = r.status_code == 200, "decide"
        return (route, (time.monotonic() - started) * 1000) if ok else None

    done = threading.Event()

    def progress() -> None:
        with tqdm(total=round(warm + seconds), desc=name, unit="s", leave=False) as bar:
            for _ in range(round(warm + seconds)):
                if done.wait(1.0):
                    return
                bar.update(1)

    bar = threading.Thread(target=progress, daemon=True)
    bar.start()
    results, errors = run_clients(call, args.clients, warm, seconds).inside()
    done.set()
    by_route: dict[str, list[float]] = {}
    for route, ms in results:
        by_route.setdefault(route, []).append(ms)
    return {"name": name, "errors": errors, "n": len(results), "seconds": seconds,
            "routes": {k: v for k, v in sorted(by_route.items())}, "all": [ms for _, ms in results]}


class Hostile:
    """`n` hostile connections kept open: trickled heads (a byte a second), short bodies, idle sockets. A socket
    the server answers or closes is counted by what it got (408 and the like, or a plain close) and reopened."""

    KINDS = ("trickle", "short body", "idle")

    def __init__(self, port: int, n: int):
        self.port, self.n = port, n
        self.stopping = threading.Event()
        self.outcomes: dict[tuple[str, str], int] = {}
        self.opened = 0
        self._thread = threading.Thread(target=self._run, name="soak-hostile", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self._thread.join(timeout=30)

    def _open(self, kind: str) -> tuple[socket.socket, str, bytes]:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        s.setblocking(False)
        self.opened += 1
        head = b"POST /decide HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
        if kind == "short body":
            s.send(head + b"Content-Length: 4000\r\n\r\n" + b'{"state": "')
            return s, kind, b""
        return s, kind, (head + b"X-Pad: " + b"a" * 4000 if kind == "trickle" else b"")

    def _run(self) -> None:
        socks = [self._open(kind) for kind, _ in zip(itertools.cycle(self.KINDS), range(self.n))]
        next_byte = time.monotonic()
        while not self.stopping.is_set():
            readable, _, _ = select.select([s for s, _, _ in socks], [], [], 0.2)
            for i, (s, kind, _rest) in enumerate(socks):
                if s not in readable:
                    continue
                try:
                    data = s.recv(4096)
                except OSError:
                    data = b""
                status = data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/1.1 ") else "closed"
                self.outcomes[(kind, status)] = self.outcomes.get((kind, status), 0) + 1
                s.close()
                socks[i] = self._open(kind)
            if time.monotonic() >= next_byte:
                next_byte += 1.0
                for i, (s, kind, rest) in enumerate(socks):
                    if kind == "trickle" and rest:
                        try:
                            s.send(rest[:1])
                        except OSError:
                            continue
                        socks[i] = (s, kind, rest[1:])
        for s, _, _ in socks:
            s.close()


class RssSampler:
    """The worker processes' RSS (children of the server's master) every `every` seconds, with phase marks."""

    def __init__(self, master: int, every: float):
        self.master, self.every = master, every
        self.samples: list[tuple[float, float]] = []  # (seconds since start, MB over all workers)
        self.marks: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="soak-rss", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def mark(self, what: str) -> None:
        self.marks.append((time.monotonic() - self._t0, what))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            self.samples.append((time.monotonic() - self._t0, worker_rss_mb(self.master)))
            if self._stop.wait(self.every):
                return


def worker_rss_mb(master: int) -> float:
    total = 0.0
    children = Path(f"/proc/{master}/task/{master}/children")
    for pid in children.read_text().split() if children.exists() else []:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
        except OSError:
            continue
    return total


def _pcts(ms: list[float]) -> tuple[float, float]:
    import numpy as np

    if not ms:
        return float("nan"), float("nan")
    p50, p99 = np.percentile(ms, [50, 99])
    return float(p50), float(p99)


def _report(out: TextIO, baseline: dict, soak: dict, hostile: Hostile, rss: RssSampler, generate: bool) -> None:
    routes = sorted(set(baseline["routes"]) | set(soak["routes"]))
    header = "| phase | good requests | errors | req/s | " + " | ".join(f"{r} p50 / p99 ms" for r in routes) + \
             " | all p99 ms |"
    print(header, file=out)
    print("|" + "---|" * (header.count("|") - 1), file=out)
    for phase in (baseline, soak):
        cells = []
        for r in routes:
            p50, p99 = _pcts(phase["routes"].get(r, []))
            cells.append(f"{p50:.0f} / {p99:.0f}")
        print(f"| {phase['name']} | {phase['n']} | {phase['errors']} | {phase['n'] / phase['seconds']:.1f} | "
              + " | ".join(cells) + f" | {_pcts(phase['all'])[1]:.0f} |", file=out)
    ratios = []
    for r in [*routes, "all"]:
        b = _pcts(baseline["all"] if r == "all" else baseline["routes"].get(r, []))[1]
        s = _pcts(soak["all"] if r == "all" else soak["routes"].get(r, []))[1]
        ratios.append(f"{r} {s / b:.2f}x" if b == b and s == s and b > 0 else f"{r} -")
    print(f"p99 with slow clients vs baseline: {', '.join(ratios)} (goal: within 2x); errors "
          f"{baseline['errors']} + {soak['errors']} (goal: 0)", file=out)
    got = ", ".join(f"{kind} -> {status}: {n}" for (kind, status), n in sorted(hostile.outcomes.items()))
    print(f"hostile connections: {hostile.opened} opened; the server cut them off as: {got or 'none yet'}", file=out)
    marks = " ".join(f"[{what} at {t:.0f} s]" for t, what in rss.marks)
    series = " ".join(f"{t:.0f}s:{mb:.0f}" for t, mb in rss.samples)
    print(f"worker RSS MB over time {marks}: {series}", file=out)
    if len(rss.samples) >= 4:
        settled = [mb for _, mb in rss.samples[len(rss.samples) // 4:]]
        print(f"worker RSS after warm-up: min {min(settled):.0f} MB, max {max(settled):.0f} MB, "
              f"last - first {settled[-1] - settled[0]:+.0f} MB", file=out)
    print(json.dumps({"baseline_p99_ms": _pcts(baseline["all"])[1], "soak_p99_ms": _pcts(soak["all"])[1],
                      "errors": baseline["errors"] + soak["errors"], "generate": generate}), file=out)
