"""`pagoda laya-mini eval` and its data: the held-out-label split holds, the examples are valid decisions of all
three types, the baseline and the checks compute what they claim, and the command runs end to end on a tiny
fixture data folder (CLINC150 / Snips layout) with a tiny checkpoint."""

import json
import random

import numpy as np
import pytest

import laya
from laya.corpus import intents
from laya.scenarios import load as scenario
from laya.testing import TINY_CLINC_DOMAINS, write_intent_data
from laya.training import mini_eval
from laya.training.examples import items_from_example
from laya.training.similarity import Cosine

CLINC_DOMAINS = TINY_CLINC_DOMAINS


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_intent_data(tmp_path_factory.mktemp("shared"))


def test_humanise():
    assert intents.humanise("GetWeather") == "get weather"
    assert intents.humanise("book_hotel") == "book hotel"
    assert intents.humanise("SearchScreeningEvent") == "search screening event"


def test_heldout_labels_never_reach_training(data):
    held = intents.heldout_labels(data)
    assert {"weather", "book_hotel", "GetWeather", "RateBook"} <= held and "transfer" not in held
    src = intents.IntentSource(data, "train", seed=0)
    rng = random.Random(1)
    types = set()
    for _ in range(400):
        ex = src.example(rng)
        q = ex["questions"]["intent"]
        types.add(q["type"])
        shown = list(q.get("criteria", [])) + [q["instructions"]]
        for label in held:
            # the held-out intent names appear in no option and no instruction (humanised or raw)
            assert not any(intents.humanise(label) == intents.humanise(s) or label in s for s in shown), (label, q)
        assert not any(intents.humanise(h) in ex["state"] for h in held)
        assert q["instructions"] != intents.EVAL_INSTRUCTION
        items_from_example({k: v for k, v in ex.items() if k != "teacher"}, "intents")   # a valid example
    assert types == {"choice", "noul"}
    qs = [src.example(random.Random(s))["questions"]["intent"] for s in range(300)]
    sizes = {len(q["criteria"]) for q in qs if q["type"] == "choice"}
    assert min(sizes) == 2 and max(sizes) == 12


def test_opaque_intent_choices_mean_what_their_descriptions_say(data):
    """`p_opaque`: the options are codes, each described by its intent, the gold the code whose description is the
    true intent's; the cosine teacher reads the intents, not the codes. At 0 the stream is what it was."""
    import hashlib

    made = intents.IntentSource(data, "train", seed=0).examples(200, seed=3)   # digest from 9ec57e7's intents.py
    assert hashlib.sha256(json.dumps(made, sort_keys=True).encode()).hexdigest()[:16] == "68d550770fad1bc1"
    src = intents.IntentSource(data, "train", seed=0, p_opaque=1.0, p_oos=0.0, p_choice=1.0)
    texts = dict(src.items)
    for s in range(100):
        ex = src.example(random.Random(s))
        crit, gold = ex["questions"]["intent"]["criteria"], ex["labels"]["intent"]
        assert isinstance(crit, dict)
        if gold in intents.CATCH_ALL:
            continue
        assert not any(intents.humanise(y) in name for name in crit for y in src.labels)   # names say nothing
        y = texts[ex["state"]]
        assert intents.humanise(y) in crit[gold] and ex["teacher"]["intent"][gold] == intents.humanise(y)


def test_out_of_scope_texts_are_negatives(data):
    src = intents.IntentSource(data, "train", seed=0, p_oos=1.0)
    for s in range(50):
        ex = src.example(random.Random(s))
        assert ex["state"].startswith("tell me a joke")
        q, gold = ex["questions"]["intent"], ex["labels"]["intent"]
        if q["type"] == "noul":
            assert gold is False
        else:
            assert gold in intents.CATCH_ALL and ex["teacher"]["intent"][gold] is None


