"""OpenAI's Responses API (`POST /v1/responses`): its body read into a chat `Request`, its answer and its stream.

The SDK's `client.responses.create`, `.stream` and `.parse` (and agent frameworks built on them) speak this
dialect rather than chat completions. Its input is a list of items (messages, earlier function calls and their
outputs) and its output a list of items too, so a turn maps onto one chat turn: `instructions` become the
system message, items become messages, and the same engine run answers. A stream is typed events
(`response.created` ... `response.completed`), each with its `sequence_number` and an SSE `event:` line, and
ends without `[DONE]`.

The server keeps nothing between requests: `store` is taken and answered `false`, and `previous_response_id`
(which reads a stored response) is refused by name, so a client sends the conversation in `input`, as
stateless clients (and vLLM without its store) do. Function calls follow chat's rules (`tools.py`): a forced
call is constrained decoding, streamed as it is generated (`stream`); under `"auto"` (the default) the model
calls or replies in one constrained JSON answer, whose calls are `function_call` items and whose reply is a
message. A finish by length is status `incomplete` with `incomplete_details.reason: "max_output_tokens"`, as
OpenAI answers.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

from serving.errors import ApiError, error_body
from serving.generate.body import BodyConstraint, Fields, bad
from serving.generate.call_list import Arguments, Begin, CallList, End
from serving.generate.config import GenerateConfig
from serving.generate.openai import chat_logprob, raise_failures
from serving.generate.openai import error_dialect as openai_error
from serving.generate.schema import OPENAI_SAMPLING, Request, openai_sampling, parse_max_tokens
from serving.generate.service import Run, Service, failure
from serving.generate.streaming import sse
from serving.generate.tool_reply import REPLY, AutoAnswer, Reply
from serving.generate.tools import parse_tools, tool_call, tools_constraint

FIELDS = {"model", "input", "instructions", "max_output_tokens", "stream", "stream_options", "text", "tools",
          "tool_choice", "parallel_tool_calls", "store", "metadata", "user", "safety_identifier", "prompt_cache_key",
          "truncation", "include", "top_logprobs", "previous_response_id", "background", "reasoning",
          "service_tier", "verbosity", "stop", "stop_token_ids", *OPENAI_SAMPLING}
LOGPROBS = "message.output_text.logprobs"  # the one `include` this server can add to an answer
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}  # each part's text field
MAX_METADATA = 16  # OpenAI's limits: 16 pairs, keys up to 64 characters, values up to 512
TOP_LOGPROBS = 20


@dataclass
class Echo:
    """What a response object repeats of its request, as OpenAI's does."""

    instructions: str | None
    max_output_tokens: int | None
    temperature: float
    top_p: float
    text_format: dict[str, Any]
    tools: list[dict[str, Any]]
    tool_choice: Any
    parallel_tool_calls: bool
    metadata: dict[str, str]
    user: str | None
    safety_identifier: str | None
    prompt_cache_key: str | None
    top_logprobs: int
    include_logprobs: bool
    created_at: int = field(default_factory=lambda: int(time.time()))
    id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")


# ---- the body ------------------------------------------------------------------------------------------

