"""The decision maths laya, distill and serving share: temperatures, option buckets, calibration measures.

One torch-free home, so a Laya checkpoint and a distilled student are tempered, fitted and measured by
the same code (their model card and report used to bin ECE differently and clamp T differently).

- Temperatures: a checkpoint ships one T per question type plus optional per-option-count buckets
  (`"choice:3-5"`...). Fitted values below 0.5 sharpen rather than calibrate (a released bucket is 0.1),
  so every applied value is clamped to [0.5, 5.0] and a non-number applies 1.0 (`clamp_temperature`).
- The fit: the T minimising mean cross-entropy against (possibly soft) targets, by golden-section search
  on log T. Cross-entropy against a teacher's distribution is KL plus a constant, so one fit serves
  hard labels (laya) and distillation (students). It is unimodal in T for fixed logits, and a
  bracketing search is deterministic and needs no tuning.
- Measures: ECE over equal-width bins `[lo, hi)` (the last bin closed at 1.0), NaN for no rows; the
  outcome may be soft (a teacher's probability of the chosen option) or 0/1 (was the argmax right).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from laya.questions import QUESTION_TYPES

TEMP_MIN = 0.5
TEMP_MAX = 5.0
FIT_RANGE = (0.05, 20.0)    # searched; the result is then clamped, and reports show both
BUCKET_SIZES = ("2", "3-5", "6-10", "11+")


# ---- option-count buckets and temperatures ------------------------------------------------------------

def option_bucket(k: int) -> str:
    """The `temperature_by_options` bucket of a question with k surviving options."""
    return "2" if k <= 2 else "3-5" if k <= 5 else "6-10" if k <= 10 else "11+"


def bucket_key(qtype: str, k: int) -> str:
    """`"choice:3-5"`: the key of temperatures and per-bucket confidence gates."""
    return f"{qtype}:{option_bucket(k)}"


BUCKET_KEYS = frozenset(f"{t}:{s}" for t in QUESTION_TYPES for s in BUCKET_SIZES)


def clamp_temperature(value: Any) -> float:
    """The T that inference applies for a stored value: clamped to [TEMP_MIN, TEMP_MAX], 1.0 if no number."""
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


@dataclass
class Temperatures:
    """Applied temperatures: per type (index = `QTYPES` value) and per `type:bucket`."""

    by_type: list[float]
    by_options: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_config(cls, temperature: Sequence[Any], by_options: dict[str, Any]) -> Temperatures:
        """Clamp stored values, announcing each replacement once with a `RuntimeWarning`."""
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
        """T for a question of type index `qtype` with `k` surviving options."""
        return self.by_options.get(bucket_key(QUESTION_TYPES[qtype], k), self.by_type[qtype])


# ---- probabilities -------------------------------------------------------------------------------------

def softmax(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """Softmax of `logits / temperature` over the last axis, in the logits' own dtype.

    float32 logits are tempered in float32 exactly as the official runtime does (so answers agree to
    the printed digit); fits and measures pass float64.
    """
    z = np.asarray(logits) / temperature
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _by_length(logits: Sequence[np.ndarray], targets: Sequence[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Rows grouped into float64 matrices of equal option count, so the fit is vectorised."""
    groups: dict[int, tuple[list, list]] = {}
    for z, t in zip(logits, targets):
        z = np.asarray(z, dtype=np.float64)
        if z.ndim == 2:  # already a matrix of rows
            groups.setdefault(z.shape[1], ([], []))[0].extend(z)
            groups[z.shape[1]][1].extend(np.asarray(t, dtype=np.float64))
            continue
        g = groups.setdefault(len(z), ([], []))
        g[0].append(z)
        g[1].append(np.asarray(t, dtype=np.float64))
    return [(np.stack(zs), np.stack(ts)) for zs, ts in groups.values()]


def mean_cross_entropy(groups: list[tuple[np.ndarray, np.ndarray]], temperature: float) -> float:
    total, n = 0.0, 0
    for z, t in groups:
        p = softmax(z, temperature)
        total += float(-(t * np.log(np.clip(p, 1e-12, 1.0))).sum())
        n += len(z)
    return total / max(1, n)


def fit_temperature(logits: Sequence[np.ndarray] | np.ndarray, targets: Sequence[np.ndarray] | np.ndarray,
                    iters: int = 60) -> float:
    """The raw (unclamped) T minimising mean cross-entropy of `softmax(logits / T)` against `targets`.

    Rows may have different option counts. 1.0 for no rows. Callers store `clamp_temperature(T)`.
    """
    if len(logits) == 0:
        return 1.0
    if isinstance(logits, np.ndarray) and logits.ndim == 2:
        logits, targets = [logits], [targets]
    groups = _by_length(logits, targets)
    lo, hi = math.log(FIT_RANGE[0]), math.log(FIT_RANGE[1])
    g = (math.sqrt(5) - 1) / 2
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = mean_cross_entropy(groups, math.exp(a)), mean_cross_entropy(groups, math.exp(b))
    for _ in range(iters):
        if fa <= fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = mean_cross_entropy(groups, math.exp(a))
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = mean_cross_entropy(groups, math.exp(b))
    return math.exp((lo + hi) / 2)


