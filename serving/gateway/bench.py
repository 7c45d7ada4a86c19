"""`pagoda bench gateway`: what the gateway costs against calling its upstream directly, measured in the
same run on the same upstream process, direct and gateway rounds alternating (order swapped every round)
so load from other jobs on a shared machine hits both alike.

Rows: non-streamed chat (1 token) p50/p99 with one client; time to first token of a stream with one
client; output tokens/s of `--streams` concurrent closed-loop streams; and the cost of a routing decision:
one client through a gateway that asks one Laya question per request (laya-mini, then a distilled
student) against the same gateway shape without rules, plus the decision time the gateway itself
measured (`/stats`). The upstream is `pagoda serve --generate-only` on one torch thread; every server
runs without its access log, as `pagoda bench serve` runs them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import requests
import yaml

from serving.bench import ServerProcess, closed_loop, free_port
from serving.generate.bench import messages, stream_loop

SYSTEM = "You are a helpful assistant. Answer briefly."
NEEDS_REASONING = {"type": "noul", "instructions": "Does answering this need several steps of reasoning, maths "
                                                   "or code?"}
DEFAULT_STUDENT = Path("models/students/support-triage")


class GatewayProcess(ServerProcess):
    """`pagoda gateway FLAGS` on a free loopback port: `ServerProcess`'s lifecycle, the other command."""

    def __init__(self, flags: list[str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "serving.cli", "gateway", "--host", "127.0.0.1", "--port", str(self.port),
             "--no-access-log", *flags], env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"},
            stdout=subprocess.DEVNULL, stderr=self.log)


def run_bench(args: Any, out: TextIO) -> int:
    model = args.generate_model or "default"
    upstream = ServerProcess(["--generate-only", "--generate-model", model, "--generate-name", "bench-llm",
                              "--generate-torch-threads", "1"])
    started: list[ServerProcess] = [upstream]
    try:
        upstream.wait_ready()
        plain = GatewayProcess(["--upstream", f"edge={upstream.url}"])
        started.append(plain)
        plain.wait_ready()
        out.write(f"pagoda bench gateway: upstream {model} at {upstream.url}; {args.rounds} alternating rounds, "
                  f"{args.seconds:g}s each\n")
        pass_through(args, upstream, plain, out)
        if not args.skip_decisions:
            decisions(args, upstream.url, plain.url, started, out)
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


def chat_body(c: int, i: int) -> dict:
    return {"model": "bench-llm", "messages": messages(SYSTEM, c, i), "max_tokens": 1, "temperature": 0}


def pass_through(args: Any, upstream: ServerProcess, gateway: ServerProcess, out: TextIO) -> None:
    def streams(url: str, clients: int):
        return lambda: stream_loop(url, "bench-llm", SYSTEM, args.new_tokens, clients, 1.0, args.seconds,
                                   {"ignore_eos": True})

    rows = []
    d, g = alternate(args.rounds, one_client(upstream.url, args.seconds), costed(one_client(gateway.url, args.seconds),
                                                                                 gateway, upstream))
    for q in ("p50", "p99"):
        rows.append((f"chat, 1 token, 1 client: {q} ms", *_paired(d, g, q)))
    per_request = _median(g, "cpu_s") / _median(g, "rps") / (0.5 + args.seconds) * 1000
    d, g = alternate(args.rounds, streams(upstream.url, 1), streams(gateway.url, 1))
    for q in ("ttft_p50", "ttft_p99"):
        rows.append((f"stream, 1 client: {q.replace('_', ' ')} ms", *_paired(d, g, q)))
    d, g = alternate(args.rounds, costed(streams(upstream.url, args.streams), None, upstream),
                     costed(streams(gateway.url, args.streams), gateway, upstream))
    rows.append((f"{args.streams} streams x {args.new_tokens} tokens: output tok/s", *_paired(d, g, "tok_s")))
    errors = sum(r["errors"] for r in d + g)
    per_round = ", ".join(f"{b['tok_s'] / a['tok_s']:.3f}" for a, b in zip(d, g))
    tokens = 1.0 + args.seconds  # seconds of streaming each round's CPU covers (warm-up included)
    out.write(_table(("measure", "direct", "gateway", "added", "gateway/direct", "range of round ratios"), rows))
    out.write(f"(medians over rounds; added and ratio are medians of the per-round pairs; failed requests in the stream rounds: {errors}; per-round gateway/direct "
              f"tok/s: {per_round})\n")
    out.write(f"CPU: the gateway spends {per_request:.2f} ms per non-streamed request and "
              f"{_median(g, 'cpu_s') / (_median(g, 'tok_s') * tokens) * 1e6:.0f} us per streamed token; the "
              f"upstream {_median(d, 'upstream_cpu_s') / (_median(d, 'tok_s') * tokens) * 1e6:.0f} us per token "
              "when called directly\n")


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


def decisions(args: Any, upstream_url: str, plain_url: str, started: list, out: TextIO) -> None:
    setups = [("laya-mini" if not args.model else Path(args.model).name,
               {"needs_reasoning": NEEDS_REASONING}, ["--model", args.model] if args.model else [])]
    student = Path(args.student) if args.student else DEFAULT_STUDENT
    if student.is_dir():
        from distill.runtime import Student

        name, question = next(iter(Student(str(student)).questions.items()))
        setups.append((f"student {student.name}", {name: question}, ["--student", str(student)]))
    else:
        out.write(f"(no student at {student}: its row is skipped)\n")
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
        closed_loop(routed.url + "/v1/chat/completions", chat_body, 1, 0.5, 1.0)  # warm the model's caches
        plain, ruled = alternate(args.rounds, one_client(plain_url, args.seconds), one_client(routed.url, args.seconds))
        decision = requests.get(routed.url + "/stats", timeout=10).json()["gateway"]["decision_ms"]
        rows.append((f"{label}: 1 question, chat p50 ms", *_paired(plain, ruled, "p50")[:3], decision["p50"],
                     decision["p99"]))
        routed.stop()
        started.remove(routed)
        os.unlink(f.name)
    out.write(_table(("routing decision", "no rules", "with rules", "added (paired median)", "decision p50 ms",
                      "decision p99 ms"),
                     rows))


def one_client(url: str, seconds: float):
    return lambda: closed_loop(url + "/v1/chat/completions", chat_body, 1, 0.5, seconds)


def _paired(direct: list[dict], gateway: list[dict], key: str) -> tuple:
    """Medians of each side, and the median (and range) of the per-round differences and ratios: a round's
    two measurements ran back to back, so their pairing cancels most of the load drift."""
    a = np.array([r[key] for r in direct])
    b = np.array([r[key] for r in gateway])
    ratios = b / a
    return (float(np.median(a)), float(np.median(b)), float(np.median(b - a)), float(np.median(ratios)),
            f"{ratios.min():.2f}-{ratios.max():.2f}")


def _median(results: list[dict], key: str) -> float:
    return float(np.median([r[key] for r in results]))


def _table(header: tuple, rows: list[tuple]) -> str:
    def cell(v: Any) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
