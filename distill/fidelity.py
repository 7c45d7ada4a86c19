"""Fidelity: how closely a student copies its teacher, the measures only distillation has.

ECE itself and its bins are `laya.calibration`'s, so a student's report and a checkpoint's model card
bin and weight calibration identically. What is added here compares two distributions row by row.
ECE against the teacher uses the teacher's distribution as the soft truth: the outcome of a row is
the teacher's probability of the option the student picked. The hard-label form (is the argmax the
teacher's argmax?) would punish a student for copying a teacher that is honestly unsure, which is
exactly what distillation should do.
"""

from __future__ import annotations

import numpy as np

from laya.calibration import ece


def agreement(student: np.ndarray, teacher: np.ndarray) -> float:
    return float((student.argmax(-1) == teacher.argmax(-1)).mean())


def decisive_agreement(student: np.ndarray, teacher: np.ndarray, margin: float = 0.05) -> tuple[float, float]:
    """(agreement, share of rows) over rows where the teacher's top two options differ by >= `margin`.

    Where the teacher is torn between options its argmax is a coin toss a faithful student cannot
    (and should not) reproduce; this is the agreement that measures copying a decision.
    """
    top2 = np.sort(teacher, axis=-1)[:, -2:]
    keep = (top2[:, 1] - top2[:, 0]) >= margin
    if not keep.any():
        return float("nan"), 0.0
    return agreement(student[keep], teacher[keep]), float(keep.mean())


def mean_kl(teacher: np.ndarray, student: np.ndarray, eps: float = 1e-7) -> float:
    """KL(teacher || student) in nats, averaged over rows."""
    t = np.clip(teacher, eps, 1.0)
    s = np.clip(student, eps, 1.0)
    return float((t * (np.log(t) - np.log(s))).sum(-1).mean())


def teacher_outcome(student: np.ndarray, teacher: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(student's top probability, teacher's probability of that same option) per row."""
    pick = student.argmax(-1)
    return student.max(-1), teacher[np.arange(len(pick)), pick]


def ece_vs_teacher(student: np.ndarray, teacher: np.ndarray, bins: int = 15) -> float:
    return ece(*teacher_outcome(student, teacher), bins)


def disagreements_vs_gold(student: np.ndarray, teacher: np.ndarray, gold: np.ndarray) -> dict[str, float | int]:
    """Where student and teacher pick differently, who matches the gold label; and the agreement over the
    rows the teacher gets right.

    On text outside the corpus (hand-written tickets) the teacher is itself wrong on some rows, and a
    student that learnt the task from the corpus may be right exactly there: argmax agreement alone then
    counts the student's correct answers against it. Rows without gold (`gold < 0`) are left out.
    """
    keep = gold >= 0
    s, t, g = student.argmax(-1)[keep], teacher.argmax(-1)[keep], gold[keep]
    differ = s != t
    right = t == g
    return {"differ": int(differ.sum()), "student_right": int((differ & (s == g)).sum()),
            "teacher_right": int((differ & right).sum()), "neither": int((differ & (s != g) & ~right).sum()),
            "teacher_right_rows": int(right.sum()),
            "agreement_teacher_right": float((s[right] == t[right]).mean()) if right.any() else float("nan")}


DEFER_THRESHOLDS = (0.5, 0.6, 0.7, 0.8, 0.9)


def deferral_curve(student: np.ndarray, teacher: np.ndarray,
                   thresholds: tuple[float, ...] = DEFER_THRESHOLDS) -> list[dict[str, float]]:
    """Per threshold: the agreement with the teacher once every answer whose top probability is under it goes
    to the teacher (`distill.deferral`), and the share of answers that does. The top probability is rounded to 4
    decimals, as `answer_confidence` is where the runtime compares it."""
    agree = student.argmax(-1) == teacher.argmax(-1)
    top = np.round(student.max(-1), 4)
    return [{"threshold": t, "agreement": float((agree | (top < t)).mean()), "deferred": float((top < t).mean())}
            for t in thresholds]
