"""`/openapi.json` stays true: it documents exactly the routes the app serves, real responses from a running server
validate against its schemas (jsonschema, 2020-12), and a request body is answered 2xx exactly when its schema
takes it, on a Laya model and on a student (`agrees`, over tables of bodies at the edges)."""

from __future__ import annotations

import json

import pytest
import requests
from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match
from serving_support import (
    BILLING_STATE,
    STUDENT_TASK,
    TINY_BERT,
    ServerProcess,
    routes_served_and_documented,
)

from serving.app import create_app
from serving.config import ServeConfig
from serving.decide.backend import LayaBackend
from serving.decide.config import DecideConfig
from serving.decide.routes import DecideApi


def check(value, schema: dict, doc: dict, where: str = "$") -> None:
    """`value` validates against `schema` of the served document `doc` (JSON Schema 2020-12, OpenAPI 3.1's
    dialect; `$ref`s resolve inside `doc`), else an AssertionError saying where."""
    error = best_match(Draft202012Validator({**schema, "components": doc["components"]}).iter_errors(value))
    assert error is None, f"{where}: {error.json_path}: {error.message:.300}"


def valid(value, schema: dict, doc: dict) -> bool:
    return Draft202012Validator({**schema, "components": doc["components"]}).is_valid(value)


def request_schema(doc: dict, path: str) -> dict:
    return doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]


def agrees(url: str, cases: list[tuple[str, dict, int]]) -> None:
    """Each body is answered 2xx exactly when the served document's request schema takes it, and with the status
    the case expects (so the table says which side it holds, and neither side can drift alone)."""
    doc = requests.get(url + "/openapi.json", timeout=10).json()
    wrong = []
    for path, body, status in cases:
        r = requests.post(url + path, json=body, timeout=60)
        takes = valid(body, request_schema(doc, path), doc)
        if r.status_code != status or takes != (status < 300):
            wrong.append(f"{path} {json.dumps(body)[:160]}: server {r.status_code} (expected {status}) "
                         f"{r.text[:200]}, schema {'takes' if takes else 'refuses'} it")
    assert not wrong, "\n".join(wrong)


def test_documents_exactly_the_served_routes(agent):
    cfg = ServeConfig()
    app = create_app(cfg, apis=[DecideApi(cfg.decide, cfg.request_timeout_s, backend=LayaBackend(agent, "tiny"))])
    served, documented = routes_served_and_documented(app)
    assert served == documented


def test_budgets_advertise_the_served_models_positions(agent, tmp_path):
    """`max_len` and `head_max_len` were advertised up to --max-len-cap (8192) while the model takes its positions
    (laya-mini 512, bert-tiny 1024) and answers 422 past them: the maximum is the smaller of the two, read from the
    model folder before the model loads (or from an injected model); where nothing says, the description does."""
    def maxima(api):
        props = api.openapi()["schemas"]["DecideRequest"]["properties"]
        return props["max_len"]["maximum"], props["head_max_len"]["maximum"]

    assert agent.max_positions == 1024
    assert maxima(DecideApi(DecideConfig(model=str(TINY_BERT)), 30)) == (1024, 1024)
    assert maxima(DecideApi(DecideConfig(model=str(TINY_BERT), max_len_cap=300), 30)) == (300, 300)
    assert maxima(DecideApi(DecideConfig(), 30, backend=LayaBackend(agent, "tiny"))) == (1024, 1024)
    (tmp_path / "rl_agent_config.json").write_text("{}")  # a folder whose encoder config is missing: the cap
    unknown = DecideApi(DecideConfig(model=str(tmp_path)), 30).openapi()["schemas"]["DecideRequest"]["properties"]
    assert unknown["max_len"]["maximum"] == 8192 and "served model's positions" in unknown["max_len"]["description"]


