"""The policy rule parser: what rules mean, and that a bad rule stops startup naming the rule."""

from __future__ import annotations

import pytest
import yaml

from serving.decide.policy import Policy, PolicyError
from serving.gateway.rules import Rules

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


def test_labels_that_are_numbers_or_booleans_are_read_as_the_json_answer_spells_them():
    """`criteria: [1, 2]` answers `"probabilities": {"1": ...}`; a rule on `d.probabilities.1` read null."""
    policy = Policy({"one": "d.probabilities.1 > 0.1", "yes": "b.probabilities.true >= 0.5", "is_one": "d.choice == 1"})
    answers = {"d": {"type": "choice", "choice": 1, "probabilities": {1: 0.4, 2: 0.6}},
               "b": {"type": "choice", "choice": True, "probabilities": {True: 0.7, False: 0.3}}}
    assert policy.evaluate(answers) == {"one": True, "yes": True, "is_one": True}


def test_missing_values_are_null_not_false():
    policy = Policy({"a": "missing.noul > 0.5", "b": "missing.noul > 0.5 or churn_risk.noul > 0.5",
                     "c": "missing.noul > 0.5 and churn_risk.noul > 0.9", "d": "not missing.choice",
                     "e": "department.choice > 1"})
    assert policy.evaluate(ANSWERS) == {"a": None, "b": True, "c": False, "d": None, "e": None}


def test_low_confidence_is_false_when_the_gate_passed_and_null_without_a_gate():
    """laya (as the official runtime) writes `low_confidence` only when it is true; a rule like
    `auto_close: not q.low_confidence` must still fire on an answer that passed the gate."""
    import laya.answers

    answers = {"churn": {"type": "noul", "noul": 0.99, "answer_confidence": 0.99},
               "dept": {"type": "choice", "choice": "a", "answer_confidence": 0.2, "probabilities": {"a": 0.6, "b": 0.4}}}
    policy = Policy({"lc": "churn.low_confidence", "auto": "not churn.low_confidence",
                     "held": "dept.low_confidence", "missing": "other.low_confidence"})
    assert policy.evaluate(answers) == {"lc": None, "auto": None, "held": None, "missing": None}  # no gate, no verdict
    laya.answers.gate(answers, 0.5)
    assert "low_confidence" not in answers["churn"] and answers["dept"]["low_confidence"] is True
    assert policy.evaluate(answers) == {"lc": False, "auto": True, "held": True, "missing": None}


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


@pytest.mark.parametrize("name,text,needle", [
    ("twice.yaml", "a: churn_risk.noul > 0.5\na: churn_risk.noul > 0.9\n", "'a' is given twice (line 2"),
    ("twice.json", '{"a": "churn_risk.noul > 0.5", "a": "urgency.score > 1"}', "'a' is given twice"),
    ("broken.yaml", "a: [x\n", "expected ',' or ']'"),
    ("number.yaml", "2024: churn_risk.noul > 0.5\n", "name 2024 must be a string"),
])
def test_a_file_of_names_is_refused_in_one_line_naming_what_is_wrong(tmp_path, name, text, needle):
    """A name given twice would silently drop a rule or preset, and a number as a name could never be asked
    for; PyYAML's own messages span lines."""
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError) as err:
        Policy.load(tmp_path / name)
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_a_rule_of_1500_terms_evaluates_and_means_the_same_as_its_short_form():
    """A long `and`/`or` chain is one node over its terms: evaluating it recurses once, not 1500 times (that
    passed startup, then raised RecursionError on every request)."""
    terms = 1500
    policy = Policy({"all": " and ".join(["churn_risk.noul > 0.5"] * terms),
                     "any": " or ".join(["urgency.score > 5"] * (terms - 1) + ["churn_risk.noul > 0.5"]),
                     "unknown": " and ".join(["churn_risk.noul > 0.5"] * (terms - 1) + ["missing.noul > 0.5"]),
                     "decided": " and ".join(["missing.noul > 0.5"] * (terms - 1) + ["urgency.score > 5"])})
    assert policy.evaluate(ANSWERS) == {"all": True, "any": True, "unknown": None, "decided": False}
    assert len(policy.rules[0].paths()) == terms


@pytest.mark.parametrize("rule", [
    "(" * 1000 + "churn_risk.noul > 0.5" + ")" * 1000,
    "not " * 1000 + "churn_risk.noul",
    "(" * 33 + "churn_risk.noul" + ")" * 33,
])
def test_a_rule_nested_past_the_limit_names_the_rule(rule):
    with pytest.raises(PolicyError) as err:
        Policy({"ok": "urgency.score > 1", "deep": rule})
    message = str(err.value)
    assert message.startswith("rule 'deep': nests deeper than 32 levels") and len(message) < 250, message


def test_nesting_up_to_the_limit_is_fine():
    policy = Policy({"deep": "(" * 32 + "churn_risk.noul > 0.5" + ")" * 32, "nots": "not " * 32 + "true"})
    assert policy.evaluate(ANSWERS) == {"deep": True, "nots": True}


def test_gateway_route_rules_share_both_bounds(tmp_path):
    """The gateway's rules are the policy language: the same long rule loads and decides, the same deep one is
    refused at start naming the file and the rule."""
    questions = {"needs_reasoning": {"type": "noul", "instructions": "Does this need several steps of reasoning?"}}
    path = tmp_path / "routes.yaml"
    path.write_text(yaml.safe_dump({"questions": questions,
                                    "routes": {"frontier": " and ".join(["needs_reasoning.noul > 0.7"] * 1500)}}))
    rules = Rules.load(str(path), ["edge", "frontier"])
    assert rules.policy.rules[0].node.evaluate({"needs_reasoning": {"noul": 0.9}}) is True
    path.write_text(yaml.safe_dump({"questions": questions,
                                    "routes": {"frontier": "(" * 500 + "needs_reasoning.noul > 0.7" + ")" * 500}}))
    with pytest.raises(ValueError) as err:
        Rules.load(str(path), ["edge", "frontier"])
    assert str(err.value).startswith(f"route file {path}: rule 'frontier': nests deeper than 32 levels"), err.value
