"""`pagoda bench serve`: closed-loop clients on `/decide`, cross-request batching off vs on.

Each mode gets its own `pagoda serve` subprocess; at each concurrency level N clients send the next
request as soon as the last one answered, for `--seconds` after a `--warmup` (`serving.bench`). Figures
are reported as ratios against the batching-off run made in the same invocation, next to the model-level
ceiling: what one forward over many requests' rows saves on this model and machine, no HTTP.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TextIO

import requests

from serving.bench import ServerProcess, closed_loop
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
        flags = ["--threads", str(threads), "--batching" if batching else "--no-batching",
                 "--torch-threads", str(args.torch_threads)]
        for flag, value in (("--model", args.model), ("--student", args.student),
                            ("--max-wait-ms", args.max_wait_ms)):
            if value is not None:
                flags += [flag, str(value)]
        server = ServerProcess(flags)
        try:
            server.wait_ready()
            results[batching] = {}
            for clients in levels:
                before = _rows_per_pass(server.url)
                results[batching][clients] = stats = closed_loop(server.url + "/decide", body_for, clients,
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
    import numpy as np
    import torch
    import yaml

    import laya

    torch.set_num_threads(args.torch_threads or torch.get_num_threads())
    agent = laya.load(args.model)
    questions = yaml.safe_load(SHIPPED_PRESETS.read_text())[args.preset]
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
