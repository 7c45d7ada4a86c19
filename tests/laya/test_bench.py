"""`laya.bench`'s agreement report: the figures issue 14's fast-path goal is read from."""

import math

import pytest

from laya.bench import DECISIVE_MARGIN, compare_answers, wilson_interval
from laya.training import mini
from serving.cli import main


def choice(**p):
    return {"probabilities": p}


def test_compare_answers_counts_flips_margins_and_decisive_answers():
    reference = [{"a": choice(x=0.501, y=0.499), "b": {"noul": 0.9}},
                 {"a": choice(x=0.2, y=0.7, z=0.1), "b": {"noul": 0.52}}]
    other = [{"a": choice(x=0.49, y=0.51), "b": {"noul": 0.8}},
             {"a": choice(x=0.25, y=0.65, z=0.1), "b": {"noul": 0.47}}]
    s = compare_answers(reference, other)
    assert (s["answers"], s["disagreements"], s["agreement"]) == (4, 2, 0.5)
    assert s["flip_margins"] == pytest.approx([0.002, 0.04])   # a: 0.501 - 0.499; b: noul 0.52 -> 0.52 - 0.48
    assert s["decisive_answers"] == 2 and s["decisive_agreement"] == 1.0   # margins 0.8 and 0.5 >= 0.05
    assert s["max_abs_dp"] == pytest.approx(0.1) and s["mean_abs_dp"] == pytest.approx((0.011 + 0.1 + 0.05 + 0.05) / 4)
    assert DECISIVE_MARGIN == 0.05


def test_wilson_interval():
    low, high = wilson_interval(287, 290)
    assert low == pytest.approx(0.9700, abs=2e-4) and high == pytest.approx(0.9965, abs=2e-4)
    assert wilson_interval(290, 290)[1] == 1.0 and wilson_interval(290, 290)[0] < 1.0   # never zero width
    assert wilson_interval(0, 10)[0] == 0.0
    assert all(math.isnan(v) for v in wilson_interval(0, 0))


def test_bench_decide_agreement_prints_the_report(laya_tiny_bert, capsys):
    mini.ensure()
    assert main(["bench", "decide", "--model", laya_tiny_bert, "--iters", "1", "--precision", "exact",
                 "--no-gemm", "--reference", "/nonexistent", "--agreement"]) == 0
    out = capsys.readouterr().out
    assert "held-out set agreement.json: 90 states, 290 answers" in out, out
    assert "95% interval" in out and "decisive answers (margin >= 0.05)" in out, out
    assert "pagoda exact: the scenario's rows alone, together and in a crowd of other states: bit-identical" in out


def test_batch_mate_gap_sees_a_row_that_depends_on_its_mates(laya_tiny_bert, monkeypatch):
    """The bench's determinism line is not a constant: an engine whose answers move with what shares the
    forward reads as not bit-identical."""
    import laya
    from laya.bench import batch_mate_gap
    from laya.scenarios import load as scenario

    agent = laya.load(laya_tiny_bert)
    state, questions = scenario("billing")
    assert batch_mate_gap(agent, state, questions) == 0.0
    forward = agent.forward

    def crowd_sensitive(rows):
        out = forward(rows)
        for o in out:
            o.logits[:] += 1e-3 * len(rows)
        return out

    monkeypatch.setattr(agent, "forward", crowd_sensitive)
    assert batch_mate_gap(agent, state, questions) > 0
