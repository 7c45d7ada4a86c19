"""OpenAI function calling through the `openai` SDK against a real `pagoda serve` (a 2-layer random Llama with
SmolLM2's tokenizer and chat template): a named or required call always parses into `tool_calls` whose
arguments validate against the tool's schema (the weights are noise, so that is the constraint's doing), equals
the engine's constrained answer in-process, streams to the same calls, and `parse` reads it into pydantic
objects; under `auto` (the default) the answer is calls or a reply, streamed as the whole answer gives it; every
malformed tool is a 400 naming its field; an agent's loop (an assistant's calls, then the tool's answer) renders
through the chat template."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest
import requests

from generation import SamplingParams

MODEL = "tiny-smollm2"
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
SEVERAL = [{"role": "user", "content": "Weather and time in Berlin, please."}]  # greedy: 3 calls under "required"


@pytest.fixture(scope="module")
def client(smollm2_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def ask(client, **kw):
    return client.chat.completions.create(**{"model": MODEL, "messages": CHAT, "temperature": 0, "max_tokens": 200,
                                             "tools": TOOLS, **kw})


def refused(client, param: str, **kw) -> str:
    with pytest.raises(openai.BadRequestError) as exc:
        ask(client, **kw)
    assert exc.value.body["param"] == param, exc.value.body
    return exc.value.body["message"]


def test_a_named_call_follows_its_schema_and_equals_the_engine(client, smollm2_engine):
    r = ask(client, tool_choice=NAMED)
    choice = r.choices[0]
    assert choice.message.content is None and choice.finish_reason == "stop"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    ids = smollm2_engine.encode(smollm2_engine.apply_chat_template(CHAT, tools=TOOLS))
    (ref,) = smollm2_engine.generate([ids], SamplingParams(max_new_tokens=200, constraint={"json_schema": WEATHER}))
    assert call.function.arguments == ref.text


def test_a_named_call_streams_its_arguments(client):
    full = ask(client, tool_choice=NAMED).choices[0].message.tool_calls[0]
    chunks = list(ask(client, tool_choice=NAMED, stream=True))
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and first.tool_calls[0].function.name == "get_weather"
    assert first.tool_calls[0].id.startswith("call_")
    args = "".join(c.choices[0].delta.tool_calls[0].function.arguments for c in chunks[1:]
                   if c.choices and c.choices[0].delta.tool_calls)
    assert args == full.function.arguments
    assert all(c.choices[0].delta.content is None for c in chunks if c.choices)
    # the SDK's own accumulator reads the same call out of the chunks
    with client.chat.completions.stream(model=MODEL, messages=CHAT, temperature=0, max_tokens=200, tools=TOOLS,
                                        tool_choice=NAMED) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.tool_calls[0].function.arguments == full.function.arguments


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=10)
    unit: Literal["celsius", "fahrenheit"]


class Place(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)


class Trip(pydantic.BaseModel):
    origin: Place
    days: int = pydantic.Field(ge=1, le=9)


def test_the_sdk_parses_a_forced_call_into_its_pydantic_model(client):
    r = client.chat.completions.parse(model=MODEL, messages=CHAT, temperature=0, max_tokens=200,
                                      tools=[openai.pydantic_function_tool(Weather)],
                                      tool_choice={"type": "function", "function": {"name": "Weather"}})
    parsed = r.choices[0].message.tool_calls[0].function.parsed_arguments
    assert isinstance(parsed, Weather) and len(parsed.city) <= 10


@pytest.mark.parametrize("parallel", [False, True])
def test_required_calls_one_of_the_tools_with_valid_arguments(client, parallel):
    r = ask(client, tool_choice="required", parallel_tool_calls=parallel, max_tokens=250)
    choice = r.choices[0]
    assert choice.message.content is None and choice.message.tool_calls, choice
    if not parallel:
        assert len(choice.message.tool_calls) == 1
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed_calls(chunks) -> tuple[list[list], str]:
    """Each call as OpenAI's deltas build it: `[id, name, [argument fragments]]` by index (the first delta of a
    call has its id, type and name and empty arguments, the later ones only more arguments), and the content."""
    calls: list[list] = []
    content = ""
    for c in chunks:
        if not c.choices:
            continue
        delta = c.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            if tc.index == len(calls):
                assert tc.id.startswith("call_") and tc.type == "function" and tc.function.arguments == ""
                calls.append([tc.id, tc.function.name, []])
            else:
                assert tc.index == len(calls) - 1 and tc.id is None and tc.function.name is None
                calls[tc.index][2].append(tc.function.arguments)
    return calls, content


@pytest.mark.parametrize("parallel", [False, True])
def test_required_calls_stream_as_they_are_generated(client, parallel):
    """Each call's id and name once its name has closed, then its arguments token by token, adding up to the whole
    answer's byte for byte; the tokens' logprobs keep coming, one record per token."""
    kw = {"messages": SEVERAL, "tool_choice": "required", "parallel_tool_calls": parallel, "max_tokens": 250,
          "logprobs": True}
    whole = ask(client, **kw).choices[0]
    chunks = list(ask(client, **kw, stream=True))
    calls, content = streamed_calls(chunks)
    assert (len(calls) > 1) == parallel
    assert [(name, "".join(parts)) for _, name, parts in calls] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert max(len(parts) for _, _, parts in calls) > 1, calls  # the arguments came as they were typed
    assert content == "" and chunks[-1].choices[0].finish_reason == whole.finish_reason == "stop"
    records = [r for c in chunks if c.choices and c.choices[0].logprobs for r in c.choices[0].logprobs.content]
    assert [r.token for r in records] == [r.token for r in whole.logprobs.content]


def test_the_sdks_stream_helper_reads_required_calls_that_validate(client):
    with client.chat.completions.stream(model=MODEL, messages=SEVERAL, temperature=0, max_tokens=250, tools=TOOLS,
                                        tool_choice="required") as stream:
        deltas = [e for e in stream if e.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert len(calls) > 1 and final.choices[0].finish_reason == "stop"
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len(deltas) > len(calls)  # more than one fragment for some call


def into_arguments(text: str) -> bool:
    """A list cut a few characters into its first call's arguments."""
    return '"parameters":{"' in text and not text.endswith('{"')


