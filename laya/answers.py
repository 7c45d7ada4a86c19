"""Per-question probabilities <-> the official answer JSON, for Laya checkpoints and students alike.

The numerics follow the official runtime step for step (float32 logits divided by T in numpy,
max-shifted exp, normalise, round to 4 decimals), so answers agree to the last printed digit
rather than "approximately". A distilled student answers through the same `answer`, so both emit
one shape (a student has no act head: its `action.act_probability` is null), and its labeller reads
a teacher's answer back with `probabilities_from_answer`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from laya.calibration import BUCKET_KEYS, bucket_key, softmax
from laya.errors import InputError
from laya.questions import Question
from laya.rows import Row

MODEL_NAME = "laya-rl-agent"
GATE_KEYS = BUCKET_KEYS | {"default"}


def probabilities(logits: np.ndarray, temperature: float, option_order: tuple[int, ...] | None) -> np.ndarray:
    """Calibrated option probabilities in option-index order (the row comes in slot order)."""
    p = softmax(logits, temperature)
    if option_order is not None:
        canonical = np.empty_like(p)
        canonical[np.asarray(option_order, dtype=int)] = p
        p = canonical
    return p


def _entropy_confidence(p: np.ndarray) -> float:
    k = len(p)
    if k < 2:
        return 1.0
    entropy = -float((p * np.log(np.clip(p, 1e-12, 1.0))).sum())
    return min(1.0, max(0.0, 1.0 - entropy / math.log(k)))


def answer(q: Question, p: np.ndarray, act_probability: float | None) -> dict[str, Any]:
    """One question's answer; `act_probability` None (a student) leaves `action.act_probability` null."""
    top = min(1.0, max(0.0, float(p.max())))
    act = None if act_probability is None else round(float(act_probability), 4)
    common = {"answer_confidence": round(top, 4), "action": {"act_probability": act}}
    if q.type == "choice":
        return {"type": "choice", "choice": q.keys[int(p.argmax())],
                "probabilities": {k: round(float(v), 4) for k, v in zip(q.keys, p)},
                "confidence": round(_entropy_confidence(p), 4), **common}
    if q.type == "score":
        return {"type": "score", "score": round(float((np.arange(len(p)) * p).sum()), 4),
                "legend": {str(i): text for i, text in enumerate(q.legend)},
                "probabilities": {str(i): round(float(v), 4) for i, v in enumerate(p)},
                "confidence": round(_entropy_confidence(p), 4), **common}
    p_true = float(p[1])
    return {"type": "noul", "noul": round(p_true, 4), "confidence": round(max(p_true, 1.0 - p_true), 4), **common}


def option_probabilities(answer: dict[str, Any]) -> dict[str, float]:
    """An answer's probabilities by option name, without its question: a noul answer as `true` / `false`.
    For comparing answers (agreement, a build's probe, the eval's edit check), where only the names matter."""
    if "probabilities" in answer:
        return answer["probabilities"]
    return {"true": answer["noul"], "false": 1 - answer["noul"]}


def top_option(answer: dict[str, Any]) -> str:
    probs = option_probabilities(answer)
    return max(probs, key=probs.get)


def probabilities_from_answer(q: Question, answer: dict[str, Any]) -> np.ndarray:
    """A question's distribution read back from its answer, in option-index order, renormalised.

    Answers are rounded to 4 decimals, so the vector is renormalised: soft targets must sum to one.
    """
    if q.type == "noul":
        p_true = float(answer["noul"])
        p = np.array([1.0 - p_true, p_true])
    else:
        probs = answer["probabilities"]
        try:
            p = np.array([float(probs[k] if k in probs else probs[str(k)]) for k in q.keys])
        except KeyError as exc:
            raise ValueError(f"answer for question {q.name!r} lacks option {exc}") from None
    p = np.clip(p, 0.0, None)
    total = p.sum()
    if not total > 0:
        raise ValueError(f"answer for question {q.name!r} has no probability mass")
    return p / total


def usage(rows: list[Row]) -> dict[str, Any]:
    if not rows:
        return {"input_tokens": 0, "output_tokens": 0}
    dropped = max(r.state_tokens_dropped for r in rows)
    out = {
        "input_tokens": sum(r.n_tokens for r in rows),
        "output_tokens": 0,
        "state_tokens": rows[0].state_tokens,
        "state_tokens_dropped": dropped,     # worst case over questions: each has its own head
        "truncated": dropped > 0,
        "truncated_questions": [r.question for r in rows if r.state_tokens_dropped > 0],
    }
    collapsed = {r.question: {"total": r.n_options, "distinct": r.options_distinct,
                              "tokens_per_option": r.tokens_per_option}
                 for r in rows if r.options_distinct < r.n_options}
    if collapsed:
        out["options"] = collapsed
    return out


def check_min_confidence(value: Any) -> float | dict[str, float] | None:
    """None, a threshold in [0, 1], or a per-bucket map like {"choice:3-5": 0.6, "default": 0.5}."""
    if value is None:
        return None
    if isinstance(value, dict):
        if not value:
            raise InputError("min_confidence: a per-bucket map must not be empty", field="min_confidence")
        for key in value:
            if key not in GATE_KEYS:
                raise InputError(f"min_confidence: unknown bucket {key!r}; use e.g. 'choice:3-5' or 'default'",
                                 field="min_confidence")
        return {k: _threshold(v) for k, v in value.items()}
    return _threshold(value)


def _threshold(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0.0 <= v <= 1.0:
        raise InputError(f"min_confidence: must be a number in [0, 1], got {v!r}", field="min_confidence")
    return float(v)


def gate(answers: dict[str, dict[str, Any]], min_confidence: float | dict[str, float]) -> None:
    """Mark each answer passed/abstained on `answer_confidence` (only called when a gate was asked for)."""
    for a in answers.values():
        if isinstance(min_confidence, dict):
            k = len(a.get("probabilities") or {}) or 2
            threshold = min_confidence.get(bucket_key(a["type"], k), min_confidence.get("default", 0.0))
        else:
            threshold = min_confidence
        if a["answer_confidence"] < threshold:
            a["low_confidence"] = True
            a["abstention"] = "abstained"
        else:
            a["abstention"] = "passed"
        a["abstention_threshold"] = float(threshold)
