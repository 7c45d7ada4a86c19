"""`pagoda laya-mini finetune --seeds`: a soup's weights are the F16 mean of its members, each member is the run
`--seed` alone would write, the temperatures are fitted on the members' calib rows pooled, `--head-dir` publishes
the soup; bad `--seeds` are one line naming the flag, rc 2, nothing trained."""

import json

import pytest
import torch
from safetensors.torch import load_file
from test_mini_eval import data  # noqa: F401  (the tiny CLINC150/Snips folder fixture)
from test_mini_finetune import TINY_CORPUS

import laya
from laya.scenarios import load as scenario
from laya.training.finetune import FinetuneConfig, finetune
from laya.training.soup import soup


def _cfg(init: str, out, data, **kw) -> FinetuneConfig:  # noqa: F811
    # lr 1e-2 so 2 Adam steps move the members apart far beyond F16 rounding
    return FinetuneConfig(init=init, out=str(out), data=str(data), steps=2, batch_size=8, window_batches=2,
                          lr=1e-2, encoder_lr=1e-2, mix={"intents": 0.5, "tickets": 0.5}, corpus=TINY_CORPUS,
                          intents_calib=20, threads=1, **kw)


def test_soup_is_the_mean_of_members_that_match_their_lone_runs(laya_tiny_bert, data, tmp_path):  # noqa: F811
    out = tmp_path / "soup"
    summary = soup(_cfg(laya_tiny_bert, out, data), [1, 2], progress=False)
    m1, m2 = out / "members" / "seed-1", out / "members" / "seed-2"
    w1, w2, ws = (load_file(str(p / "model.safetensors")) for p in (m1, m2, out))
    assert w1.keys() == ws.keys()
    assert not torch.equal(w1["scorer.1.weight"], w2["scorer.1.weight"])               # the seeds differ
    for k in ws:
        assert ws[k].dtype == w1[k].dtype == torch.float16
        assert torch.equal(ws[k], ((w1[k].double() + w2[k].double()) / 2).to(torch.float16)), k

    # a member trained after another in the same process is the run `--seed 2` writes alone
    alone = tmp_path / "alone"
    finetune(_cfg(laya_tiny_bert, alone, data, seed=2), progress=False)
    lone = load_file(str(alone / "model.safetensors"))
    assert all(torch.equal(lone[k], w2[k]) for k in lone)

    rows = {line for m in (m1, m2) for line in (m / "calib.jsonl").read_text().splitlines()}
    assert set((out / "calib.jsonl").read_text().splitlines()) == rows
    assert len((out / "calib.jsonl").read_text().splitlines()) == len(rows)          # unique rows
    stored = json.loads((out / "rl_agent_config.json").read_text())
    assert stored["temperature"] == [round(t, 4) for t in summary["temperature"]]
    assert stored["laya_mini"]["fine_tune"]["seeds"] == [1, 2] and "seed" not in stored["laya_mini"]["fine_tune"]
    assert summary["seeds"] == [1, 2] and set(summary["members"]) == {"1", "2"}
    state, questions = scenario()
    answers = laya.load(str(out)).predict(state, questions)["answers"]
    assert answers["department"]["probabilities"] != \
        laya.load(str(m1)).predict(state, questions)["answers"]["department"]["probabilities"]


def test_head_dir_publishes_the_soup_not_a_member(data, tmp_path):  # noqa: F811
    from laya.training import mini

    out, head = tmp_path / "soup", tmp_path / "head"
    cfg = FinetuneConfig(init=str(mini.ensure()), out=str(out), data=str(data), steps=1, batch_size=4,
                         window_batches=1, mix={"tickets": 1.0}, corpus=TINY_CORPUS, intents_calib=0, threads=1,
                         head_dir=str(head))
    soup(cfg, [3, 4], progress=False)
    manifest = json.loads((head / "manifest.json").read_text())
    assert manifest["build"]["recipe"]["seeds"] == [3, 4] and manifest["build"]["how"].endswith("--seeds")
    assert not (out / "members" / "seed-3" / "manifest.json").exists()
    assembled = mini.assemble(tmp_path / "assembled", head)          # verifies the probe within 0.002
    state, questions = scenario()
    assert laya.load(str(assembled)).predict(state, questions)["answers"] == \
        laya.load(str(out)).predict(state, questions)["answers"]


