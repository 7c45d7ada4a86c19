"""`python -m distill.corpus`: generated tickets with their gold, plus real utterances and tickets cut to their
first sentence (no gold), seeded; rows without gold are scored against the teacher only."""

import json
import subprocess
import sys

import pytest
from distill_support import ROOT, TASK

from datasets import Dataset
from distill import labels as L
from distill.corpus import first_sentence, main, write_corpus
from distill.task import parse_task
from laya.corpus import intents, tickets
from laya.testing import write_intent_data


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return write_intent_data(tmp_path_factory.mktemp("shared"))


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_corpus_mixes_gold_tickets_cut_tickets_and_utterances(shared, tmp_path):
    rows = read(write_corpus(tmp_path / "c.jsonl", 40, seed=3, n_utterances=50, truncated=0.5, data=shared))
    gen = tickets.generate(40, seed=3)
    by_source = {s: [r for r in rows if r["source"] == s] for s in ("tickets", "tickets-cut", "utterances")}
    assert sorted(r["text"] for r in by_source["tickets"]) == sorted(t["text"] for t in gen)
    gold = {t["text"]: (t["department"], t["urgency"], t["churn"]) for t in gen}
    assert all(gold[r["text"]] == (r["department"], r["urgency"], r["churn"]) for r in by_source["tickets"])
    assert 5 <= len(by_source["tickets-cut"]) <= 30
    for r in by_source["tickets-cut"]:
        assert any(r["text"] in t["text"] and len(r["text"]) < len(t["text"]) for t in gen), r["text"]
    pool = {t for t, _ in intents.clinc(shared, "train") + intents.clinc(shared, "oos_train")}
    pool |= {t for texts in intents.snips(shared, "train").values() for t in texts}
    assert len(by_source["utterances"]) == 50 and {r["text"] for r in by_source["utterances"]} <= pool
    assert all(r[k] is None for r in by_source["tickets-cut"] + by_source["utterances"]
               for k in ("department", "urgency", "churn"))
    again = read(write_corpus(tmp_path / "d.jsonl", 40, seed=3, n_utterances=50, truncated=0.5, data=shared))
    assert again == rows


def test_first_sentence_cuts_after_the_greeting_or_not_at_all():
    assert first_sentence("Hi,\nMy order is late. Please check. Thanks\n- Ana") == "My order is late."
    assert first_sentence("order late! pls check") == "order late!"
    assert first_sentence("one sentence only.") is None


def test_rows_without_gold_are_not_scored_against_gold():
    task = parse_task(TASK)
    ds = Dataset.from_list([{"department": "billing", "urgency": 2, "churn": True},
                            {"department": None, "urgency": None, "churn": None}])
    gold = L.gold_indices(ds, task)
    assert gold["department"].tolist() == [0, -1] and gold["urgency"].tolist() == [2, -1]
    assert gold["churn"].tolist() == [task.parsed["churn"].keys.index("true"), -1]


def test_too_many_utterances_is_one_line_naming_the_flag(shared, tmp_path):
    out = subprocess.run([sys.executable, "-m", "distill.corpus", "--tickets", "5", "--utterances", "100000",
                          "--data", str(shared), "--out", str(tmp_path / "x.jsonl")], capture_output=True, text=True,
                         cwd=ROOT)
    assert out.returncode == 2 and "error: --utterances: 100000 asked" in out.stderr and "Traceback" not in out.stderr


def test_handwritten_texts_join_as_written_and_perturbed(shared, tmp_path):
    import random

    from distill.corpus import handwritten_variants
    from laya.corpus.handwritten import STUDENT_FILE, default_tickets, read_texts

    texts = read_texts(default_tickets(STUDENT_FILE))
    path = write_corpus(tmp_path / "h.jsonl", 20, seed=3, data=shared, handwritten=default_tickets(STUDENT_FILE),
                        variants=4)
    rows = [r for r in read(path) if r["source"] == "handwritten"]
    assert set(texts) <= {r["text"] for r in rows}                       # every text as written
    assert len(texts) < len(rows) <= 5 * len(texts)                       # and up to 4 distinct copies each
    one = handwritten_variants(texts[:1], 4, random.Random(0))
    assert one[0] == texts[0] and len(set(one)) == len(one)               # a text's copies are distinct
    assert all(r[k] is None for r in rows for k in ("department", "urgency", "churn"))   # the teacher labels them
    assert read(write_corpus(tmp_path / "i.jsonl", 20, seed=3, data=shared, handwritten=default_tickets(STUDENT_FILE),
                             variants=4)) == read(path)
    variants = handwritten_variants(["Refund the double charge. We need it today."], 30, random.Random(0))
    assert any(v.islower() for v in variants) and any("\n\n" in v for v in variants)
    assert any("refund" in v.lower() and "today" not in v.lower() for v in variants)     # first sentence only


def test_handwritten_corpus_errors_name_the_flag(shared, tmp_path):
    with pytest.raises(ValueError, match="--handwritten-variants"):
        write_corpus(tmp_path / "x.jsonl", 5, data=shared, handwritten=ROOT / "datasets" / "handwritten_tickets_student.jsonl",
                     variants=-1)
    with pytest.raises(FileNotFoundError, match="--handwritten"):
        write_corpus(tmp_path / "x.jsonl", 5, data=shared, handwritten=tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": ""}\n')
    with pytest.raises(ValueError, match="'text'"):
        write_corpus(tmp_path / "x.jsonl", 5, data=shared, handwritten=bad)


def test_several_handwritten_files_are_one_pool(shared, tmp_path):
    """`--handwritten` repeats (the Makefile passes the student texts and the calibration tickets): every
    file's texts join, each as written."""
    from laya.corpus.handwritten import CALIB_FILE, STUDENT_FILE, default_tickets, read_texts

    files = [default_tickets(STUDENT_FILE), default_tickets(CALIB_FILE)]
    out = subprocess.run([sys.executable, "-m", "distill.corpus", "--tickets", "5", "--data", str(shared),
                          *(a for f in files for a in ("--handwritten", str(f))), "--handwritten-variants", "1",
                          "--out", str(tmp_path / "p.jsonl")], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    texts = {r["text"] for r in read(tmp_path / "p.jsonl") if r["source"] == "handwritten"}
    assert all(set(read_texts(f)) <= texts for f in files)


@pytest.mark.parametrize("argv, words", [
    (["--tickets", "0"], "--tickets: must be >= 1"),
    (["--tickets", "5", "--utterances", "-1"], "--utterances: must be >= 0"),
    (["--tickets", "5", "--handwritten-variants", "3"], "no --handwritten file"),
])
def test_corpus_flags_out_of_range_are_one_line_before_any_file(tmp_path, capsys, argv, words):
    out = tmp_path / "c.jsonl"
    assert main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.splitlines()) == 1 and not out.exists(), err


def test_corpus_out_that_is_a_folder_leaves_nothing_behind(tmp_path, capsys):
    assert main(["--tickets", "5", "--out", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err and not tmp_path.with_suffix(".tmp").exists()
