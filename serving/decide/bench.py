"""`pagoda bench serve`: closed-loop clients on the decision API: batching off vs on, each precision, and the
official `laya-serve` on the same checkpoint.

Each mode gets its own server subprocess; at each concurrency level N clients send the next request as
soon as the last one answered, for `--seconds` after a `--warmup` (`serving.bench`). A Laya model is asked
through the `/v1/systemone` route, which `pagoda serve` and laya-serve both speak, with the same bodies
(the preset's questions, explicitly), so every mode does the same work per request. laya-serve (from
`--reference PYTHON`, a venv with `laya[serve]==0.4.15`, else `.refvenv` when it has one, as `pagoda bench
decide` uses) runs with the same thread count; it serves one inference at a time. Our precisions come from
`--precision`, else `$PAGODA_PRECISION`, else exact. Every `pagoda serve` runs with `--generate-model none`:
a decision benchmark has no use for an LLM's load time and memory. Figures are ratios against batching off and against laya-serve, measured in the same
invocation, next to the model-level ceiling: what one forward over many requests' rows saves, no HTTP.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TextIO

import requests

from serving.bench import ServerProcess, closed_loop, free_port, plot_by_clients
from serving.decide.config import SHIPPED_PRESETS

STATES = [
    "Hi, we were billed twice for March. Please refund the duplicate today or we will cancel our plan.",
    "The dashboard has been down since this morning and none of our team can log in. Please fix it.",
    "Could you tell me where to find the invoice for last month? No rush.",
    "I love the new release, thanks! One question: can I change the plan of my second account?",
    "Your app deleted my files AGAIN. This is the third time, I am moving to a competitor next week.",
    "Hello, I'd like to know whether you ship to Norway and how long delivery usually takes.",
]


def _rows_per_pass(url: str) -> tuple[int, int]:
    """(question rows, forward passes) so far, from the server's /stats histogram."""
    histogram = requests.get(url + "/stats", timeout=10).json()["batch_size_histogram"]
    return sum(int(k) * v for k, v in histogram.items()), sum(histogram.values())


