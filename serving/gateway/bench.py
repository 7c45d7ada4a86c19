"""`pagoda bench gateway`: what the gateway costs against calling its upstream directly, measured in the
same run on the same upstream process, so load from other jobs on a shared machine hits both alike.

Rows: non-streamed chat (1 token) p50/p99 and a stream's time to first token, one client, direct and
gateway requests alternating one by one (`--requests` each); output tokens/s of `--streams` concurrent
closed-loop streams, direct and gateway rounds alternating (order swapped every round); the CPU the
gateway and the upstream processes spend (from /proc), which is what the throughput ratio comes down to
when both share the cores; and the cost of a routing decision: requests alternating between the plain
gateway and one that asks one Laya question per request (laya-mini, then a distilled student), plus the
decision time the gateway itself measured (`/stats`). The upstream is `pagoda serve --generate-only` on
one torch thread; every server runs without its access log, as `pagoda bench serve` runs them.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import requests
import yaml

from serving.app import check_serve_argv
from serving.bench import ServerProcess, free_port
from serving.generate.bench import messages, stream_chat, stream_loop

SYSTEM = "You are a helpful assistant. Answer briefly."
NEEDS_REASONING = {"type": "noul", "instructions": "Does answering this need several steps of reasoning, maths "
                                                   "or code?"}
DEFAULT_STUDENT = Path("models/students/support-triage")


class GatewayProcess(ServerProcess):
    """`pagoda gateway FLAGS` on a free loopback port: `ServerProcess`'s lifecycle, the other command."""

    label = "the gateway"
    command = "bench gateway"

    def __init__(self, flags: list[str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "serving.cli", "gateway", *self.argv(flags, self.port)],
            env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"},
            stdout=subprocess.DEVNULL, stderr=self.log)

    @classmethod
    def check(cls, flags: list[str]) -> None:
        """Raise the `ValueError` `pagoda gateway FLAGS` would refuse to start with, or its worker to build the
        decision model the bench's rules ask (as `serving.app.check_serve_argv` does for a server), before the
        first server starts: the routed gateways start last, after minutes of measurement."""
        from serving.gateway.config import GatewayConfig, add_arguments

        parser = argparse.ArgumentParser(prog="pagoda gateway", conflict_handler="resolve")
        add_arguments(parser)
        GatewayConfig.load(vars(parser.parse_args(cls.argv(flags, 0))))


UPSTREAM = "edge=http://127.0.0.1:1"  # what a gateway's flags are checked with, before its upstream has a port


def run_bench(args: Any, out: TextIO) -> int:
    model = args.generate_model or "default"
    flags = ["--generate-only", "--generate-model", model, "--generate-name", "bench-llm", "--generate-torch-threads", "1"]
    setups = [] if args.skip_decisions else decision_setups(args)
    check_serve_argv(ServerProcess.argv(flags))  # every server's flags before the first starts: the decision rows last
    for gateway_flags in [[], *(setup[2] for setup in setups)]:
        GatewayProcess.check(["--upstream", UPSTREAM, *gateway_flags])
    upstream = ServerProcess(flags, command="bench gateway")
    started: list[ServerProcess] = [upstream]
    try:
        upstream.wait_ready()
        plain = GatewayProcess(["--upstream", f"edge={upstream.url}"])
        started.append(plain)
        plain.wait_ready()
        out.write(f"pagoda bench gateway: upstream {model} at {upstream.url}; {args.rounds} alternating rounds, "
                  f"{args.seconds:g}s each\n")
        pass_through(args, upstream, plain, out)
        if setups:
            decisions(args, setups, upstream.url, plain.url, started, out)
    finally:
        for proc in started:
            proc.stop()
    return 0


def alternate(rounds: int, direct: Any, gateway: Any) -> tuple[list, list]:
    """`rounds` rounds of each, alternating, the order swapped every round."""
    a, b = [], []
    for r in range(rounds):
        if r % 2 == 0:
            a.append(direct())
            b.append(gateway())
        else:
            b.append(gateway())
            a.append(direct())
    return a, b


def chat_body(i: int, stream: bool = False) -> dict:
    return {"model": "bench-llm", "messages": messages(SYSTEM, 0, i), "max_tokens": 1, "temperature": 0,
            "stream": stream}


def interleaved(n: int, urls: tuple[str, str], stream: bool) -> tuple[np.ndarray, np.ndarray]:
    """`n` requests to each of two servers, one at a time and alternating request by request (the order
    swapped every pair), so a load spike from another job lands on both sides alike. Milliseconds to the
    whole answer, or to a stream's first token."""
    times: tuple[list[float], list[float]] = ([], [])
    with requests.Session() as a, requests.Session() as b:
        sessions = (a, b)
        for i in range(n + 2):  # two warm-up pairs
            for side in ((0, 1) if i % 2 == 0 else (1, 0)):
                if stream:
                    got = stream_chat(sessions[side], urls[side], {**chat_body(i), "max_tokens": 4})
                    ms = (got["times"][0] - got["started"]) * 1000 if got and got["times"] else None
                else:
                    started = time.perf_counter()
                    ok = sessions[side].post(urls[side] + "/v1/chat/completions", json=chat_body(i),
                                             timeout=60).status_code == 200
                    ms = (time.perf_counter() - started) * 1000 if ok else None
                if ms is None:
                    raise SystemExit(f"bench gateway: a request to {urls[side]} failed")
                if i >= 2:
                    times[side].append(ms)
    return np.array(times[0]), np.array(times[1])


