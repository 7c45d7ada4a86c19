"""`laya.training.trainer` on tiny checkpoints: it learns, it is reproducible, it resumes exactly, it rejects bad data."""

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import laya
from laya.rows import Budgets
from laya.training.examples import Augment, encode, items_from_example, read_jsonl
from laya.training.losses import LossWeights
from laya.training.trainer import TrainConfig, evaluate, train

CHOICE = {"type": "choice", "instructions": "department",
          "criteria": {"billing": "payments", "technical": "bugs", "shipping": "parcels", "other": "the rest"}}
NOUL = {"type": "noul", "instructions": "Is the customer angry?"}
SCORE = {"type": "score", "instructions": "urgency", "criteria": ["low", "medium", "high"]}


def _examples():
    rng = random.Random(0)
    out = []
    for i in range(24):
        dept = ["billing", "technical", "shipping", "other"][i % 4]
        out.append({"state": f"ticket {i} about {dept} stuff", "questions": {"d": CHOICE, "a": NOUL, "u": SCORE},
                    "labels": {"d": dept, "a": i % 3 == 0, "u": i % 3}})
    # soft targets are training data too
    out.append({"state": "maybe billing", "questions": {"d": CHOICE},
                "targets": {"d": {"billing": 0.7, "other": 0.3}}})
    rng.shuffle(out)
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("train") / "train.jsonl"
    path.write_text("".join(json.dumps(ex) + "\n" for ex in _examples()))
    return str(path)


def _cfg(ckpt, data, out, **kw):
    base = dict(data=data, out=str(out), init=ckpt, batch_size=8, lr=3e-3, encoder_lr=1e-3, max_steps=6,
                eval_every=100, save_every=3, threads=1, loss=LossWeights(1.0, 0.5, 1.0), max_len=64, head_max_len=48)
    base.update(kw)
    return TrainConfig(**base)


def test_training_lowers_the_loss_and_writes_a_loadable_checkpoint(laya_tiny_bert, data, tmp_path):
    items = read_jsonl(data)
    agent = laya.load(laya_tiny_bert)
    budgets = Budgets(64, 48)
    before = evaluate(agent.model, agent.tokenizer, items, budgets)
    train(_cfg(laya_tiny_bert, data, tmp_path / "run", max_steps=40, shuffle_options=0.0, option_subsets=0.0),
          progress=False)
    trained = laya.load(str(tmp_path / "run"))
    after = evaluate(trained.model, trained.tokenizer, items, budgets)
    assert after["nll"] < before["nll"] - 0.1
    out = trained.predict("ticket 3 about billing stuff", {"d": CHOICE, "a": NOUL, "u": SCORE})
    assert set(out["answers"]) == {"d", "a", "u"}
    cfg = json.loads((tmp_path / "run" / "rl_agent_config.json").read_text())
    assert cfg["training"]["step"] == 40
    assert (tmp_path / "run" / "train_summary.json").is_file()


def test_same_seed_same_weights_and_resume_is_exact(laya_tiny_bert, data, tmp_path):
    train(_cfg(laya_tiny_bert, data, tmp_path / "a"), progress=False)
    train(_cfg(laya_tiny_bert, data, tmp_path / "b"), progress=False)
    wa = load_file(str(tmp_path / "a" / "model.safetensors"))
    wb = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert all((wa[k] == wb[k]).all() for k in wa)
    # interrupt after 3 of 6 steps, then resume
    train(_cfg(laya_tiny_bert, data, tmp_path / "c", stop_at=3), progress=False)
    train(_cfg(laya_tiny_bert, data, tmp_path / "c", resume=True), progress=False)
    wc = load_file(str(tmp_path / "c" / "model.safetensors"))
    assert all((wa[k] == wc[k]).all() for k in wa)
    other = train(_cfg(laya_tiny_bert, data, tmp_path / "d", seed=1), progress=False)
    wd = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert other["steps"] == 6 and any((wa[k] != wd[k]).any() for k in wa)


