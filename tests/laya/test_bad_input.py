"""Bad input fails loudly, naming the question and the field (or the missing file) — never a silent answer."""

import json
import shutil
from pathlib import Path

import pytest

import laya
from laya.calibration import Temperatures, bucket_key, clamp_temperature
from laya.errors import InputError
from laya.lru import ByteLRU

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
    # keys are read in any case: both were taken and one description silently kept
    ({"q": {"type": "noul", "instructions": "x", "criteria": {"True": "a", "true": "b"}}},
     r"question 'q': field 'criteria'.*keys 'True' and 'true' are both 'true'"),
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


@pytest.mark.parametrize("qdef,kwargs,path", [
    (dict(OK, state=1), {}, "questions.q.state"),        # a question's unknown field, whatever its name
    (dict(OK, max_len=1), {}, "questions.q.max_len"),
    (dict(OK, lang="de"), {}, "questions.q.lang"),
    (dict(OK, option_order=[1, 1]), {}, "questions.q.option_order"),
    (OK, {"option_order": {"q": [1, 1]}}, "option_order.q"),  # the argument that holds it
    ({"type": "choice", "instructions": "x", "criteria": [f"opt {i}" for i in range(30)]}, {"max_len": 40},
     "max_len"),                                          # markers that do not fit: raising max_len cures it
])
def test_errors_point_at_where_the_mistake_is(agent, qdef, kwargs, path):
    with pytest.raises(InputError) as err:
        agent.predict(STATE, {"q": qdef}, **kwargs)
    assert err.value.path == path


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
    """As the official runtime reads them: any sequence of states, `batch_size` None (its default), 0 or a negative
    for one pass (None and -1 were refused), `lang` (which changes nothing without language temperatures, and none
    can be loaded); a bad state is named by index."""
    with pytest.raises(ValueError, match="states"):
        agent.predict_batch(STATE, {"q": OK})
    for bad in ("2", 1.5, True):
        with pytest.raises(InputError, match="batch_size"):
            agent.predict_batch([STATE], {"q": OK}, batch_size=bad)
    assert agent.predict_batch([], {"q": OK}) == []
    one = agent.predict_batch([STATE, "other"], {"q": OK})
    assert agent.predict_batch((STATE, "other"), {"q": OK}, batch_size=0, lang="de-AT") == one
    assert agent.predict_batch([STATE, "other"], {"q": OK}, batch_size=None) == one
    assert agent.predict_batch([STATE, "other"], {"q": OK}, batch_size=-1) == one
    assert agent.predict(STATE, {"q": OK}, lang="de") == one[0]
    with pytest.raises(InputError, match=r"states\[2\]: must be a string") as err:
        agent.predict_batch([STATE, "other", 5], {"q": OK})
    assert err.value.path == "states[2]"
    with pytest.raises(InputError, match="lang") as err:
        agent.predict(STATE, {"q": OK}, lang=5)
    assert err.value.path == "lang"


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


# ---- inputs a model cannot hold, texts a tokenizer cannot read, keys JSON cannot tell apart -------------------

@pytest.fixture(scope="module")
def bert_agent(laya_tiny_bert):
    """A BERT encoder: absolute positions, 1024 of them, so a budget past them is a real failure to refuse."""
    return laya.load(laya_tiny_bert, question_cache_bytes=1 << 20)


@pytest.mark.parametrize("field", ["max_len", "head_max_len"])
def test_budget_past_the_encoder_positions_is_refused_before_compute(bert_agent, field):
    assert bert_agent.max_positions == 1024
    with pytest.raises(InputError, match=f"{field}: 1025 is more than this model's 1024 positions") as err:
        bert_agent.prepare("word " * 3000, {"q": OK}, **{field: 1025})
    assert err.value.path == field
    assert bert_agent.predict("word " * 3000, {"q": OK}, max_len=1024)["usage"]["input_tokens"] == 1024