def test_heldout_sets_are_five_way_on_heldout_test_text(data):
    sets = intents.heldout_choice_sets(data, n=10)
    held = set(intents.clinc_heldout(data))
    dom = intents.clinc_domain_of(data)
    test_texts = {t for t, _ in intents.clinc(data, "test")}
    for name in ("clinc", "clinc_hard"):
        assert len(sets[name]) == 10
        for text, opts, gold in sets[name]:
            assert len(set(opts)) == 5 and set(opts) <= held and text in test_texts
            assert intents.humanise(opts[gold]) in text
            if name == "clinc_hard":
                assert len({dom[o] for o in opts}) == 1
    for _text, opts, gold in sets["snips"]:
        assert opts[gold] in intents.SNIPS_HELDOUT and len(set(opts)) == 5
    assert sets == intents.heldout_choice_sets(data, n=10)    # fixed by its seed


def test_missing_data_names_the_flag(tmp_path):
    with pytest.raises(FileNotFoundError, match="--data"):
        intents.heldout_choice_sets(tmp_path)


def test_an_absurd_thread_count_is_refused_by_name(monkeypatch):
    """The API took threads=99999 and handed it to torch, which segfaulted or hung at its first op."""
    import torch

    def no_threads(n):
        raise AssertionError(f"torch was given {n} threads")

    monkeypatch.setattr(torch, "set_num_threads", no_threads)
    for bad in (99999, 0):
        with pytest.raises(ValueError, match=f"^--threads: must be an integer from 1 to 1024, got {bad}$"):
            mini_eval.evaluate(threads=bad)


def test_acceptance_checks_fail_on_wrong_answers():
    case = mini_eval.ACCEPTANCE[0]

    def ans(dept, churn, urg):
        return {"department": {"choice": dept}, "churn_risk": {"noul": churn}, "urgency": {"score": urg}}

    assert case.failures(ans("billing", 0.9, 1.2)) == []
    assert len(case.failures(ans("technical", 0.2, 0.1))) == 3
    assert mini_eval.ACCEPTANCE[3].failures(ans("billing", 0.5, 0.2)) == ["churn_risk 0.500 (want < 0.3)"]


def test_cosine_baseline_picks_the_matching_label():
    cos = Cosine()
    assert cos.choose("what's the weather like in Paris tomorrow", ["book hotel", "get weather", "play music"]) == 1
    assert cos.choose("play some jazz by Miles Davis", ["book hotel", "get weather", "play music"]) == 2
    e = cos.embed(["a", "b"])
    assert np.allclose(np.linalg.norm(e, axis=1), 1.0, atol=1e-5)


_EMBED_IN_A_FRESH_PROCESS = """
import hashlib, sys
from laya.training.similarity import Cosine
words = ["ok", "refund", "antidisestablishment", "xylophone", "is", "a", "tea", "go"]
texts = [" ".join(words[(i * 3 + j) % 8] for j in range(1 + i % 5)).ljust(32, ".")[:32] for i in range(40)]
e = Cosine(batch_size=4).embed(texts)
sys.stdout.write(hashlib.sha256(e.tobytes()).hexdigest())
"""


