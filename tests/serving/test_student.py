"""`pagoda serve --student DIR`: a distilled student behind /decide. Slow: it distils a student first
(`student_folder`, conftest: `pagoda distill`, linear kind)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from serving_support import REPO, TINY_BERT, ServerProcess
from serving_support import STUDENT_TASK as TASK

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def student(student_folder, tmp_path_factory):
    server = ServerProcess(tmp_path_factory.mktemp("student-server") / "serve.log", ["--student", str(student_folder)])
    yield student_folder, server.running()
    server.stop()


def test_student_serving(student):
    from distill.runtime import Student

    folder, server = student
    local = Student(folder)
    models = requests.get(server.url + "/v1/models", timeout=10).json()["data"]
    assert models[0]["kind"] == "student" and models[0]["questions"] == sorted(TASK["questions"])
    state = "I was charged twice this month, refund me or I cancel."
    r = requests.post(server.url + "/decide", json={"state": state}, timeout=30)  # no questions: all of its own
    assert r.status_code == 200, r.text
    assert r.json()["answers"] == local.predict(state)["answers"]
    subset = {"churn": TASK["questions"]["churn"]}
    r = requests.post(server.url + "/decide", json={"state": state, "questions": subset}, timeout=30)
    assert list(r.json()["answers"]) == ["churn"] and r.json()["answers"]["churn"] == local.predict(state)["answers"]["churn"]
    states = [state, "The site is down.", {"text": "hello"}]
    r = requests.post(server.url + "/decide/batch", json={"states": states}, timeout=30)
    assert [x["answers"] for x in r.json()["results"]] == [x["answers"] for x in local.predict_batch(states)]
    # questions it was not distilled for are refused, by name
    other = {"urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "high"]}}
    r = requests.post(server.url + "/decide", json={"state": state, "questions": other}, timeout=30)
    assert r.status_code == 422 and "urgency" in r.json()["error"]["message"]
    assert r.json()["error"]["field"] == "questions.urgency"   # named as laya names a question's mistake
    changed = {"churn": 5}                                      # its own name, another definition
    r = requests.post(server.url + "/decide", json={"state": state, "questions": changed}, timeout=30)
    assert r.status_code == 422 and r.json()["error"]["field"] == "questions.churn", r.text
    r = requests.post(server.url + "/decide", json={"state": state, "max_len": 32}, timeout=30)
    assert r.status_code == 422 and r.json()["error"]["field"] == "max_len"
    for bad in (5, "churn", 1.5, [["a"]], True):  # never a 500, nor a string read as its letters
        r = requests.post(server.url + "/decide", json={"state": state, "questions": bad}, timeout=30)
        assert r.status_code == 422 and r.json()["error"]["field"] == "questions", (bad, r.text)
        assert "expected a dict" in r.json()["error"]["message"], r.text
    gate = {"choice:3-5": 0.99, "default": 0.5}  # the gate works over HTTP as in `Student.predict`
    r = requests.post(server.url + "/decide", json={"state": state, "min_confidence": gate}, timeout=30)
    assert r.status_code == 200 and r.json()["answers"] == local.predict(state, min_confidence=gate)["answers"]
    assert "abstention_threshold" in r.json()["answers"]["churn"]
    # presets: those of its own questions are the ones it knows, as /v1/models lists them; one asking others is
    # named as the preset (it was refused as questions.<name>, and "known presets" listed it)
    listed = requests.get(server.url + "/v1/models", timeout=10).json()["presets"]
    assert "support-triage" not in listed
    r = requests.post(server.url + "/decide", json={"state": state, "preset": "support-triage"}, timeout=30)
    assert r.status_code == 422 and r.json()["error"]["field"] == "preset", r.text
    assert "asks questions this student was not distilled for" in r.json()["error"]["message"]
    r = requests.post(server.url + "/decide", json={"state": state, "preset": "no-such"}, timeout=30)
    assert r.status_code == 422 and r.json()["error"]["field"] == "preset", r.text
    assert r.json()["error"]["message"].endswith(f"known presets: {', '.join(listed) or 'none loaded'}"), r.text
    engine = requests.get(server.url + "/stats", timeout=10).json()["decision_engine"]
    # ServerProcess sets $PAGODA_TORCH_THREADS=1, which reaches onnxruntime
    assert engine == {"precision": "fp32", "backend": "onnxruntime", "model_file": "model.onnx", "threads": 1}


def test_deferring_to_a_default_teacher_that_is_not_built_stops_startup(student, tmp_path, monkeypatch):
    """An edge install (no laya-mini built) started, and each worker failed as it loaded, advising a build that
    needs pagoda[laya]; it is refused before any fork, naming the ways out."""
    from serving.decide.config import DecideConfig

    folder, _ = student
    monkeypatch.setenv("PAGODA_LAYA_MINI", str(tmp_path / "not-built"))
    with pytest.raises(ValueError, match=r"the default laya-mini \(.*not-built\), is not built here: .*--defer-to"):
        DecideConfig(student=str(folder), defer_below="0.5")
    DecideConfig(student=str(folder), defer_below="0.5", defer_to="http://127.0.0.1:9")  # a remote teacher: fine


def test_a_body_without_questions_waits_like_any_while_the_student_loads(student, monkeypatch):
    """Leaving `questions` out asks a student all of its own; before it has loaded that is the 503 every
    request gets (retry), not a 422 "questions is required" a client would take as final."""
    from serving.app import create_app
    from serving.config import ServeConfig
    from serving.decide.config import DecideConfig
    from serving.decide.routes import DecideApi
    from serving.decide.service import Service

    folder, _ = student
    monkeypatch.setattr(Service, "load_in_background", lambda self: None)  # still loading, however long the test
    cfg = ServeConfig(decide=DecideConfig(student=str(folder)))
    client = create_app(cfg, apis=[DecideApi(cfg.decide, 30)]).test_client()
    for body in ({"state": "help"}, {"state": "help", "questions": ["churn"]}):
        r = client.post("/decide", json=body)
        assert r.status_code == 503 and r.get_json()["error"]["type"] == "not_ready", (body, r.get_json())


def test_a_precision_the_student_lacks_stops_startup(student):
    """A linear student has one fp32 model: `--precision int8` (or bf16) names what it has, before any worker boots;
    `exact` and `fast` take the fp32 model."""
    import os

    folder, _ = student
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PAGODA_GENERATE_MODEL": "none"}
    for precision in ("int8", "bf16"):
        r = subprocess.run([sys.executable, "-m", "serving.cli", "serve", "--student", str(folder), "--port", "0",
                            "--precision", precision], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and f"precision '{precision}': this student has fp32 models only" in r.stderr, r.stderr


@pytest.mark.parametrize("precision, env, models, chosen", [
    (None, None, {"fp32": "m", "int8": "q"}, None),          # the student's own default
    ("exact", None, {"fp32": "m", "int8": "q"}, "fp32"),
    ("int8", None, {"fp32": "m", "int8": "q"}, "int8"),
    ("fast", None, {"fp32": "m", "int8": "q"}, "int8"),
    ("fast", None, {"fp32": "m"}, "fp32"),
    (None, "exact", {"fp32": "m", "int8": "q"}, "fp32"),    # $PAGODA_PRECISION, as laya.load reads it
])
def test_student_precision_names_one_of_its_models(monkeypatch, precision, env, models, chosen):
    from serving.decide.config import student_precision

    if env is None:
        monkeypatch.delenv("PAGODA_PRECISION", raising=False)
    else:
        monkeypatch.setenv("PAGODA_PRECISION", env)
    assert student_precision(precision, models) == chosen


def test_unsure_answers_go_to_the_laya_model(student, tmp_path):
    """`--student DIR --model M --defer-below ...`: the answers under a question's threshold are the Laya
    model's, each says who gave it, usage and /stats count them; the rest are the student's. The student's
    department answers are never certain, so a threshold of 1 hands every one of them over."""
    import laya
    from distill.runtime import Student

    folder, _ = student
    server = ServerProcess(tmp_path / "defer.log", ["--student", str(folder), "--model", str(TINY_BERT),
                                                    "--defer-below", "department=1,churn=0"]).running()
    try:
        local, teacher = Student(folder), laya.load(str(TINY_BERT), threads=1)
        states = ["I was charged twice this month, refund me or I cancel.", "The site is down.", {"text": "hello"}]
        r = requests.post(server.url + "/decide/batch", json={"states": states}, timeout=60)
        assert r.status_code == 200, r.text
        for state, got in zip(states, r.json()["results"]):
            mine = local.predict(state)["answers"]
            theirs = teacher.predict(state, {"department": TASK["questions"]["department"]})["answers"]
            assert got["answers"]["department"] == {**theirs["department"], "answered_by": "teacher"}
            assert got["answers"]["churn"] == {**mine["churn"], "answered_by": "student"}   # its threshold is 0
            assert got["usage"]["deferred_questions"] == ["department"]
            assert got["usage"]["teacher_input_tokens"] > 0
        stats = requests.get(server.url + "/stats", timeout=10).json()
        assert stats["deferred_answers"] == len(states)
        assert stats["decision_engine"]["defer_below"] == {"department": 1.0, "churn": 0.0}
        # a request that does not ask department hands nothing over: the teacher answers only questions asked
        r = requests.post(server.url + "/decide", json={"state": states[0], "questions": ["churn"]}, timeout=60)
        assert r.status_code == 200, r.text
        assert list(r.json()["answers"]) == ["churn"]
        assert r.json()["usage"]["deferred_questions"] == [] and r.json()["usage"]["teacher_input_tokens"] == 0
        assert requests.get(server.url + "/stats", timeout=10).json()["deferred_answers"] == len(states)
    finally:
        server.stop()


def _rebuilt_teacher(tmp_path) -> Path:
    """TINY_BERT with its temperatures refitted: another model to the student, as laya-mini with a new head is."""
    import json
    import shutil

    other = tmp_path / "rebuilt"
    shutil.copytree(TINY_BERT, other)
    config = json.loads((other / "rl_agent_config.json").read_text())
    config["temperature"] = [t * 1.5 for t in config["temperature"]]
    (other / "rl_agent_config.json").write_text(json.dumps(config))
    return other


def test_unsure_answers_go_to_a_remote_server(student, tmp_path):
    """`--student DIR --defer-below ... --defer-to URL`: another pagoda server's Laya model takes the unsure answers,
    exactly as a model loaded in this process would. When that server is gone, every answer is the student's,
    each state says why, /stats and /metrics count it, and the edge server keeps answering. When another model
    is served at that URL (a teacher redeployed with a new head), its answers are refused, naming its digest."""
    import laya
    from distill.deferral import Deferral, parse_below
    from distill.runtime import Student
    from laya.layout import answers_digest

    folder, _ = student
    teacher_server = ServerProcess(tmp_path / "teacher.log", ["--model", str(TINY_BERT)]).running()
    server = ServerProcess(tmp_path / "edge.log", ["--student", str(folder), "--defer-below", "department=1,churn=0",
                                                   "--defer-to", teacher_server.url, "--defer-timeout-s", "5",
                                                   "--defer-max-states", "2", "--defer-cooldown-s", "1"]).running()
    try:
        local = Student(folder)
        here = Deferral(laya.load(str(TINY_BERT), threads=1), parse_below("department=1,churn=0", local.questions))
        states = ["I was charged twice this month, refund me or I cancel.", "The site is down.", {"text": "hello"}]
        r = requests.post(server.url + "/decide/batch", json={"states": states}, timeout=60)
        assert r.status_code == 200, r.text
        expected = local.predict_batch(states, defer=here)
        for got, want in zip(r.json()["results"], expected):
            assert got["answers"] == want["answers"]
            assert got["answers"]["department"]["answered_by"] == "teacher"
            assert {k: got["usage"][k] for k in ("deferred_questions", "teacher_input_tokens", "deferral_error")} \
                == {"deferred_questions": ["department"], "teacher_input_tokens": want["usage"]["teacher_input_tokens"],
                    "deferral_error": None}
        engine = requests.get(server.url + "/stats", timeout=10).json()["decision_engine"]
        assert engine["defer_to"] == {"url": teacher_server.url, "model": None, "timeout_s": 5.0, "max_states": 2,
                                      "cooldown_s": 1.0, "teacher_digest": answers_digest(TINY_BERT),
                                      "teacher_check": "the student's teacher"}

        teacher_server.stop()
        r = requests.post(server.url + "/decide/batch", json={"states": states}, timeout=60)
        assert r.status_code == 200, r.text
        alone = local.predict_batch(states)
        for got, mine in zip(r.json()["results"], alone):
            assert got["answers"] == {q: {**a, "answered_by": "student"} for q, a in mine["answers"].items()}
            assert got["usage"]["deferred_questions"] == [] and "refused" in got["usage"]["deferral_error"]
        stats = requests.get(server.url + "/stats", timeout=10).json()
        assert (stats["deferred_answers"], stats["deferral_errors"]) == (len(states), len(states))
        assert f"pagoda_deferral_errors_total {len(states)}.0" in requests.get(server.url + "/metrics", timeout=10).text

        time.sleep(1.0)   # the cooldown the refused connection started
        rebuilt = _rebuilt_teacher(tmp_path)
        redeployed = ServerProcess(tmp_path / "redeployed.log", ["--model", str(rebuilt)],
                                   port=teacher_server.port).running()
        try:
            r = requests.post(server.url + "/decide/batch", json={"states": states}, timeout=60)
            assert r.status_code == 200, r.text
            for got, mine in zip(r.json()["results"], alone):
                assert got["answers"] == {q: {**a, "answered_by": "student"} for q, a in mine["answers"].items()}
                assert (f"answers digest {answers_digest(rebuilt)}, not the student's teacher "
                        f"({answers_digest(TINY_BERT)})") in got["usage"]["deferral_error"]
            engine = requests.get(server.url + "/stats", timeout=10).json()["decision_engine"]
            assert engine["defer_to"]["teacher_check"] == f"refused: answers digest {answers_digest(rebuilt)}"
        finally:
            redeployed.stop()
    finally:
        server.stop()
        teacher_server.stop()


def test_a_slow_remote_teacher_holds_up_no_other_request(student, tmp_path, canned_http):
    """A request waiting on the remote teacher (a server that takes 4 s) waits on its own thread: a request with
    nothing to defer, sent after it, is answered while the first still waits; then the first gets the teacher's
    answer."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    from laya.questions import parse_question

    folder, _ = student
    keys = parse_question("department", TASK["questions"]["department"]).keys  # an answer as laya writes one
    answer = {"type": "choice", "choice": "billing", "probabilities": {k: float(k == "billing") for k in keys},
              "confidence": 1.0, "answer_confidence": 1.0}
    slow = canned_http(4.0, json.dumps({"results": [{"answers": {"department": answer},
                                                     "usage": {"input_tokens": 7}}]}).encode())
    server = ServerProcess(tmp_path / "edge.log", ["--student", str(folder), "--defer-below", "department=1,churn=0",
                                                   "--defer-to", slow]).running()
    state = "I was charged twice this month, refund me or I cancel."
    try:
        with ThreadPoolExecutor(2) as pool:
            waiting = pool.submit(requests.post, server.url + "/decide",
                                  json={"state": state, "questions": {"department": TASK["questions"]["department"]}},
                                  timeout=60)
            assert slow.arrived.wait(30)   # the first request is with the teacher
            quick = requests.post(server.url + "/decide",
                                  json={"state": state, "questions": {"churn": TASK["questions"]["churn"]}}, timeout=60)
            assert quick.status_code == 200 and not waiting.done()
            assert quick.json()["answers"]["churn"]["answered_by"] == "student"
            got = waiting.result().json()
        assert got["answers"]["department"] == {**answer, "answered_by": "teacher"}
        assert got["usage"]["teacher_input_tokens"] == 7
        engine = requests.get(server.url + "/stats", timeout=10).json()["decision_engine"]
        assert engine["defer_to"]["teacher_check"] == "unchecked: the server names no answers digest"
    finally:
        server.stop()


