"""The engine: requests in, tokens out, KV and prefix reuse managed underneath.

`Engine` is synchronous and single-threaded: `step()` schedules one batch, runs one forward and
samples; `generate` and `stream` drive steps until their requests finish. Serving layers (an HTTP API,
a gateway) are expected to own a thread that calls `step()`; nothing here assumes a caller.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from generation.block_manager import BlockManager
from generation.config import EngineConfig, SamplingParams
from generation.model_runner import ModelRunner
from generation.prefix_cache import make_prefix_cache
from generation.sampler import sample
from generation.scheduler import Scheduler
from generation.sequence import Sequence, Status
from generation.weights import load_model

Prompt = str | list[int]


@dataclass
class GenerationOutput:
    index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    cached_tokens: int
    finish_reason: str
    logprobs: list[dict[str, Any]] | None = None


@dataclass
class TokenEvent:
    """One streamed token; `text` is the new printable text (held back while it may be a stop string)."""

    index: int
    token_id: int
    text: str
    finish_reason: str | None = None
    logprob: dict[str, Any] | None = None
    cached_tokens: int = 0


@dataclass
class KVPrefix:
    """Computed KV kept alive outside any request: a pinned checkpoint or a session's history."""

    tokens: list[int]
    blocks: list[int]
    num_computed: int
    handle: Any = None
    salt: str | None = None
    released: bool = field(default=False, repr=False)


