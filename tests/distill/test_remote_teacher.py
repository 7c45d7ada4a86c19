"""`distill.remote_teacher`: a real `pagoda serve` of the tiny teacher answers deferred questions over HTTP exactly as
the same teacher in this process does; a server that is gone, slow, refusing or talking nonsense leaves the
student's answers and says why."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import requests
from distill_support import DEFER_STATES as STATES
from distill_support import TASK, pagoda, torch_threads

from distill.deferral import Deferral, parse_below, recorded_teacher
from distill.remote_teacher import DIGEST_HEADER, RemoteTeacher
from distill.runtime import Student
from laya.errors import InputError
from laya.layout import answers_digest

REPO = Path(__file__).resolve().parents[2]
KEY = "remote-teacher-key"
QUESTIONS = list(TASK["questions"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def teacher_url(distill_inputs, tmp_path_factory):
    """The teacher behind `pagoda serve`, with an API key (and the default limit of 64 states a request)."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGODA_")}
    env.update({"HF_HUB_OFFLINE": "1", "PAGODA_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1",
                "PAGODA_GENERATE_MODEL": "none", "PAGODA_API_KEY": KEY})
    log = open(tmp_path_factory.mktemp("teacher-server") / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "serving.cli", "serve", "--model", str(distill_inputs["teacher"]),
                             "--host", "127.0.0.1", "--port", str(port)],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if requests.get(url + "/ready", headers={"Authorization": f"Bearer {KEY}"}, timeout=5).status_code == 200:
                break
        except requests.ConnectionError:
            pass
        assert proc.poll() is None, "the teacher server exited"
        time.sleep(0.1)
    else:
        raise AssertionError("the teacher server never became ready")
    yield url
    proc.terminate()
    proc.wait(timeout=30)
    log.close()


@pytest.fixture(scope="module")
def pair(student_dir, distill_inputs):
    import laya

    with torch_threads(1):
        yield Student(student_dir, threads=1), laya.load(distill_inputs["teacher"], threads=1)


def _below(student: Student) -> dict[str, float]:
    """One threshold between the student's confidences per question, so each question has both kinds."""
    alone = student.predict_batch(STATES)
    return {q: float(np.median([r["answers"][q]["answer_confidence"] for r in alone])) for q in QUESTIONS}


def test_the_server_answers_as_the_teacher_here_does(pair, teacher_url):
    """Same answers, same usage, bit for bit, with the states split over requests of 2."""
    student, teacher = pair
    below = _below(student)
    remote = RemoteTeacher(teacher_url, api_key=KEY, max_states=2)
    here = student.predict_batch(STATES, defer=Deferral(teacher, below))
    there = student.predict_batch(STATES, defer=Deferral(remote, below))
    assert there == here
    assert all(r["usage"]["deferral_error"] is None for r in there)
    assert 0 < sum(len(r["usage"]["deferred_questions"]) for r in there) < len(STATES) * len(QUESTIONS)
    assert remote.describe() == {"url": teacher_url, "model": None, "timeout_s": 10.0, "max_states": 2,
                                 "cooldown_s": 5.0, "teacher_digest": None, "teacher_check": "off"}  # no key