@pytest.mark.parametrize("argv", [
    ["--seeds", "6"],
    ["--seeds", "6,6"],
    ["--seeds", "6,x"],
    ["--seeds", "6,7", "--seed", "1"],
    ["--seeds", "6,7", "--steps", "0"],
])
def test_bad_seeds_are_one_line_naming_the_flag(argv, laya_tiny_bert, tmp_path, capsys):
    from serving.cli import main

    rc = main(["laya-mini", "finetune", "--init", laya_tiny_bert, "--out", str(tmp_path / "out"), *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "--seeds" in err, err
    assert not (tmp_path / "out").exists()


def test_soup_command_averages_finished_checkpoints(laya_tiny_bert, data, tmp_path):  # noqa: F811
    """`pagoda laya-mini soup`: the mean of checkpoints already trained (how round 6 joined two recipes), the
    temperatures fitted on the calib rows of the members that carry them; an assembled member carries none."""
    import shutil
    from dataclasses import replace

    from serving.cli import main

    a, b = tmp_path / "a", tmp_path / "b"
    finetune(_cfg(laya_tiny_bert, a, data, seed=1), progress=False)
    finetune(replace(_cfg(laya_tiny_bert, b, data, seed=2), mix={"tickets": 1.0}), progress=False)
    bare = tmp_path / "bare"                                       # like models/laya-mini: no calib.jsonl
    shutil.copytree(a, bare)
    (bare / "calib.jsonl").unlink()
    out = tmp_path / "soup"
    assert main(["laya-mini", "soup", "--members", str(bare), str(b), "--out", str(out)]) == 0
    wa, wb, ws = (load_file(str(p / "model.safetensors")) for p in (bare, b, out))
    assert not torch.equal(wa["scorer.1.weight"], wb["scorer.1.weight"])
    for k in ws:
        assert torch.equal(ws[k], ((wa[k].double() + wb[k].double()) / 2).to(wa[k].dtype)), k
    assert (out / "calib.jsonl").read_text() == (b / "calib.jsonl").read_text()
    stored = json.loads((out / "rl_agent_config.json").read_text())
    recipe = stored["laya_mini"]["fine_tune"]
    assert recipe["soup_of"] == [str(bare), str(b)] and recipe["recipes"][1]["mix"] == {"tickets": 1.0}
    summary = json.loads((out / "finetune_summary.json").read_text())
    assert stored["temperature"] == [round(t, 4) for t in summary["temperature"]]
    state, questions = scenario()
    assert laya.load(str(out)).predict(state, questions)["answers"] != \
        laya.load(str(b)).predict(state, questions)["answers"]


@pytest.mark.parametrize("case,flag", [("one", "--members"), ("same", "--members"), ("missing", "--members"),
                                       ("out-is-member", "--out"), ("no-calib", "--members")])
def test_bad_soup_members_are_one_line_naming_the_flag(case, flag, laya_tiny_bert, tmp_path, capsys):
    import shutil

    from serving.cli import main

    a, b, out = tmp_path / "a", tmp_path / "b", tmp_path / "out"
    for m in (a, b):
        shutil.copytree(laya_tiny_bert, m)
    if case != "no-calib":
        (a / "calib.jsonl").write_text("")
    members = {"one": [a], "same": [a, a], "missing": [a, tmp_path / "nope"]}.get(case, [a, b])
    if case == "out-is-member":
        out = b
    rc = main(["laya-mini", "soup", "--members", *map(str, members), "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and flag in err, err
    assert not (tmp_path / "out").exists()