def responses_request(body: Any, cfg: GenerateConfig) -> tuple[Request, Echo]:
    f = Fields(body, FIELDS)
    if f.has("previous_response_id"):
        raise bad("previous_response_id", "this server keeps no responses: send the whole conversation in `input`")
    if f.boolean("background"):
        raise bad("background", "only false is supported: answers come on the request that asked")
    if f.has("reasoning"):
        raise bad("reasoning", "not supported: this model does not reason before it answers")
    if f.raw("truncation", "disabled") != "disabled":
        raise bad("truncation", "only \"disabled\" is supported: a prompt over the context is refused, never cut")
    if f.has("service_tier") and f.raw("service_tier") not in ("auto", "default"):
        raise bad("service_tier", "only \"auto\" or \"default\": this server has one tier")
    f.boolean("store")  # taken, and answered false: nothing is kept
    for name in ("user", "safety_identifier", "prompt_cache_key"):  # identifiers; the prefix cache needs no key
        if f.has(name) and not isinstance(f.raw(name), str):
            raise bad(name, "must be a string")
    if f.has("stream_options"):
        if not f.boolean("stream"):
            raise bad("stream_options", "only allowed with stream: true")
        Fields(f.raw("stream_options"), {"include_obfuscation"}, "stream_options.", "stream_options").boolean(
            "include_obfuscation")  # nothing is padded: the stream's sizes show nothing a proxy could not see
    instructions = f.raw("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("instructions", "must be a string")
    turns = ([{"role": "system", "content": instructions}] if instructions else []) + _input(f.raw("input"))
    kw, names, _ = openai_sampling(f, cfg)
    kw["max_new_tokens"], given = parse_max_tokens(f, ("max_output_tokens",), cfg.max_new_tokens, cfg, low=1)
    names["max_new_tokens"] = "max_output_tokens"
    include = _include(f)
    top = f.integer("top_logprobs", 0, low=0, high=TOP_LOGPROBS)
    kw["logprobs"], names["logprobs"] = (top if include else None), "top_logprobs"
    model = f.raw("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "must be a string")
    tools = parse_tools(f, cfg, flat=True)
    asked, text_format = _text_format(f)
    constraint = tools_constraint(tools, kw["stop"], asked, "text.format")
    echo = Echo(instructions, kw["max_new_tokens"] if given else None, f.number("temperature", 1.0),
                f.number("top_p", 1.0), text_format, f.raw("tools", []), f.raw("tool_choice", "auto"),
                f.boolean("parallel_tool_calls", True), _metadata(f), f.raw("user"), f.raw("safety_identifier"),
                f.raw("prompt_cache_key"), top, include)
    req = Request("responses", [turns], ["input"], [kw], [names], stream=f.boolean("stream"), model=model,
                  constraint=constraint, tools=tools, logprobs=kw["logprobs"], max_tokens_set=[given])
    return req, echo


def _include(f: Fields) -> bool:
    """Whether the answer carries its tokens' logprobs: the only extra output this server has to include."""
    include = f.raw("include", [])
    if not isinstance(include, list) or not all(isinstance(v, str) for v in include):
        raise bad("include", "must be a list of strings")
    for i, value in enumerate(include):
        if value != LOGPROBS:
            raise bad(f"include[{i}]", f"only {LOGPROBS!r} is supported, got {value!r:.60}")
    return bool(include)


def _metadata(f: Fields) -> dict[str, str]:
    value = f.raw("metadata", {})
    if not isinstance(value, dict) or len(value) > MAX_METADATA:
        raise bad("metadata", f"must be an object of at most {MAX_METADATA} string pairs")
    for key, v in value.items():
        if len(key) > 64 or not isinstance(v, str) or len(v) > 512:
            raise bad(f"metadata.{key:.64}", "keys up to 64 characters, values strings up to 512")
    return value


def _text_format(f: Fields) -> tuple[BodyConstraint | None, dict[str, Any]]:
    """`text.format`: text, json_object, or json_schema with its schema beside its type (chat nests it)."""
    text = Fields(f.raw("text", {}), {"format", "verbosity"}, "text.", "text")
    for where, fields in (("verbosity", f), ("text.verbosity", text)):  # the SDK's parse sends the first
        if fields.raw(where.split(".")[-1], "medium") != "medium":
            raise bad(where, "only \"medium\" is supported: the model has no other")
    given = text.raw("format", {"type": "text"})
    fmt = Fields(given, {"type", "name", "schema", "strict", "description"}, "text.format.", "text.format")
    kind = fmt.raw("type")
    if kind == "text":
        return None, {"type": "text"}
    if kind == "json_object":
        return BodyConstraint("json_object", True, "text.format"), {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.raw("schema"), dict):
            raise bad("text.format.schema", "must be a JSON schema object")
        if not isinstance(fmt.raw("name"), str):
            raise bad("text.format.name", "is required: a string")
        fmt.boolean("strict")  # the output follows the schema, strict or not
        return BodyConstraint("json_schema", fmt.raw("schema"), "text.format.schema"), given
    raise bad("text.format.type", f"must be text, json_object or json_schema, got {kind!r}")


def _input(value: Any) -> list[dict[str, Any]]:
    """The input items as chat messages: a function call joins the assistant turn before it (chat's
    `tool_calls`), its output is a `tool` message."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad("input", "is required: a string or a non-empty list of input items")
    turns: list[dict[str, Any]] = []
    for j, item in enumerate(value):
        where = f"input[{j}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            turns.append(_message(item, where))
        elif kind == "function_call":
            call = Fields(item, {"type", "id", "call_id", "name", "arguments", "status", "parsed_arguments"}, f"{where}.",
                          "a function call")
            for name in ("call_id", "name", "arguments"):
                if not isinstance(call.raw(name), str):
                    raise bad(f"{where}.{name}", "is required: a string")
            entry = {"id": call.raw("call_id"), "type": "function",
                     "function": {"name": call.raw("name"), "arguments": call.raw("arguments")}}
            if turns and turns[-1]["role"] == "assistant":
                turns[-1].setdefault("tool_calls", []).append(entry)
            else:
                turns.append({"role": "assistant", "content": "", "tool_calls": [entry]})
        elif kind == "function_call_output":
            out = Fields(item, {"type", "id", "call_id", "output", "status"}, f"{where}.", "a function call output")
            if not isinstance(out.raw("call_id"), str):
                raise bad(f"{where}.call_id", "is required: the call_id of the call it answers")
            turns.append({"role": "tool", "tool_call_id": out.raw("call_id"),
                          "content": _text(out.raw("output"), f"{where}.output")})
        elif isinstance(item, dict):
            raise bad(f"{where}.type", f"must be message, function_call or function_call_output, got {kind!r:.40}"
                      + (" (this server keeps no items to refer to)" if kind == "item_reference" else ""))
        else:
            raise bad(where, f"an input item must be a JSON object, got {type(item).__name__}")
    return turns


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    # `phase` (commentary or final_answer) is what OpenAI asks clients to send back on an assistant's turns
    m = Fields(item, {"type", "role", "content", "id", "status", "phase"}, f"{where}.", "a message")
    role = m.raw("role")
    if not isinstance(role, str) or role not in ROLES:
        raise bad(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {role!r:.40}")
    return {"role": ROLES[role], "content": _text(m.raw("content"), f"{where}.content")}


def _text(content: Any, where: str) -> str | list[dict[str, str]]:
    """A string, or text parts as the chat template's tokenizer joins them. Images, files and audio are
    refused: this model reads text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(where, "must be a string or a list of content parts")
    parts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str) or kind not in TEXT_PARTS:  # a list or object is unhashable: the type first
            raise bad(f"{where}[{k}].type", "only input_text, output_text or refusal parts: this model reads text, "
                                            f"got {kind!r:.40}")
        # an earlier answer sent back as the SDK returned it carries its annotations, logprobs and parsed value
        p = Fields(part, {"type", TEXT_PARTS[kind], "annotations", "logprobs", "parsed"}, f"{where}[{k}].",
                   "a content part")
        text = p.raw(TEXT_PARTS[kind])
        if not isinstance(text, str):
            raise bad(p.where(TEXT_PARTS[kind]), "is required: a string")
        parts.append({"type": "text", "text": text})
    return parts


# ---- the answer ----------------------------------------------------------------------------------------

def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(run: Run) -> dict[str, Any]:
    u = run.usage()
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": u["prompt_tokens_details"],
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"]}


def _object(echo: Echo, service: Service, status: str, output: list[dict[str, Any]],
            usage: dict[str, Any] | None, error: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": echo.id, "object": "response", "created_at": echo.created_at, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None, "background": False, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": echo.instructions, "max_output_tokens": echo.max_output_tokens, "model": service.name,
            "output": output, "parallel_tool_calls": echo.parallel_tool_calls, "previous_response_id": None,
            "reasoning": None, "store": False, "temperature": echo.temperature, "top_p": echo.top_p,
            "text": {"format": echo.text_format, "verbosity": "medium"}, "tool_choice": echo.tool_choice,
            "tools": echo.tools, "top_logprobs": echo.top_logprobs, "truncation": "disabled", "usage": usage,
            "user": echo.user, "safety_identifier": echo.safety_identifier, "prompt_cache_key": echo.prompt_cache_key,
            "service_tier": "default", "metadata": echo.metadata}


def _text_part(text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def _message_item(item_id: str, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def _call_item(call: dict[str, Any], status: str, item_id: str | None = None) -> dict[str, Any]:
    """A `tool_calls` entry (chat's form) as a function_call output item."""
    fn = call["function"]
    return {"id": item_id or _id("fc"), "type": "function_call", "status": status, "call_id": call["id"],
            "name": fn["name"], "arguments": fn["arguments"]}


def _status(out: Any) -> str:
    return "incomplete" if out.finish_reason == "length" else "completed"


def answer(run: Run, service: Service, echo: Echo) -> dict[str, Any]:
    out = run.wait()[0]
    raise_failures([out])
    status = _status(out)
    tools = run.req.tools if run.req.tools is not None and run.req.tools.constrained else None
    calls = tools.calls(out.text) if tools is not None else None
    if calls is not None:
        # a listed call that parsed is whole, whatever cut the list after it (a stream closes its item as its object
        # closes, before the finish is known); a forced call's text is its arguments, cut or not
        whole = "completed" if tools.forced is None else status
        output = [_call_item(c, whole) for c in calls]
    else:
        logprobs = [chat_logprob(service, r) for r in out.logprobs] if echo.include_logprobs else []
        text = tools.content(out.text) if tools is not None else out.text
        output = [_message_item(_id("msg"), status, [_text_part(text, logprobs)])]
    return _object(echo, service, status, output, _usage(run))


class _CallItems:
    """function_call output items as their calls are generated, and their events: added (name and call_id,
    no arguments), argument deltas, then the arguments' done and the item's done. A forced call is one item,
    named before its first token; a `"required"` list's calls each open once their name shows."""

    def __init__(self, event: Any) -> None:
        self.event = event
        self.items: list[dict[str, Any]] = []  # as they stand: arguments so far, status until done
        self.open: list[bool] = []

    def added(self, name: str) -> Iterator[str]:
        self.items.append(_call_item(tool_call(name, ""), "in_progress"))
        self.open.append(True)
        yield self.event("response.output_item.added", output_index=len(self.items) - 1, item=dict(self.items[-1]))

    def delta(self, k: int, text: str) -> Iterator[str]:
        self.items[k]["arguments"] += text
        yield self.event("response.function_call_arguments.delta", item_id=self.items[k]["id"], output_index=k,
                         delta=text)

    def done(self, k: int, status: str) -> Iterator[str]:
        item = self.items[k]
        item["status"], self.open[k] = status, False
        yield self.event("response.function_call_arguments.done", item_id=item["id"], output_index=k,
                         name=item["name"], arguments=item["arguments"])
        yield self.event("response.output_item.done", output_index=k, item=dict(item))

    def close(self, status: str) -> Iterator[str]:
        for k, still in enumerate(self.open):
            if still:
                yield from self.done(k, status)

    def failed(self) -> list[dict[str, Any]]:
        """What was streamed, as far as it got, for a failed response."""
        return [{**item, "status": "incomplete"} if still else item for item, still in zip(self.items, self.open)]


def stream(run: Run, service: Service, echo: Echo, request_id: str) -> Iterator[str]:
    """Typed events as the tokens come: a message's text, or function_call items (`_CallItems`): a named call's
    arguments, or each call of a `"required"` list once its name shows, then its arguments, its item done when
    its object closes (a whole call is `completed`, as `answer` says of it). Under auto nothing is sent until the
    answer's first key shows: then its calls, as a list's, or its reply as a message's text, decoded. A list cut
    short (by `max_output_tokens`) does not parse, so `answer` gives its text as a message; the stream cannot take
    back the calls it has sent: it ends the one cut as `incomplete` and then sends that same message, after them."""
    from generation.engine import TokenEvent

    seq = itertools.count()
    tools = run.req.tools if run.req.tools is not None and run.req.tools.constrained else None
    forced = tools.forced if tools is not None else None
    auto = AutoAnswer() if tools is not None and tools.auto else None
    listed = CallList() if tools is not None and forced is None and auto is None else None

    def event(kind: str, **payload: Any) -> str:
        return sse({"type": kind, "sequence_number": next(seq), **payload}, event=kind)

    calls = _CallItems(event)
    yield event("response.created", response=_object(echo, service, "in_progress", [], None))
    yield event("response.in_progress", response=_object(echo, service, "in_progress", [], None))
    text, logprobs, unsent, status = "", [], [], "completed"  # unsent: records no text delta has carried yet
    item_id = _id("msg")
    where = {"item_id": item_id, "output_index": 0}
    opened = tools is None  # the message item has been added (a text answer's at once, auto's reply once it shows)

    def call_news(news: list[Any]) -> Iterator[str]:
        for e in news:
            if isinstance(e, Begin):
                yield from calls.added(e.name)
            elif isinstance(e, Arguments):
                yield from calls.delta(e.index, e.text)
            elif isinstance(e, End):
                yield from calls.done(e.index, "completed")

    def open_message() -> Iterator[str]:
        yield event("response.output_item.added", output_index=where["output_index"],
                    item=_message_item(item_id, "in_progress", []))
        yield event("response.content_part.added", **where, content_index=0, part=_text_part("", []))

    try:
        if forced is not None:
            yield from calls.added(forced.name)
        elif opened:
            yield from open_message()
        with closing(run.events()) as events:
            for _, ev in events:
                if isinstance(ev, TokenEvent):
                    lp = [chat_logprob(service, ev.logprob)] if echo.include_logprobs and ev.logprob else []
                    text += ev.text
                    logprobs += lp
                    unsent += lp
                    piece = ev.text if tools is None else ""
                    if forced is not None and ev.text:
                        yield from calls.delta(0, ev.text)
                    elif listed is not None:
                        yield from call_news(listed.feed(ev.text))
                    elif auto is not None:
                        news = auto.feed(ev.text)
                        yield from call_news(news)
                        if not opened and auto.kind == REPLY:
                            where["output_index"] = len(calls.items)
                            yield from open_message()
                            opened = True
                        piece = "".join(e.text for e in news if isinstance(e, Reply))
                    if opened and (piece or unsent):
                        yield event("response.output_text.delta", **where, content_index=0, delta=piece,
                                    logprobs=unsent)
                        unsent = []
                    continue
                fail = failure(ev)
                if fail is not None:
                    raise fail
                status = _status(ev)
        whole = tools is not None and tools.calls(text) is not None
        yield from calls.close(status)  # a forced call, or a listed one cut short: every whole one is closed
        output = list(calls.items)
        if not whole:  # a text answer or auto's reply, or calls cut short: its text, as a message after what was sent
            content = tools.content(text) if tools is not None else text
            if not opened:
                where = {"item_id": item_id, "output_index": len(output)}
                yield from open_message()
                yield event("response.output_text.delta", **where, content_index=0, delta=content, logprobs=logprobs)
            part = _text_part(content, logprobs)
            yield event("response.output_text.done", **where, content_index=0, text=content, logprobs=logprobs)
            yield event("response.content_part.done", **where, content_index=0, part=part)
            item = _message_item(item_id, status, [part])
            yield event("response.output_item.done", output_index=len(output), item=item)
            output.append(item)
        final = "response.incomplete" if status == "incomplete" else "response.completed"
        yield event(final, response=_object(echo, service, status, output, _usage(run)))
    except ApiError as exc:
        err = openai_error(error_body(exc.message, exc.type, exc.field, request_id))["error"]
        yield event("error", code=err["code"], message=err["message"], param=err["param"])
        # what was streamed stays in the failed response, as far as it got
        sent = auto.reply if auto is not None else text
        partial = calls.failed() or (
            [_message_item(item_id, "incomplete", [_text_part(sent, logprobs)])] if opened and sent else [])
        # OpenAI's ResponseError codes name no timeout or abort: the server's side, with our code in the message
        yield event("response.failed", response=_object(echo, service, "failed", partial, None, {
            "code": "server_error", "message": f"{err['code']}: {err['message']}"}))
