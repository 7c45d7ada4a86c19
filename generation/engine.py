"""The engine: requests in, tokens out, KV and prefix reuse managed underneath.

`Engine` is synchronous and single-threaded. `add_request` queues a request under an id; `step()`
schedules one batch, runs one forward, samples, and returns what happened: a `TokenEvent` per sampled
token and a `GenerationOutput` per request that ended. `generate`, `stream` and `pin` drive steps until
their own requests end, so they are for callers that own the engine outright; a server hands the engine
to an `EngineLoop` (`generation.engine_loop`), whose thread is then the only one that calls it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from generation.block_manager import BlockManager
from generation.config import EngineConfig, InvalidParam, SamplingParams, lone_surrogate
from generation.constraints import ConstraintError, GrammarProcessor, processor_from_request
from generation.logit_bias import LogitBias
from generation.min_new_tokens import MinNewTokens
from generation.model_runner import ModelRunner, StepLogits
from generation.prefix_cache import make_prefix_cache
from generation.sampler import logprob_record, sample
from generation.scheduler import Scheduler
from generation.sequence import Pin, Sequence, Status
from generation.weights import load_model

Prompt = str | list[int]
ABORT_REASONS = ("abort", "deadline", "error")


def generator_seed(seed: int) -> int:
    """The 32 bits a request's 64-bit seed becomes. torch's CPU generator (mt19937) keeps only a seed's low 32
    bits, so seeds 2**32 apart would sample alike; mixing all 64 (splitmix64's finaliser) first leaves no such
    pattern, only the chance collisions any 32-bit seed space has."""
    x = seed % 2**64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
    return (x ^ (x >> 31)) >> 32


@dataclass
class TokenEvent:
    """One sampled token; `text` is the new printable text (held back while it may be part of a stop string)."""

    request_id: str
    index: int
    token_id: int
    text: str
    finish_reason: str | None = None
    logprob: dict[str, Any] | None = None
    cached_tokens: int = 0


@dataclass
class GenerationOutput:
    """A request that ended. `finish_reason`: stop, length, abort, deadline or error (`error` says why).

    `prompt_token_ids` include a pin's tokens; `pin` is the id of the pin the request left behind when it
    was added with `pin_result=True`; `prompt_logprobs` has one record per prompt token from
    `SamplingParams.prompt_logprobs_start` on. `matched_stop` says what ended a `stop`: the token id (EOS
    or one of `stop_token_ids`) or the stop string. `no_room` marks an `error` that is the pool's, not the
    request's nor the model's: the sequence outgrew what pins and the pool leave it (a server answers 507)."""

    request_id: str
    index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    cached_tokens: int
    finish_reason: str
    logprobs: list[dict[str, Any]] | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    pin: str | None = None
    error: str | None = None
    matched_stop: int | str | None = None
    no_room: bool = False


class Engine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        config = config or EngineConfig()
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model_config, weights, self.tokenizer = load_model(config.model)
        positions = self.model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > positions:  # never trained past them
            raise InvalidParam(f"EngineConfig.max_model_len: {config.max_model_len} is past the model's {positions} "
                               f"positions (max_position_embeddings; a GGUF's context_length)", "max_model_len")
        self.runner = ModelRunner(config, self.model_config, weights)
        del weights
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size)
        self.cache = make_prefix_cache(config.cache_backend, self.blocks)
        self.scheduler = Scheduler(config, self.blocks, self.cache)
        self.max_model_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                                 self.runner.num_blocks * config.block_size)
        self.eos_ids = set(self.model_config.eos_token_ids)
        self._rng = torch.Generator().manual_seed(config.seed)
        self._requests: dict[str, Sequence] = {}
        self._pins: dict[str, Pin] = {}
        self._request_ids = itertools.count()
        self._pin_ids = itertools.count()
        self._counters = dict(output_tokens=0, decode_tokens=0, decode_steps=0, steps=0)
        self._peak_used = 0

    # ---- requests ---------------------------------------------------------------------------------

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            at = lone_surrogate(prompt)
            if at is not None:
                raise InvalidParam(f"prompt: not valid Unicode text (a lone surrogate {prompt[at]!r} at character "
                                   f"{at})", "prompt")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise InvalidParam(f"prompt: token ids {bad[:5]} outside the vocabulary (size "
                                   f"{self.model_config.vocab_size})", "prompt")
            return list(prompt)
        raise InvalidParam("prompt: must be a string or a list of token ids", "prompt")

    def check_request(self, prompt: Prompt, params: SamplingParams, *, pin: str | None = None) -> list[int]:
        """Validate a request without changing any engine state, so any thread may call it (a server
        answers 4xx at once); returns the prompt's token ids. Errors name the offending field. A
        constraint is compiled here (into the shared grammar cache), so a server's request threads do
        that work and the engine thread finds it cached."""
        return self._check(prompt, params, pin)[0]

    def _check(self, prompt: Prompt, params: SamplingParams, pin: str | None) -> tuple[list[int], GrammarProcessor | None]:
        """The prompt's token ids and the prototype processor of the request's constraint (None without)."""
        if not isinstance(params, SamplingParams):
            raise InvalidParam("params: must be a SamplingParams", "params")
        ids = self.encode(prompt)
        total = len(ids)
        if pin is not None:
            kept = self._pin(pin)
            if params.cache_salt != kept.salt:
                raise InvalidParam("params.cache_salt: must match the pin's salt", "cache_salt")
            total += len(kept.tokens)
        if not total:
            raise InvalidParam("prompt: empty (give at least one token)", "prompt")
        if total >= self.max_model_len:
            raise InvalidParam(f"prompt: {total} tokens, limit is EngineConfig.max_model_len - 1 = "
                               f"{self.max_model_len - 1}", "prompt")
        self.check_params(params)
        return ids, self._constraint_processor(params)

    def check_params(self, params: SamplingParams) -> None:
        """What a request's settings must satisfy for this model, whatever its prompt: a server checks each
        prompt's settings with it, so the error names that prompt's field."""
        unknown = [t for t in params.stop_token_ids if t >= self.model_config.vocab_size]
        if unknown:  # it could never be sampled: a stop that never fires is a caller's mistake, said at once
            raise InvalidParam(f"SamplingParams.stop_token_ids: {unknown[:5]} outside the vocabulary (size "
                               f"{self.model_config.vocab_size})", "stop_token_ids")
        unknown = [t for t in params.logit_bias if t >= self.model_config.vocab_size]
        if unknown:  # no logit to add it to: refused rather than an index error in the sampler
            raise InvalidParam(f"SamplingParams.logit_bias: token ids {unknown[:5]} outside the vocabulary (size "
                               f"{self.model_config.vocab_size})", "logit_bias")

    def _constraint_processor(self, params: SamplingParams) -> GrammarProcessor | None:
        if params.constraint is None:
            return None
        try:
            return processor_from_request(params.constraint, self, stop_token_ids=params.stop_token_ids)
        except ConstraintError as exc:
            raise InvalidParam(f"SamplingParams.{exc.field}: {exc.detail}", exc.field) from None
        except ImportError as exc:  # refused by name, never ignored: a caller asking for JSON must not get prose
            raise InvalidParam(f"SamplingParams.constraint: constrained decoding is not available ({exc})",
                               "constraint") from None

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None,
                    index: int = 0, pin: str | None = None, pin_result: bool = False) -> str:
        """Queue a request; its events come out of `step()` under the returned id.

        `pin`: the prompt continues that pin's tokens and reuses their KV. `pin_result`: when the request
        finishes, its KV (prompt and output) stays resident as a new pin, named in its output."""
        seq = self._new_sequence(prompt, params, request_id, index, pin, pin_result)
        self._enqueue(seq)
        return seq.request_id

    def _new_sequence(self, prompt: Prompt, params: SamplingParams | None, request_id: str | None, index: int,
                      pin: str | None, pin_result: bool) -> Sequence:
        params = params or SamplingParams()
        ids, grammar = self._check(prompt, params, pin)
        if request_id is None:
            request_id = f"req-{next(self._request_ids)}"
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id: must be a non-empty string")
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        kept = self._pin(pin) if pin is not None else None
        seq = Sequence(prompt_ids=kept.tokens + ids if kept else ids, params=params, request_id=request_id,
                       index=index, pin=kept, pin_result=pin_result)
        if pin_result:
            self._check_pin_room(len(seq.prompt_ids) + params.max_new_tokens)
        # ahead of the request's own processors: the bias edits the raw logits (OpenAI's meaning) and
        # min_new_tokens masks the stopping tokens (never beside a grammar, which SamplingParams refuses), then
        # the grammar masks them, a masked token staying -inf whatever its bias. The grammar comes first among
        # the rest, so constrained rows share one bitmask call per step, whatever custom processors follow
        # (a processor that re-opens a masked token fails its own request); a step mixing biased and unbiased
        # constrained rows makes two such calls, one per list position.
        ahead = [LogitBias(params.logit_bias, self.runner.device)] if params.logit_bias else []
        stops = [*([] if params.ignore_eos else self.eos_ids), *params.stop_token_ids]
        if params.min_new_tokens and stops:
            ahead.append(MinNewTokens(params.min_new_tokens, stops, self.runner.device))
        if grammar is not None:
            ahead.append(grammar.fork())
        seq.processors[:0] = ahead
        return seq

    def _enqueue(self, seq: Sequence) -> None:
        params = seq.params
        if params.temperature > 0:
            seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self._rng))
            seq.generator = torch.Generator(device=self.runner.device).manual_seed(generator_seed(seed))
        if seq.pin is not None:
            seq.pin.users += 1
        self._requests[seq.request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str, *, reason: str = "abort", error: str | None = None) -> GenerationOutput | None:
        """End a request now, returning its blocks; None if no such request is in flight."""
        if reason not in ABORT_REASONS:
            raise ValueError(f"reason: must be one of {ABORT_REASONS}, got {reason!r}")
        seq = self._requests.get(request_id)
        return None if seq is None else self._end(seq, reason, error)

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    @property
    def num_waiting(self) -> int:
        """Requests not running now: never admitted yet, or preempted and waiting to be recomputed."""
        return len(self.scheduler.waiting)

    # ---- the loop ---------------------------------------------------------------------------------

    def step(self) -> list[TokenEvent | GenerationOutput]:
        """Run one scheduled batch; returns a TokenEvent per sampled token and an output per ended request."""
        plan = self.scheduler.schedule()
        if not plan:
            seq = self.scheduler.unschedulable
            if seq is None:
                return []
            pinned = self._pinned_blocks()
            out = self._end(seq, "error", f"KV pool too small for request {seq.request_id!r} ({len(seq)} tokens; "
                                          f"pins hold {pinned} of its {self.blocks.num_blocks} blocks): unpin, or "
                                          "raise EngineConfig.num_blocks or kv_cache_memory_mb")
            out.no_room = True
            return [out]
        out = self.runner.run(plan)
        self._counters["steps"] += 1
        if plan.decode:
            self._counters["decode_steps"] += 1
            self._counters["decode_tokens"] += len(plan.decode)
        for seq in plan.decode:
            seq.num_computed += 1
        for seq, n in plan.prefill:
            seq.num_computed += n
        self._peak_used = max(self._peak_used, self.blocks.num_blocks - self.blocks.num_free)
        self._score_prompts(out)
        events: list[TokenEvent | GenerationOutput] = []
        if out.sampled:
            events += self._take_samples(out)
        for seq in plan.decode:
            if seq.prefill_only and seq.status is Status.RUNNING:
                self._finish(seq, "length")
                events.append(self._complete(seq))
        for seq, _ in plan.prefill:
            if seq.status is not Status.RUNNING:
                continue
            if seq.prefill_only and seq.num_uncomputed == 0:
                self._finish(seq, "length")
                events.append(self._complete(seq))
            else:
                self.scheduler.cache_progress(seq)  # publish this chunk's full blocks to concurrent requests
        return events

    def _take_samples(self, out: StepLogits) -> list[TokenEvent | GenerationOutput]:
        picked = sample(out.logits[: len(out.sampled)], out.sampled)
        events: list[TokenEvent | GenerationOutput] = []
        for i, (seq, tok, rec) in enumerate(zip(out.sampled, picked.tokens, picked.records)):
            if tok is None:
                events.append(self._end(seq, "error", picked.errors[i]))
                continue
            seq.output_ids.append(tok)
            if rec is not None:
                seq.logprobs.append(rec)
            self._counters["output_tokens"] += 1
            reason = self._stop_reason(seq, tok)
            if reason:
                self._finish(seq, reason)
            events.append(TokenEvent(seq.request_id, seq.index, tok, self._new_text(seq), seq.finish_reason,
                                     rec, seq.cached_tokens))
            if reason:
                events.append(self._complete(seq))
        return events

    def _score_prompts(self, out: StepLogits) -> None:
        row = len(out.sampled)
        for seq, first, count in out.prompt_rows:
            for q in range(first, first + count):
                rec = logprob_record(out.logits[row].float(), seq.prompt_ids[q + 1], seq.params.prompt_logprobs)
                seq.prompt_logprobs.append(rec)
                row += 1

    def _stop_reason(self, seq: Sequence, tok: int) -> str | None:
        p = seq.params
        before = len(seq.text)
        seq.text = self.tokenizer.decode(seq.output_ids, p.skip_special_tokens)
        if (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            seq.matched_stop = tok
            if p.trim_stop_token:
                seq.text = self.tokenizer.decode(seq.output_ids[:-1], p.skip_special_tokens)
            return "stop"
        if p.stop and len(seq.output_ids) < p.min_new_tokens:  # as SGLang and vLLM: no stop string before that
            seq.stop_floor = len(seq.text.rstrip("\ufffd"))  # the characters that are final
        elif p.stop:
            # a stop string may straddle token boundaries: search from where one could have begun before this
            # token's text (a token may add any number of characters; up to 3 U+FFFD of a character still
            # incomplete may have collapsed into it), but not one that ended before min_new_tokens
            start = max(0, before - max(len(s) for s in p.stop) - 3)
            hits = [(i, s) for i, s in ((seq.text.find(s, max(start, seq.stop_floor - len(s) + 1)), s)
                                        for s in p.stop) if i >= 0]
            if hits:
                at, seq.matched_stop = min(hits)
                seq.text = seq.text[:at]
                return "stop"
        if len(seq.output_ids) >= p.max_new_tokens or len(seq) >= self.max_model_len:
            return "length"
        return None

    def _new_text(self, seq: Sequence) -> str:
        text = seq.text
        if seq.status is not Status.FINISHED:
            text = text.rstrip("\ufffd")  # an incomplete UTF-8 sequence waits for its next byte, and is no
            hold = max((len(s) - 1 for s in seq.params.stop), default=0)  # character a stop string could start
            text = text[: max(0, len(text) - hold)]  # a text shorter than the hold shows nothing yet
        delta = text[seq.emitted_text_len :]
        seq.emitted_text_len = max(seq.emitted_text_len, len(text))
        return delta

    def _finish(self, seq: Sequence, reason: str) -> None:
        """A normal end (stop or length); a `pin_result` request keeps its blocks for the pin it becomes."""
        if seq.pin_result:
            self.scheduler.cache_progress(seq)
        self.scheduler.finish(seq, reason, keep=seq.pin_result)

    def _end(self, seq: Sequence, reason: str, error: str | None = None) -> GenerationOutput:
        self.scheduler.finish(seq, reason)
        seq.error = error
        return self._complete(seq)

    def _complete(self, seq: Sequence) -> GenerationOutput:
        del self._requests[seq.request_id]
        pin_id = None
        if seq.pin_result and seq.finish_reason in ("stop", "length"):
            pin_id = f"pin-{next(self._pin_ids)}"
            self._pins[pin_id] = Pin(seq.all_ids, seq.block_table, seq.num_computed, seq.cache_handle, seq.salt)
            seq.block_table, seq.cache_handle = [], None
        if seq.pin is not None:
            seq.pin.users -= 1
            if seq.pin.unpinned and seq.pin.users == 0:
                self._release_pin(seq.pin)
        p = seq.params
        return GenerationOutput(seq.request_id, seq.index, seq.prompt_ids, list(seq.output_ids), seq.text,
                                seq.cached_tokens, seq.finish_reason,
                                seq.logprobs if p.logprobs is not None else None,
                                seq.prompt_logprobs if p.prompt_logprobs is not None else None, pin_id, seq.error,
                                seq.matched_stop)

    # ---- driving the engine from the caller's thread ----------------------------------------------------

    def _add_batch(self, prompts: Prompt | list[Prompt], params: SamplingParams | list[SamplingParams] | None,
                   pin: str | None, pin_result: bool) -> list[str]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, list) or not prompts:
            raise ValueError("prompts: give a string, a list of token ids, or a non-empty list of those")
        if isinstance(params, list):
            if len(params) != len(prompts):
                raise ValueError(f"params: {len(params)} given for {len(prompts)} prompts")
        else:
            params = [params or SamplingParams()] * len(prompts)
        # every request is validated before any is queued, so a bad prompt leaves nothing behind
        seqs = [self._new_sequence(p, sp, None, i, pin, pin_result) for i, (p, sp) in enumerate(zip(prompts, params))]
        for seq in seqs:
            self._enqueue(seq)
        return [s.request_id for s in seqs]

    def _drive(self, request_ids: list[str]) -> Iterator[TokenEvent | GenerationOutput]:
        pending = set(request_ids)
        try:
            while pending:
                for event in self.step():
                    if event.request_id not in pending:
                        continue
                    if isinstance(event, GenerationOutput):
                        pending.discard(event.request_id)
                        if event.finish_reason == "error":
                            raise RuntimeError(event.error)
                    yield event
        finally:  # an error or a consumer that stops early must not leave its requests holding the pool
            for rid in pending:
                self.abort(rid)

    def generate(self, prompts: Prompt | list[Prompt], params: SamplingParams | list[SamplingParams] | None = None,
                 *, pin: str | None = None, pin_result: bool = False) -> list[GenerationOutput]:
        """Run prompts to completion (batched continuously); one output per prompt, in order.

        With `pin`, each prompt is a continuation of that pin and reuses all of its KV. A request that
        fails raises RuntimeError (the others are aborted)."""
        request_ids = self._add_batch(prompts, params, pin, pin_result)
        outputs = {}
        for event in self._drive(request_ids):
            if isinstance(event, GenerationOutput):
                outputs[event.request_id] = event
        return [outputs[r] for r in request_ids]

    def stream(self, prompts: Prompt | list[Prompt], params: SamplingParams | list[SamplingParams] | None = None,
               *, pin: str | None = None) -> Iterator[TokenEvent]:
        """Tokens as they are sampled; closing the iterator early aborts its requests and frees their blocks."""
        events = self._drive(self._add_batch(prompts, params, pin, False))
        try:
            for event in events:
                if isinstance(event, TokenEvent):
                    yield event
        finally:
            events.close()

    # ---- pins -------------------------------------------------------------------------------------------

    def _pin(self, pin_id: str) -> Pin:
        kept = self._pins.get(pin_id)
        if kept is None:
            raise InvalidParam(f"pin: unknown or unpinned id {pin_id!r}", "pin")
        return kept

    def _check_pin_room(self, tokens: int) -> None:
        """Refuse a pin that would take pins (those being computed included) past `max_pinned_fraction` of the
        pool: each holds its blocks until unpinned, and a pool they fill has no room for any request."""
        if self.config.max_pinned_fraction >= 1:
            return  # the whole pool: a pin is refused only when it does not fit (`step`)
        need = self.blocks.blocks_for(tokens)
        held = self._pinned_blocks() + sum(self.blocks.blocks_for(len(s.prompt_ids) + s.params.max_new_tokens)
                                           for s in self._requests.values() if s.pin_result)
        limit = int(self.config.max_pinned_fraction * self.blocks.num_blocks)
        if held + need > limit:
            raise InvalidParam(f"pin_result: pins would hold {held + need} of the KV pool's {self.blocks.num_blocks} "
                               f"blocks, past the {limit} that max_pinned_fraction "
                               f"({self.config.max_pinned_fraction:g}) allows: unpin some first", "pin_result")

    def _pinned_blocks(self) -> int:
        """Pool blocks the pins hold, each once (pins of a common prefix share its blocks), those unpinned while
        requests still use them included: they are held until the last of those ends."""
        draining = [s.pin for s in self._requests.values() if s.pin is not None and s.pin.unpinned]
        return len({b for p in [*self._pins.values(), *draining] for b in p.blocks})

    def pin(self, prompt: Prompt, *, cache_salt: str | None = None) -> str:
        """Compute `prompt`'s KV and keep it resident (never evicted) until `unpin(id)`. Returns its id."""
        (out,) = self.generate([prompt], SamplingParams(max_new_tokens=0, cache_salt=cache_salt), pin_result=True)
        return out.pin

    def unpin(self, pin_id: str) -> None:
        """Let a pin's KV go (into the prefix cache's care); requests still using it keep it until they end."""
        kept = self._pin(pin_id)
        del self._pins[pin_id]
        kept.unpinned = True
        if kept.users == 0:
            self._release_pin(kept)

    def pins(self) -> dict[str, dict[str, int]]:
        """Every pin: its token count and the pool blocks it holds."""
        return {pin_id: {"tokens": len(kept.tokens), "blocks": len(kept.blocks)} for pin_id, kept in self._pins.items()}

    def flush_cache(self) -> int:
        """Drop every cached block no request or pin holds (they count as evictions); returns how many."""
        return self.cache.evict(self.cache.num_cached_blocks)

    def _release_pin(self, kept: Pin) -> None:
        self.cache.unlock(kept.handle)
        for b in kept.blocks:
            self.blocks.decref(b)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt, tools)

    # ---- metrics --------------------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        c, s = self._counters, self.scheduler
        n = self.blocks.num_blocks
        return {
            "prompt_tokens": s.prompt_tokens,
            "compute_saved_tokens": s.hit_tokens,
            "prefill_skip_ratio": s.hit_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
            "output_tokens": c["output_tokens"],
            "forwards": self.runner.forwards,
            "avg_forward_per_output_token": self.runner.forwards / c["output_tokens"] if c["output_tokens"] else 0.0,
            "decode_batch_factor": c["decode_tokens"] / c["decode_steps"] if c["decode_steps"] else 0.0,
            "kv_utilization": (n - self.blocks.num_free) / n,
            "kv_peak_utilization": self._peak_used / n,
            "cached_blocks": self.cache.num_cached_blocks,
            "free_blocks": self.blocks.num_free,
            "num_blocks": n,
            "evictions": self.cache.evictions,
            "preemptions": s.preemptions,
            "running_requests": len(s.running),
            "waiting_requests": len(s.waiting),
            "pins": len(self._pins),
            "pinned_blocks": (pinned := self._pinned_blocks()),
            "pinned_bytes": pinned * self.runner.block_bytes,
            "kv_pool_bytes": n * self.runner.block_bytes,
        }