def test_frozen_encoder_stays_frozen_and_fresh_head_from_encoder_folder(laya_tiny_bert, data, tmp_path):
    src = laya.load(laya_tiny_bert)
    enc = tmp_path / "encoder"
    src.model.encoder.save_pretrained(str(enc))
    src.tokenizer.save(str(enc))
    train(_cfg(None, data, tmp_path / "fresh", encoder=str(enc), encoder_lr=0.0, head_layers=1), progress=False)
    w = load_file(str(tmp_path / "fresh" / "model.safetensors"))
    ref = {k: v.float() for k, v in src.model.state_dict().items()}
    enc_keys = [k for k in w if k.startswith("encoder.")]
    assert enc_keys and all(((w[k].float() - ref[k]).abs() < 1e-6).all() for k in enc_keys if k in ref)
    assert "head.layers.0.linear1.weight" in w and "head.layers.1.linear1.weight" not in w
    assert laya.load(str(tmp_path / "fresh")).predict("x", {"a": NOUL})["answers"]["a"]["noul"] >= 0


def test_option_order_and_subsets_keep_the_target_on_its_option(laya_tiny_bert):
    tok = laya.load(laya_tiny_bert).tokenizer
    item = items_from_example({"state": "s", "questions": {"d": CHOICE}, "labels": {"d": "shipping"}}, "x")[0]
    rng = random.Random(0)
    seen_slots, seen_sizes = set(), set()
    for _ in range(40):
        row, target = encode(tok, item, Budgets(64, 48), rng, Augment(shuffle=1.0, subset=0.5))
        gold = target.index(1.0)
        ids = row.input_ids[row.markers[gold] + 1: (row.markers[gold + 1] if gold + 1 < len(row.markers) else None)]
        assert tok.tokenizer.decode(ids).replace(" ", "").startswith("shipping")
        seen_slots.add(gold)
        seen_sizes.add(len(target))
    assert len(seen_slots) >= 3 and len(seen_sizes) >= 2


@pytest.mark.parametrize("example, message", [
    ({"questions": {"d": CHOICE}, "labels": {"d": "billing"}}, "field 'state' is missing"),
    ({"state": 3, "questions": {"d": CHOICE}, "labels": {"d": "billing"}}, "state"),
    ({"state": "s", "questions": {"d": CHOICE}, "labels": {"d": "plumbing"}}, "question 'd': field 'labels'"),
    ({"state": "s", "questions": {"d": CHOICE}}, "question 'd': field 'labels': no label"),
    ({"state": "s", "questions": {"u": SCORE}, "labels": {"u": 3}}, "question 'u': field 'labels'"),
    ({"state": "s", "questions": {"a": NOUL}, "labels": {"a": "maybe"}}, "noul label must be true or false"),
    ({"state": "s", "questions": {"d": CHOICE}, "targets": {"d": {"billing": 0.5}}}, "sum to 1"),
    ({"state": "s", "questions": {"d": CHOICE}, "labels": {"x": "billing", "d": "billing"}}, "question 'x'"),
    ({"state": "s", "questions": {"d": {"type": "choice", "instructions": "x", "criteria": []}},
      "labels": {"d": "a"}}, "question 'd': field 'criteria'"),
])
def test_bad_examples_name_the_question_and_field(example, message):
    with pytest.raises(ValueError, match=message):
        items_from_example(example, "data.jsonl:1")