# ---- calibration measures ------------------------------------------------------------------------------

def reliability_bins(confidence: np.ndarray, outcome: np.ndarray, bins: int = 10
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per non-empty bin `[lo, hi)` (last bin closed): mean confidence, mean outcome, count."""
    confidence = np.asarray(confidence, dtype=np.float64)
    outcome = np.asarray(outcome, dtype=np.float64)
    idx = np.minimum((confidence * bins).astype(int), bins - 1)
    rows = [(confidence[idx == b].mean(), outcome[idx == b].mean(), int((idx == b).sum()))
            for b in range(bins) if (idx == b).any()]
    if not rows:
        return np.zeros(0), np.zeros(0), np.zeros(0, dtype=int)
    conf, out, count = zip(*rows)
    return np.array(conf), np.array(out), np.array(count)


def ece(confidence: np.ndarray, outcome: np.ndarray, bins: int = 15) -> float:
    """Expected calibration error: count-weighted |mean confidence - mean outcome| over the bins; NaN if empty."""
    conf, out, count = reliability_bins(confidence, outcome, bins)
    if count.sum() == 0:
        return float("nan")
    return float((count * np.abs(out - conf)).sum() / count.sum())


def ece_by_chance(confidence: np.ndarray, outcome: np.ndarray, bins: int = 15, draws: int = 2000,
              seed: int = 0) -> dict[str, Any]:
    """What the sample's size alone puts into an ECE measured on it, to read that ECE against.

    Over a few dozen items ECE is biased upward: each sparsely filled bin's mean outcome strays from its mean
    confidence by chance, and the absolute value counts every stray as error. So even a perfectly calibrated
    model (each outcome drawn with its stated confidence) measures a positive ECE, and on 74 tickets that
    figure is as large as the goal (0.05) one is held to. `calibrated_mean` and `calibrated_p95` are that
    model's ECE over `draws` simulated outcome sets at these very confidences; `calibrated_share` is how often
    it comes out no higher than the measured ECE. `bootstrap_ci95` resamples the items. Seeded: the same
    input gives the same figures.
    """
    conf = np.asarray(confidence, dtype=np.float64)
    out = np.asarray(outcome, dtype=np.float64)
    if conf.ndim != 1 or conf.shape != out.shape or conf.size == 0:
        raise ValueError(f"ece_by_chance: confidence and outcome must be equal-length 1-D arrays, got {conf.shape} "
                         f"and {out.shape}")
    measured = ece(conf, out, bins)
    rng = np.random.default_rng(seed)
    calibrated = np.array([ece(conf, (rng.random(conf.size) < conf).astype(np.float64), bins)
                           for _ in range(draws)])
    boot = np.array([ece(conf[i], out[i], bins) for i in (rng.integers(0, conf.size, conf.size)
                                                             for _ in range(draws))])
    return {"ece": measured, "calibrated_mean": float(calibrated.mean()),
            "calibrated_p95": float(np.percentile(calibrated, 95)),
            "calibrated_share": float((calibrated <= measured).mean()),
            "bootstrap_ci95": [float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))],
            "draws": draws, "seed": seed}


def metrics(probs: Sequence[np.ndarray], targets: Sequence[np.ndarray]) -> dict[str, float]:
    """accuracy, nll, brier, ece15, ece10 and n of distributions against targets (gold = argmax of target)."""
    if len(probs) == 0:
        return {"n": 0}
    gold = np.array([int(np.argmax(t)) for t in targets])
    conf = np.array([float(np.max(p)) for p in probs])
    hit = np.array([int(np.argmax(p)) for p in probs]) == gold
    nll = np.mean([-float(np.sum(t * np.log(np.clip(p, 1e-12, 1.0)))) for p, t in zip(probs, targets)])
    brier = np.mean([float(np.sum((np.asarray(p) - t) ** 2)) for p, t in zip(probs, targets)])
    return {"n": len(probs), "accuracy": float(hit.mean()), "nll": float(nll), "brier": float(brier),
            "ece15": ece(conf, hit, 15), "ece10": ece(conf, hit, 10)}


def plot_reliability(panels: dict[str, list[tuple[str, np.ndarray, np.ndarray]]], path: str, bins: int = 10,
                     xlabel: str = "confidence (top probability)", ylabel: str = "accuracy") -> None:
    """One panel per name, one curve per (label, confidence, outcome), with its ECE, to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4), squeeze=False)
    styles = ("o--", "s-", "^:", "d-.")
    for ax, (name, curves) in zip(axes[0], panels.items()):
        ax.plot([0, 1], [0, 1], ":", color="grey", label="perfect")
        n = 0
        for (label, conf, outcome), style in zip(curves, styles):
            x, y, _ = reliability_bins(conf, outcome, bins)
            ax.plot(x, y, style, label=f"{label} (ECE {ece(conf, outcome, bins):.3f})")
            n = len(conf)
        ax.set_title(f"{name} (n={n})")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