def latency_rows(label: str, direct: np.ndarray, gateway: np.ndarray) -> list[tuple]:
    rows = []
    for q in (50, 99):
        d, g = float(np.percentile(direct, q)), float(np.percentile(gateway, q))
        rows.append((f"{label}: p{q} ms", d, g, g - d, g / d, ""))
    rows[0] = (*rows[0][:5], f"paired median {float(np.median(gateway - direct)):+.3f} ms")
    return rows


def pass_through(args: Any, upstream: ServerProcess, gateway: ServerProcess, out: TextIO) -> None:
    urls = (upstream.url, gateway.url)
    before = cpu_seconds(gateway)
    d, g = interleaved(args.requests, urls, stream=False)
    per_request = (cpu_seconds(gateway) - before) / (args.requests + 2) * 1000
    rows = latency_rows(f"chat, 1 token, {args.requests} alternating requests", d, g)
    d, g = interleaved(args.requests, urls, stream=True)
    rows += latency_rows("stream, time to first token", d, g)

    def streams(url: str):
        return lambda: stream_loop(url, "bench-llm", SYSTEM, args.new_tokens, args.streams, 1.0, args.seconds)

    d, g = alternate(args.rounds, costed(streams(upstream.url), None, upstream),
                     costed(streams(gateway.url), gateway, upstream))
    ratios = np.array([b["tok_s"] / a["tok_s"] for a, b in zip(d, g)])
    dm, gm = _median(d, "tok_s"), _median(g, "tok_s")
    rows.append((f"{args.streams} streams x {args.new_tokens} tokens: output tok/s ({args.rounds} rounds)", dm, gm,
                 gm - dm, float(np.median(ratios)), f"round ratios {ratios.min():.2f}-{ratios.max():.2f}"))
    errors = sum(r["errors"] for r in d + g)
    covered = 1.0 + args.seconds  # the seconds of streaming a round's CPU covers (its warm-up included)
    out.write(_table(("measure", "direct", "gateway", "added", "gateway/direct", "note"), rows))
    out.write(f"(throughput: medians over rounds, ratio the median of per-round ratios; failed requests in "
              f"the stream rounds: {errors})\n")
    out.write(f"CPU: the gateway spends {per_request:.2f} ms per non-streamed request and "
              f"{_median(g, 'cpu_s') / (gm * covered) * 1e6:.0f} us per streamed token; the upstream "
              f"{_median(d, 'upstream_cpu_s') / (dm * covered) * 1e6:.0f} us per token when called directly\n")


def costed(measure: Any, gateway: ServerProcess | None, upstream: ServerProcess):
    """`measure`, with the CPU seconds the gateway and the upstream processes spent during it."""
    def run() -> dict:
        before = (cpu_seconds(gateway) if gateway else 0.0, cpu_seconds(upstream))
        result = measure()
        return {**result, "cpu_s": (cpu_seconds(gateway) if gateway else 0.0) - before[0],
                "upstream_cpu_s": cpu_seconds(upstream) - before[1]}

    return run


def cpu_seconds(server: ServerProcess) -> float:
    """User + system CPU of a server: its gunicorn master and workers (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    pids = [server.proc.pid]
    try:
        pids += [int(p) for p in Path(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children").read_text().split()]
    except OSError:
        pass
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def decision_setups(args: Any) -> list[tuple[str, dict, list[str]]]:
    """(row label, the rules' question, the routed gateway's flags) per decision row."""
    setups = [("laya-mini" if not args.model else Path(args.model).name,
               {"needs_reasoning": NEEDS_REASONING}, ["--model", args.model] if args.model else [])]
    student = Path(args.student) if args.student else DEFAULT_STUDENT
    if student.is_dir():
        from distill.runtime import Student

        name, question = next(iter(Student(str(student)).questions.items()))
        setups.append((f"student {student.name}", {name: question}, ["--student", str(student)]))
    return setups


def decisions(args: Any, setups: list[tuple[str, dict, list[str]]], upstream_url: str, plain_url: str, started: list,
              out: TextIO) -> None:
    if len(setups) == 1:
        out.write(f"(no student at {Path(args.student) if args.student else DEFAULT_STUDENT}: its row is skipped)\n")
    rows = []
    for label, questions, flags in setups:
        name = next(iter(questions))
        answer = "noul" if questions[name]["type"] == "noul" else "confidence"
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            yaml.safe_dump({"questions": questions, "routes": {"edge": f"{name}.{answer} >= 0"}, "default": "edge"},
                           f, sort_keys=False)
        routed = GatewayProcess(["--upstream", f"edge={upstream_url}", "--route", f.name, *flags])
        started.append(routed)
        routed.wait_ready()
        plain, ruled = interleaved(args.requests, (plain_url, routed.url), stream=False)
        decision = requests.get(routed.url + "/stats", timeout=10).json()["gateway"]["decision_ms"]
        pm, rm = float(np.median(plain)), float(np.median(ruled))
        rows.append((f"{label}: 1 question", pm, rm, rm - pm, float(np.median(ruled - plain)), decision["p50"],
                     decision["p99"]))
        routed.stop()
        started.remove(routed)
        os.unlink(f.name)
    out.write(_table(("routing decision (chat p50 ms)", "no rules", "with rules", "added", "paired median",
                      "decision p50 ms", "decision p99 ms"), rows))


def _median(results: list[dict], key: str) -> float:
    return float(np.median([r[key] for r in results]))


def _table(header: tuple, rows: list[tuple]) -> str:
    def cell(v: Any) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
