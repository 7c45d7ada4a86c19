"""`pagoda laya-mini finetune`: a few steps on a tiny checkpoint and the tiny CLINC150/Snips fixture folder give a
loadable, calibrated checkpoint that answers differently from its init; the teacher term is a KL that vanishes only
at the teacher's distribution; bad flags are one line naming the flag, rc 2."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_mini_eval import _FixedCosine, data  # noqa: F401  (the teacher stand-in; the tiny CLINC150/Snips folder fixture)

import laya
from laya.scenarios import load as scenario
from laya.training.examples import items_from_example
from laya.training.finetune import FinetuneConfig, finetune, smooth, teacher_kl

TINY_CORPUS = {"tickets_train": 40, "tickets_calib": 12, "tickets_test": 4, "tickets_unseen": 4,
               "reviews_train": 40, "reviews_calib": 12, "reviews_test": 4}


def test_finetune_writes_a_calibrated_checkpoint_that_answers_differently(laya_tiny_bert, data, tmp_path):  # noqa: F811
    out = tmp_path / "ft"
    # lr 1e-2 so 3 Adam steps move the trained weights far beyond F16 rounding (the shipped recipe: 1e-4 / 3e-5)
    cfg = FinetuneConfig(init=laya_tiny_bert, out=str(out), data=str(data), steps=3, batch_size=8, window_batches=2,
                         lr=1e-2, encoder_lr=1e-2, mix={"intents": 0.5, "tickets": 0.5}, corpus=TINY_CORPUS,
                         intents_calib=20, threads=1)
    summary = finetune(cfg, progress=False)
    assert summary["steps"] == 3 and sum(summary["steps_by_source"].values()) == 3
    w0 = load_file(f"{laya_tiny_bert}/model.safetensors")
    w1 = {k: v.float() for k, v in load_file(str(out / "model.safetensors")).items()}
    frozen = "encoder.embeddings.word_embeddings.weight"
    assert torch.all((w1[frozen] - w0[frozen]).abs() <= w0[frozen].abs() * 2**-10 + 1e-6)   # F16 rounding only
    assert (w1["scorer.1.weight"] - w0["scorer.1.weight"]).abs().max() > 1e-3               # trained
    state, questions = scenario()
    before = laya.load(laya_tiny_bert).predict(state, questions)["answers"]
    after = laya.load(str(out)).predict(state, questions)["answers"]
    assert after["department"]["probabilities"] != before["department"]["probabilities"]
    stored = json.loads((out / "rl_agent_config.json").read_text())
    assert stored["temperature"] == [round(t, 4) for t in summary["temperature"]]
    assert stored["laya_mini"]["fine_tune"]["steps"] == 3
    assert (out / "calib.jsonl").stat().st_size > 0


def test_a_loss_that_turns_nan_stops_the_run_at_that_step(laya_tiny_bert, data, tmp_path, monkeypatch):  # noqa: F811
    """A diverged fine-tune used to train on NaNs to the end and save them; now it stops naming the step."""
    import laya.training.losses as losses

    real, calls = losses.proper_loss, []

    def nan_from_step_2(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs) * (float("nan") if len(calls) >= 2 else 1.0)

    monkeypatch.setattr(losses, "proper_loss", nan_from_step_2)
    cfg = FinetuneConfig(init=laya_tiny_bert, out=str(tmp_path / "ft"), data=str(data), steps=3, batch_size=8,
                         window_batches=2, mix={"tickets": 1.0}, corpus=TINY_CORPUS, intents_calib=0, threads=1)
    with pytest.raises(ValueError, match=r"finetune \(tickets batch\): the loss is nan at step 2, training "
                                         r"diverged: lower the learning rates \(lr 0\.0001, encoder_lr 3e-05\)"):
        finetune(cfg, progress=False)
    assert len(calls) == 2 and not (tmp_path / "ft" / "model.safetensors").exists()
    for name in ("lr", "encoder_lr"):   # 1e308 is finite and trained NaNs
        with pytest.raises(ValueError, match=f"finetune: {name} must be a learning rate in"):
            FinetuneConfig(init=laya_tiny_bert, out=str(tmp_path / "o"), **{name: 1e308}).validate()


def test_opaque_options_reach_the_intent_and_ticket_rows_and_the_recipe(laya_tiny_bert, data, tmp_path,  # noqa: F811
                                                                         monkeypatch):
    """`opaque_options` is what the run's intent source and corpus are built with, and the checkpoint records it."""
    from laya.corpus import build as corpus_build
    from laya.corpus import intents as intent_corpus

    seen = {}
    real_source, real_build = intent_corpus.IntentSource, corpus_build.build

    def source(*args, **kwargs):
        seen["intents"] = kwargs.get("p_opaque")
        return real_source(*args, **kwargs)

    def build(cfg):
        seen["corpus"] = cfg.opaque_options
        return real_build(cfg)

    monkeypatch.setattr(intent_corpus, "IntentSource", source)
    monkeypatch.setattr(corpus_build, "build", build)
    out = tmp_path / "ft"
    finetune(FinetuneConfig(init=laya_tiny_bert, out=str(out), data=str(data), steps=2, batch_size=8,
                            window_batches=2, mix={"intents": 0.5, "tickets": 0.5}, corpus=TINY_CORPUS,
                            intents_calib=0, threads=1, opaque_options=0.5), progress=False)
    assert seen == {"intents": 0.5, "corpus": 0.5}
    recipe = json.loads((out / "rl_agent_config.json").read_text())["laya_mini"]["fine_tune"]
    assert recipe["opaque_options"] == 0.5


