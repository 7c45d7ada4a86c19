"""laya-mini on real text it never trained on, against the zero-shot baseline computed in the same run.

`pagoda laya-mini eval` (issue 15). Three measurements:

- **held-out-label intents**, 5-way (`laya.corpus.intents.heldout_choice_sets`: CLINC `utility`+`travel`,
  random and same-domain distractors; Snips GetWeather/RateBook/SearchScreeningEvent): laya-mini's
  answer vs the cosine similarity of mean-pooled all-MiniLM-L6-v2 embeddings of text and label (the
  encoder under laya-mini, untrained), on the same items. Labels humanised ("book hotel"); `raw` wording
  ("book_hotel") is reported too.
- **hand-written tickets** (`datasets/handwritten_tickets.jsonl`, read by `laya.corpus.handwritten`; never
  used in training or calibration) under the README's support-triage questions (`laya.scenarios`
  "billing"): department accuracy, churn accuracy (p > 0.5), urgency MAE (expected level vs gold),
  department ECE at the checkpoint's fitted temperatures, i.e. after calibration, the gold answer's log
  loss per question; the baseline's department accuracy on rendered options; and how often each answer
  survives edits that keep a ticket's meaning (`laya.corpus.noise.SAME_MEANING`: case, punctuation, a typo
  or two, a greeting and sign-off), which bounds what a student taught on such copies can agree with it.
- the issue's **acceptance sentences** (`ACCEPTANCE`, also `tests/laya/test_mini_acceptance.py`).

Answers go through `Agent.prepare/forward/finish`, the path `predict` takes, so temperatures and budgets
are the checkpoint's own. The baseline is `laya.training.similarity.Cosine` (also the build's teacher).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from laya.answers import top_option
from laya.calibration import ece, ece_by_chance
from laya.checks import check_threads
from laya.corpus import noise
from laya.corpus.handwritten import default_tickets, read_tickets
from laya.corpus.intents import DEFAULT_DATA, EVAL_INSTRUCTION, heldout_choice_sets, humanise
from laya.scenarios import load as scenario
from laya.training.similarity import Cosine

ECE_BINS = 10            # 74 tickets: 15 bins would leave most bins with a handful of items
GOAL_MARGIN = 0.03       # issue 15: held-out-label accuracy >= baseline + 3 points
WORST_INTENTS = 3        # per held-out set, the intents printed where laya-mini trails the baseline most


@dataclass(frozen=True)
class Acceptance:
    """One of the issue's sentences and the answers the shipped default must give."""

    text: str
    department: str | None = None
    churn_above: float | None = None
    churn_below: float | None = None
    urgency_at_least: float | None = None
    urgency_at_most: float | None = None

    def failures(self, answers: dict[str, Any]) -> list[str]:
        """What this answer gets wrong, as measured values (empty: passes)."""
        dept = answers["department"]["choice"]
        churn, urg = answers["churn_risk"]["noul"], answers["urgency"]["score"]
        bad = []
        if self.department is not None and dept != self.department:
            bad.append(f"department {dept} (want {self.department})")
        if self.churn_above is not None and not churn > self.churn_above:
            bad.append(f"churn_risk {churn:.3f} (want > {self.churn_above})")
        if self.churn_below is not None and not churn < self.churn_below:
            bad.append(f"churn_risk {churn:.3f} (want < {self.churn_below})")
        if self.urgency_at_least is not None and not urg >= self.urgency_at_least:
            bad.append(f"urgency {urg:.2f} (want >= {self.urgency_at_least})")
        if self.urgency_at_most is not None and not urg <= self.urgency_at_most:
            bad.append(f"urgency {urg:.2f} (want <= {self.urgency_at_most})")
        return bad


ACCEPTANCE = (
    Acceptance("We were billed twice, refund or we cancel.", "billing", churn_above=0.7, urgency_at_least=1.0),
    Acceptance("I subscribed last month, but I was charged twice. I want a refund, and I need to cancel my "
               "account today.", "billing", churn_above=0.7, urgency_at_least=1.0),
    Acceptance("Our whole team is locked out of production right now", urgency_at_least=1.5),
    Acceptance("When will my April invoice be sent? No rush.", urgency_at_most=0.5, churn_below=0.3),
)


# ---- laya ---------------------------------------------------------------------------------------------

