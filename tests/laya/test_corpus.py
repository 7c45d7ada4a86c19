"""The laya-mini corpus: deterministic, labelled correctly, and with held-out label sets really held out."""

import hashlib
import json

import pytest

from laya.corpus import dialogs, forms, reviews, tickets
from laya.corpus.build import CorpusConfig, build, write
from laya.training.examples import items_from_example

SMALL = CorpusConfig(seed=3, tickets_train=120, tickets_calib=40, tickets_test=40, tickets_unseen=30,
                     reviews_train=80, reviews_calib=30, reviews_test=30)


@pytest.fixture(scope="module")
def splits():
    return build(SMALL)


def test_ticket_generator_is_deterministic_and_labelled():
    a, b = tickets.generate(300, seed=7), tickets.generate(300, seed=7)
    assert a == b
    assert a != tickets.generate(300, seed=8)
    assert {t["department"] for t in a} == set(tickets.DEPARTMENTS)
    assert {t["urgency"] for t in a} == {0, 1, 2}
    assert {t["sentiment"] for t in a} == set(tickets.SENTIMENTS)
    assert 0.15 < sum(t["churn"] for t in a) / len(a) < 0.45
    assert len({t["text"] for t in a}) > 0.97 * len(a)           # real variety, not a handful of templates
    lengths = sorted(len(t["text"]) for t in a)
    assert lengths[-1] > 2 * lengths[0]


def test_ticket_urgency_follows_the_text():
    """A ticket that says nothing about time has the urgency its problem implies (a stopped business is blocking,
    a fault "soon", an inquiry "not urgent", a churn threat at least "soon"); every other urgency is said."""
    a = tickets.generate(2000, seed=11)
    implied = {"blocking": 2, "fault": 1, "inquiry": 0}
    for t in a:
        if not t["urgency_said"]:
            assert t["urgency"] == max(implied[t["kind"]], 1 if t["churn"] else 0), t
    for kind, level in implied.items():   # each kind comes with and without a cue; uncued, at its own level only
        assert {t["urgency_said"] for t in a if t["kind"] == kind} == {False, True}
        uncued = [t for t in a if t["kind"] == kind and not t["urgency_said"] and not t["churn"]]
        assert uncued and {t["urgency"] for t in uncued} == {level}
    assert {t["urgency"] for t in a if t["kind"] == "fault" and t["urgency_said"]} == {0, 1, 2}
    impact = [t for t in a if t["kind"] == "blocking" and not t["urgency_said"]]
    cues = [c.lower() for level in tickets._URGENCY_CUES for c in level]
    assert not any(c in t["text"].lower() for t in impact for c in cues)


def test_ticket_generator_rejects_bad_arguments():
    with pytest.raises(ValueError, match="departments"):
        tickets.generate(3, seed=0, departments=("billing", "plumbing"))
    with pytest.raises(ValueError, match="n must be"):
        tickets.generate(-1, seed=0)
    assert {t["department"] for t in tickets.generate(50, 0, tickets.HELDOUT_DEPARTMENTS)} <= set(
        tickets.HELDOUT_DEPARTMENTS)


def test_installed_sources_load():
    rev = reviews.load()
    assert len(rev) > 10000 and {r["category"] for r in rev} == {"fresh", "rotten", "plot"}
    dia = dialogs.load()
    assert {d["topic"] for d in dia} == set(dialogs.TOPICS)
    assert all(len(d["turns"]) >= 2 for d in dia)


def test_every_example_is_valid_training_data(splits):
    n = 0
    for split, examples in splits.items():
        for i, ex in enumerate(examples):
            n += len(items_from_example(ex, f"{split}:{i}"))   # raises on any bad label or question
            json.dumps(ex)
    assert n > 500