def test_real_responses_validate(server, billing_questions):
    doc = requests.get(server.url + "/openapi.json", timeout=10).json()
    assert doc["openapi"].startswith("3.1")
    assert doc["components"]["schemas"]["DecideRequest"]["properties"]["max_len"]["maximum"] == 1024  # bert-tiny's

    def response_schema(path, method, status):
        content = doc["paths"][path][method]["responses"][str(status)]["content"]
        return next(iter(content.values()))["schema"]

    calls = [
        ("/decide", {"state": BILLING_STATE, "questions": billing_questions, "min_confidence": 0.5}),
        ("/decide", {"state": {"message": BILLING_STATE}, "preset": "support-triage"}),
        ("/decide/batch", {"states": [BILLING_STATE, "other"], "questions": billing_questions}),
        ("/v1/systemone", {"state": BILLING_STATE, "questions": billing_questions, "model": "jev-1"}),
        ("/v1/systemone/batch", {"states": [BILLING_STATE], "questions": billing_questions}),
    ]
    for path, body in calls:
        check(body, request_schema(doc, path), doc, f"request {path}")
        r = requests.post(server.url + path, json=body, timeout=60)
        assert r.status_code == 200, r.text
        check(r.json(), response_schema(path, "post", 200), doc, f"response {path}")
    bad = requests.post(server.url + "/decide", json={"questions": {}}, timeout=10)
    check(bad.json(), response_schema("/decide", "post", 422), doc, "422")
    for path in ("/health", "/ready", "/v1/models", "/stats", "/openapi.json"):
        r = requests.get(server.url + path, timeout=10)
        assert r.status_code == 200
        check(r.json(), response_schema(path, "get", 200), doc, path)


def q(**fields) -> dict:
    return {"questions": {"q": {"type": "choice", "instructions": "Which fits?", "criteria": ["a", "b"], **fields}}}


def noul(**fields) -> dict:
    return {"questions": {"q": {"type": "noul", "instructions": "Is it so?", **fields}}}


def test_request_schemas_take_what_the_laya_routes_answer(server, billing_questions):
    """Found with jsonschema against the served document: bodies it refused were answered 200 (instructions written
    as JSON, null budgets and presets, systemone's loose controls) and bodies it took were refused 422 (unknown
    question fields, unknown gate buckets, empty questions); `option_order` was not documented at all."""
    s = {"state": BILLING_STATE}
    qs = {"questions": billing_questions}
    cases = [
        ("/decide", {**s, **qs}, 200),
        ("/decide", {**s, **noul(instructions=5)}, 200),                         # written as JSON (docs/laya.md)
        ("/decide", {**s, **noul(instructions={"ask": "leaving?"})}, 200),
        ("/decide", {**s, **noul(instructions=True)}, 422),
        ("/decide", {**s, **noul(instructions="  ")}, 422),
        ("/decide", {**s, **noul(instructions=[])}, 422),
        ("/decide", {**s, **qs, "max_len": None, "head_max_len": None, "min_confidence": None}, 200),
        ("/decide", {**s, **qs, "preset": None}, 200),
        ("/decide", {**s, "preset": None}, 422),                                 # nothing to ask
        ("/decide", {**s, "preset": "support-triage"}, 200),
        ("/decide", {**s, "preset": "nope"}, 422),
        ("/decide", {**s, **qs, "preset": "support-triage"}, 422),
        ("/decide", {**s, **qs, "max_len": 0}, 422),
        ("/decide", {**s, **qs, "max_len": 1025}, 422),                          # past bert-tiny's positions
        ("/decide", {**s, **q(bogus=1)}, 422),                                   # unknown question field
        ("/decide", {**s, **q(labels={"false": "n", "true": "y"})}, 422),        # labels are noul's
        ("/decide", {**s, **noul(labels={"false": "n", "true": "y"})}, 200),
        ("/decide", {**s, **noul(criteria={"TRUE": "they say so"})}, 200),
        ("/decide", {**s, **noul(criteria={"maybe": "x"})}, 422),
        ("/decide", {**s, **q(option_order=[1, 0])}, 200),
        ("/decide", {**s, **q(option_order=[0, 0])}, 422),
        ("/decide", {**s, **q(criteria=["only"])}, 200),                         # as the official runtime answers
        ("/decide", {**s, **q(criteria=[])}, 422),
        ("/decide", {**s, **q(criteria=["a", "a"])}, 422),
        ("/decide", {**s, **q(type="score", criteria=["one level"])}, 422),
        ("/decide", {**s, **q(type="score", criteria=["low", "high"])}, 200),
        ("/decide", {**s, "questions": {"q": {"type": "choice", "instructions": "Which?"}}}, 422),
        ("/decide", {**s, "questions": {" ": {"type": "noul", "instructions": "Is it so?"}}}, 422),
        ("/decide", {**s, **qs, "min_confidence": {"bogus": 0.5}}, 422),
        ("/decide", {**s, **qs, "min_confidence": {"choice:3-5": 0.5, "default": 0.2}}, 200),
        ("/decide", {**s, **qs, "min_confidence": {"default": 2}}, 422),
        ("/decide", {**s, "questions": {}}, 422),
        ("/decide", {"state": None, **qs}, 422),
        ("/decide/batch", {"states": [], **qs}, 422),
        ("/decide/batch", {"states": ["a", "b"], "questions": {}}, 422),
        ("/decide/batch", {"states": ["a", {"t": "b"}], **qs, "preset": None}, 200),
        ("/v1/systemone", {**s, **qs, "model": 5, "task": None, "lang": None, "lang_guess": "de"}, 200),
        ("/v1/systemone", {**s, **qs, "task": 5}, 422),
        ("/v1/systemone", {**s, **qs, "lang": 5}, 422),
        ("/v1/systemone", {**s, "questions": {}}, 200),                          # laya-serve answers {} too
        ("/v1/systemone", {**s, **q(bogus=1)}, 422),
        ("/v1/systemone/batch", {"states": ["a"], **qs, "batch_size": 2, "sort_by_length": None}, 200),
        ("/v1/systemone/batch", {"states": ["a"], **qs, "batch_size": "x"}, 422),
        ("/v1/systemone/batch", {"states": ["a"], **qs, "batch_size": 0}, 422),
        ("/v1/systemone/batch", {"states": ["a"], **qs, "batch_size": True}, 422),
        ("/v1/systemone/batch", {"states": ["a"], **qs, "sort_by_length": "yes"}, 422),
    ]
    agrees(server.url, cases)


