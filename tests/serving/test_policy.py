"""The policy rule parser: what rules mean, and that a bad rule stops startup naming the rule."""

from __future__ import annotations

import pytest

from serving.decide.policy import Policy, PolicyError

ANSWERS = {
    "churn_risk": {"type": "noul", "noul": 0.81, "confidence": 0.81},
    "department": {"type": "choice", "choice": "billing", "probabilities": {"billing": 0.6, "other": 0.4}},
    "urgency": {"type": "score", "score": 1.2},
}


def test_issue_examples_and_operators():
    policy = Policy({
        "escalate": "churn_risk.noul > 0.7",
        "queue": "department.choice",
        "priority": "urgency.score >= 1.5",
        "combo": "not (urgency.score < 1) and (department.choice == 'billing' or churn_risk.noul <= -0.5)",
        "label": "department.probabilities.billing != 0.6",
        "literal": "true",
    })
    assert policy.evaluate(ANSWERS) == {"escalate": True, "queue": "billing", "priority": False, "combo": True,
                                        "label": False, "literal": True}


def test_missing_values_are_null_not_false():
    policy = Policy({"a": "missing.noul > 0.5", "b": "missing.noul > 0.5 or churn_risk.noul > 0.5",
                     "c": "missing.noul > 0.5 and churn_risk.noul > 0.9", "d": "not missing.choice",
                     "e": "department.choice > 1"})
    assert policy.evaluate(ANSWERS) == {"a": None, "b": True, "c": False, "d": None, "e": None}


@pytest.mark.parametrize("rule,needle", [
    ("churn_risk.noul >", "end of rule"),
    ("churn_risk > 0.5", "not a question.field path"),
    ("churn_risk.nope > 0.5", "unknown answer field 'nope'"),
    ("department.probabilities > 0.5", "takes one key"),
    ("__import__('os').system('true')", "cannot read"),
    ("churn_risk.noul > 0.5 0.6", "unexpected '0.6'"),
    ("(churn_risk.noul > 0.5", "missing ')'"),
    ("", "non-empty"),
])
def test_bad_rules_name_the_rule(rule, needle):
    with pytest.raises(PolicyError) as err:
        Policy({"ok": "urgency.score > 1", "broken": rule})
    assert "'broken'" in str(err.value) and needle in str(err.value)


def test_load_yaml_and_json(tmp_path):
    (tmp_path / "p.yaml").write_text("escalate: churn_risk.noul > 0.7\n")
    (tmp_path / "p.json").write_text('{"rules": {"queue": "department.choice"}}')
    assert Policy.load(tmp_path / "p.yaml").evaluate(ANSWERS) == {"escalate": True}
    assert Policy.load(tmp_path / "p.json").evaluate(ANSWERS) == {"queue": "billing"}
    (tmp_path / "bad.yaml").write_text("- a list\n")
    with pytest.raises(ValueError, match="mapping"):
        Policy.load(tmp_path / "bad.yaml")
