"""Bad flags of `pagoda generate` and the `pagoda bench` commands: one line naming the flag, exit status 2,
no traceback, and nothing loaded first (each case answers before any model is read)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from serving_support import REPO

from serving.cli import main

# argparse's own checks (type=int, choices) print the usage above their one error line
ARGPARSE = {"--seed", "--cache-backend", "--part", "--threads"}
README = str(REPO / "README.md")  # a file where a folder goes
CASES = [
    # (argv, the flag the error line must name)
    (["generate", "-p", "hi", "--model", "/nonexistent"], "--model"),
    (["generate", "-p", "hi", "--temperature", "-1"], "--temperature"),
    (["generate", "-p", "hi", "--temperature", "nan"], "--temperature"),
    (["generate", "-p", "hi", "--top-p", "0"], "--top-p"),
    (["generate", "-p", "hi", "--top-p", "1.5"], "--top-p"),
    (["generate", "-p", "hi", "--repeat", "0"], "--repeat"),
    (["generate", "-p", "hi", "--threads", "0"], "--threads"),
    (["generate", "-p", "hi", "--seed", "x"], "--seed"),
    (["generate", "-p", "hi", "--cache-backend", "lru"], "--cache-backend"),
    (["bench", "generate", "--requests", "0"], "--requests"),
    (["bench", "generate", "--prefix-tokens", "-5"], "--prefix-tokens"),
    (["bench", "generate", "--parts", "xyz"], "--parts"),
    (["bench", "generate", "--parts", ""], "--parts"),
    (["bench", "generate", "--model", "/nonexistent"], "--model"),
    (["bench", "generate", "--threads", "0"], "--threads"),
    (["bench", "constraints", "--steps", "0"], "--steps"),
    (["bench", "constraints", "--rounds", "0"], "--rounds"),
    (["bench", "constraints", "--model", "/nonexistent"], "--model"),
    (["bench", "constraints", "--part", "everything"], "--part"),
    (["bench", "decide", "--precision", "fp4"], "--precision"),
    (["bench", "decide", "--threads", "0"], "--threads"),
    (["train", "--data", "x", "--init", "y", "--out", "z", "--threads", "-1"], "--threads"),
    # non-finite numbers passed `>= 0`-style checks and trained a checkpoint of NaNs, exit 0
    (["train", "--data", "x", "--init", "y", "--out", "z", "--lr", "inf"], "--lr: must be a learning rate in [0, 1]"),
    (["train", "--data", "x", "--init", "y", "--out", "z", "--spherical", "nan"], "'spherical' must be a finite"),
    (["train", "--data", "x", "--init", "y", "--out", "z", "--epochs", "inf"], "epochs must be a finite number"),
    (["laya-mini", "finetune", "--init", "tests/fixtures/laya/bert-tiny", "--out", "/tmp/never", "--kl-weight", "inf"],
     "--kl-weight"),
    (["laya-mini", "eval", "--threads", "-1"], "--threads"),
    (["laya-mini", "build", "--from-scratch", "--work", "/tmp/never", "--spec", '{"bogus": 1}'], "--spec"),
    (["laya-mini", "build", "--from-scratch", "--work", "/tmp/never", "--spec", "[1]"], "--spec"),
    (["laya-mini", "build", "--from-scratch", "--work", "/tmp/never", "--spec", "notjson"], "--spec"),
    (["bench", "constraints", "--part", "engines", "--engines", "bogus"], "--engines"),
    (["bench", "serve", "--seconds", "0"], "--seconds"),
    (["bench", "serve", "--seconds", "inf"], "--seconds"),
    (["bench", "serve", "--warmup", "inf"], "--warmup"),
    (["bench", "serve", "--generate", "--hf-rounds", "-1"], "--hf-rounds"),
    (["bench", "gateway", "--requests", "0"], "--requests"),
    (["bench", "gateway", "--streams", "0"], "--streams"),
    (["bench", "gateway", "--new-tokens", "0"], "--new-tokens"),
    (["bench", "gateway", "--rounds", "0"], "--rounds"),
    (["bench", "gateway", "--seconds", "nan"], "--seconds"),
    (["bench", "serve", "--generate", "--single-rounds", "0"], "--single-rounds"),
    (["bench", "serve", "--generate", "--baseline-server", "/nonexistent/llama-server"], "--baseline-server"),
    (["bench", "serve", "--generate", "--baseline-python", README], "--baseline-python"),
    (["bench", "serve", "--reference", "none"], "--reference"),
    (["bench", "generate", "--device", "bogus"], "--device"),
    (["train", "--data", "x", "--init", "y", "--out", README], "--out"),
    (["calibrate", "--model", "x", "--data", "y", "--report", README], "--report"),
    (["laya-mini", "finetune", "--init", "x", "--out", README], "--out"),
    (["laya-mini", "soup", "--members", "a", "b", "--out", README], "--out"),
    (["laya-mini", "eval", "--out", README], "--out"),
    (["laya-mini", "build", "--from-scratch", "--work", README], "--work"),
    (["bench", "lang", "--url", "notaurl"], "--url"),
    (["bench", "lang", "--json", "/tmp"], "--json"),
    (["bench", "lang", "--json", "/nonexistent/x.json"], "--json"),
    (["bench", "constraints", "--json", "/tmp"], "--json"),
    (["bench", "lang", "--url", "http://127.0.0.1:9", "--no-http"], "--url"),
    (["bench", "soak", "--minutes", "0"], "--minutes"),
    (["bench", "soak", "--clients", "0"], "--clients"),
    (["bench", "soak", "--new-tokens", "0"], "--new-tokens"),
    (["bench", "soak", "--sample-s", "0"], "--sample-s"),
    (["bench", "distill", "--student", "models/students/support-triage", "--singles", "0"], "--singles"),
    (["bench", "distill", "--student", "models/students/support-triage", "--teacher", "/nonexistent"], "--teacher"),
]


# Torch takes any thread count, then segfaults or hangs starting its pool (99999 crashed `pagoda generate`). What
# each command would run next is stubbed, so a count that got past its check fails the test, not the machine.
TORCH_THREADS = [
    (["generate", "-p", "hi", "--threads", "99999"], "generation.engine.Engine", "--threads: must be at most 1024"),
    (["bench", "generate", "--threads", "99999"], "generation.bench.run", "--threads: must be at most 1024"),
    (["bench", "constraints", "--threads", "99999"], "generation.bench_constraints.compare_engines",
     "--threads: must be at most 1024"),
    (["bench", "lang", "--no-http", "--threads", "99999"], "generation.lang.bench.run",
     "--threads: must be at most 1024"),
    (["bench", "serve", "--torch-threads", "99999"], "serving.decide.bench.run_bench",
     "--torch-threads: expected 0..1024"),
    (["bench", "serve", "--generate", "--torch-threads", "99999"], "serving.generate.bench.run_bench",
     "--torch-threads: expected 0..1024"),
]


# Flags and variables a bench hands the servers it starts: each server refused them itself once started (after the
# model loaded, or after other servers were measured), as "bench serve" whatever the bench. Now refused before the
# first starts; starting one fails the test.
CHILD_FLAGS = [
    (["bench", "soak", "--model", "/nonexistent"], {}, "--model / PAGODA_MODEL /nonexistent: no such folder"),
    (["bench", "soak", "--torch-threads", "-1"], {}, "--torch-threads / PAGODA_TORCH_THREADS must be in 0..1024"),
    (["bench", "gateway", "--generate-model", "/nonexistent"], {},
     "--generate-model / PAGODA_GENERATE_MODEL /nonexistent: neither a model folder"),
    (["bench", "gateway", "--model", "/nonexistent"], {}, "--model / PAGODA_MODEL /nonexistent: no such file or folder"),
    (["bench", "gateway", "--model", README], {}, f"--model / PAGODA_MODEL {README}: no such folder"),
    (["bench", "serve", "--precision", "exact,fp4"], {}, "--precision / PAGODA_PRECISION must be one of"),
    (["bench", "serve", "--max-wait-ms", "-1"], {}, "--max-wait-ms / PAGODA_MAX_WAIT_MS must not be negative"),
    (["bench", "serve", "--preset", "bogus"], {}, "--preset: 'bogus' is not a shipped preset (one of support-triage"),
    (["bench", "serve", "--precision", ","], {}, "--precision / PAGODA_PRECISION: expected a comma list"),
    (["bench", "serve", "--generate"], {"PAGODA_GENERATE_KV_CACHE_MB": "0"},
     "--generate-kv-cache-mb / PAGODA_GENERATE_KV_CACHE_MB must be at least 1"),
]


def _run(argv, capsys) -> tuple[int, str]:
    try:
        rc = main(argv)
    except SystemExit as exc:   # argparse's own checks exit 2 through SystemExit
        rc = exc.code
    return rc, capsys.readouterr().err


@pytest.mark.parametrize(("argv", "flag"), CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_flag_is_one_line_naming_it(argv, flag, capsys):
    rc, err = _run(argv, capsys)
    assert rc == 2, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("pagoda ") and ": error: " in last and flag in last, err
    assert "Traceback" not in err
    if flag not in ARGPARSE:
        assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(("argv", "runs", "needle"), TORCH_THREADS, ids=[" ".join(a) for a, _, _ in TORCH_THREADS])
def test_a_torch_thread_count_past_the_bound_is_refused_before_torch_gets_it(argv, runs, needle, capsys, monkeypatch):
    def ran(*args, **kwargs):
        raise AssertionError(f"{runs} ran with {argv[-1]} torch threads")

    monkeypatch.setattr(runs, ran)
    rc, err = _run(argv, capsys)
    assert rc == 2 and err == f"pagoda {' '.join(argv[:2] if argv[0] == 'bench' else argv[:1])}: error: {needle}, " \
                              f"got 99999\n", err


@pytest.mark.parametrize(("argv", "env", "needle"), CHILD_FLAGS, ids=[" ".join(a) for a, _, _ in CHILD_FLAGS])
def test_a_bench_refuses_its_servers_flags_before_starting_one(argv, env, needle, capsys, monkeypatch):
    def started(*args, **kwargs):
        raise AssertionError("a server started")

    monkeypatch.setattr("serving.bench.ServerProcess.__init__", started)
    monkeypatch.setattr("serving.gateway.bench.GatewayProcess.__init__", started)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    rc, err = _run(argv, capsys)
    assert rc == 2 and err.startswith(f"pagoda bench {argv[1]}: error: {needle}") and err.count("\n") == 1, err


@pytest.mark.parametrize("argv", [["generate", "-p", "hi", "--model", "/nonexistent"],
                                  ["generate", "-p", "hi", "--temperature", "-1"]])
def test_the_installed_entry_point_exits_2_without_traceback(argv):
    """The issue's two cases through a real process (`python -m serving.cli` is the `pagoda` entry point)."""
    res = subprocess.run([sys.executable, "-m", "serving.cli", *argv], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().count("\n") == 0 and res.stderr.startswith("pagoda generate: error: --"), res.stderr
    assert res.stdout == ""


@pytest.mark.parametrize("value", ["abc", "0"])
def test_bench_serve_bad_concurrency_names_the_flag(value, capsys):
    """`pagoda bench serve --concurrency` refuses by name, rc 2, before starting any server."""
    rc, err = _run(["bench", "serve", "--concurrency", value], capsys)
    assert rc == 2
    assert err.strip().count("\n") == 0 and err.startswith("pagoda bench serve: error: --concurrency")


@pytest.mark.parametrize("argv", [["--model", "/nonexistent"], ["--rounds", "0"], ["--branches", "-1"]])
def test_bench_lang_bad_flags_name_the_flag(argv, capsys):
    """`pagoda bench lang` refuses by name, rc 2, before loading a model."""
    rc, err = _run(["bench", "lang", *argv], capsys)
    assert rc == 2
    assert err.strip().count("\n") == 0 and err.startswith(f"pagoda bench lang: error: {argv[0]}")


def test_bench_lang_refuses_more_branches_than_it_can_hold(capsys, monkeypatch):
    """Each branch is a thread (and over HTTP a server request thread): 99999 took the machine's memory."""
    def ran(*args, **kwargs):
        raise AssertionError("bench lang ran")

    monkeypatch.setattr("generation.lang.bench.run", ran)
    rc, err = _run(["bench", "lang", "--no-http", "--branches", "65"], capsys)
    assert rc == 2 and err == "pagoda bench lang: error: --branches: must be at most 64, got 65\n", err
    with pytest.raises(SystemExit):
        main(["bench", "lang", "--help"])
    assert "fork width, 1-64" in capsys.readouterr().out


def test_a_path_of_the_wrong_kind_is_one_line_not_a_traceback(tmp_path, capsys, tiny_llama):
    """A command that did not catch it itself: a folder given as a data file, a student folder that is none."""
    fixture = str(REPO / "tests" / "fixtures" / "laya" / "bert-tiny")
    assert main(["calibrate", "--model", fixture, "--data", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagoda calibrate: error: ") and str(tmp_path) in err and len(err.splitlines()) == 1, err
    assert main(["bench", "distill", "--student", str(tmp_path / "none"), "--teacher", "none"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagoda bench distill: error: ") and "student.json" in err, err
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')  # a model folder missing its geometry
    assert main(["generate", "-p", "hi", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "config.json lacks vocab_size" in err and len(err.splitlines()) == 1, err
    assert main(["generate", "-p", "", "--raw", "--model", str(tiny_llama)]) == 2  # the engine's InvalidParam
    err = capsys.readouterr().err
    assert err.startswith("pagoda generate: error: prompt: empty") and len(err.splitlines()) == 1, err


def test_a_command_an_extra_is_missing_for_names_the_extra(tmp_path):
    """The base install (an edge box serving a student) has no torch or onnx; a command that needs them ended in a
    ModuleNotFoundError traceback. It says which module and which extra to install, exit 2."""
    from serving_support import TINY_BERT

    code = ("import sys\nfor m in ('torch', 'onnx'): sys.modules[m] = None  # as if not installed\n"
            "from serving.cli import main\n"
            f"sys.exit(main(['decide', '--model', {str(TINY_BERT)!r}, '--state', 'hi', '--questions', "
            "'{\"q\": {\"type\": \"noul\", \"instructions\": \"Is it so?\"}}']))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("pagoda decide: error: this needs ") and "pip install 'pagoda[laya]'" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr
