"""Configuration: flags over `PAGODA_*` variables over defaults; bad values name the flag and variable;
startup refuses a broken presets or policy file by name (the real CLI, before any model loads)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from serving_support import REPO

from serving.config import ServeConfig


def test_precedence():
    env = {"PAGODA_PORT": "9001", "PAGODA_BATCHING": "false", "PAGODA_MAX_WAIT_MS": "7.5", "PAGODA_API_KEY": "k"}
    cfg = ServeConfig.from_sources({"port": 9002, "batching": None}, env=env)
    assert (cfg.port, cfg.batching, cfg.max_wait_ms, cfg.api_key) == (9002, False, 7.5, "k")
    assert ServeConfig.from_sources({}, env={}).port == 8000


@pytest.mark.parametrize("env,needle", [
    ({"PAGODA_PORT": "eighty"}, "PAGODA_PORT must be int"),
    ({"PAGODA_BATCHING": "maybe"}, "PAGODA_BATCHING must be a boolean"),
    ({"PAGODA_MAX_QUEUE": "0"}, "--max-queue / PAGODA_MAX_QUEUE must be at least 1"),
    ({"PAGODA_MAX_QUEUE": "8"}, "must be at least --max-states"),
    ({"PAGODA_REQUEST_TIMEOUT_S": "0"}, "PAGODA_REQUEST_TIMEOUT_S must be positive"),
])
def test_bad_values_name_the_setting(env, needle):
    with pytest.raises(ValueError, match=needle):
        ServeConfig.from_sources({}, env=env)


def test_serve_refuses_bad_files(tmp_path):
    (tmp_path / "policy.yaml").write_text("escalate: churn_risk.noul >> 0.7\n")
    (tmp_path / "presets.yaml").write_text("triage:\n  q: {type: choice, instructions: Which one}\n")
    for flag, needle in (("--policy", "rule 'escalate'"), ("--presets", "preset 'triage'")):
        proc = subprocess.run([sys.executable, "-m", "serving.cli", "serve", "--model", str(tmp_path), flag,
                               str(tmp_path / f"{flag[2:]}.yaml")], cwd=REPO, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode != 0 and needle in proc.stderr, proc.stderr