def test_a_remote_teacher_is_waited_on_no_longer_than_the_request_timeout(student, tmp_path, canned_http):
    """`--request-timeout-s` bounds the whole request, the call to the remote teacher included: with a 6 s teacher,
    a 30 s `--defer-timeout-s` and a 2 s request timeout, the request gets 200 with the student's answers and why;
    being cut short by the request's own deadline pauses nothing, so the next request asks the teacher again."""
    import re

    folder, _ = student
    slow = canned_http(6.0, b"{}")
    server = ServerProcess(tmp_path / "edge.log", ["--student", str(folder), "--defer-below", "department=1,churn=0",
                                                   "--defer-to", slow, "--defer-timeout-s", "30",
                                                   "--request-timeout-s", "2"]).running()
    body = {"state": "I was charged twice this month, refund me or I cancel.",
            "questions": {"department": TASK["questions"]["department"]}}
    try:
        for _ in range(2):
            r = requests.post(server.url + "/decide", json=body, timeout=60)
            assert r.status_code == 200, r.text
            got = r.json()
            assert got["answers"]["department"]["answered_by"] == "student"
            why = got["usage"]["deferral_error"]
            left = re.search(r"no answer in the ([\d.]+) s left before the request's deadline", why)
            assert left and float(left.group(1)) <= 2.0, why
        stats = requests.get(server.url + "/stats", timeout=10).json()
        assert stats["deferral_errors"] == 2
    finally:
        server.stop()


