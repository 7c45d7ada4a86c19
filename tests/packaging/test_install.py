"""pagoda installs as users install it: a built wheel in fresh venvs, never the editable checkout.

- The base install is the edge's: a distilled student answers, in-process and behind `pagoda serve
  --student`, in a venv where torch cannot even be found.
- `pagoda[all]` (non-editable) answers `pagoda decide` on a fixture checkpoint and assembles the
  embedded laya-mini from the head it ships as package data, run from a folder with no sources.

Slow: each venv installs its dependencies from the package registry (a minute or two).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "laya" / "bert-tiny"
pytestmark = pytest.mark.slow

TASK = {
    "name": "edge-triage", "text_field": "text",
    "questions": {
        "department": {"type": "choice", "instructions": "Which department should handle this ticket?",
                       "criteria": {"billing": "invoices, payments, refunds", "technical": "bugs, outages",
                                    "other": "everything else"}},
        "churn": {"type": "noul", "instructions": "Does the user threaten to cancel or leave?"},
    },
    "gold": {"department": "department", "churn": "churn"},
    "labels": {"chunk_rows": 40, "batch_size": 16, "threads": 1},
    "split": {"holdout": 0.25, "validation": 0.15},
    "student": {"layers": 1, "epochs": 1, "max_len": 48, "batch_size": 16, "threads": 1, "baseline": False},
    "export": {"check_rows": 8},
    "report": {"singles": 1, "teacher_singles": 1, "batches": 1, "batch_size": 2},
}
STATES = ["We were billed twice, refund or we cancel.", "The login page shows error 500 since this morning."]


def run(cmd: list[str], cwd: Path | str, env: dict | None = None, timeout: int = 900) -> str:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def venv(path: Path, *requirements: str) -> Path:
    """A fresh venv (not the project's) with `requirements` installed from the registry."""
    run([sys.executable, "-m", "venv", str(path)], cwd=path.parent)
    run([str(path / "bin" / "python"), "-m", "pip", "install", "-q", *requirements], cwd=path.parent)
    return path / "bin"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT)],
        cwd=ROOT)
    (built,) = out.glob("pagoda-*.whl")
    return built


@pytest.fixture(scope="module")
def student(tmp_path_factory) -> Path:
    from distill.corpus import write_corpus

    d = tmp_path_factory.mktemp("edge-student")
    (d / "task.yaml").write_text(yaml.safe_dump(TASK, sort_keys=False))
    data = write_corpus(d / "tickets.jsonl", 60, seed=11)
    out = d / "edge-triage"
    run([sys.executable, "-m", "serving.cli", "distill", "--teacher", str(FIXTURE), "--task", str(d / "task.yaml"),
         "--data", str(data), "--out", str(out), "--no-progress"], cwd=ROOT)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def _wait_ready(server: subprocess.Popen, port: int, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{what} did not start:\n" + server.stderr.read()[-3000:]) from None
            time.sleep(0.3)


def test_base_install_runs_and_serves_a_student_without_torch(wheel, student, tmp_path):
    """...and hands its unsure answers to a teacher on a server (the checkpoint it was distilled from, served from
    the project's venv): in process and behind `pagoda serve --defer-to`, still without torch."""
    import laya
    from distill.deferral import Deferral, parse_below
    from distill.runtime import Student

    teacher_port = _free_port()
    teacher = subprocess.Popen([sys.executable, "-m", "serving.cli", "serve", "--model", str(FIXTURE),
                                "--port", str(teacher_port)], cwd=ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PAGODA_GENERATE_MODEL": "none", "PAGODA_TORCH_THREADS": "1",
                                    "HF_HUB_OFFLINE": "1"})
    server = None
    try:
        bin_dir = venv(tmp_path / "edge", str(wheel))
        _wait_ready(teacher, teacher_port, "the teacher server")
        teacher_url = f"http://127.0.0.1:{teacher_port}"
        script = ("import importlib.util, json, sys\n"
                  "assert importlib.util.find_spec('torch') is None, 'torch is installed in the edge venv'\n"
                  "assert importlib.util.find_spec('transformers') is None\n"
                  "from distill.deferral import Deferral, parse_below\n"
                  "from distill.remote_teacher import RemoteTeacher\n"
                  "from distill.runtime import Student\n"
                  "s = Student(sys.argv[1])\n"
                  "states = json.loads(sys.argv[2])\n"
                  "d = Deferral(RemoteTeacher(sys.argv[3]), parse_below('department=1', s.questions))\n"
                  "print(json.dumps([s.predict_batch(states), s.predict_batch(states, defer=d)]))\n")
        edge, edge_deferred = json.loads(run([str(bin_dir / "python"), "-c", script, str(student),
                                              json.dumps(STATES), teacher_url], cwd=tmp_path))
        here = Student(student).predict_batch(STATES)
        assert [r["answers"] for r in edge] == [r["answers"] for r in here]
        local = Deferral(laya.load(str(FIXTURE), threads=1), parse_below("department=1", TASK["questions"]))
        here_deferred = Student(student).predict_batch(STATES, defer=local)
        assert [r["answers"] for r in edge_deferred] == [r["answers"] for r in here_deferred]
        assert all(r["usage"]["deferred_questions"] == ["department"] for r in edge_deferred)

        port = _free_port()
        server = subprocess.Popen([str(bin_dir / "pagoda"), "serve", "--student", str(student), "--port", str(port),
                                   "--defer-below", "department=1", "--defer-to", teacher_url],
                                  cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        _wait_ready(server, port, "the edge server", timeout=60)
        got = _post(f"http://127.0.0.1:{port}/decide", {"state": STATES[0]})
        assert got["answers"] == here_deferred[0]["answers"]
        assert got["answers"]["churn"]["answered_by"] == "student"
    finally:
        for proc in (server, teacher):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)


def test_all_install_decides_and_builds_the_default_from_package_data(wheel, tmp_path):
    import laya
    from laya.scenarios import load as scenario

    bin_dir = venv(tmp_path / "all", "torch==2.13.0", f"{wheel}[all]")
    cwd = tmp_path / "elsewhere"          # no sources on the path: only the installed package can answer
    cwd.mkdir()
    state, questions = scenario("billing")
    (cwd / "q.json").write_text(json.dumps(questions))
    (cwd / "state.txt").write_text(state)
    out = run([str(bin_dir / "pagoda"), "decide", "--model", str(FIXTURE), "--state", "@state.txt",
               "--questions", "q.json"], cwd=cwd, env={"HF_HUB_OFFLINE": "1"})
    assert json.loads(out)["answers"] == laya.load(str(FIXTURE)).predict(state, questions)["answers"]
    where = run([str(bin_dir / "python"), "-c", "import laya; print(laya.__file__)"], cwd=cwd)
    assert str(ROOT) not in where and "site-packages" in where
    # The bf16 engine's kernels build from the source shipped as package data (into a fresh cache).
    built = run([str(bin_dir / "python"), "-m", "laya.kernels"], cwd=cwd,
                env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert built.startswith("laya.kernels: built ") and str(tmp_path / "cache") in built

    mini = tmp_path / "laya-mini"
    run([str(bin_dir / "pagoda"), "laya-mini", "build", "--out", str(mini)], cwd=cwd, env={"HF_HUB_OFFLINE": "1"})
    assert (mini / "model.safetensors").is_file()