def _answers(agent, requests: list[tuple[Any, dict]], batch_size: int = 64) -> list[dict[str, Any]]:
    """`predict` on many (state, questions) pairs, forwarding rows of several requests together."""
    prepared = [agent.prepare(s, q) for s, q in requests]
    order = sorted(range(len(prepared)), key=lambda i: max(r.n_tokens for r in prepared[i].rows))
    out: list[dict[str, Any]] = [{}] * len(prepared)
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        outputs = agent.forward([r for i in chunk for r in prepared[i].rows])
        at = 0
        for i in chunk:
            n = len(prepared[i].rows)
            out[i] = agent.finish(prepared[i], outputs[at:at + n])["answers"]
            at += n
    return out


def _log_loss(gold_p: np.ndarray) -> float:
    """Mean log loss of the gold answer, a proper score: accuracy, MAE and a 10-bin ECE over 74 tickets move by
    whole items, while a change of temperatures shows here first. The API rounds to 4 digits: floor 1e-4."""
    return float(-np.log(np.maximum(gold_p, 1e-4)).mean())


OPAQUE_INTENT_NAMES = tuple(f"choice {c}" for c in "ABCDE")
OPAQUE_DEPARTMENT_NAMES = tuple(f"desk {c}" for c in "ABCDEFGH")
"""Option names that say nothing, for the `_opaque` measures: the meaning is in the descriptions only, as when a user
names queues by code. Forms no training row uses (`laya.corpus.forms.opaque_names`)."""


def _criteria(opts: list[str], wording: str) -> dict[str, str] | list[str]:
    """A held-out item's options as the `wording` writes them: humanised names, raw names, or opaque names each
    described by its humanised label."""
    if wording == "opaque":
        return {name: humanise(o) for name, o in zip(OPAQUE_INTENT_NAMES, opts)}
    return [humanise(o) if wording == "human" else o for o in opts]


def _rendered(criteria: dict[str, str] | list[str]) -> list[str]:
    """What an option reads as in laya's row (`name: description`), which the cosine baseline compares with."""
    return [f"{k}: {v}" for k, v in criteria.items()] if isinstance(criteria, dict) else list(criteria)


def eval_intents(agent, cosine: Cosine, sets: dict[str, list[tuple[str, list[str], int]]]) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for name, items in sets.items():
        for wording in ("human", "raw", "opaque"):
            crits = [_criteria(opts, wording) for _, opts, _ in items]
            qs = [(t, {"intent": {"type": "choice", "instructions": EVAL_INSTRUCTION, "criteria": c}})
                  for (t, _, _), c in zip(items, crits)]
            ans = [a["intent"] for a in _answers(agent, qs)]
            golds = [list(c)[g] for (_, _, g), c in zip(items, crits)]
            hit = np.array([a["choice"] == gold for a, gold in zip(ans, golds)], dtype=float)
            conf = np.array([max(a["probabilities"].values()) for a in ans])
            base = np.array([cosine.choose(t, _rendered(c)) == g for (t, _, g), c in zip(items, crits)], dtype=float)
            key = name if wording == "human" else f"{name}_{wording}"
            gold_p = np.array([a["probabilities"][gold] for a, gold in zip(ans, golds)], dtype=float)
            res[key] = {"n": len(items), "laya": float(hit.mean()), "cosine": float(base.mean()),
                        "laya_ece10": ece(conf, hit, ECE_BINS), "laya_nll": _log_loss(gold_p),
                        "by_intent": by_intent([opts[g] for _, opts, g in items], hit, base,
                                               [a["choice"] for a in ans])}
    return res


def by_intent(golds: list[str], hit: np.ndarray, base: np.ndarray, answers: list[str]) -> dict[str, dict[str, Any]]:
    """Accuracy per true intent, laya-mini and the baseline, and laya-mini's most frequent wrong answer: a set's
    mean hides whether it trails everywhere or on one label that a seen label draws away."""
    out: dict[str, dict[str, Any]] = {}
    for y in sorted(set(golds)):
        idx = [i for i, g in enumerate(golds) if g == y]
        wrong = Counter(answers[i] for i in idx if not hit[i]).most_common(1)
        out[y] = {"n": len(idx), "laya": float(hit[idx].mean()), "cosine": float(base[idx].mean()),
                  "most_wrong": list(wrong[0]) if wrong else None}
    return out


