"""The report stage: `report.md`, `report.json` and PNGs comparing students with their teacher, held-out rows.

Quality is measured against the teacher (argmax agreement, KL, ECE with the teacher's distribution
as the soft truth) and, where the data has gold labels, against those with `laya.calibration.metrics`
(the measures of a checkpoint's model card, so the two read alike); latency for every student
and for the teacher in the same process, 1 thread and all cores, batch 1 and batch 32, so the
speed-up is a ratio of two numbers taken under the same (shared, noisy) load.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from distill import fidelity
from laya.calibration import metrics, plot_reliability, softmax
from laya.corpus import noise

TARGETS = {"int8_size_mb": 25.0, "b1_p50_ms_1thread": 10.0, "b1_p50_cpu_ms_1thread": 10.0, "agreement": 0.95, "ece_teacher": 0.03, "speedup": 10.0}


def dir_size_mb(path: Path) -> float:
    if path.is_file():
        return path.stat().st_size / 2**20
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


def student_probs(path: Path, precision: str | None, texts: list[str]
                  ) -> tuple[dict[str, np.ndarray], dict[str, dict[str, float | None]]]:
    """Per question: calibrated probabilities as the runtime tempers them, and the (applied, fitted) T."""
    from distill.runtime import Student

    s = Student(path, precision=precision)
    logits = s.logits(texts).astype(np.float64)  # measures in float64 (laya.calibration's convention)
    probs = {h["name"]: softmax(logits[:, h["offset"]:h["offset"] + h["size"]], s.temperatures[h["name"]])
             for h in s.meta["heads"]}
    temps = {h["name"]: {"temperature": s.temperatures[h["name"]],
                         "temperature_raw": h.get("temperature_raw")} for h in s.meta["heads"]}
    return probs, temps


def vs_gold(p: np.ndarray, gold: np.ndarray) -> dict[str, float]:
    """ECE (15 bins) and accuracy against gold labels, over rows whose gold label is one of the options."""
    keep = gold >= 0
    m = metrics(list(p[keep]), list(np.eye(p.shape[1])[gold[keep]]))
    return {"ece_gold": m.get("ece15", float("nan")), "acc_gold": m.get("accuracy", float("nan"))}


def quality(probs: dict[str, np.ndarray], teacher: dict[str, np.ndarray], gold: dict[str, np.ndarray]) -> dict:
    out = {}
    for q, p in probs.items():
        decisive, share = fidelity.decisive_agreement(p, teacher[q])
        row = {"mean_top_p": float(p.max(-1).mean()),
               "agreement": fidelity.agreement(p, teacher[q]), "decisive_agreement": decisive,
               "decisive_share": share,
               "kl": fidelity.mean_kl(teacher[q], p),
               "ece_teacher": fidelity.ece_vs_teacher(p, teacher[q]),
               "deferral": fidelity.deferral_curve(p, teacher[q])}
        if q in gold:
            row.update(vs_gold(p, gold[q]))
            row["vs_gold"] = fidelity.disagreements_vs_gold(p, teacher[q], gold[q])
        out[q] = row
    return out


def _fmt(v: Any, spec: str = ".3f") -> str:
    return "—" if v is None or (isinstance(v, float) and np.isnan(v)) else format(v, spec)


def plots(out: Path, probs: dict[str, dict[str, np.ndarray]], teacher: dict[str, np.ndarray],
          latency: dict[str, dict]) -> list[str]:
    panels = {q: [(label, *fidelity.teacher_outcome(pr[q], teacher[q])) for label, pr in probs.items()]
              for q in teacher}
    plot_reliability(panels, str(out / "report-reliability.png"), bins=15,
                     xlabel="student confidence (max p)", ylabel="teacher probability of that option")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = list(latency)
    keys = [k for k in next(iter(latency.values()))]
    width = 0.8 / len(keys)
    for j, k in enumerate(keys):
        ax.bar(np.arange(len(labels)) + j * width, [latency[m][k]["b1_p50"] for m in labels], width, label=k + ", batch 1")
    ax.set_yscale("log")
    ax.set_xticks(np.arange(len(labels)) + width * (len(keys) - 1) / 2, labels)
    ax.set_ylabel("ms per state (p50)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "report-latency.png", dpi=90)
    plt.close(fig)
    return ["report-reliability.png", "report-latency.png"]


def write_report(run, d: dict) -> dict:
    from tqdm.auto import tqdm

    from distill.latency import student_latency, teacher_latency

    out, task = run.layout.out, run.task
    rc = task.report
    sel = np.flatnonzero(d["split"] == 2)
    texts = [d["texts"][i] for i in sel]
    teacher = {q: v[sel] for q, v in d["targets"].items()}
    gold = {q: v[sel] for q, v in d["gold"].items()}
    variants: dict[str, tuple[Path, str | None]] = {}
    if task.student.kind == "encoder":
        variants["encoder int8"] = (out, "int8")
        variants["encoder fp32"] = (out, "fp32")
    if "linear" in run.kinds():
        variants["linear"] = (out if task.student.kind == "linear" else run.layout.baseline, None)
    cores = os.cpu_count() or 1
    threads = {"1 thread": 1, f"{cores} threads": cores}
    report: dict[str, Any] = {"held_out_rows": len(texts), "students": {}, "teacher": {}, "targets": {}}
    probs = {}
    with tqdm(total=len(variants) * (1 + len(threads)) + len(threads), desc="report", unit="step",
              disable=not run.progress) as bar:
        for name, (path, precision) in variants.items():
            probs[name], temps = student_probs(path, precision, texts)
            bar.update(1)
            lat = {}
            for tname, n in threads.items():
                lat[tname] = student_latency(path, n, precision, texts, singles=rc.singles, batches=rc.batches,
                                             batch_size=rc.batch_size)
                bar.update(1)
            model_file = path / ("model.int8.onnx" if precision == "int8" else "model.onnx")
            per_question = quality(probs[name], teacher, gold)
            for q, t in temps.items():
                per_question[q].update(t)
            report["students"][name] = {"questions": per_question, "latency": lat,
                                        "size_mb": dir_size_mb(model_file)}
        tlat = {}
        for tname, n in threads.items():
            tlat[tname] = teacher_latency(str(run.teacher_dir), task.questions, n, texts, task.budgets,
                                          singles=rc.teacher_singles, batches=max(1, rc.batches // 2),
                                          batch_size=rc.batch_size)
            bar.update(1)
        tq = {}
        for q in teacher:
            share = fidelity.decisive_agreement(teacher[q], teacher[q])[1]
            tq[q] = {"mean_top_p": float(teacher[q].max(-1).mean()), "agreement": 1.0, "decisive_agreement": 1.0,
                     "decisive_share": share, "kl": 0.0, "ece_teacher": 0.0}
            if q in gold:
                tq[q].update(vs_gold(teacher[q], gold[q]))
        report["teacher"] = {"questions": tq, "latency": tlat, "size_mb": dir_size_mb(run.teacher_dir),
                             "path": str(run.teacher_dir)}
    report["other_data"] = {name: other_data(run, path, variants) for name, path in run.eval_data.items()}
    lat_all = {**{k: v["latency"] for k, v in report["students"].items()}, "teacher": tlat}
    pngs = plots(out, probs, teacher, lat_all)
    report["targets"] = targets(report)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "report.md").write_text(render(task, report, pngs, run))
    print((out / "report.md").read_text())
    return report


def other_data(run, path: Path, variants: dict[str, tuple[Path, str | None]]) -> dict[str, Any]:
    """Agreement with the teacher on text outside the corpus (e.g. hand-written tickets), where a student
    trained on one generator's text shows whether it learnt the teacher or the generator; and, where the
    file has gold labels, the teacher's and each student's accuracy on them, since on such text a
    disagreement may be the teacher's mistake rather than the student's."""
    import dataclasses

    from distill.labels import gold_indices, load_corpus
    from laya.answers import probabilities_from_answer
    from laya.rows import state_text

    ds = load_corpus(path, dataclasses.replace(run.task, gold={}), "--eval-data")
    # the task's gold where the file has its column (a file of bare texts is measured against the teacher
    # only), and the --eval-gold columns, which `Run` checked every eval file has
    gold_columns = {q: c for q, c in run.task.gold.items() if c in ds.column_names} | run.eval_gold
    task = dataclasses.replace(run.task, gold=gold_columns)
    texts = [state_text(x) for x in ds[task.text_field]]
    gold = gold_indices(ds, task)

    def teacher_probs(states: list[str]) -> dict[str, np.ndarray]:
        answers = run.agent.predict_batch(states, task.questions, batch_size=task.labels.batch_size, **task.budgets)
        return {q: np.array([probabilities_from_answer(parsed, a["answers"][q]) for a in answers], dtype=np.float64)
                for q, parsed in task.parsed.items()}

    teacher = teacher_probs(texts)
    # How often the teacher's own answer survives edits that keep a text's meaning: a student taught on edited
    # copies (distill.corpus) learns a teacher that answers one message two ways, so this is a rough ceiling
    # on its agreement (not a bound: docs/distill.md has files where a student exceeds it).
    edited = teacher_probs(noise.same_meaning_copies(texts))
    unchanged = {q: fidelity.agreement(edited[q], np.repeat(teacher[q], noise.EDIT_COPIES, axis=0)) for q in teacher}
    return {"path": str(path), "rows": len(texts), "gold_columns": task.gold,
            "teacher": {q: vs_gold(teacher[q], gold[q]) for q in teacher if q in gold},
            "teacher_unchanged_under_edits": unchanged,
            "students": {name: quality(student_probs(p, precision, texts)[0], teacher, gold)
                         for name, (p, precision) in variants.items()}}


def targets(report: dict) -> dict[str, dict]:
    if "encoder int8" not in report["students"]:
        return {}
    s = report["students"]["encoder int8"]
    one = s["latency"]["1 thread"]["b1_p50"]
    speed = report["teacher"]["latency"]["1 thread"]["b1_p50"] / one
    values = {
        "int8_size_mb": (s["size_mb"], "<="),
        "b1_p50_ms_1thread": (one, "<="),
        "b1_p50_cpu_ms_1thread": (s["latency"]["1 thread"]["b1_cpu_p50"], "<="),
        "agreement": (min(q["agreement"] for q in s["questions"].values()), ">="),
        "ece_teacher": (max(q["ece_teacher"] for q in s["questions"].values()), "<="),
        "speedup": (speed, ">="),
    }
    return {k: {"value": v, "target": TARGETS[k], "met": bool(v <= TARGETS[k] if op == "<=" else v >= TARGETS[k]),
                "op": op} for k, (v, op) in values.items()}


def _deferral_table(students: dict[str, dict], qs: list[str]) -> list[str]:
    """Agreement when the answers under a threshold are the teacher's (`distill.deferral`), int8 encoder only."""
    m = students.get("encoder int8")
    if not m or "deferral" not in m[qs[0]]:
        return []
    curve = {q: {c["threshold"]: c for c in m[q]["deferral"]} for q in qs}
    lines = ["", "Deferring to the teacher (`pagoda serve --student ... --defer-below T`): the int8 student's "
             "agreement when every answer whose `answer_confidence` is under T is the teacher's, and the share of "
             "answers that goes to the teacher (agreement / share).", "",
             "| T | " + " | ".join(qs) + " |", "| ---: | " + " | ".join("---:" for _ in qs) + " |"]
    for t in curve[qs[0]]:
        lines.append(f"| {t:g} | " + " | ".join(
            f"{_fmt(curve[q][t]['agreement'])} / {_fmt(curve[q][t]['deferred'], '.2f')}" for q in qs) + " |")
    return lines