def test_a_required_list_cut_short_streams_its_calls_then_the_text_the_answer_gives(client):
    """A list cut by max_tokens does not parse: the whole answer gives its text as content, no tool_calls. A stream
    has sent the calls it saw by then (the last one's arguments cut), and sends that same text as content before
    the same `length` finish."""
    tokens = [r.token for r in ask(client, tool_choice="required", max_tokens=250, logprobs=True)
              .choices[0].logprobs.content]
    n = next(n for n in range(1, len(tokens)) if into_arguments("".join(tokens[:n])))
    text = "".join(tokens[:n])
    whole = ask(client, tool_choice="required", max_tokens=n).choices[0]
    assert whole.finish_reason == "length" and whole.message.tool_calls is None and whole.message.content == text
    chunks = list(ask(client, tool_choice="required", max_tokens=n, stream=True))
    calls, content = streamed_calls(chunks)
    assert content == whole.message.content and chunks[-1].choices[0].finish_reason == "length"
    ((_, name, parts),) = calls
    assert text == f'[{{"name":"{name}","parameters":' + "".join(parts)


def test_required_over_schemas_with_refs_keeps_each_tools_definitions(client):
    tools = [openai.pydantic_function_tool(Trip), openai.pydantic_function_tool(Weather)]
    assert "$defs" in tools[0]["function"]["parameters"]
    r = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=250, tools=tools,
                                       tool_choice="required", parallel_tool_calls=False)
    (call,) = r.choices[0].message.tool_calls
    model = {"Trip": Trip, "Weather": Weather}[call.function.name]
    model.model_validate_json(call.function.arguments)


def test_a_cut_call_keeps_its_finish_reason(client):
    named = ask(client, tool_choice=NAMED, max_tokens=3).choices[0]
    assert named.finish_reason == "length" and len(named.message.tool_calls[0].function.arguments) > 0
    required = ask(client, tool_choice="required", max_tokens=3).choices[0]
    assert required.finish_reason == "length" and required.message.tool_calls is None
    assert required.message.content.startswith("[")


