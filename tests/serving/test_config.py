"""Configuration: flags over `PAGODA_*` variables over defaults; bad values name the flag and variable;
startup refuses a broken presets or policy file by name (the real CLI, before any model loads)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from serving_support import REPO

from serving.config import ServeConfig


def test_precedence():
    env = {"PAGODA_PORT": "9001", "PAGODA_BATCHING": "false", "PAGODA_MAX_WAIT_MS": "7.5", "PAGODA_API_KEY": "k"}
    cfg = ServeConfig.from_sources({"port": 9002, "batching": None}, env=env)
    assert (cfg.port, cfg.decide.batching, cfg.decide.max_wait_ms, cfg.api_key) == (9002, False, 7.5, "k")
    assert ServeConfig.from_sources({}, env={}).port == 8000


@pytest.mark.parametrize("env,needle", [
    ({"PAGODA_PORT": "eighty"}, "PAGODA_PORT must be int"),
    ({"PAGODA_BATCHING": "maybe"}, "PAGODA_BATCHING must be a boolean"),
    ({"PAGODA_MAX_QUEUE": "0"}, "--max-queue / PAGODA_MAX_QUEUE must be at least 1"),
    ({"PAGODA_MAX_QUEUE": "8"}, "must be at least --max-states"),
    ({"PAGODA_REQUEST_TIMEOUT_S": "0"}, "PAGODA_REQUEST_TIMEOUT_S must be positive"),
    # NaN passes every comparison (it was taken, and closed idle connections at once or made every request 408)
    ({"PAGODA_KEEPALIVE_S": "nan"}, "--keepalive-s / PAGODA_KEEPALIVE_S must be a finite number"),
    ({"PAGODA_QUESTION_CACHE_MB": "nan"}, "--question-cache-mb / PAGODA_QUESTION_CACHE_MB must be a finite"),
    ({"PAGODA_DEFER_TIMEOUT_S": "nan"}, "--defer-timeout-s / PAGODA_DEFER_TIMEOUT_S must be a finite"),
    # a duration past what thread and timer waits take: every generation was a 500 (OverflowError)
    ({"PAGODA_GENERATE_DEADLINE_S": "inf"}, "--generate-deadline-s / PAGODA_GENERATE_DEADLINE_S must be a finite"),
    ({"PAGODA_GENERATE_DEADLINE_S": "1e10"}, "PAGODA_GENERATE_DEADLINE_S must be at most 1e\\+06"),
    ({"PAGODA_MAX_WAIT_MS": "1e12"}, "PAGODA_MAX_WAIT_MS must be at most 1e\\+09"),
    # torch took any thread count, then segfaulted or hung starting its pool in the worker
    ({"PAGODA_TORCH_THREADS": "99999"}, "--torch-threads / PAGODA_TORCH_THREADS must be in 0..1024, got 99999"),
    ({"PAGODA_GENERATE_TORCH_THREADS": "99999"}, "PAGODA_GENERATE_TORCH_THREADS must be in 0..1024, got 99999"),
    # gunicorn forked that many workers, each loading its own models, until the machine ran out of memory
    ({"PAGODA_WORKERS": "100000"}, "--workers / PAGODA_WORKERS must be in 1..256, got 100000"),
])
def test_bad_values_name_the_setting(env, needle):
    with pytest.raises(ValueError, match=needle):
        ServeConfig.from_sources({}, env=env)


def test_a_device_torch_cannot_use_names_its_setting(monkeypatch, tmp_path):
    """Refused with the settings, before gunicorn forks or a model loads (both sections; a student's
    `--device` is not checked: it runs on onnxruntime)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for env, needle in (({"PAGODA_DEVICE": "cuda"}, "--device / PAGODA_DEVICE: 'cuda' is not available"),
                        ({"PAGODA_GENERATE_DEVICE": "cuda:1"}, "--generate-device / PAGODA_GENERATE_DEVICE: 'cuda:1' is not available"),
                        ({"PAGODA_DEVICE": "quantum"}, "'quantum' is not a device name")):
        with pytest.raises(ValueError, match=needle):
            ServeConfig.from_sources({}, env=env)
    assert ServeConfig.from_sources({}, env={"PAGODA_GENERATE_DEVICE": "cuda", "PAGODA_GENERATE_MODEL": "none"})
    (tmp_path / "model.onnx").write_bytes(b"")  # a student folder as student.json describes it (nothing loads)
    (tmp_path / "student.json").write_text(json.dumps({
        "format": "pagoda-student/1", "name": "s", "kind": "linear", "questions": {"q": {"type": "noul"}},
        "heads": [{"name": "q"}], "models": {"fp32": "model.onnx"}, "default_precision": "fp32", "max_len": 8}))
    assert ServeConfig.from_sources({"student": str(tmp_path)}, env={"PAGODA_DEVICE": "cuda"}).decide.device == "cuda"


