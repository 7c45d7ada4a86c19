"""Typed errors end to end: laya's `InputError` becomes the 422 body by its attributes, never by its text,
and what a question means is checked by laya alone (serving's schema lets a malformed question through)."""

from __future__ import annotations

import json
import time

import pytest
import requests
from serving_support import BILLING_STATE

from laya.errors import InputError
from laya.questions import parse_question
from serving.decide.backend import LayaBackend
from serving.decide.config import DecideConfig
from serving.decide.metrics import DecideMetrics
from serving.decide.schema import DecideRequest, decide_request
from serving.decide.service import Service
from serving.errors import ApiError, PeerGone, parse_json


def laya_refusal(name: str, qdef: dict) -> InputError:
    with pytest.raises(InputError) as err:
        parse_question(name, qdef)
    return err.value


def post(server, path, body):
    return requests.post(server.url + path, json=body, timeout=60)


@pytest.mark.parametrize("qdef,field", [
    ({"type": "maybe", "instructions": "?"}, "questions.q.type"),
    ({"type": "choice", "instructions": "?", "criteria": []}, "questions.q.criteria"),
    ({"type": "noul", "instructions": "?", "criteria": {"perhaps": "x"}}, "questions.q.criteria"),
    ({"type": "noul", "instructions": "?", "criteria": {"True": "x", "true": "y"}}, "questions.q.criteria"),
    ({"type": "noul", "instructions": "?", "colour": "red"}, "questions.q.colour"),
    ({"type": "score", "instructions": ""}, "questions.q.instructions"),
])
def test_laya_errors_reach_the_client_as_laya_wrote_them(server, qdef, field):
    expected = laya_refusal("q", qdef)
    assert expected.path == field
    for path, body in (("/decide", {"state": BILLING_STATE, "questions": {"q": qdef}}),
                       ("/decide/batch", {"states": [BILLING_STATE, "x"], "questions": {"q": qdef}})):
        r = post(server, path, body)
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        # the message is laya's own, word for word: nothing in serving re-checked the question first
        assert error == {"message": str(expected), "type": "invalid_request", "field": field}


def test_batch_states_are_named_by_index(server, billing_questions):
    r = post(server, "/decide/batch", {"states": [BILLING_STATE, {"ok": 1}, 7], "questions": billing_questions})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["field"] == "states[2]"
    r = post(server, "/v1/systemone/batch", {"states": [None], "questions": billing_questions})
    assert r.status_code == 422 and r.json()["error"]["field"] == "states[0]"
    assert r.json()["detail"] == r.json()["error"]["message"]


def test_request_level_fields_keep_their_own_name(server, billing_questions):
    # laya names a budget by itself even when one question is what it does not fit
    tight = {"state": BILLING_STATE, "questions": billing_questions, "max_len": 8}
    r = post(server, "/decide", tight)
    assert r.status_code == 422 and r.json()["error"]["field"] == "max_len", r.text
    r = post(server, "/decide", {**tight, "max_len": 0})
    assert r.status_code == 422 and r.json()["error"]["field"] == "max_len", r.text
    r = post(server, "/decide", {"state": "x", "questions": billing_questions, "min_confidence": {"nope": 1}})
    assert r.status_code == 422 and r.json()["error"]["field"] == "min_confidence", r.text
    r = post(server, "/decide", {"state": "x", "questions": ["not", "a", "mapping"]})
    assert r.status_code == 422 and r.json()["error"]["field"] == "questions", r.text


def test_schema_checks_limits_not_meaning():
    cfg = DecideConfig()
    nonsense = {"q": {"type": "maybe", "criteria": {"a": 1}}, "r": "not even an object"}
    req = decide_request({"state": "x", "questions": nonsense, "max_len": "long"}, "decide", cfg, {})
    assert req.questions == nonsense and req.budgets == {"max_len": "long"}
    too_many = {"q": {"type": "maybe", "criteria": list(range(cfg.max_options + 1))}}
    with pytest.raises(InputError) as err:
        decide_request({"state": "x", "questions": too_many}, "decide", cfg, {})
    assert err.value.path == "questions.q.criteria"


def test_service_names_the_batch_state_laya_refused(agent, billing_questions):
    """Past the schema (an embedding caller), laya's own refusal of a state still names its index."""
    service = Service(DecideConfig(), DecideMetrics(), request_timeout_s=30)
    service.attach(LayaBackend(agent, "tiny"))
    req = DecideRequest(states=[BILLING_STATE, 7], questions=billing_questions)
    with pytest.raises(InputError) as err:
        service.decide(req, 0.0, "test", batch=True)
    assert err.value.path == "states[1]"
    with pytest.raises(InputError) as err:
        service.decide(DecideRequest(states=[7], questions=billing_questions), 0.0, "test", batch=False)
    assert err.value.path == "state"
    service.batcher.stop()


