"""`pagoda decide` and `pagoda bench decide` through the real CLI entry point, and the flags every laya command
shares."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from serving.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "laya" / "scenarios"


def test_decide_prints_answer_json(laya_tiny_bert, capsys):
    rc = main(["decide", "--model", laya_tiny_bert, "--state", "@" + str(EXAMPLES / "billing_state.txt"),
               "--questions", str(EXAMPLES / "billing_questions.json"), "--min-confidence", "0.5"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["answers"]) == {"department", "urgency", "churn_risk"}
    assert out["answers"]["urgency"]["abstention_threshold"] == 0.5
    import laya

    state = (EXAMPLES / "billing_state.txt").read_text().removesuffix("\n")
    questions = json.loads((EXAMPLES / "billing_questions.json").read_text())
    assert out == laya.load(laya_tiny_bert).predict(state, questions, min_confidence=0.5)


def test_decide_reports_bad_question_and_missing_file(laya_tiny_bert, tmp_path, capsys):
    bad = tmp_path / "q.json"
    bad.write_text(json.dumps({"q": {"type": "score", "instructions": "x", "criteria": ["one"]}}))
    assert main(["decide", "--model", laya_tiny_bert, "--state", "hi", "--questions", str(bad)]) == 2
    assert "question 'q': field 'criteria'" in capsys.readouterr().err
    assert main(["decide", "--model", str(tmp_path), "--state", "hi", "--questions", str(bad)]) == 2
    assert "rl_agent_config.json" in capsys.readouterr().err


def test_decide_takes_questions_as_at_file_or_inline_json(laya_tiny_bert, tmp_path, capsys):
    q = {"churn": {"type": "noul", "instructions": "Does the user threaten to leave?"}}
    path = tmp_path / "q.json"
    path.write_text(json.dumps(q))
    outs = []
    for arg in (str(path), "@" + str(path), json.dumps(q)):
        assert main(["decide", "--model", laya_tiny_bert, "--state", "refund or we cancel", "--questions", arg]) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert outs[0] == outs[1] == outs[2] and set(outs[0]["answers"]) == {"churn"}
    assert main(["decide", "--model", laya_tiny_bert, "--state", "hi", "--questions", "{nope"]) == 2
    assert "--questions: not valid JSON" in capsys.readouterr().err
    assert main(["decide", "--model", laya_tiny_bert, "--state", "hi", "--questions", "@" + str(tmp_path / "no.json")]) == 2
    assert "--questions: file not found" in capsys.readouterr().err


def test_decide_names_the_argument_and_file_it_could_not_read(laya_tiny_bert, tmp_path, capsys):
    """Broken JSON, JSON nested past Python's recursion limit, bytes that are not UTF-8: one line naming the
    flag and the file, exit 2, never a traceback."""
    q = tmp_path / "q.json"
    q.write_text(json.dumps({"churn": {"type": "noul", "instructions": "Does the user threaten to leave?"}}))
    files = {"broken.json": b'{"a": ', "deep.json": b"[" * 100_000 + b"]" * 100_000, "latin.txt": b"\xff\xfe caf\xe9"}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        for flag, args in (("--state", ["--state", f"@{tmp_path / name}", "--questions", str(q)]),
                           ("--questions", ["--state", "hi", "--questions", str(tmp_path / name)])):
            assert main(["decide", "--model", laya_tiny_bert, *args]) == 2, (name, flag)
            err = capsys.readouterr().err
            assert err.startswith(f"pagoda decide: error: {flag}: {tmp_path / name}") and "Traceback" not in err, err
    assert main(["decide", "--model", laya_tiny_bert, "--state", "@@home", "--questions", str(q)]) == 0
    assert json.loads(capsys.readouterr().out)["usage"]["state_tokens"] > 0  # the text "@home", not a file


def test_decide_names_the_model_flag_for_a_folder_that_is_not_there(laya_tiny_bert, tmp_path, capsys):
    """It said "checkpoint folder not found: /nowhere", naming no flag, where every other argument is named."""
    q = tmp_path / "q.json"
    q.write_text(json.dumps({"churn": {"type": "noul", "instructions": "Does the user threaten to leave?"}}))
    assert main(["decide", "--model", str(tmp_path / "nowhere"), "--state", "hi", "--questions", str(q)]) == 2
    assert capsys.readouterr().err == f"pagoda decide: error: --model: {tmp_path / 'nowhere'}: no such checkpoint folder\n"


@pytest.mark.parametrize("args, words", [
    (["--state", "hi", "--questions", ""], "--questions: no file named"),          # said "file not found: ."
    (["--state", "@", "--questions", "{}"], "--state: no file named"),
    (["--state", "@{tmp}", "--questions", "{}"], "--state: {tmp} is a folder, not a file"),  # said "file not found"
])
def test_decide_names_an_empty_path_and_a_folder(laya_tiny_bert, tmp_path, capsys, args, words):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    assert main(["decide", "--model", laya_tiny_bert, *args]) == 2
    assert capsys.readouterr().err.startswith(f"pagoda decide: error: {words.replace('{tmp}', str(tmp_path))}")


def test_decide_names_a_damaged_checkpoint_file(laya_tiny_bert, tmp_path, capsys):
    import shutil

    q = tmp_path / "q.json"
    q.write_text(json.dumps({"churn": {"type": "noul", "instructions": "Does the user threaten to leave?"}}))
    broken = tmp_path / "ck"
    shutil.copytree(laya_tiny_bert, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert main(["decide", "--model", str(broken), "--state", "hi", "--questions", str(q)]) == 2
    assert "model.safetensors" in (err := capsys.readouterr().err) and "truncated" in err, err
    shutil.rmtree(broken)
    shutil.copytree(laya_tiny_bert, broken)
    (broken / "rl_agent_config.json").write_text('{"max_len": 512,')
    assert main(["decide", "--model", str(broken), "--state", "hi", "--questions", str(q)]) == 2
    assert "rl_agent_config.json: not valid JSON" in capsys.readouterr().err


def test_bench_decide_runs(laya_tiny_bert, capsys):
    assert main(["bench", "decide", "--model", laya_tiny_bert, "--iters", "3", "--reference", "/nonexistent"]) == 0
    out = capsys.readouterr().out
    assert "p50 ms" in out and "input tokens" in out and "no reference runtime" in out
    rows = {line.split()[1] for line in out.splitlines() if line.startswith("pagoda ") and " ms" not in line
            and not line.startswith("pagoda exact:")}
    assert "exact" in rows, out  # the default precision is always timed, whatever the CPU offers


def test_registering_does_not_import_torch():
    code = ("import argparse, sys; from laya import cli; p = argparse.ArgumentParser(); s = p.add_subparsers(); "
            "b = s.add_parser('bench').add_subparsers(); cli.register(s, b); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.mark.parametrize("argv", [
    ["bench", "decide"], ["bench", "train"], ["train", "--data", "d", "--out", "o", "--init", "i"],
    ["laya-mini", "build"], ["laya-mini", "eval"],
])
@pytest.mark.parametrize("threads", ["99999", "0"])
def test_every_threads_flag_refuses_a_count_torch_cannot_run(argv, threads, capsys):
    """torch.set_num_threads(99999) segfaults or hangs at the first op: refused by argparse, before any work."""
    with pytest.raises(SystemExit) as exc:   # parsed only: a count that passed would run the command
        build_parser().parse_args([*argv, "--threads", threads])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "argument --threads: expected" in err, err
    assert build_parser().parse_args([*argv, "--threads", "1024"]).threads == 1024