def test_tool_choice_none_answers_in_text(client):
    with_tools = ask(client, tool_choice="none", max_tokens=8)
    without = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=8)
    assert with_tools.choices[0].message.tool_calls is None
    assert with_tools.choices[0].message.content == without.choices[0].message.content  # SmolLM2 shows no tools


def test_an_agent_loop_renders_the_calls_and_the_tools_answer(client, smollm2_engine):
    call = ask(client, tool_choice=NAMED).choices[0].message.tool_calls[0]
    turns = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
             {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=turns, temperature=0, max_tokens=5)
    rendered = smollm2_engine.apply_chat_template([*CHAT, {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
                                           {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}])
    assert "<|im_start|>tool\n18 degrees, sunny<|im_end|>" in rendered
    assert r.usage.prompt_tokens == len(smollm2_engine.encode(rendered))


@pytest.mark.parametrize("kw, param", [
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tool_choice": {"type": "tool", "function": {"name": "get_time"}}}, "tool_choice.type"),
    ({"tool_choice": NAMED, "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tool_choice": "required", "tools": [TOOLS[0], {"type": "function", "function": {"name": "bad name!"}}]},
     "tools[1].function.name"),
    ({"tool_choice": "required", "tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    ({"tool_choice": "required", "tools": [TOOLS[0], {"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "string", "not": {}}}}}}]},
     "tools[1].function.parameters.properties.x"),
    ({"tool_choice": NAMED, "tools": [{**TOOLS[0], "function": {**TOOLS[0]["function"], "parameters": {
        "type": "object", "properties": {"x": {"uniqueItems": True}}}}}]}, "tools[0].function.parameters.properties.x"),
    ({"tool_choice": NAMED, "tools": TOOLS * 3}, "tools"),  # --generate-max-tools 4
    ({"tool_choice": NAMED, "tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tool_choice": NAMED, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_bad_tools_are_refused_by_field(client, kw, param):
    refused(client, param, **kw)


def test_messages_of_an_agent_loop_are_checked(smollm2_server):
    def post(messages):
        return requests.post(smollm2_server.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 2},
                             timeout=60)

    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    for messages, param in [
        ([{"role": "tool", "content": "12:00"}], "messages[0].tool_call_id"),
        ([{"role": "user", "content": "hi", "tool_calls": [call]}], "messages[0].tool_calls"),
        ([{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]}],
         "messages[0].tool_calls[0].function"),
        ([{"role": "user", "content": "hi", "tool_call_id": "c"}], "messages[0].tool_call_id"),
        ([{"role": "assistant", "content": None}], "messages[0].content"),
    ]:
        r = post(messages)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (messages, r.text)
    assert post([*CHAT, {"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]).status_code == 200


def test_an_agent_loop_takes_back_the_message_parse_and_stream_returned(client):
    """`parse` adds `parsed_arguments`, the stream helper an `index`, OpenAI's answers `annotations`: the message an
    agent appends as it got it is taken (these are answers, not instructions) and renders as the plain one."""
    tools = [openai.pydantic_function_tool(Weather)]
    named = {"type": "function", "function": {"name": "Weather"}}
    parsed = client.chat.completions.parse(model=MODEL, messages=CHAT, temperature=0, max_tokens=200, tools=tools,
                                           tool_choice=named).choices[0].message
    with client.chat.completions.stream(model=MODEL, messages=CHAT, temperature=0, max_tokens=200, tools=tools,
                                        tool_choice=named) as stream:
        streamed = stream.get_final_completion().choices[0].message
    usage = []
    for message in (parsed, streamed, {**parsed.model_dump(exclude_none=True), "annotations": []}):
        call_id = message["tool_calls"][0]["id"] if isinstance(message, dict) else message.tool_calls[0].id
        turns = [*CHAT, message, {"role": "tool", "tool_call_id": call_id, "content": "18 degrees"}]
        usage.append(client.chat.completions.create(model=MODEL, messages=turns, temperature=0, max_tokens=2)
                     .usage.prompt_tokens)
    assert len(set(usage)) == 1


def test_a_function_without_parameters_is_called_with_an_empty_object(client):
    """OpenAI: "omitting parameters defines a function with an empty parameter list". An open object let the
    model invent arguments until max_tokens (found by the probe); `{}` as parameters means the same."""
    for function in ({"name": "now"}, {"name": "now", "parameters": {}}):
        r = ask(client, tools=[{"type": "function", "function": function}], tool_choice="required",
                parallel_tool_calls=False, max_tokens=60)
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "now" and json.loads(call.function.arguments) == {}
        r = ask(client, tools=[{"type": "function", "function": function}],
                tool_choice={"type": "function", "function": {"name": "now"}}, max_tokens=60)
        assert r.choices[0].message.tool_calls[0].function.arguments == "{}"


def test_each_tools_schema_is_compiled_alone_so_its_error_names_it(client):
    """Under "required" an error the grammar engine finds (a $ref to nothing, a schema no output satisfies) names
    the tool and its own paths, as a named call does; an unsatisfiable tool was silently never called."""
    broken = {"type": "function", "function": {"name": "b", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/Nope"}}, "required": ["p"]}}}
    never = {"type": "function", "function": {"name": "n", "parameters": {
        "type": "object", "properties": {"xs": {"type": "array", "minItems": 3, "maxItems": 1}}, "required": ["xs"]}}}
    for tool in (broken, never):
        message = refused(client, "tools[1].function.parameters", tools=[TOOLS[0], tool], tool_choice="required")
        assert "tool1" not in message


@pytest.mark.parametrize("kw, param", [
    ({"tool_choice": NAMED, "stop": [","]}, "stop"),  # a stop string cut a forced call's JSON with finish "stop"
    ({"tool_choice": "required", "stop": "]"}, "stop"),
    ({"tool_choice": NAMED, "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "string"}}}]}, "tools[0].function.parameters.type"),
])
def test_what_would_break_a_forced_call_is_refused(client, kw, param):
    refused(client, param, **kw)


def test_arguments_are_an_object_even_where_the_schema_gives_no_type(client):
    """A schema of properties alone also takes a string under JSON Schema: a forced call answered one (found by the
    second probe). A root without `type` is read as an object, as OpenAI's function parameters are."""
    tool = {"type": "function", "function": {"name": "now", "parameters": {
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a"],
        "additionalProperties": False}}}
    for choice in ({"type": "function", "function": {"name": "now"}}, "required"):
        r = ask(client, tools=[tool], tool_choice=choice, parallel_tool_calls=False, max_tokens=60)
        arguments = json.loads(r.choices[0].message.tool_calls[0].function.arguments)
        assert isinstance(arguments, dict) and isinstance(arguments["a"], int)


def test_a_ref_inside_data_is_not_rewritten_under_required(client):
    """Under "required" a tool's own `$ref`s are moved under its `$defs` entry; one that is data (inside `const`)
    stays as the tool wrote it (it became "#/$defs/tool0/keep", found by the second probe)."""
    tool = {"type": "function", "function": {"name": "c", "parameters": {
        "type": "object", "properties": {"x": {"const": {"$ref": "#/keep"}}, "y": {"$ref": "#/$defs/Y"}},
        "required": ["x", "y"], "additionalProperties": False,
        "$defs": {"Y": {"type": "integer", "minimum": 0, "maximum": 9}}}}}
    r = ask(client, tools=[tool], tool_choice="required", parallel_tool_calls=False, max_tokens=60)
    arguments = json.loads(r.choices[0].message.tool_calls[0].function.arguments)
    assert arguments["x"] == {"$ref": "#/keep"} and 0 <= arguments["y"] <= 9


@pytest.mark.parametrize("parameters", [[], False, 0, "", [1], "x"])
def test_parameters_that_are_not_a_schema_object_are_refused(client, parameters):
    refused(client, "tools[0].function.parameters", tool_choice=NAMED,
            tools=[{"type": "function", "function": {"name": "get_weather", "parameters": parameters}}])


# ---- tool_choice "auto" (OpenAI's default once tools are given) ----------------------------------------------


def token(engine, text: str) -> str:
    (token_id,) = engine.tokenizer.encode(text)
    return str(token_id)


def branch(engine, name: str) -> dict:
    """A logit_bias that takes a branch on the random model: `response` written at once and `"}` as soon as the
    string may close (a whole reply), or `tool` wherever a string may hold it (calls; no reply starts with it)."""
    if name == "reply":
        return {"logit_bias": {token(engine, "response"): 100, token(engine, '"}'): 100}}
    return {"logit_bias": {token(engine, "tool"): 100}}


def streamed_answer(chunks) -> tuple[str | None, list[tuple[str, str]], str, list[str]]:
    """The content as a client accumulates it (None if no chunk has any), the calls (name, arguments), the finish
    reason and the tokens of the logprobs records."""
    content, (calls, _) = None, streamed_calls(chunks)
    for c in chunks:
        if c.choices and c.choices[0].delta.content is not None:
            content = (content or "") + c.choices[0].delta.content
    records = [r.token for c in chunks if c.choices and c.choices[0].logprobs for r in c.choices[0].logprobs.content]
    return content, [(name, "".join(parts)) for _, name, parts in calls], chunks[-1].choices[0].finish_reason, records


@pytest.mark.parametrize("case, kw, kind", [
    ("a reply cut short", {}, "text"),  # greedy: the random model replies, at length
    ("calls", {"messages": SEVERAL}, "calls"),  # greedy: one call
    ("a whole reply", "reply", "reply"),
    ("calls of tools", "calls", "calls"),
    ("calls cut short", {"messages": SEVERAL, "max_tokens": 16}, "text"),  # into the call's arguments
    ("no branch yet", {"max_tokens": 1}, "text"),
])
def test_auto_streams_what_the_whole_answer_gives(client, smollm2_engine, case, kw, kind):
    """No tool_choice (the SDK's default, and agent frameworks'): the model replies or calls, in one JSON answer;
    a stream adds up to the whole answer, byte for byte, finish reason and logprobs records included."""
    kw = branch(smollm2_engine, kw) if isinstance(kw, str) else kw
    kw = {"max_tokens": 60, **kw, "logprobs": True}
    whole = ask(client, **kw).choices[0]
    content, calls, finish, records = streamed_answer(list(ask(client, **kw, stream=True)))
    assert (content, finish) == (whole.message.content, whole.finish_reason), case
    assert records == [r.token for r in whole.logprobs.content]
    if kind == "calls":
        assert whole.finish_reason == "tool_calls" and whole.message.content is None
        assert calls == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    else:
        assert whole.message.tool_calls is None and whole.finish_reason == ("stop" if kind == "reply" else "length")
        assert isinstance(whole.message.content, str)
    if kind == "reply":  # the decoded string, up to the `"}` that closed it
        assert "response" in whole.message.content and not whole.message.content.endswith('"}')
    if case == "no branch yet":
        assert whole.message.content == '{"'
    if case == "calls cut short":  # the stream sent the call it saw; the whole answer and the stream's content agree
        assert calls and whole.message.content.startswith('{"tool_calls":[{"name":"' + calls[0][0])


def test_the_sdks_stream_helper_reads_auto_answers_as_the_whole_ones(client, smollm2_engine):
    for kw in (branch(smollm2_engine, "reply"), branch(smollm2_engine, "calls")):
        whole = ask(client, max_tokens=60, **kw).choices[0].message
        with client.chat.completions.stream(model=MODEL, messages=CHAT, temperature=0, max_tokens=60, tools=TOOLS,
                                            **kw) as stream:
            final = stream.get_final_completion().choices[0].message
        assert final.content == whole.content
        assert [(c.function.name, c.function.arguments) for c in final.tool_calls or []] == \
            [(c.function.name, c.function.arguments) for c in whole.tool_calls or []]


def test_auto_without_parallel_calls_makes_at_most_one(client, smollm2_engine):
    many = ask(client, tool_choice="auto", max_tokens=120, **branch(smollm2_engine, "calls")).choices[0]
    one = ask(client, tool_choice="auto", parallel_tool_calls=False, max_tokens=120,
              **branch(smollm2_engine, "calls")).choices[0]
    assert len(many.message.tool_calls) > 1 and len(one.message.tool_calls) == 1, (many, one)


def test_both_branches_of_auto_are_reachable_and_nothing_else_is(smollm2_engine):
    """The constraint takes exactly one object, calls or a reply (escapes and all), compact, as the reader reads it."""
    from generation.constraints import processor_from_request
    from serving.generate.config import GenerateConfig
    from serving.generate.tools import offered

    spec = offered(TOOLS, GenerateConfig()).constraint().params

    def takes(text: str) -> bool:
        seq = processor_from_request(spec, smollm2_engine).fork()
        return all(seq.matcher.consume_token(t) for t in smollm2_engine.tokenizer.encode(text)) \
            and seq.matcher.is_accepting()

    assert takes('{"tool_calls":[{"name":"get_time","parameters":{"zone":"UTC"}}]}')
    assert takes('{"tool_calls":[{"name":"get_time","parameters":{"zone":"UTC"}},{"name":"get_weather",'
                 '"parameters":{"city":"Paris","unit":"celsius"}}]}')
    assert takes('{"response":"Hi"}') and takes('{"response":""}')
    # llguidance writes `\\uXXXX` only for control characters, and other characters as they are
    assert takes('{"response":"a\\n\\"b\\" \\\\ \\t \\u001f é😀"}')
    for text in ('{"tool_calls":[]}', '{"response":"Hi","tool_calls":[]}', '{"tool_calls":[{"name":"get_time",'
                 '"parameters":{"zone":"EST"}}]}', '{"answer":"Hi"}', '{ "response":"Hi"}', '"Hi"', '{"response":1}'):
        assert not takes(text), text


def test_under_auto_an_earlier_call_reads_as_the_json_the_model_writes(client, smollm2_server):
    """An agent's loop: the assistant's calls come back as the `{"tool_calls": ...}` answer it was asked to write
    (arguments parsed, compact), the tool's answer as the template renders it; /tokenize renders as chat does."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    turns = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    tokens = requests.post(smollm2_server.url + "/tokenize", timeout=60, json={
        "messages": turns, "tools": TOOLS, "return_token_strs": True}).json()
    text = "".join(tokens["token_strs"])
    assert ('<|im_start|>assistant\n{"tool_calls":[{"name":"get_weather","parameters":{"city":"Paris",'
            '"unit":"celsius"}}]}<|im_end|>\n<|im_start|>tool\n18 degrees, sunny<|im_end|>') in text
    assert ask(client, messages=turns, max_tokens=2).usage.prompt_tokens == tokens["count"]


@pytest.mark.parametrize("messages, system", [
    (CHAT, ""),
    ([{"role": "system", "content": "Be brief."}, *CHAT], "Be brief.\n\n"),
    ([{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]}, *CHAT], "Be brief.\n\n"),
])
def test_the_instruction_joins_the_system_message_or_comes_first(smollm2_server, messages, system):
    from serving.generate.config import GenerateConfig
    from serving.generate.tools import offered

    instruction = offered(TOOLS, GenerateConfig()).instruction()
    assert '{"name":"get_weather","description":"Weather in a city","parameters":{"type":"object"' in instruction
    assert '\n{"name":"get_time","parameters":{"type":"object"' in instruction
    r = requests.post(smollm2_server.url + "/tokenize", timeout=60, json={
        "messages": messages, "tools": TOOLS, "return_token_strs": True}).json()
    assert "".join(r["token_strs"]).startswith(
        f"<|im_start|>system\n{system}{instruction}<|im_end|>\n<|im_start|>user\n{CHAT[0]['content']}<|im_end|>")


@pytest.mark.parametrize("choice", [None, "auto"])
@pytest.mark.parametrize("kw, param", [
    ({"stop": ["}"]}, "stop"),  # a stop string would cut the answer's JSON
    ({"response_format": {"type": "json_object"}}, "tool_choice"),
    ({"extra_body": {"structured_outputs": {"regex": "a+"}}}, "tool_choice"),
    ({"extra_body": {"min_tokens": 2}}, "min_tokens"),  # the grammar decides where the answer ends
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),  # the body's index, though the instruction's system message comes first
])
def test_what_would_break_auto_is_refused_by_field(client, choice, kw, param):
    message = refused(client, param, **kw, **({"tool_choice": choice} if choice else {}))
    if param == "tool_choice":  # the format asked for beside the tools is named too
        assert next(k for k in (*kw, *kw.get("extra_body", {})) if k != "extra_body") in message
