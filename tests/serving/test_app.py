"""The main server, a real `pagoda serve` process: answers, compat routes, presets, policy, errors, metrics."""

from __future__ import annotations

import json
import threading

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from serving_support import BILLING_STATE

from laya.precision import detect

TIMING = ("latency_ms", "queue_ms")
STATES = [
    BILLING_STATE,
    {"customer": "ACME", "plan": "pro", "message": "The server is down again and we cannot log in."},
    [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "how can I help?"},
     {"role": "user", "content": "my invoice is wrong, I was charged twice"}],
]


def post(server, path, body, **kw):
    return requests.post(server.url + path, json=body, timeout=60, **kw)


def assert_same_decision(served: dict, expected: dict) -> None:
    """Identical rounded JSON answers and usage (timing aside): the bit-identical goal, as JSON shows it."""
    assert served["answers"] == expected["answers"]
    usage = {k: v for k, v in served["usage"].items() if k not in TIMING}
    assert usage == expected["usage"]
    assert served["model"] == expected["model"]


def assert_error(response, status: int, type_: str, field: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body["error"]) == {"message", "type", "field"}
    assert body["error"]["type"] == type_
    assert body["error"]["message"]
    if field is not None:
        assert body["error"]["field"] == field, body
    assert body["request_id"] == response.headers["X-Request-ID"]
    return body


def test_health_ready_models(server):
    # the process answered while the model was loading: /ready said 503 until it was in memory
    assert server.ready_statuses[0] == 503 and server.ready_statuses[-1] == 200
    # /health names the CPU features precision detection saw and the engine that answers (issue 14)
    health = requests.get(server.url + "/health", timeout=5).json()
    assert health["status"] == "ok" and set(health) == {"status", "decide"}  # this server runs no LLM
    assert health["decide"]["cpu"] == detect().summary()
    assert health["decide"]["engine"]["precision"] == "exact"
    ready = requests.get(server.url + "/ready", timeout=5)
    assert ready.status_code == 200 and ready.json()["kind"] == "laya"
    models = requests.get(server.url + "/v1/models", timeout=5).json()
    assert models["data"][0]["id"] == "bert-tiny" and "support-triage" in models["presets"]


@pytest.mark.parametrize("state", STATES, ids=["text", "object", "chat"])
def test_decide_equals_predict(server, agent, billing_questions, state):
    r = post(server, "/decide", {"state": state, "questions": billing_questions})
    assert r.status_code == 200, r.text
    body = r.json()
    assert_same_decision(body, agent.predict(state, billing_questions))
    assert body["request_id"] == r.headers["X-Request-ID"]
    assert body["usage"]["latency_ms"] >= body["usage"]["queue_ms"] >= 0


def test_budgets_and_min_confidence_pass_through(server, agent, billing_questions):
    controls = {"max_len": 48, "head_max_len": 40, "min_confidence": 0.6}
    r = post(server, "/decide", {"state": BILLING_STATE * 3, "questions": billing_questions, **controls})
    assert r.status_code == 200, r.text
    expected = agent.predict(BILLING_STATE * 3, billing_questions, **controls)
    assert expected["usage"]["truncated"]  # the budget really bit
    assert_same_decision(r.json(), expected)


def test_decide_batch_equals_predict(server, agent, billing_questions):
    r = post(server, "/decide/batch", {"states": STATES, "questions": billing_questions})
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["results"]) == len(STATES)
    for served, state in zip(body["results"], STATES):
        assert_same_decision(served, agent.predict(state, billing_questions))
    assert body["usage"]["input_tokens"] == sum(x["usage"]["input_tokens"] for x in body["results"])
    assert body["usage"]["latency_ms"] >= body["usage"]["queue_ms"] >= 0


