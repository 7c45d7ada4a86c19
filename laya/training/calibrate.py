"""Fit inference temperatures on held-out decisions and report calibration before and after.

One temperature per `type:bucket` (bucket = number of options: 2, 3-5, 6-10, 11+) where the split
has at least `min_bucket` questions of that kind, else the type's temperature. A type with no
questions in the split keeps the checkpoint's temperatures for it (its type's and its buckets'): the
split says nothing about them, and resetting them to 1.0 changed answers to questions nobody calibrated. The fit and the clamp rule are `laya.calibration`'s (shared with distilled
students); the report keeps the raw fit so a clamp is visible.

Records come from `Agent.forward` on the rows inference would build (the checkpoint's own
budgets, the data's option order), so the fit sees exactly the logits `predict` will temper.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from laya.calibration import (
    TEMP_MAX,
    TEMP_MIN,
    bucket_key,
    clamp_temperature,
    fit_temperature,
    metrics,
    plot_reliability,
    softmax,
)
from laya.questions import QUESTION_TYPES


@dataclass
class Record:
    """One answered question: untempered logits (valid slots), target distribution, type index, source."""

    logits: np.ndarray   # [k] float64
    target: np.ndarray   # [k], sums to 1 (one-hot for hard labels)
    qtype: int
    source: str = ""

    @property
    def k(self) -> int:
        return len(self.logits)

    @property
    def bucket(self) -> str:
        return bucket_key(QUESTION_TYPES[self.qtype], self.k)


def fit_records(records: list[Record]) -> float:
    return fit_temperature([r.logits for r in records], [r.target for r in records])


@dataclass
class Fit:
    temperature: list[float]                        # per type, clamped
    temperature_by_options: dict[str, float]        # "type:bucket" -> T, clamped
    raw: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    kept: list[str] = field(default_factory=list)   # types with no data, whose temperatures the checkpoint gave

    def lookup(self, r: Record) -> float:
        return self.temperature_by_options.get(r.bucket, self.temperature[r.qtype])


def fit_temperatures(records: list[Record], min_bucket: int = 10, prior: Fit | None = None) -> Fit:
    """`prior`: the checkpoint's temperatures, kept for each type the records have no question of."""
    if isinstance(min_bucket, bool) or not isinstance(min_bucket, int) or min_bucket < 1:
        raise ValueError(f"calibrate: min_bucket must be a positive integer, got {min_bucket!r}")
    fit = Fit([1.0, 1.0, 1.0], {})
    for qtype, name in enumerate(QUESTION_TYPES):
        of_type = [r for r in records if r.qtype == qtype]
        fit.counts[name] = len(of_type)
        if not of_type and prior is not None:
            fit.temperature[qtype] = prior.temperature[qtype]
            fit.temperature_by_options.update({k: t for k, t in prior.temperature_by_options.items()
                                               if k.split(":")[0] == name})
            fit.kept.append(name)
        if of_type:
            raw = fit_records(of_type)
            fit.raw[name] = raw
            fit.temperature[qtype] = clamp_temperature(raw)
        buckets: dict[str, list[Record]] = {}
        for r in of_type:
            buckets.setdefault(r.bucket, []).append(r)
        for key, group in sorted(buckets.items()):
            fit.counts[key] = len(group)
            if len(group) >= min_bucket:
                raw = fit_records(group)
                fit.raw[key] = raw
                fit.temperature_by_options[key] = clamp_temperature(raw)
    return fit


def records(agent, items, budgets=None) -> list[Record]:
    """Untempered logits of every item's question, via the agent's own forward (inference rows)."""
    from laya.training.examples import encode

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
        groups.setdefault("type:" + QUESTION_TYPES[r.qtype], []).append(i)
        if r.source:
            groups.setdefault("source:" + r.source, []).append(i)
    out = {}
    for name, idx in groups.items():
        targets = [recs[i].target for i in idx]
        out[name] = {"before": metrics([before[i] for i in idx], targets),
                     "after": metrics([after[i] for i in idx], targets)}
    return out


def _confidence_and_hits(recs: list[Record], temperature) -> tuple[np.ndarray, np.ndarray]:
    probs = [softmax(r.logits, temperature(r)) for r in recs]
    conf = np.array([p.max() for p in probs])
    hits = np.array([int(np.argmax(p)) == int(np.argmax(r.target)) for p, r in zip(probs, recs)], dtype=float)
    return conf, hits


def plot_by_type(recs: list[Record], fit: Fit, path: str) -> None:
    """Reliability before (T=1) and after the fit, one panel per question type."""
    panels = {}
    for qtype, name in enumerate(QUESTION_TYPES):
        sub = [r for r in recs if r.qtype == qtype]
        if sub:
            panels[name] = [("before", *_confidence_and_hits(sub, lambda r: 1.0)),
                            ("after", *_confidence_and_hits(sub, fit.lookup))]
    if panels:
        plot_reliability(panels, path)


def checkpoint_temperatures(model_dir: str) -> Fit:
    """The temperatures a checkpoint holds now (1.0 where it has none), as a `Fit`."""
    from laya.config import LayaConfig

    with open(os.path.join(model_dir, "rl_agent_config.json"), encoding="utf-8") as f:
        cfg = LayaConfig.from_dict(json.load(f))
    cfg.validate()
    return Fit([float(t) for t in cfg.temperature], {k: float(v) for k, v in cfg.temperature_by_options.items()})


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
    lines = [f"# {title}", "", f"Temperatures (raw fit -> stored, clamped to [{TEMP_MIN:g}, {TEMP_MAX:g}]):", "",
             "| group | n | raw T | stored T |", "| --- | ---: | ---: | ---: |"]
    for key, n in fit.counts.items():
        if key in fit.raw:
            stored = fit.temperature_by_options.get(key) if ":" in key else fit.temperature[QUESTION_TYPES.index(key)]
            lines.append(f"| {key} | {n} | {fit.raw[key]:.3f} | {stored:.3f} |")
        elif key in fit.kept:
            kept = [f"{fit.temperature[QUESTION_TYPES.index(key)]:.3f}"] + [
                f"{k} {t:.3f}" for k, t in sorted(fit.temperature_by_options.items()) if k.split(":")[0] == key]
            lines.append(f"| {key} | 0 | - | {', '.join(kept)} (no data: the checkpoint's, kept) |")
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
    from laya.training.examples import read_jsonl

    items = read_jsonl(data)
    agent = laya.load(model_dir)
    recs = records(agent, items)
    fit = fit_temperatures(recs, min_bucket, checkpoint_temperatures(model_dir))
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