def test_corpus_layers_zero_leaves_the_encoder_to_intent_batches(laya_tiny_bert, data, tmp_path):  # noqa: F811
    """`--corpus-layers 0` with tickets alone: every encoder layer is set to train, yet none moves (beyond F16
    rounding), since only intent batches may train them; the head still trains."""
    out = tmp_path / "ft"
    cfg = FinetuneConfig(init=laya_tiny_bert, out=str(out), data=str(data), steps=3, batch_size=8, window_batches=2,
                         lr=1e-2, encoder_lr=1e-2, encoder_layers=99, corpus_layers=0, mix={"tickets": 1.0},
                         corpus=TINY_CORPUS, intents_calib=0, threads=1)
    finetune(cfg, progress=False)
    w0 = load_file(f"{laya_tiny_bert}/model.safetensors")
    w1 = {k: v.float() for k, v in load_file(str(out / "model.safetensors")).items()}
    layers = [k for k in w0 if ".layer." in k and k.startswith("encoder.")]
    assert layers and all(torch.all((w1[k] - w0[k]).abs() <= w0[k].abs() * 2**-10 + 1e-6) for k in layers)
    assert (w1["scorer.1.weight"] - w0["scorer.1.weight"]).abs().max() > 1e-3


def test_train_tickets_names_the_files_handwritten_draws(laya_tiny_bert, data, tmp_path, monkeypatch):  # noqa: F811
    """`--train-tickets A B`: the mix's hand-written batches come from those files, all of them, and no other; the
    flag without handwritten=W in the mix is refused rather than silently unread."""
    from laya.corpus import handwritten

    read = []
    real = handwritten.read_tickets
    monkeypatch.setattr(handwritten, "read_tickets", lambda path, *a: read.append(path.name) or real(path, *a))
    files = [str(handwritten.default_tickets(n)) for n in (handwritten.TRAIN_FILE, handwritten.TRAIN2_FILE)]
    base = dict(init=laya_tiny_bert, data=str(data), steps=2, batch_size=8, window_batches=2, corpus=TINY_CORPUS,
                intents_calib=0, calib_sources=["tickets"], threads=1, train_tickets=files)
    summary = finetune(FinetuneConfig(out=str(tmp_path / "ft"), mix={"handwritten": 1.0}, **base), progress=False)
    assert summary["steps_by_source"] == {"handwritten": 2}
    assert read == [handwritten.TRAIN_FILE, handwritten.TRAIN2_FILE]
    with pytest.raises(ValueError, match="--train-tickets"):
        FinetuneConfig(out=str(tmp_path / "ft2"), mix={"tickets": 1.0}, **base).validate()
    with pytest.raises(ValueError, match="--train-tickets: give one or more files"):
        FinetuneConfig(out=str(tmp_path / "ft2"), mix={"handwritten": 1.0}, **{**base, "train_tickets": []}).validate()
    with pytest.raises(FileNotFoundError, match="--train-tickets"):
        finetune(FinetuneConfig(out=str(tmp_path / "ft3"), mix={"handwritten": 1.0},
                                **{**base, "train_tickets": [str(tmp_path / "missing.jsonl")]}), progress=False)


