"""`pagoda bench decide`: predict latency on the billing scenario, as a ratio against the official runtime.

The baseline runs in a subprocess of the same command, on the same checkpoint, machine and
iteration count, right after ours: the official package is also imported as `laya`, so it runs
from a directory without our sources and from its own venv (`--reference`, default `.refvenv`).
Timings on a shared machine are noisy; the ratio of two back-to-back runs is what to read.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from laya.scenarios import load as scenario

WARMUP = 5
DEFAULT_REFERENCE = Path(".refvenv") / "bin" / "python"   # `make fixtures` creates it in the repo root

# Runs under the reference interpreter, kept free of our package. It loads, warms up, then answers
# each "n" line on stdin with n timed predicts, so the two runtimes can be timed in alternation.
_REFERENCE = r"""
import json, sys, time, warnings
warnings.simplefilter("ignore")
import laya
model, state, questions = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
agent = laya.load(model, device="cpu")
for _ in range(5):
    out = agent.predict(state, questions)
print(json.dumps({"version": getattr(laya, "__version__", "?"), "result": out}), flush=True)
for line in sys.stdin:
    times = []
    for _ in range(int(line)):
        t = time.perf_counter()
        agent.predict(state, questions)
        times.append((time.perf_counter() - t) * 1000)
    print(json.dumps(times), flush=True)
"""


def timed(fn, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return times


class Reference:
    """The official runtime in a subprocess (its own venv, a directory without our sources)."""

    def __init__(self, python: str, model: str):
        state, questions = scenario()
        self._cwd = tempfile.TemporaryDirectory()
        self.proc = subprocess.Popen([python, "-c", _REFERENCE, os.path.abspath(model), state, json.dumps(questions)],
                                     cwd=self._cwd.name, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        hello = self._line()
        self.version, self.result = hello["version"], hello["result"]

    def _line(self) -> Any:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("reference runtime failed:\n" + self.proc.stderr.read()[-2000:])
        return json.loads(line)

    def time(self, n: int) -> list[float]:
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        return self._line()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self._cwd.cleanup()


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
    """Ours and the reference alternate, one predict each, so load drift on a shared machine hits both."""
    import torch

    import laya

    if iters < 1:
        print("pagoda bench decide: error: --iters must be >= 1", file=sys.stderr)
        return 2
    agent = laya.load(model, device=device)
    model = model or agent.source          # the default laya-mini folder, for the reference too
    state, questions = scenario()
    for _ in range(WARMUP):
        out = agent.predict(state, questions)
    ref_python = reference or str(DEFAULT_REFERENCE)
    ref = Reference(ref_python, model) if Path(ref_python).is_file() else None
    ours, theirs = [], []
    try:
        for _ in range(iters):
            ours += timed(lambda: agent.predict(state, questions), 1)
            if ref is not None:
                theirs += ref.time(1)
    finally:
        if ref is not None:
            ref.close()
    p50, p95 = np.percentile(ours, [50, 95])
    print(f"checkpoint: {model}  device: {device}  torch threads: {torch.get_num_threads()}")
    print(f"scenario: billing (3 questions), {out['usage']['input_tokens']} input tokens, "
          f"{WARMUP} warm-up + {iters} timed, runtimes alternating")
    print(f"{'runtime':<24}{'p50 ms':>10}{'p95 ms':>10}{'speed-up p50':>14}")
    if ref is None:
        print(f"{'pagoda laya':<24}{p50:>10.1f}{p95:>10.1f}")
        print("(no reference runtime: pass --reference PYTHON with the official laya installed)")
        return 0
    r50, r95 = np.percentile(theirs, [50, 95])
    print(f"{'official laya ' + ref.version:<24}{r50:>10.1f}{r95:>10.1f}{1.0:>13.2f}x")
    print(f"{'pagoda laya':<24}{p50:>10.1f}{p95:>10.1f}{r50 / p50:>13.2f}x")
    print(f"max |p_ours - p_official| on this scenario: {max_probability_gap(out, ref.result):.1e}")
    return 0
