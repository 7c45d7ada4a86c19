"""The laya-serve wire contract of `/v1/systemone` and `/v1/systemone/batch`, for existing clients.

Those servers answer the plain answer JSON with one addition on every choice and score answer:
`x_jev_confidence`, the confidence TypeSafe Jev's own formulas give for the same probabilities (Laya's
`confidence` is normalised entropy, a different number), so a client porting a Jev threshold keeps its
meaning. The batch route answers `{"results": [...], "total_usage": {input_tokens, output_tokens}}`.
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


def systemone_result(result: dict) -> dict:
    answers: dict[str, Any] = {}
    for name, answer in result.get("answers", {}).items():
        conf = jev_confidence(answer) if isinstance(answer, dict) else None
        answers[name] = answer if conf is None else {**answer, "x_jev_confidence": round(conf, 4)}
    return {**result, "answers": answers}


def systemone_batch(results: list[dict]) -> dict:
    return {
        "results": [systemone_result(r) for r in results],
        "total_usage": {"input_tokens": sum(r["usage"].get("input_tokens", 0) for r in results),
                        "output_tokens": sum(r["usage"].get("output_tokens", 0) for r in results)},
    }
