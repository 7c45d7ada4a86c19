"""Request bodies of the generation routes: shapes, JSON types, the server's caps, and fields not supported.

Only what HTTP owes is checked here: the body is an object of the route's fields, each of the JSON type it
must be, counts and sizes under the server's caps (`GenerateConfig`). A field the server does not support
(`functions`, `suffix`, `best_of`, ...) is a 400 naming it, never silently dropped; the same field sent as
`null` asks for nothing and passes. What a value *means* (`top_p` in (0, 1], a token id inside the
vocabulary) is the engine's to check, once: the service builds `SamplingParams` and maps the engine's
`InvalidParam.field` back to the body field through `Request.names` (per prompt: SGLang's `sampling_params` may
be a list).

Every error is `ApiError(400, ..., "invalid_request", field)`; on `/v1/*` the OpenAI dialect turns
`field` into `param`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from generation.config import TEMPERATURE_RANGE
from serving.generate.body import BodyConstraint, Fields, bad
from serving.generate.config import GenerateConfig
from serving.generate.tools import ToolCalling, offered, parse_tools, tools_constraint

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}

# OpenAI's names for the engine's sampling fields, shared by both OpenAI routes; vLLM's and SGLang's
# extras ride along under the engine's own names (clients send them through `extra_body`).
OPENAI_SAMPLING = ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "logit_bias", "top_k",
                   "min_p", "repetition_penalty", "ignore_eos", "skip_special_tokens", "min_tokens")
CHAT_FIELDS = {"model", "messages", "max_tokens", "max_completion_tokens", "n", "stop", "stream", "stream_options",
               "logprobs", "top_logprobs", "response_format", "structured_outputs", "stop_token_ids", "user",
               "tools", "tool_choice", "parallel_tool_calls", "store", "include_stop_str_in_output",
               "continue_final_message", "chat_template_kwargs", *OPENAI_SAMPLING}
COMPLETION_FIELDS = {"model", "prompt", "max_tokens", "n", "stop", "stream", "stream_options", "logprobs", "echo",
                     "response_format", "structured_outputs", "stop_token_ids", "user", "include_stop_str_in_output",
                     *OPENAI_SAMPLING}
GENERATE_FIELDS = {"text", "input_ids", "sampling_params", "stream", "return_logprob", "logprob_start_len",
                   "top_logprobs_num", "return_text_in_logprobs"}
SGLANG_SAMPLING = {"max_new_tokens", "min_new_tokens", "n", "stop", "stop_token_ids", "stop_regex", "temperature",
                   "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
                   "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
                   "sampling_seed", "logit_bias", "regex", "json_schema", "ebnf"}
PIN_FIELDS = {"text", "messages", "input_ids"}
TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "tools",
                   "return_token_strs", "continue_final_message", "chat_template_kwargs", "mm_processor_kwargs"}
DETOKENIZE_FIELDS = {"model", "tokens"}
SGLANG_DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's own default
# A temperature in [0, this) is greedy on every route: the engine's least temperature (vLLM reads those as greedy
# too; SGLang below 1e-6, and samples from there at a temperature that picks the top token all the same).
GREEDY_BELOW = TEMPERATURE_RANGE[0]
OPENAI_COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default


@dataclass
class Request:
    """One generation request, whichever route it came in on. `prompts` are strings, token-id lists or
    (chat) message lists; `where[i]` is the body field prompt i came from. `sampling[i]` holds prompt
    i's `SamplingParams` arguments, `names[i]` the body field of each of them."""

    route: str
    prompts: list[Any]
    where: list[str]
    sampling: list[dict[str, Any]]
    names: list[dict[str, str]]
    n: int = 1
    stream: bool = False
    batch: bool = False  # the body gave a list of prompts: answer a list
    model: str | None = None
    constraint: BodyConstraint | None = None
    tools: ToolCalling | None = None  # chat: the functions, and whether a call is forced
    logprobs: int | None = None  # OpenAI: per-token logprobs with this many alternatives
    echo: bool = False
    include_usage: bool = False
    return_logprob: bool = False  # SGLang
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    # per prompt, the body field that set its output budget; None: the server's default, which a long prompt
    # shrinks to what the context leaves (a budget the client set is refused instead: `Service.fit_context`)
    max_tokens_set: list[str | None] = dataclasses.field(default_factory=list)