class Engine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        config = config or EngineConfig()
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model_config, weights, self.tokenizer = load_model(config.model)
        self.runner = ModelRunner(config, self.model_config, weights)
        del weights
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size)
        self.cache = make_prefix_cache(config.cache_backend, self.blocks)
        self.scheduler = Scheduler(config, self.blocks, self.cache)
        self.max_model_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                                 self.runner.num_blocks * config.block_size)
        self.eos_ids = set(self.model_config.eos_token_ids)
        self._rng = torch.Generator().manual_seed(config.seed)
        self._checkpoints: dict[str, KVPrefix] = {}
        self._cp_ids = itertools.count()
        self._counters = dict(output_tokens=0, decode_tokens=0, decode_steps=0, steps=0)
        self._peak_used = 0

    # ---- requests ---------------------------------------------------------------------------------

    def encode(self, prompt: Prompt, field_name: str = "prompt") -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise ValueError(f"{field_name}: token ids {bad[:5]} outside the vocabulary (size {self.model_config.vocab_size})")
            return list(prompt)
        raise ValueError(f"{field_name}: must be a string or a list of token ids")

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, *, index: int = 0,
                    prefix: KVPrefix | None = None) -> Sequence:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("params: must be a SamplingParams")
        ids = self.encode(prompt)
        if prefix is not None:
            if prefix.released:
                raise ValueError("checkpoint: already released")
            if params.cache_salt != prefix.salt:
                raise ValueError("params.cache_salt: must match the checkpoint's salt")
            ids = prefix.tokens + ids
        if not ids:
            raise ValueError("prompt: empty (give at least one token)")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens, limit is EngineConfig.max_model_len - 1 = {self.max_model_len - 1}")
        seq = Sequence(prompt_ids=ids, params=params, index=index, checkpoint=prefix)
        if params.temperature > 0:
            seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self._rng))
            seq.generator = torch.Generator(device=self.runner.device).manual_seed(seed)
        if params.max_new_tokens == 0:
            seq.status, seq.finish_reason = Status.FINISHED, "length"
            return seq
        self.scheduler.add(seq)
        return seq

    # ---- the loop ---------------------------------------------------------------------------------

    def step(self) -> list[tuple[Sequence, int | None]]:
        """Run one scheduled batch; returns (sequence, new token or None) for every sequence that moved."""
        plan = self.scheduler.schedule()
        if not plan:
            if self.scheduler.waiting or self.scheduler.running:
                raise RuntimeError("KV pool too small for the waiting request: raise EngineConfig.num_blocks "
                                   "or kv_cache_memory_mb")
            return []
        logits, sampled = self.runner.run(plan)
        self._counters["steps"] += 1
        if plan.decode:
            self._counters["decode_steps"] += 1
            self._counters["decode_tokens"] += len(plan.decode)
        for seq in plan.decode:
            seq.num_computed += 1
        for seq, n in plan.prefill:
            seq.num_computed += n
        self._peak_used = max(self._peak_used, self.blocks.num_blocks - self.blocks.num_free)
        tokens, records = sample(logits, sampled) if sampled else ([], [])
        moved: list[tuple[Sequence, int | None]] = []
        for seq, tok, rec in zip(sampled, tokens, records):
            seq.output_ids.append(tok)
            if rec is not None:
                seq.logprobs.append(rec)
            self._counters["output_tokens"] += 1
            reason = self._stop_reason(seq, tok)
            if reason:
                self._finish(seq, reason)
            moved.append((seq, tok))
        for seq, _ in plan.prefill:
            if seq.status is not Status.RUNNING:
                continue
            if seq.prefill_only and seq.num_uncomputed == 0:
                self._finish(seq, "length")
            elif seq.num_uncomputed > 0:
                self.scheduler.cache_progress(seq)
                moved.append((seq, None))
        for seq in plan.decode:
            if seq.prefill_only and seq.status is Status.RUNNING:
                self._finish(seq, "length")
        return moved

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.keep_kv:
            self.scheduler.cache_progress(seq)
        self.scheduler.finish(seq, reason, keep=seq.keep_kv)
        if reason != "stop" or not seq.params.stop:
            seq.text = self.tokenizer.decode(seq.output_ids)

    def _stop_reason(self, seq: Sequence, tok: int) -> str | None:
        p = seq.params
        if (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            return "stop"
        if p.stop:
            seq.text = self.tokenizer.decode(seq.output_ids)
            # a stop string may straddle token boundaries: search the tail that the new token could complete
            window = max(len(s) for s in p.stop) + 16
            start = max(0, len(seq.text) - window)
            hits = [i for i in (seq.text.find(s, start) for s in p.stop) if i >= 0]
            if hits:
                seq.text = seq.text[: min(hits)]
                return "stop"
        if len(seq.output_ids) >= p.max_new_tokens or len(seq) >= self.max_model_len:
            return "length"
        return None

    def _run(self, seqs: list[Sequence]) -> Iterator[tuple[Sequence, int | None]]:
        mine = {id(s) for s in seqs}
        try:
            while any(s.status is not Status.FINISHED for s in seqs):
                for seq, tok in self.step():
                    if id(seq) in mine:
                        yield seq, tok
        finally:  # an error or a consumer that stops early must not leave its requests holding the pool
            for seq in seqs:
                if seq.status is not Status.FINISHED:
                    self.scheduler.abort(seq)

    def _submit(self, prompts: Prompt | list[Prompt], params: SamplingParams | list[SamplingParams] | None,
                prefix: KVPrefix | None) -> list[Sequence]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, list) or not prompts:
            raise ValueError("prompts: give a string, a list of token ids, or a non-empty list of those")
        if isinstance(params, list):
            if len(params) != len(prompts):
                raise ValueError(f"params: {len(params)} given for {len(prompts)} prompts")
        else:
            params = [params or SamplingParams()] * len(prompts)
        return [self.add_request(p, sp, index=i, prefix=prefix) for i, (p, sp) in enumerate(zip(prompts, params))]

    def generate(self, prompts: Prompt | list[Prompt], params: SamplingParams | list[SamplingParams] | None = None,
                 *, checkpoint: str | None = None) -> list[GenerationOutput]:
        """Run prompts to completion (batched continuously); one output per prompt, in order.

        With `checkpoint`, each prompt is a continuation of that pinned prefix and reuses all of its KV.
        """
        seqs = self._submit(prompts, params, self._checkpoint(checkpoint))
        for _ in self._run(seqs):
            pass
        return [self._output(s) for s in seqs]

    def stream(self, prompts: Prompt | list[Prompt], params: SamplingParams | list[SamplingParams] | None = None,
               *, checkpoint: str | None = None) -> Iterator[TokenEvent]:
        seqs = self._submit(prompts, params, self._checkpoint(checkpoint))
        run = self._run(seqs)
        try:
            for seq, tok in run:
                if tok is None:
                    continue
                yield TokenEvent(seq.index, tok, self._new_text(seq), seq.finish_reason,
                                 seq.logprobs[-1] if seq.params.logprobs is not None else None, seq.cached_tokens)
        finally:
            run.close()

    def _new_text(self, seq: Sequence) -> str:
        if seq.status is not Status.FINISHED and not seq.params.stop:
            seq.text = self.tokenizer.decode(seq.output_ids)
        text = seq.text
        if seq.status is not Status.FINISHED:
            hold = max((len(s) - 1 for s in seq.params.stop), default=0)
            text = text[: len(text) - hold] if hold else text
            text = text.rstrip("\ufffd")  # an incomplete UTF-8 sequence waits for its next byte
        delta = text[seq.emitted_text_len :]
        seq.emitted_text_len = max(seq.emitted_text_len, len(text))
        return delta

    def _output(self, seq: Sequence) -> GenerationOutput:
        return GenerationOutput(seq.index, seq.prompt_ids, list(seq.output_ids), seq.text, seq.cached_tokens,
                                seq.finish_reason or "length", seq.logprobs if seq.params.logprobs is not None else None)

    # ---- checkpoints and sessions -------------------------------------------------------------------

    def _checkpoint(self, checkpoint_id: str | None) -> KVPrefix | None:
        if checkpoint_id is None:
            return None
        if checkpoint_id not in self._checkpoints:
            raise ValueError(f"checkpoint: unknown or released id {checkpoint_id!r}")
        return self._checkpoints[checkpoint_id]

    def _compute_prefix(self, ids: list[int], params: SamplingParams, prefix: KVPrefix | None,
                        prefill_only: bool) -> tuple[Sequence, KVPrefix]:
        seq = self.add_request(ids, params, prefix=prefix)
        seq.prefill_only = prefill_only
        seq.keep_kv = True
        for _ in self._run([seq]):
            pass
        kept = KVPrefix(seq.all_ids, seq.block_table, seq.num_computed, seq.cache_handle, params.cache_salt)
        seq.block_table, seq.cache_handle = [], None
        return seq, kept

    def checkpoint(self, prompt: Prompt, *, cache_salt: str | None = None) -> str:
        """Compute and pin a prefix; it is never evicted until `release(id)`. Returns its id."""
        ids = self.encode(prompt)
        _, kept = self._compute_prefix(ids, SamplingParams(max_new_tokens=1, cache_salt=cache_salt), None, True)
        cid = f"cp-{next(self._cp_ids)}"
        self._checkpoints[cid] = kept
        return cid

    def release_prefix(self, prefix: KVPrefix) -> None:
        if prefix.released:
            return
        self.cache.unlock(prefix.handle)
        for b in prefix.blocks:
            self.blocks.decref(b)
        prefix.released = True

    def release(self, checkpoint_id: str) -> None:
        prefix = self._checkpoint(checkpoint_id)
        del self._checkpoints[checkpoint_id]
        self.release_prefix(prefix)

    def session(self, cache_salt: str | None = None) -> Session:
        return Session(self, cache_salt)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt)

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
        }


class Session:
    """A conversation whose KV stays resident: each turn computes only the tokens it adds."""

    def __init__(self, engine: Engine, cache_salt: str | None = None) -> None:
        self.engine = engine
        self.salt = cache_salt
        self.prefix: KVPrefix | None = None

    @property
    def token_ids(self) -> list[int]:
        return list(self.prefix.tokens) if self.prefix else []

    def send(self, prompt: Prompt, params: SamplingParams | None = None) -> GenerationOutput:
        """Append `prompt` to the conversation and generate; the reply becomes part of the history."""
        params = params or SamplingParams()
        if params.max_new_tokens < 1:
            raise ValueError("params.max_new_tokens: a session turn must generate at least 1 token")
        if params.cache_salt != self.salt:
            params = SamplingParams(**{**params.__dict__, "cache_salt": self.salt})
        ids = self.engine.encode(prompt)
        seq, kept = self.engine._compute_prefix(ids, params, self.prefix, prefill_only=False)
        if self.prefix is not None:
            self.engine.release_prefix(self.prefix)
        self.prefix = kept
        return self.engine._output(seq)

    def close(self) -> None:
        if self.prefix is not None:
            self.engine.release_prefix(self.prefix)
            self.prefix = None

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