def ticket_rows(agent, cosine: Cosine, tickets: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """Per-ticket outcomes (edit checks: per edited copy), so that ticket files can be summed up alone or pooled
    without answering a ticket twice."""
    _, questions = scenario("billing")
    ans = _answers(agent, [(t["text"], questions) for t in tickets])
    dept = [a["department"] for a in ans]
    churn = np.array([a["churn_risk"]["noul"] for a in ans])
    crit = questions["department"]["criteria"]
    rendered = [f"{k}: {v}" for k, v in crit.items()]   # what the option reads as in laya's row
    keys = list(crit)
    texts = [t["text"] for t in tickets]
    opaque_names = dict(zip(keys, OPAQUE_DEPARTMENT_NAMES))
    opaque = {**questions["department"], "criteria": {opaque_names[k]: v for k, v in crit.items()}}
    by_description = _answers(agent, [(x, {"department": opaque}) for x in texts])
    opaque_rendered = _rendered(opaque["criteria"])
    edited = _answers(agent, [(x, questions) for x in noise.same_meaning_copies(texts)])
    clean = [a for a in ans for _ in range(noise.EDIT_COPIES)]
    rows = {"department_hit": np.array([d["choice"] == t["department"] for d, t in zip(dept, tickets)], dtype=float),
            "department_conf": np.array([max(d["probabilities"].values()) for d in dept]),
            "department_cosine_hit": np.array([keys[cosine.choose(t["text"], rendered)] == t["department"]
                                               for t in tickets], dtype=float),
            "department_opaque_hit": np.array([a["department"]["choice"] == opaque_names[t["department"]]
                                               for a, t in zip(by_description, tickets)], dtype=float),
            "department_opaque_cosine_hit": np.array([keys[cosine.choose(t["text"], opaque_rendered)] == t["department"]
                                                      for t in tickets], dtype=float),
            "churn": churn,
            "churn_hit": np.array([(p > 0.5) == t["churn"] for p, t in zip(churn, tickets)], dtype=float),
            "urgency_error": np.array([abs(a["urgency"]["score"] - t["urgency"]) for a, t in zip(ans, tickets)]),
            "gold_p_department": np.array([d["probabilities"][t["department"]] for d, t in zip(dept, tickets)]),
            "gold_p_urgency": np.array([a["urgency"]["probabilities"][str(t["urgency"])]
                                        for a, t in zip(ans, tickets)]),
            "gold_p_churn": np.array([p if t["churn"] else 1 - p for p, t in zip(churn, tickets)])}
    for q in questions:
        rows[f"unchanged_{q}"] = np.array([top_option(a[q]) == top_option(e[q]) for a, e in zip(clean, edited)],
                                          dtype=float)
    return rows


def summarize_tickets(rows: dict[str, np.ndarray]) -> dict[str, Any]:
    """`ticket_rows` (one file's, or several concatenated) -> the report's ticket figures."""
    dhit, dconf, churn, chit = rows["department_hit"], rows["department_conf"], rows["churn"], rows["churn_hit"]
    return {"n": len(dhit),
            "nll": {k: _log_loss(rows[f"gold_p_{k}"]) for k in ("department", "urgency", "churn")},
            "self_agreement_under_edits": {k.removeprefix("unchanged_"): float(v.mean())
                                           for k, v in rows.items() if k.startswith("unchanged_")},
            "department": float(dhit.mean()), "department_cosine": float(rows["department_cosine_hit"].mean()),
            "department_opaque": float(rows["department_opaque_hit"].mean()),
            "department_opaque_cosine": float(rows["department_opaque_cosine_hit"].mean()),
            "department_ece10": ece(dconf, dhit, ECE_BINS),
            "department_ece10_by_chance": ece_by_chance(dconf, dhit, ECE_BINS),
            "churn": float(chit.mean()),
            "churn_ece10": ece(np.maximum(churn, 1 - churn), chit, ECE_BINS),
            "urgency_mae": float(rows["urgency_error"].mean()),
            "_department_conf": dconf.tolist(), "_department_hit": dhit.tolist()}


def eval_acceptance(agent) -> list[dict[str, Any]]:
    _, questions = scenario("billing")
    out = []
    for case, a in zip(ACCEPTANCE, _answers(agent, [(c.text, questions) for c in ACCEPTANCE])):
        out.append({"text": case.text, "department": a["department"]["choice"], "churn_risk": a["churn_risk"]["noul"],
                    "urgency": a["urgency"]["score"], "failures": case.failures(a)})
    return out


def goals(report: dict[str, Any]) -> dict[str, bool]:
    """Issue 15's targets, each as measured in this report."""
    i, t = report["intents"], report["tickets"]
    g = {f"{k}: laya >= cosine + {GOAL_MARGIN:.2f}": i[k]["laya"] >= i[k]["cosine"] + GOAL_MARGIN - 1e-9
         for k in ("clinc", "clinc_hard", "snips")}
    g |= ticket_goals(t, "tickets")
    g |= {f"acceptance {j + 1}": not a["failures"] for j, a in enumerate(report["acceptance"])}
    return g


def ticket_goals(t: dict[str, Any], name: str) -> dict[str, bool]:
    """The issue's four ticket targets on one ticket set (`summarize_tickets`' result)."""
    return {f"{name} department >= 0.90": t["department"] >= 0.90, f"{name} churn >= 0.90": t["churn"] >= 0.90,
            f"{name} urgency MAE <= 0.5": t["urgency_mae"] <= 0.5,
            f"{name} department ECE <= 0.05": t["department_ece10"] <= 0.05}


def evaluate(model: str | None = None, data: Path = DEFAULT_DATA, tickets: Path | None = None, n: int = 300,
             threads: int | None = None, blind: Path | None = None) -> dict[str, Any]:
    """The full report (JSON-able). `n` items per intent set (300 in the published figures).

    `blind` (`datasets/handwritten_tickets_blind.jsonl`) is a second ticket file, committed before any head
    answered it. The evaluation file chose heads, so its figures lean towards the head that ships; the blind
    file's do not, as long as no choice reads them: so it is read only when asked for, and runs are judged on
    the dev file (`--tickets datasets/handwritten_tickets_dev.jsonl`). Both files are also pooled, since a 10-bin
    ECE over 74 tickets is mostly sample noise and the pool nearly triples n. The issue's goals stay on the
    evaluation file, so every round's count compares; the blind file's are reported beside them."""
    import torch

    import laya

    if check_threads(threads):   # 99999 segfaulted torch at the first op
        torch.set_num_threads(threads)
    t0 = time.time()
    sets = heldout_choice_sets(Path(data), n)
    ticket_items = read_tickets(Path(tickets) if tickets else default_tickets())
    blind_items = read_tickets(Path(blind), "--blind-tickets") if blind else []
    agent = laya.load(model)
    cosine = Cosine()
    rows = ticket_rows(agent, cosine, ticket_items)
    report = {"model": agent.source, "data": str(data), "n_per_set": n,
              "intents": eval_intents(agent, cosine, sets), "tickets": summarize_tickets(rows),
              "acceptance": eval_acceptance(agent)}
    report["goals"] = goals(report)
    if blind_items:
        blind_rows = ticket_rows(agent, cosine, blind_items)
        report["tickets_blind"] = summarize_tickets(blind_rows)
        report["tickets_pooled"] = summarize_tickets({k: np.concatenate([rows[k], blind_rows[k]]) for k in rows})
        report["goals_blind"] = ticket_goals(report["tickets_blind"], "blind tickets")
        report["goals_pooled"] = ticket_goals(report["tickets_pooled"], "pooled tickets")
    report["seconds"] = time.time() - t0
    report["threads"] = torch.get_num_threads()
    return report


def _ticket_lines(t: dict[str, Any], title: str) -> list[str]:
    return [f"{title} (n={t['n']}): department {t['department']:.3f} (cosine {t['department_cosine']:.3f}), churn "
            f"{t['churn']:.3f}, urgency MAE {t['urgency_mae']:.3f}, department ECE10 {t['department_ece10']:.3f} "
            "(after calibration)",
            f"  department with the options named {', '.join(OPAQUE_DEPARTMENT_NAMES[:3])} (the meaning in the "
            f"descriptions only): {t['department_opaque']:.3f} (cosine {t['department_opaque_cosine']:.3f})",
            _ece_context(t["department_ece10_by_chance"], t["n"]),
            "  log loss of the gold answer: " + ", ".join(f"{k} {v:.3f}" for k, v in t["nll"].items()),
            f"  answer unchanged under meaning-keeping edits ({noise.EDIT_COPIES} per ticket): "
            + ", ".join(f"{k} {v:.3f}" for k, v in t["self_agreement_under_edits"].items())]


def _ece_context(spread: dict[str, Any], n: int) -> str:
    lo, hi = spread["bootstrap_ci95"]
    return (f"  department ECE10 in context: a perfectly calibrated model with these {n} confidences measures "
            f"{spread['calibrated_mean']:.3f} on average (95th percentile {spread['calibrated_p95']:.3f}; no more "
            f"than this ECE in {spread['calibrated_share']:.0%} of {spread['draws']} draws); bootstrap 95% interval "
            f"{lo:.3f}-{hi:.3f}")


def summary(report: dict[str, Any]) -> str:
    """The printed table: laya-mini vs the cosine baseline, tickets, acceptance, goals."""
    lines = ["| held-out labels, 5-way | n | laya-mini | cosine baseline | laya - cosine | laya ECE10 | laya log loss |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for k, v in report["intents"].items():
        lines.append(f"| {k} | {v['n']} | {v['laya']:.3f} | {v['cosine']:.3f} | {v['laya'] - v['cosine']:+.3f} | "
                     f"{v['laya_ece10']:.3f} | {v['laya_nll']:.3f} |")
    lines += ["", "where laya-mini trails the baseline most (humanised-label sets; true intent: laya vs cosine, "
              "its most frequent wrong answer):"]
    for k, v in report["intents"].items():
        if k.endswith(("_raw", "_opaque")):
            continue
        worst = sorted(v["by_intent"].items(), key=lambda kv: kv[1]["laya"] - kv[1]["cosine"])[:WORST_INTENTS]
        parts = []
        for y, r in worst:
            wrong = f" ('{r['most_wrong'][0]}' x{r['most_wrong'][1]})" if r["most_wrong"] else ""
            parts.append(f"{y} (n {r['n']}) {r['laya']:.2f} vs {r['cosine']:.2f}{wrong}")
        lines.append(f"  {k}: " + "; ".join(parts))
    lines += [""] + _ticket_lines(report["tickets"], "hand-written tickets")
    if "tickets_blind" in report:
        lines += _ticket_lines(report["tickets_blind"], "blind hand-written tickets")
        lines += _ticket_lines(report["tickets_pooled"], "both ticket files pooled")
    lines += ["", "acceptance sentences:"]
    for a in report["acceptance"]:
        verdict = "ok  " if not a["failures"] else "FAIL"
        lines.append(f"  {verdict} department={a['department']} churn_risk={a['churn_risk']:.3f} "
                     f"urgency={a['urgency']:.2f}  {a['text'][:70]!r}" + (f"  ({'; '.join(a['failures'])})"
                                                                          if a["failures"] else ""))
    met = report["goals"]
    lines += ["", f"issue-15 goals met: {sum(met.values())}/{len(met)}"]
    lines += [f"  {'met    ' if ok else 'missed '} {name}" for name, ok in met.items()]
    for key in ("goals_blind", "goals_pooled"):
        if key in report:
            lines.append(f"the same ticket goals on the {key.split('_')[1]} set (not counted above): "
                         + ", ".join(f"{name.split(' ', 2)[2]} {'met' if ok else 'missed'}"
                                     for name, ok in report[key].items()))
    lines.append(f"({report['seconds']:.0f} s, {report['threads']} thread(s), model {report['model']})")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    """Bars: laya-mini vs cosine per held-out intent set and on ticket departments; the department
    reliability diagram next to them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from laya.calibration import reliability_bins

    intents = [k for k in report["intents"] if not k.endswith("_raw")]
    ticket_sets = [("tickets dept", "tickets")] + ([("blind dept", "tickets_blind")] if "tickets_blind" in report else [])
    names = intents + [name for name, _ in ticket_sets]
    laya_v = [report["intents"][k]["laya"] for k in intents] + [report[key]["department"] for _, key in ticket_sets]
    cos_v = [report["intents"][k]["cosine"] for k in intents] + [report[key]["department_cosine"]
                                                                 for _, key in ticket_sets]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [3, 2]})
    x = np.arange(len(names))
    ax.bar(x - 0.2, laya_v, 0.4, label="laya-mini")
    ax.bar(x + 0.2, cos_v, 0.4, label="MiniLM cosine (no training)")
    for xi, (a, b) in enumerate(zip(laya_v, cos_v)):
        ax.text(xi - 0.2, a + 0.01, f"{a:.2f}", ha="center", fontsize=8)
        ax.text(xi + 0.2, b + 0.01, f"{b:.2f}", ha="center", fontsize=8)
    ax.set_xticks(x, names)
    ax.set_ylim(0, 1.08)
    ax.set_ylabel("accuracy (5-way; tickets 3-way)")
    ax.set_title("held-out labels and hand-written tickets")
    ax.legend(loc="lower left", fontsize=8)
    ax2.plot([0, 1], [0, 1], ":", color="grey")
    for key, label in (("tickets", "evaluation file"), ("tickets_pooled", "both files pooled")):
        if key in report:
            t = report[key]
            bx, by, _ = reliability_bins(np.array(t["_department_conf"]), np.array(t["_department_hit"]), ECE_BINS)
            ax2.plot(bx, by, "o-", label=f"{label}, n={t['n']} (ECE10 {t['department_ece10']:.3f})")
    ax2.set_xlim(0, 1)
    ax2.set_ylim(0, 1)
    ax2.set_xlabel("confidence (top probability)")
    ax2.set_ylabel("accuracy")
    ax2.set_title("ticket department, after calibration")
    ax2.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write(report: dict[str, Any], out: Path) -> tuple[Path, Path]:
    """`out/eval.json` and `out/eval.png`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    js, png = out / "eval.json", out / "eval.png"
    js.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    plot(report, png)
    return js, png