@pytest.mark.parametrize("text,field,words", [
    ("[" * 10_000 + "]" * 10_000, "body[0]", "64-level limit"),                    # past the parser's recursion
    ('{"a": {"b": [' + "[" * 70 + "]" * 70 + "]}}", "a.b[0]", "64-level limit"),   # past ours, not the parser's
    ('{"n": ' + "1" * 4301 + "}", "n", "more than 4300 digits"),
    ('{"n": [1.5, -Infinity]}', "n[1]", "-Infinity is not JSON"),
    ('{"n": {"x": 2e308}}', "n.x", "outside the range of a double"),
    ('{"q": {"\\ud800": 1}}', "q.\\ud800", "unpaired UTF-16 surrogate"),
    ('{"q": ["ok", "x\\udfff"]}', "q[1]", "unpaired UTF-16 surrogate"),
    ('"\\ud800"', "body", "unpaired UTF-16 surrogate"),
    # a name given twice: the parser would keep the last value and lose the first without a word
    ('{"state": "refund", "state": 5}', "state", "'state' appears more than once in the body"),
    ('{"questions": {"d": {"criteria": {"billing": "x", "billing": "y", "tech": "z"}}}}', "questions.d.criteria.billing",
     "appears more than once in questions.d.criteria"),
    ('[{"x": 1}, {"y": [{"z": 1, "z": 1}]}]', "body[1].y[0].z", "'z' appears more than once"),
])
def test_parse_json_names_what_it_refuses(text, field, words):
    with pytest.raises(ApiError) as err:
        parse_json(text.encode())
    assert (err.value.status, err.value.type, err.value.field) == (400, "invalid_json", field)
    assert words in err.value.message


def test_parse_json_reads_what_json_allows():
    text = '{"a": [[["deep enough"]]], "n": -' + "9" * 4300 + ', "f": 1.5e300, "e": "\\ud83d\\ude00 \\u00e9"}'
    value = parse_json(text.encode())
    assert value["e"] == "\U0001f600 \u00e9" and value["f"] == 1.5e300 and len(str(value["n"])) == 4301
    assert parse_json(("[" * 64 + "]" * 64).encode()) == json.loads("[" * 64 + "]" * 64)


def test_cost_limits_refuse_before_the_model(agent, billing_questions):
    """Rows are counted before anything is tokenised; tokens as each state is prepared, stopping at the limit."""
    cfg = DecideConfig(max_request_rows=5, max_request_tokens=200)
    with pytest.raises(ApiError) as err:
        decide_request({"states": ["a", "b"], "questions": billing_questions}, "decide_batch", cfg, {})
    assert (err.value.status, err.value.type, err.value.field) == (413, "request_too_large", "states")
    assert "6 question rows (2 states x 3 questions)" in err.value.message
    assert "max_len" not in err.value.message  # a lower max_len makes no fewer rows: it was advised anyway
    service = Service(cfg, DecideMetrics(), request_timeout_s=30)
    service.attach(LayaBackend(agent, "tiny"))
    long = DecideRequest(states=[BILLING_STATE * 20] * 3, questions={"q": billing_questions["churn_risk"]},
                         budgets={"max_len": 150})
    with pytest.raises(ApiError) as err:
        service.decide(long, time.monotonic(), "test", batch=True)
    assert err.value.status == 413 and "300 encoder tokens for its first 2 of 3 states" in err.value.message
    assert err.value.message.endswith("send fewer states or questions, or a lower max_len")
    assert "limit of 200 (--max-request-tokens / PAGODA_MAX_REQUEST_TOKENS)" in err.value.message
    fits = DecideRequest(states=[BILLING_STATE * 20], questions={"q": billing_questions["churn_risk"]},
                         budgets={"max_len": 150})
    assert service.decide(fits, time.monotonic(), "test", batch=True)[0][0]["usage"]["input_tokens"] == 150
    service.batcher.stop()


def test_peer_gone_runs_each_callback_once_and_at_once_when_already_set():
    """The gateway's cut hangs on this: a callback registered before the client goes runs when it goes, one
    registered after runs at once, one cancelled never runs, and a callback that raises stops no other."""
    gone = PeerGone()
    calls: list[str] = []
    gone.when_set(lambda: calls.append("first"))
    cancel = gone.when_set(lambda: calls.append("cancelled"))
    gone.when_set(lambda: 1 / 0)
    gone.when_set(lambda: calls.append("after a failing one"))
    cancel()
    assert calls == []
    gone.set()
    gone.set()  # the watch sets it once; a second set runs nothing again
    assert calls == ["first", "after a failing one"] and gone.is_set()
    gone.when_set(lambda: calls.append("late"))()  # runs now; its cancel is a no-op
    assert calls[-1] == "late"
