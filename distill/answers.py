"""Probability vectors <-> the official answer JSON, with nothing but numpy.

The student is trained on vectors and answers with vectors; callers (and `pagoda serve`) speak the
answer JSON that `laya` returns. Both directions live here, in one torch-free module, because the
edge runtime needs the second and the labeller needs the first, and they must agree on option order:
choice labels in criteria order, score levels 0..k-1, noul `[false, true]`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def softmax(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """Row-wise softmax of `logits / temperature` in float64, so rounding never depends on batch shape."""
    z = np.asarray(logits, dtype=np.float64) / float(temperature)
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def probs_from_answer(qid: str, spec: dict[str, Any], answer: dict[str, Any]) -> np.ndarray:
    """Read one question's distribution back out of an answer, in the student's option order.

    The teacher rounds to 4 decimals, so the vector is renormalised: KL targets must sum to one.
    """
    if qid not in answer:
        raise ValueError(f"teacher answer has no question {qid!r}")
    a = answer[qid]
    if spec["type"] == "noul":
        p_true = float(a["noul"])
        p = np.array([1.0 - p_true, p_true])
    else:
        probs = a["probabilities"]
        keys = spec["keys"]
        try:
            p = np.array([float(probs[k] if k in probs else probs[str(k)]) for k in keys])
        except KeyError as exc:
            raise ValueError(f"teacher answer for question {qid!r} lacks option {exc}") from None
    p = np.clip(p, 0.0, None)
    total = p.sum()
    if not total > 0:
        raise ValueError(f"teacher answer for question {qid!r} has no probability mass")
    return p / total


def entropy_confidence(p: np.ndarray) -> float:
    """1 - H(p)/log(k): the official runtime's `confidence` (concentration, not calibrated)."""
    k = len(p)
    if k < 2:
        return 1.0
    nz = p[p > 0]
    h = float(-(nz * np.log(nz)).sum())
    return min(1.0, max(0.0, 1.0 - h / math.log(k)))


def answer_from_probs(spec: dict[str, Any], p: np.ndarray) -> dict[str, Any]:
    """One question's answer in the official shape; `answer_confidence` is max(p), the calibrated one."""
    kind = spec["type"]
    conf = round(entropy_confidence(p), 4)
    top = round(float(p.max()), 4)
    if kind == "choice":
        keys = spec["keys"]
        return {
            "type": "choice",
            "choice": keys[int(p.argmax())],
            "probabilities": {str(k): round(float(v), 4) for k, v in zip(keys, p)},
            "confidence": conf,
            "answer_confidence": top,
        }
    if kind == "score":
        return {
            "type": "score",
            "score": round(float((np.arange(len(p)) * p).sum()), 4),
            "legend": {str(i): text for i, text in enumerate(spec["legend"])},
            "probabilities": {str(i): round(float(v), 4) for i, v in enumerate(p)},
            "confidence": conf,
            "answer_confidence": top,
        }
    p_true = round(float(p[1]), 4)
    return {
        "type": "noul",
        "noul": p_true,
        "confidence": round(max(p_true, 1.0 - p_true), 4),
        "answer_confidence": top,
    }
