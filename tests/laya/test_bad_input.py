"""Bad input fails loudly, naming the question and the field (or the missing file) — never a silent answer."""

import json
import shutil
from pathlib import Path

import pytest

import laya
from laya.calibration import Temperatures, bucket_key, clamp_temperature

ROOT = Path(__file__).resolve().parents[2]
STATE = "Hi, we were billed twice for March."
OK = {"type": "choice", "instructions": "Which department?", "criteria": ["billing", "other"]}

BAD_QUESTIONS = [
    ({"q": {"type": "vote", "instructions": "x", "criteria": ["a", "b"]}}, r"question 'q': field 'type'"),
    ({"q": {"instructions": "x", "criteria": ["a", "b"]}}, r"question 'q': field 'type'"),
    ({"q": {"type": "choice", "criteria": ["a", "b"]}}, r"question 'q': field 'instructions'"),
    ({"q": {"type": "choice", "instructions": "  ", "criteria": ["a", "b"]}}, r"question 'q': field 'instructions'"),
    ({"q": {"type": "choice", "instructions": "x", "criteria": []}}, r"question 'q': field 'criteria'.*empty"),
    ({"q": {"type": "choice", "instructions": "x", "criteria": {}}}, r"question 'q': field 'criteria'.*empty"),
    ({"q": {"type": "choice", "instructions": "x"}}, r"question 'q': field 'criteria'"),
    ({"q": {"type": "choice", "instructions": "x", "criteria": ["a", "b", "a"]}},
     r"question 'q': field 'criteria'.*duplicates"),
    ({"q": {"type": "choice", "instructions": "x", "criteria": [1, True]}}, r"question 'q': field 'criteria'.*duplicates"),
    ({"q": {"type": "choice", "instructions": "x", "criteria": ["a", None]}}, r"question 'q': field 'criteria'"),
    ({"q": {"type": "choice", "instructions": "x", "criteria": ["a", ["b"]]}}, r"question 'q': field 'criteria'"),
    ({"q": {"type": "score", "instructions": "x", "criteria": ["only"]}}, r"question 'q': field 'criteria'.*2 levels"),
    ({"q": {"type": "score", "instructions": "x", "criteria": []}}, r"question 'q': field 'criteria'"),
    ({"q": {"type": "score", "instructions": "x", "criteria": ["low", "low"]}},
     r"question 'q': field 'criteria'.*duplicates"),
    ({"q": {"type": "score", "instructions": "x", "criteria": {"a": 1}}}, r"question 'q': field 'criteria'"),
    ({"q": {"type": "choice", "instructions": "x", "criteria": [f"o{i}" for i in range(256)]}},
     r"question 'q': field 'criteria'.*at most 255"),
    ({"q": {"type": "noul", "instructions": "x", "criteria": {"yes": "a"}}}, r"question 'q': field 'criteria'"),
    ({"q": {"type": "noul", "instructions": "x", "labels": {"false": "A", "true": "A"}}}, r"question 'q': field 'labels'"),
    ({"q": {"type": "noul", "instructions": "x", "labels": {"true": "A"}}}, r"question 'q': field 'labels'"),
    ({"q": {"type": "choice", "instructions": "x", "criteria": ["a", "b"], "labels": {}}}, r"question 'q': field 'labels'"),
    ({"q": {"type": "choice", "instructions": "x", "criteria": ["a", "b"], "option_order": [0, 0]}},
     r"question 'q': field 'option_order'"),
    ({"q": {"type": "noul", "instructions": "x", "option_order": [0, 1, 2]}}, r"question 'q': field 'option_order'"),
    ({"q": {"type": "choice", "instructions": "x", "criteria": ["a", "b"], "critera": 1}}, r"question 'q': field 'critera'"),
    ({"q": "choice"}, r"question 'q': definition must be a dict"),
    ({"": OK}, r"question name"),
    (["not", "a", "dict"], r"questions: expected a dict"),
]


@pytest.fixture(scope="module")
def agent(laya_tiny_modernbert):
    return laya.load(laya_tiny_modernbert)


