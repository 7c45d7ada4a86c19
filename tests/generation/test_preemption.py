"""Seeded top-p sampling across a preemption: a preempted request is recomputed from its kept tokens and its
own generator carries on where it stopped, so it draws exactly the tokens it draws on a pool that never
preempts. Checked for each cache backend (a readmission re-matches its prefix in the cache, or recomputes
it all with `none`)."""

from __future__ import annotations

import pytest

from generation import Engine, EngineConfig, SamplingParams
from tests.generation.test_engine_vs_hf import assert_no_leak, make_prompts

NEW = 12


def seeded(i: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=NEW, temperature=0.9, top_p=0.8, seed=100 + i, ignore_eos=True)


def run(tiny_llama, backend: str, num_blocks: int, prompts, params):
    engine = Engine(EngineConfig(model=str(tiny_llama), cache_backend=backend, block_size=4, num_blocks=num_blocks,
                                 max_num_batched_tokens=64))
    outs = engine.generate(prompts, params)
    assert_no_leak(engine)
    return [o.token_ids for o in outs], engine.stats()["preemptions"]


@pytest.fixture(scope="module")
def roomy(tiny_llama):
    """Every request's seeded tokens (and greedy ones) on a pool large enough that nothing is preempted."""
    prompts = make_prompts()
    params = [seeded(i) for i in range(len(prompts))]
    sampled, preemptions = run(tiny_llama, "radix", 512, prompts, params)
    assert preemptions == 0
    greedy, _ = run(tiny_llama, "radix", 512, prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    # the draws really are random: top-p sampling leaves the greedy path for most requests
    assert sum(s != g for s, g in zip(sampled, greedy)) >= len(prompts) // 2
    return prompts, params, sampled


@pytest.mark.parametrize("backend", ["radix", "hashed", "none"])
def test_seeded_top_p_survives_preemption(tiny_llama, roomy, backend):
    prompts, params, expected = roomy
    got, preemptions = run(tiny_llama, backend, 30, prompts, params)
    assert preemptions > 0
    assert got == expected


@pytest.mark.parametrize("backend", ["radix", "hashed", "none"])
def test_preempted_seeded_request_beside_greedy_ones(tiny_llama, roomy, backend):
    """Mixed batch: greedy neighbours and seeded requests share the preempting pool; each seeded request
    still equals its run on the roomy pool (its generator is its own, whatever shares the batch)."""
    prompts, params, expected = roomy
    greedy = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    mixed = [params[i] if i % 2 else greedy for i in range(len(prompts))]
    got, preemptions = run(tiny_llama, backend, 30, prompts, mixed)
    assert preemptions > 0
    assert [got[i] for i in range(1, len(prompts), 2)] == [expected[i] for i in range(1, len(prompts), 2)]