class LayaServe(ServerProcess):
    """The official `laya-serve` (FastAPI, one inference at a time) from its own venv, serving `model` as "bench"."""

    def __init__(self, python: str, model: str, threads: int, clients: int):   # not `pagoda serve`: no super()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._cwd = tempfile.TemporaryDirectory()   # laya's import name is ours too: no sources on its path
        env = {**os.environ, "LAYA_HOST": "127.0.0.1", "LAYA_PORT": str(self.port),
               "LAYA_EXTRA_MODELS": json.dumps({"bench": str(Path(model).resolve())}), "LAYA_MODELS": "bench",
               "LAYA_DEFAULT_MODEL": "bench", "LAYA_THREADS": str(threads), "OMP_NUM_THREADS": str(threads),
               "LAYA_MAX_CONCURRENT": str(max(64, 2 * clients)), "LAYA_LOG_LEVEL": "warning", "HF_HUB_OFFLINE": "1"}
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([str(Path(python).absolute().parent / "laya-serve")], cwd=self._cwd.name, env=env,
                                     stdout=subprocess.DEVNULL, stderr=self.log)

    def wait_ready(self, timeout: float = 300.0) -> None:
        """laya-serve preloads before it listens, so its first `/health` answer means loaded."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            try:
                requests.get(self.url + "/health", timeout=5)
                return
            except requests.RequestException:
                time.sleep(0.25)
        self.log.seek(0)
        raise SystemExit(f"pagoda {self.command}: error: laya-serve did not come up: {self.log.read().decode()[-2000:]}")

    def stop(self) -> None:
        super().stop()
        self._cwd.cleanup()


def server_flags(args, levels: list[int]) -> list[list[str]]:
    """The flags of every `pagoda serve` the run starts (`pagoda bench serve` checks them all before the first)."""
    if not args.student:
        _preset_questions(args.preset)
    return [flags for _, flags in _servers(args, levels)]


def _preset_questions(name: str) -> dict:
    import yaml

    presets = yaml.safe_load(SHIPPED_PRESETS.read_text())
    if name not in presets:
        raise ValueError(f"--preset: {name!r} is not a shipped preset (one of {', '.join(sorted(presets))})")
    return presets[name]


def _servers(args, levels: list[int]) -> list[tuple[str, list[str]]]:
    """(mode name, `pagoda serve` flags) per mode of ours, in the order they run."""
    precisions = _precision_list(args)
    # Closed-loop clients wait as long as a queue takes (laya-serve's do): no 504s from the default deadline.
    common = ["--threads", str(max(64, 2 * max(levels))), "--torch-threads", str(args.torch_threads),
              "--workers", str(args.workers), "--request-timeout-s", "600", "--generate-model", "none"]
    for flag, value in (("--model", args.model), ("--student", args.student), ("--max-wait-ms", args.max_wait_ms)):
        if value is not None:
            common += [flag, str(value)]
    if args.student:
        return [("batching off", common + ["--no-batching"]), ("batching on", common + ["--batching"])]
    return [(f"pagoda {precisions[0]}, batching off", common + ["--no-batching", "--precision", precisions[0]])] + [
        (f"pagoda {p}, batching on", common + ["--batching", "--precision", p]) for p in precisions]


def _modes(args, levels: list[int]) -> list[tuple[str, object]]:
    """(name, server factory) per mode, in the order they run."""
    modes: list[tuple[str, object]] = [(name, lambda flags=flags: ServerProcess(flags))
                                       for name, flags in _servers(args, levels)]
    reference = None if args.student else _reference(args)  # a student's rows have no laya-serve to compare
    if reference:
        modes.append(("laya-serve 0.4.15 (fp32)",
                      lambda: LayaServe(reference, args.model or _default_model(),
                                        args.torch_threads * args.workers if args.torch_threads else 0, max(levels))))
    return modes


def _precision_list(args) -> list[str]:
    given = args.precision or os.environ.get("PAGODA_PRECISION") or "exact"
    precisions = [p.strip() for p in given.split(",") if p.strip()]
    if not precisions:
        raise ValueError(f"--precision / PAGODA_PRECISION: expected a comma list of precisions, got {given!r}")
    return precisions


def _reference(args) -> str | None:
    """The official runtime's python: `--reference`, else `.refvenv`'s when it has laya-serve."""
    if args.reference:
        return args.reference
    from laya.bench import DEFAULT_REFERENCE

    return str(DEFAULT_REFERENCE) if (DEFAULT_REFERENCE.parent / "laya-serve").is_file() else None


def _default_model() -> str:
    from laya.paths import default_model_dir

    return str(default_model_dir())


def run_bench(args, levels: list[int], out: TextIO) -> int:
    if args.student:
        route = "/decide"

        def body_for(c: int, i: int) -> dict:
            return {"state": f"{STATES[(c + i) % len(STATES)]} (#{c}-{i})"}
    else:
        route = "/v1/systemone"
        questions = _preset_questions(args.preset)

        def body_for(c: int, i: int) -> dict:
            return {"state": f"{STATES[(c + i) % len(STATES)]} (#{c}-{i})", "questions": questions, "model": "bench"}
    modes = _modes(args, levels)
    results: dict[str, dict[int, dict]] = {}
    for name, start in modes:
        server = start()
        try:
            server.wait_ready()
            results[name] = {}
            for clients in levels:
                ours = not isinstance(server, LayaServe)
                before = _rows_per_pass(server.url) if ours else None
                results[name][clients] = stats = closed_loop(server.url + route, body_for, clients,
                                                             args.warmup, args.seconds)
                rows = float("nan")
                if ours:
                    after = _rows_per_pass(server.url)
                    passes = after[1] - before[1]
                    rows = (after[0] - before[0]) / passes if passes else float("nan")
                stats["rows"] = rows
                print(f"{name:<32} clients {clients:>3}: {stats['rps']:7.2f} req/s  p50 {stats['p50']:8.1f} ms  "
                      f"p99 {stats['p99']:8.1f} ms  ({stats['n']} ok, {stats['errors']} errors; "
                      f"{rows:.1f} question rows per forward)", file=out, flush=True)
        finally:
            server.stop()
    if not args.student:
        print(_model_ceiling(args, 16 if 16 in levels else max(levels)), file=out)
    off = results[modes[0][0]]
    ref = next((results[n] for n, _ in modes if n.startswith("laya-serve")), None)
    print(f"\nmodel: {args.model or args.student or 'laya-mini (embedded default)'}; {args.seconds:g}s per cell "
          f"after {args.warmup:g}s warm-up; pagoda: {args.workers} worker process(es) x {args.torch_threads} model "
          f"thread(s); laya-serve: {args.workers * args.torch_threads} thread(s)", file=out)

    def ratio(x: float, y: float) -> str:
        return f"{x / y:.2f}x" if y and y == y else "-"

    print("| clients | mode | req/s | p50 ms | p99 ms | vs batching off | vs laya-serve | rows per forward |", file=out)
    print("|---:|---|---:|---:|---:|---:|---:|---:|", file=out)
    for c in levels:
        for name, _ in modes:
            r = results[name][c]
            print(f"| {c} | {name} | {r['rps']:.2f} | {r['p50']:.0f} | {r['p99']:.0f} | {ratio(r['rps'], off[c]['rps'])} "
                  f"| {ratio(r['rps'], ref[c]['rps']) if ref else '-'} | {r['rows']:.1f} |", file=out)
    if args.plot:
        plot_by_clients(args.plot, levels, [
            ("throughput", "requests / s", {k: {c: v[c]["rps"] for c in v} for k, v in results.items()}),
            ("tail latency", "p99 latency (ms)", {k: {c: v[c]["p99"] for c in v} for k, v in results.items()})])
        print(f"plot: {args.plot}", file=out)
    return 0


def _model_ceiling(args, clients: int) -> str:
    """The most any batcher can gain on this model and machine: one forward over `clients` requests'
    rows against `clients` forwards of one request each, in this process, no HTTP."""
    import numpy as np

    import laya

    agent = laya.load(args.model, precision=_precision_list(args)[0], threads=args.torch_threads or None)
    questions = _preset_questions(args.preset)
    prepared = [agent.prepare(f"{STATES[i % len(STATES)]} (#{i})", questions) for i in range(clients)]

    def timed(fn) -> float:
        fn()
        runs = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - t)
        return float(np.percentile(runs, 50))

    one = timed(lambda: [agent.forward(p.rows) for p in prepared])
    together = timed(lambda: agent.forward([r for p in prepared for r in p.rows]))
    return (f"model-level ceiling ({agent.plan.precision}): {clients} requests' rows in one forward take "
            f"{together * 1000:.0f} ms vs {one * 1000:.0f} ms one request at a time ({one / together:.2f}x): no "
            f"batcher can gain more on this model and machine")