@pytest.mark.parametrize("questions,match", BAD_QUESTIONS, ids=[m for _, m in BAD_QUESTIONS])
def test_bad_question(agent, questions, match):
    with pytest.raises(ValueError, match=match):
        agent.predict(STATE, questions)
    with pytest.raises(ValueError, match=match):   # the serving path validates the same way
        agent.prepare(STATE, questions)


@pytest.mark.parametrize("state", [None, 3, 2.5, b"bytes", ("a", "b")])
def test_state_of_wrong_type(agent, state):
    with pytest.raises(ValueError, match="state: must be"):
        agent.predict(state, {"q": OK})


def test_marker_pushed_out_of_budget_names_question_and_field(agent):
    many = {"many": {"type": "choice", "instructions": "x", "criteria": [f"opt {i}" for i in range(30)]}}
    with pytest.raises(ValueError, match=r"question 'many': field 'max_len'.*of its 30 option markers"):
        agent.predict(STATE, many, max_len=40)


@pytest.mark.parametrize("kwargs,match", [
    ({"max_len": 0}, "max_len"), ({"max_len": "512"}, "max_len"), ({"head_max_len": -1}, "head_max_len"),
    ({"min_confidence": 1.5}, "min_confidence"), ({"min_confidence": True}, "min_confidence"),
    ({"min_confidence": {"choice:7": 0.5}}, "min_confidence"),
    ({"option_order": {"nope": [1, 0]}}, "option_order"),
    ({"option_order": {"q": [1, 1]}}, r"question 'q': field 'option_order'"),
])
def test_bad_call_arguments(agent, kwargs, match):
    with pytest.raises(ValueError, match=match):
        agent.predict(STATE, {"q": OK}, **kwargs)


def test_option_order_argument_equals_in_question_order(agent):
    a = agent.predict(STATE, {"q": OK}, option_order={"q": [1, 0]})
    b = agent.predict(STATE, {"q": dict(OK, option_order=[1, 0])})
    assert a == b


def test_predict_batch_arguments(agent):
    with pytest.raises(ValueError, match="states"):
        agent.predict_batch(STATE, {"q": OK})
    with pytest.raises(ValueError, match="batch_size"):
        agent.predict_batch([STATE], {"q": OK}, batch_size=0)
    assert agent.predict_batch([], {"q": OK}) == []


@pytest.mark.parametrize("missing", ["rl_agent_config.json", "model.safetensors", "encoder/config.json",
                                     "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"])
def test_missing_checkpoint_file_is_named(laya_tiny_modernbert, tmp_path, missing):
    ck = tmp_path / "ck"
    shutil.copytree(laya_tiny_modernbert, ck)
    (ck / missing).unlink()
    with pytest.raises(FileNotFoundError, match=missing.split("/")[-1]):
        laya.load(ck)


def test_weights_that_do_not_fit_are_named(laya_tiny_modernbert, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(laya_tiny_modernbert, ck)
    cfg = json.loads((ck / "rl_agent_config.json").read_text())
    cfg["act_costs"] = {"ask": 0.1}                      # act_head.2 now has the wrong shape
    (ck / "rl_agent_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"act_head\.2\.weight"):
        laya.load(ck)


def test_temperature_clamp_and_buckets():
    assert [clamp_temperature(v) for v in (0.1, 7, "x", None, True, float("nan"), 1.7)] == [
        0.5, 5.0, 1.0, 1.0, 1.0, 1.0, 1.7]
    assert [bucket_key("choice", k) for k in (1, 2, 3, 5, 6, 10, 11, 255)] == [
        "choice:2", "choice:2", "choice:3-5", "choice:3-5", "choice:6-10", "choice:6-10", "choice:11+", "choice:11+"]
    with pytest.warns(RuntimeWarning, match="temperature\\[1\\]='x' -> 1"):
        t = Temperatures.from_config([1.0, "x", 2.0], {"score:11+": 0.01})
    assert t.lookup(1, 12) == 0.5 and t.lookup(1, 3) == 1.0 and t.lookup(2, 2) == 2.0
