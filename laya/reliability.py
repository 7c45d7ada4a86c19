"""Calibration measures over prediction records: ECE (equal-width bins), Brier, NLL, accuracy.

A record is one answered question: its untempered option logits (valid slots only), its target
distribution over those slots and its type. Confidence for ECE is the top probability, as in the
reliability diagrams people read; Brier is the multi-class squared error over the full vector.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QTYPE_NAMES = ("choice", "score", "noul")


@dataclass
class Record:
    logits: np.ndarray   # [k] float64, untempered
    target: np.ndarray   # [k] probabilities summing to 1 (one-hot for hard labels)
    qtype: int
    source: str = ""

    @property
    def k(self) -> int:
        return len(self.logits)


def option_bucket(k: int) -> str:
    """The official `temperature_by_options` bucket of a question with k surviving options."""
    if k <= 2:
        return "2"
    if k <= 5:
        return "3-5"
    if k <= 10:
        return "6-10"
    return "11+"


def softmax(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    z = np.asarray(logits, dtype=np.float64) / temperature
    z = z - z.max()
    e = np.exp(z)
    return e / e.sum()


def probabilities(records: list[Record], temperatures: list[float] | None = None) -> list[np.ndarray]:
    """Each record's distribution; `temperatures[i]` scales record i (default 1)."""
    ts = temperatures or [1.0] * len(records)
    return [softmax(r.logits, t) for r, t in zip(records, ts)]


def metrics(records: list[Record], probs: list[np.ndarray]) -> dict[str, float]:
    """accuracy, nll, brier, ece15, ece10 and n over the records (gold = argmax of the target)."""
    if not records:
        return {"n": 0}
    gold = np.array([int(np.argmax(r.target)) for r in records])
    conf = np.array([float(p.max()) for p in probs])
    hit = np.array([int(np.argmax(p)) for p in probs]) == gold
    nll = np.mean([-float(np.sum(r.target * np.log(np.clip(p, 1e-12, 1.0)))) for r, p in zip(records, probs)])
    brier = np.mean([float(np.sum((p - r.target) ** 2)) for r, p in zip(records, probs)])
    return {"n": len(records), "accuracy": float(hit.mean()), "nll": float(nll), "brier": float(brier),
            "ece15": ece(conf, hit, 15), "ece10": ece(conf, hit, 10)}


def ece(confidence: np.ndarray, correct: np.ndarray, bins: int) -> float:
    """Expected calibration error with `bins` equal-width confidence bins over [0, 1]."""
    confidence = np.asarray(confidence, dtype=np.float64)
    correct = np.asarray(correct, dtype=np.float64)
    if confidence.size == 0:
        return 0.0
    idx = np.minimum((confidence * bins).astype(int), bins - 1)
    total = 0.0
    for b in range(bins):
        sel = idx == b
        if sel.any():
            total += sel.sum() * abs(correct[sel].mean() - confidence[sel].mean())
    return float(total / confidence.size)


def reliability_curve(confidence: np.ndarray, correct: np.ndarray, bins: int = 10):
    """Per non-empty bin: (mean confidence, accuracy, count)."""
    confidence = np.asarray(confidence, dtype=np.float64)
    correct = np.asarray(correct, dtype=np.float64)
    idx = np.minimum((confidence * bins).astype(int), bins - 1)
    rows = [(confidence[idx == b].mean(), correct[idx == b].mean(), int((idx == b).sum()))
            for b in range(bins) if (idx == b).any()]
    return [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]


def plot_reliability(panels: dict[str, tuple[list[Record], list[np.ndarray], list[np.ndarray]]],
                     path: str, bins: int = 10) -> None:
    """One panel per name with the before/after curves (records, probs before, probs after) to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4), squeeze=False)
    for ax, (name, (records, before, after)) in zip(axes[0], panels.items()):
        gold = np.array([int(np.argmax(r.target)) for r in records])
        ax.plot([0, 1], [0, 1], ":", color="grey", label="perfect")
        for label, probs, style in (("before", before, "o--"), ("after", after, "s-")):
            conf = np.array([p.max() for p in probs])
            hit = np.array([int(np.argmax(p)) for p in probs]) == gold
            x, y, _ = reliability_curve(conf, hit, bins)
            ax.plot(x, y, style, label=f"{label} (ECE {ece(conf, hit, bins):.3f})")
        ax.set_title(f"{name} (n={len(records)})")
        ax.set_xlabel("confidence (top probability)")
        ax.set_ylabel("accuracy")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