def test_question_forms_vary(splits):
    qs = [q for ex in splits["train"] for q in ex["questions"].values()]
    assert {q["type"] for q in qs} == {"choice", "score", "noul"}
    sizes = {len(q["criteria"]) for q in qs if q["type"] == "choice"}
    assert {2, 3, 4, 5} <= sizes
    assert any(isinstance(q["criteria"], dict) for q in qs if q["type"] == "choice")
    assert any(isinstance(q["criteria"], list) for q in qs if q["type"] == "choice")
    assert len({q["instructions"] for q in qs}) > 20
    assert {ex["source"] for ex in splits["train"]} == {"tickets", "reviews", "dialogs"}


def _option_names(examples):
    names = set()
    for ex in examples:
        for q in ex["questions"].values():
            if q["type"] == "choice":
                names |= {str(k).lower() for k in q["criteria"]}
            names.add(q["instructions"].lower())
    return names


def test_held_out_label_sets_never_reach_training(splits):
    seen = _option_names(splits["train"] + splits["calib"])
    unseen_departments = {n for d in tickets.HELDOUT_DEPARTMENTS for n in forms.DEPARTMENT_NAMES[d]}
    unseen_topics = {dialogs.TOPICS[t][0] for t in dialogs.HELDOUT_TOPICS}
    assert not seen & (unseen_departments | unseen_topics)
    assert not any(any(t in name for t in unseen_topics) for name in seen)
    test_sources = {ex["source"] for ex in splits["test"]}
    assert {"tickets-unseen-labels", "dialogs-unseen-labels"} <= test_sources
    test_names = _option_names([ex for ex in splits["test"] if ex["source"].endswith("unseen-labels")])
    assert unseen_departments & test_names and unseen_topics & test_names


def test_splits_do_not_share_texts(splits):
    def texts(split):
        return {json.dumps(ex["state"]) for ex in splits[split] if ex["source"] in ("reviews", "dialogs")}
    assert not texts("train") & texts("test")
    assert not texts("train") & texts("calib")


def test_write_round_trips(tmp_path, splits):
    paths = write(splits, tmp_path, SMALL)
    assert sum(1 for _ in open(paths["train"])) == len(splits["train"])
    assert json.loads((tmp_path / "corpus.json").read_text())["seed"] == 3
    assert build(SMALL) == splits   # same config, same corpus



def test_opaque_options_carry_their_meaning_in_the_descriptions_only():
    """`opaque_options`: the train tickets' department choices named by codes, each option still described, the
    gold the code of the right description; calib and test rows unchanged; at 0 the corpus is what it was (no draw)."""
    import random

    assert len(set(forms.opaque_names(5, random.Random(0)))) == 5
    cfg = dict(seed=1, tickets_train=200, tickets_calib=40, tickets_test=40, tickets_unseen=10, reviews_train=20,
               reviews_calib=5, reviews_test=5)
    plain, opaque = build(CorpusConfig(**cfg)), build(CorpusConfig(**cfg, opaque_options=1.0))
    assert opaque["calib"] == plain["calib"] and opaque["test"] == plain["test"]
    # at 0 the rows are those the code made before `opaque_options` existed (digest taken from 9ec57e7's forms.py)
    rows = forms.ticket_examples(tickets.generate(60, seed=1), seed=2)
    assert hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:16] == "bac453a0236fb575"
    department_of = {d: dept for dept, ds in forms.DEPARTMENT_DESCRIPTIONS.items() for d in ds}
    worded = {w for ws in forms.DEPARTMENT_NAMES.values() for w in ws}
    truth = {t["text"]: t["department"] for t in tickets.generate(200, seed=1000)}   # build's train tickets
    asked = 0
    for ex in (e for e in opaque["train"] if e["source"] == "tickets"):
        for name, q in ex["questions"].items():
            crit = q.get("criteria")
            if q["type"] != "choice" or not isinstance(crit, dict) or not set(crit.values()) <= set(department_of):
                continue   # not a department choice
            assert not set(crit) & worded, crit   # every one is named by a code
            shown = {department_of[d] for d in crit.values()}
            gold = department_of[crit[ex["labels"][name]]]
            assert gold == (truth[ex["state"]] if truth[ex["state"]] in shown else "other"), (ex["state"], crit)
            asked += 1
    assert asked > 100