def test_bad_file_and_config(tmp_path, laya_tiny_bert):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"state": "s", "questions": {"a": {"type": "noul", "instructions": "x"}}, "labels": {"a": true}}\n{oops\n')
    with pytest.raises(ValueError, match="^--data: .*bad.jsonl:2: not valid JSON"):
        read_jsonl(str(bad))
    with pytest.raises(ValueError, match="^--eval-data: .*missing.jsonl does not exist"):
        read_jsonl(str(tmp_path / "missing.jsonl"), "--eval-data")
    (tmp_path / "blank.jsonl").write_text("\n \n")
    with pytest.raises(ValueError, match="^--data: .*blank.jsonl holds no examples"):
        read_jsonl(str(tmp_path / "blank.jsonl"))
    with pytest.raises(ValueError, match="exactly one of --init"):
        TrainConfig(data="x", out="y").validate()
    for name, flag in (("batch_size", "--batch-size"), ("max_steps", "--max-steps"), ("eval_every", "--eval-every")):
        with pytest.raises(ValueError, match=f"^{flag}: must be a positive integer, got 0"):  # named its field
            TrainConfig(data="x", out="y", init="z", **{name: 0}).validate()
    for flag, lr in (("--lr", 1e308), ("--lr", -1e-3), ("--encoder-lr", 2.0)):  # 1e308 trained NaNs, exit 0
        with pytest.raises(ValueError, match=f"{flag}: must be a learning rate in \\[0, 1\\]"):
            TrainConfig(data="x", out="y", init="z", **{flag[2:].replace("-", "_"): lr}).validate()
    for threads in (0, 99999, 2.0):  # 99999 segfaulted torch at the first op
        with pytest.raises(ValueError, match="--threads: must be an integer from 1 to 1024"):
            TrainConfig(data="x", out="y", init="z", threads=threads).validate()
    for layers in (-2, 0):  # trained no layer at all before
        with pytest.raises(ValueError, match="encoder_layers"):
            TrainConfig(data="x", out="y", init="z", encoder_lr=1e-3, encoder_layers=layers).validate()


@pytest.mark.parametrize("flag", ["--max-len", "--head-max-len"])
def test_a_budget_past_the_encoders_positions_is_refused_before_training(flag, laya_tiny_bert, data, tmp_path, capsys):
    """The tiny BERT has 1024 positions: 4000 trained silently on short states, and failed with a tensor-size
    traceback once a state was long enough, where predict refuses the same budget by name."""
    from serving.cli import main

    argv = [flag, "4000"]
    assert main(["train", "--data", data, "--init", laya_tiny_bert, "--out", str(tmp_path / "o"), "--threads", "1",
                 "--max-steps", "1", "--no-progress", *argv]) == 2
    err = capsys.readouterr().err
    assert f"{flag}: 4000 is more than the encoder's 1024 positions" in err, err
    assert not (tmp_path / "o").exists()


def test_a_loss_that_turns_nan_stops_the_run_at_that_step(laya_tiny_bert, data, tmp_path, monkeypatch):
    """A diverged run used to train on NaNs to the end, exit 0 and save them; now it stops naming the step and
    the flag to lower, with no summary written."""
    import laya.training.losses as losses

    real, calls = losses.proper_loss, []

    def nan_from_step_3(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs) * (float("nan") if len(calls) >= 3 else 1.0)

    monkeypatch.setattr(losses, "proper_loss", nan_from_step_3)
    with pytest.raises(ValueError, match=r"train: the loss is nan at step 3, training diverged: lower --lr \(0\.003\) "
                                         r"or --encoder-lr \(0\.001\)"):
        train(_cfg(laya_tiny_bert, data, tmp_path / "nan"), progress=False)
    assert len(calls) == 3 and not (tmp_path / "nan" / "train_summary.json").exists()


@pytest.mark.parametrize("kw, message", [
    ({"stop_at": 0}, "--stop-at: must be a step >= 1"),    # was ignored: the run went on to its end
    ({"stop_at": -1}, "--stop-at: must be a step >= 1"),   # saved nothing, then missed its train_summary.json
    ({"head_layers": -1}, "--head-layers: must be an integer >= 0, got -1"),  # trained, then refused at load
])
def test_values_refused_before_training(kw, message, laya_tiny_bert, data, tmp_path, capsys):
    from serving.cli import main

    with pytest.raises(ValueError, match=message):
        TrainConfig(data="x", out="y", encoder="z", **kw).validate()
    flag, value = next(iter(kw.items()))
    assert main(["train", "--data", data, "--encoder", laya_tiny_bert, "--out", str(tmp_path / "o"), "--threads", "1",
                 f"--{flag.replace('_', '-')}", str(value)]) == 2
    assert capsys.readouterr().err.strip() == f"pagoda train: error: {message}" + (
        f" (the run stops after it), got {value}" if flag == "stop_at" else "")
    assert not (tmp_path / "o").exists()


def _train_cli(ckpt, data, out, *argv):
    from serving.cli import main

    return main(["train", "--data", data, "--init", ckpt, "--out", str(out), "--threads", "1", "--max-len", "64",
                 "--head-max-len", "48", "--batch-size", "8", "--max-steps", "6", "--encoder-lr", "1e-3",
                 "--no-progress", *argv])


@pytest.mark.parametrize("argv, message", [
    (["--batch-size", "4"], "--batch-size: the run in {out} was saved with 8, got 4"),  # replayed another plan
    (["--max-steps", "2"], "--max-steps: the run in {out} was saved with 6, got 2"),    # summary claimed step 2
    (["--seed", "1"], "--seed: the run in {out} was saved with 0, got 1"),
    (["--lr", "0.1"], "--lr: the run in {out} was saved with 0.003, got 0.1"),
    (["--encoder-lr", "0"], "--encoder-lr: the run in {out} was saved with 0.001, got 0.0"),  # torch's group error
])
def test_resume_refuses_settings_its_save_was_not_made_with(argv, message, laya_tiny_bert, data, tmp_path, capsys):
    """These resumed exit 0 from a plan, schedule or optimizer state that was not theirs."""
    out = tmp_path / "r"
    assert _train_cli(laya_tiny_bert, data, out, "--lr", "0.003", "--stop-at", "3") == 0
    saved = load_file(str(out / "model.safetensors"))
    capsys.readouterr()
    assert _train_cli(laya_tiny_bert, data, out, "--lr", "0.003", "--resume", *argv) == 2
    assert capsys.readouterr().err.strip() == (f"pagoda train: error: {message.format(out=out)}; resume with the "
                                               "settings it was started with")
    assert all(torch.equal(saved[k], v) for k, v in load_file(str(out / "model.safetensors")).items())
    assert json.loads((out / "train_summary.json").read_text())["steps"] == 3


@pytest.mark.parametrize("stop_at", [2, 3])
def test_resume_refuses_a_stop_at_not_past_the_saved_step(stop_at, laya_tiny_bert, data, tmp_path, capsys):
    """It replayed the plan up to --stop-at, saved nothing and wrote a summary claiming that step, exit 0."""
    out = tmp_path / "r"
    assert _train_cli(laya_tiny_bert, data, out, "--stop-at", "3") == 0
    capsys.readouterr()
    assert _train_cli(laya_tiny_bert, data, out, "--resume", "--stop-at", str(stop_at)) == 2
    assert capsys.readouterr().err.strip() == (f"pagoda train: error: --stop-at: step {stop_at} is not past step 3, "
                                               f"where the run in {out} was saved; give a later step, or none to run "
                                               "to the end")
    assert json.loads((out / "train_summary.json").read_text())["steps"] == 3
    assert _train_cli(laya_tiny_bert, data, out, "--resume", "--stop-at", "4") == 0
    summary = json.loads((out / "train_summary.json").read_text())
    # examples_seen is this process's part of the run, one step of 8 (it read as if steps 1-4 had seen 8)
    assert (summary["steps"], summary["resumed_from"], summary["examples_seen"]) == (4, 3, 8)


def test_resume_refuses_other_data_and_a_schedule_that_ended_before_the_save(laya_tiny_bert, data, tmp_path):
    out = tmp_path / "r"
    train(_cfg(laya_tiny_bert, data, out, stop_at=3), progress=False)
    fewer = tmp_path / "fewer.jsonl"
    fewer.write_text("".join(Path(data).read_text().splitlines(keepends=True)[:10]))
    with pytest.raises(ValueError, match=f"--data: the run in {out} was saved training on 73 items, {fewer} holds 30"):
        train(_cfg(laya_tiny_bert, str(fewer), out, resume=True), progress=False)
    state = torch.load(out / "trainer_state.pt", weights_only=False)
    del state["run"]    # a save from before the settings were recorded: only its step is known
    torch.save(state, out / "trainer_state.pt")
    with pytest.raises(ValueError, match=f"--max-steps: 2 ends the run at step 2, before step 3, where the run in "
                                         f"{out} was saved"):
        train(_cfg(laya_tiny_bert, data, out, resume=True, max_steps=2), progress=False)
    assert train(_cfg(laya_tiny_bert, data, out, resume=True), progress=False)["steps"] == 6


def test_resume_refuses_a_folder_without_a_save_and_a_run_that_ended(laya_tiny_bert, data, tmp_path):
    """Both went on, exit 0: a wrong --out trained a new run from step 0, and a finished run's summary was rewritten
    as a run that saw no example."""
    with pytest.raises(ValueError, match=f"--resume: {tmp_path / 'none'} holds no save to continue from"):
        train(_cfg(laya_tiny_bert, data, tmp_path / "none", resume=True), progress=False)
    assert not (tmp_path / "none").exists()
    out = tmp_path / "done"
    train(_cfg(laya_tiny_bert, data, out), progress=False)
    summary = (out / "train_summary.json").read_text()
    with pytest.raises(ValueError, match=f"--resume: the run in {out} already ended at step 6; nothing to continue"):
        train(_cfg(laya_tiny_bert, data, out, resume=True), progress=False)
    assert (out / "train_summary.json").read_text() == summary


@pytest.mark.parametrize("flag", ["--data", "--eval-data"])
def test_a_data_file_not_in_utf8_is_one_line_naming_its_flag(flag, laya_tiny_bert, data, tmp_path, capsys):
    """It was "'utf-8' codec can't decode byte 0xe9 in position 14", a position in a read buffer, no flag named."""
    from serving.cli import main

    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(Path(data).read_bytes() + '{"state": "caf\u00e9"}\n'.encode("latin-1"))
    offset = len(Path(data).read_bytes()) + len('{"state": "caf')
    files = {"--data": data, "--eval-data": data, flag: str(latin1)}
    assert main(["train", *[a for f in files.items() for a in f], "--init", laya_tiny_bert, "--out",
                 str(tmp_path / "o"), "--threads", "1", "--no-progress"]) == 2
    assert capsys.readouterr().err.strip() == (f"pagoda train: error: {flag}: {latin1} is not UTF-8: byte 0xe9 at "
                                               f"offset {offset} (line 26); save it as UTF-8")
    assert not (tmp_path / "o").exists()


def test_the_utf8_check_counts_offsets_across_its_reads(tmp_path):
    from laya.checks import check_utf8

    text = tmp_path / "t.txt"
    text.write_bytes(b"a\n" * 40000 + "\u00e9\u20ac".encode() + b"\xff")   # past the first 64 KiB read
    with pytest.raises(ValueError, match=r"^-x: .* is not UTF-8: byte 0xff at offset 80005 \(line 40001\)"):
        check_utf8(text, "-x")
    text.write_bytes(b"a" * 65535 + "\u20ac".encode())   # a character split by the reads is fine
    check_utf8(text, "-x")
    text.write_bytes(b"ok\n" + "\u20ac".encode()[:2])   # one cut at the end is not
    with pytest.raises(ValueError, match=r"byte 0xe2 at offset 3 \(line 2\)"):
        check_utf8(text, "-x")


@pytest.mark.parametrize("argv, bar", [([], True), (["--no-progress"], False)])
def test_cli(argv, bar, laya_tiny_bert, data, tmp_path, capsys):
    from serving.cli import main

    assert main(["train", "--data", data, "--init", laya_tiny_bert, "--out", str(tmp_path / "cli"), "--max-steps", "2",
                 "--batch-size", "4", "--threads", "1", "--max-len", "64", "--head-max-len", "48", *argv]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["steps"] == 2
    assert ("2/2" in out.err) is bar  # the progress bar's count, on stderr, only without --no-progress
    assert Path(tmp_path / "cli" / "model.safetensors").is_file()


def test_only_the_top_encoder_layers_train(laya_tiny_bert, data, tmp_path):
    from laya.training.trainer import encoder_layer_prefixes

    src = laya.load(laya_tiny_bert)
    top = encoder_layer_prefixes(src.model, 1)
    assert top == ["encoder.encoder.layer.1."]
    train(_cfg(laya_tiny_bert, data, tmp_path / "top", encoder_lr=1e-2, encoder_layers=1), progress=False)
    w = load_file(str(tmp_path / "top" / "model.safetensors"))
    ref = {k: v.float() for k, v in src.model.state_dict().items()}
    changed = {k for k in w if k.startswith("encoder.") and not torch.equal(w[k].float(), ref[k])}
    assert changed and all(k.startswith(top[0]) for k in changed)
    with pytest.raises(ValueError, match="--encoder-layers: 3 is more than the encoder's 2 layers"):  # trained all 2
        train(_cfg(laya_tiny_bert, data, tmp_path / "three", encoder_lr=1e-2, encoder_layers=3), progress=False)
    assert len(encoder_layer_prefixes(src.model, 3)) == 2  # laya-mini's recipes ask "at most n": all there are


def test_an_encoder_folder_without_its_config_is_named(data, tmp_path):
    """transformers said only "Unrecognized model in ...", naming no flag."""
    (tmp_path / "enc").mkdir()
    with pytest.raises(FileNotFoundError, match=r"^--encoder: .*enc holds no config.json"):
        train(TrainConfig(data=data, out=str(tmp_path / "o"), encoder=str(tmp_path / "enc")), progress=False)


def _claim_bf16_units(monkeypatch, units: bool) -> None:
    """Make `laya.precision.detect` report (or deny) bf16 units: CPU autocast runs, emulated, on any x86 CPU,
    so the bf16 training path is testable on machines without the units."""
    import laya.precision as precision

    flags = frozenset({"avx2", "avx512_bf16"} if units else {"avx2"})
    monkeypatch.setattr(precision, "detect", lambda: precision.CpuFeatures("test cpu", flags, 2))


def test_training_precision_is_checked_by_name(monkeypatch):
    with pytest.raises(ValueError, match="--precision: expected one of fp32, bf16, got 'fp16'"):
        TrainConfig(data="x", out="y", init="z", precision="fp16").validate()
    _claim_bf16_units(monkeypatch, False)
    with pytest.raises(ValueError, match=r"--precision: 'bf16' autocast needs a CPU with amx_bf16 or avx512_bf16; "
                                         r"this CPU \(test cpu\)"):
        TrainConfig(data="x", out="y", init="z", precision="bf16").validate()
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    TrainConfig(data="x", out="y", init="z", precision="bf16", device="cuda").validate()   # GPUs have bf16


def test_a_device_torch_cannot_use_is_refused_by_name(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"--device: 'cuda' is not available to this torch \("):
        TrainConfig(data="x", out="y", init="z", device="cuda").validate()
    with pytest.raises(ValueError, match="--device: 'gpu0' is not a device name"):
        TrainConfig(data="x", out="y", init="z", device="gpu0").validate()


def test_bf16_autocast_trains_fp32_weights_reproducibly(laya_tiny_bert, data, tmp_path, monkeypatch):
    from laya.checkpoint import load_checkpoint
    from laya.training.trainer import use_precision

    _claim_bf16_units(monkeypatch, True)
    train(_cfg(laya_tiny_bert, data, tmp_path / "fp32", max_steps=4, save_every=100), progress=False)
    for run in ("a", "b"):
        train(_cfg(laya_tiny_bert, data, tmp_path / run, max_steps=4, save_every=100, precision="bf16"),
              progress=False)
    a, b, f = (load_file(str(tmp_path / r / "model.safetensors")) for r in ("a", "b", "fp32"))
    assert all(torch.equal(a[k], b[k]) for k in a)                         # same seed, same bits
    assert {v.dtype for v in a.values()} == {v.dtype for v in f.values()}    # the layout does not change
    key = "scorer.1.weight"
    assert not torch.equal(a[key], f[key])                                   # the forward really was bf16
    assert (a[key].float() - f[key].float()).abs().max() < 0.05              # ... and learned the same thing
    assert json.loads((tmp_path / "a" / "train_summary.json").read_text())["config"]["precision"] == "bf16"
    model = load_checkpoint(laya_tiny_bert)[0]
    use_precision(model, "fp32", "cpu")
    assert model.encoder.config._attn_implementation == "sdpa"
    use_precision(model, "bf16", "cpu")                                      # CPU flash backward is slow in bf16
    assert model.encoder.config._attn_implementation == "eager"
