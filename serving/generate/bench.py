"""`pagoda bench serve --generate`: closed-loop streaming chat clients against `pagoda serve`, with
transformers `generate` (always) and optionally llama.cpp's own `llama-server` and llama-cpp-python's
OpenAI server on the same GGUF as baselines measured in the same run.

The workload is the issue's: every chat request shares a ~300-token system prompt and asks its own
question, 32 new tokens. At each concurrency N clients send the next request the moment their last stream
ended; only requests that end inside the measured window count. Reported: output tokens/s, time to first
token p50/p99, inter-token gap p50, the prefix-cache hit ratio, and ratios against the baselines. The
in-process single-stream decode rate of the same engine is the ceiling one HTTP client is held to.
transformers has no server: its figure is what one static batch of N requests (left-padded, one
`generate` call, greedy) sustains, which is how a transformers user serves N clients at once.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import requests

from generation.bench import QUESTIONS, SYSTEM_SENTENCE
from serving.bench import ServerProcess, free_port, plot_by_clients, run_clients


def system_prompt(tokenizer: Any, tokens: int) -> str:
    text = SYSTEM_SENTENCE
    while len(tokenizer.encode(text)) < tokens:
        text += SYSTEM_SENTENCE
    return text


def messages(system: str, client: int, i: int) -> list[dict]:
    return [{"role": "system", "content": system},
            {"role": "user", "content": f"{QUESTIONS[(client * 7 + i) % len(QUESTIONS)]} (ticket {client}-{i})"}]


def stream_chat(session: requests.Session, url: str, body: dict) -> dict | None:
    """One streamed chat request: when it started, when each content chunk (a token) arrived, its usage."""
    started = time.monotonic()
    times, usage = [], None
    payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
    try:
        response = session.post(url + "/v1/chat/completions", json=payload, stream=True, timeout=600)
    except requests.ConnectionError:  # a keep-alive connection the server had closed: retried, as the openai SDK does
        response = session.post(url + "/v1/chat/completions", json=payload, stream=True, timeout=600)
    with response as r:
        if r.status_code != 200:
            return None
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            data = json.loads(line[6:])
            usage = data.get("usage") or usage
            if any((ch.get("delta") or {}).get("content") for ch in data.get("choices", [])):
                times.append(time.monotonic())
    return {"started": started, "times": times, "usage": usage}


def stream_loop(url: str, model: str, system: str, new_tokens: int, clients: int, warmup: float,
                seconds: float) -> dict:
    """`clients` closed-loop streaming chat clients. Throughput counts the tokens that arrived inside the
    measured window (a request longer than the window still counts its share; a request's tokens are its
    usage's, spread over its chunks); TTFT is over the requests whose first token arrived inside it,
    inter-token gaps over consecutive chunks both inside it."""
    def body(c: int, i: int) -> dict:
        # EOS ignored on every side (llama.cpp honours `ignore_eos` too), so all generate the same tokens
        return {"model": model, "messages": messages(system, c, i), "max_tokens": new_tokens, "temperature": 0,
                "ignore_eos": True}

    # Every client's first request is unmeasured: llama.cpp caches a prompt per slot, so only then does each
    # of its slots hold the system prompt, as our one shared prefix cache does after the first request.
    window = run_clients(lambda session, c, i: stream_chat(session, url, body(c, i)), clients, warmup, seconds,
                         warm_each=True)
    runs = [r for _, r in window.calls if r is not None]

    def inside(t: float) -> bool:
        return window.start <= t <= window.end

    def generated(r: dict) -> int:  # tokens, not chunks: a token with no text of its own (a special one) sends none
        return (r["usage"] or {}).get("completion_tokens") or len(r["times"])

    tokens = sum(sum(map(inside, r["times"])) * generated(r) / len(r["times"]) for r in runs if r["times"])
    ttft = [(r["times"][0] - r["started"]) * 1000 for r in runs if r["times"] and inside(r["times"][0])]
    gaps = [(b - a) * 1000 for r in runs for a, b in zip(r["times"], r["times"][1:]) if inside(a) and inside(b)]
    usages = [r["usage"] for r in runs if r["usage"]]
    prompt = sum(u["prompt_tokens"] for u in usages)
    cached = sum(((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0) for u in usages)

    def pct(values: list[float], q: float) -> float:
        return float(np.percentile(values, q)) if values else float("nan")

    return {"tok_s": tokens / seconds, "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "itl_p50": pct(gaps, 50),
            "hit": cached / prompt if prompt else float("nan"), "n": len(runs),
            "per_request": float(np.mean([generated(r) for r in runs])) if runs else float("nan"),
            "errors": sum(r is None for _, r in window.calls)}


def single_stream(url: str, model: str, engine: Any, system: str, new_tokens: int, rounds: int) -> tuple[float, float]:
    """Decode rate of one client over HTTP against the same engine in-process, alternating request by
    request so load from other jobs hits both: (median HTTP / in-process ratio, in-process tok/s).
    Decode rate = tokens after the first / time from the first token to the last (prefill excluded)."""
    from generation.config import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    ratios, local_rates = [], []
    with requests.Session() as session:
        for i in range(rounds + 1):
            got = stream_chat(session, url, {"model": model, "messages": messages(system, 99, i), "temperature": 0,
                                             "max_tokens": new_tokens, "ignore_eos": True})
            ids = engine.tokenizer.encode(engine.apply_chat_template(messages(system, 98, i)))
            times = [time.monotonic() for _ in engine.stream([ids], params)]
            if i == 0 or got is None:  # round 0 computes the system prompt on both sides
                continue
            http = (len(got["times"]) - 1) / (got["times"][-1] - got["times"][0])
            local = (len(times) - 1) / (times[-1] - times[0])
            ratios.append(http / local)
            local_rates.append(local)
    return float(np.median(ratios)), float(np.median(local_rates))


def hf_level(hf: Any, tokenizer: Any, system: str, clients: int, new_tokens: int, rounds: int) -> dict:
    """transformers serving N clients at once: one left-padded batch per round, greedy."""
    import torch

    prompts = [tokenizer.encode(tokenizer.apply_chat_template(messages(system, c, 0))) for c in range(clients)]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def timed(n: int) -> float:
        t = time.perf_counter()
        with torch.inference_mode():
            hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t

    ttft = timed(1)
    total = sum(timed(new_tokens) for _ in range(rounds))
    per_round = total / rounds
    return {"tok_s": clients * new_tokens / per_round, "ttft_p50": ttft * 1000, "ttft_p99": ttft * 1000,
            "itl_p50": (per_round - ttft) / max(1, new_tokens - 1) * 1000, "hit": 0.0, "n": clients * rounds,
            "per_request": float(new_tokens), "errors": 0}


class Peer(ServerProcess):
    """A peer server the bench compares with, started on a free port by `cmd(port)`."""

    def __init__(self, label: str, cmd: Callable[[int], list[str]], ready_path: str):  # not `pagoda serve`: no super()
        self.label, self.ready_path = label, ready_path
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd(self.port), stdout=subprocess.DEVNULL, stderr=self.log)


def llama_server(binary: str, model: Path, threads: int, slots: int, slot_tokens: int) -> Peer:
    """llama.cpp's own server: one slot per client of the top level, so it batches them all (continuous
    batching is its default), each slot room for one request's prompt and answer."""
    return Peer("llama.cpp", lambda port: [binary, "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
                                           "--threads", str(threads), "--threads-batch", str(threads),
                                           "--parallel", str(slots), "--ctx-size", str(slots * slot_tokens)],
                "/health")


