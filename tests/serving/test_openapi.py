"""`/openapi.json` stays true: it documents exactly the routes the app serves, and real responses from a
running server validate against its schemas (a small JSON-schema subset checker below)."""

from __future__ import annotations

import requests
from serving_support import BILLING_STATE, TINY_BERT, routes_served_and_documented

from serving.app import create_app
from serving.config import ServeConfig
from serving.decide.backend import LayaBackend
from serving.decide.config import DecideConfig
from serving.decide.routes import DecideApi


def check(value, schema: dict, doc: dict, where: str = "$") -> None:
    """The JSON-schema subset the document uses: $ref, type, enum, oneOf, required, properties,
    additionalProperties, items, min/max(Items|Properties|Length|imum)."""
    if "$ref" in schema:
        return check(value, doc["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]], doc, where)
    if "oneOf" in schema:
        matches = 0
        for option in schema["oneOf"]:
            try:
                check(value, option, doc, where)
                matches += 1
            except AssertionError:
                pass
        assert matches == 1, f"{where}: matches {matches} of oneOf"
    kinds = {"object": dict, "array": list, "string": str, "integer": int, "number": (int, float),
             "boolean": bool, "null": type(None)}
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        ok = any(isinstance(value, kinds[t]) and not (t in ("integer", "number") and isinstance(value, bool))
                 for t in types)
        assert ok, f"{where}: {value!r:.80} is not {types}"
    if "enum" in schema:
        assert value in schema["enum"], f"{where}: {value!r} not in {schema['enum']}"
    if isinstance(value, dict):
        for key in schema.get("required", []):
            assert key in value, f"{where}: missing required {key!r}"
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            if key in props:
                check(item, props[key], doc, f"{where}.{key}")
            elif extra is False:
                raise AssertionError(f"{where}: undocumented property {key!r}")
            elif isinstance(extra, dict):
                check(item, extra, doc, f"{where}.{key}")
        assert len(value) <= schema.get("maxProperties", len(value))
    if isinstance(value, list):
        assert schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)), where
        for i, item in enumerate(value):
            check(item, schema.get("items", {}), doc, f"{where}[{i}]")


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

    def request_schema(path):
        return doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]

    calls = [
        ("/decide", {"state": BILLING_STATE, "questions": billing_questions, "min_confidence": 0.5}),
        ("/decide", {"state": {"message": BILLING_STATE}, "preset": "support-triage"}),
        ("/decide/batch", {"states": [BILLING_STATE, "other"], "questions": billing_questions}),
        ("/v1/systemone", {"state": BILLING_STATE, "questions": billing_questions, "model": "jev-1"}),
        ("/v1/systemone/batch", {"states": [BILLING_STATE], "questions": billing_questions}),
    ]
    for path, body in calls:
        check(body, request_schema(path), doc, f"request {path}")
        r = requests.post(server.url + path, json=body, timeout=60)
        assert r.status_code == 200, r.text
        check(r.json(), response_schema(path, "post", 200), doc, f"response {path}")
    bad = requests.post(server.url + "/decide", json={"questions": {}}, timeout=10)
    check(bad.json(), response_schema("/decide", "post", 422), doc, "422")
    for path in ("/health", "/ready", "/v1/models", "/stats", "/openapi.json"):
        r = requests.get(server.url + path, timeout=10)
        assert r.status_code == 200
        check(r.json(), response_schema(path, "get", 200), doc, path)
