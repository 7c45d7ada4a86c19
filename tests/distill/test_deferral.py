"""Deferring a student's unsure answers to its teacher (`distill.deferral`): the real tiny student and the real
Laya checkpoint it was distilled from."""

from __future__ import annotations

import numpy as np
import pytest
from distill_support import DEFER_STATES as STATES
from distill_support import TASK, torch_threads

from distill.deferral import Deferral, parse_below
from distill.fidelity import deferral_curve
from distill.runtime import Student
from laya.errors import InputError

QUESTIONS = list(TASK["questions"])


@pytest.fixture(scope="module")
def pair(student_dir, distill_inputs):
    import laya

    with torch_threads(1):
        yield Student(student_dir, threads=1), laya.load(distill_inputs["teacher"], threads=1)


@pytest.mark.parametrize("value, expected", [
    (0.7, {q: 0.7 for q in QUESTIONS}),
    ("0.5", {q: 0.5 for q in QUESTIONS}),
    ("department=0.8, churn=0", {"department": 0.8, "churn": 0.0}),
    ({"urgency": 1}, {"urgency": 1.0}),
])
def test_thresholds_parse(value, expected):
    assert parse_below(value, QUESTIONS) == expected


@pytest.mark.parametrize("value, words", [
    (1.5, "department: must be a number in [0, 1]"),
    ("-0.1", "must be a number in [0, 1]"),
    ("nan", "must be a number in [0, 1]"),
    ("high", "expected a number or QUESTION=NUMBER"),
    ("department=high", "department: expected a number"),
    ("=0.5", "expected QUESTION=NUMBER"),
    ("sentiment=0.5", "['sentiment'] not among the student's questions"),
    ({"department": True}, "must be a number in [0, 1]"),
])
def test_bad_thresholds_name_the_field(value, words):
    with pytest.raises(InputError, match="defer_below") as err:
        parse_below(value, QUESTIONS)
    assert words in str(err.value) and err.value.field == "defer_below"


def test_each_answer_under_its_threshold_is_the_teacher_s(pair):
    student, teacher = pair
    alone = student.predict_batch(STATES)
    told = teacher.predict_batch(STATES, TASK["questions"])
    # one threshold between the student's confidences per question, so that each question has both kinds
    below = {q: float(np.median([r["answers"][q]["answer_confidence"] for r in alone])) for q in QUESTIONS}
    out = student.predict_batch(STATES, defer=Deferral(teacher, below))
    teacher_answers = 0
    for mine, theirs, result in zip(alone, told, out):
        for q in QUESTIONS:
            got = result["answers"][q]
            if mine["answers"][q]["answer_confidence"] < below[q]:
                assert got == {**theirs["answers"][q], "answered_by": "teacher"}, q
                teacher_answers += 1
            else:
                assert got == {**mine["answers"][q], "answered_by": "student"}, q
        deferred = [q for q in QUESTIONS if result["answers"][q]["answered_by"] == "teacher"]
        assert result["usage"]["deferred_questions"] == deferred
        assert (result["usage"]["teacher_input_tokens"] > 0) == bool(deferred)
        assert result["model"] == "student:tiny-triage"
    assert 0 < teacher_answers < len(STATES) * len(QUESTIONS)


def test_an_answer_the_teacher_gave_on_the_whole_state_is_not_reported_cut(pair, student_dir):
    """The student reads 16 tokens of a long state, the teacher all of it: a deferred answer was not truncated."""
    _, teacher = pair
    short = Student(student_dir, threads=1, max_len=16)
    long_state = " ".join(["refund"] * 40)
    result = short.predict(long_state, defer=Deferral(teacher, parse_below(1.0, QUESTIONS)))
    assert result["usage"]["truncated"] is True  # the student's own reading was cut
    deferred = result["usage"]["deferred_questions"]
    assert deferred and result["usage"]["truncated_questions"] == [q for q in QUESTIONS if q not in deferred]