def llama_cpp_python(python: str, model: Path, threads: int) -> Peer:
    """llama-cpp-python's OpenAI server: one model, requests served one at a time. By default a new request
    interrupts the stream in progress, so concurrent clients would cut each other off with no tokens; here
    they queue, which is the only way it serves more than one client."""
    return Peer("llama-cpp-python", lambda port: [python, "-m", "llama_cpp.server", "--model", str(model), "--host",
                                                  "127.0.0.1", "--port", str(port), "--n_threads", str(threads),
                                                  "--n_ctx", "4096", "--interrupt_requests", "false"], "/v1/models")


def _server(args: Any, levels: list[int]) -> tuple[Path, int, list[str]]:
    """The model, the torch threads and our server's flags: one answer for the run and the check before it."""
    import torch

    from generation.weights import default_model_path

    threads = args.torch_threads or torch.get_num_threads()
    path = Path(args.generate_model) if args.generate_model else default_model_path()
    return path, threads, ["--generate-only", "--generate-model", str(path), "--generate-torch-threads", str(threads),
                           "--generate-dtype", args.generate_dtype,
                           "--threads", str(2 * max(levels) + 8), "--generate-threads", str(2 * max(levels))]


def server_flags(args: Any, levels: list[int]) -> list[list[str]]:
    """The flags of the `pagoda serve` the run starts (`pagoda bench serve` checks them before the run)."""
    return [_server(args, levels)[2]]