def parse_max_tokens(f: Fields, names: tuple[str, ...], default: int, cfg: GenerateConfig,
                     low: int) -> tuple[int, str | None]:
    """(the budget, the field that set it: None for the default)."""
    given = next((n for n in names if f.has(n)), None)
    if given is None:
        return min(default, cfg.max_new_tokens), None
    value = f.integer(given, low=low)
    if value > cfg.max_new_tokens:
        raise bad(f.where(given), f"at most {cfg.max_new_tokens} (--generate-max-new-tokens), got {value}")
    return value, given


def _temperature(f: Fields) -> float:
    """The request's temperature, 1 when not given (both APIs' default is sampling), 0 below `GREEDY_BELOW`."""
    temperature = f.number("temperature", 1.0)
    return 0.0 if 0 <= temperature < GREEDY_BELOW else temperature


def openai_sampling(f: Fields, cfg: GenerateConfig) -> tuple[dict[str, Any], dict[str, str], int]:
    kw: dict[str, Any] = {"temperature": _temperature(f),  # OpenAI's default is sampling
                          "trim_stop_token": True}  # vLLM leaves the stopping token's text out (EOS, stop_token_ids)
    f.harmless("include_stop_str_in_output")  # vLLM's way to keep it, and a matched stop string, in the text
    for name in ("top_p", "presence_penalty", "frequency_penalty", "min_p", "repetition_penalty"):
        if f.has(name):
            kw[name] = f.number(name)
    if f.has("seed"):
        kw["seed"] = f.integer("seed")
    if f.has("top_k"):
        top_k = f.integer("top_k", low=-1)  # vLLM and SGLang disable it with -1, the engine with 0
        kw["top_k"] = 0 if top_k == -1 else top_k
    for name in ("ignore_eos", "skip_special_tokens"):
        if f.has(name):
            kw[name] = f.boolean(name)
    kw["stop"] = f.stop("stop")
    kw["stop_token_ids"] = f.token_ids("stop_token_ids")
    if f.has("logit_bias"):
        kw["logit_bias"] = f.logit_bias("logit_bias")
    if f.has("min_tokens"):  # vLLM's name for the engine's min_new_tokens
        kw["min_new_tokens"] = f.integer("min_tokens", low=0)
    n = f.integer("n", 1, low=1, high=cfg.max_n)
    names = {k: k for k in (*OPENAI_SAMPLING, "stop", "stop_token_ids")} | {"min_new_tokens": "min_tokens"}
    return kw, names, n


def _stream_options(f: Fields) -> bool:
    stream = f.boolean("stream")
    if not f.has("stream_options"):
        return False
    if not stream:
        raise bad("stream_options", "only allowed with stream: true")
    opts = Fields(f.raw("stream_options"), {"include_usage"}, "stream_options.", "stream_options")
    return opts.boolean("include_usage")


