"""The edge runtime: official answer shape, question selection, determinism, and no torch anywhere."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from distill_support import ROOT, TASK

from distill.runtime import Student

STATES = ["Hi, we were billed twice for March. Refund it today or we cancel.",
          "The export button gives error 500 since the update, our whole team is blocked!",
          {"customer": "ACME", "message": "where is my parcel? tracking says delivered"},
          "thanks, all good now",
          "Hello, I cannot log in. Password reset mail never arrives. " * 3]


@pytest.fixture(scope="module", params=["int8", "fp32", "linear"])
def student(request, student_dir):
    if request.param == "linear":
        return Student(student_dir / "baseline-linear", threads=1)
    return Student(student_dir, precision=request.param, threads=1)


def test_answers_have_the_laya_shape(student):
    out = student.predict(STATES[0])
    assert out["model"] == "student:tiny-triage"
    assert list(out["answers"]) == ["department", "urgency", "churn"]
    dep, urg, churn = (out["answers"][q] for q in ("department", "urgency", "churn"))
    assert dep["type"] == "choice" and dep["choice"] in TASK["questions"]["department"]["criteria"]
    assert list(dep["probabilities"]) == list(TASK["questions"]["department"]["criteria"])
    assert abs(sum(dep["probabilities"].values()) - 1) < 1e-3
    assert dep["answer_confidence"] == max(dep["probabilities"].values())
    assert urg["type"] == "score" and 0 <= urg["score"] <= 2
    assert urg["legend"] == {"0": "not urgent", "1": "soon", "2": "blocking"}
    assert abs(urg["score"] - sum(int(k) * v for k, v in urg["probabilities"].items())) < 1e-3
    assert churn["type"] == "noul" and 0 <= churn["noul"] <= 1
    assert churn["confidence"] == round(max(churn["noul"], 1 - churn["noul"]), 4)
    u = out["usage"]
    assert u["output_tokens"] == 0 and u["input_tokens"] > 0 and u["truncated"] is False


def test_answer_fields_match_laya_for_the_same_probabilities():
    """Same distribution in, same answer out as laya's own answer builder (less the act head's field)."""
    from distill.answers import answer_from_probs
    from distill.task import parse_task
    from laya import answers as laya_answers
    from laya.questions import parse_question

    for head in parse_task(TASK).heads():
        p = np.random.default_rng(len(head["keys"])).dirichlet(np.ones(head["size"]))
        ours = answer_from_probs(head, p)
        theirs = laya_answers.answer(parse_question(head["name"], TASK["questions"][head["name"]]), p, 1.0)
        theirs.pop("action")
        assert ours == theirs


def test_batch_results_are_bit_identical_to_single_predictions(student):
    batch = student.predict_batch(STATES * 3, batch_size=4)
    for i, state in enumerate(STATES * 3):
        assert batch[i] == student.predict(state)
    logits = student.logits(STATES)
    for i, state in enumerate(STATES):
        assert np.array_equal(student.logits([state])[0], logits[i])


def test_long_states_are_truncated_to_the_budget_and_reported(student_dir):
    s = Student(student_dir, max_len=16)
    u = s.predict(STATES[-1] * 4)["usage"]
    assert u["input_tokens"] == 16 and u["truncated"] is True and u["state_tokens_dropped"] > 0
    assert u["truncated_questions"] == ["department", "urgency", "churn"]
    with pytest.raises(ValueError, match="max_len"):
        Student(student_dir, max_len=1000)


def test_subset_of_questions_and_refusals_name_the_question(student):
    out = student.predict(STATES[1], ["churn"])
    assert list(out["answers"]) == ["churn"]
    assert list(student.predict(STATES[1], {"urgency": TASK["questions"]["urgency"]})["answers"]) == ["urgency"]
    with pytest.raises(ValueError, match="'sentiment'"):
        student.predict(STATES[1], {"sentiment": {"type": "noul", "instructions": "Is the customer happy?"}})
    changed = dict(TASK["questions"]["churn"], instructions="Is the customer happy?")
    with pytest.raises(ValueError, match="churn.*differs"):
        student.predict(STATES[1], {"churn": changed})
    with pytest.raises(ValueError, match="state"):
        student.predict(42)
    with pytest.raises(ValueError, match="batch_size"):
        student.predict_batch(STATES, batch_size=0)
    assert student.predict_batch([]) == []


def test_bad_folders_and_options_are_named(student_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="student.json"):
        Student(tmp_path)
    with pytest.raises(ValueError, match="precision"):
        Student(student_dir / "baseline-linear", precision="int8")
    with pytest.raises(ValueError, match="threads"):
        Student(student_dir, threads=0)
    meta = json.loads((student_dir / "student.json").read_text())
    (tmp_path / "student.json").write_text(json.dumps(dict(meta, format="something-else")))
    with pytest.raises(ValueError, match="'format'"):
        Student(tmp_path)


def test_runtime_runs_with_torch_and_transformers_unimportable(student_dir):
    """A subprocess where importing torch, transformers (and the training stack) raises ImportError."""
    script = textwrap.dedent(f"""
        import sys
        BLOCKED = ("torch", "transformers", "sklearn", "skl2onnx", "datasets", "laya", "safetensors")

        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError("blocked for this test: " + name)
                return None

        sys.meta_path.insert(0, Block())
        from distill.runtime import Student
        for folder in ({str(student_dir)!r}, {str(student_dir / "baseline-linear")!r}):
            s = Student(folder)
            out = s.predict_batch(["I was charged twice, refund me or I leave", "app crashes"])
            assert set(out[0]["answers"]) == {{"department", "urgency", "churn"}}, out
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
        assert not loaded, loaded
        print("ok", sorted(m for m in sys.modules if m.split(".")[0] in ("onnxruntime", "tokenizers", "numpy"))[:3])
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("ok")
