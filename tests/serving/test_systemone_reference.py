"""`/v1/systemone(/batch)` against the official `laya-serve` (laya 0.4.15, the runtime the goldens come from),
both serving the same checkpoint: every answer field, `x_jev_confidence` included (choice and score, 2 to 12
options, a permuted option order), and the batch route's results and total usage.

The official server lives in `.refvenv` (`make test` and `make fixtures` build it), so a bare `pytest` without it
skips this file. It runs from /tmp: the official package is also imported as `laya`.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import requests
from serving_support import BILLING_STATE, REPO, TINY_BERT, free_port

LAYA_SERVE = REPO / ".refvenv/bin/laya-serve"
pytestmark = pytest.mark.skipif(not LAYA_SERVE.exists(), reason=".refvenv (the official laya-serve) is not built: "
                                                                "`make test` builds it")

TWELVE = ["red", "green", "blue", "yellow", "cat", "dog", "bird", "fish", "one", "two", "three", "four"]
QUESTIONS = {
    "department": {"type": "choice", "instructions": "Which department should handle this message?",
                   "criteria": {"billing": "invoices, payments, refunds", "technical": "bugs, outages",
                                "other": "everything else"}},
    "two": {"type": "choice", "instructions": "Positive or negative?", "criteria": ["positive", "negative"]},
    "twelve": {"type": "choice", "instructions": "Which word fits the message best?", "criteria": TWELVE},
    "seven": {"type": "choice", "instructions": "Which weekday?", "criteria": ["mon", "tue", "wed", "thu", "fri",
                                                                             "sat", "sun"]},
    "urgency": {"type": "score", "instructions": "How urgent is this message?",
                "criteria": ["not urgent", "soon", "blocking"]},
    "anger": {"type": "score", "instructions": "Rate the anger",
              "criteria": ["none", "low", "some", "medium", "high", "very high", "furious"]},
    "ordered": {"type": "score", "instructions": "How sure?", "criteria": ["no", "maybe", "likely", "yes"],
                "option_order": [3, 1, 0, 2]},
    "churn_risk": {"type": "noul", "instructions": "Does the user threaten to cancel or leave?"},
}
STATES = [BILLING_STATE, "The server is down again and we cannot log in.",
          {"customer": "ACME", "text": "Der Kunde möchte kündigen"},
          ["user: hello", "assistant: how can I help?", "user: my invoice is wrong, I was charged twice"], ""]


@pytest.fixture(scope="module")
def official(tmp_path_factory):
    port = free_port()
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "LAYA_HOST": "127.0.0.1",
           "LAYA_PORT": str(port), "LAYA_THREADS": "1", "LAYA_DEVICE": "cpu", "LAYA_MODELS": "tiny",
           "LAYA_DEFAULT_MODEL": "tiny", "LAYA_EXTRA_MODELS": json.dumps({"tiny": str(TINY_BERT)})}
    log = tmp_path_factory.mktemp("laya-serve") / "laya-serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(LAYA_SERVE)], cwd="/tmp", env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"laya-serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if requests.get(url + "/health", timeout=5).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"laya-serve did not come up:\n{log.read_text()[-3000:]}")
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _post(url: str, path: str, body: dict) -> dict:
    r = requests.post(url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def assert_same_answers(ours: dict, theirs: dict) -> None:
    """Every field the official server answers, equal to the last printed digit; noul has no x_jev."""
    assert list(ours) == list(theirs)
    for name, expected in theirs.items():
        assert ours[name] == expected, name
        assert ("x_jev_confidence" in expected) == (expected["type"] != "noul")


def assert_same_usage(ours: dict, theirs: dict) -> None:
    shared = set(ours) & set(theirs)
    assert {"input_tokens", "output_tokens"} <= shared
    assert {k: ours[k] for k in shared} == {k: theirs[k] for k in shared}


@pytest.mark.parametrize("i", range(len(STATES)))
def test_systemone_matches_laya_serve(server, official, i):
    body = {"state": STATES[i], "questions": QUESTIONS}
    ours = _post(server.url, "/v1/systemone", body)
    theirs = _post(official, "/v1/systemone", {**body, "model": "tiny"})
    assert theirs["routing"]["repo"] == str(TINY_BERT)     # the official server really used our checkpoint
    assert_same_answers(ours["answers"], theirs["answers"])
    assert_same_usage(ours["usage"], theirs["usage"])
    assert ours["model"] == theirs["model"]


def test_systemone_batch_matches_laya_serve(server, official):
    body = {"states": STATES[:4], "questions": QUESTIONS}
    ours = _post(server.url, "/v1/systemone/batch", body)
    theirs = _post(official, "/v1/systemone/batch", {**body, "model": "tiny"})
    assert len(ours["results"]) == len(theirs["results"]) == 4
    for mine, official_result in zip(ours["results"], theirs["results"]):
        assert_same_answers(mine["answers"], official_result["answers"])
        assert_same_usage(mine["usage"], official_result["usage"])
    assert ours["total_usage"] == theirs["total_usage"]


def test_the_comparison_sees_both_confidences_vary(server, official):
    """x_jev_confidence is compared on values that differ between questions and from Laya's own confidence
    (a constant or copied field would make the equality above say little)."""
    theirs = _post(official, "/v1/systemone", {"state": BILLING_STATE, "questions": QUESTIONS, "model": "tiny"})
    jev = [a["x_jev_confidence"] for a in theirs["answers"].values() if "x_jev_confidence" in a]
    assert len(set(jev)) >= 4
    assert any(a["x_jev_confidence"] != a["confidence"] for a in theirs["answers"].values() if a["type"] != "noul")
    assert os.path.samefile(theirs["routing"]["repo"], Path(TINY_BERT))


def test_a_student_defers_to_laya_serve_as_to_its_teacher_here(official, student_folder):
    """`RemoteTeacher` speaks /v1/systemone/batch, so a student can hand its unsure answers to the official server:
    they are the answers its teacher gives in this process, usage included (laya-serve's `x_jev_confidence` is
    dropped). laya-serve names no checkpoint, so its answers are taken unchecked, and the check says so."""
    import laya
    from distill.deferral import Deferral, parse_below, recorded_teacher
    from distill.remote_teacher import RemoteTeacher
    from distill.runtime import Student

    student = Student(student_folder)
    below = parse_below(1, student.questions)
    remote = RemoteTeacher(official, model="tiny", max_states=2, teacher_digest=recorded_teacher(student.meta))
    there = student.predict_batch(STATES, defer=Deferral(remote, below))
    here = student.predict_batch(STATES, defer=Deferral(laya.load(str(TINY_BERT), threads=1), below))
    assert there == here
    assert all(r["usage"]["deferral_error"] is None for r in there)
    assert remote.describe()["teacher_check"] == "unchecked: the server names no answers digest"  # laya-serve's
    assert sum(len(r["usage"]["deferred_questions"]) for r in there) >= len(STATES)
