"""Logits processors: bans, no-op processors, mixed batches, batching by class, state across preemption, failures,
`logit_bias` and `min_new_tokens`, the processors the engine adds itself."""

from __future__ import annotations

import re

import pytest
import torch

from generation import Engine, EngineConfig, InvalidParam, LogitsProcessor, SamplingParams
from generation.engine import GenerationOutput
from generation.logit_bias import LogitBias
from generation.sampler import sample
from generation.sequence import Sequence
from tests.generation.llama_builders import hf_greedy


class Ban(LogitsProcessor):
    def __init__(self, banned: list[int]) -> None:
        self.banned = banned

    def __call__(self, prompt_ids, output_ids, logits):
        logits[self.banned] = float("-inf")


class AllowAll(LogitsProcessor):
    def __call__(self, prompt_ids, output_ids, logits):
        logits.clamp_(min=float("-inf"))  # touches the row, changes nothing


class Recorder(LogitsProcessor):
    """Stateful: checks on every call that what it accepted is exactly the sequence's output so far."""

    def __init__(self) -> None:
        self.accepted: list[int] = []
        self.forks: list[Recorder] = []

    def fork(self) -> Recorder:
        child = Recorder()
        self.forks.append(child)
        return child

    def __call__(self, prompt_ids, output_ids, logits):
        assert list(output_ids) == self.accepted

    def accept(self, token_id):
        self.accepted.append(token_id)


class CountingBatch(Ban):
    calls: list[int] = []

    @classmethod
    def apply_batch(cls, processors, prompt_ids, output_ids, logits, rows):
        cls.calls.append(len(rows))
        super().apply_batch(processors, prompt_ids, output_ids, logits, rows)


class Boom(LogitsProcessor):
    def __call__(self, prompt_ids, output_ids, logits):
        raise KeyError("grammar state lost")


class EndAfter(LogitsProcessor):
    """A grammar that ends after `n` tokens: no EOS before, nothing but EOS after."""

    def __init__(self, n: int, eos: int) -> None:
        self.n, self.eos = n, eos

    def __call__(self, prompt_ids, output_ids, logits):
        if len(output_ids) < self.n:
            logits[self.eos] = float("-inf")
        else:
            keep = logits[self.eos].clone()
            logits.fill_(float("-inf"))
            logits[self.eos] = keep


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return Engine(EngineConfig(model=str(tiny_llama), block_size=4, num_blocks=256, max_num_batched_tokens=32))


def no_leak(engine: Engine) -> bool:
    return not engine.num_unfinished and engine.blocks.num_free + engine.cache.num_cached_blocks == engine.blocks.num_blocks


def rows(params: list[SamplingParams]) -> list[Sequence]:
    seqs = [Sequence(prompt_ids=[5, 6, 7 + i], params=p, request_id=f"r{i}") for i, p in enumerate(params)]
    for s in seqs:
        s.generator = torch.Generator().manual_seed(11) if s.params.temperature > 0 else None
    return seqs


MIXED = [SamplingParams(logprobs=2), SamplingParams(temperature=0.8, top_p=0.9, logprobs=1),
         SamplingParams(repetition_penalty=1.3, logprobs=0), SamplingParams(temperature=1.1, top_k=20)]


def test_rows_without_processors_are_bit_identical_in_a_mixed_batch():
    logits = torch.randn(len(MIXED) + 1, 300, generator=torch.Generator().manual_seed(0))
    plain = sample(logits[: len(MIXED)].clone(), rows(MIXED))
    banned = SamplingParams(logits_processors=[Ban(list(range(300)[::2]))], logprobs=2)
    mixed = sample(logits.clone(), rows(MIXED + [banned]))
    assert mixed.tokens[: len(MIXED)] == plain.tokens and mixed.records[: len(MIXED)] == plain.records
    assert mixed.tokens[-1] % 2 == 1 and not mixed.errors
    assert mixed.records[-1]["logprob"] == float(torch.log_softmax(logits[-1], -1)[mixed.tokens[-1]])  # raw


def test_a_processor_that_allows_everything_changes_nothing():
    logits = torch.randn(len(MIXED), 300, generator=torch.Generator().manual_seed(1))
    plain = sample(logits.clone(), rows(MIXED))
    with_noop = sample(logits.clone(), rows([SamplingParams(**{**p.__dict__, "logits_processors": [AllowAll()]})
                                             for p in MIXED]))
    assert with_noop.tokens == plain.tokens and with_noop.records == plain.records


def test_banned_tokens_never_appear_and_batch_mates_keep_their_answers(engine, tiny_llama):
    prompts = [[5, 6, 7], [20, 21, 22, 23, 24], [40] * 9]
    free = SamplingParams(max_new_tokens=8, ignore_eos=True)
    ref = hf_greedy(tiny_llama, prompts, 8)
    ban = sorted(set(ref[1]))
    constrained = SamplingParams(max_new_tokens=8, ignore_eos=True, logits_processors=[Ban(ban)])
    outs = engine.generate(prompts, [free, constrained, free])
    assert outs[0].token_ids == ref[0] and outs[2].token_ids == ref[2]
    assert not set(outs[1].token_ids) & set(ban) and len(outs[1].token_ids) == 8
    noop = engine.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True, logits_processors=[AllowAll()]))
    assert [o.token_ids for o in noop] == ref
    seeded = SamplingParams(max_new_tokens=8, temperature=0.9, seed=4, ignore_eos=True)
    alone = engine.generate(prompts[0], seeded)[0].token_ids
    assert engine.generate(prompts[0], SamplingParams(**{**seeded.__dict__, "logits_processors": [AllowAll()]}))[0].token_ids == alone
    assert no_leak(engine)


def test_processors_of_one_class_run_as_one_batch_call_per_step(engine):
    CountingBatch.calls.clear()
    p = SamplingParams(max_new_tokens=4, ignore_eos=True, logits_processors=[CountingBatch([9])])
    engine.generate([[5, 6], [7, 8], [9, 10]], p)
    assert CountingBatch.calls[-1] == 3 and sum(CountingBatch.calls) == 12  # every row of every step, batched


def test_each_sequence_gets_its_own_fork_and_state_survives_preemption(tiny_llama):
    engine = Engine(EngineConfig(model=str(tiny_llama), block_size=4, num_blocks=14, max_num_batched_tokens=64))
    rec = Recorder()
    prompts = [[10 + i] * 13 for i in range(4)]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True, logits_processors=[rec]))
    assert engine.stats()["preemptions"] > 0
    assert [f.accepted for f in rec.forks] == [o.token_ids for o in outs]
    assert [o.token_ids for o in outs] == hf_greedy(tiny_llama, prompts, 10)


def test_eos_is_sampled_exactly_when_the_processor_allows_it(engine):
    eos = min(engine.eos_ids)
    out = engine.generate([5, 6, 7], SamplingParams(max_new_tokens=20, logits_processors=[EndAfter(3, eos)]))[0]
    assert out.finish_reason == "stop" and len(out.token_ids) == 4 and out.token_ids[-1] == eos
    assert eos not in out.token_ids[:3]


def test_a_failing_processor_ends_only_its_own_request(engine):
    good = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=6, ignore_eos=True))
    bad = engine.add_request([8, 9], SamplingParams(max_new_tokens=6, logits_processors=[Boom()]))
    masked = engine.add_request([8, 9], SamplingParams(max_new_tokens=6, logits_processors=[Ban(list(range(engine.model_config.vocab_size)))]))
    ends: dict[str, GenerationOutput] = {}
    while engine.num_unfinished:
        ends.update({e.request_id: e for e in engine.step() if isinstance(e, GenerationOutput)})
    assert ends[bad].finish_reason == "error" and "Boom" in ends[bad].error and "grammar state lost" in ends[bad].error
    assert ends[masked].finish_reason == "error" and "masked every token" in ends[masked].error
    assert ends[good].finish_reason == "length"
    assert ends[good].token_ids == engine.generate([5, 6, 7], SamplingParams(max_new_tokens=6, ignore_eos=True))[0].token_ids
    with pytest.raises(RuntimeError, match="grammar state lost"):
        engine.generate(["hello", "world"], SamplingParams(max_new_tokens=3, logits_processors=[Boom()]))
    assert no_leak(engine)


def test_processor_params_are_validated():
    with pytest.raises(ValueError, match="SamplingParams.logits_processors"):
        SamplingParams(logits_processors=[lambda ids, logits: None])
    assert not SamplingParams(logits_processors=[AllowAll()]).plain_greedy


class NaNs(LogitsProcessor):
    def __call__(self, prompt_ids, output_ids, logits):
        logits.fill_(float("nan"))


def test_a_row_that_cannot_be_sampled_ends_only_its_own_request(engine):
    """A sampled row whose numbers break torch.multinomial (NaN logits from a processor) ends its request with
    an error; its batch mates go on. It used to raise out of the step and fail every request in it. A top_p
    that float32 rounds to 0 still keeps the most likely token (it left no token and failed the same way)."""
    good = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=6, ignore_eos=True))
    nan = engine.add_request([8, 9], SamplingParams(max_new_tokens=6, temperature=1.0, seed=1,
                                                    logits_processors=[NaNs()]))
    tiny = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=1.0,
                                                        top_p=1e-46, seed=1))
    ends: dict[str, GenerationOutput] = {}
    while engine.num_unfinished:
        ends.update({e.request_id: e for e in engine.step() if isinstance(e, GenerationOutput)})
    assert ends[nan].finish_reason == "error" and "sampling failed" in ends[nan].error
    greedy = engine.generate([5, 6, 7], SamplingParams(max_new_tokens=6, ignore_eos=True))[0].token_ids
    assert ends[good].finish_reason == "length" and ends[good].token_ids == greedy
    assert ends[tiny].finish_reason == "length" and ends[tiny].token_ids == greedy
    assert no_leak(engine)


