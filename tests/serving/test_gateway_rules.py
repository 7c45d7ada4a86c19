"""The gateway's settings and rules files and its routing choices, in-process: what a valid file means, that
every bad one is refused when the gateway starts with an error naming the rule, question or key (one case
also as a real `pagoda gateway` process that exits before serving), which member of a group takes a
request, fallback and ejection, and the default route when no decision can be made."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import yaml
from prometheus_client import CollectorRegistry
from serving_support import REPO
from urllib3.util import SKIP_HEADER

from serving.gateway.config import GatewayConfig
from serving.gateway.metrics import GatewayMetrics
from serving.gateway.proxy import request_headers
from serving.gateway.router import Decisions, Router, bounded, read_body, request_state
from serving.gateway.rules import Rules
from serving.gateway.upstreams import Upstreams

GROUPS = ["edge", "frontier"]
QUESTIONS = {
    "needs_reasoning": {"type": "noul", "instructions": "Does this need several steps of reasoning?"},
    "topic": {"type": "choice", "instructions": "What is it about?", "criteria": ["code", "chat", "maths"],
              "input": "conversation"},
    "tier": {"type": "score", "instructions": "How demanding is this customer?", "criteria": ["low", "high"],
             "input": "field:user"},
}


def write(tmp_path, data: dict, name: str = "routes.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def load(tmp_path, data: dict) -> Rules:
    return Rules.load(write(tmp_path, data), GROUPS)


def test_a_valid_file_groups_questions_by_input_and_keeps_rule_order(tmp_path):
    rules = load(tmp_path, {"questions": QUESTIONS, "routes": {
        "frontier": "needs_reasoning.noul > 0.7 or topic.choice == 'maths'", "edge": "tier.score < 0.5"},
        "default": "frontier", "fallback": "edge", "explicit": ["edge"], "budgets": {"max_len": 128}})
    assert [(a.input, sorted(a.questions)) for a in rules.asks] == [
        ("last_user", ["needs_reasoning"]), ("conversation", ["topic"]), ("field:user", ["tier"])]
    assert "input" not in rules.asks[1].questions["topic"]  # laya's definition, without the gateway's key
    assert [r.name for r in rules.policy.rules] == ["frontier", "edge"]
    assert (rules.default, rules.fallback, rules.explicit, rules.budgets) == ("frontier", "edge", {"edge"},
                                                                             {"max_len": 128})


def test_without_a_file_the_first_group_is_the_default_and_groups_may_be_named():
    assert Rules.plain(GROUPS).default == "edge" and Rules.plain(GROUPS).explicit == {"edge", "frontier"}
    assert Rules.plain(["only"]).explicit == frozenset()  # one group: nothing to name, nothing to parse


@pytest.mark.parametrize("data, words", [
    ({"questions": QUESTIONS, "routes": {"frontier": "reasoning.noul > 0.7"}},
     ["rule 'frontier'", "question 'reasoning'", "does not ask"]),
    ({"questions": QUESTIONS, "routes": {"frontier": "needs_reasoning.score > 0.7"}},
     ["rule 'frontier'", "needs_reasoning.score", "noul question"]),
    ({"questions": QUESTIONS, "routes": {"frontier": "topic.probabilities.physics > 0.5"}},
     ["rule 'frontier'", "topic.probabilities.physics"]),
    ({"questions": QUESTIONS, "routes": {"frontier": "needs_reasoning.low_confidence"}},
     ["rule 'frontier'", "min_confidence"]),
    ({"questions": QUESTIONS, "routes": {"gpu": "needs_reasoning.noul > 0.7"}},
     ["rule 'gpu'", "no upstream group 'gpu'"]),
    ({"questions": QUESTIONS, "routes": {"frontier": "needs_reasoning.noul >"}}, ["rule 'frontier'"]),
    ({"questions": QUESTIONS, "routes": {"frontier": "topic.choice"}}, ["rule 'frontier'", "must be a condition"]),
    ({"questions": QUESTIONS, "routes": {"frontier": "needs_reasoning.nul > 1"}},
     ["rule 'frontier'", "unknown answer field 'nul'"]),
    ({"questions": {"q": {"type": "choice", "instructions": "x"}}}, ["question 'q'", "criteria"]),
    ({"questions": {"q": {"type": "noul", "instructions": "x", "input": "the body"}}}, ["question 'q'", "input"]),
    ({"questions": QUESTIONS, "default": "gpu"}, ["default", "'gpu'"]),
    ({"questions": QUESTIONS, "fallback": "gpu"}, ["fallback", "'gpu'"]),
    ({"explicit": ["gpu"]}, ["explicit", "'gpu'"]),
    ({"budgets": {"max_len": 0}}, ["max_len"]),
    ({"budgets": {"max_length": 10}}, ["budgets", "max_length"]),
    ({"route": {}}, ["unknown key 'route'"]),
    # a question no rule reads costs a decision per request and changes no route; so does a file of questions only
    ({"questions": QUESTIONS, "routes": {"frontier": "needs_reasoning.noul > 0.7 or tier.score > 1"}},
     ["question 'topic'", "read by no rule"]),
    ({"questions": {"q": QUESTIONS["needs_reasoning"]}}, ["question 'q'", "read by no rule"]),
    # a label the choice does not have makes the comparison constant, either way round and negated
    ({"questions": QUESTIONS, "routes": {"frontier": "needs_reasoning.noul > 0.7 or tier.score > 1 or "
                                                     "topic.choice == 'physics'"}},
     ["rule 'frontier'", "topic.choice is never 'physics'", "'code', 'chat', 'maths'"]),
    ({"questions": QUESTIONS, "routes": {"frontier": "needs_reasoning.noul > 0.7 and tier.score > 1 and "
                                                     "not ('Maths' != topic.choice)"}},
     ["rule 'frontier'", "never 'Maths'"]),
    ({"questions": {"q": {"type": "noul", "instructions": "x", "input": "field:.."}}}, ["question 'q'", "input"]),
    ({"questions": {"q": {"type": "noul", "instructions": "x", "input": "field:user."}}}, ["question 'q'", "input"]),
])
def test_a_bad_file_is_refused_naming_what_is_wrong(tmp_path, data, words):
    with pytest.raises(ValueError) as err:
        load(tmp_path, data)
    message = str(err.value)
    assert message.startswith(f"route file {tmp_path}") and all(w in message for w in words), message


def test_a_budget_past_the_routing_models_positions_is_refused_at_start(tmp_path):
    with pytest.raises(ValueError, match=r"budgets.max_len: 100000000 is more than the routing model's 512"):
        Rules.load(write(tmp_path, {"budgets": {"max_len": 100_000_000}}), GROUPS, positions=512)
    assert Rules.load(write(tmp_path, {"budgets": {"max_len": 512}}), GROUPS, positions=512).budgets["max_len"] == 512


def test_pagoda_gateway_stops_at_start_naming_the_rule(tmp_path):
    bad = write(tmp_path, {"questions": QUESTIONS, "routes": {"frontier": "needs_reasoning.score > 0.7"}})
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "serving.cli", "gateway", "--upstream", "edge=http://127.0.0.1:9",
                           "--upstream", "frontier=http://127.0.0.1:10", "--route", bad, "--port", "0"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and time.monotonic() - started < 120
    assert "pagoda gateway: error: route file" in done.stderr and "rule 'frontier'" in done.stderr, done.stderr
    assert "Booting" not in done.stderr  # refused before gunicorn started


def _fake_student(tmp_path, questions: dict):
    """A student folder as its student.json describes it (the check at start reads no model)."""
    import json

    folder = tmp_path / "student"
    folder.mkdir()
    (folder / "model.onnx").write_bytes(b"")
    (folder / "student.json").write_text(json.dumps({
        "format": "pagoda-student/1", "name": "triage", "kind": "linear", "questions": questions,
        "heads": [{"name": n} for n in questions], "models": {"fp32": "model.onnx"}, "default_precision": "fp32",
        "max_len": 128}))
    return folder


@pytest.mark.parametrize("data, words", [
    ({"questions": {"needs_reasoning": QUESTIONS["needs_reasoning"]}, "budgets": {"max_len": 256},
      "routes": {"frontier": "needs_reasoning.noul > 0.5"}}, "budgets.max_len: not taken with --student"),
    ({"questions": {"topic": QUESTIONS["topic"]}, "routes": {"frontier": "topic.choice == 'code'"}},
     "this student answers only ['needs_reasoning']"),
])
def test_a_route_file_a_student_cannot_answer_stops_the_gateway_at_start(tmp_path, data, words):
    """A worker found these only as it loaded: the gateway exited 3 with the reason in its log."""
    student = _fake_student(tmp_path, {"needs_reasoning": QUESTIONS["needs_reasoning"]})
    done = subprocess.run([sys.executable, "-m", "serving.cli", "gateway", "--upstream", "edge=http://127.0.0.1:9",
                           "--upstream", "frontier=http://127.0.0.1:10", "--route", write(tmp_path, data),
                           "--student", str(student), "--port", "0"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and words in done.stderr and "Booting" not in done.stderr, done.stderr


def test_request_state_reads_what_each_input_names():
    chat = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "first"},
                         {"role": "assistant", "content": "ok"},
                         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
            "user": "gold", "metadata": {"tags": ["x", "y"]}}
    path = "/v1/chat/completions"
    assert request_state("last_user", path, chat) == "a\nb"
    assert request_state("conversation", path, chat)[0] == {"role": "system", "content": "be brief"}
    assert len(request_state("conversation", path, chat)) == 4
    assert request_state("field:user", path, chat) == "gold"
    assert request_state("field:metadata.tags.1", path, chat) == "y"
    assert request_state("field:metadata.missing", path, chat) is None
    assert request_state("last_user", "/v1/completions", {"prompt": ["p1", "p2"]}) == "p1\np2"
    assert request_state("last_user", "/v1/completions", {"prompt": [1, 2, 3]}) is None  # token ids: no text
    assert request_state("conversation", "/generate", {"text": "t"}) == "t"
    assert request_state("last_user", path, {"messages": [{"role": "system", "content": "s"}]}) is None
    # the Responses API: a string is one user message; items with parts, and function calls (no role) skipped
    items = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "refund"}]},
                       {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                       {"type": "function_call_output", "call_id": "c", "output": "done"},
                       {"type": "message", "role": "assistant",
                        "content": [{"type": "output_text", "text": "ok", "annotations": []}]},
                       {"role": "user", "content": "and cancel"}]}
    assert request_state("last_user", "/v1/responses", {"input": "hello"}) == "hello"
    assert request_state("last_user", "/v1/responses", items) == "and cancel"
    assert request_state("conversation", "/v1/responses", items) == [
        {"role": "user", "content": "refund"}, {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "and cancel"}]


def test_explicit_model_names_a_group_only_when_allowed(tmp_path):
    rules = load(tmp_path, {"explicit": ["frontier"], "default": "edge"})
    router = Router(rules, None)
    assert router.route("/v1/chat/completions", {"model": "frontier"}, "r").group == "frontier"
    assert router.route("/v1/chat/completions", {"model": "frontier"}, "r").reason == "explicit"
    assert router.route("/v1/chat/completions", {"model": "edge"}, "r").reason == "default"
    assert router.route("/v1/chat/completions", None, "r").group == "edge"


def test_rules_that_read_no_question_route_without_a_decision(tmp_path):
    """`frontier: "true"` switches every request to frontier; with no questions there is no decision model,
    and the rules were once skipped for want of one."""
    rules = load(tmp_path, {"routes": {"frontier": "true"}, "default": "edge"})
    route = Router(rules, None).route("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "r")
    assert (route.group, route.reason, route.decision_s) == ("frontier", "rule", None)


@pytest.mark.parametrize("body", [
    b'{"messages": ' + b"[" * 2000 + b"]" * 2000 + b"}",       # past the nesting limit (a RecursionError: a 500)
    b'{"model": "edge", "max_tokens": 3, "max_tokens": 4}',     # a rewrite would keep only the last
    b'{"model": "edge", "temperature": 1e400}',                # a rewrite would send Infinity
    b'[1, 2]', b"not json",
])
def test_a_body_json_cannot_mean_is_forwarded_untouched(body):
    """Read as strictly as `pagoda serve` reads it: the upstream refuses it in its own words, and the gateway
    neither fails on it nor rewrites it."""
    assert read_body(body) is None
    assert read_body(b'{"model": "edge", "temperature": 0.7}') == {"model": "edge", "temperature": 0.7}


def test_what_routing_reads_of_a_long_prompt_is_bounded():
    """A text's start and a conversation's end are what the routing model reads (laya keeps the end of a list
    state): the rest is cut before tokenising."""
    assert bounded("abcdef", 4) == "abcd" and bounded("ab", 4) == "ab"
    conversation = [{"role": "user", "content": "first question"}, {"role": "assistant", "content": "answer"},
                    {"role": "user", "content": "last"}]
    assert bounded(conversation, 8) == [{"role": "assistant", "content": "swer"}, {"role": "user", "content": "last"}]
    assert bounded(conversation, 100) == conversation


def test_hop_by_hop_headers_are_dropped_and_the_request_id_is_added():
    sent = request_headers([("Content-Type", "application/json"), ("Connection", "keep-alive, X-Secret"),
                            ("X-Secret", "1"), ("Keep-Alive", "5"), ("Transfer-Encoding", "chunked"),
                            ("Host", "gw:8080"), ("Content-Length", "12"), ("Authorization", "Bearer k"),
                            ("X-Request-ID", "client-id"), ("User-Agent", "openai/1")], "gw-id")
    assert sent == {"Content-Type": "application/json", "Authorization": "Bearer k", "User-Agent": "openai/1",
                    "X-Request-ID": "gw-id", "Accept-Encoding": SKIP_HEADER}  # not urllib3's: none was sent


def test_settings_come_from_flags_then_variables_then_the_config_file(tmp_path):
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump({"upstream": {"edge": ["http://a:1", "http://b:2"], "frontier": "http://c:3"},
                                      "health-interval-s": 0.5, "port": 9000, "retry": True}))
    cfg = GatewayConfig.load({"config": str(config), "port": 9100}, env={"PAGODA_HEALTH_INTERVAL_S": "0.25"})
    assert cfg.port == 9100 and cfg.health_interval_s == 0.25 and cfg.retry is True
    assert [(s.group, s.url) for s in cfg.upstreams] == [("edge", "http://a:1"), ("edge", "http://b:2"),
                                                         ("frontier", "http://c:3")]
    cfg = GatewayConfig.load({"upstream": ["x=http://h:1/prefix/"]}, env={"PAGODA_UPSTREAM": "y=http://h:2"})
    assert [(s.group, s.url, s.base_path) for s in cfg.upstreams] == [("x", "http://h:1", "/prefix")]
    assert GatewayConfig.load({}, env={"PAGODA_UPSTREAM": "y=http://h:2,z=http://h:3"}).upstreams[1].group == "z"


@pytest.mark.parametrize("flags, env, words", [
    ({}, {}, ["--upstream", "at least one"]),
    ({"upstream": ["edge"]}, {}, ["'edge'", "NAME=URL"]),
    ({"upstream": ["edge=ftp://x"]}, {}, ["upstream 'edge'", "http"]),
    ({"upstream": ["edge=http://x:1", "other=http://x:1"]}, {}, ["given twice"]),
    ({"upstream": ["edge=http://x:1"]}, {"PAGODA_HEALTH_FAILS": "0"}, ["--health-fails", "at least 1"]),
    ({"upstream": ["edge=http://x:1"]}, {"PAGODA_RETRY": "maybe"}, ["PAGODA_RETRY", "boolean"]),
])
def test_bad_settings_name_the_flag_and_the_variable(flags, env, words):
    with pytest.raises(ValueError) as err:
        GatewayConfig.load(flags, env=env)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_a_config_file_key_that_is_no_setting_is_named(tmp_path):
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump({"upstreams": "edge=http://a:1"}))
    with pytest.raises(ValueError, match="unknown setting 'upstreams'"):
        GatewayConfig.load({"config": str(config)}, env={})


def upstreams(*specs: str) -> Upstreams:
    cfg = GatewayConfig.load({"upstream": list(specs)}, env={})
    return Upstreams(cfg, GatewayMetrics(CollectorRegistry()))  # pools connect lazily: nothing is contacted


def test_the_least_busy_healthy_member_takes_a_request_and_ties_take_turns():
    ups = upstreams("edge=http://127.0.0.1:9", "edge=http://127.0.0.1:10", "edge=http://127.0.0.1:11")
    a, b, c = ups.groups["edge"]
    firsts = {ups.candidates("edge", None)[1][0].url for _ in range(6)}
    assert firsts == {a.url, b.url, c.url}  # in turn
    a.enter(), b.enter()
    assert [u.url for u in ups.candidates("edge", None)[1]][0] == c.url
    c.failed("x"), c.failed("y")  # --health-fails 2: out of rotation
    assert c.url not in [u.url for u in ups.candidates("edge", None)[1]]


def test_a_group_with_no_healthy_member_falls_back_or_is_tried_anyway():
    ups = upstreams("frontier=http://127.0.0.1:9", "edge=http://127.0.0.1:10")
    (frontier,), (edge,) = ups.groups["frontier"], ups.groups["edge"]
    for _ in range(2):
        frontier.failed("connection refused")
    assert not frontier.up and frontier.error == "connection refused"
    assert ups.candidates("frontier", "edge") == ("edge", [edge])
    assert ups.candidates("frontier", None) == ("frontier", [frontier])  # nothing better: try it
    for _ in range(2):
        edge.failed("connection refused")
    assert ups.candidates("frontier", "edge") == ("frontier", [frontier])
    frontier.passed(by_check=False)
    assert not frontier.up  # a request's success does not restore: only checks do
    frontier.passed(by_check=True), frontier.passed(by_check=True)
    assert frontier.up and frontier.error is None


def test_a_decision_that_cannot_be_made_takes_the_default_route(tmp_path):
    rules = load(tmp_path, {"questions": {"needs_reasoning": QUESTIONS["needs_reasoning"]},
                            "routes": {"frontier": "needs_reasoning.noul > 0.5"}, "default": "edge"})
    cfg = GatewayConfig.load({"upstream": ["edge=http://127.0.0.1:9", "frontier=http://127.0.0.1:10"]}, env={})
    decisions = Decisions(cfg, rules, CollectorRegistry())  # never loaded: every decision is 503 not_ready
    route = Router(rules, decisions).route("/v1/chat/completions",
                                           {"messages": [{"role": "user", "content": "prove it"}]}, "r")
    assert (route.group, route.reason) == ("edge", "decision_failed") and route.decision_s is not None
    route = Router(rules, decisions).route("/v1/chat/completions", {"messages": []}, "r")
    assert (route.group, route.reason) == ("edge", "default")  # nothing to ask about: no decision at all
