"""Programs on the engine in this process, through an `EngineLoop`, so all running states share its batch.

A fork pins its prefix: the parent's text, tokenised, is computed once and kept resident as a KV pin,
and every branch's first request continues that pin, so it starts with the prefix computed whatever the
eviction pressure (the engine's `compute_saved_tokens` shows it). The pin holds all the prefix's tokens
but the last: a prompt is tokenised whole, and the prefix's last token may merge with the text a branch
appends ("Answer: " + "yes" ends in " yes", not " " + "yes"), while the tokens before it stay put.
A branch's later requests go through the prefix cache instead, which holds the pin's full blocks and
everything the branch's earlier requests computed: the engine matches a request that continues a pin
only up to the pin's end, so the pin would make them recompute the branch's own text. A `select` pins
its text the same way while its choices are scored, so each choice computes only its own tokens and the
scoring window.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from generation.config import InvalidParam, SamplingParams
from generation.engine import Engine, GenerationOutput, TokenEvent
from generation.engine_loop import BatchHandle, EngineLoop
from generation.lang.backend import Backend, OnText
from generation.lang.chat_template import ChatTemplate
from generation.lang.choices import ChoiceScores, scored_from
from generation.lang.errors import CallSite, LangError
from generation.lang.ir import GenParams

log = logging.getLogger(__name__)


class LocalBackend(Backend):
    """`LocalBackend(engine)` starts (and `close()` stops) an EngineLoop on `engine`; given an EngineLoop,
    it shares that loop with its other users. `pin_prefixes=False` leaves the prefixes of forks and selects
    to the prefix cache (no pins)."""

    def __init__(self, engine: Engine | EngineLoop, *, pin_prefixes: bool = True) -> None:
        self._owns_loop = not isinstance(engine, EngineLoop)
        self.loop = EngineLoop(engine) if self._owns_loop else engine
        self.engine = self.loop.engine
        self.pin_prefixes = pin_prefixes
        tokenizer = self.engine.tokenizer
        self._template = (ChatTemplate(lambda messages: tokenizer.apply_chat_template(messages, False))
                          if tokenizer.chat_template else None)
        self._pins: dict[str, list[int]] = {}
        self._lock = threading.Lock()  # a pin is never unpinned between a request's lookup and its submit

    def close(self) -> None:
        if self._owns_loop:
            self.loop.close()

    def __enter__(self) -> LocalBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def chat_template(self) -> ChatTemplate | None:
        return self._template

    # ---- requests ---------------------------------------------------------------------------------

    def _submit(self, prompts: list[list[int]], params: list[SamplingParams], site: CallSite,
                shared: str | None = None) -> BatchHandle:
        """Submit the prompts together, each continuing the pin `shared` when its tokens start with the pin's."""
        with self._lock:
            kept = self._pins.get(shared) if shared is not None else None
            pins, rests = [], []
            for ids in prompts:
                fits = kept is not None and len(kept) < len(ids) and ids[:len(kept)] == kept
                pins.append(shared if fits else None)
                rests.append(ids[len(kept):] if fits else ids)
            try:
                return self.loop.submit_batch(rests, params, pins=pins)
            except ValueError as exc:
                raise LangError(site, str(exc)) from None

    def _finish(self, batch: BatchHandle, site: CallSite, on_text: OnText | None = None) -> list[GenerationOutput]:
        for event in batch:
            if on_text is not None and isinstance(event, TokenEvent) and event.text:
                on_text(event.text)
        for out in batch.outputs:
            if out.finish_reason not in ("stop", "length"):
                raise LangError(site, f"the engine ended the request with {out.finish_reason}: {out.error or ''}".rstrip(": "))
        return batch.outputs  # type: ignore[return-value]

    def _sampling(self, params: GenParams, site: CallSite) -> SamplingParams:
        # the constraint rides in SamplingParams, as every engine client's does: its shape is checked here,
        # it is compiled when the request is submitted, and either failure is a LangError naming the call
        try:
            return SamplingParams(
                max_new_tokens=params.max_new_tokens, min_new_tokens=params.min_new_tokens or 0,
                temperature=params.temperature, top_p=params.top_p,
                top_k=0 if params.top_k in (None, -1) else params.top_k, min_p=params.min_p,
                frequency_penalty=params.frequency_penalty, presence_penalty=params.presence_penalty,
                stop=params.stops, stop_token_ids=list(params.stop_token_ids or []), ignore_eos=params.ignore_eos,
                trim_stop_token=True,  # a stop token's text is left out, as SGLang's server (and HttpBackend) leave it
                seed=params.seed, logprobs=(params.top_logprobs_num or 0) if params.return_logprob else None,
                constraint=params.constraint)
        except InvalidParam as exc:
            raise LangError(site, str(exc)) from None

    def _token_text(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id], skip_special_tokens=False)

    def generate(self, text: str, params: GenParams, site: CallSite, on_text: OnText | None = None,
                 shared: Any = None) -> tuple[str, dict]:
        sp = self._sampling(params, site)
        batch = self._submit([self.engine.tokenizer.encode(text)], [sp], site, shared)
        (out,) = self._finish(batch, site, on_text)
        meta: dict[str, Any] = {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": len(out.token_ids),
                                "cached_tokens": out.cached_tokens, "finish_reason": _finish_reason(out)}
        if out.logprobs is not None:
            meta["output_token_logprobs"] = [[r["logprob"], r["token_id"], self._token_text(r["token_id"])]
                                             for r in out.logprobs]
            if params.top_logprobs_num:
                meta["output_top_logprobs"] = [[[lp, t, self._token_text(t)] for t, lp in r["top"]] for r in out.logprobs]
        return out.text, meta

    def choice_scores(self, text: str, choices: list[str], unconditional: bool, site: CallSite,
                      shared: Any = None) -> ChoiceScores:
        encode = self.engine.tokenizer.encode
        ids = encode(text)
        start = scored_from(len(ids))
        scoring = SamplingParams(max_new_tokens=0, prompt_logprobs=0, prompt_logprobs_start=start)
        # As SGLang's select first caches the text, the text is pinned while its choices are scored: each
        # choice then continues it exactly (the prefix cache would only give it the text's full blocks).
        reuse = shared in self._pins and self._pins[shared] == ids[:-1]  # a branch's first call, right at the fork
        own = None if reuse or len(choices) < 2 else self._pin(ids[:-1])
        try:
            batch = self._submit([encode(text + c) for c in choices], [scoring] * len(choices), site, own or shared)
            outs = self._finish(batch, site)
        finally:
            self.release(own)
        entries = [[(r["logprob"], r["token_id"], self._token_text(r["token_id"])) for r in out.prompt_logprobs]
                   for out in outs]
        scores = ChoiceScores(list(choices), entries)
        if unconditional:
            alone = [[e[1] for e in es] for es in entries if es]
            params = SamplingParams(max_new_tokens=0, prompt_logprobs=0, prompt_logprobs_start=1)
            scored = iter(self._finish(self._submit(alone, [params] * len(alone), site), site) if alone else [])
            scores.unconditional = [[0.0, *(r["logprob"] for r in next(scored).prompt_logprobs)] if es else []
                                    for es in entries]
        return scores

    # ---- forks ------------------------------------------------------------------------------------

    def share_prefix(self, text: str, site: CallSite) -> str | None:
        return self._pin(self.engine.tokenizer.encode(text)[:-1])

    def _pin(self, ids: list[int]) -> str | None:
        """Pin `ids` (None when pins are off, `ids` is empty, or the pool cannot hold it: the prefix
        cache then shares what it can)."""
        if not self.pin_prefixes or not ids:
            return None
        try:
            pin = self.loop.pin(ids)
        except (RuntimeError, ValueError) as exc:
            log.info("prefix of %d tokens not pinned (%s); relying on the prefix cache", len(ids), exc)
            return None
        with self._lock:
            self._pins[pin] = ids
        return pin

    def release(self, handle: Any) -> None:
        if handle is None:
            return
        with self._lock:
            self._pins.pop(handle, None)
            self.loop.unpin(handle)


def _finish_reason(out: GenerationOutput) -> dict[str, Any]:
    if out.finish_reason == "stop":
        return {"type": "stop", "matched": out.matched_stop}
    return {"type": "length", "length": len(out.token_ids)}
