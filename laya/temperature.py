"""Inference-time calibration: which temperature divides a question's logits.

A checkpoint ships one temperature per question type plus optional per-option-count buckets
(`"choice:3-5"`...). Fitted values below 0.5 sharpen rather than calibrate (a released bucket is
0.1), so every value is clamped to [0.5, 5.0]; anything that is not a finite number applies 1.0.
Both replacements are announced once, at load, with a `RuntimeWarning`.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

TEMP_MIN = 0.5
TEMP_MAX = 5.0
QTYPE_NAMES = ("choice", "score", "noul")


def clamp_temperature(value: Any) -> float:
    if isinstance(value, bool):
        return 1.0
    try:
        t = float(value)
    except (TypeError, ValueError):
        return 1.0
    if not math.isfinite(t):
        return 1.0
    return min(TEMP_MAX, max(TEMP_MIN, t))


def _rejected(raw: Any, applied: float) -> bool:
    if isinstance(raw, bool):
        return True
    try:
        return float(raw) != applied
    except (TypeError, ValueError):
        return True


def bucket(qtype: int, k: int) -> str:
    size = "2" if k <= 2 else "3-5" if k <= 5 else "6-10" if k <= 10 else "11+"
    return f"{QTYPE_NAMES[qtype]}:{size}"


@dataclass
class Temperatures:
    by_type: list[float]
    by_options: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_config(cls, temperature: list[Any], by_options: dict[str, Any]) -> Temperatures:
        out = cls([clamp_temperature(t) for t in temperature],
                  {k: clamp_temperature(v) for k, v in by_options.items()})
        entries = [(f"temperature[{i}]", raw, out.by_type[i]) for i, raw in enumerate(temperature)]
        entries += [(k, raw, out.by_options[k]) for k, raw in by_options.items()]
        bad = [f"{name}={raw!r} -> {applied:g}" for name, raw, applied in entries if _rejected(raw, applied)]
        if bad:
            warnings.warn(f"laya: checkpoint temperatures outside [{TEMP_MIN:g}, {TEMP_MAX:g}] or not numbers; "
                          "applying " + ", ".join(bad), RuntimeWarning, stacklevel=3)
        return out

    def lookup(self, qtype: int, k: int) -> float:
        """T for a question of `qtype` with `k` surviving option markers."""
        return self.by_options.get(bucket(qtype, k), self.by_type[qtype])