def test_train_tickets_can_ask_some_questions_of_a_file(laya_tiny_bert, data, tmp_path, monkeypatch):  # noqa: F811
    """`--train-tickets A B=department,churn_risk`: B's tickets are asked those two questions and never urgency,
    A's all three (R18: a file whose urgency gold is skewed still teaches department); a question that is not
    one of the support-triage three, or an empty list, is refused naming the flag."""
    from laya.corpus import handwritten
    from laya.training import finetune as ft

    asked = []
    real = handwritten.examples
    monkeypatch.setattr(handwritten, "examples", lambda t, ask=handwritten.QUESTIONS: asked.append(ask) or real(t, ask))
    a, b = (str(handwritten.default_tickets(n)) for n in (handwritten.TRAIN_FILE, handwritten.TRAIN2_FILE))
    base = dict(init=laya_tiny_bert, data=str(data), steps=1, batch_size=8, window_batches=2, corpus=TINY_CORPUS,
                intents_calib=0, calib_sources=["tickets"], threads=1, mix={"handwritten": 1.0})
    finetune(FinetuneConfig(out=str(tmp_path / "ft"), train_tickets=[a, b + "=department,churn_risk"], **base),
             progress=False)
    assert asked == [handwritten.QUESTIONS, ("department", "churn_risk")]
    exs = real(handwritten.read_tickets(Path(b)), ("department", "churn_risk"))
    assert all(set(ex["questions"]) == set(ex["labels"]) == {"department", "churn_risk"} for ex in exs)
    assert ft.train_ticket_spec("x.jsonl") == ("x.jsonl", handwritten.QUESTIONS)
    for bad in ("x.jsonl=", "x.jsonl=department,speed", "=urgency"):
        with pytest.raises(ValueError, match="--train-tickets"):
            FinetuneConfig(out=str(tmp_path / "ft2"), train_tickets=[bad], **base).validate()


def test_handwritten_in_the_mix_trains_on_the_training_tickets_gold(laya_tiny_bert, data, tmp_path,  # noqa: F811
                                                                     monkeypatch):
    """`--mix handwritten=W`: batches of datasets/handwritten_tickets_train.jsonl (never the evaluation, blind,
    dev or calibration file) under the support-triage questions; the head trains on them."""
    from laya.corpus import handwritten

    read = []
    real = handwritten.read_tickets
    monkeypatch.setattr(handwritten, "read_tickets", lambda path, *a: read.append(path.name) or real(path, *a))
    out = tmp_path / "ft"
    cfg = FinetuneConfig(init=laya_tiny_bert, out=str(out), data=str(data), steps=3, batch_size=8, window_batches=2,
                         lr=1e-2, encoder_lr=1e-2, mix={"handwritten": 1.0}, corpus=TINY_CORPUS, intents_calib=0,
                         calib_sources=["tickets"], threads=1)
    summary = finetune(cfg, progress=False)
    assert summary["steps_by_source"] == {"handwritten": 3}
    assert read == [handwritten.TRAIN_FILE]
    w0 = load_file(f"{laya_tiny_bert}/model.safetensors")
    w1 = {k: v.float() for k, v in load_file(str(out / "model.safetensors")).items()}
    assert (w1["scorer.1.weight"] - w0["scorer.1.weight"]).abs().max() > 1e-3


def test_calib_sources_keep_only_those_rows_in_the_temperature_fit(laya_tiny_bert, data, tmp_path):  # noqa: F811
    from laya.corpus import handwritten

    out = tmp_path / "ft"
    cfg = FinetuneConfig(init=laya_tiny_bert, out=str(out), data=str(data), steps=0, mix={"tickets": 1.0},
                         corpus=TINY_CORPUS, intents_calib=20, threads=1, calib_sources=["intents", "handwritten"])
    finetune(cfg, progress=False)
    rows = [json.loads(line) for line in (out / "calib.jsonl").read_text().splitlines()]
    by_source = {s: sum(r["source"] == s for r in rows) for s in {r["source"] for r in rows}}
    n_tickets = len(handwritten.read_tickets(handwritten.default_tickets(handwritten.CALIB_FILE)))
    assert by_source == {"intents": 20, "handwritten": n_tickets}


