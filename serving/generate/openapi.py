"""The generation API's part of `/openapi.json`: its routes and schemas, from the live limits.

Request schemas are checked against `schema`'s field sets when built, so the document cannot drift from
the parser. Answers are documented as far as clients rely on them (OpenAI's objects are OpenAI's; the
test validates real responses against what is written here).
"""

from __future__ import annotations

from generation.config import LOGIT_BIAS_RANGE
from serving.generate.config import GenerateConfig
from serving.generate.responses import FIELDS as RESPONSES_FIELDS
from serving.generate.responses import LOGPROBS
from serving.generate.schema import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    DETOKENIZE_FIELDS,
    GENERATE_FIELDS,
    PIN_FIELDS,
    SGLANG_SAMPLING,
    TOKENIZE_FIELDS,
)
from serving.openapi import json_content, ref

ERRORS = {"400": "invalid field (error.param / error.field names it), or malformed JSON",
          "401": "missing or wrong bearer token", "404": "unknown model or pin", "405": "wrong method",
          "413": "body over the size limit", "500": "the engine failed on this request",
          "503": "model loading, queue full or request threads busy (Retry-After)", "504": "deadline passed",
          "507": "the KV pool cannot hold the pin"}


DONE_LAST = "SSE events, then data: [DONE]"


def _errors(schema: str, *codes: str) -> dict:
    return {c: {"description": ERRORS[c], **json_content(ref(schema))} for c in codes}


def _route(method: str, summary: str, response: dict, error: str, codes: tuple[str, ...], request: str | None = None,
           stream: str = "") -> dict:
    """`stream`: how the route's SSE stream reads, when it has one."""
    content = dict(json_content(response)["content"])
    if stream:
        content["text/event-stream"] = {"schema": {"type": "string", "description": stream}}
    op = {"summary": summary, "responses": {"200": {"description": "ok", "content": content},
                                            **_errors(error, *codes)}}
    if request:
        op["requestBody"] = {"required": True, **json_content(ref(request))}
    return {method: op}


def _request(name: str, props: dict, fields: set[str], required: list[str]) -> dict:
    if set(props) != set(fields):  # the document must not drift from the parser
        raise RuntimeError(f"openapi: {name} documents {sorted(props)}, parses {sorted(fields)}")
    return {"type": "object", "required": required, "properties": props,
            "description": "any other field is refused with 400 unless it is null"}