@pytest.mark.slow
def test_a_students_document_describes_the_student(student_folder, tmp_path):
    """Under --student the document offered a Laya model's budgets (max_len up to 8192, "laya-mini: 512") and any
    question, which the student refuses: it offers the student's own questions, as distilled, and no budgets."""
    server = ServerProcess(tmp_path / "serve.log", ["--student", str(student_folder)]).running()
    try:
        own = STUDENT_TASK["questions"]
        churn = {"churn": own["churn"]}
        s = {"state": BILLING_STATE}
        cases = [
            ("/decide", s, 200),
            ("/decide", {**s, "questions": churn}, 200),
            ("/decide", {**s, "questions": ["churn", "department"]}, 200),
            ("/decide", {**s, "questions": None}, 200),
            ("/decide", {**s, "questions": {}}, 422),
            ("/decide", {**s, "questions": {"churn": 5}}, 422),
            ("/decide", {**s, "questions": {"churn": {**own["churn"], "instructions": "Leaving?"}}}, 422),
            ("/decide", {**s, "questions": {"urgency": {"type": "noul", "instructions": "Urgent?"}}}, 422),
            ("/decide", {**s, "max_len": 32}, 422),
            ("/decide", {**s, "head_max_len": 32}, 422),
            ("/decide", {**s, "preset": "support-triage"}, 422),                 # not its questions
            ("/decide", {**s, "min_confidence": 0.5}, 200),
            ("/decide/batch", {"states": ["a", "b"], "questions": churn}, 200),
            ("/v1/systemone", {**s, "questions": churn, "model": "x"}, 200),
            ("/v1/systemone", {**s, "questions": churn, "max_len": 32}, 422),
        ]
        agrees(server.url, cases)
        doc = requests.get(server.url + "/openapi.json", timeout=10).json()
        assert "laya-mini" not in json.dumps(doc["components"]["schemas"]["DecideRequest"])
    finally:
        server.stop()
