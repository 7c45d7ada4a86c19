"""Fit inference temperatures on held-out decisions and report calibration before and after.

One temperature per `type:bucket` (bucket = number of options: 2, 3-5, 6-10, 11+) where the split
has at least `min_bucket` questions of that kind, else the type's temperature; a type with no
questions keeps 1.0. Each is the minimiser of the mean NLL, found by golden-section search on
log T: NLL is unimodal in T for a fixed set of logits, and a bracketing search is deterministic
and needs no tuning. Values are stored clamped to the range inference applies ([0.5, 5.0]); the
report keeps the raw fit so a clamp is visible.

Records come from `Agent.forward` on the rows inference would build (the checkpoint's own
budgets, the data's option order), so the fit sees exactly the logits `predict` will temper.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from laya.reliability import QTYPE_NAMES, Record, metrics, option_bucket, plot_reliability, softmax

TEMP_MIN, TEMP_MAX = 0.5, 5.0
SEARCH = (math.log(0.05), math.log(20.0))


def mean_nll(records: list[Record], t: float) -> float:
    return float(np.mean([-np.sum(r.target * np.log(np.clip(softmax(r.logits, t), 1e-12, 1.0)))
                          for r in records]))


def fit_temperature(records: list[Record], iters: int = 60) -> float:
    """argmin_T mean NLL over `records` (raw, unclamped); 1.0 for no records."""
    if not records:
        return 1.0
    lo, hi = SEARCH
    g = (math.sqrt(5) - 1) / 2
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = mean_nll(records, math.exp(a)), mean_nll(records, math.exp(b))
    for _ in range(iters):
        if fa <= fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = mean_nll(records, math.exp(a))
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = mean_nll(records, math.exp(b))
    return math.exp((lo + hi) / 2)


@dataclass
class Fit:
    temperature: list[float]                        # per type, clamped
    temperature_by_options: dict[str, float]        # "type:bucket" -> T, clamped
    raw: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def lookup(self, r: Record) -> float:
        return self.temperature_by_options.get(f"{QTYPE_NAMES[r.qtype]}:{option_bucket(r.k)}",
                                               self.temperature[r.qtype])


def _clamp(t: float) -> float:
    return min(TEMP_MAX, max(TEMP_MIN, t))


def fit_temperatures(records: list[Record], min_bucket: int = 10) -> Fit:
    if isinstance(min_bucket, bool) or not isinstance(min_bucket, int) or min_bucket < 1:
        raise ValueError(f"calibrate: min_bucket must be a positive integer, got {min_bucket!r}")
    fit = Fit([1.0, 1.0, 1.0], {})
    for qtype, name in enumerate(QTYPE_NAMES):
        of_type = [r for r in records if r.qtype == qtype]
        fit.counts[name] = len(of_type)
        if of_type:
            raw = fit_temperature(of_type)
            fit.raw[name] = raw
            fit.temperature[qtype] = _clamp(raw)
        buckets: dict[str, list[Record]] = {}
        for r in of_type:
            buckets.setdefault(f"{name}:{option_bucket(r.k)}", []).append(r)
        for key, group in sorted(buckets.items()):
            fit.counts[key] = len(group)
            if len(group) >= min_bucket:
                raw = fit_temperature(group)
                fit.raw[key] = raw
                fit.temperature_by_options[key] = _clamp(raw)
    return fit


def records(agent, items, budgets=None) -> list[Record]:
    """Untempered logits of every item's question, via the agent's own forward (inference rows)."""
    from laya.examples import encode

    budgets = budgets or agent.budgets()
    rows, targets = [], []
    for it in items:
        row, target = encode(agent.tokenizer, it, budgets)
        rows.append(row)
        targets.append(target)
    outs = agent.forward(rows) if rows else []
    return [Record(np.asarray(o.logits, dtype=np.float64), np.asarray(t, dtype=np.float64), it.question.qtype,
                   it.source) for o, t, it in zip(outs, targets, items)]


def evaluate(recs: list[Record], fit: Fit | None) -> dict[str, Any]:
    """Metrics overall, per type and per source, at T=1 ("before") and under `fit` ("after")."""
    before = [softmax(r.logits) for r in recs]
    after = [softmax(r.logits, fit.lookup(r)) for r in recs] if fit else before
    groups: dict[str, list[int]] = {"all": list(range(len(recs)))}
    for i, r in enumerate(recs):
        groups.setdefault("type:" + QTYPE_NAMES[r.qtype], []).append(i)
        if r.source:
            groups.setdefault("source:" + r.source, []).append(i)
    out = {}
    for name, idx in groups.items():
        sub = [recs[i] for i in idx]
        out[name] = {"before": metrics(sub, [before[i] for i in idx]),
                     "after": metrics(sub, [after[i] for i in idx])}
    return out


def plot_by_type(recs: list[Record], fit: Fit, path: str) -> None:
    panels = {}
    for qtype, name in enumerate(QTYPE_NAMES):
        sub = [r for r in recs if r.qtype == qtype]
        if sub:
            panels[name] = (sub, [softmax(r.logits) for r in sub], [softmax(r.logits, fit.lookup(r)) for r in sub])
    if panels:
        plot_reliability(panels, path)


def write_config(model_dir: str, out_dir: str, fit: Fit) -> None:
    """Copy the checkpoint to `out_dir` (unless in place) with the fitted temperatures in its config."""
    import shutil

    if os.path.abspath(out_dir) != os.path.abspath(model_dir):
        shutil.copytree(model_dir, out_dir, dirs_exist_ok=True)
    path = os.path.join(out_dir, "rl_agent_config.json")
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["temperature"] = [round(t, 4) for t in fit.temperature]
    cfg["temperature_by_options"] = {k: round(v, 4) for k, v in fit.temperature_by_options.items()}
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    os.replace(tmp, path)


def markdown_report(fit: Fit, ev: dict[str, Any], figure: str | None, title: str = "Calibration report") -> str:
    lines = [f"# {title}", "", "Temperatures (raw fit -> stored, clamped to [0.5, 5]):", "",
             "| group | n | raw T | stored T |", "| --- | ---: | ---: | ---: |"]
    for key, n in fit.counts.items():
        if key in fit.raw:
            stored = fit.temperature_by_options.get(key) if ":" in key else fit.temperature[QTYPE_NAMES.index(key)]
            lines.append(f"| {key} | {n} | {fit.raw[key]:.3f} | {stored:.3f} |")
        else:
            lines.append(f"| {key} | {n} | - | (type T) |")
    lines += ["", "| group | n | acc | ECE15 before | ECE15 after | ECE10 before | ECE10 after | "
              "Brier before | Brier after | NLL before | NLL after |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, m in ev.items():
        b, a = m["before"], m["after"]
        if not b.get("n"):
            continue
        lines.append(f"| {name} | {b['n']} | {a['accuracy']:.3f} | {b['ece15']:.3f} | {a['ece15']:.3f} | "
                     f"{b['ece10']:.3f} | {a['ece10']:.3f} | {b['brier']:.3f} | {a['brier']:.3f} | "
                     f"{b['nll']:.3f} | {a['nll']:.3f} |")
    if figure:
        lines += ["", f"![reliability per question type]({figure})", ""]
    return "\n".join(lines) + "\n"


def calibrate(model_dir: str, data: str, out_dir: str | None = None, report_dir: str | None = None,
              min_bucket: int = 10) -> tuple[Fit, dict[str, Any]]:
    """Fit on `data` (JSONL decisions), write temperatures, and a Markdown report with a reliability PNG."""
    import laya
    from laya.examples import read_jsonl

    items = read_jsonl(data)
    agent = laya.load(model_dir)
    recs = records(agent, items)
    fit = fit_temperatures(recs, min_bucket)
    ev = evaluate(recs, fit)
    write_config(model_dir, out_dir or model_dir, fit)
    if report_dir:
        os.makedirs(report_dir, exist_ok=True)
        plot_by_type(recs, fit, os.path.join(report_dir, "reliability.png"))
        with open(os.path.join(report_dir, "calibration.md"), "w", encoding="utf-8") as f:
            f.write(markdown_report(fit, ev, "reliability.png",
                                    f"Calibration of {os.path.basename(os.path.normpath(model_dir))} on "
                                    f"{os.path.basename(data)} (fit split; see a held-out split for generalisation)"))
        with open(os.path.join(report_dir, "calibration.json"), "w", encoding="utf-8") as f:
            json.dump({"temperature": fit.temperature, "temperature_by_options": fit.temperature_by_options,
                       "raw": fit.raw, "counts": fit.counts, "metrics": ev}, f, indent=2)
    return fit, ev


def register(commands, bench) -> None:
    p = commands.add_parser("calibrate", help="fit temperatures on held-out decisions; report ECE/Brier/NLL")
    p.add_argument("--model", required=True, help="Laya checkpoint folder")
    p.add_argument("--data", required=True, help="held-out JSONL of {state, questions, labels|targets}")
    p.add_argument("--out", help="write the calibrated checkpoint here (default: update --model in place)")
    p.add_argument("--report", help="folder for calibration.md, calibration.json and reliability.png")
    p.add_argument("--min-bucket", type=int, default=10, help="questions needed for a per-bucket temperature")
    p.set_defaults(func=_run)


def _run(args) -> int:
    fit, ev = calibrate(args.model, args.data, args.out, args.report, args.min_bucket)
    a = ev["all"]
    print(json.dumps({"temperature": fit.temperature, "temperature_by_options": fit.temperature_by_options,
                      "ece15_before": a["before"]["ece15"], "ece15_after": a["after"]["ece15"],
                      "nll_before": a["before"]["nll"], "nll_after": a["after"]["nll"]}, indent=2))
    return 0