def test_only_the_student_s_own_teacher_is_taken(pair, teacher_url, distill_inputs):
    """The server names its checkpoint with every decision (and in /v1/models); given the digest the student
    recorded, the teacher's answers are taken, and another checkpoint's are refused like a failed call: a server
    redeployed with another model under the same URL must not answer as if it had taught the student."""
    student, teacher = pair
    recorded = recorded_teacher(student.meta)
    assert recorded == answers_digest(distill_inputs["teacher"])
    auth = {"Authorization": f"Bearer {KEY}"}
    r = requests.post(teacher_url + "/v1/systemone/batch", json={"states": STATES[:1], "questions": TASK["questions"]},
                      headers=auth, timeout=30)
    assert r.status_code == 200 and r.headers[DIGEST_HEADER] == recorded
    listed = requests.get(teacher_url + "/v1/models", headers=auth, timeout=10).json()["data"]
    assert [m["answers_digest"] for m in listed if m["kind"] == "laya"] == [recorded]

    below = _below(student)
    own = RemoteTeacher(teacher_url, api_key=KEY, teacher_digest=recorded)
    assert own.describe()["teacher_check"] == "not asked yet"
    there = student.predict_batch(STATES, defer=Deferral(own, below))
    assert there == student.predict_batch(STATES, defer=Deferral(teacher, below))
    assert own.describe()["teacher_check"] == "the student's teacher"

    other = RemoteTeacher(teacher_url, api_key=KEY, teacher_digest="0123456789abcdef", cooldown_s=60)
    out = student.predict_batch(STATES, defer=Deferral(other, parse_below(1, QUESTIONS)))
    _student_kept(student, STATES, out, f"answers digest {recorded}, not the student's teacher (0123456789abcdef)")
    assert other.describe()["teacher_check"] == f"refused: answers digest {recorded}"
    again = student.predict_batch(STATES[:1], defer=Deferral(other, parse_below(1, QUESTIONS)))
    assert "not asked again" in again[0]["usage"]["deferral_error"]   # paused, as for a server that is down


def test_request_threads_share_one_remote_teacher(pair, teacher_url):
    """A server defers from many request threads at once through one RemoteTeacher: each gets its own answers."""
    from concurrent.futures import ThreadPoolExecutor

    student, _ = pair
    d = Deferral(RemoteTeacher(teacher_url, api_key=KEY), parse_below(1, QUESTIONS))
    want = student.predict_batch(STATES, defer=d)
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda state: student.predict(state, defer=d), STATES * 4))
    assert got == want * 4
    assert all(r["usage"]["deferral_error"] is None for r in got)


def _student_kept(student: Student, states: list, out: list[dict], words: str) -> None:
    """Every answer is the student's own, and every state that had an unsure answer says why it was not deferred."""
    alone = student.predict_batch(states)
    for mine, got in zip(alone, out):
        assert got["answers"] == {q: {**a, "answered_by": "student"} for q, a in mine["answers"].items()}
        assert got["usage"]["deferred_questions"] == [] and got["usage"]["teacher_input_tokens"] == 0
        assert words in got["usage"]["deferral_error"], got["usage"]["deferral_error"]


@pytest.mark.parametrize("kwargs, words", [
    ({"api_key": KEY, "max_states": 70}, "HTTP 422: too many states (66 > 64, --max-states"),   # over the server's limit
    ({"api_key": "wrong"}, "HTTP 401"),
    ({}, "HTTP 401"),
])
def test_a_refusing_server_leaves_the_student_s_answers(pair, teacher_url, kwargs, words):
    student, _ = pair
    states = STATES * 11
    out = student.predict_batch(states, defer=Deferral(RemoteTeacher(teacher_url, **kwargs), parse_below(1, QUESTIONS)))
    _student_kept(student, states, out, words)
    assert out[0]["usage"]["deferral_error"].startswith(f"{teacher_url}/v1/systemone/batch: ")


def test_no_server_leaves_the_student_s_answers(pair):
    student, _ = pair
    url = f"http://127.0.0.1:{_free_port()}"   # nothing listens there
    out = student.predict_batch(STATES, defer=Deferral(RemoteTeacher(url), parse_below(1, QUESTIONS)))
    _student_kept(student, STATES, out, "refused")


def test_a_slow_server_costs_at_most_the_timeout(pair, canned_http):
    student, _ = pair
    url = canned_http(3.0, b"{}")
    t0 = time.monotonic()
    out = student.predict_batch(STATES, defer=Deferral(RemoteTeacher(url, timeout_s=0.3), parse_below(1, QUESTIONS)))
    assert time.monotonic() - t0 < 2.5   # one request, one timeout: no retries
    _student_kept(student, STATES, out, "Timeout")


