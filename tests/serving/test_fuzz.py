"""Schema fuzzing of every route the server documents, against a real `pagoda serve` with both APIs mounted.

schemathesis reads `/openapi.json` (serving/openapi.py plus each API's part) and generates, per operation,
bodies, paths and queries that follow the schema and ones that break it; whatever it sends, the server must
answer below 500, and every error in the project's JSON error shape (or, on the OpenAI-compatible routes,
that shape as their dialect reshapes it). The example count is bounded
(PAGODA_FUZZ_EXAMPLES per operation, default 15) and fixed-seed, so `make test` stays minutes, not hours.
"""

from __future__ import annotations

import json
import os

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from serving_support import TINY_BERT

EXAMPLES = int(os.environ.get("PAGODA_FUZZ_EXAMPLES", "15"))
# The `both` server's limits (tests/serving/conftest.py), so the in-process document is the one it serves; the
# document is needed at collection time, before any server runs (schemathesis's lazy loader fails on pytest 9).
FLAGS = {"model": str(TINY_BERT), "generate_max_new_tokens": 512, "generate_threads": 48, "threads": 96}


def served_document() -> dict:
    from serving import openapi
    from serving.app import build_apis
    from serving.config import ServeConfig

    cfg = ServeConfig.from_sources(FLAGS, env={})
    return openapi.document([api.openapi() for api in build_apis(cfg)], cfg.max_body_bytes, False)


DOCUMENT = served_document()
schema = schemathesis.openapi.from_dict(DOCUMENT)
schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE], max_examples=EXAMPLES,
                                deterministic=True, database="none")


@pytest.fixture(scope="session")
def both(gen_servers):
    """Session-scoped: hypothesis runs many examples in one test call, so the server fixture must outlive it."""
    return gen_servers["both"].running()


def test_the_fuzzed_document_is_the_served_one(both):
    served = requests.get(both.url + "/openapi.json", timeout=10).json()
    assert sorted(served["paths"]) == sorted(DOCUMENT["paths"])
    assert served["components"]["schemas"].keys() == DOCUMENT["components"]["schemas"].keys()


@schema.parametrize()
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
def test_no_route_answers_5xx_and_every_error_is_json(case, both):
    response = case.call(base_url=both.url, timeout=120)
    sent = f"{case.method} {case.formatted_path} body={case.body!r:.300}"
    assert response.status_code < 500, f"{sent} -> {response.status_code} {response.text[:500]}"
    if response.status_code >= 400:
        content_type = response.headers.get("content-type", [""])[0]  # schemathesis: lowercased names, value lists
        assert content_type.startswith("application/json"), f"{sent} -> {response.status_code} {content_type}"
        body = json.loads(response.text)
        error = body["error"]
        assert isinstance(error["message"], str) and error["message"], sent
        assert isinstance(error["type"], str) and error["type"], sent
        # the project's shape carries request_id in the body; the OpenAI dialect's routes (code, param) in the header
        assert "request_id" in body or "code" in error, sent
        assert response.headers.get("x-request-id"), sent
