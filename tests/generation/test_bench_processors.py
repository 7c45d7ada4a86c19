"""`pagoda bench generate --parts d` (the per-step logits processors against a plain decode) and `--parts e` (a
short request behind a long prefill) run and print
its rows, on the tiny random Llama with the smallest settings. Its figures go to docs/benchmarks.md and are
never asserted here: only that each variant ran, wrote every token, and got a ratio."""

from __future__ import annotations

import re

from generation.bench import run


def test_bench_generate_part_d_prints_a_ratio_per_processor(tiny_llama, capsys):
    results = run(str(tiny_llama), requests=3, new_tokens=3, parts="d", rounds=2, threads=1)
    out = capsys.readouterr().out
    assert "(d) per-step processors, 3 requests x 3 new tokens, greedy, 2 alternating rounds" in out, out
    assert re.search(r"^    plain +[0-9.]+ tok/s, [0-9.]+ ms/step; sampler [0-9]+ us/step$", out, re.M), out
    for name in ("logit_bias 50 ids", "logit_bias 1000 ids", "min_new_tokens 3"):
        assert re.search(rf"^    {name} +[0-9.]+ tok/s, x[0-9.]+ of plain \(x[0-9.]+ x[0-9.]+\); sampler [0-9]+ us/step, "
                         r"x[0-9.]+, [-+][0-9]+ us = [-+][0-9.]+% of a decode step$", out, re.M), (name, out)
        assert results[f"processor_ratio[{name}]"] > 0 and results[f"sampler_ratio[{name}]"] > 0
    assert "(a)" not in out and "(b)" not in out and "(c)" not in out  # part d alone: no HF reference loaded


def test_bench_generate_part_e_times_a_short_request_behind_a_long_prefill(tiny_llama, capsys):
    """Part e runs both scheduler policies on one engine and leaves the shipped share in place afterwards."""
    from generation import scheduler

    share = scheduler.WAITING_SHARE
    results = run(str(tiny_llama), ttft_tokens=300, parts="e", rounds=2, threads=1)
    out = capsys.readouterr().out
    assert re.search(r"\(e\) a [0-9]+-token question while a 300-token prompt is prefilled, 2 alternating rounds "
                     r"\(medians\): its answer [0-9.]+ s with the waiting share 0.25, [0-9.]+ s without \(x[0-9.]+\); "
                     r"the long prompt [0-9.]+ s against [0-9.]+ s \(x[0-9.]+\)", out), out
    assert results["short_behind_long_prefill"] > 0 and results["long_prefill_cost"] > 0
    assert scheduler.WAITING_SHARE == share
