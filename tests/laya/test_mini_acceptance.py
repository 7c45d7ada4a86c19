"""Issue 15's acceptance sentences on the built default (laya-mini assembled from the committed head), asked
with the README's support-triage questions. The cases and thresholds live in `laya.training.mini_eval.ACCEPTANCE`
(the eval command prints the same checks). A case the shipped default does not meet yet is a strict xfail
that states the measured answer: it turns into a failure the day the default starts to pass it, so the mark
must then be removed; the thresholds are never loosened to make a case pass."""

import pytest

import laya
from laya.scenarios import load as scenario
from laya.training import mini
from laya.training.mini_eval import ACCEPTANCE

# Measured on the shipped default (the issue-15 fine-tuned head), `pagoda laya-mini eval`, docs/laya-mini.md:
# every case is met since round 4 (round 7, the soup of Dec 6: sentence 1 billing, churn_risk 0.995, urgency 1.001).
NOT_MET: dict[int, str] = {}

@pytest.fixture(scope="module")
def agent():
    return laya.load(str(mini.ensure()))


CASES = [pytest.param(i, id=f"sentence{i + 1}",
                      marks=[pytest.mark.xfail(strict=True, reason=NOT_MET[i])] if i in NOT_MET else [])
         for i in range(len(ACCEPTANCE))]


@pytest.mark.parametrize("i", CASES)
def test_acceptance_sentence(agent, i):
    case = ACCEPTANCE[i]
    answers = agent.predict(case.text, scenario("billing")[1])["answers"]
    assert case.failures(answers) == [], case.text
