"""The edge runtime: official answer shape, question selection, determinism, and no torch anywhere."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from distill_support import ROOT, TASK, torch_threads

from distill.runtime import Student
from laya.errors import InputError

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
    assert all(a["action"] == {"act_probability": None} for a in out["answers"].values())
    u = out["usage"]
    assert u["output_tokens"] == 0 and u["input_tokens"] > 0 and u["truncated"] is False


def test_answers_carry_exactly_the_keys_laya_gives(student, distill_inputs):
    """The teacher (a real Laya checkpoint) and the student answer the same request in one shape."""
    import laya

    with torch_threads(1):
        agent = laya.load(distill_inputs["teacher"])
        for gate in (None, 0.5, {"choice:3-5": 0.9, "default": 0.2}):
            theirs = agent.predict(STATES[2], TASK["questions"], min_confidence=gate)
            ours = student.predict(STATES[2], min_confidence=gate)
            assert set(ours) == set(theirs)
            assert set(ours["usage"]) == set(theirs["usage"]) - {"options"}
            for q in TASK["questions"]:
                assert set(ours["answers"][q]) == set(theirs["answers"][q]), q
                assert ours["answers"][q]["action"] == {"act_probability": None}
                assert isinstance(theirs["answers"][q]["action"]["act_probability"], float)


def test_min_confidence_gates_like_laya_and_is_validated(student):
    everything = student.predict(STATES[0], min_confidence=1.0)["answers"]
    assert all(a["abstention"] == "abstained" and a["low_confidence"] for a in everything.values())
    nothing = student.predict(STATES[0], min_confidence=0.0)["answers"]
    assert all(a["abstention"] == "passed" and "low_confidence" not in a for a in nothing.values())
    per_bucket = student.predict(STATES[0], min_confidence={"choice:3-5": 1.0, "default": 0.0})["answers"]
    assert [per_bucket[q]["abstention"] for q in ("department", "urgency", "churn")] == [
        "abstained", "passed", "passed"]
    assert "abstention" not in student.predict(STATES[0])["answers"]["churn"]
    with pytest.raises(ValueError, match="min_confidence"):
        student.predict(STATES[0], min_confidence=1.5)
    with pytest.raises(ValueError, match="min_confidence"):
        student.predict(STATES[0], min_confidence={"choice:many": 0.5})


def test_stored_temperatures_get_laya_s_clamp(student_dir, tmp_path):
    """A folder written before students were clamped (T=0.1 sharpens) is tempered at 0.5, with a warning."""
    folder = tmp_path / "old-linear"
    shutil.copytree(student_dir / "baseline-linear", folder)
    meta = json.loads((folder / "student.json").read_text())
    for h in meta["heads"]:
        h["temperature"] = 0.1
    (folder / "student.json").write_text(json.dumps(meta))
    with pytest.warns(RuntimeWarning, match="department=0.1 -> 0.5"):
        old = Student(folder, threads=1)
    assert old.temperatures == {"department": 0.5, "urgency": 0.5, "churn": 0.5}
    for h in meta["heads"]:
        h["temperature"] = 0.5
    (folder / "student.json").write_text(json.dumps(meta))
    assert Student(folder, threads=1).predict(STATES[1]) == old.predict(STATES[1])


def test_batch_results_are_bit_identical_to_single_predictions(student):
    batch = student.predict_batch(STATES * 3, batch_size=4)
    for i, state in enumerate(STATES * 3):
        assert batch[i] == student.predict(state)
    logits = student.logits(STATES)
    for i, state in enumerate(STATES):
        assert np.array_equal(student.logits([state])[0], logits[i])


def test_distinct_states_of_one_length_share_a_batch_bit_identically(student, student_dir):
    """int8 students quantise per token, so they batch like fp32: mates of one length leave a state's bits alone."""
    texts = [f"order {n} arrived broken, please refund me" for n in range(10, 40)]
    if student.kind == "encoder":  # one token length, so the runtime puts them in one batch
        assert len({len(e.ids) for e in student._tokenizer.encode_batch(texts)}) == 1
    together = student.logits(texts)
    for i, text in enumerate(texts):
        assert np.array_equal(student.logits([text])[0], together[i])
    if student.precision == "int8":
        assert json.loads((student_dir / "student.json").read_text())["int8_activations"] == "per-token"


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
    for bad in (5, "churn", 1.5, [["churn"]], True):  # an InputError naming `questions`, never a TypeError
        with pytest.raises(InputError, match="questions: expected a dict") as err:
            student.predict(STATES[1], bad)
        assert err.value.field == "questions"


def test_usage_counts_state_tokens_as_laya_does(student):
    """laya's `state_tokens` is the state's own tokens (laya-mini's teacher reads them with this very tokenizer);
    the student's row adds [CLS] and [SEP] around them, which `input_tokens` counts."""
    from distill.inputs import minilm_tokenizer

    if student.kind != "encoder":
        pytest.skip("a linear student counts words")
    for state in ("", "my package never arrived", "refund " * 40):
        usage = student.predict(state)["usage"]
        own = len(minilm_tokenizer().encode(state, add_special_tokens=False).ids)
        assert usage["state_tokens"] == own and usage["input_tokens"] == min(own, student.max_len - 2) + 2, state


