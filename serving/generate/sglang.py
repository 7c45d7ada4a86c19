"""SGLang's native wire shapes: `/generate` answers and streams, as `sglang.RuntimeEndpoint` reads them.

An answer is `{"text", "output_ids", "meta_info"}` (a list for a batch or n > 1). `meta_info` carries the
id, `finish_reason` (`{"type": "stop", "matched": token id or string}`, `{"type": "length", "length": n}`,
or `{"type": "abort", "message"}`), prompt/completion/cached token counts, `e2e_latency` and, with
`return_logprob`, logprob entries `[logprob, token_id, text or null]`. Prompt logprobs follow SGLang
exactly: entries for the tokens from `logprob_start_len` on, the first of them `None` (SGLang computes
the logits from that position, not before it), which is what `select`'s token-healing arithmetic
expects; the engine therefore scores from `logprob_start_len + 1`. A stream sends the text so far in
each event and ends with `data: [DONE]`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import closing
from typing import Any

from serving.errors import ApiError, error_body
from serving.generate.body import bad
from serving.generate.schema import Request
from serving.generate.service import Run, Service, failure
from serving.generate.streaming import DONE, sse


def prompt_logprobs_from(req: Request, prompt_ids: list[list[int]]) -> list[int] | None:
    """Where the engine starts scoring each prompt (None: no prompt logprobs asked). SGLang's -1 means
    output logprobs only."""
    if not req.return_logprob or req.logprob_start_len < 0:
        return None
    for ids, where in zip(prompt_ids, req.where):
        if req.logprob_start_len > len(ids):
            raise bad("logprob_start_len", f"{req.logprob_start_len} is past the end of {where} ({len(ids)} tokens)")
    return [req.logprob_start_len + 1] * len(prompt_ids)


def finish_reason(out: Any) -> dict:
    if out.finish_reason == "stop":
        return {"type": "stop", "matched": out.matched_stop}
    if out.finish_reason == "length":
        return {"type": "length", "length": len(out.token_ids)}
    return {"type": "abort", "message": out.error or out.finish_reason}


class Writer:
    """Builds one request's answers; keeps the per-choice logprob entries a stream accumulates."""

    def __init__(self, run: Run, service: Service):
        self.run = run
        self.req = run.req
        self.service = service
        self.with_text = run.req.return_text_in_logprobs

    def entry(self, logprob: float | None, token_id: int) -> list:
        return [logprob, token_id, self.service.token_text(token_id) if self.with_text else None]

    def top(self, rec: dict | None) -> list | None:
        return None if rec is None else [self.entry(lp, t) for t, lp in rec.get("top", [])]

    def meta(self, b: int, out: Any, token_ids: list[int], records: list[dict], cached: int) -> dict:
        """`out` is the GenerationOutput, or None while the choice is still streaming."""
        req = self.req
        prompt = self.run.prompt_ids[b // req.n]
        meta: dict[str, Any] = {
            "id": self.run.batch.handles[b].request_id,
            "finish_reason": None if out is None else finish_reason(out),
            "prompt_tokens": len(prompt), "completion_tokens": len(token_ids), "cached_tokens": cached,
            "e2e_latency": round(time.monotonic() - self.run.t0, 4),
        }
        if not req.return_logprob:
            return meta
        meta["output_token_logprobs"] = [self.entry(r["logprob"], r["token_id"]) for r in records]
        start = req.logprob_start_len
        scored = out.prompt_logprobs if out is not None and out.prompt_logprobs is not None else []
        first = [None] if 0 <= start < len(prompt) and out is not None else []
        meta["input_token_logprobs"] = ([self.entry(None, prompt[start])] if first else []) + \
            [self.entry(r["logprob"], r["token_id"]) for r in scored]
        if req.top_logprobs_num:
            meta["output_top_logprobs"] = [self.top(r) for r in records]
            meta["input_top_logprobs"] = first + [self.top(r) for r in scored]
        return meta

    def answer(self, b: int, out: Any) -> dict:
        return {"text": out.text, "output_ids": out.token_ids,
                "meta_info": self.meta(b, out, out.token_ids, out.logprobs or [], out.cached_tokens)}


def generate(run: Run, service: Service) -> dict | list:
    outputs = run.wait()
    for out in outputs:
        if out.finish_reason in ("deadline", "error"):  # SGLang answers an aborted choice as one, with its reason
            raise failure(out)
    writer = Writer(run, service)
    answers = [writer.answer(b, out) for b, out in enumerate(outputs)]
    return answers if run.req.batch or run.req.n > 1 else answers[0]


def generate_stream(run: Run, service: Service, request_id: str) -> Iterator[str]:
    from generation.engine import TokenEvent

    writer = Writer(run, service)
    many = run.req.batch or run.req.n > 1
    texts = [""] * run.n_choices
    ids: list[list[int]] = [[] for _ in range(run.n_choices)]
    records: list[list[dict]] = [[] for _ in range(run.n_choices)]

    def event(b: int, payload: dict) -> str:
        return sse({**payload, "index": b} if many else payload)

    try:
        with closing(run.events()) as events:
            for b, ev in events:
                if isinstance(ev, TokenEvent):
                    if ev.finish_reason is not None:
                        continue  # the last token: the answer that follows at once says it, with the finish
                    texts[b] += ev.text
                    ids[b].append(ev.token_id)
                    if ev.logprob is not None:
                        records[b].append(ev.logprob)
                    yield event(b, {"text": texts[b], "output_ids": ids[b],
                                    "meta_info": writer.meta(b, None, ids[b], records[b], ev.cached_tokens)})
                    continue
                if ev.finish_reason in ("deadline", "error"):
                    raise failure(ev)
                yield event(b, writer.answer(b, ev))
    except ApiError as exc:
        yield sse(error_body(exc.message, exc.type, exc.field, request_id))
    yield DONE
