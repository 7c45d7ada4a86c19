"""Hand-written support tickets: the real-text measure of laya-mini, the natural text its temperatures fit,
and natural text for the distilled student.

Three files under `datasets/`, written by hand for issue 15 and never produced by a generator:
`handwritten_tickets.jsonl` is evaluation only (`pagoda laya-mini eval`, the student agreement check);
`handwritten_tickets_calib.jsonl` is laya-mini's calibration data. The second exists because temperatures
fitted on the synthetic calib split alone (tickets answered ~97% right) sharpened the answers, and on
natural text the same head is wrong more often: urgency there was overconfident (NLL 1.56 on the
evaluation tickets). Neither is ever laya-mini training data. `handwritten_tickets_student.jsonl` is text
only, no gold: the student's corpus takes it, and the calibration tickets' texts without their gold
(`python -m distill.corpus --handwritten`), labelled by the teacher, because a student distilled on
generated tickets alone learnt the generator rather than its teacher. `handwritten_tickets_blind.jsonl` is a
second evaluation file, committed before any model answered it: the first one selected heads (rounds 2-5 of
issue 15), so it is no longer a blind measure. The files share no text, the student file no near-copy of an
evaluation ticket, and the blind file no near-copy of any other file's text (tests check all three).
`handwritten_tickets_train.jsonl` and `handwritten_tickets_dev.jsonl` (Dec 5) are natural tickets with gold for
fine-tuning (`pagoda laya-mini finetune --mix ...,handwritten=W`) and for judging such runs without the blind file;
`handwritten_tickets_dev2.jsonl` is a second dev file, written when the first and the evaluation file disagreed on a
student choice by ten answers. `handwritten_tickets_student2.jsonl` (Dec 6) is more student text, written from one
brief by six writers, with no near-copy of a ticket of the four files that judge students; its gold, added by six
readers afterwards, makes it training tickets too (`--train-tickets`). `handwritten_tickets_train3.jsonl` (Dec 6)
is training tickets about leaving: ultimatums on a fault against calm intents to leave and their look-alikes (R19).
`handwritten_tickets_short_dev.jsonl` and `handwritten_tickets_short_blind.jsonl` (Dec 6) are one-line messages
(up to 15 words), which the other judged files hold few of (23 of 443 have 8 words or fewer) and users send
first: a dev file that may judge runs, and a blind one read once. `handwritten_tickets_train_short.jsonl` is
one-line training tickets with gold, written by two other writers (R23).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from laya.paths import source_checkout
from laya.scenarios import load as scenario

EVAL_FILE = "handwritten_tickets.jsonl"
CALIB_FILE = "handwritten_tickets_calib.jsonl"
STUDENT_FILE = "handwritten_tickets_student.jsonl"
STUDENT2_FILE = "handwritten_tickets_student2.jsonl"
BLIND_FILE = "handwritten_tickets_blind.jsonl"
TRAIN_FILE = "handwritten_tickets_train.jsonl"
TRAIN2_FILE = "handwritten_tickets_train2.jsonl"
TRAIN3_FILE = "handwritten_tickets_train3.jsonl"
DEV_FILE = "handwritten_tickets_dev.jsonl"
DEV2_FILE = "handwritten_tickets_dev2.jsonl"
SHORT_DEV_FILE = "handwritten_tickets_short_dev.jsonl"
SHORT_BLIND_FILE = "handwritten_tickets_short_blind.jsonl"
TRAIN_SHORT_FILE = "handwritten_tickets_train_short.jsonl"
SOURCE = "handwritten"


def default_tickets(name: str = EVAL_FILE) -> Path:
    root = source_checkout()
    if root is None:
        hint = ("give their path with --tickets" if name == EVAL_FILE else
                "run from a checkout, or leave them out (`pagoda laya-mini finetune --no-calib-tickets`)")
        raise FileNotFoundError(f"datasets/{name}: the hand-written tickets ship with the source checkout, not "
                                f"with the installed package; {hint}")
    return root / "datasets" / name


def read_tickets(path: Path, flag: str = "--tickets") -> list[dict[str, Any]]:
    """`{"id", "text", "department", "department5", "urgency", "churn"}` per line; `flag` names the option a
    missing file came from."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{flag}: file not found: {path}")
    out = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        t = json.loads(line)
        for key, kind in (("text", str), ("department", str), ("urgency", int), ("churn", bool)):
            if not isinstance(t.get(key), kind):
                raise ValueError(f"{path}:{i}: field {key!r} must be a {kind.__name__}, got {t.get(key)!r}")
        out.append(t)
    if not out:
        raise ValueError(f"{path}: no tickets")
    return out


QUESTIONS = ("department", "urgency", "churn_risk")   # the support-triage questions, as the scenario names them


def examples(tickets: list[dict[str, Any]], ask: tuple[str, ...] = QUESTIONS) -> list[dict[str, Any]]:
    """Decision examples under the README's support-triage questions (the ones the evaluation asks), with the
    gold department (3-way preset), urgency level and churn threat as hard labels. `ask` keeps some of the
    questions: a file whose gold is sound for department but skewed for urgency (the student2 file, R18 in
    docs/laya-mini-log.md) can teach the one without the other."""
    unknown = set(ask) - set(QUESTIONS)
    if not ask or unknown:
        raise ValueError(f"ask: give some of {list(QUESTIONS)}, got {list(ask)!r}")
    questions = {k: q for k, q in scenario("billing")[1].items() if k in ask}
    return [{"state": t["text"], "questions": questions, "source": SOURCE,
             "labels": {k: v for k, v in (("department", t["department"]), ("urgency", t["urgency"]),
                                          ("churn_risk", t["churn"])) if k in ask}}
            for t in tickets]


def calib_examples() -> list[dict[str, Any]]:
    return examples(read_tickets(default_tickets(CALIB_FILE)))


def read_texts(path: Path) -> list[str]:
    """The `text` of each line (the student file has no gold labels)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--handwritten: file not found: {path}")
    out = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            text = json.loads(line).get("text")
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"{path}:{i}: field 'text' must be a non-empty string, got {text!r}")
            out.append(text)
    if not out:
        raise ValueError(f"{path}: no tickets")
    return out
