"""OpenAI's wire shapes: chat completions, completions, their SSE streams, logprobs, and the error dialect.

What the SDK reads is what is written: `chat.completion` / `chat.completion.chunk` / `text_completion`
objects, `usage` with `prompt_tokens_details.cached_tokens`, streams ending with `data: [DONE]` (a usage
chunk before it with `stream_options.include_usage`), and errors as `{"error": {"message", "type",
"param", "code"}}`. A choice the engine cut short (deadline, error, shutdown) has no OpenAI finish reason:
outside a stream it fails the request (504/500/503); inside one it becomes an error event before
`[DONE]`, as vLLM does.
"""

from __future__ import annotations

import codecs
import time
import uuid
from collections.abc import Iterator
from contextlib import closing
from typing import Any

from serving.errors import ApiError, error_body
from serving.generate.call_list import Arguments, Begin, CallList, End
from serving.generate.service import Run, Service, failure
from serving.generate.streaming import DONE, sse
from serving.generate.tool_reply import REPLY, AutoAnswer, Reply
from serving.generate.tools import tool_call

SERVER_SIDE = {"overloaded", "not_ready", "timeout", "model_error", "internal_error", "aborted",
               "insufficient_storage"}


def error_dialect(body: dict) -> dict:
    """The core's error body in OpenAI's shape: our `type` becomes `code`, our `field` becomes `param`."""
    err = body["error"]
    if err["type"] == "unauthorized":
        kind = "authentication_error"
    else:
        kind = "server_error" if err["type"] in SERVER_SIDE else "invalid_request_error"
    return {"error": {"message": err["message"], "type": kind, "param": err["field"], "code": err["type"]}}


def raise_failures(outputs: list[Any]) -> None:
    for out in outputs:
        fail = failure(out)
        if fail is not None:
            raise fail


def stream_error(exc: ApiError, request_id: str | None) -> str:
    return sse(error_dialect(error_body(exc.message, exc.type, exc.field, request_id)))


# ---- logprobs ------------------------------------------------------------------------------------------

def _token(service: Service, token_id: int) -> tuple[str, list[int]]:
    raw = service.token_bytes(token_id)
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_logprob(service: Service, rec: dict) -> dict:
    text, raw = _token(service, rec["token_id"])
    top = []
    for token_id, logprob in rec.get("top", []):
        t, b = _token(service, token_id)
        top.append({"token": t, "logprob": logprob, "bytes": b})
    return {"token": text, "logprob": rec["logprob"], "bytes": raw, "top_logprobs": top}


def legacy_logprobs(service: Service, scored: list[tuple[int, dict | None]], offset: int) -> dict:
    """Completions' logprobs: parallel lists; `text_offset` is where each token starts in the choice's text.

    A token may hold part of a character: its `tokens` entry then shows U+FFFD, but the offsets count the
    characters the tokens' bytes decode to so far (an incomplete character counts once it completes), which is
    where a stream, whose text deltas hold such bytes back, puts them too."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for token_id, rec in scored:
        text, raw = _token(service, token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(None if rec is None else rec["logprob"])
        out["top_logprobs"].append(None if rec is None or "top" not in rec else
                                   {_token(service, t)[0]: lp for t, lp in rec["top"]})
        out["text_offset"].append(offset)
        offset += len(decoder.decode(bytes(raw)))
    return out


def _head(kind: str, prefix: str, service: Service) -> dict:
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": service.name}


# ---- chat ----------------------------------------------------------------------------------------------

def _choice(run: Run, out: Any) -> tuple[dict, str]:
    """The answer as a message, and its finish reason: calls (a forced call's, or those auto chose) are its
    `tool_calls` (content null, as OpenAI sends); an answer that does not parse (cut by `max_tokens`) stays text,
    beside its `length` finish reason, and auto's reply is its text, decoded."""
    tools = run.req.tools
    if tools is None or not tools.constrained:
        return {"role": "assistant", "content": out.text}, out.finish_reason
    calls = tools.calls(out.text)
    finish = tools.finish_reason(calls is not None, out.finish_reason)
    if calls is None:
        return {"role": "assistant", "content": tools.content(out.text)}, finish
    return {"role": "assistant", "content": None, "tool_calls": calls}, finish


def chat_completion(run: Run, service: Service) -> dict:
    outputs = run.wait()
    raise_failures(outputs)
    want = run.req.logprobs is not None
    choices = []
    for i, out in enumerate(outputs):
        message, finish = _choice(run, out)
        choices.append({"index": i, "message": message, "finish_reason": finish,
                        "logprobs": {"content": [chat_logprob(service, r) for r in out.logprobs]} if want else None})
    return {**_head("chat.completion", "chatcmpl", service), "choices": choices, "usage": run.usage()}


def chat_stream(run: Run, service: Service, request_id: str) -> Iterator[str]:
    from generation.engine import TokenEvent

    req = run.req
    head = _head("chat.completion.chunk", "chatcmpl", service)
    usage = {"usage": None} if req.include_usage else {}

    def chunk(i: int, delta: dict, logprobs: dict | None = None, finish: str | None = None) -> str:
        return sse({**head, "choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
                    **usage})

    tools = req.tools if req.tools is not None and req.tools.constrained else None
    forced = tools.forced if tools is not None else None
    auto = tools is not None and tools.auto  # calls or a reply, known once its first key shows (tool_reply.py)
    listed = tools is not None and forced is None and not auto  # "required": each call as it shows (call_list.py)
    held = [""] * run.n_choices  # a list's whole text, to tell at its end whether it parses
    lists = [CallList() for _ in range(run.n_choices)]
    answers = [AutoAnswer() for _ in range(run.n_choices)]

    def delta(text: str) -> dict:
        return {"content": text} if forced is None else {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}

    try:
        for i in range(run.n_choices):
            if forced is not None:  # the call's id and name first, then its arguments as they come
                call = tool_call(forced.name, "")
                yield chunk(i, {"role": "assistant", "content": None, "tool_calls": [{"index": 0, **call}]})
            else:
                yield chunk(i, {"role": "assistant", "content": None if tools else ""})
        with closing(run.events()) as events:
            for i, ev in events:
                if isinstance(ev, TokenEvent):
                    lp = {"content": [chat_logprob(service, ev.logprob)]} if req.logprobs is not None and ev.logprob else None
                    if listed or auto:
                        held[i] += ev.text
                        news = (answers[i] if auto else lists[i]).feed(ev.text)
                        deltas = [_news_delta(e) for e in news if not isinstance(e, End)]
                        for d in deltas or ([{}] if lp else []):
                            yield chunk(i, d, lp)
                            lp = None  # the token's logprobs ride on its first chunk
                    elif ev.text or lp:
                        yield chunk(i, delta(ev.text) if ev.text else {}, lp)
                    continue
                fail = failure(ev)
                if fail is not None:
                    raise fail
                finish = ev.finish_reason
                if listed or auto:
                    called = tools.calls(held[i]) is not None
                    if not called and not (auto and answers[i].kind == REPLY):
                        # cut short: the text the whole answer gives as content (a reply has sent its own)
                        yield chunk(i, {"content": tools.content(held[i])})
                    finish = tools.finish_reason(called, finish)
                yield chunk(i, {}, finish=finish)
        if req.include_usage:
            yield sse({**head, "choices": [], "usage": run.usage()})
    except ApiError as exc:
        yield stream_error(exc, request_id)
    yield DONE


def _news_delta(event: Begin | Arguments | Reply) -> dict:
    """A list's news as a chat delta (a call's id and name, or more of its arguments), or more of auto's reply."""
    if isinstance(event, Reply):
        return {"content": event.text}
    if isinstance(event, Begin):
        return {"tool_calls": [{"index": event.index, **tool_call(event.name, "")}]}
    return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}


