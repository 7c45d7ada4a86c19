"""`pagoda bench train`: both recipes really train at each precision and the table and JSON carry the ratio; bad
flags are one line naming the flag."""

import json

import pytest
from test_mini_eval import data  # noqa: F401  (the tiny CLINC150/Snips folder fixture)
from test_train import _claim_bf16_units

from laya.training.bench import run


def test_both_recipes_at_both_precisions(laya_tiny_bert, data, monkeypatch, capsys):  # noqa: F811
    _claim_bf16_units(monkeypatch, True)      # emulated bf16 where the units are missing: slow, but it runs
    assert run(("scratch", "finetune"), ("fp32", "bf16"), steps=2, warmup=1, threads=1, data=str(data),
               model=laya_tiny_bert) == 0
    out = capsys.readouterr().out.strip().splitlines()
    report = json.loads(out[-1])
    assert set(report["results"]) == {"scratch", "finetune"}
    for part, by in report["results"].items():
        assert set(by) == {"fp32", "bf16"}
        assert all(r["s_per_step"] > 0 and r["final_loss"] for r in by.values())
        rows = [line.split() for line in out if line.startswith(part + " ")]
        assert [r[1] for r in rows] == ["fp32", "bf16"] and rows[0][3] == "1.00x"
        ratio = by["fp32"]["s_per_step"] / by["bf16"]["s_per_step"]
        assert rows[1][3] == f"{ratio:.2f}x"


@pytest.mark.parametrize("argv, flag", [
    (["--part", "gpu"], "--part"),
    (["--precision", "fp16"], "--precision"),
    (["--steps", "0"], "--steps"),
    (["--part", "finetune", "--precision", "fp32", "--steps", "1", "--model", "NOWHERE"], "--model"),
    (["--part", "finetune", "--precision", "fp32", "--steps", "1", "--data", "NOWHERE"], "--data"),
])
def test_bad_flags_are_one_line_naming_the_flag(argv, flag, tmp_path, capsys):
    from serving.cli import main

    argv = [str(tmp_path / "nowhere") if a == "NOWHERE" else a for a in argv]
    assert main(["bench", "train", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and flag in err, err


def test_bf16_without_units_is_refused_by_name(monkeypatch, capsys):
    _claim_bf16_units(monkeypatch, False)
    assert run(("finetune",), ("fp32", "bf16"), steps=1) == 2
    assert "--precision: 'bf16' autocast needs a CPU with" in capsys.readouterr().err


def test_an_absurd_thread_count_is_refused_by_name(monkeypatch):
    """`run(threads=99999)` handed it to torch, which segfaulted (exit 139) at its first op."""
    import torch

    def no_threads(n):
        raise AssertionError(f"torch was given {n} threads")

    monkeypatch.setattr(torch, "set_num_threads", no_threads)
    with pytest.raises(ValueError, match="^--threads: must be an integer from 1 to 1024, got 99999$"):
        run(("scratch",), ("fp32",), steps=1, threads=99999)