# ---- logit_bias: OpenAI's field, a processor the engine adds ahead of the grammar ---------------------------


def test_a_bias_of_100_forces_a_token_and_minus_100_bans_it(engine):
    """Greedy with +100 on a token picks it every step; -100 on the greedy token falls to the second most likely.
    The reported log-probabilities stay the raw distribution's: the forced token keeps its own, low one."""
    plain = SamplingParams(max_new_tokens=5, ignore_eos=True, logprobs=2)
    free = engine.generate([5, 6, 7], plain)[0]
    (first, _), (second, _) = free.logprobs[0]["top"]
    forced_token = next(t for t in range(3, 320) if t not in free.token_ids)
    forced = engine.generate([5, 6, 7], SamplingParams(**{**plain.__dict__, "logit_bias": {forced_token: 100}}))[0]
    assert forced.token_ids == [forced_token] * 5
    assert [t for t, _ in forced.logprobs[0]["top"]] == [first, second]
    assert forced.logprobs[0]["logprob"] < forced.logprobs[0]["top"][1][1]  # raw: not lifted by the bias
    banned = engine.generate([5, 6, 7], SamplingParams(**{**plain.__dict__, "logit_bias": {first: -100}}))[0]
    assert banned.token_ids[0] == second and first not in banned.token_ids
    assert not SamplingParams(logit_bias={first: 1.5}).plain_greedy and SamplingParams(logit_bias={}).plain_greedy
    assert no_leak(engine)


def test_biased_rows_leave_their_batch_mates_bit_identical():
    """Biased rows (one `apply_batch` call for all of them, rows not adjacent) edit only their own listed
    tokens: every other row samples exactly as without them, and each biased row as if it were alone."""
    logits = torch.randn(len(MIXED), 300, generator=torch.Generator().manual_seed(2))
    extra = torch.randn(2, 300, generator=torch.Generator().manual_seed(3))
    plain = sample(logits.clone(), rows(MIXED))
    up, down = LogitBias({7: 100.0, 8: -3.5}), LogitBias({int(extra[1].argmax()): -100.0})
    seqs = rows(MIXED)
    seqs.insert(2, Sequence([5, 6], SamplingParams(logits_processors=[up], logprobs=1), "up"))
    seqs.append(Sequence([5, 6], SamplingParams(logits_processors=[down]), "down"))
    mixed = sample(torch.cat([logits[:2], extra[:1], logits[2:], extra[1:]]), seqs)
    assert mixed.tokens[:2] + mixed.tokens[3:-1] == plain.tokens and not mixed.errors
    assert mixed.records[:2] + mixed.records[3:-1] == plain.records
    assert mixed.tokens[2] == 7 and mixed.records[2]["logprob"] == float(torch.log_softmax(extra[0], -1)[7])  # raw
    alone = extra[1].clone()
    down([], [], alone)
    assert mixed.tokens[-1] == int(alone.argmax()) != int(extra[1].argmax())


def test_a_biased_request_leaves_the_others_in_its_batch_unchanged(engine, tiny_llama):
    prompts = [[5, 6, 7], [20, 21, 22, 23, 24], [40] * 9]
    free = SamplingParams(max_new_tokens=8, ignore_eos=True)
    ref = hf_greedy(tiny_llama, prompts, 8)
    biased = SamplingParams(max_new_tokens=8, ignore_eos=True, logit_bias={ref[1][0]: -100, 9: 100})
    outs = engine.generate(prompts, [free, biased, free])
    assert outs[0].token_ids == ref[0] and outs[2].token_ids == ref[2]
    assert outs[1].token_ids == [9] * 8
    assert no_leak(engine)


def test_a_constraint_wins_over_a_bias(engine):
    """The bias edits the raw logits and the grammar masks them after: +100 on a token the regex forbids never
    gets it sampled, +100 on an allowed one takes every step the regex leaves open."""
    tok = engine.tokenizer
    seven, q = tok.encode("7"), tok.encode("q")
    assert len(seven) == len(q) == 1
    regex = {"regex": "[a-z]{3,12}"}
    out = engine.generate("numbers", SamplingParams(max_new_tokens=20, constraint=regex,
                                                    logit_bias={seven[0]: 100}))[0]
    assert out.finish_reason == "stop" and seven[0] not in out.token_ids and re.fullmatch("[a-z]{3,12}", out.text)
    both = engine.generate("numbers", SamplingParams(max_new_tokens=20, constraint=regex,
                                                     logit_bias={seven[0]: 100, q[0]: 100}))[0]
    assert both.finish_reason == "stop" and both.text == "q" * 12
    assert no_leak(engine)