def test_threshold_zero_never_asks_and_one_asks_all_but_certain_answers(pair):
    student, teacher = pair
    alone = student.predict_batch(STATES)
    never = student.predict_batch(STATES, defer=Deferral(teacher, parse_below(0, QUESTIONS)))
    assert [{q: {k: v for k, v in a.items() if k != "answered_by"} for q, a in r["answers"].items()} for r in never] \
        == [r["answers"] for r in alone]
    assert all(r["usage"]["deferred_questions"] == [] for r in never)
    always = student.predict_batch(STATES, defer=Deferral(teacher, parse_below(1, QUESTIONS)))
    told = teacher.predict_batch(STATES, TASK["questions"])
    for r, t in zip(always, told):
        for q in QUESTIONS:
            if r["answers"][q]["answered_by"] == "teacher":
                assert {k: v for k, v in r["answers"][q].items() if k != "answered_by"} == t["answers"][q]
    assert sum(len(r["usage"]["deferred_questions"]) for r in always) >= len(STATES) * len(QUESTIONS) - 2


def test_answers_do_not_depend_on_batch_mates(pair):
    """A state's answers are the same alone and in a batch whose other states defer other questions."""
    student, teacher = pair
    alone = student.predict_batch(STATES)
    below = {q: float(np.median([r["answers"][q]["answer_confidence"] for r in alone])) for q in QUESTIONS}
    d = Deferral(teacher, below)
    batch = student.predict_batch(STATES, defer=d)
    assert batch == [student.predict(s, defer=d) for s in STATES]
    assert batch[::-1] == student.predict_batch(STATES[::-1], defer=d)


def test_the_gate_reads_the_answer_that_is_given(pair):
    """min_confidence gates after deferral: a teacher's answer is passed or abstained on its own confidence."""
    student, teacher = pair
    out = student.predict_batch(STATES, min_confidence=0.5, defer=Deferral(teacher, parse_below(1, QUESTIONS)))
    for r in out:
        for a in r["answers"].values():
            assert a["abstention"] == ("abstained" if a["answer_confidence"] < 0.5 else "passed")


def test_only_the_asked_questions_are_answered_or_deferred(pair):
    student, teacher = pair
    out = student.predict_batch(STATES, ["churn"], defer=Deferral(teacher, parse_below(1, QUESTIONS)))
    assert all(list(r["answers"]) == ["churn"] and set(r["usage"]["deferred_questions"]) <= {"churn"} for r in out)


def test_any_object_with_predict_batch_may_teach(pair):
    """The module's word: a teacher is anything with laya's predict_batch. describe() read `.engine`, which only a
    laya Agent has, and raised AttributeError for any other."""
    student, teacher = pair

    class Wrapped:
        def predict_batch(self, states, questions, **budgets):
            return teacher.predict_batch(states, questions, **budgets)

    deferral = Deferral(Wrapped(), parse_below(1, QUESTIONS))
    assert deferral.describe() == {"defer_below": {q: 1.0 for q in QUESTIONS}, "defer_to": {"teacher": "Wrapped"}}
    mine = student.predict_batch(STATES, defer=deferral)
    theirs = student.predict_batch(STATES, defer=Deferral(teacher, parse_below(1, QUESTIONS)))
    assert mine == theirs


def test_deferral_curve_counts_the_teacher_s_answers_as_agreeing():
    teacher = np.array([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.3, 0.7]])
    student = np.array([[0.95, 0.05], [0.65, 0.35], [0.55, 0.45], [0.2, 0.8]])   # rows 1 and 2 unsure, 1 wrong
    curve = {c["threshold"]: c for c in deferral_curve(student, teacher, (0.5, 0.6, 0.7, 0.9))}
    assert curve[0.5] == {"threshold": 0.5, "agreement": 0.75, "deferred": 0.0}
    assert curve[0.6] == {"threshold": 0.6, "agreement": 0.75, "deferred": 0.25}   # the right unsure row
    assert curve[0.7] == {"threshold": 0.7, "agreement": 1.0, "deferred": 0.5}
    assert curve[0.9] == {"threshold": 0.9, "agreement": 1.0, "deferred": 0.75}
