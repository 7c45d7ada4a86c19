"""`pagoda bench lang`: a branching program on the local backend, against the same calls as independent
requests with the cache off, and over HTTP.

The program: a ~300-token context, `fork(8)`, and in each branch a 32-token `gen` and then a `select`
over 4 choices (41 requests: 8 gens and 8 x 4 scored choices, plus the fork's pin). Three ways to run it,
alternated round by round because the machine is shared and noisy:
  (a) independent: an engine with `cache_backend="none"` and no fork pin, so every request computes its
      whole prompt (the same calls, at the same concurrency, so only the prefix reuse differs);
  (b) local: the prefix cache on and forks pinned;
  (c) HTTP: the same program through `HttpBackend` against `pagoda serve` with the same engine settings
      (started here unless `--url` names a running server).
Printed: wall time (median of the rounds), prompt tokens the engine computed, the ratios (a)/(b), and
(c) - (b) per program call. Every run's text is checked equal across the three (greedy).
Since the branching program's HTTP cost hides in its compute noise, the call overhead is also measured
on a chain of 24 one-token `gen`s in one state (sequential calls, little compute each), local vs HTTP.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from generation.config import MAX_TORCH_THREADS
from generation.lang.ir import gen, select
from generation.lang.program import function

SENTENCES = [
    "Our bicycle rental company operates in twelve cities and keeps about four thousand bikes on the road.",
    "Customers unlock a bike with the app, ride for as long as they like, and return it at any station.",
    "Late returns cost two euros per started hour, and a lost key costs thirty euros.",
    "Helmets are free at every station, children under twelve ride only with an adult, and pets ride in baskets.",
    "Electric bikes cost twice as much per hour but include a charged battery and a phone holder.",
    "The support team answers within ten minutes during the day and within an hour at night.",
    "Last quarter, complaints were mostly about flat tyres, app crashes and stations that were full.",
]
CHOICES = ["excellent", "good", "average", "poor"]
KV_MB = 256
# Each branch is a program state with a thread of its own here and, over HTTP, a request thread in the server
# (128 by default): 99999 branches took the machine's memory in threads. 64 is the engine's default batch.
MAX_BRANCHES = 64
PROGRAM_TOKENS = 32  # the program's own words around the context and a branch's gen ("Idea 1:", a choice)


def build_context(tokenizer: Any, tokens: int) -> str:
    """Whole sentences of the policy text until about `tokens` tokens."""
    text, i = "", 0
    while len(tokenizer.encode(text)) < tokens:
        text += SENTENCES[i % len(SENTENCES)] + " "
        i += 1
    return text.rstrip() + "\n"


@function
def brainstorm(s, context, branches, new_tokens):
    s += context + "Here are ideas to reduce complaints.\n"
    forks = s.fork(branches)
    forks += lambda i: f"\nIdea {i + 1}:" + gen("idea", max_tokens=new_tokens, ignore_eos=True)
    forks += "\nThis idea is " + select("rating", choices=CHOICES)
    forks.join()


@function
def chain(s, calls):
    s += "Stations in order:"
    for i in range(calls):
        s += f" {i + 1}." + gen(f"n{i}", max_tokens=1, ignore_eos=True)


CHAIN_CALLS = 24


def _computed(stats: dict[str, Any]) -> int:
    return stats["prompt_tokens"] - stats["compute_saved_tokens"]


def _run_local(backend: Any, args: dict[str, Any]) -> tuple[float, int, str]:
    backend.loop.flush_cache()
    before = _computed(backend.loop.stats())
    t = time.perf_counter()
    state = brainstorm.run(backend=backend, temperature=0, **args)
    wall = time.perf_counter() - t
    return wall, _computed(backend.loop.stats()) - before, _outcome(state)


def _outcome(state: Any) -> str:
    return json.dumps([state.text(), state["idea"], state["rating"]])


class _Server:
    """`pagoda serve --generate-only` with the bench's engine settings, on a free loopback port."""

    def __init__(self, model: str | None, threads: int, log: Path) -> None:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        pagoda = shutil.which("pagoda", path=str(Path(sys.executable).parent)) or shutil.which("pagoda")
        if pagoda is None:
            raise SystemExit("bench lang: no `pagoda` command to start the server with; give --url")
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("PAGODA_")}, "HF_HUB_OFFLINE": "1"}
        self._log = open(log, "ab")
        self.proc = subprocess.Popen(
            [pagoda, "serve", "--host", "127.0.0.1", "--port", str(port), "--generate-only", "--no-access-log",
             "--generate-model", model or "default", "--generate-torch-threads", str(threads),
             "--generate-kv-cache-mb", str(KV_MB)], env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 600.0) -> None:
        import requests

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise SystemExit(f"bench lang: the server exited with {self.proc.returncode} (log: {self._log.name})")
            try:
                if requests.get(self.url + "/ready", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise SystemExit(f"bench lang: the server was not ready after {timeout:.0f} s (log: {self._log.name})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


def run(model: str | None = None, *, context_tokens: int = 300, branches: int = 8, new_tokens: int = 32,
        rounds: int = 3, threads: int = 1, url: str | None = None, http: bool = True) -> dict[str, Any]:
    import requests
    from tqdm import tqdm

    from generation.config import EngineConfig
    from generation.engine import Engine
    from generation.engine_loop import EngineLoop
    from generation.lang.backend_http import HttpBackend
    from generation.lang.backend_local import LocalBackend

    server = None
    if http and url is None:  # boots while the local engines load
        server = _Server(model, threads, Path(os.environ.get("TMPDIR", "/tmp")) / "pagoda-bench-lang-serve.log")
    try:
        backends = {}
        for name, cache, pin in (("independent", "none", False), ("local", "radix", True)):
            engine = Engine(EngineConfig(model=model, cache_backend=cache, kv_cache_memory_mb=KV_MB))
            backends[name] = LocalBackend(EngineLoop(engine, num_threads=threads), pin_prefixes=pin)
        limit = backends["local"].engine.max_model_len
        if context_tokens + new_tokens + PROGRAM_TOKENS >= limit:  # else building the context alone runs on and on
            raise ValueError(f"--context-tokens / --new-tokens: {context_tokens} + {new_tokens} tokens and the "
                             f"program's own do not fit in the model's {limit}-token context")
        args = {"context": build_context(backends["local"].engine.tokenizer, context_tokens), "branches": branches,
                "new_tokens": new_tokens}
        modes = list(backends)
        if http:
            if server is not None:
                server.wait_ready()
            backends["http"] = HttpBackend(url or server.url)
            modes.append("http")
        wall: dict[str, list[float]] = {m: [] for m in modes}
        tokens: dict[str, int] = {}
        outcomes: set[str] = set()
        chain_texts: set[str] = set()
        for m in modes:  # warm-up: first-touch allocations, HTTP connections
            (brainstorm.run(backend=backends[m], temperature=0, **args) if m == "http"
             else _run_local(backends[m], args))
        for _ in tqdm(range(rounds), desc="bench lang rounds", unit="round"):
            for m in modes:
                if m == "http":
                    requests.post(backends[m].base_url + "/flush_cache", timeout=60)
                    t = time.perf_counter()
                    state = brainstorm.run(backend=backends[m], temperature=0, **args)
                    wall[m].append(time.perf_counter() - t)
                    outcomes.add(_outcome(state))
                else:
                    secs, computed, outcome = _run_local(backends[m], args)
                    wall[m].append(secs)
                    tokens[m] = computed
                    outcomes.add(outcome)
        chain_wall: dict[str, list[float]] = {m: [] for m in modes if m != "independent"}
        if http:
            for _ in tqdm(range(rounds), desc="bench lang call overhead", unit="round"):
                for m in chain_wall:
                    t = time.perf_counter()
                    state = chain.run(calls=CHAIN_CALLS, backend=backends[m], temperature=0)
                    chain_wall[m].append(time.perf_counter() - t)
                    chain_texts.add(state.text())
        for m in ("independent", "local"):
            backends[m].loop.close()
    finally:
        if server is not None:
            server.stop()
    calls = 1 + 2 * branches  # the fork, then one gen and one select per branch
    median = {m: statistics.median(v) for m, v in wall.items()}
    result = {
        "context_tokens": len(backends["local"].engine.tokenizer.encode(args["context"])), "branches": branches,
        "new_tokens": new_tokens, "choices": len(CHOICES), "rounds": rounds, "threads": threads,
        "wall_s": median, "wall_s_all": wall, "prompt_tokens_computed": tokens,
        "same_text": len(outcomes) == 1 and len(chain_texts) <= 1,
        "wall_ratio": median["independent"] / median["local"],
        "computed_ratio": tokens["independent"] / max(tokens["local"], 1), "program_calls": calls,
    }
    if "http" in median:
        result["http_overhead_ms_per_call"] = 1000 * (median["http"] - median["local"]) / calls
        result["http_requests"] = 1 + branches * 3  # fork prefix; per branch a gen, the prompt length, the choices
        chained = {m: statistics.median(v) for m, v in chain_wall.items()}
        result.update(chain_calls=CHAIN_CALLS, chain_wall_s=chained, chain_wall_s_all=chain_wall,
                      chain_overhead_ms_per_call=1000 * (chained["http"] - chained["local"]) / CHAIN_CALLS)
    return result


def report(result: dict[str, Any], out=sys.stdout) -> None:
    r = result
    print(f"\nbranching program: {r['context_tokens']}-token context, fork({r['branches']}), gen {r['new_tokens']} "
          f"tokens then select over {r['choices']} per branch; greedy; {r['threads']} torch thread(s); "
          f"median of {r['rounds']} alternating rounds", file=out)
    print(f"{'mode':<40}{'wall s':>10}{'prompt tokens computed':>26}", file=out)
    rows = [("independent requests, cache off", "independent"), ("local backend (fork pins, radix cache)", "local")]
    for label, m in rows:
        print(f"{label:<40}{r['wall_s'][m]:>10.2f}{r['prompt_tokens_computed'][m]:>26}", file=out)
    print(f"{'ratio independent / local':<40}{r['wall_ratio']:>9.2f}x{r['computed_ratio']:>25.1f}x", file=out)
    if "http" in r["wall_s"]:
        print(f"{'HTTP backend (pagoda serve)':<40}{r['wall_s']['http']:>10.2f}", file=out)
        print(f"HTTP - local: {r['http_overhead_ms_per_call']:.1f} ms per program call ({r['program_calls']} calls, "
              f"{r['http_requests']} HTTP requests); HTTP / local wall {r['wall_s']['http'] / r['wall_s']['local']:.2f}x",
              file=out)
        print(f"chain of {r['chain_calls']} one-token gens: local {r['chain_wall_s']['local']:.2f} s, HTTP "
              f"{r['chain_wall_s']['http']:.2f} s: {r['chain_overhead_ms_per_call']:.1f} ms per call over HTTP", file=out)
    print(f"same text in every mode and round: {'yes' if r['same_text'] else 'NO'}", file=out)


def register(bench: Any) -> None:
    b = bench.add_parser("lang", help="a fork/gen/select program: local backend vs independent requests, and over HTTP")
    b.add_argument("--model", default=None, help="HF folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    b.add_argument("--context-tokens", type=int, default=300,
                   help="tokens of the shared context (with --new-tokens, within the model's context)")
    b.add_argument("--branches", type=int, default=8, help=f"fork width, 1-{MAX_BRANCHES}")
    b.add_argument("--new-tokens", type=int, default=32, help="tokens each branch generates")
    b.add_argument("--rounds", type=int, default=3, help="alternating rounds; the median counts")
    b.add_argument("--threads", type=int, default=1,
                   help=f"torch threads of every engine, the server's too (1-{MAX_TORCH_THREADS})")
    b.add_argument("--url", default=None, help="a running /generate server to use instead of starting pagoda serve")
    b.add_argument("--no-http", action="store_true", help="skip the HTTP comparison")
    b.add_argument("--json", default=None, help="also write the results to this file")
    b.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    bad = [f"--{n.replace('_', '-')}: must be a positive integer, got {getattr(args, n)}"
           for n in ("context_tokens", "branches", "new_tokens", "rounds", "threads") if getattr(args, n) < 1]
    if args.threads > MAX_TORCH_THREADS:  # torch takes it, then crashes starting its pool
        bad.append(f"--threads: must be at most {MAX_TORCH_THREADS}, got {args.threads}")
    if args.branches > MAX_BRANCHES:
        bad.append(f"--branches: must be at most {MAX_BRANCHES}, got {args.branches}")
    if args.model is not None and not Path(args.model).exists():
        bad.append(f"--model: {args.model}: no such model folder or .gguf file")
    if args.url is not None and args.no_http:
        bad.append("--url: a server to compare over HTTP, and --no-http skips that comparison: give one")
    elif args.url is not None and not args.url.startswith(("http://", "https://")):
        bad.append(f"--url: expected http://HOST:PORT, got {args.url!r}")
    if args.json and (Path(args.json).is_dir() or not Path(args.json).parent.is_dir()):  # not after the run
        bad.append(f"--json: {args.json} is a folder or in no folder; give a file path to write")
    if bad:  # before any model loads: one line naming the flag, rc 2
        print(f"pagoda bench lang: error: {bad[0]}", file=sys.stderr)
        return 2
    result = run(args.model, context_tokens=args.context_tokens, branches=args.branches, new_tokens=args.new_tokens,
                 rounds=args.rounds, threads=args.threads, url=args.url, http=not args.no_http)
    report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if result["same_text"] else 1