def render(task, report: dict, pngs: list[str], run) -> str:
    teacher_name = "teacher ({})".format(Path(report["teacher"]["path"]).name)
    rows = [(teacher_name, report["teacher"])] + list(report["students"].items())
    qs = list(task.questions)
    lines = [f"# Student report: {task.name}", "",
             f"Held-out rows: {report['held_out_rows']} (never trained or calibrated on). "
             f"Teacher: `{report['teacher']['path']}`.",
             "ECE vs teacher: 15 bins of the student's top probability against the teacher's probability "
             "of the same option. Decisive rows: the teacher's top two options differ by >= 0.05 (elsewhere "
             "its argmax is a coin toss). ECE is `laya.calibration.ece` (bins [lo, hi), the last closed), as "
             "in laya's model card. T: the temperature the runtime applies, clamped to laya's [0.5, 5], and "
             "the raw fit on the validation split. Latency: ms per state, measured in one process on a "
             "shared machine (noisy: compare ratios). CPU ms: process CPU time per batch-1 call at 1 thread, "
             "i.e. the wall time an idle core would show.", ""]
    lines += ["## Quality per question", "",
              "| model | question | mean top p | agreement | agreement, decisive rows (share) | mean KL "
              "| ECE vs teacher | ECE vs gold | accuracy vs gold | T applied (fit) |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in rows:
        for q in qs:
            m = r["questions"][q]
            temp = "—" if "temperature" not in m else "{} ({})".format(
                _fmt(m["temperature"], ".3g"), _fmt(m.get("temperature_raw"), ".3g"))
            lines.append("| {} | {} | {} | {} | {} ({}) | {} | {} | {} | {} | {} |".format(
                name, q, _fmt(m["mean_top_p"]), _fmt(m["agreement"]), _fmt(m["decisive_agreement"]),
                _fmt(m["decisive_share"], ".2f"), _fmt(m["kl"], ".4f"), _fmt(m["ece_teacher"]),
                _fmt(m.get("ece_gold")), _fmt(m.get("acc_gold")), temp))
    keys = list(report["teacher"]["latency"])
    lines += ["", "## Latency and size", "",
              "| model | size MB | " + " | ".join(f"{k} b1 p50 | {k} b1 p99 | {k} b{task.report.batch_size} p50/state"
                                                  for k in keys)
              + " | 1 thread b1 CPU ms p50 | speed-up vs teacher (1 thread, b1) |",
              "| --- | ---: | " + " | ".join("---: | ---: | ---:" for _ in keys) + " | ---: | ---: |"]
    t1 = report["teacher"]["latency"]["1 thread"]["b1_p50"]
    for name, r in rows:
        cells = []
        for k in keys:
            lat = r["latency"][k]
            cells += [_fmt(lat["b1_p50"], ".2f"), _fmt(lat["b1_p99"], ".2f"), _fmt(lat["b32_p50"], ".2f")]
        lines.append("| {} | {:.1f} | {} | {:.2f} | {:.1f}× |".format(
            name, r["size_mb"], " | ".join(cells), r["latency"]["1 thread"]["b1_cpu_p50"],
            t1 / r["latency"]["1 thread"]["b1_p50"]))
    for name, other in report.get("other_data", {}).items():
        gold_cols = ", ".join(f"{q}: `{c}`" for q, c in other.get("gold_columns", {}).items()) or "none"
        lines += ["", f"## Agreement on {name} ({other['rows']} rows of `{other['path']}`, not in the corpus)", "",
                  f"Gold columns: {gold_cols}. Accuracy vs gold puts the agreement in context: where the teacher "
                  "is wrong on such text, a student that disagrees with it may be right. *Disagreements* splits "
                  "the rows where the two pick differently by who matches gold (student / teacher / neither); "
                  "*where the teacher is right* is the agreement over the rows whose teacher answer matches "
                  "gold (their count in brackets). The teacher's *agreement* is with itself: how often its answer "
                  f"stays the same on {noise.EDIT_COPIES} copies of each row with edits that keep the meaning (case, "
                  "punctuation, typos, a greeting and sign-off; `laya.corpus.noise`): a rough ceiling for a "
                  "student taught on such copies, not a bound.", "",
                  "| model | question | agreement | agreement, decisive rows (share) | mean KL | ECE vs teacher "
                  "| accuracy vs gold | disagreements: student / teacher / neither right | agreement where the "
                  "teacher is right (rows) |",
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for q in qs:
            lines.append("| {} | {} | {} | — | — | — | {} | — | — |".format(
                teacher_name, q, _fmt(other["teacher_unchanged_under_edits"][q]),
                _fmt(other["teacher"].get(q, {}).get("acc_gold"))))
        for model, r in other["students"].items():
            for q in qs:
                m = r[q]
                split = right = "—"
                if "vs_gold" in m:
                    v = m["vs_gold"]
                    split = f"{v['differ']}: {v['student_right']} / {v['teacher_right']} / {v['neither']}"
                    right = f"{_fmt(v['agreement_teacher_right'])} ({v['teacher_right_rows']})"
                lines.append("| {} | {} | {} | {} ({}) | {} | {} | {} | {} | {} |".format(
                    model, q, _fmt(m["agreement"]), _fmt(m["decisive_agreement"]), _fmt(m["decisive_share"], ".2f"),
                    _fmt(m["kl"], ".4f"), _fmt(m["ece_teacher"]), _fmt(m.get("acc_gold")), split, right))
        lines += _deferral_table(other["students"], qs)
    if report["targets"]:
        lines += ["", "## Targets (encoder int8)", "", "| target | value | goal | met |", "| --- | ---: | ---: | --- |"]
        for k, t in report["targets"].items():
            met = "yes" if t["met"] else "**no**"
            lines.append("| {} | {:.3f} | {} {} | {} |".format(k, t["value"], t["op"], t["target"], met))
    lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in pngs]
    lines += ["", "Student config: `{}`".format(json.dumps(task.to_dict()["student"]))]
    return "\n".join(lines) + "\n"