def _openai_constraint(f: Fields) -> BodyConstraint | None:
    if f.has("response_format") and f.has("structured_outputs"):
        raise bad("structured_outputs", "give either response_format or structured_outputs, not both")
    if f.has("response_format"):
        rf = Fields(f.raw("response_format"), {"type", "json_schema"}, "response_format.", "response_format")
        kind = rf.raw("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return BodyConstraint("json_object", True, "response_format")
        if kind == "json_schema":
            js = Fields(rf.raw("json_schema"), {"name", "schema", "strict", "description"}, "response_format.json_schema.",
                        "response_format.json_schema")
            if not isinstance(js.raw("schema"), dict):
                raise bad("response_format.json_schema.schema", "must be a JSON schema object")
            return BodyConstraint("json_schema", js.raw("schema"), "response_format.json_schema.schema")
        raise bad("response_format.type", f"must be text, json_object or json_schema, got {kind!r}")
    if f.has("structured_outputs"):
        so = Fields(f.raw("structured_outputs"), {"json", "regex", "choice", "grammar"}, "structured_outputs.",
                    "structured_outputs")
        given = [k for k in ("json", "regex", "choice", "grammar") if so.has(k)]
        if len(given) != 1:
            raise bad("structured_outputs", "give exactly one of json, regex, choice, grammar")
        kind = {"json": "json_schema", "choice": "choices"}.get(given[0], given[0])
        return BodyConstraint(kind, so.raw(given[0]), f"structured_outputs.{given[0]}")
    return None


def chat_request(body: Any, cfg: GenerateConfig) -> Request:
    f = Fields(body, CHAT_FIELDS)
    f.harmless("store")  # "keep nothing": what this server does anyway
    for name in ("continue_final_message", "chat_template_kwargs"):
        f.harmless(name)  # vLLM's, which its clients send at these values
    messages = f.raw("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty list of messages")
    turns = [_message(m, i) for i, m in enumerate(messages)]
    kw, names, n = openai_sampling(f, cfg)
    kw["max_new_tokens"], given = parse_max_tokens(
        f, ("max_completion_tokens", "max_tokens"), cfg.max_new_tokens, cfg, low=1)
    names["max_new_tokens"] = given or "max_tokens"
    logprobs = None
    if f.boolean("logprobs"):
        logprobs = f.integer("top_logprobs", 0, low=0, high=20)
    elif f.has("top_logprobs"):
        raise bad("top_logprobs", "needs logprobs: true")
    kw["logprobs"], names["logprobs"] = logprobs, "top_logprobs" if f.has("top_logprobs") else "logprobs"
    model = f.raw("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "must be a string")
    tools = parse_tools(f, cfg)
    asked = _openai_constraint(f)
    constraint = tools_constraint(tools, kw["stop"], asked, asked.field.split(".")[0] if asked else "")
    return Request("chat", [turns], ["messages"], [kw], [names], n=n, stream=f.boolean("stream"), model=model,
                   constraint=constraint, tools=tools, logprobs=logprobs, include_usage=_stream_options(f),
                   max_tokens_set=[given])


# What the SDK's own answers carry besides the message (a refusal, annotations, `parse`'s parsed value, the stream
# accumulator's call index): an agent sends the message back as it got it, so these are taken and not used.
ANSWER_ONLY = {"refusal", "annotations", "audio", "parsed"}


def _message(message: Any, i: int) -> dict[str, Any]:
    f = Fields(message, {"role", "content", "name", "tool_calls", "tool_call_id", *ANSWER_ONLY}, f"messages[{i}].",
               "a message")
    role = f.raw("role")
    if not isinstance(role, str) or role not in ROLES:  # a dict or list is unhashable: test the type first
        raise bad(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}, got {role!r}")
    out: dict[str, Any] = {"role": ROLES[role]}
    if f.has("tool_calls"):  # an earlier answer's calls, sent back in an agent's loop
        if role != "assistant":
            raise bad(f"messages[{i}].tool_calls", "only an assistant message makes tool calls")
        out["tool_calls"] = _tool_calls(f.raw("tool_calls"), f"messages[{i}].tool_calls")
    if role == "tool":
        if not isinstance(f.raw("tool_call_id"), str):
            raise bad(f"messages[{i}].tool_call_id", "a tool message needs the id (a string) of the call it answers")
        out["tool_call_id"] = f.raw("tool_call_id")
    elif f.has("tool_call_id"):
        raise bad(f"messages[{i}].tool_call_id", "only a tool message answers a call")
    content = f.raw("content")
    if content is None and "tool_calls" not in out:
        raise bad(f"messages[{i}].content", "is required")
    out["content"] = "" if content is None else content  # text parts are the tokenizer's to check
    name = f.raw("name")
    if name is not None:  # OpenAI's participant name: the chat template may show it (SmolLM2's does not)
        if not isinstance(name, str):
            raise bad(f"messages[{i}].name", f"must be a string, got {type(name).__name__}")
        out["name"] = name
    return out


def _tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """Calls as the chat template reads them (transformers' form): each with its id and a function whose
    arguments are the JSON text the call was answered with."""
    if not isinstance(value, list) or not value:
        raise bad(where, "must be a non-empty list of tool calls")
    calls = []
    for j, item in enumerate(value):
        call = Fields(item, {"id", "type", "function", "index"}, f"{where}[{j}].", "a tool call")
        if not isinstance(call.raw("id"), str) or call.raw("type") != "function":
            raise bad(f"{where}[{j}]", "needs an id (a string) and type \"function\"")
        fn = Fields(call.raw("function"), {"name", "arguments", "parsed_arguments"}, f"{where}[{j}].function.",
                    "a function call")
        if not isinstance(fn.raw("name"), str) or not isinstance(fn.raw("arguments"), str):
            raise bad(f"{where}[{j}].function", "needs a name and arguments, both strings")
        calls.append({"id": call.raw("id"), "type": "function",
                      "function": {"name": fn.raw("name"), "arguments": fn.raw("arguments")}})
    return calls


def completion_request(body: Any, cfg: GenerateConfig) -> Request:
    f = Fields(body, COMPLETION_FIELDS)
    if not f.has("prompt"):
        raise bad("prompt", "is required: a string, a list of strings, token ids or lists of token ids")
    prompts, where, batch = _prompt_list(f.raw("prompt"), "prompt", cfg)
    kw, names, n = openai_sampling(f, cfg)
    kw["max_new_tokens"], given = parse_max_tokens(
        f, ("max_tokens",), OPENAI_COMPLETIONS_DEFAULT_MAX_TOKENS, cfg, low=0)
    names["max_new_tokens"] = "max_tokens"
    logprobs = f.integer("logprobs", low=0, high=20)
    echo = f.boolean("echo")
    if echo and logprobs is not None and f.boolean("stream"):
        raise bad("echo", "with logprobs is not supported in a stream (the prompt's logprobs come at its end)")
    kw["logprobs"], names["logprobs"] = logprobs, "logprobs"
    if echo and logprobs is not None:
        kw["prompt_logprobs"], names["prompt_logprobs"] = logprobs, "logprobs"
    model = f.raw("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "must be a string")
    return Request("completions", prompts, where, [kw] * len(prompts), [names] * len(prompts), n=n, stream=f.boolean("stream"),
                   batch=batch, model=model, constraint=_openai_constraint(f), logprobs=logprobs, echo=echo,
                   include_usage=_stream_options(f), max_tokens_set=[given] * len(prompts))


def _prompt_list(value: Any, name: str, cfg: GenerateConfig, ids_only: bool = False) -> tuple[list[Any], list[str], bool]:
    """A string or token ids (one prompt), or a list of strings or of token-id lists (a batch); `ids_only`
    (SGLang's `input_ids`) takes no text."""
    def ids(v: Any) -> bool:
        return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)

    def text(v: Any) -> bool:
        return isinstance(v, str) and not ids_only

    if text(value) or (ids(value) and value):
        return [value], [name], False
    if isinstance(value, list) and value and all(text(v) or (ids(v) and v) for v in value):
        if len(value) > cfg.max_prompts:
            raise bad(name, f"at most {cfg.max_prompts} prompts (--generate-max-prompts), got {len(value)}")
        return list(value), [f"{name}[{i}]" for i in range(len(value))], True
    raise bad(name, "must be token ids or a list of token-id lists (none empty)" if ids_only else
              "must be a string, a list of strings, token ids or a list of token-id lists (none empty)")


def generate_request(body: Any, cfg: GenerateConfig) -> Request:
    """SGLang's `/generate`: `text` or `input_ids`, one or a batch, with `sampling_params`."""
    f = Fields(body, GENERATE_FIELDS)
    if f.has("text") == f.has("input_ids"):
        raise bad("text", "give exactly one of text or input_ids")
    if f.has("text"):
        text = f.raw("text")
        if not (isinstance(text, str) or (isinstance(text, list) and text and all(isinstance(t, str) for t in text))):
            raise bad("text", "must be a string or a non-empty list of strings")
        prompts, where, batch = _prompt_list(text, "text", cfg)
    else:
        prompts, where, batch = _prompt_list(f.raw("input_ids"), "input_ids", cfg, ids_only=True)
    raw = f.raw("sampling_params", {})
    per = raw if isinstance(raw, list) else [raw] * len(prompts)
    if isinstance(raw, list) and len(raw) != len(prompts):
        raise bad("sampling_params", f"a list needs one entry per prompt ({len(prompts)}), got {len(raw)}")
    prefixes = ["sampling_params" + (f"[{i}]." if isinstance(raw, list) else ".") for i in range(len(per))]
    parsed = [_sglang_sampling(sp, prefix, cfg) for sp, prefix in zip(per, prefixes)]
    ns = {p[2] for p in parsed}
    if len(ns) != 1:
        raise bad("sampling_params", "n must be the same for every prompt")
    constraints = [p[3] for p in parsed if p[3] is not None]
    if constraints and len(constraints) != len(parsed):
        raise bad("sampling_params", "a constraint must be given for every prompt of a batch or none")
    for c in constraints[1:]:  # one request, one constraint: never the first prompt's silently applied to all
        if (c.kind, c.spec) != (constraints[0].kind, constraints[0].spec):
            raise bad(c.field, f"differs from {constraints[0].field}: every prompt of a batch takes the same "
                               "constraint (send different ones as separate requests)")
    top = f.integer("top_logprobs_num", 0, low=0, high=20)
    start = f.integer("logprob_start_len", -1, low=-1)
    return_logprob = f.boolean("return_logprob")
    names = [{k: prefix + v for k, v in p[1].items()} for p, prefix in zip(parsed, prefixes)]
    sampling = [p[0] for p in parsed]
    if return_logprob:
        for kw, named in zip(sampling, names):
            kw["logprobs"] = top
            named["logprobs"] = "top_logprobs_num"
    return Request("generate", prompts, where, sampling, names, n=ns.pop(), stream=f.boolean("stream"),
                   batch=batch, constraint=constraints[0] if constraints else None, return_logprob=return_logprob,
                   logprob_start_len=start, top_logprobs_num=top,
                   return_text_in_logprobs=f.boolean("return_text_in_logprobs"),
                   max_tokens_set=[prefix + "max_new_tokens" if isinstance(sp, dict) and sp.get("max_new_tokens")
                                   is not None else None for sp, prefix in zip(per, prefixes)])


def _sglang_sampling(raw: Any, prefix: str, cfg: GenerateConfig) -> tuple[dict, dict, int, BodyConstraint | None]:
    f = Fields(raw, SGLANG_SAMPLING, prefix, "sampling_params")
    for name in ("stop_regex", "spaces_between_special_tokens", "no_stop_trim"):
        f.harmless(name)
    kw: dict[str, Any] = {"temperature": _temperature(f),  # SGLang's default is sampling
                          "trim_stop_token": True}  # SGLang drops a stop token's text (`no_stop_trim` false)
    names = {"temperature": "temperature", "max_new_tokens": "max_new_tokens", "seed": "sampling_seed"}
    for name in ("top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        if f.has(name):
            kw[name], names[name] = f.number(name), name
    if f.has("top_k"):
        top_k = f.integer("top_k", low=-1)  # SGLang disables with -1 (and we with 0)
        kw["top_k"], names["top_k"] = (0 if top_k == -1 else top_k), "top_k"
    if f.has("sampling_seed"):
        kw["seed"] = f.integer("sampling_seed")
    if f.has("min_new_tokens"):
        kw["min_new_tokens"], names["min_new_tokens"] = f.integer("min_new_tokens", low=0), "min_new_tokens"
    for name in ("ignore_eos", "skip_special_tokens"):
        if f.has(name):
            kw[name], names[name] = f.boolean(name), name
    kw["stop"], names["stop"] = f.stop("stop"), "stop"
    kw["stop_token_ids"], names["stop_token_ids"] = f.token_ids("stop_token_ids"), "stop_token_ids"
    if f.has("logit_bias"):
        kw["logit_bias"], names["logit_bias"] = f.logit_bias("logit_bias"), "logit_bias"
    default = min(SGLANG_DEFAULT_MAX_NEW_TOKENS, cfg.max_new_tokens)
    kw["max_new_tokens"] = f.integer("max_new_tokens", default, low=0, high=cfg.max_new_tokens)
    n = f.integer("n", 1, low=1, high=cfg.max_n)
    given = [k for k in ("regex", "json_schema", "ebnf") if f.has(k) and f.raw(k) != ""]  # "": none, as SGLang
    if len(given) > 1:
        raise bad(prefix + given[1], f"give one constraint, not {' and '.join(given)}")
    constraint = None
    if given:
        kind = {"ebnf": "grammar"}.get(given[0], given[0])
        constraint = BodyConstraint(kind, f.raw(given[0]), prefix + given[0])
    return kw, names, n, constraint


def pin_request(body: Any) -> tuple[str, Any]:
    """`POST /v1/pins`: exactly one of `text`, `messages` (rendered without a generation prompt, so a chat
    that continues them extends the pin) or `input_ids`. Returns (kind, value)."""
    f = Fields(body, PIN_FIELDS)
    given = [k for k in ("text", "messages", "input_ids") if f.has(k)]
    if len(given) != 1:
        raise bad("text", "give exactly one of text, messages or input_ids")
    kind, value = given[0], f.raw(given[0])
    if kind == "text" and (not isinstance(value, str) or not value):
        raise bad("text", "must be a non-empty string")
    if kind == "input_ids" and not (value and f.token_ids("input_ids")):
        raise bad("input_ids", "must be a non-empty list of token ids")
    if kind == "messages":
        if not isinstance(value, list) or not value:
            raise bad("messages", "must be a non-empty list of messages")
        value = [_message(m, i) for i, m in enumerate(value)]
    return kind, value


@dataclass
class TokenizeRequest:
    """vLLM's `/tokenize`: a `prompt` (text, as `/v1/completions` reads it) or chat `messages` (as
    `/v1/chat/completions` renders them, `tools` included: as under `tool_choice` "auto", chat's default)."""

    prompt: Any
    where: str
    model: str | None
    add_special_tokens: bool
    add_generation_prompt: bool
    tools: ToolCalling | None
    return_token_strs: bool


def tokenize_request(body: Any, cfg: GenerateConfig) -> TokenizeRequest:
    f = Fields(body, TOKENIZE_FIELDS)
    for name in ("continue_final_message", "chat_template_kwargs", "mm_processor_kwargs"):
        f.harmless(name)  # vLLM's, which its clients send at these values
    if f.has("prompt") == f.has("messages"):
        raise bad("prompt", "give exactly one of prompt or messages")
    if f.has("prompt"):
        if not isinstance(f.raw("prompt"), str):
            raise bad("prompt", "must be a string")
        for name in ("add_generation_prompt", "tools"):
            if f.has(name):
                raise bad(name, "only with messages")
        prompt, where = f.raw("prompt"), "prompt"
    else:
        messages = f.raw("messages")
        if not isinstance(messages, list) or not messages:
            raise bad("messages", "must be a non-empty list of messages")
        prompt, where = [_message(m, i) for i, m in enumerate(messages)], "messages"
    tools = offered(f.raw("tools"), cfg) if f.has("tools") else None  # checked as chat checks them
    model = f.raw("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "must be a string")
    return TokenizeRequest(prompt, where, model, f.boolean("add_special_tokens", True),
                           f.boolean("add_generation_prompt", True), tools, f.boolean("return_token_strs"))


def detokenize_request(body: Any) -> tuple[list[int], str | None]:
    """vLLM's `/detokenize`: (the token ids, the model asked for)."""
    f = Fields(body, DETOKENIZE_FIELDS)
    if not isinstance(f.raw("tokens"), list):
        raise bad("tokens", "is required: a list of token ids")
    model = f.raw("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "must be a string")
    return f.token_ids("tokens"), model
