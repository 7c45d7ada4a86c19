"""`pagoda bench decide`: predict latency on the billing scenario, as a ratio against the official runtime.

The baseline runs in a subprocess of the same command, on the same checkpoint, machine and
iteration count, right after ours: the official package is also imported as `laya`, so it runs
from a directory without our sources and from its own venv (`--reference`, default `.refvenv`).
Timings on a shared machine are noisy; the ratio of two back-to-back runs is what to read.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "docs" / "examples"
WARMUP = 5

# Runs under the reference interpreter; prints one JSON line. Kept free of our package on purpose.
_REFERENCE = r"""
import json, sys, time, warnings
warnings.simplefilter("ignore")
import laya
model, iters, state, questions = sys.argv[1], int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
agent = laya.load(model, device="cpu")
for _ in range(5):
    out = agent.predict(state, questions)
times = []
for _ in range(iters):
    t = time.perf_counter()
    out = agent.predict(state, questions)
    times.append((time.perf_counter() - t) * 1000)
print(json.dumps({"times_ms": times, "result": out, "version": getattr(laya, "__version__", "?")}))
"""


def scenario() -> tuple[str, dict[str, Any]]:
    state = (EXAMPLES / "billing_state.txt").read_text(encoding="utf-8").removesuffix("\n")
    return state, json.loads((EXAMPLES / "billing_questions.json").read_text(encoding="utf-8"))


def percentiles(times_ms: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(times_ms, n=20, method="inclusive") if len(times_ms) > 1 else times_ms * 19
    return statistics.median(times_ms), q[18]


def time_ours(model: str | None, iters: int, device: str) -> tuple[list[float], dict[str, Any]]:
    import laya

    agent = laya.load(model, device=device)
    state, questions = scenario()
    for _ in range(WARMUP):
        out = agent.predict(state, questions)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        out = agent.predict(state, questions)
        times.append((time.perf_counter() - t) * 1000)
    return times, out


def time_reference(python: str, model: str, iters: int) -> dict[str, Any]:
    state, questions = scenario()
    with tempfile.TemporaryDirectory() as cwd:   # anywhere but our repository root
        proc = subprocess.run([python, "-c", _REFERENCE, os.path.abspath(model), str(iters), state,
                               json.dumps(questions)], cwd=cwd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError("reference runtime failed:\n" + proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def max_probability_gap(a: dict[str, Any], b: dict[str, Any]) -> float:
    gap = 0.0
    for name, x in a["answers"].items():
        y = b["answers"][name]
        for key in ("probabilities",):
            for k, v in (x.get(key) or {}).items():
                gap = max(gap, abs(v - y[key][k]))
        if "noul" in x:
            gap = max(gap, abs(x["noul"] - y["noul"]))
    return gap


def run(model: str | None, iters: int = 50, device: str = "cpu", reference: str | None = None) -> int:
    import torch

    if iters < 1:
        print("pagoda bench decide: error: --iters must be >= 1", file=sys.stderr)
        return 2
    ours, out = time_ours(model, iters, device)
    p50, p95 = percentiles(ours)
    usage = out["usage"]
    print(f"checkpoint: {model or 'laya-mini (default)'}  device: {device}  torch threads: {torch.get_num_threads()}")
    print(f"scenario: billing (3 questions), {usage['input_tokens']} input tokens, {WARMUP} warm-up + {iters} timed")
    print(f"{'runtime':<24}{'p50 ms':>10}{'p95 ms':>10}{'ratio p50':>11}")
    ref_python = reference or str(ROOT / ".refvenv" / "bin" / "python")
    if model is None or not Path(ref_python).is_file():
        print(f"{'pagoda laya':<24}{p50:>10.1f}{p95:>10.1f}{'':>11}")
        print("(no reference runtime: pass --reference PYTHON with the official laya installed, and --model)")
        return 0
    ref = time_reference(ref_python, model, iters)
    r50, r95 = percentiles(ref["times_ms"])
    print(f"{'official laya ' + ref['version']:<24}{r50:>10.1f}{r95:>10.1f}{1.0:>10.2f}x")
    print(f"{'pagoda laya':<24}{p50:>10.1f}{p95:>10.1f}{r50 / p50:>10.2f}x")
    print(f"speed-up p50: {r50 / p50:.2f}x   max |p_ours - p_official| on this scenario: "
          f"{max_probability_gap(out, ref['result']):.1e}")
    return 0