def openapi(cfg: GenerateConfig) -> dict:
    num, integer, boolean, string = {"type": "number"}, {"type": "integer"}, {"type": "boolean"}, {"type": "string"}
    stop = {"oneOf": [string, {"type": "array", "items": string, "maxItems": 16}]}
    ids = {"type": "array", "items": integer}
    constraint = {"type": "object", "description": "structured output (constrained decoding); 400 where the "
                                                  "server has no grammar engine"}
    low, high = LOGIT_BIAS_RANGE
    logit_bias = {"type": "object", "propertyNames": {"pattern": "^(0|[1-9][0-9]*)$"},
                  "additionalProperties": {"type": "number", "minimum": low, "maximum": high},
                  "description": "token id (in decimal) -> a number added to its logit before any constraint's "
                                 "mask; ids outside the vocabulary are a 400; reported logprobs stay unbiased"}
    sampling = {"temperature": num, "top_p": num, "seed": integer, "presence_penalty": num, "frequency_penalty": num,
                "top_k": integer, "min_p": num, "repetition_penalty": num, "ignore_eos": boolean,
                "min_tokens": {"type": "integer", "minimum": 0, "description": "vLLM's: no stop before this many tokens"},
                "skip_special_tokens": boolean, "stop": stop, "stop_token_ids": ids, "logit_bias": logit_bias,
                "n": {"type": "integer", "minimum": 1, "maximum": cfg.max_n}, "stream": boolean,
                "stream_options": {"type": "object", "properties": {"include_usage": boolean}},
                "model": string, "user": {"type": "string", "description": "accepted; has no effect"},
                "response_format": constraint, "structured_outputs": constraint,
                "include_stop_str_in_output": {"enum": [False], "description": "vLLM's; only false: a matched stop "
                                                                               "token or string is left out"}}
    max_tokens = {"type": "integer", "minimum": 0, "maximum": cfg.max_new_tokens}
    call = {"type": "object", "required": ["id", "type", "function"], "properties": {
        "id": string, "type": {"enum": ["function"]}, "function": {"type": "object", "required": ["name", "arguments"],
                                                                 "properties": {"name": string, "arguments": string}}}}
    message = {"type": "object", "required": ["role"], "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"oneOf": [string, {"type": "array", "items": {"type": "object", "properties": {
            "type": {"enum": ["text"]}, "text": string}}}, {"type": "null"}],
            "description": "required, except null in an assistant message that has tool_calls"},
        "tool_calls": {"type": "array", "items": call, "description": "an assistant's earlier calls"},
        "tool_call_id": {"type": "string", "description": "a tool message: the call it answers (required there)"}}}
    tool = {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"enum": ["function"]}, "function": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}, "description": string,
            "parameters": {"type": "object", "description": "a JSON schema; a forced call's arguments follow it"},
            "strict": boolean}}}}
    prompt = {"oneOf": [string, {"type": "array", "items": {"oneOf": [string, integer, ids]},
                                 "maxItems": cfg.max_prompts}]}
    usage = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
             "properties": {"prompt_tokens": integer, "completion_tokens": integer, "total_tokens": integer,
                            "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": integer}}}}
    finish = {"enum": ["stop", "length"]}
    chat_finish = {"enum": ["stop", "length", "tool_calls"]}  # tool_calls: the calls the model chose (auto)
    sg_sampling = {k: {} for k in SGLANG_SAMPLING} | {"max_new_tokens": max_tokens, "temperature": num,
                                                      "stop": stop, "stop_token_ids": ids, "logit_bias": logit_bias}
    schemas = {
        "ChatCompletionRequest": _request("chat", {
            **{k: v for k, v in sampling.items()}, "messages": {"type": "array", "minItems": 1, "items": message},
            "max_tokens": max_tokens, "max_completion_tokens": max_tokens, "logprobs": boolean,
            "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
            "tools": {"type": "array", "items": tool, "minItems": 1, "maxItems": cfg.max_tools},
            "tool_choice": {"oneOf": [{"enum": ["none", "auto", "required"]}, {"type": "object", "properties": {
                "type": {"enum": ["function"]}, "function": {"type": "object", "properties": {"name": string}}}}],
                "description": "a forced call (required, or a named function) is constrained decoding; \"auto\" "
                               "(the default once tools are given) holds the answer to calls or a reply, in one "
                               "JSON object the system message describes"},
            "parallel_tool_calls": {"type": "boolean", "description": "false: \"required\" makes exactly one call, "
                                                                     "\"auto\" at most one"},
            "store": {"enum": [False], "description": "only false: nothing is stored"},
            "continue_final_message": {"enum": [False], "description": "vLLM's; only false"},
            "chat_template_kwargs": {"type": "object", "maxProperties": 0, "description": "vLLM's; only {}"}},
            CHAT_FIELDS, ["messages"]),
        "ChatCompletion": {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
                           "properties": {"id": string, "object": {"enum": ["chat.completion"]}, "created": integer,
                                          "model": string, "usage": usage, "choices": {"type": "array", "items": {
                                              "type": "object", "required": ["index", "message", "finish_reason"],
                                              "properties": {"index": integer, "finish_reason": chat_finish,
                                                             "message": {"type": "object", "properties": {
                                                                 "role": {"enum": ["assistant"]},
                                                                 "content": {"type": ["string", "null"]},
                                                                 "tool_calls": {"type": "array", "items": call}}},
                                                             "logprobs": {"type": ["object", "null"]}}}}}},
        "CompletionRequest": _request("completions", {
            **sampling, "prompt": prompt, "max_tokens": max_tokens, "echo": boolean,
            "logprobs": {"type": "integer", "minimum": 0, "maximum": 20}}, COMPLETION_FIELDS, ["prompt"]),
        "Completion": {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
                       "properties": {"id": string, "object": {"enum": ["text_completion"]}, "created": integer,
                                      "model": string, "usage": usage, "choices": {"type": "array", "items": {
                                          "type": "object", "required": ["index", "text", "finish_reason"],
                                          "properties": {"index": integer, "text": string, "finish_reason": finish,
                                                         "logprobs": {"type": ["object", "null"]}}}}}},
        "ResponsesRequest": _request("responses", {
            **{k: v for k, v in sampling.items() if k not in ("n", "stream_options", "response_format",
                                                               "structured_outputs", "include_stop_str_in_output")},
            "input": {"oneOf": [string, {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
                "type": {"enum": ["message", "function_call", "function_call_output"]}}}}],
                "description": "a string (one user message) or items: messages (role, content as a string or "
                               "input_text/output_text parts), function_call and function_call_output"},
            "instructions": {"type": "string", "description": "the system message"},
            "max_output_tokens": {**max_tokens, "minimum": 1},
            "text": {"type": "object", "properties": {"format": {"type": "object", "properties": {
                "type": {"enum": ["text", "json_object", "json_schema"]}, "name": string,
                "schema": {"type": "object"}, "strict": boolean, "description": string}},
                "verbosity": {"enum": ["medium"]}}, "description": "format json_schema or json_object: "
                                                                  "constrained decoding"},
            "tools": {"type": "array", "minItems": 1, "maxItems": cfg.max_tools, "items": {
                "type": "object", "required": ["type", "name"], "properties": {
                    "type": {"enum": ["function"]}, "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                    "description": string, "parameters": {"type": "object"}, "strict": boolean}}},
            "tool_choice": {"oneOf": [{"enum": ["none", "auto", "required"]}, {"type": "object", "properties": {
                "type": {"enum": ["function"]}, "name": string}}],
                "description": "as chat's: a forced call is constrained decoding, \"auto\" (the default) calls or "
                               "replies in one JSON answer"},
            "parallel_tool_calls": boolean,
            "include": {"type": "array", "items": {"enum": [LOGPROBS]}},
            "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
            "store": {"type": "boolean", "description": "taken; nothing is stored, and answers say store: false"},
            "previous_response_id": {"type": "null", "description": "refused: nothing is stored, so send the "
                                                                   "conversation in input"},
            "background": {"enum": [False]}, "reasoning": {"type": "null"}, "truncation": {"enum": ["disabled"]},
            "service_tier": {"enum": ["auto", "default"]},
            "verbosity": {"enum": ["medium"], "description": "as text.verbosity (the SDK's parse sends it here)"},
            "metadata": {"type": "object", "maxProperties": 16, "additionalProperties": {"type": "string"},
                         "description": "echoed in the answer"},
            "safety_identifier": string, "prompt_cache_key": {"type": "string", "description": "accepted; the "
                                                                                                 "prefix cache needs no key"},
            "stream_options": {"type": "object", "properties": {"include_obfuscation": boolean}}},
            RESPONSES_FIELDS, ["input"]),
        "Response": {"type": "object", "required": ["id", "object", "created_at", "status", "model", "output", "usage"],
                     "properties": {"id": string, "object": {"enum": ["response"]}, "created_at": integer,
                                    "status": {"enum": ["completed", "incomplete"]}, "model": string,
                                    "incomplete_details": {"type": ["object", "null"]},
                                    "output": {"type": "array", "items": {"type": "object", "required": ["type", "id"],
                                                                          "properties": {"type": {"enum": [
                                                                              "message", "function_call"]}}}},
                                    "usage": {"type": "object", "required": ["input_tokens", "output_tokens",
                                                                             "total_tokens"],
                                              "properties": {"input_tokens": integer, "output_tokens": integer,
                                                             "total_tokens": integer}}}},
        "TokenizeRequest": _request("tokenize", {
            "model": string, "prompt": {"type": "string", "description": "text, as /v1/completions encodes it"},
            "messages": {"type": "array", "minItems": 1, "items": message,
                         "description": "a conversation, as /v1/chat/completions renders it"},
            "add_special_tokens": {"type": "boolean", "description": "default true: the tokenizer's BOS, if it adds one"},
            "add_generation_prompt": {"type": "boolean", "description": "messages only; default true"},
            "tools": {"type": "array", "items": {"type": "object"}, "description": "messages only: rendered as chat "
                                                                                 "renders them under tool_choice auto"},
            "return_token_strs": boolean,
            "continue_final_message": {"enum": [False], "description": "vLLM's; only false"},
            "chat_template_kwargs": {"type": "object", "maxProperties": 0, "description": "vLLM's; only {}"},
            "mm_processor_kwargs": {"type": "object", "maxProperties": 0, "description": "vLLM's; only {}"}},
            TOKENIZE_FIELDS, []),
        "Tokenized": {"type": "object", "required": ["count", "max_model_len", "tokens"], "properties": {
            "count": integer, "max_model_len": integer, "tokens": ids,
            "token_strs": {"type": ["array", "null"], "items": string}}},
        "DetokenizeRequest": _request("detokenize", {"model": string, "tokens": ids}, DETOKENIZE_FIELDS, ["tokens"]),
        "Detokenized": {"type": "object", "required": ["prompt"], "properties": {"prompt": string}},
        "GenerateRequest": _request("generate", {
            "text": {"oneOf": [string, {"type": "array", "items": string, "maxItems": cfg.max_prompts}]},
            "input_ids": {"oneOf": [ids, {"type": "array", "items": ids, "maxItems": cfg.max_prompts}]},
            "sampling_params": {"oneOf": [{"type": "object", "properties": sg_sampling},
                                          {"type": "array", "items": {"type": "object"}}]},
            "stream": boolean, "return_logprob": boolean, "logprob_start_len": {"type": "integer", "minimum": -1},
            "top_logprobs_num": {"type": "integer", "minimum": 0, "maximum": 20},
            "return_text_in_logprobs": boolean}, GENERATE_FIELDS, []),
        "GenerateAnswer": {"type": "object", "required": ["text", "output_ids", "meta_info"], "properties": {
            "text": string, "output_ids": ids, "meta_info": {"type": "object", "required": [
                "id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens"], "properties": {
                "id": string, "finish_reason": {"type": ["object", "null"]}, "prompt_tokens": integer,
                "completion_tokens": integer, "cached_tokens": integer, "e2e_latency": num,
                "input_token_logprobs": {"type": "array"}, "output_token_logprobs": {"type": "array"}}}}},
        "GenerateResponse": {"oneOf": [ref("GenerateAnswer"), {"type": "array", "items": ref("GenerateAnswer")}]},
        "PinRequest": _request("pin", {"text": string, "messages": {"type": "array", "items": message},
                                       "input_ids": ids}, PIN_FIELDS, []),
        "Pin": {"type": "object", "required": ["id", "object", "tokens", "blocks"],
                "properties": {"id": string, "object": {"enum": ["pin"]}, "tokens": integer, "blocks": integer}},
        "PinList": {"type": "object", "required": ["object", "data"],
                    "properties": {"object": {"enum": ["list"]}, "data": {"type": "array", "items": ref("Pin")}}},
        "PinDeleted": {"type": "object", "required": ["id", "deleted"],
                       "properties": {"id": string, "object": {"enum": ["pin"]}, "deleted": boolean}},
        "ModelInfo": {"type": "object", "required": ["model_path", "tokenizer_path", "is_generation"],
                      "properties": {"model_path": string, "tokenizer_path": string, "is_generation": boolean,
                                     "served_model_name": string}},
        "OpenAIError": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"],
            "properties": {"message": string, "type": string, "param": {"type": ["string", "null"]},
                           "code": {"type": ["string", "null"]}}}}},
    }
    v1 = ("400", "401", "404", "405", "413", "500", "503", "504")
    sg = ("400", "401", "405", "413", "500", "503", "504")
    paths = {
        "/v1/chat/completions": _route("post", "OpenAI chat completion (stream: SSE chunks)", ref("ChatCompletion"),
                                       "OpenAIError", v1, "ChatCompletionRequest", stream=DONE_LAST),
        "/v1/completions": _route("post", "OpenAI completion (stream: SSE chunks)", ref("Completion"), "OpenAIError", v1,
                                  "CompletionRequest", stream=DONE_LAST),
        "/v1/responses": _route("post", "OpenAI Responses API, stateless (stream: typed events)", ref("Response"),
                                "OpenAIError", v1, "ResponsesRequest",
                                stream="SSE events, each with its event: line, from response.created to "
                                       "response.completed, response.incomplete or response.failed; no [DONE]"),
        "/v1/pins": {**_route("post", "pin a prefix (text, messages or token ids): its KV stays resident; prompts "
                                      "that extend it hit it fully", ref("Pin"), "OpenAIError",
                              ("400", "401", "405", "413", "503", "504", "507"), "PinRequest"),
                     **_route("get", "the pins, with their token and block counts", ref("PinList"), "OpenAIError",
                              ("401", "503"))},
        "/v1/pins/{pin_id}": {"parameters": [{"name": "pin_id", "in": "path", "required": True,
                                              "schema": {"type": "string"}, "description": "a pin's id"}],
                              **_route("delete", "release a pin", ref("PinDeleted"), "OpenAIError",
                                       ("401", "404", "503"))},
        "/generate": _route("post", "SGLang native generation (a list for a batch or n > 1; stream: SSE)",
                            ref("GenerateResponse"), "Error", sg, "GenerateRequest", stream=DONE_LAST),
        "/tokenize": _route("post", "vLLM's: the token ids a prompt or conversation is fed as, counted past the "
                                    "prompt limit too", ref("Tokenized"), "OpenAIError", ("400", "401", "404", "405",
                                                                                          "413", "503"),
                            "TokenizeRequest"),
        "/detokenize": _route("post", "vLLM's: the text of token ids", ref("Detokenized"), "OpenAIError",
                              ("400", "401", "404", "405", "413", "503"), "DetokenizeRequest"),
        "/get_model_info": _route("get", "SGLang model info", ref("ModelInfo"), "Error", ("401",)),
        "/server_info": _route("get", "engine settings and live counters", ref("Object"), "Error", ("401", "503")),
        "/flush_cache": _route("post", "drop the prefix cache's unused blocks (pins stay)", ref("Object"), "Error",
                               ("401", "503")),
        "/health_generate": _route("get", "200 `ok` once one token went through the engine, or `busy` when engine "
                                   "steps went on ending while it waited; 503 saying why otherwise", ref("Object"), "Error",
                                   ("401", "503")),
    }
    return {"paths": paths, "schemas": schemas}