def run_bench(args: Any, levels: list[int], out: TextIO) -> int:
    import torch

    from generation.bench import hf_reference
    from generation.config import EngineConfig
    from generation.engine import Engine

    path, threads, flags = _server(args, levels)
    torch.set_num_threads(threads)
    engine = Engine(EngineConfig(model=str(path), dtype=args.generate_dtype))
    system = system_prompt(engine.tokenizer, args.prefix_tokens)
    prompt_tokens = len(engine.tokenizer.encode(engine.apply_chat_template(messages(system, 0, 0))))
    print(f"model {path.name}; {prompt_tokens}-token chat prompts ({len(engine.tokenizer.encode(system))}-token "
          f"shared system prompt), {args.new_tokens} new tokens; {args.generate_dtype} (pagoda and transformers); "
          f"torch threads {threads}; "
          f"{args.seconds:g}s per level after {args.warmup:g}s warm-up", file=out, flush=True)
    rows: dict[str, dict[int, dict]] = {}

    tokenizer = engine.tokenizer
    server = ServerProcess(flags)
    try:
        server.wait_ready()
        name = requests.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        single, decode = single_stream(server.url, name, engine, system, args.new_tokens, args.single_rounds)
        print(f"single stream: in-process decode {decode:.1f} tok/s; one HTTP client decodes at {single:.0%} of it "
              f"(median of {args.single_rounds} alternating rounds)", file=out, flush=True)
        del engine  # its KV pool and weights: the baselines need the memory and the cores
        rows["pagoda"] = {}
        for clients in levels:
            rows["pagoda"][clients] = _report("pagoda", clients, stream_loop(
                server.url, name, system, args.new_tokens, clients, args.warmup, args.seconds), out)
    finally:
        server.stop()

    peers = []
    if args.baseline_server:
        slot = -(-(prompt_tokens + args.new_tokens + 64) // 256) * 256
        peers.append(lambda: llama_server(args.baseline_server, path, threads, max(levels), slot))
    if args.baseline_python:
        peers.append(lambda: llama_cpp_python(args.baseline_python, path, threads))
    for start in peers:
        peer = start()
        try:
            peer.wait_ready()
            rows[peer.label] = _measure_baseline(peer.label, peer.url, system, args, levels, out, peer.exited)
        except SystemExit as exc:  # a peer that never came up: reported, and the others' figures still print
            print(f"baseline not measured: {exc}", file=out, flush=True)
        finally:
            peer.stop()
    if args.baseline_url:
        url = args.baseline_url.rstrip("/")
        rows[url] = _measure_baseline(url, url, system, args, levels, out)

    if args.hf_rounds:
        hf = hf_reference(path, getattr(torch, args.generate_dtype))
        hf.generation_config.eos_token_id = None
        rows["transformers"] = {}
        for clients in levels:
            rows["transformers"][clients] = _report("transformers", clients, hf_level(
                hf, tokenizer, system, clients, args.new_tokens, args.hf_rounds), out)

    _table(rows, levels, single, decode, out)
    if args.plot:
        plot_by_clients(args.plot, levels, [
            ("throughput", "output tokens / s", {k: {c: v[c]["tok_s"] for c in v} for k, v in rows.items()}),
            ("time to first token", "TTFT p50 (ms)", {k: {c: v[c]["ttft_p50"] for c in v} for k, v in rows.items()})])
        print(f"plot: {args.plot}", file=out)
    return 0


def _measure_baseline(label: str, url: str, system: str, args: Any, levels: list[int], out: TextIO,
                      exited: Callable[[], str | None] = lambda: None) -> dict[int, dict]:
    """Every level on one peer. A peer that dies (`exited` says why) is reported with
    its cause and its remaining levels are left out, so the figures measured before it still print."""
    try:
        name = requests.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    except (requests.RequestException, ValueError, KeyError, IndexError) as exc:
        print(f"{label:>16}: not measured: GET /v1/models failed: {exc}", file=out, flush=True)
        return {}
    got: dict[int, dict] = {}
    for clients in levels:
        stats = stream_loop(url, name, system, args.new_tokens, clients, args.warmup, args.seconds)
        if why := exited():
            print(f"{label:>16} clients {clients:>3}: not measured: {why}", file=out, flush=True)
            break
        got[clients] = _report(label, clients, stats, out)
    return got


def _report(label: str, clients: int, stats: dict, out: TextIO) -> dict:
    print(f"{label:>16} clients {clients:>3}: {stats['tok_s']:8.1f} output tok/s  TTFT p50 {stats['ttft_p50']:7.1f} ms "
          f"p99 {stats['ttft_p99']:7.1f} ms  ITL p50 {stats['itl_p50']:6.1f} ms  cache hit {stats['hit']:.2f}  "
          f"{stats['per_request']:.1f} tokens/request  ({stats['n']} requests, {stats['errors']} errors)",
          file=out, flush=True)
    return stats


def _table(rows: dict[str, dict[int, dict]], levels: list[int], single: float, decode: float, out: TextIO) -> None:
    ours = rows["pagoda"]
    peers = [label for label in rows if label not in ("pagoda", "transformers")]
    hf_rows = rows.get("transformers")  # absent with --hf-rounds 0
    heads = ["clients", "pagoda tok/s", "TTFT p50/p99 ms", "ITL p50 ms", "cache hit"] + (
        ["vs transformers"] if hf_rows else [])
    for label in peers:
        heads += [f"{label} tok/s", f"vs {label}"]
    print("\n| " + " | ".join(heads) + " |", file=out)
    print("|" + "---:|" * len(heads), file=out)
    for c in levels:
        a = ours[c]
        cells = [str(c), f"{a['tok_s']:.1f}", f"{a['ttft_p50']:.0f} / {a['ttft_p99']:.0f}", f"{a['itl_p50']:.1f}",
                 f"{a['hit']:.2f}"] + ([f"{a['tok_s'] / hf_rows[c]['tok_s']:.2f}x"] if hf_rows else [])
        for label in peers:
            peer = rows[label].get(c)
            cells += ([f"{peer['tok_s']:.1f}", f"{a['tok_s'] / peer['tok_s']:.2f}x" if peer["tok_s"] else "n/a"]
                      if peer else ["failed", "n/a"])
        print("| " + " | ".join(cells) + " |", file=out)
    print(f"\none HTTP client decodes at {single:.0%} of the in-process single-stream rate ({decode:.1f} tok/s; "
          "goal >= 95%)", file=out)
    top = max(levels)
    goals = [f"{top} clients vs transformers {ours[top]['tok_s'] / hf_rows[top]['tok_s']:.2f}x (goal >= 3x)"] \
        if hf_rows else [f"{top} clients: transformers not measured (--hf-rounds 0)"]
    for label in peers:
        if (peer := rows[label].get(top)) and peer["tok_s"]:
            goal = " (goal >= 1.5x)" if label.startswith("llama") else ""
            goals.append(f"vs {label} {ours[top]['tok_s'] / peer['tok_s']:.2f}x{goal}")
    print("; ".join(goals), file=out)