def test_checkpoint_whose_budget_passes_its_positions_is_refused_at_load(laya_tiny_bert, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(laya_tiny_bert, ck)
    cfg = json.loads((ck / "rl_agent_config.json").read_text())
    (ck / "rl_agent_config.json").write_text(json.dumps({**cfg, "max_len": 1025}))
    with pytest.raises(ValueError, match=r"max_len 1025 is more than the encoder's 1024 positions"):
        laya.load(ck)


@pytest.mark.parametrize("questions,path", [
    ({"q": {**OK, "instructions": "Which \ud800 department?"}}, "questions.q.instructions"),
    ({"q": {**OK, "criteria": ["billing", "oth\udfffer"]}}, "questions.q.criteria"),
    ({"q": {**OK, "criteria": {"billing": "invoices \ud83d"}}}, "questions.q.criteria"),
])
def test_unpaired_surrogates_in_a_question_name_the_field(agent, questions, path):
    with pytest.raises(InputError, match="unpaired UTF-16 surrogate") as err:
        agent.predict(STATE, questions)
    assert err.value.path == path


def test_unreadable_states_name_the_state(agent):
    with pytest.raises(InputError, match="unpaired UTF-16 surrogate") as err:
        agent.predict("billed \ud800 twice", {"q": OK})
    assert err.value.path == "state"
    with pytest.raises(InputError, match="unpaired UTF-16 surrogate"):
        agent.predict([{"role": "user", "content": "x\udc00"}], {"q": OK})
    deep: list = []
    for _ in range(10_000):
        deep = [deep]
    with pytest.raises(InputError, match="nests too deeply") as err:
        agent.predict(deep, {"q": OK})
    assert err.value.path == "state"
    circular: dict = {}
    circular["self"] = circular
    with pytest.raises(InputError, match="cannot be written as JSON"):
        agent.predict(circular, {"q": OK})
    with pytest.raises(InputError, match="cannot be written as JSON: Object of type set") as err:
        agent.predict({"message": "refund please", "tags": {"billing"}}, {"q": OK})
    assert err.value.path == "state"
    # a surrogate pair in JSON (an emoji written as two escapes) decodes to one character: text, and answers
    emoji = json.loads('"billed twice \\ud83d\\ude00"')
    assert emoji.endswith("\U0001f600") and agent.predict(emoji, {"q": OK})["answers"]["q"]["type"] == "choice"


@pytest.mark.parametrize("labels,match", [
    ([1, "1"], r"label 1 \('1'\) and label 0 \(1\) are the same key '1'"),
    ([True, "true"], r"same key 'true'"),
    (["x", 1.5, "1.5"], r"label 2 \('1.5'\) and label 1 \(1.5\)"),
    ([float("nan"), 1], r"label 0 \(nan\) is not a finite number"),
    ([1, float("inf")], r"label 1 \(inf\) is not a finite number"),
])
def test_choice_labels_must_be_distinct_json_keys(agent, labels, match):
    with pytest.raises(InputError, match=match) as err:
        agent.predict(STATE, {"q": {**OK, "criteria": labels}})
    assert err.value.path == "questions.q.criteria"


def test_numeric_labels_answer_strict_json(agent):
    """Labels of several types that stay distinct as JSON keys answer, and the answer is strict JSON."""
    answer = agent.predict(STATE, {"q": {**OK, "criteria": [1, 2.5, "x", False]}})["answers"]["q"]

    def no_duplicates(pairs):
        keys = [k for k, _ in pairs]
        assert len(keys) == len(set(keys)), keys
        return dict(pairs)

    def no_constants(name):
        raise AssertionError(f"{name} in an answer")

    text = json.dumps(answer)
    back = json.loads(text, object_pairs_hook=no_duplicates, parse_constant=no_constants)
    assert list(back["probabilities"]) == ["1", "2.5", "x", "false"]


def test_question_token_cache_is_bounded_by_bytes(bert_agent):
    """Distinct large questions (~200 KB of instructions each) keep at most the cache's byte budget, and a
    row never needs more instruction tokens than the positions, so no more are kept."""
    cache = bert_agent.question_cache
    big = "word " * 40_000
    answers = []
    for i in range(6):
        q = {"q": {"type": "noul", "instructions": f"question {i}: {big}"}}
        answers.append(bert_agent.predict(STATE, q)["answers"]["q"])
        stats = cache.stats()
        assert stats["bytes"] <= stats["max_bytes"] == 1 << 20, stats
    assert cache.stats()["entries"] <= 5
    # the cached (truncated) head builds the same row as a fresh tokenisation: answers are unchanged
    q = {"q": {"type": "noul", "instructions": f"question 5: {big}"}}
    hits = cache.stats()["hits"]
    assert bert_agent.predict(STATE, q)["answers"]["q"] == answers[5] and cache.stats()["hits"] == hits + 1
    fresh = laya.load(bert_agent.source, question_cache_bytes=0)
    assert fresh.predict(STATE, q)["answers"]["q"] == answers[5] and fresh.question_cache.stats()["entries"] == 0


def test_byte_lru_keeps_the_most_recent_within_its_budget():
    lru = ByteLRU(10, lambda key, value: len(value))
    for key in "abc":
        lru.get(key, lambda k=key: k * 4)            # 4 bytes each: "a" is dropped when "c" arrives
    assert lru.stats()["entries"] == 2 and lru.stats()["bytes"] == 8
    assert lru.get("b", lambda: "never computed") == "bbbb"
    lru.get("d", lambda: "dddd")                     # "c" was the least recent: dropped, "b" kept
    assert list(lru._entries) == ["b", "d"]
    assert lru.get("c", lambda: "fresh") == "fresh" and list(lru._entries) == ["d", "c"]
    assert lru.get("big", lambda: "z" * 11) == "z" * 11 and "big" not in lru._entries  # over budget: not kept
    with pytest.raises(ValueError):
        ByteLRU(-1, len)
