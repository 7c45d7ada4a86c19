"""`pagoda bench decide`: decision latency, cold start, memory and int8 agreement, as ratios measured in one run.

Latency: the billing scenario (1 state, 3 questions), predict by predict, each precision of ours and
the official runtime (PyPI `laya` 0.4.15 in its own venv, `--reference`, default `.refvenv`; it is
also imported as `laya`, so it runs in a subprocess from a directory without our sources) in
alternation, with a probe of this machine's fp32 GEMM rate between them, so load drift on a shared
machine hits every figure alike. All run with the same thread count. The probe runs the model's own
linear shapes (every row's tokens at once) on onnxruntime's fp32 GEMM; a runtime's "GEMM fraction" is
the model's FLOPs per predict (linears and attention, as our exact graph computes them) over its
predict time, divided by that rate: the roofline of an fp32 predict on this machine.

`--cold N`: N fresh processes of each (ours exact, official), alternating: wall time from process start
to the first answer, and peak RSS. `--agreement`: the embedded default at `fast` against `exact` on
the held-out set shipped in `laya/scenarios/agreement.json` (never used for training): argmax
agreement and the largest |delta p| of any option.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from laya.answers import option_probabilities
from laya.precision import detect, plan
from laya.scenarios import load as scenario

WARMUP = 5
# Idle time before each timed call. Runtimes that just finished keep their worker threads spinning for a
# while (onnxruntime's pool, OpenMP); on a 2-core machine at 2 threads those spins took cores from the next
# runtime in the alternation (bf16 measured 143 ms p50 there, 69-85 ms after a pause).
SETTLE_S = 0.05
DEFAULT_REFERENCE = Path(".refvenv") / "bin" / "python"   # `make fixtures` creates it in the repo root
AGREEMENT_FILE = Path(__file__).resolve().parent / "scenarios" / "agreement.json"

# Runs under the reference interpreter, kept free of our package. It loads, warms up, then answers
# each "n" line on stdin with n timed predicts, so the runtimes can be timed in alternation.
_REFERENCE = r"""
import json, sys, time, warnings
warnings.simplefilter("ignore")
import torch
torch.set_num_threads(int(sys.argv[4]))
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