def test_a_teacher_other_than_the_students_own_is_refused_unless_allowed(student, tmp_path):
    """A teacher rebuilt in place (here: a refitted temperature) would answer the unsure share as another model:
    `--defer-below` with a model loaded here checks it against the digest the student recorded when distilled."""
    import json

    from distill.deferral import teacher_mismatch
    from laya.layout import answers_digest
    from serving.decide.config import DecideConfig

    folder, _ = student
    meta = json.loads((folder / "student.json").read_text())
    assert meta["provenance"]["teacher_digest"] == answers_digest(TINY_BERT)
    assert teacher_mismatch(meta, TINY_BERT) is None
    DecideConfig(student=str(folder), model=str(TINY_BERT), defer_below="0.5")
    other = _rebuilt_teacher(tmp_path)
    with pytest.raises(ValueError, match=r"--defer-below / PAGODA_DEFER_BELOW: the student was distilled from .*"
                                         r"answers digest .* but the teacher here, .*rebuilt, has digest .*"
                                         r"--defer-any-teacher / PAGODA_DEFER_ANY_TEACHER"):
        DecideConfig(student=str(folder), model=str(other), defer_below="0.5")
    DecideConfig(student=str(folder), model=str(other), defer_below="0.5", defer_any_teacher=True)
    assert answers_digest(TINY_BERT) != answers_digest(other)  # the temperature is part of the answers...
    original = json.loads((TINY_BERT / "rl_agent_config.json").read_text())
    (other / "rl_agent_config.json").write_text(json.dumps({**original, "laya_mini": {"recipe": "any"}}))
    assert teacher_mismatch(meta, other) is None  # ...a laya-mini block's record of how it was made is not


