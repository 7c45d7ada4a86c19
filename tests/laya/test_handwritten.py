"""The hand-written ticket files: valid, disjoint (calibration and student text must never be evaluation text),
and turned into decision examples under the questions the evaluation asks."""

import json
import re

import pytest

from laya.corpus import handwritten
from laya.scenarios import load as scenario
from laya.training.examples import items_from_example


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z]+", text.lower()))


def _near(a: set[str], b: set[str], share: float) -> bool:
    """A near-copy: more than `share` of the two texts' words (their union) in common."""
    return len(a & b) > share * len(a | b)


def _assert_clear_of(rows: list[dict], judged_files: tuple[str, ...]) -> None:
    """Rows written for training: no near-copy of a judged file's text (more than 40% of the words shared), and
    none of each other (more than 60%), so what judges a head was never taught to it."""
    judged = [_words(t) for f in judged_files for t in handwritten.read_texts(handwritten.default_tickets(f))]
    seen: list[set[str]] = []
    for r in rows:
        a = _words(r["text"])
        assert a and not any(_near(a, b, 0.4) for b in judged), r
        assert not any(_near(a, b, 0.6) for b in seen), r
        seen.append(a)


@pytest.mark.parametrize("name", [handwritten.EVAL_FILE, handwritten.CALIB_FILE, handwritten.BLIND_FILE,
                                  handwritten.TRAIN_FILE, handwritten.DEV_FILE, handwritten.DEV2_FILE,
                                  handwritten.TRAIN2_FILE, handwritten.TRAIN3_FILE])
def test_ticket_files_are_valid(name):
    tickets = handwritten.read_tickets(handwritten.default_tickets(name))
    assert len(tickets) >= 60
    assert {t["department"] for t in tickets} == {"billing", "technical", "other"}
    assert {t["urgency"] for t in tickets} == {0, 1, 2} and {t["churn"] for t in tickets} == {True, False}
    assert len({t["id"] for t in tickets}) == len(tickets)


def test_calibration_tickets_are_not_evaluation_tickets():
    norm = lambda t: " ".join(t["text"].lower().split())  # noqa: E731
    evaluation = {norm(t) for t in handwritten.read_tickets(handwritten.default_tickets())}
    calib = {norm(t) for t in handwritten.read_tickets(handwritten.default_tickets(handwritten.CALIB_FILE))}
    assert not evaluation & calib


def test_student_texts_are_not_evaluation_or_calibration_tickets():
    """The student's hand-written texts: no text of the other two files, and no near-copy of an evaluation
    ticket (more than 60% of the words shared), so the agreement measured there stays on unseen text."""
    norm = lambda t: " ".join(t.lower().split())  # noqa: E731
    student = handwritten.read_texts(handwritten.default_tickets(handwritten.STUDENT_FILE))
    assert len(student) >= 100 and len({norm(t) for t in student}) == len(student)
    evaluation = [t["text"] for t in handwritten.read_tickets(handwritten.default_tickets())]
    calib = [t["text"] for t in handwritten.read_tickets(handwritten.default_tickets(handwritten.CALIB_FILE))]
    assert not {norm(t) for t in student} & {norm(t) for t in evaluation + calib}
    for s in student:
        a = _words(s)
        for e in evaluation:
            b = _words(e)
            assert not _near(a, b, 0.6), (s, e)


def test_second_student_texts_are_not_judged_text():
    """The second student file (texts, and gold since R16) against the four files that judge students
    (evaluation, dev, dev2, blind): no text of theirs nor a near-copy (more than 40% of the words shared); within
    itself no near-copy over 60%."""
    path = handwritten.default_tickets(handwritten.STUDENT2_FILE)
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert len(rows) >= 2000 and all(r["id"].startswith("hy") for r in rows)
    assert len({r["id"] for r in rows}) == len(rows)
    assert len(handwritten.read_tickets(path)) == len(rows)   # its gold, as training tickets read it
    _assert_clear_of(rows, (handwritten.EVAL_FILE, handwritten.DEV_FILE, handwritten.DEV2_FILE, handwritten.BLIND_FILE))


@pytest.mark.parametrize("name, prefix", [(handwritten.BLIND_FILE, "hb"), (handwritten.TRAIN_FILE, "ht"),
                                          (handwritten.DEV_FILE, "hd"), (handwritten.DEV2_FILE, "he"),
                                          (handwritten.TRAIN2_FILE, "hn"), (handwritten.TRAIN3_FILE, "hz")])
def test_later_ticket_files_are_no_earlier_files_text(name, prefix):
    """The blind, training (three) and dev files (two) against every other ticket file: no text of one, nor a near-copy (more
    than 40% of the words shared), and ids of their own. The blind file measures text no head, temperature or
    student choice has read; the training tickets must not teach it, nor the dev tickets that judge them."""
    files = [handwritten.EVAL_FILE, handwritten.CALIB_FILE, handwritten.STUDENT_FILE, handwritten.BLIND_FILE,
             handwritten.TRAIN_FILE, handwritten.DEV_FILE, handwritten.DEV2_FILE, handwritten.TRAIN2_FILE,
             handwritten.TRAIN3_FILE]
    tickets = handwritten.read_tickets(handwritten.default_tickets(name))
    assert len(tickets) >= 75 and all(t["id"].startswith(prefix) for t in tickets)
    others = [text for other in files if other != name
              for text in handwritten.read_texts(handwritten.default_tickets(other))]
    other_words = [_words(o) for o in others]
    for t in tickets:
        a = _words(t["text"])
        for o, b in zip(others, other_words):
            assert not _near(a, b, 0.4), (t["text"], o)


