"""Per-question temperatures fitted so the student's probabilities match the teacher's.

The objective is the same KL the student was trained on, evaluated on the validation split;
one scalar per question is a convex-enough 1-D problem that a bracketed golden-section search on
log T is exact to the printed digits and needs neither torch nor scipy.
"""

from __future__ import annotations

import math

import numpy as np

from distill.answers import softmax
from distill.metrics import mean_kl

T_MIN, T_MAX = 0.05, 20.0


def fit_temperature(logits: np.ndarray, teacher: np.ndarray, iters: int = 60) -> float:
    lo, hi = math.log(T_MIN), math.log(T_MAX)
    g = (math.sqrt(5) - 1) / 2

    def loss(log_t: float) -> float:
        return mean_kl(teacher, softmax(logits, math.exp(log_t)))

    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = loss(a), loss(b)
    for _ in range(iters):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = loss(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = loss(b)
    return round(math.exp((lo + hi) / 2), 4)


def fit_temperatures(heads: list[dict], logits: np.ndarray, teacher: dict[str, np.ndarray]) -> dict[str, float]:
    """`heads` as in student.json (offset/size per question); returns {question: T}."""
    return {h["name"]: fit_temperature(logits[:, h["offset"]:h["offset"] + h["size"]], teacher[h["name"]])
            for h in heads}