@pytest.mark.parametrize("flags, words", [
    (["--defer-below", "0.5"], "--defer-below / PAGODA_DEFER_BELOW needs --student"),
    (["--student", "{folder}", "--defer-to", "http://127.0.0.1:9"], "--defer-to / PAGODA_DEFER_TO needs --defer-below"),
    (["--student", "{folder}", "--defer-below", "0.5", "--defer-to", "localhost:8000"],
     "--defer-to / PAGODA_DEFER_TO: expected an http(s) URL"),
    (["--student", "{folder}", "--defer-below", "0.5", "--defer-model", "tiny"],
     "--defer-model / PAGODA_DEFER_MODEL needs --defer-to"),
    (["--student", "{folder}", "--defer-below", "0.5", "--model", str(TINY_BERT), "--defer-to", "http://127.0.0.1:9"],
     "give either --model or --defer-to / PAGODA_DEFER_TO"),
    (["--student", "{folder}", "--defer-below", "sentiment=0.5"], "['sentiment'] not among the student's questions"),
    (["--student", "{folder}", "--defer-below", "2"], "must be a number in [0, 1]"),
    (["--student", "{folder}", "--model", str(TINY_BERT)], "give either --model or --student"),
    (["--student", "{folder}", "--defer-any-teacher"],  # was taken silently, though it changes nothing alone
     "--defer-any-teacher / PAGODA_DEFER_ANY_TEACHER needs --defer-below"),
])
def test_bad_deferral_flags_stop_startup_by_name(student, flags, words):
    import os

    folder, _ = student
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PAGODA_GENERATE_MODEL": "none"}
    r = subprocess.run([sys.executable, "-m", "serving.cli", "serve", "--port", "0",
                        *[f.format(folder=folder) for f in flags]], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and words in r.stderr, r.stderr
