"""Strictly proper scoring rules over masked option logits, for training Laya heads.

Every rule here is strictly proper: its expectation is optimised only by reporting the true
distribution, which is what makes temperature calibration afterwards a small correction rather
than a repair. The log score carries the gradient; the spherical score is bounded (no single
confident mistake dominates a batch) and the ranked probability score rewards putting mass near
the right level on ordered `score` questions, which the log score ignores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # `pagoda --help` registers `pagoda train` with TrainConfig defaults; torch loads only when a loss runs
    import torch

SCORE_QTYPE = 1


@dataclass
class LossWeights:
    log: float = 1.0
    spherical: float = 0.0
    rps: float = 0.0

    def __post_init__(self):
        for name in ("log", "spherical", "rps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 <= value < math.inf:  # NaN passed `< 0`
                raise ValueError(f"loss weight {name!r} must be a finite number >= 0, got {value!r}")
        if self.log == 0 and self.spherical == 0 and self.rps == 0:
            raise ValueError("loss weights: at least one of log, spherical, rps must be positive")


def log_score(logits: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row cross-entropy -sum t log p over the valid slots ([B])."""
    import torch

    logp = torch.log_softmax(logits.masked_fill(~mask, -1e4), -1)
    return -(target * logp).masked_fill(~mask, 0.0).sum(-1)


def spherical_score(logits: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row 1 - <t, p> / ||p||: zero for a certain right answer, at most 1."""
    import torch

    p = torch.softmax(logits.masked_fill(~mask, -1e4), -1) * mask
    return 1.0 - (target * p).sum(-1) / p.norm(dim=-1).clamp_min(1e-12)


def ranked_probability_score(logits: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row mean squared gap between predicted and target CDFs over the k ordered levels."""
    import torch

    p = torch.softmax(logits.masked_fill(~mask, -1e4), -1) * mask
    gap = (torch.cumsum(p, -1) - torch.cumsum(target * mask, -1)) ** 2
    k = mask.sum(-1)
    # The last CDF term is always 1 - 1 = 0; divide by k - 1 so 2- and 5-level scores weigh alike.
    return (gap * mask).sum(-1) / (k - 1).clamp_min(1)


def proper_loss(logits: torch.Tensor, target: torch.Tensor, mask: torch.Tensor, qtype: torch.Tensor,
                weights: LossWeights) -> torch.Tensor:
    """Mean over rows of the weighted sum; RPS applies only to `score` rows."""
    loss = weights.log * log_score(logits, target, mask)
    if weights.spherical:
        loss = loss + weights.spherical * spherical_score(logits, target, mask)
    if weights.rps:
        loss = loss + weights.rps * ranked_probability_score(logits, target, mask) * (qtype == SCORE_QTYPE)
    return loss.mean()