def _timed_error(student: Student, teacher: RemoteTeacher) -> tuple[float, str]:
    t0 = time.monotonic()
    out = student.predict(STATES[0], defer=Deferral(teacher, parse_below(1, QUESTIONS)))
    return time.monotonic() - t0, out["usage"]["deferral_error"]


def test_a_server_that_seems_down_is_not_asked_again_for_the_cooldown(pair, canned_http):
    """After a timeout the next unsure answers stay the student's at once, with the same reason; with no cooldown
    each call waits again. A 5xx opens the cooldown too; a 4xx (a request the server refuses) does not."""
    student, _ = pair
    slow = canned_http(3.0, b"{}")
    first = _timed_error(student, RemoteTeacher(slow, timeout_s=0.3, cooldown_s=60))
    cooled = RemoteTeacher(slow, timeout_s=0.3, cooldown_s=60)
    _timed_error(student, cooled)
    took, why = _timed_error(student, cooled)
    assert took < first[0] and "Timeout" in why and "not asked again for" in why, (took, first, why)
    uncooled = RemoteTeacher(slow, timeout_s=0.3, cooldown_s=0)
    _timed_error(student, uncooled)
    took, why = _timed_error(student, uncooled)
    assert took >= 0.3 and "not asked again" not in why
    busy = RemoteTeacher(canned_http(0.0, json.dumps({"error": {"message": "server busy"}}).encode(), 503))
    assert "HTTP 503: server busy" in _timed_error(student, busy)[1]
    assert "not asked again" in _timed_error(student, busy)[1]
    refusing = RemoteTeacher(canned_http(0.0, json.dumps({"error": "no"}).encode(), 422))
    assert _timed_error(student, refusing)[1].endswith("HTTP 422: no")
    assert "not asked again" not in _timed_error(student, refusing)[1]


def test_a_deadline_bounds_the_call_and_pauses_nothing(pair, canned_http):
    """A caller's deadline (a server's request timeout) cuts the wait short of `timeout_s`; that says nothing about
    the server, so the next call asks again. A deadline already past asks nothing."""
    import time as clock

    from distill.deferral import apply_deferral
    from distill.remote_teacher import TeacherUnavailable

    student, _ = pair
    slow = canned_http(3.0, b"{}")
    teacher = RemoteTeacher(slow, timeout_s=30, cooldown_s=60)
    churn = {"churn": TASK["questions"]["churn"]}
    for _ in range(2):
        with pytest.raises(TeacherUnavailable, match=r"no answer in the 0\.[0-4]\d s left before the request's"):
            teacher.predict_batch(STATES[:1], churn, deadline=clock.monotonic() + 0.4)
    with pytest.raises(TeacherUnavailable, match="not asked, the request's deadline had passed"):
        teacher.predict_batch(STATES[:1], churn, deadline=clock.monotonic() - 1)
    out = student.predict_batch(STATES)
    apply_deferral(Deferral(teacher, parse_below(1, QUESTIONS)), STATES, out, student.questions,
                   deadline=clock.monotonic() + 0.3)
    _student_kept(student, STATES, out, "before the request's deadline")


@pytest.mark.parametrize("body, words", [
    (b"not json", "is not 6 results"),
    (json.dumps({"results": []}).encode(), "is not 6 results"),
    (json.dumps({"results": [{"answers": {"department": {}}}] * 6}).encode(), "answering ['churn', 'department'"),
])
def test_a_body_that_is_not_answers_leaves_the_student_s(pair, canned_http, body, words):
    student, _ = pair
    out = student.predict_batch(STATES, defer=Deferral(RemoteTeacher(canned_http(0.0, body)), parse_below(1, QUESTIONS)))
    _student_kept(student, STATES, out, words)


def _drop_probabilities(answer: dict) -> None:
    answer.pop("probabilities", None)
    answer.pop("noul", None)