@pytest.mark.parametrize("bias", [{5: 100.5}, {5: -101}, {5: float("nan")}, {5: float("inf")}, {5: "1"}, {5: True},
                                  {-1: 1.0}, {"5": 1.0}, {5.0: 1.0}, [(5, 1.0)]])
def test_a_bad_logit_bias_is_refused_by_name(bias):
    with pytest.raises(InvalidParam) as err:
        SamplingParams(logit_bias=bias)
    assert err.value.field == "logit_bias" and str(err.value).startswith("SamplingParams.logit_bias: ")


def test_a_bias_on_a_token_outside_the_vocabulary_is_refused_before_anything_is_queued(engine):
    vocab = engine.model_config.vocab_size
    params = SamplingParams(logit_bias={vocab - 1: 100, vocab: 1.0})  # the edges are in range
    with pytest.raises(InvalidParam) as err:
        engine.check_params(params)
    assert err.value.field == "logit_bias" and f"[{vocab}]" in str(err.value)
    with pytest.raises(InvalidParam):
        engine.generate(["hello", "world"], [SamplingParams(), params])
    assert engine.num_unfinished == 0 and not engine.scheduler.waiting
    engine.check_params(SamplingParams(logit_bias={0: -100, vocab - 1: 100}))


# ---- min_new_tokens: SGLang's field (vLLM's min_tokens), a processor the engine adds ----------------------------


def test_min_new_tokens_holds_off_eos_and_stop_tokens(engine):
    """EOS forced by a bias from the first step: with min_new_tokens n the output is n other tokens, then EOS
    (whatever the bias, the stopping tokens are masked until then); a stop token id is held off the same way."""
    eos = min(engine.eos_ids)
    forced = SamplingParams(max_new_tokens=20, logit_bias={eos: 100})
    assert engine.generate([5, 6, 7], forced)[0].token_ids == [eos]
    out = engine.generate([5, 6, 7], SamplingParams(**{**forced.__dict__, "min_new_tokens": 4}))[0]
    assert out.finish_reason == "stop" and len(out.token_ids) == 5 and out.token_ids[-1] == eos
    assert eos not in out.token_ids[:4]
    free = engine.generate([5, 6, 7], SamplingParams(max_new_tokens=6, ignore_eos=True))[0]
    stop_id = free.token_ids[0]
    held = engine.generate([5, 6, 7], SamplingParams(max_new_tokens=6, ignore_eos=True, stop_token_ids=[stop_id],
                                                     min_new_tokens=3))[0]
    assert stop_id not in held.token_ids[:3] and len(held.token_ids) >= 4
    assert not SamplingParams(min_new_tokens=2).plain_greedy and SamplingParams(min_new_tokens=0).plain_greedy
    assert no_leak(engine)


def test_min_new_tokens_skips_stop_strings_until_then(engine):
    """A stop string the first token completes ends the output at once without min_new_tokens; with it, the
    output runs past that token (the string is looked for only from the n-th token on, as SGLang and vLLM do)."""
    outs = {p: engine.generate(p, SamplingParams(max_new_tokens=8, ignore_eos=True))[0]
            for p in ("hello world", "the cat", "a radix tree")}
    prompt, free = next((p, out) for p, out in outs.items() if engine.tokenizer.decode(out.token_ids[:1]).isalnum())
    first = engine.tokenizer.decode(free.token_ids[:1])
    assert free.text.count(first) == 1, "the first token's text must not come again in this output"
    stop = SamplingParams(max_new_tokens=8, ignore_eos=True, stop=[first])
    cut = engine.generate(prompt, stop)[0]
    assert cut.finish_reason == "stop" and len(cut.token_ids) == 1 and cut.text == ""
    held = engine.generate(prompt, SamplingParams(**{**stop.__dict__, "min_new_tokens": 3}))[0]
    assert held.token_ids == free.token_ids and held.finish_reason == "length" and held.text == free.text


@pytest.mark.parametrize("kw", [{"min_new_tokens": -1}, {"min_new_tokens": 1.5}, {"min_new_tokens": 9, "max_new_tokens": 8},
                                {"min_new_tokens": 2, "constraint": {"regex": "[a-z]+"}}])
def test_a_bad_min_new_tokens_is_refused_by_name(kw):
    with pytest.raises(InvalidParam) as err:
        SamplingParams(**kw)
    assert err.value.field == "min_new_tokens"