def test_no_calib_tickets_is_calib_sources_less_handwritten():
    from laya.cli import _calib_sources_flag

    assert _calib_sources_flag(None, False) is None
    assert _calib_sources_flag(None, True) == ["tickets", "reviews", "dialogs", "intents"]
    assert _calib_sources_flag("intents, handwritten", True) == ["intents"]
    assert _calib_sources_flag("intents,handwritten", False) == ["intents", "handwritten"]


def test_smoothing_spreads_eps_over_a_rows_own_options_only():
    target = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True, True], [True, True, False, False]])   # row 2: two options, padded
    out = smooth(target, mask, 0.2)
    assert torch.allclose(out, torch.tensor([[0.85, 0.05, 0.05, 0.05], [0.1, 0.9, 0.0, 0.0]]))
    assert torch.allclose(out.sum(-1), torch.ones(2)) and torch.equal(smooth(target, mask, 0.0), target)


def test_teacher_term_is_zero_only_at_the_teacher_distribution():
    ex = {"state": "send money to my brother", "labels": {"intent": "Transfer"},
          "questions": {"intent": {"type": "choice", "instructions": "intent", "criteria": ["Transfer", "Balance",
                                                                                          "other"]}}}
    item = items_from_example(ex, "t")[0]
    teacher = {"Transfer": "transfer", "Balance": "balance", "other": None}   # the catch-all has no text
    p = _FixedCosine().distribution("", ["transfer", "balance"], 0.5)
    at_teacher = torch.tensor([[*np.log(p), 5.0]], dtype=torch.float32)       # the catch-all's logit is ignored
    assert float(teacher_kl(at_teacher, [item], [teacher], _FixedCosine(), 0.5)) == pytest.approx(0.0, abs=1e-6)
    flat = torch.zeros(1, 3)
    assert float(teacher_kl(flat, [item], [teacher], _FixedCosine(), 0.5)) > 0.1
    assert teacher_kl(flat, [item], [None], _FixedCosine(), 0.5) is None          # no teacher: no term


@pytest.mark.parametrize("argv, flag", [
    (["--out", "OUT"], "--init"),
    (["--init", "INIT"], "--out"),
    (["--init", "INIT", "--out", "OUT", "--steps", "abc"], "--steps"),
    (["--init", "INIT", "--out", "OUT", "--steps", "-1"], "--steps"),
    (["--init", "INIT", "--out", "OUT", "--threads", "-1"], "--threads"),
    (["--init", "INIT", "--out", "OUT", "--threads", "99999"], "--threads"),
    (["--init", "MISSING", "--out", "OUT"], "--init"),
    (["--init", "INIT", "--out", "OUT", "--precision", "fp16"], "--precision"),
    (["--init", "INIT", "--out", "OUT", "--encoder-layers", "0"], "--encoder-layers"),
    (["--init", "INIT", "--out", "OUT", "--kl-weight", "x"], "--kl-weight"),
    (["--init", "INIT", "--out", "OUT", "--corpus-layers", "-1"], "--corpus-layers"),
    (["--init", "INIT", "--out", "OUT", "--corpus-layers", "two"], "--corpus-layers"),
    (["--init", "INIT", "--out", "OUT", "--label-smoothing", "1"], "--label-smoothing"),
    (["--init", "INIT", "--out", "OUT", "--calib-sources", "intents,synthetic"], "--calib-sources"),
    (["--init", "INIT", "--out", "OUT", "--calib-sources", ""], "--calib-sources"),
    (["--init", "INIT", "--out", "OUT", "--label-smoothing", "lots"], "--label-smoothing"),
    (["--init", "INIT", "--out", "OUT", "--kl-weight", "-1"], "--kl-weight"),
    (["--init", "INIT", "--out", "OUT", "--opaque-options", "1.5"], "--opaque-options"),
    (["--init", "INIT", "--out", "OUT", "--opaque-options", "some"], "--opaque-options"),
])
def test_bad_flags_are_one_line_naming_the_flag(argv, flag, laya_tiny_bert, tmp_path, capsys):
    from serving.cli import main

    subst = {"INIT": laya_tiny_bert, "OUT": str(tmp_path / "out"), "MISSING": str(tmp_path / "nowhere")}
    rc = main(["laya-mini", "finetune", *[subst.get(a, a) for a in argv]])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and flag in err, err
    assert not (tmp_path / "out").exists()


