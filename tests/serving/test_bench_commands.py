"""Every `pagoda bench` command that no other test runs, run whole on the tiny random Llama with the smallest
settings: their figures go to docs/benchmarks.md and are never asserted here, but a command that crashes
cannot be rerun to check them. (`bench serve`, `bench gateway`, `bench decide`, `bench train` and
`bench distill` run in their own packages' tests.)"""

from __future__ import annotations

import subprocess
import sys

import pytest
from serving_support import REPO, TINY_BERT

COMMANDS = {
    "generate": (["--requests", "2", "--prefix-tokens", "16", "--new-tokens", "2", "--decode-tokens", "4",
                  "--ttft-tokens", "16"], ["(a) 2 requests", "(b) single stream", "(c) TTFT"]),
    # an HF folder, not the embedded GGUF: the engines part once read only GGUF metadata
    "constraints": (["--steps", "2", "--new-tokens", "2", "--rounds", "1"],
                    ["compile invoice", "batch 32 (wall)", "constrained  : "]),
    "lang": (["--context-tokens", "32", "--branches", "2", "--new-tokens", "2", "--rounds", "1"],
             ["local backend", "HTTP backend", "same text in every mode and round: yes"]),
    "soak": (["--minutes", "0.05", "--clients", "2", "--slow", "4", "--new-tokens", "2", "--model", str(TINY_BERT),
              "--sample-s", "1"], ["| baseline |", "| +4 slow/idle |", "worker RSS after warm-up"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("command", COMMANDS)
def test_bench_command_runs_end_to_end(command, tiny_llama):
    flags, expected = COMMANDS[command]
    model = ["--generate-model" if command == "soak" else "--model", str(tiny_llama)]
    proc = subprocess.run([sys.executable, "-m", "serving.cli", "bench", command, *model, *flags], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    missing = [line for line in expected if line not in proc.stdout]
    assert not missing, f"{missing} not in:\n{proc.stdout[-3000:]}"


@pytest.mark.slow
def test_bench_generate_refuses_a_run_past_the_models_context(tiny_llama):
    """Past the context the engine stopped early while the figures divided by every token asked for: a
    5,000-token run on a 1,024-token model reported an 11x speed-up."""
    proc = subprocess.run([sys.executable, "-m", "serving.cli", "bench", "generate", "--model", str(tiny_llama),
                           "--requests", "2", "--new-tokens", "5000"], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 2 and "(a)" not in proc.stdout, proc.stdout[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("pagoda bench generate: error: --prefix-tokens / "
                                                           "--new-tokens: "), proc.stderr[-2000:]


@pytest.mark.slow
def test_bench_lang_refuses_a_context_past_the_models(tiny_llama):
    """A context past the model's was built first, one sentence at a time (1M tokens: still building after 90 s)."""
    proc = subprocess.run([sys.executable, "-m", "serving.cli", "bench", "lang", "--model", str(tiny_llama), "--no-http",
                           "--context-tokens", "5000"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "pagoda bench lang: error: --context-tokens / --new-tokens: 5000 + 32 tokens and the program's own do not "
        "fit in the model's 1024-token context"), proc.stderr[-2000:]
