"""The `/v1/systemone` dialect: laya-serve's wire contract of `/v1/systemone(/batch)`, for existing clients.

Those servers answer the plain answer JSON with one addition on every choice and score answer:
`x_jev_confidence`, the confidence TypeSafe Jev's own formulas give for the same probabilities (Laya's
`confidence` is normalised entropy, a different number), so a client porting a Jev threshold keeps its
meaning. The batch route answers `{"results": [...], "total_usage": {input_tokens, output_tokens}}`,
and error bodies carry FastAPI's `detail` beside the server's `error` object, which those clients read.
"""

from __future__ import annotations

import math
from typing import Any


def jev_confidence(answer: dict) -> float | None:
    """Jev's confidence: choice `(max p - 1/n) / (1 - 1/n)`; score one minus the spread around the mode
    relative to a uniform distribution's spread around the centre; None where it has no value."""
    kind, probs = answer.get("type"), answer.get("probabilities")
    if kind not in ("choice", "score") or not isinstance(probs, dict) or not probs:
        return None
    values = [probs[k] for k in (sorted(probs, key=int) if kind == "score" else probs)]
    if any(isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0 for v in values):
        return None
    n = len(values)
    if n == 1:
        return 1.0
    total = sum(values)
    p = [v / total for v in values] if total else [1.0 / n] * n
    if kind == "choice":
        return (max(p) - 1.0 / n) / (1.0 - 1.0 / n)
    mode = max(range(n), key=p.__getitem__)
    spread = sum(v * abs(i - mode) for i, v in enumerate(p))
    centre = (n - 1) / 2
    uniform = sum(abs(i - centre) for i in range(n)) / n
    return max(0.0, 1.0 - spread / uniform)


def result(decision: dict) -> dict:
    answers: dict[str, Any] = {}
    for name, answer in decision.get("answers", {}).items():
        conf = jev_confidence(answer) if isinstance(answer, dict) else None
        answers[name] = answer if conf is None else {**answer, "x_jev_confidence": round(conf, 4)}
    return {**decision, "answers": answers}


def batch(decisions: list[dict]) -> dict:
    return {
        "results": [result(d) for d in decisions],
        "total_usage": {"input_tokens": sum(d["usage"].get("input_tokens", 0) for d in decisions),
                        "output_tokens": sum(d["usage"].get("output_tokens", 0) for d in decisions)},
    }


def error_body(body: dict) -> dict:
    return {**body, "detail": body["error"]["message"]}