def test_head_dir_publishes_a_head_that_assembles_to_the_fine_tuned_answers(data, tmp_path):  # noqa: F811
    """`--head-dir`: the shards + manifest `make model` assembles, carrying the layers the init head had trained
    plus what this run trained, and reproducing the fine-tuned checkpoint's probe answer."""
    from laya.training import mini

    out, head = tmp_path / "ft", tmp_path / "head"
    cfg = FinetuneConfig(init=str(mini.ensure()), out=str(out), data=str(data), steps=1, batch_size=4,
                         window_batches=1, mix={"tickets": 1.0}, corpus=TINY_CORPUS, intents_calib=0, threads=1,
                         head_dir=str(head))
    finetune(cfg, progress=False)
    manifest = json.loads((head / "manifest.json").read_text())
    shipped = json.loads((mini.HEAD_DIR / "manifest.json").read_text())
    assert manifest["trained_encoder_prefixes"] == shipped["trained_encoder_prefixes"]   # the init head's trained layers (all 6 since round 5)
    assert manifest["build"]["recipe"]["steps"] == 1 and json.loads((head / "metrics.json").read_text())["test"]
    assembled = mini.assemble(tmp_path / "assembled", head)          # verifies the probe within 0.002
    state, questions = scenario()
    want = laya.load(str(out)).predict(state, questions)["answers"]
    assert laya.load(str(assembled)).predict(state, questions)["answers"] == want


def test_zero_steps_refit_only_the_temperatures_and_the_head_digest_follows_them(data, tmp_path):  # noqa: F811
    """`--steps 0` (how a calib-file change reaches the shipped head): the weights come back bit for bit, the
    temperatures are refitted on a calib file that holds the hand-written calibration tickets, and the published
    head's digest changes with its config alone, so `is_built` rebuilds an assembled checkpoint of the old one."""
    from laya.corpus import handwritten
    from laya.training import mini

    init = mini.ensure()
    out, head = tmp_path / "ft", tmp_path / "head"
    cfg = FinetuneConfig(init=str(init), out=str(out), data=str(data), steps=0, mix={"tickets": 1.0},
                         corpus=TINY_CORPUS, intents_calib=0, threads=1, head_dir=str(head))
    summary = finetune(cfg, progress=False)
    assert summary["steps"] == 0 and summary["steps_by_source"] == {"tickets": 0}
    w0, w1 = load_file(str(init / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)
    calib = [json.loads(line) for line in (out / "calib.jsonl").read_text().splitlines()]
    n_tickets = len(handwritten.read_tickets(handwritten.default_tickets(handwritten.CALIB_FILE)))
    assert sum(ex.get("source") == handwritten.SOURCE for ex in calib) == n_tickets
    manifest = json.loads((head / "manifest.json").read_text())
    shipped = json.loads((mini.HEAD_DIR / "manifest.json").read_text())
    assert manifest["shards"] == shipped["shards"]                       # the same tensors, byte for byte
    assert manifest["config"]["temperature"] != shipped["config"]["temperature"]
    assert manifest["head_sha256"] != shipped["head_sha256"]
    assert mini.is_built(init) and not mini.is_built(init, head)

    cfg.calib_sources, cfg.out, cfg.head_dir = ["tickets", "reviews"], str(tmp_path / "ft2"), ""
    finetune(cfg, progress=False)
    assert not any(handwritten.SOURCE in line for line in (tmp_path / "ft2" / "calib.jsonl").read_text().splitlines())


@pytest.mark.parametrize("argv, progress", [([], True), (["--no-progress"], False)])
def test_no_progress_reaches_the_run(argv, progress, laya_tiny_bert, tmp_path, monkeypatch):
    """`--no-progress` keeps a log free of progress bars (a 23-minute `make model-finetune` writes thousands)."""
    import laya.training.finetune as ft
    from serving.cli import main

    seen = {}

    def fake(cfg, progress=True):
        seen["progress"] = progress
        return {"steps": cfg.steps, "threads": 1, "times_s": {"train": 0.0, "total": 0.0},
                "calib": {"ece15_before": 0.0, "ece15_after": 0.0}}

    monkeypatch.setattr(ft, "finetune", fake)
    assert main(["laya-mini", "finetune", "--init", laya_tiny_bert, "--out", str(tmp_path / "out"), *argv]) == 0
    assert seen == {"progress": progress}