def test_preset_and_policy_actions(server, agent, billing_questions):
    r = post(server, "/decide", {"state": BILLING_STATE, "preset": "support-triage"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert_same_decision(body, agent.predict(BILLING_STATE, billing_questions))
    answers = body["answers"]
    assert body["actions"] == {
        "escalate": answers["churn_risk"]["noul"] > 0.7,
        "queue": answers["department"]["choice"],
        "priority": answers["urgency"]["score"] >= 1.5,
        "refund_desk": answers["department"]["choice"] == "billing"
                       and answers["department"]["probabilities"]["billing"] >= 0.5,
    }
    # a rule over questions this request did not ask is null, never a made-up false
    only_urgency = {"urgency": billing_questions["urgency"]}
    actions = post(server, "/decide", {"state": BILLING_STATE, "questions": only_urgency}).json()["actions"]
    assert actions["escalate"] is None and actions["queue"] is None and isinstance(actions["priority"], bool)
    assert_error(post(server, "/decide", {"state": "x", "preset": "nope"}), 422, "invalid_request", "preset")


def test_systemone_round_trip(server, agent, billing_questions):
    r = post(server, "/v1/systemone", {"state": BILLING_STATE, "questions": billing_questions, "model": "jev-1"})
    assert r.status_code == 200, r.text
    body = r.json()
    expected = agent.predict(BILLING_STATE, billing_questions)
    assert set(body) == {"model", "answers", "usage"}
    for name, answer in body["answers"].items():
        extra = {k: v for k, v in answer.items() if k != "x_jev_confidence"}
        assert extra == expected["answers"][name]
        assert ("x_jev_confidence" in answer) == (answer["type"] != "noul")
        if answer["type"] == "choice":
            p, n = max(answer["probabilities"].values()), len(answer["probabilities"])
            assert answer["x_jev_confidence"] == pytest.approx((p - 1 / n) / (1 - 1 / n), abs=2e-4)
    batch = post(server, "/v1/systemone/batch", {"states": STATES[:2], "questions": billing_questions}).json()
    assert [r["answers"]["department"]["choice"] for r in batch["results"]] == [
        agent.predict(s, billing_questions)["answers"]["department"]["choice"] for s in STATES[:2]]
    assert batch["total_usage"]["input_tokens"] == sum(r["usage"]["input_tokens"] for r in batch["results"])
    bad = assert_error(post(server, "/v1/systemone", {"questions": billing_questions}), 422, "invalid_request", "state")
    assert bad["detail"] == bad["error"]["message"]  # laya-serve clients read `detail`
    # no preset hint where the route takes no preset (it refuses `preset` as an unknown field)
    bad = assert_error(post(server, "/v1/systemone", {"state": "x"}), 422, "invalid_request", "questions")
    assert bad["error"]["message"] == "questions is required"
    bad = assert_error(post(server, "/decide", {"state": "x"}), 422, "invalid_request", "questions")
    assert bad["error"]["message"] == "questions is required (or name a preset)"


def _options(n):
    return {f"option{i}": f"description {i}" for i in range(n)}


@pytest.mark.parametrize("path,body,status,type_,field", [
    ("/decide", {"questions": {}}, 422, "invalid_request", "state"),
    ("/decide", {"state": "x", "questions": {"q": {"type": "maybe", "instructions": "?"}}},
     422, "invalid_request", "questions.q.type"),
    ("/decide", {"state": "x", "questions": {"q": {"type": "choice", "instructions": "?"}}},
     422, "invalid_request", "questions.q.criteria"),
    ("/decide", {"state": "x", "questions": {"q": {"type": "choice", "instructions": "?", "criteria": _options(101)}}},
     422, "invalid_request", "questions.q.criteria"),
    ("/decide/batch", {"states": ["x"] * 65, "questions": {}}, 422, "invalid_request", "states"),
    ("/decide", {"state": "x", "questions": {"q": {"type": "score", "instructions": "?", "criteria": ["a"]}}},
     422, "invalid_request", "questions.q.criteria"),  # the core's own check, surfaced as 422
    ("/decide", {"state": 5, "questions": {}}, 422, "invalid_request", "state"),
    # a question's unknown field is the question's, whatever its name, and no state's in a batch
    ("/decide/batch", {"states": ["x", "y"], "questions": {"q": {"type": "noul", "instructions": "?", "state": 1}}},
     422, "invalid_request", "questions.q.state"),
    ("/decide", {"state": "x", "questions": {"q": {"type": "noul", "instructions": "?", "lang": 1}}},
     422, "invalid_request", "questions.q.lang"),
    ("/decide", {"state": "x", "questions": {"q": {"type": "noul", "instructions": "?"}}, "max_len": -1}, 422,
     "invalid_request", "max_len"),
    ("/decide", {"state": "x", "questions": {}, "temperature": 2}, 422, "invalid_request", "temperature"),
    ("/decide", [1, 2], 422, "invalid_request", "body"),
])
def test_schema_violations(server, path, body, status, type_, field):
    assert_error(post(server, path, body), status, type_, field)


def test_http_errors(server):
    r = requests.post(server.url + "/decide", data=b'{"state": "x", "questions": {', timeout=10,
                      headers={"Content-Type": "application/json"})
    assert_error(r, 400, "invalid_json")
    r = requests.post(server.url + "/decide", data=b"{" + b" " * (1 << 20) + b"}", timeout=30)
    assert_error(r, 413, "payload_too_large")
    r = requests.get(server.url + "/decide", timeout=10)
    assert_error(r, 405, "method_not_allowed")
    assert "POST" in r.headers["Allow"]
    assert_error(requests.get(server.url + "/no/such/route", timeout=10), 404, "not_found")
    assert_error(requests.post(server.url + "/health", timeout=10), 405, "method_not_allowed")


def test_budget_past_the_positions_is_422_and_isolated(server, agent, billing_questions):
    """max_len 2000 on a 1024-position BERT used to fail inside the forward pass (a 500, and a re-run of
    every request batched with it); it is refused at validation, and its neighbours never notice."""
    poison = {"state": BILLING_STATE * 60, "questions": billing_questions, "max_len": 2000}
    body = assert_error(post(server, "/decide", poison), 422, "invalid_request", "max_len")
    assert "1024 positions" in body["error"]["message"]
    results: dict[int, requests.Response] = {}

    def call(i):
        results[i] = post(server, "/decide", poison if i == 0 else {"state": STATES[i % 3], "questions":
                                                                       billing_questions})

    threads = [threading.Thread(target=call, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results[0].status_code == 422
    for i in range(1, 6):
        assert results[i].status_code == 200, results[i].text
        assert_same_decision(results[i].json(), agent.predict(STATES[i % 3], billing_questions))
    assert "model forward failed" not in server.log() and "model worker error" not in server.log()


def test_metrics_and_stats(server, billing_questions):
    post(server, "/decide", {"state": BILLING_STATE, "questions": billing_questions})
    text = requests.get(server.url + "/metrics", timeout=10).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("pagoda_requests", "pagoda_decisions", "pagoda_request_latency_seconds",
                 "pagoda_batch_questions", "pagoda_queue_wait_seconds", "pagoda_tokens"):
        assert name in families, sorted(families)
    ok = [s for s in families["pagoda_requests"].samples
          if s.name == "pagoda_requests_total" and s.labels == {"route": "/decide", "status": "200"}]
    assert ok and ok[0].value >= 1
    stats = requests.get(server.url + "/stats", timeout=10).json()
    assert stats["decisions"] >= 1 and stats["questions"] >= 3 and stats["tokens"] > 0
    assert stats["latency_ms"]["p50"] is not None and stats["queue_ms"]["p99"] is not None
    assert sum(stats["batch_size_histogram"].values()) == stats["batches"]


def test_access_log_line(server, billing_questions):
    r = post(server, "/decide", {"state": BILLING_STATE, "questions": billing_questions},
             headers={"X-Request-ID": "trace-me-123"})
    assert r.headers["X-Request-ID"] == "trace-me-123" and r.json()["request_id"] == "trace-me-123"
    lines = [json.loads(line) for line in server.log().splitlines() if "trace-me-123" in line and line.startswith("{")]
    assert lines, server.log()[-2000:]
    assert lines[-1]["route"] == "/decide" and lines[-1]["status"] == 200 and lines[-1]["latency_ms"] > 0


def test_empty_questions_are_refused_before_any_pass_but_systemone_answers_them(server):
    """`/decide` answered `{"questions": {}}` with no answers and counted a model pass of 0 rows (a student refused
    it): both backends refuse it now, before any pass. laya-serve answers it on its routes, so those do here too,
    still with no pass."""
    def passes():
        stats = requests.get(server.url + "/stats", timeout=10).json()
        return stats["batches"], stats["batch_size_histogram"].get("0")

    before = passes()
    for path, body in (("/decide", {"state": "x", "questions": {}}), ("/decide/batch", {"states": ["x"], "questions": {}})):
        error = assert_error(post(server, path, body), 422, "invalid_request", "questions")["error"]
        assert error["message"] == "questions: empty; ask at least one question"
    r = post(server, "/v1/systemone", {"state": "x", "questions": {}})
    assert r.status_code == 200 and r.json()["answers"] == {}, r.text
    assert r.json()["usage"] == {"input_tokens": 0, "output_tokens": 0}        # as laya-serve answers it
    r = post(server, "/v1/systemone/batch", {"states": ["x", "y"], "questions": {}})
    assert r.status_code == 200 and [x["answers"] for x in r.json()["results"]] == [{}, {}], r.text
    assert passes() == before
