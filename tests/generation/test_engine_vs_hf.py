"""Greedy output must equal transformers' generate token for token, whatever the engine does underneath."""

from __future__ import annotations

import random

import pytest

from generation import Engine, EngineConfig, SamplingParams
from tests.generation.llama_builders import build_tiny_llama, hf_greedy

NEW = 10


def make_prompts(vocab: int = 300) -> list[list[int]]:
    rng = random.Random(1)
    shared = [rng.randrange(3, vocab) for _ in range(37)]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 2, 9, 16, 31)]
    prompts += [shared + [rng.randrange(3, vocab) for _ in range(k)] for k in (1, 6, 20)]
    return prompts


@pytest.fixture(scope="module")
def reference(tiny_llama):
    prompts = make_prompts()
    return prompts, hf_greedy(tiny_llama, prompts, NEW)


def assert_no_leak(engine: Engine) -> None:
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.blocks.num_free + engine.cache.num_cached_blocks == engine.blocks.num_blocks
    held = sum(1 for r in engine.blocks.ref if r)
    assert held == engine.cache.num_cached_blocks


@pytest.mark.parametrize("backend", ["radix", "hashed", "none"])
@pytest.mark.parametrize("chunked", [True, False])
def test_greedy_matches_transformers(tiny_llama, reference, backend, chunked):
    prompts, ref = reference
    engine = Engine(EngineConfig(model=str(tiny_llama), cache_backend=backend, block_size=4, num_blocks=256,
                                 max_num_batched_tokens=24, chunked_prefill=chunked))
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    # batch sizes 1, 3 and 8 over the same engine: later batches meet a warm cache
    for batch in ([0], [1, 5, 6], list(range(8))):
        outs = engine.generate([prompts[i] for i in batch], params)
        assert [o.token_ids for o in outs] == [ref[i] for i in batch]
        assert all(o.finish_reason == "length" for o in outs)
        assert_no_leak(engine)
    stats = engine.stats()
    if backend == "none":
        assert stats["compute_saved_tokens"] == 0
    else:
        assert stats["compute_saved_tokens"] > 0 and 0 < stats["prefill_skip_ratio"] < 1
    assert stats["decode_batch_factor"] > 1


def test_shared_prefix_in_one_batch_is_computed_once(tiny_llama, reference):
    prompts, ref = reference
    engine = Engine(EngineConfig(model=str(tiny_llama), cache_backend="radix", block_size=4, num_blocks=256))
    outs = engine.generate(prompts[5:8], SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == ref[5:8]
    assert [o.cached_tokens for o in outs] == [0, 36, 36]  # 37 shared tokens -> 9 full blocks of 4


@pytest.mark.parametrize("backend", ["radix", "hashed", "none"])
def test_preemption_recomputes_without_losing_requests(tiny_llama, reference, backend):
    prompts, ref = reference
    engine = Engine(EngineConfig(model=str(tiny_llama), cache_backend=backend, block_size=4, num_blocks=30,
                                 max_num_batched_tokens=64))
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == ref
    assert engine.stats()["preemptions"] > 0
    assert_no_leak(engine)


@pytest.mark.parametrize("variant", [
    dict(tie=True, kv_heads=1),
    dict(kv_heads=4, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
])
def test_model_variants_match(tmp_path, variant):
    folder = build_tiny_llama(tmp_path / "m", seed=3, **variant)
    prompts = make_prompts()[3:6]
    ref = hf_greedy(folder, prompts, 8)
    engine = Engine(EngineConfig(model=str(folder), block_size=8, num_blocks=64))
    assert [o.token_ids for o in engine.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))] == ref


def test_repetition_penalty_matches_transformers(tiny_llama):
    import torch
    from transformers import LlamaForCausalLM

    prompt = make_prompts()[4]
    model = LlamaForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        x = torch.tensor([prompt])
        y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False,
                           repetition_penalty=1.7, pad_token_id=0)[0, len(prompt):].tolist()
    engine = Engine(EngineConfig(model=str(tiny_llama), num_blocks=32))
    (out,) = engine.generate(prompt, SamplingParams(max_new_tokens=12, repetition_penalty=1.7, ignore_eos=True))
    assert out.token_ids == y


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("backend", ["radix", "hashed"])
def test_cuda_runs_the_same_code_paths(tiny_llama, reference, backend):
    """The same engine on a GPU: chunked prefill, cache hits, preemption and seeded sampling."""
    prompts, ref = reference
    engine = Engine(EngineConfig(model=str(tiny_llama), cache_backend=backend, device="cuda", block_size=4,
                                 num_blocks=40, max_num_batched_tokens=24))
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    for _ in range(2):
        assert [o.token_ids for o in engine.generate(prompts, params)] == ref
    assert engine.stats()["preemptions"] > 0 and engine.stats()["compute_saved_tokens"] > 0
    seeded = SamplingParams(max_new_tokens=8, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
    alone = engine.generate(prompts[4], seeded)[0].token_ids
    assert engine.generate([prompts[1], prompts[4]], [params, seeded])[1].token_ids == alone
    assert_no_leak(engine)


@pytest.mark.parametrize("backend", ["radix", "hashed"])
def test_prompt_logprobs_match_transformers(tiny_llama, backend):
    """Prompt scoring over cached, chunked and preempted prefills equals transformers' own log-softmax."""
    import torch
    from transformers import LlamaForCausalLM

    prompt, other = make_prompts()[7], make_prompts()[4]
    model = LlamaForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
    engine = Engine(EngineConfig(model=str(tiny_llama), cache_backend=backend, block_size=4, num_blocks=20,
                                 max_num_batched_tokens=16))
    engine.generate([prompt], SamplingParams(max_new_tokens=1))  # the whole prompt is cached now
    start = 30
    scoring = SamplingParams(max_new_tokens=0, prompt_logprobs=2, prompt_logprobs_start=start)
    busy = SamplingParams(max_new_tokens=12, ignore_eos=True)
    outs = engine.generate([other, prompt], [busy, scoring])  # the scorer is the youngest: preempted first
    assert engine.stats()["preemptions"] > 0
    out = outs[1]
    assert 0 < out.cached_tokens <= start - 1 and out.token_ids == [] and out.finish_reason == "length"
    assert len(out.prompt_logprobs) == len(prompt) - start
    for pos, rec in zip(range(start, len(prompt)), out.prompt_logprobs):
        assert rec["token_id"] == prompt[pos]
        assert abs(rec["logprob"] - float(ref[pos - 1, prompt[pos]])) < 1e-4
        assert [t for t, _ in rec["top"]] == ref[pos - 1].topk(2).indices.tolist()
    whole = engine.generate([prompt], SamplingParams(max_new_tokens=3, prompt_logprobs=0, ignore_eos=True))[0]
    assert whole.prompt_logprobs[0] is None and len(whole.prompt_logprobs) == len(prompt)
    assert max(abs(r["logprob"] - float(ref[i, prompt[i + 1]])) for i, r in enumerate(whole.prompt_logprobs[1:])) < 1e-4
    assert len(whole.token_ids) == 3 and whole.cached_tokens == 0
    assert_no_leak(engine)