def test_cosine_embeddings_do_not_depend_on_the_process_hash_seed():
    """Texts are embedded in batches sorted by length; ties must not fall in set order, which Python's string
    hashing changes per process: a text's batch mates set its padding, and with them its last bits, and the
    fine-tune's teacher targets (and so its weights) followed from run to run."""
    import os
    import subprocess
    import sys

    digests = {subprocess.run([sys.executable, "-c", _EMBED_IN_A_FRESH_PROCESS], capture_output=True, text=True,
                              check=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout
               for seed in ("1", "2", "3")}
    assert len(digests) == 1, digests


def test_eval_command_end_to_end(laya_tiny_bert, data, tmp_path, capsys):
    from serving.cli import main

    tickets = tmp_path / "t.jsonl"
    tickets.write_text("".join(json.dumps({"text": f"refund my invoice {i}", "department": "billing", "urgency": 1,
                                           "churn": False}) + "\n" for i in range(6)))
    blind = tmp_path / "b.jsonl"
    blind.write_text("".join(json.dumps({"text": f"the app crashes on start {i}", "department": "technical",
                                         "urgency": 2, "churn": i == 0}) + "\n" for i in range(4)))
    rc = main(["laya-mini", "eval", "--model", laya_tiny_bert, "--data", str(data), "--tickets", str(tickets),
               "--blind-tickets", str(blind), "--n", "6", "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert rc == 0, out
    report = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert (tmp_path / "out" / "eval.png").stat().st_size > 1000
    assert set(report["intents"]) == {f"{k}{w}" for k in ("clinc", "clinc_hard", "snips") for w in ("", "_raw", "_opaque")}
    # the fixture's utterances contain their label: the real encoder's cosine baseline gets them right, also when
    # the label is only the description of an opaque name ("choice C: book hotel")
    assert all(report["intents"][k]["cosine"] == 1.0 for k in ("clinc", "snips", "clinc_opaque", "snips_opaque"))
    assert report["tickets"]["n"] == 6 and 0 <= report["tickets"]["department"] <= 1
    agent, questions = laya.load(laya_tiny_bert), scenario("billing")[1]
    answers = [agent.predict(f"refund my invoice {i}", questions)["answers"] for i in range(6)]
    want = {"department": [a["department"]["probabilities"]["billing"] for a in answers],
            "urgency": [a["urgency"]["probabilities"]["1"] for a in answers],
            "churn": [1 - a["churn_risk"]["noul"] for a in answers]}
    for k, ps in want.items():   # the gold answer's log loss, as the API reports probabilities
        assert report["tickets"]["nll"][k] == pytest.approx(float(np.mean([-np.log(max(p, 1e-4)) for p in ps])))
    assert "log loss of the gold answer" in out
    # department asked with opaque names ("desk A") over the preset's descriptions: the same ticket, answered so
    crit = questions["department"]["criteria"]
    opaque = {**questions["department"], "criteria": {f"desk {c}": v for c, v in zip("ABC", crit.values())}}
    gold = f"desk {'ABC'[list(crit).index('billing')]}"
    hits = [agent.predict(f"refund my invoice {i}", {"department": opaque})["answers"]["department"]["choice"] == gold
            for i in range(6)]
    assert report["tickets"]["department_opaque"] == pytest.approx(np.mean(hits))
    assert 0 <= report["tickets"]["department_opaque_cosine"] <= 1
    assert "department with the options named desk A, desk B, desk C" in out
    assert "answer unchanged under meaning-keeping edits" in out
    spread = report["tickets"]["department_ece10_by_chance"]   # the measured ECE read against the sample's own noise
    assert spread["ece"] == report["tickets"]["department_ece10"]
    assert "a perfectly calibrated model with these 6 confidences measures" in out
    assert len(report["acceptance"]) == 4 and len(report["goals"]) == 11
    assert "cosine baseline" in out and "acceptance sentences" in out
    per = report["intents"]["snips"]["by_intent"]   # every true intent of the set, counts adding up to n
    assert set(per) <= set(intents.SNIPS_HELDOUT) and sum(r["n"] for r in per.values()) == 6
    assert "trails the baseline most" in out
    # the blind file: reported on its own and pooled with the evaluation file, its goals beside the 11
    b, pooled = report["tickets_blind"], report["tickets_pooled"]
    assert b["n"] == 4 and pooled["n"] == 10
    assert pooled["department"] == pytest.approx((6 * report["tickets"]["department"] + 4 * b["department"]) / 10)
    assert pooled["urgency_mae"] == pytest.approx((6 * report["tickets"]["urgency_mae"] + 4 * b["urgency_mae"]) / 10)
    assert len(report["goals_blind"]) == 4 and len(report["goals_pooled"]) == 4
    assert "blind hand-written tickets (n=4)" in out and "both ticket files pooled (n=10)" in out
    assert "the same ticket goals on the blind set" in out
    rc = main(["laya-mini", "eval", "--model", laya_tiny_bert, "--data", str(data), "--tickets", str(tickets),
               "--n", "6", "--out", str(tmp_path / "out2")])   # the blind file is read only when asked for
    assert rc == 0 and "tickets_blind" not in json.loads((tmp_path / "out2" / "eval.json").read_text())
    assert "blind" not in capsys.readouterr().out


def test_by_intent_splits_a_set_by_its_true_intent():
    golds = ["RateBook", "RateBook", "RateBook", "GetWeather"]
    laya_hit, cos_hit = np.array([0.0, 0.0, 1.0, 1.0]), np.array([1.0, 1.0, 0.0, 1.0])
    answers = ["search creative work", "search creative work", "rate book", "get weather"]
    per = mini_eval.by_intent(golds, laya_hit, cos_hit, answers)
    assert per["RateBook"] == {"n": 3, "laya": pytest.approx(1 / 3), "cosine": pytest.approx(2 / 3),
                               "most_wrong": ["search creative work", 2]}
    assert per["GetWeather"] == {"n": 1, "laya": 1.0, "cosine": 1.0, "most_wrong": None}


def test_eval_command_rejects_a_missing_data_folder(tmp_path, capsys):
    from serving.cli import main

    rc = main(["laya-mini", "eval", "--data", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")])
    assert rc == 2 and "--data" in capsys.readouterr().err


def test_eval_command_names_a_missing_blind_file(data, tmp_path, capsys):
    from serving.cli import main

    rc = main(["laya-mini", "eval", "--data", str(data), "--blind-tickets", str(tmp_path / "gone.jsonl"),
               "--out", str(tmp_path / "o")])
    assert rc == 2 and "--blind-tickets: file not found" in capsys.readouterr().err


class _FixedCosine:
    """Teacher stand-in with known similarities: the option text 'transfer' scores highest."""

    def embed(self, texts, progress=False):
        return None

    def distribution(self, text, options, tau):
        z = np.array([2.0 if o == "transfer" else 0.0 for o in options]) / tau
        p = np.exp(z - z.max())
        return p / p.sum()


def test_build_intents_learn_part_of_their_target_from_the_teacher(data):
    from laya.training import mini

    spec = mini.MiniSpec(data=str(data), teacher_weight=0.4)
    exs = mini.intent_examples(spec, "train", 200, seed=3, cosine=_FixedCosine())
    soft = [ex for ex in exs if "targets" in ex]
    assert soft and all("teacher" not in ex for ex in exs)
    for ex in soft:
        dist = ex["targets"]["intent"]
        assert abs(sum(dist.values()) - 1) < 1e-4
        gold = max(dist, key=dist.get)
        assert dist[gold] >= 0.6 - 1e-6             # the gold option keeps 1 - weight at least
        for k, p in dist.items():
            if k in intents.CATCH_ALL:
                assert p == 0.0                       # no text to compare: no teacher mass
        items_from_example(ex, "mix")                 # what the trainer reads
    calib = mini.intent_examples(spec, "calib", 50, seed=4, cosine=_FixedCosine())
    assert all("labels" in ex and "targets" not in ex and "teacher" not in ex for ex in calib)


def test_self_agreement_counts_the_answers_an_edit_changes():
    """On real tickets and the embedded default (where edits do move some answers), the figure is the share of
    (ticket, edited copy) pairs whose top answer equals the one on the ticket as written, copies drawn with the
    report's seed."""
    from laya.answers import top_option
    from laya.corpus import noise
    from laya.corpus.handwritten import default_tickets, read_tickets
    from laya.training import mini

    tickets = read_tickets(default_tickets())[:24]
    agent, questions = laya.load(str(mini.ensure())), scenario("billing")[1]
    report = mini_eval.summarize_tickets(mini_eval.ticket_rows(agent, Cosine(), tickets))["self_agreement_under_edits"]
    texts = [t["text"] for t in tickets]
    rng, same = random.Random(noise.EDIT_SEED), {q: [] for q in questions}
    for text in texts:
        clean = agent.predict(text, questions)["answers"]
        for _ in range(noise.EDIT_COPIES):
            edited = agent.predict(noise.perturb(text, rng, texts, noise.SAME_MEANING), questions)["answers"]
            for q in questions:
                same[q].append(top_option(edited[q]) == top_option(clean[q]))
    assert report == pytest.approx({q: np.mean(v) for q, v in same.items()})
    assert min(report.values()) < 1.0     # some answer moved: the comparison is not vacuous here