@pytest.mark.parametrize("name, prefix", [(handwritten.SHORT_DEV_FILE, "hsd"), (handwritten.SHORT_BLIND_FILE, "hsx")])
def test_short_message_files_are_short_and_no_other_files_text(name, prefix):
    """The one-line files: every label present, at most 15 words a message, and no text of any other file nor a
    near-copy (more than 40% of the words shared), the acceptance sentences included, so they measure one-liners
    no head or student has read."""
    from laya.training.mini_eval import ACCEPTANCE

    tickets = handwritten.read_tickets(handwritten.default_tickets(name))
    assert len(tickets) >= 55 and all(t["id"].startswith(prefix) for t in tickets)
    assert {t["department5"] for t in tickets} == {"billing", "technical", "shipping", "account", "other"}
    assert {t["urgency"] for t in tickets} == {0, 1, 2} and {t["churn"] for t in tickets} == {True, False}
    assert all(len(t["text"].split()) <= 15 for t in tickets)
    root = handwritten.default_tickets(name).parent
    others = [text for other in sorted(root.glob("handwritten_tickets*.jsonl")) if other.name != name
              for text in handwritten.read_texts(other)] + [case.text for case in ACCEPTANCE]
    other_words = [_words(o) for o in others]
    for t in tickets:
        a = _words(t["text"])
        for o, b in zip(others, other_words):
            assert not _near(a, b, 0.4), (t["text"], o)


def test_one_line_training_tickets_are_not_judged_text():
    """The one-line training file against every file that judges a head or student and the calibration tickets: no
    near-copy (more than 40% of the words shared); within itself none over 60%."""
    tickets = handwritten.read_tickets(handwritten.default_tickets(handwritten.TRAIN_SHORT_FILE))
    assert len(tickets) >= 300 and all(t["id"][:3] in ("hsa", "hsb") for t in tickets)
    assert len({t["id"] for t in tickets}) == len(tickets)
    _assert_clear_of(tickets, (handwritten.EVAL_FILE, handwritten.DEV_FILE, handwritten.DEV2_FILE, handwritten.BLIND_FILE,
                               handwritten.SHORT_DEV_FILE, handwritten.SHORT_BLIND_FILE, handwritten.CALIB_FILE))


@pytest.mark.parametrize("name", [handwritten.TRAIN_FILE, handwritten.TRAIN2_FILE, handwritten.TRAIN3_FILE,
                                  handwritten.STUDENT2_FILE, handwritten.TRAIN_SHORT_FILE])
def test_training_tickets_hold_no_acceptance_sentence(name):
    """No training ticket is a near-copy of one of issue 15's acceptance sentences (more than 40% of the words
    shared): they test the head on text it has not been taught."""
    from laya.training.mini_eval import ACCEPTANCE

    sentences = [_words(case.text) for case in ACCEPTANCE]
    for text in handwritten.read_texts(handwritten.default_tickets(name)):
        a = _words(text)
        assert not any(_near(a, b, 0.4) for b in sentences), text


def test_bad_lines_name_the_field(tmp_path):
    bad = tmp_path / "t.jsonl"
    bad.write_text(json.dumps({"text": "x", "department": "billing", "urgency": "high", "churn": False}) + "\n")
    with pytest.raises(ValueError, match="'urgency'"):
        handwritten.read_tickets(bad)
    with pytest.raises(FileNotFoundError, match="--tickets"):
        handwritten.read_tickets(tmp_path / "missing.jsonl")


def test_examples_ask_the_triage_questions_with_gold_labels():
    ticket = {"id": "x", "text": "Refund the double charge or we cancel.", "department": "billing",
              "urgency": 2, "churn": True}
    (ex,) = handwritten.examples([ticket])
    items = {it.name: it for it in items_from_example(ex, "x")}
    assert set(items) == set(scenario("billing")[1])
    assert items["department"].question.keys[items["department"].target.index(1.0)] == "billing"
    assert items["urgency"].target == (0.0, 0.0, 1.0)
    assert items["churn_risk"].question.keys[items["churn_risk"].target.index(1.0)] == "true"
    assert all(it.source == handwritten.SOURCE for it in items.values())


def test_outside_a_checkout_the_error_says_what_to_do(monkeypatch):
    monkeypatch.setattr(handwritten, "source_checkout", lambda: None)
    with pytest.raises(FileNotFoundError, match="--tickets"):
        handwritten.default_tickets()
    with pytest.raises(FileNotFoundError, match="--no-calib-tickets"):
        handwritten.calib_examples()
