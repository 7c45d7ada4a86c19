"""How close a student is to its teacher (and to gold labels, where the data has them).

ECE against the teacher uses the teacher's distribution as the soft truth: in each confidence bin,
the student's mean top probability against the teacher's mean probability of that same option.
The hard-label form (is the argmax the teacher's argmax?) would punish a student for copying a
teacher that is honestly unsure, which is exactly what distillation should do.
"""

from __future__ import annotations

import numpy as np


def _bins(conf: np.ndarray, bins: int) -> list[np.ndarray]:
    edges = np.linspace(0.0, 1.0, bins + 1)
    return [(conf >= lo if i == 0 else conf > lo) & (conf <= hi)
            for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:]))]


def ece(conf: np.ndarray, outcome: np.ndarray, bins: int = 15) -> float:
    """Expected calibration error: bin-weighted |mean confidence - mean outcome| (outcome may be soft)."""
    if len(conf) == 0:
        return float("nan")
    total = 0.0
    for sel in _bins(conf, bins):
        if sel.any():
            total += sel.mean() * abs(conf[sel].mean() - outcome[sel].mean())
    return float(total)


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


def ece_vs_teacher(student: np.ndarray, teacher: np.ndarray, bins: int = 15) -> float:
    pick = student.argmax(-1)
    return ece(student.max(-1), teacher[np.arange(len(pick)), pick], bins)


def ece_vs_gold(probs: np.ndarray, gold: np.ndarray, bins: int = 15) -> tuple[float, float]:
    """(ECE, accuracy) over rows whose gold label is one of the options."""
    keep = gold >= 0
    p, g = probs[keep], gold[keep]
    correct = (p.argmax(-1) == g).astype(np.float64)
    return ece(p.max(-1), correct, bins), float(correct.mean()) if len(g) else float("nan")


def reliability(conf: np.ndarray, outcome: np.ndarray, bins: int = 10) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per bin: mean confidence, mean outcome, count (for the report's reliability diagrams)."""
    out = [(conf[s].mean(), outcome[s].mean(), s.sum()) if s.any() else (np.nan, np.nan, 0) for s in _bins(conf, bins)]
    return tuple(np.array(x) for x in zip(*out))  # type: ignore[return-value]
