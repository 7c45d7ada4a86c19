"""The training losses are strictly proper and respect the option mask."""

import pytest
import torch

from laya.training.losses import (
    LossWeights,
    log_score,
    proper_loss,
    ranked_probability_score,
    spherical_score,
)

RULES = [log_score, spherical_score, ranked_probability_score]


def _expected(rule, p, truth):
    """E_{y ~ truth}[rule(p, y)] with p given as logits."""
    k = truth.numel()
    logits = torch.log(p).expand(k, k)
    onehot = torch.eye(k)
    mask = torch.ones(k, k, dtype=torch.bool)
    return float((truth * rule(logits, onehot, mask)).sum())


@pytest.mark.parametrize("rule", RULES)
def test_strictly_proper(rule):
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        k = int(torch.randint(2, 7, (1,), generator=g))
        truth = torch.softmax(torch.randn(k, generator=g) * 2, -1)
        best = _expected(rule, truth, truth)
        for _ in range(10):
            other = torch.softmax(torch.randn(k, generator=g) * 2, -1)
            assert _expected(rule, other, truth) > best - 1e-7


@pytest.mark.parametrize("rule", RULES)
def test_unused_slots_change_nothing(rule):
    logits = torch.tensor([[0.3, -1.2, 2.0]])
    target = torch.tensor([[0.0, 0.0, 1.0]])
    padded = torch.cat([logits, torch.tensor([[5.0, -1e4]])], -1)
    padded_target = torch.cat([target, torch.zeros(1, 2)], -1)
    mask = torch.tensor([[True, True, True, False, False]])
    assert torch.allclose(rule(logits, target, torch.ones(1, 3, dtype=torch.bool)), rule(padded, padded_target, mask))


def test_log_score_is_cross_entropy_and_rps_knows_order():
    logits = torch.tensor([[1.0, 2.0, 0.5]])
    target = torch.tensor([[0.0, 1.0, 0.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    assert torch.allclose(log_score(logits, target, mask), torch.nn.functional.cross_entropy(logits, torch.tensor([1])))
    near = torch.log(torch.tensor([[0.1, 0.2, 0.7]]))   # mass next to the right level
    far = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))    # same top-p, two levels away
    gold = torch.tensor([[0.0, 0.0, 1.0]])
    assert ranked_probability_score(near, gold, mask) < ranked_probability_score(far, gold, mask)
    assert float(ranked_probability_score(torch.tensor([[-30.0, -30.0, 30.0]]), gold, mask)) < 1e-9


def test_proper_loss_applies_rps_to_score_rows_only_and_has_gradients():
    logits = torch.randn(4, 3, requires_grad=True)
    target = torch.eye(3)[[0, 1, 2, 0]]
    mask = torch.ones(4, 3, dtype=torch.bool)
    qtype = torch.tensor([0, 1, 2, 0])
    base = proper_loss(logits, target, mask, qtype, LossWeights(1.0, 0.0, 0.0))
    with_rps = proper_loss(logits, target, mask, qtype, LossWeights(1.0, 0.0, 1.0))
    expected = base + ranked_probability_score(logits, target, mask)[1] / 4
    assert torch.allclose(with_rps, expected)
    with_rps.backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_bad_weights():
    with pytest.raises(ValueError, match="spherical"):
        LossWeights(1.0, -1.0, 0.0)
    with pytest.raises(ValueError, match="at least one"):
        LossWeights(0.0, 0.0, 0.0)