# A fresh process's path to its first answer, for --cold (ours: this interpreter; official: its own).
_COLD = r"""
import json, sys
{setup}
import laya
state, questions = open(sys.argv[2], encoding="utf-8").read(), json.loads(open(sys.argv[3]).read())
agent = laya.load(sys.argv[1], device="cpu"{precision})
print(json.dumps(agent.predict(state, questions)["answers"]))
# VmHWM is this image's own peak: ru_maxrss would include the bench process's RSS at fork (Linux carries it over exec)
print(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM")), flush=True)
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

    def __init__(self, python: str, model: str, threads: int):
        state, questions = scenario()
        self._cwd = tempfile.TemporaryDirectory()
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        self.proc = subprocess.Popen([os.path.abspath(python), "-c", _REFERENCE, os.path.abspath(model), state,
                                      json.dumps(questions), str(threads)],
                                     cwd=self._cwd.name, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env)
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
        for k, v in (x.get("probabilities") or {}).items():
            gap = max(gap, abs(v - y["probabilities"][k]))
        if "noul" in x:
            gap = max(gap, abs(x["noul"] - y["noul"]))
    return gap


class GemmProbe:
    """The fp32 GEMM rate this machine gives the model's linear shapes, on onnxruntime's kernels (the
    ones the exact path runs), with `threads` threads: one call runs each distinct [tokens x in] x
    [in x out] product of one encoder layer and of the head once, with prepacked weights."""

    def __init__(self, shapes: list[tuple[int, int]], tokens: int, threads: int):
        import onnxruntime as ort
        from onnx import TensorProto, helper, numpy_helper

        rng = np.random.default_rng(0)
        nodes, inits, inputs, outputs, self.feeds = [], [], [], [], {}
        for i, (k, n) in enumerate(shapes):
            nodes.append(helper.make_node("MatMul", [f"x{i}", f"w{i}"], [f"y{i}"]))
            inits.append(numpy_helper.from_array(rng.standard_normal((k, n)).astype(np.float32), f"w{i}"))
            inputs.append(helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [None, k]))
            outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [None, n]))
            self.feeds[f"x{i}"] = rng.standard_normal((tokens, k)).astype(np.float32)
        model = helper.make_model(helper.make_graph(nodes, "gemm", inputs, outputs, inits),
                                  opset_imports=[helper.make_opsetid("", 21)])
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        self.session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        self.flops = sum(2 * tokens * k * n for k, n in shapes)
        self.session.run(None, self.feeds)

    def rate(self, min_s: float = 0.05) -> float:
        """GFLOP/s of back-to-back calls for at least `min_s` seconds."""
        n, start = 0, time.perf_counter()
        while True:
            self.session.run(None, self.feeds)
            n += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_s:
                return self.flops * n / elapsed / 1e9


def model_flops(agent, rows) -> int | None:
    """FLOPs of one forward over `rows` as the exact graph computes them (None for other encoders)."""
    from laya.layout import read_parts
    from laya.onnx_graph import EncoderSpec, Unsupported

    try:
        spec = EncoderSpec.from_config(read_parts(agent.source)[1])
    except Unsupported:
        return None
    heads = agent.config.head_layers
    lengths = [r.n_tokens for r in rows]
    selected = [1 + len(r.markers) for r in rows]
    macs = spec.linear_macs(sum(lengths), sum(selected), heads) + spec.attention_macs(lengths, heads, selected)
    return 2 * macs


def _gemm_shapes(agent) -> list[tuple[int, int]]:
    from laya.layout import read_parts
    from laya.onnx_graph import EncoderSpec

    spec = EncoderSpec.from_config(read_parts(agent.source)[1])
    d, i = spec.hidden, spec.intermediate
    layer = [(d, 3 * d), (d, d), (d, 2 * i), (i, d)] if spec.arch == "modernbert" else [(d, d)] * 4 + [(d, i), (i, d)]
    return layer + ([(d, 4 * d), (4 * d, d)] if agent.config.head_layers else [])


def machine_lines(threads: int) -> list[str]:
    cpu = detect().summary()
    lines = [f"machine: {cpu['model']}, {cpu['cores']} cores; flags: {', '.join(cpu['flags']) or 'none reported'}",
             f"threads: {threads} (ours and the official runtime); load average at start: {_load()}"]
    for want in ("bf16", "int8"):
        try:
            p = plan(want)
            lines.append(f"precision {want}: available ({p.backend}; {p.reason})")
        except ValueError as exc:
            lines.append(f"precision {want}: unavailable: {exc}")
    return lines


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def run(model: str | None, iters: int = 20, device: str = "cpu", reference: str | None = None,
        precisions: tuple[str, ...] = ("exact", "fast"), threads: int = 1, cold: int = 0,
        agreement: bool = False, gemm: bool = True) -> int:
    """Every runtime alternates, one predict each, with a GEMM probe between rounds."""
    import laya

    if iters < 1:
        print("pagoda bench decide: error: --iters must be >= 1", file=sys.stderr)
        return 2
    os.environ["OMP_NUM_THREADS"] = str(threads)   # torch engines and the reference read it
    for line in machine_lines(threads):
        print(line)
    agents: dict[str, Any] = {}
    for p in precisions:
        try:
            agent = laya.load(model, device=device, precision=p, threads=threads)
        except ValueError as exc:
            print(f"pagoda {p}: not run: {exc}")
            continue
        agents[f"pagoda {agent.plan.precision}" + (f" ({p})" if p != agent.plan.precision else "")] = agent
    if not agents:
        return 2
    first = next(iter(agents.values()))
    model = model or first.source          # the default laya-mini folder, for the reference too
    state, questions = scenario()
    outs = {}
    for name, agent in agents.items():
        for _ in range(WARMUP):
            outs[name] = agent.predict(state, questions)
    rows = first.prepare(state, questions).rows
    flops = model_flops(first, rows)
    probe = GemmProbe(_gemm_shapes(first), sum(r.n_tokens for r in rows), threads) if gemm and flops else None
    ref_python = reference or str(DEFAULT_REFERENCE)
    ref = Reference(ref_python, model, threads) if Path(ref_python).is_file() else None
    times: dict[str, list[float]] = {name: [] for name in agents}
    theirs: list[float] = []
    rates: list[float] = []
    try:
        for _ in range(iters):
            for name, agent in agents.items():
                time.sleep(SETTLE_S)
                times[name] += timed(lambda a=agent: a.predict(state, questions), 1)
            if ref is not None:
                time.sleep(SETTLE_S)
                theirs += ref.time(1)
            if probe is not None:
                time.sleep(SETTLE_S)
                rates.append(probe.rate())
    finally:
        if ref is not None:
            ref.close()
    rate = float(np.median(rates)) if rates else None
    print(f"checkpoint: {model}  device: {device}")
    print(f"scenario: billing (3 questions), {outs[next(iter(outs))]['usage']['input_tokens']} input tokens, "
          f"{WARMUP} warm-up + {iters} timed, runtimes alternating; load average at end: {_load()}")
    if flops:
        print(f"work per predict: {flops / 1e9:.2f} GFLOP (linears + attention, no padding)")
    if rate:
        print(f"fp32 GEMM rate, measured between rounds (onnxruntime, the model's linear shapes, "
              f"{sum(r.n_tokens for r in rows)} rows): {rate:.1f} GFLOP/s")
    r50 = float(np.percentile(theirs, 50)) if theirs else None
    print(f"{'runtime':<30}{'p50 ms':>10}{'p95 ms':>10}{'vs official':>13}{'GFLOP/s':>10}{'GEMM frac':>11}"
          f"{'max |dp| vs official':>22}")
    table = ([(f"official laya {ref.version} (fp32)", theirs, ref.result)] if ref else []) + \
            [(name, times[name], outs[name]) for name in agents]
    for name, ts, result in table:
        p50, p95 = np.percentile(ts, [50, 95])
        speed = f"{r50 / p50:.2f}x" if r50 else "-"
        achieved = flops / (p50 / 1000) / 1e9 if flops else None
        frac = f"{achieved / rate:.0%}" if achieved and rate else "-"
        gap = f"{max_probability_gap(result, ref.result):.1e}" if ref else "-"
        print(f"{name:<30}{p50:>10.1f}{p95:>10.1f}{speed:>13}{(f'{achieved:.1f}' if achieved else '-'):>10}"
              f"{frac:>11}{gap:>22}")
    if ref is None:
        print("(no reference runtime: pass --reference PYTHON with the official laya installed)")
    for name, agent in agents.items():
        print(f"{name}: {json.dumps(agent.engine.describe())}")
    for name, agent in agents.items():
        gap = batch_mate_gap(agent, state, questions)
        print(f"{name}: the scenario's rows alone, together and in a crowd of other states: "
              + ("bit-identical" if gap == 0 else f"NOT bit-identical (max |delta| {gap:.2e})"))
    if cold:
        cold_start(model, cold, threads, ref_python if ref is not None else None)
    if agreement:
        report_agreement(threads)
    return 0


# States whose rows share a forward with the scenario's in `batch_mate_gap` (lengths unlike its own).
CROWD = ("The export button does nothing since this morning. " * 6, ["user: hi", "user: I want to cancel"],
         {"plan": "team", "seats": 40, "overdue_invoices": 2})


def batch_mate_gap(agent, state: Any, questions: dict) -> float:
    """The largest difference, in a logit or an act probability, between each of the scenario's rows answered
    alone and the same row in one forward with its own mates, then inside a crowd of other states' rows:
    0.0 is the determinism the engines promise (a row's bits never depend on what shares its call)."""
    rows = agent.prepare(state, questions).rows
    crowd = [r for s in CROWD for r in agent.prepare(s, questions).rows]
    alone = [agent.forward([r])[0] for r in rows]
    together = agent.forward(rows)
    mixed = agent.forward(crowd[:2] + rows + crowd[2:])[2:2 + len(rows)]
    return max(float(max(np.abs(a.logits - b.logits).max(), np.abs(a.act_probabilities - b.act_probabilities).max()))
               for got in (together, mixed) for a, b in zip(alone, got))


def cold_start(model: str, n: int, threads: int, ref_python: str | None) -> None:
    """Process start to first answer (the wall time includes the exit, the same for both) and peak RSS,
    `n` fresh processes of each, alternating."""
    state, questions = scenario()
    with tempfile.TemporaryDirectory() as tmp:
        state_file, q_file = Path(tmp, "state.txt"), Path(tmp, "q.json")
        state_file.write_text(state, encoding="utf-8")
        q_file.write_text(json.dumps(questions), encoding="utf-8")
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
        ours_code = _COLD.format(setup=f"sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})",
                                 precision=f", precision='exact', threads={threads}")
        ref_code = _COLD.format(setup=f"import torch; torch.set_num_threads({threads})", precision="")
        runs = {"pagoda exact": (sys.executable, ours_code)}
        if ref_python:
            runs["official laya (fp32)"] = (os.path.abspath(ref_python), ref_code)
        results: dict[str, list[tuple[float, float]]] = {k: [] for k in runs}
        for _ in range(n):
            for name, (python, code) in runs.items():
                results[name].append(_one_process([python, "-c", code, os.path.abspath(model), str(state_file),
                                                   str(q_file)], tmp, env))
    print(f"cold start ({n} fresh processes each, alternating; process start to first answer):")
    base = results.get("official laya (fp32)")
    for name, rs in results.items():
        wall, rss = np.median([r[0] for r in rs]), np.median([r[1] for r in rs])
        rel = ""
        if base:
            rel = (f"  ({wall / np.median([r[0] for r in base]):.2f}x the official wall time, "
                   f"{rss / np.median([r[1] for r in base]):.2f}x its RSS)")
        print(f"  {name:<24} {wall:6.2f} s   peak RSS {rss:7.0f} MB{rel}")


def _one_process(cmd: list[str], cwd: str, env: dict) -> tuple[float, float]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise RuntimeError(f"cold start run failed: {proc.stderr[-2000:]}")
    return wall, int(proc.stdout.split()[-1]) / 1024   # VmHWM, in kB


def agreement_cases() -> tuple[dict[str, dict], list[dict]]:
    doc = json.loads(AGREEMENT_FILE.read_text(encoding="utf-8"))
    return doc["question_sets"], doc["cases"]


DECISIVE_MARGIN = 0.05   # the reference's top two options this far apart: a decision, not a coin toss


def compare_answers(reference: list[dict], other: list[dict]) -> dict[str, Any]:
    """Argmax agreement (noul: p > 0.5) and the largest |delta p| of any option over paired answers.

    Also what a reader needs to weigh a disagreement count of a few hundred answers: its 95% Wilson
    interval, the reference's top-two margin at each disagreement (a margin of 0.001 flips under any
    rounding at all), and the agreement over decisive answers (reference margin >= DECISIVE_MARGIN, the
    rule `distill.fidelity.decisive_agreement` applies to students)."""
    n = agree = decisive = decisive_agree = 0
    gaps, flip_margins = [], []
    for ref_answers, answers in zip(reference, other):
        for name, a in ref_answers.items():
            b = answers[name]
            pa, pb = option_probabilities(a), option_probabilities(b)
            gaps.append(max(abs(pa[k] - pb[k]) for k in pa))
            top = sorted(pa.values(), reverse=True)
            margin = top[0] - top[1]
            same = max(pa, key=pa.get) == max(pb, key=pb.get)
            agree += same
            n += 1
            if margin >= DECISIVE_MARGIN:
                decisive += 1
                decisive_agree += same
            if not same:
                flip_margins.append(margin)
    return {"answers": n, "agreement": agree / n if n else float("nan"), "disagreements": n - agree,
            "agreement_ci95": wilson_interval(agree, n), "flip_margins": sorted(flip_margins),
            "decisive_answers": decisive,
            "decisive_agreement": decisive_agree / decisive if decisive else float("nan"),
            "max_abs_dp": max(gaps, default=float("nan")), "p99_abs_dp": float(np.percentile(gaps, 99)) if gaps else
            float("nan"), "mean_abs_dp": float(np.mean(gaps)) if gaps else float("nan")}


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion (written out: one closed form is not worth adding scipy to
    the `laya` extra). Unlike p +- z sqrt(p(1-p)/n) it stays inside [0, 1] and is not zero-width at 290/290."""
    if n == 0:
        return float("nan"), float("nan")
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def report_agreement(threads: int, precision: str = "fast") -> dict[str, Any]:
    import laya

    question_sets, cases = agreement_cases()
    exact = laya.load(None, precision="exact", threads=threads)
    fast = laya.load(None, precision=precision, threads=threads)
    results = {}
    for name, agent in (("exact", exact), (precision, fast)):
        results[name] = [agent.predict(c["state"], question_sets[c["questions"]])["answers"] for c in cases]
    stats = compare_answers(results["exact"], results[precision])
    print(f"agreement on the embedded default ({exact.source}), {fast.plan.precision} ({precision}) vs exact, "
          f"held-out set {AGREEMENT_FILE.name}: {len(cases)} states, {stats['answers']} answers")
    low, high = stats["agreement_ci95"]
    print(f"  argmax agreement {stats['agreement']:.2%} ({stats['disagreements']} differ; 95% interval "
          f"{low:.1%}-{high:.1%}); |delta p| max {stats['max_abs_dp']:.4f}, p99 {stats['p99_abs_dp']:.4f}, "
          f"mean {stats['mean_abs_dp']:.4f}")
    margins = ", ".join(f"{m:.4f}" for m in stats["flip_margins"]) or "none"
    print(f"  exact's top-two margin where they differ: {margins}; agreement on the "
          f"{stats['decisive_answers']} decisive answers (margin >= {DECISIVE_MARGIN}): "
          f"{stats['decisive_agreement']:.2%}")
    return stats