@pytest.mark.parametrize("edit, words", [
    # fields gone: clients would get answers without them, as the teacher's
    (_drop_probabilities, "no probabilities of its options"),
    # a confidence that is not a number: a request with min_confidence then failed with a 500
    (lambda a: a.update(answer_confidence="high"), "answer_confidence 'high'"),
    (lambda a: a.update(type="score"), "type 'score'"),
])
def test_answers_that_are_not_laya_s_leave_the_student_s(pair, canned_http, edit, words):
    student, teacher = pair
    results = teacher.predict_batch(STATES, TASK["questions"])
    for r in results:
        edit(r["answers"]["department"])
    body = json.dumps({"results": results}).encode()
    out = student.predict_batch(STATES, defer=Deferral(RemoteTeacher(canned_http(0.0, body)), parse_below(1, QUESTIONS)))
    _student_kept(student, STATES, out, words)


def test_a_student_server_is_not_taken_for_a_teacher(pair, canned_http):
    """pagoda's own student servers name no answers digest, as laya-serve does; their answers (the student's
    own) came back marked as the teacher's."""
    student, _ = pair
    results = [{**r, "model": "student:triage"} for r in student.predict_batch(STATES)]
    body = json.dumps({"results": results}).encode()
    out = student.predict_batch(STATES, defer=Deferral(RemoteTeacher(canned_http(0.0, body)), parse_below(1, QUESTIONS)))
    _student_kept(student, STATES, out, "a distilled student (student:triage)")


def test_bench_times_the_remote_deferral_beside_the_local_one(student_dir, distill_inputs, teacher_url, monkeypatch):
    """`pagoda bench distill --defer-below 1 --defer-to URL`: both rows, both agreeing with the teacher (the server
    runs the same one); a server that refuses stops the bench with its reason."""
    monkeypatch.setenv("PAGODA_DEFER_API_KEY", KEY)
    proc = pagoda("bench", "distill", "--student", str(student_dir), "--teacher", str(distill_inputs["teacher"]),
                  "--singles", "3", "--defer-below", "1", "--defer-to", teacher_url)
    lines = proc.stdout.splitlines()
    for name in ("int8 deferred", "int8 remote"):
        rows = [line for line in lines if line.startswith(name)]
        assert len(rows) == 3 and all(line.rstrip().endswith("x") for line in rows[:2]), proc.stdout
    shares = [line.split() for line in lines if line.startswith("  ")]
    assert len(shares) == 2 * len(QUESTIONS)
    assert shares[:len(QUESTIONS)] == shares[len(QUESTIONS):]   # the same answers, here and over HTTP
    monkeypatch.setenv("PAGODA_DEFER_API_KEY", "wrong")
    bad = pagoda("bench", "distill", "--student", str(student_dir), "--teacher", str(distill_inputs["teacher"]),
                 "--singles", "3", "--defer-below", "1", "--defer-to", teacher_url, check=False)
    assert bad.returncode == 1 and "HTTP 401" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
    alone = pagoda("bench", "distill", "--student", str(student_dir), "--defer-to", teacher_url, check=False)
    assert alone.returncode == 2 and "--defer-to needs --defer-below" in alone.stderr


@pytest.mark.parametrize("url, kwargs, words", [
    ("localhost:8000", {}, "expected an http(s) URL"),
    ("ftp://host/", {}, "expected an http(s) URL"),
    ("http://", {}, "expected an http(s) URL"),
    ("http://host:8000", {"timeout_s": 0}, "timeout must be positive"),
    ("http://host:8000", {"max_states": 0}, "max_states must be a positive integer"),
    ("http://host:8000", {"cooldown_s": -1}, "cooldown must be 0 or more"),
])
def test_a_bad_setting_is_refused_by_name(url, kwargs, words):
    with pytest.raises(InputError, match="defer_to") as err:
        RemoteTeacher(url, **kwargs)
    assert words in str(err.value) and err.value.field == "defer_to"


def test_only_an_unavailable_teacher_is_caught(pair):
    """Anything else a teacher raises is a bug and reaches the caller."""
    student, _ = pair

    class Broken:
        def predict_batch(self, states, questions, **budgets):
            raise KeyError("a bug")

    with pytest.raises(KeyError):
        student.predict_batch(STATES, defer=Deferral(Broken(), parse_below(1, QUESTIONS)))