def test_serve_refuses_bad_files(tmp_path):
    (tmp_path / "rl_agent_config.json").write_text("{}")  # a model folder, as far as the settings look
    (tmp_path / "policy.yaml").write_text("escalate: churn_risk.noul >> 0.7\n")
    (tmp_path / "presets.yaml").write_text("triage:\n  q: {type: choice, instructions: Which one}\n")
    for flag, needle in (("--policy", "rule 'escalate'"), ("--presets", "preset 'triage'")):
        proc = subprocess.run([sys.executable, "-m", "serving.cli", "serve", "--model", str(tmp_path), flag,
                               str(tmp_path / f"{flag[2:]}.yaml")], cwd=REPO, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
        assert proc.stderr.startswith("pagoda serve: error: ") and proc.stderr.count("\n") == 1, proc.stderr


def test_serve_refuses_a_worker_count_past_its_bound(monkeypatch, capsys):
    """Checked before gunicorn forks: one line naming the flag, exit 2 (99999 forked until memory ran out)."""
    from serving import server
    from serving.cli import main

    def no_server(*args):
        raise AssertionError("pagoda serve went on to start its workers")

    monkeypatch.setattr(server, "GunicornServer", no_server)
    rc = main(["serve", "--workers", "99999", "--generate-model", "none"])
    err = capsys.readouterr().err
    assert rc == 2 and err == "pagoda serve: error: --workers / PAGODA_WORKERS must be in 1..256, got 99999\n", err
    rc = main(["gateway", "--workers", "99999", "--upstream", "edge=http://127.0.0.1:9"])  # the same bound
    err = capsys.readouterr().err
    assert rc == 2 and err == "pagoda gateway: error: --workers / PAGODA_WORKERS must be in 1..256, got 99999\n", err


def test_an_api_section_gets_its_own_flags_and_variables():
    """How the next API adds settings: a `Settings` dataclass with a prefix; flags, variables, `--help` and
    the errors that name a bad value come from its fields."""
    import argparse
    from dataclasses import dataclass

    from serving.flags import Settings, option, section

    @dataclass
    class Generate(Settings):
        PREFIX = "generate_"
        max_tokens: int = option(16, "most tokens per completion", minimum=1)
        stream: bool = option(False, "stream tokens")

    @dataclass
    class Server(Settings):
        port: int = option(8000, "bind port")
        generate: Generate = section(Generate)

    parser = argparse.ArgumentParser()
    Server.add_arguments(parser)
    flags = vars(parser.parse_args(["--generate-max-tokens", "32"]))
    cfg = Server.from_sources(flags, env={"PAGODA_GENERATE_STREAM": "1", "PAGODA_PORT": "9"})
    assert (cfg.port, cfg.generate.max_tokens, cfg.generate.stream) == (9, 32, True)
    with pytest.raises(ValueError, match="--generate-max-tokens / PAGODA_GENERATE_MAX_TOKENS must be at least 1"):
        Server.from_sources({}, env={"PAGODA_GENERATE_MAX_TOKENS": "0"})
    # the real ServeConfig composes the decision API's section the same way
    assert ServeConfig.from_sources({"max_states": 3}, env={}).decide.max_states == 3


@pytest.mark.parametrize("env,needle", [
    ({"PAGODA_UPSTREAM": "a=http://127.0.0.1:9", "PAGODA_HEALTH_INTERVAL_S": "nan"}, "--health-interval-s"),
    ({"PAGODA_UPSTREAM": "a=http://127.0.0.1:9", "PAGODA_UPSTREAM_TIMEOUT_S": "inf"}, "--upstream-timeout-s"),
])
def test_the_gateway_refuses_durations_that_are_not_finite(env, needle):
    """They were taken: NaN between health checks made thousands a second, an infinite upstream timeout made
    every proxied request a 500."""
    from serving.gateway.config import GatewayConfig

    with pytest.raises(ValueError, match=needle + ".*must be a finite number"):
        GatewayConfig.from_sources({}, env=env)


def test_the_gateway_refuses_a_torch_thread_count_torch_would_crash_on():
    from serving.gateway.config import GatewayConfig

    with pytest.raises(ValueError, match="--torch-threads / PAGODA_TORCH_THREADS must be in 0..1024, got 99999"):
        GatewayConfig.from_sources({}, env={"PAGODA_UPSTREAM": "a=http://127.0.0.1:9", "PAGODA_TORCH_THREADS": "99999"})


@pytest.mark.parametrize("flag,needle", [
    ("--model", "--model / PAGODA_MODEL {}: not a model folder (no rl_agent_config.json)"),
    ("--student", "--student / PAGODA_STUDENT {}: not a student folder (no student.json)"),
    ("--generate-model", "--generate-model / PAGODA_GENERATE_MODEL {}: neither a model folder"),
])
def test_serve_refuses_a_folder_that_holds_no_model(flag, needle, tmp_path):
    """Refused with the settings, exit 2, one line: the worker used to fail to boot on it with a traceback."""
    proc = subprocess.run([sys.executable, "-m", "serving.cli", "serve", flag, str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr == f"pagoda serve: error: {needle.format(tmp_path)}" + (
        " (with config.json) nor a .gguf file\n" if flag == "--generate-model" else "\n"), proc.stderr


def test_serve_refuses_a_max_model_len_past_the_models_positions(tiny_llama, monkeypatch, capsys):
    """It was served (11000 on SmolLM2's 8192 positions, which it was never trained past). Refused where the master
    builds the engine, before gunicorn starts: one line naming the flag and the model's limit, exit 2."""
    import torch

    from serving import server
    from serving.cli import main

    def no_server(*args):
        raise AssertionError("pagoda serve went on to start its workers")

    monkeypatch.setattr(server, "GunicornServer", no_server)
    threads = torch.get_num_threads()
    try:  # the master runs torch on one thread until the fork
        rc = main(["serve", "--generate-only", "--generate-model", str(tiny_llama), "--generate-max-model-len", "1025"])
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err
    assert rc == 2 and err.splitlines()[-1] == (
        "pagoda serve: error: --generate-max-model-len / PAGODA_GENERATE_MAX_MODEL_LEN: 1025 is past the model's "
        "1024 positions (max_position_embeddings; a GGUF's context_length)"), err


def test_laya_and_generation_bound_thread_counts_alike():
    """The two packages cannot share the constant (neither imports the other); a server holds both."""
    from generation.config import MAX_TORCH_THREADS
    from laya.checks import MAX_THREADS

    assert MAX_THREADS == MAX_TORCH_THREADS


@pytest.mark.parametrize("flag,needle", [
    ("--model", "--model / PAGODA_MODEL {}: not a model folder (no rl_agent_config.json)"),
    ("--student", "--student / PAGODA_STUDENT {}: not a student folder (no student.json)"),
])
def test_the_gateway_refuses_a_folder_that_holds_no_decision_model(flag, needle, tmp_path):
    """Refused before it starts, as pagoda serve refuses it: the gateway's worker used to fail to boot on it."""
    proc = subprocess.run([sys.executable, "-m", "serving.cli", "gateway", "--upstream", "a=http://127.0.0.1:9", flag,
                           str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr == f"pagoda gateway: error: {needle.format(tmp_path)}\n", proc.stderr
