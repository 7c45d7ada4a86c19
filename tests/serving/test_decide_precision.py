"""`--precision`: validated by name, honoured by a real server, and int8 and bf16 batches stay bit-identical to
alone."""

from __future__ import annotations

import numpy as np
import pytest
import requests
from serving_support import BILLING_STATE, TINY_BERT, ServerProcess

import laya
from laya.testing import packed_bf16_agent
from serving.decide.backend import LayaBackend
from serving.decide.config import DecideConfig
from serving.decide.routes import DecideApi


def test_precision_setting_is_checked_and_read_from_the_environment():
    with pytest.raises(ValueError, match="--precision / PAGODA_PRECISION must be one of exact, int8, bf16, fast"):
        DecideConfig(precision="half")
    assert DecideConfig.from_sources({}, {"PAGODA_PRECISION": "int8"}).precision == "int8"
    assert DecideConfig.from_sources({"precision": "exact"}, {"PAGODA_PRECISION": "int8"}).precision == "exact"


@pytest.mark.parametrize("precision", ["int8", "bf16"])
def test_batches_equal_alone(billing_questions, precision):
    """What the batcher runs for a batch (`LayaBackend.run` over many requests' units) against each alone."""
    agent = laya.load(TINY_BERT, precision="int8") if precision == "int8" else packed_bf16_agent(TINY_BERT)
    backend = LayaBackend(agent, "tiny")
    work = [backend.prepare(f"{BILLING_STATE[: 12 + 9 * i]} #{i}", billing_questions, {}) for i in range(10)]
    together = backend.run(work)
    for unit, outputs in zip(work, together):
        for got, alone in zip(outputs, backend.run([unit])[0]):
            assert np.array_equal(got.logits, alone.logits)
            assert np.array_equal(got.act_probabilities, alone.act_probabilities)


def test_health_part_reports_cpu_and_engine():
    api = DecideApi(DecideConfig(presets=""), 30.0, backend=LayaBackend(laya.load(TINY_BERT, precision="int8"), "tiny"))
    api.start(__import__("prometheus_client").CollectorRegistry())
    part = api.health()["decide"]
    assert part["cpu"]["flags"] is not None and part["engine"]["precision"] == "int8"
    assert api.stats()["decision_engine"]["backend"] == "onnxruntime"


def test_server_answers_at_the_precision_it_was_given(tmp_path, billing_questions):
    server = ServerProcess(tmp_path / "int8.log", ["--model", str(TINY_BERT), "--precision", "int8"]).running()
    try:
        engine = requests.get(server.url + "/stats", timeout=10).json()["decision_engine"]
        assert engine["precision"] == "int8" and engine["requested"] == "int8"
        got = requests.post(server.url + "/decide", json={"state": BILLING_STATE, "questions": billing_questions},
                            timeout=60).json()
        assert got["answers"] == laya.load(TINY_BERT, precision="int8").predict(BILLING_STATE, billing_questions)["answers"]
    finally:
        server.stop()


@pytest.mark.parametrize("flags, env, served", [
    ([], "int8", ["int8"]),                                    # $PAGODA_PRECISION, as `pagoda serve` reads it
    (["--precision", "exact,int8"], "int8", ["exact", "int8"]),  # the flag wins
])
def test_bench_serve_modes_skip_the_llm_and_read_the_precision(monkeypatch, flags, env, served):
    """`pagoda bench serve`'s servers, from its own parser: no LLM loaded, our precisions from --precision
    else PAGODA_PRECISION, laya-serve (--reference) last."""
    import serving.decide.bench as bench
    from serving.cli import build_parser

    started = []
    monkeypatch.setattr(bench, "ServerProcess", lambda flags: started.append(flags))
    monkeypatch.setattr(bench, "LayaServe", lambda *a: started.append(["laya-serve", *a]))
    monkeypatch.setenv("PAGODA_PRECISION", env)
    args = build_parser().parse_args(["bench", "serve", "--model", str(TINY_BERT), "--reference", "/ref/bin/python",
                                      *flags])
    modes = bench._modes(args, [1, 16])
    assert [name for name, _ in modes] == [f"pagoda {served[0]}, batching off",
                                           *[f"pagoda {p}, batching on" for p in served], "laya-serve 0.4.15 (fp32)"]
    for _, start in modes:
        start()
    for flags, precision in zip(started, [served[0], *served]):
        assert flags[flags.index("--generate-model") + 1] == "none"
        assert flags[flags.index("--precision") + 1] == precision
    assert started[-1][:2] == ["laya-serve", "/ref/bin/python"]


def test_bench_serve_workers_give_every_server_the_same_cores(monkeypatch):
    """`--workers W --torch-threads T`: each pagoda server runs W processes of T model threads, and laya-serve
    (one process) gets W x T threads, so both sides compute on as many cores."""
    import serving.decide.bench as bench
    from serving.cli import build_parser

    started = []
    monkeypatch.setattr(bench, "ServerProcess", lambda flags: started.append(flags))
    monkeypatch.setattr(bench, "LayaServe", lambda *a: started.append(["laya-serve", *a]))
    args = build_parser().parse_args(["bench", "serve", "--model", str(TINY_BERT), "--reference", "/ref/bin/python",
                                      "--workers", "2", "--torch-threads", "1", "--precision", "bf16"])
    for _, start in bench._modes(args, [16]):
        start()
    for flags in started[:-1]:
        assert flags[flags.index("--workers") + 1] == "2" and flags[flags.index("--torch-threads") + 1] == "1"
    assert started[-1][:4] == ["laya-serve", "/ref/bin/python", str(TINY_BERT), 2]


@pytest.mark.skipif(not __import__("laya.precision").precision.detect().bf16_units,
                    reason="bf16 is served only on a CPU with AMX-BF16 or AVX512-BF16")
def test_server_answers_bf16_packed(tmp_path, billing_questions):
    server = ServerProcess(tmp_path / "bf16.log", ["--model", str(TINY_BERT), "--precision", "fast"]).running()
    try:
        engine = requests.get(server.url + "/stats", timeout=10).json()["decision_engine"]
        assert (engine["precision"], engine["requested"], engine["rows_per_forward"]) == ("bf16", "fast", "packed")
        got = requests.post(server.url + "/decide", json={"state": BILLING_STATE, "questions": billing_questions},
                            timeout=60).json()
        assert got["answers"] == laya.load(TINY_BERT, precision="bf16").predict(BILLING_STATE, billing_questions)["answers"]
    finally:
        server.stop()