# ---- completions ---------------------------------------------------------------------------------------

def _prompt_text(run: Run, service: Service, i: int) -> str:
    """The prompt as echoed: a token-id prompt's special tokens stay in its text, as in the logprobs' tokens and
    text offsets (decoded without them, `text_offset` pointed past the text it indexes)."""
    prompt = run.req.prompts[i]
    return prompt if isinstance(prompt, str) else service.engine.tokenizer.decode(prompt, skip_special_tokens=False)


def _echo_scored(run: Run, i: int, out: Any) -> list[tuple[int, dict | None]]:
    records = out.prompt_logprobs or [None] * len(run.prompt_ids[i])
    return list(zip(run.prompt_ids[i], records))


def completion(run: Run, service: Service) -> dict:
    outputs = run.wait()
    raise_failures(outputs)
    req = run.req
    choices = []
    for b, out in enumerate(outputs):
        i = b // req.n
        echo = _prompt_text(run, service, i) if req.echo else ""
        logprobs = None
        if req.logprobs is not None:
            scored = (_echo_scored(run, i, out) if req.echo else []) + [(r["token_id"], r) for r in out.logprobs]
            logprobs = legacy_logprobs(service, scored, 0)
        choices.append({"index": b, "text": echo + out.text, "logprobs": logprobs, "finish_reason": out.finish_reason})
    return {**_head("text_completion", "cmpl", service), "choices": choices, "usage": run.usage()}


def completion_stream(run: Run, service: Service, request_id: str) -> Iterator[str]:
    from generation.engine import TokenEvent

    req = run.req
    head = _head("text_completion", "cmpl", service)
    usage = {"usage": None} if req.include_usage else {}
    offsets = [0] * run.n_choices

    def chunk(b: int, text: str, logprobs: dict | None = None, finish: str | None = None) -> str:
        return sse({**head, "choices": [{"index": b, "text": text, "logprobs": logprobs, "finish_reason": finish}],
                    **usage})

    try:
        if req.echo:  # (echo with logprobs is refused in a stream: the prompt's records come only at the end)
            for b in range(run.n_choices):
                text = _prompt_text(run, service, b // req.n)
                offsets[b] = len(text)
                yield chunk(b, text)
        with closing(run.events()) as events:
            for b, ev in events:
                if isinstance(ev, TokenEvent):
                    lp = None
                    if req.logprobs is not None and ev.logprob:
                        lp = legacy_logprobs(service, [(ev.token_id, ev.logprob)], offsets[b])
                    offsets[b] += len(ev.text)
                    if ev.text or lp:
                        yield chunk(b, ev.text, lp)
                    continue
                fail = failure(ev)
                if fail is not None:
                    raise fail
                yield chunk(b, "", finish=ev.finish_reason)
        if req.include_usage:
            yield sse({**head, "choices": [], "usage": run.usage()})
    except ApiError as exc:
        yield stream_error(exc, request_id)
    yield DONE