def test_a_linear_student_counts_the_words_it_reads(student_dir):
    """docs/distill.md: tokens read are words for the linear student, the `\\w\\w+` words it reads; it counted the
    text split on spaces ("a b c d" 4, where it reads none; "refund!!!refund" 1, where it reads two)."""
    linear = Student(student_dir / "baseline-linear")
    for state, words in (("a b c d", 0), ("refund!!!refund", 2), ("My package never arrived.", 4), ("", 0)):
        usage = linear.predict(state)["usage"]
        assert usage["input_tokens"] == usage["state_tokens"] == words, (state, usage)


def test_an_absurd_thread_count_is_refused_before_the_session(student_dir, monkeypatch):
    """onnxruntime took threads=99999 and hung building the session's thread pool."""
    import distill.runtime

    def no_session(*args, **kwargs):
        raise AssertionError(f"a session was built with {args[1].intra_op_num_threads} threads")

    monkeypatch.setattr(distill.runtime.ort, "InferenceSession", no_session)
    for bad in (99999, 0, 2.0):
        with pytest.raises(ValueError, match=f"^threads: must be an integer from 1 to 1024, got {bad!r}$"):
            Student(student_dir, threads=bad)


def test_bad_folders_and_options_are_named(student_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="student.json"):
        Student(tmp_path)
    with pytest.raises(ValueError, match="precision"):
        Student(student_dir / "baseline-linear", precision="int8")
    with pytest.raises(ValueError, match="threads"):
        Student(student_dir, threads=0)
    for bad in (64.5, "64", True):
        with pytest.raises(ValueError, match="max_len: must be an integer"):
            Student(student_dir, max_len=bad)
    meta = json.loads((student_dir / "student.json").read_text())
    (tmp_path / "student.json").write_text(json.dumps(dict(meta, format="something-else")))
    with pytest.raises(ValueError, match="'format'"):
        Student(tmp_path)


@pytest.mark.parametrize("edit, error, words", [
    # each gave a KeyError traceback, a tokenizer's bare "No such file or directory", or a server that started and
    # answered 500 to every request
    (lambda m, d: (d / "student.json").write_text("{not json"), ValueError, "student.json: not valid JSON"),
    (lambda m, d: (d / "student.json").write_text(json.dumps({k: v for k, v in m.items() if k != "models"})),
     ValueError, "student.json: field 'models' must be a non-empty dict"),
    (lambda m, d: (d / "student.json").write_text(json.dumps({**m, "heads": [m["heads"][0]]})), ValueError,
     "field 'heads' has no head for question(s)"),
    (lambda m, d: (d / "tokenizer.json").unlink(), FileNotFoundError, "student files missing: tokenizer.json"),
    (lambda m, d: (d / "model.onnx").unlink(), FileNotFoundError, "student files missing: model.onnx"),
])
def test_a_broken_student_folder_is_named_with_its_file_and_field(student_dir, tmp_path, edit, error, words):
    import shutil

    from serving.decide.config import DecideConfig

    folder = tmp_path / "copy"
    shutil.copytree(student_dir, folder, ignore=shutil.ignore_patterns("baseline-*"))
    edit(json.loads((folder / "student.json").read_text()), folder)
    with pytest.raises(error, match=re.escape(words)):
        Student(folder)
    with pytest.raises(error, match=re.escape(words)):  # `pagoda serve --student` refuses it before any worker starts
        DecideConfig(student=str(folder))


def test_runtime_runs_with_torch_and_transformers_unimportable(student_dir):
    """A subprocess where torch, transformers, the training stack and laya's torch modules raise ImportError.

    laya's torch-free modules (answers, calibration, questions, rows) must load: the runtime answers
    through them; laya's model, agent and training code must not.
    """
    script = textwrap.dedent(f"""
        import sys
        BLOCKED = ("torch", "transformers", "sklearn", "skl2onnx", "datasets", "safetensors",
                   "laya.agent", "laya.modeling_laya", "laya.checkpoint", "laya.batching", "laya.training")

        def blocked(name):
            return any(name == b or name.startswith(b + ".") for b in BLOCKED)

        class Block:
            def find_spec(self, name, path=None, target=None):
                if blocked(name):
                    raise ImportError("blocked for this test: " + name)
                return None

        sys.meta_path.insert(0, Block())
        from distill.runtime import Student
        for folder in ({str(student_dir)!r}, {str(student_dir / "baseline-linear")!r}):
            s = Student(folder)
            out = s.predict_batch(["I was charged twice, refund me or I leave", "app crashes"],
                                  min_confidence=0.5)
            assert set(out[0]["answers"]) == {{"department", "urgency", "churn"}}, out
        loaded = sorted(m for m in sys.modules if blocked(m))
        assert not loaded, loaded
        assert "laya.agent" not in sys.modules and "laya.modeling_laya" not in sys.modules
        assert {{"laya.answers", "laya.calibration", "laya.rows"}} <= set(sys.modules)
        print("ok", sorted(m for m in sys.modules if m.split(".")[0] in ("onnxruntime", "tokenizers", "numpy"))[:3])
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("ok")
