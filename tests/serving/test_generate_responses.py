"""OpenAI's Responses API through the `openai` SDK (`responses.create`, `.stream`, `.parse`) and `requests`,
against a real `pagoda serve` (a 2-layer random Llama with SmolLM2's tokenizer and chat template): answers equal
the engine's in-process, token for token; a stream is the typed events the SDK's accumulator reads, whose
deltas add up to the answer; forced function calls and `text.format` follow their schemas, and under `"auto"`
(the default) the answer is calls or a message, streamed as the whole answer gives it; an agent's loop
(its output items and the tools' outputs sent back) renders as chat's messages do; every unsupported or
malformed field is a 400 naming it."""

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
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER},
         {"type": "function", "name": "get_time", "parameters": TIME}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
SEVERAL = "Weather and time in Berlin, please."  # greedy: 3 calls under "required"


@pytest.fixture(scope="module")
def client(smollm2_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def ask(client, **kw):
    return client.responses.create(**{"model": MODEL, "input": "What is the weather in Paris?", "temperature": 0,
                                      "max_output_tokens": 24, **kw})


def engine_answer(engine, messages, tools=None, **kw):
    ids = engine.encode(engine.apply_chat_template(messages, tools=tools))
    (out,) = engine.generate([ids], SamplingParams(**kw))
    return ids, out


def test_a_text_answer_equals_the_engine_and_reads_as_openai_s(client, smollm2_engine):
    r = ask(client, instructions="Answer briefly.", metadata={"ticket": "42"})
    ids, ref = engine_answer(smollm2_engine, [{"role": "system", "content": "Answer briefly."},
                                              {"role": "user", "content": "What is the weather in Paris?"}],
                             max_new_tokens=24)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.output_text == ref.text
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert (r.status, item.status) == (("incomplete", "incomplete") if ref.finish_reason == "length" else
                                       ("completed", "completed"))
    assert r.usage.input_tokens == len(ids) and r.usage.output_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == len(ids) + len(ref.token_ids)
    assert r.metadata == {"ticket": "42"} and r.instructions == "Answer briefly." and r.store is False


def test_a_length_cut_is_incomplete_with_its_reason(client):
    r = ask(client, max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"


def test_a_stream_is_typed_events_whose_deltas_add_up_to_the_answer(client, smollm2_server):
    whole = ask(client, max_output_tokens=40)
    raw = requests.post(smollm2_server.url + "/v1/responses", stream=True, timeout=120, json={
        "model": MODEL, "input": "What is the weather in Paris?", "temperature": 0, "max_output_tokens": 40,
        "stream": True})
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("text/event-stream")
    events, names = [], []
    for line in raw.iter_lines(decode_unicode=True):
        if line.startswith("event: "):
            names.append(line[7:])
        elif line.startswith("data: "):
            events.append(json.loads(line[6:]))
    kinds = [e["type"] for e in events]
    assert names == kinds  # each event named on its own line, as OpenAI sends them; no [DONE]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    end = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", end]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1]["response"]["output"][0]["content"][0]["text"]
    assert events[0]["response"]["status"] == "in_progress" and events[-1]["response"]["usage"]["output_tokens"] > 0

    with client.responses.stream(model=MODEL, input="What is the weather in Paris?", temperature=0,
                                 max_output_tokens=12) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    assert text == ask(client, max_output_tokens=12).output_text


def test_text_format_is_constrained_and_parse_reads_it(client, smollm2_engine):
    class Weather(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=12)
        unit: Literal["celsius", "fahrenheit"]

    r = client.responses.parse(model=MODEL, input="Weather in Paris as JSON.", text_format=Weather, temperature=0,
                               max_output_tokens=60)
    assert isinstance(r.output_parsed, Weather)
    schema = TIME
    r = ask(client, max_output_tokens=60,
            text={"format": {"type": "json_schema", "name": "zone", "schema": schema, "strict": True}})
    _, ref = engine_answer(smollm2_engine, [{"role": "user", "content": "What is the weather in Paris?"}],
                           max_new_tokens=60, constraint={"json_schema": schema})
    assert r.output_text == ref.text and json.loads(r.output_text)["zone"] in ("UTC", "CET")
    assert r.text.format.type == "json_schema"


def test_a_named_call_is_a_function_call_item_that_equals_the_engine(client, smollm2_engine):
    r = ask(client, tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=200)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert call.id.startswith("fc_") and call.status == "completed" and r.output_text == ""
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    _, ref = engine_answer(smollm2_engine, [{"role": "user", "content": "What is the weather in Paris?"}],
                           tools=CHAT_TOOLS, max_new_tokens=200, constraint={"json_schema": WEATHER})
    assert call.arguments == ref.text

    with client.responses.stream(model=MODEL, input="What is the weather in Paris?", temperature=0,
                                 max_output_tokens=200, tools=TOOLS,
                                 tool_choice={"type": "function", "name": "get_weather"}) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta")
        final = stream.get_final_response()
    assert deltas == call.arguments == final.output[0].arguments and final.output[0].name == "get_weather"


def call_fields(item) -> tuple:
    """A function_call item ids aside."""
    return item.type, item.name, item.arguments, item.status


def call_events(stream) -> tuple[list, object]:
    """The events in order, and the final response (the SDK's `get_final_response` takes only a completed one)."""
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events, stream.get_final_response() if events[-1].type == "response.completed" else events[-1].response


@pytest.mark.parametrize("parallel", [False, True])
def test_required_calls_stream_as_they_are_generated_and_validate(client, parallel):
    """Each call's item is added (name and call_id, no arguments yet) once its name shows, its arguments come as
    deltas, then its done events, before the next call's item is added; the final response equals the whole one."""
    kw = {"input": SEVERAL, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": parallel,
          "max_output_tokens": 300}
    r = ask(client, **kw)
    assert r.status == "completed" and all(o.type == "function_call" for o in r.output)
    for call in r.output:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert (len(r.output) > 1) == parallel and r.parallel_tool_calls is parallel
    with client.responses.stream(model=MODEL, temperature=0, **kw) as stream:
        events, final = call_events(stream)
    assert [call_fields(o) for o in final.output] == [call_fields(o) for o in r.output]
    kinds = [(e.type, getattr(e, "output_index", None)) for e in events]
    assert kinds[-1] == ("response.completed", None)
    per_call = []
    for k, item in enumerate(final.output):
        (added,) = [e for e in events if e.type == "response.output_item.added" and e.output_index == k]
        assert (added.item.name, added.item.call_id, added.item.arguments, added.item.status) == (
            item.name, item.call_id, "", "in_progress")
        mine = [e for e in events if getattr(e, "output_index", None) == k]
        assert [e.type for e in mine] == ["response.output_item.added",
                                          *["response.function_call_arguments.delta"] * (len(mine) - 3),
                                          "response.function_call_arguments.done", "response.output_item.done"]
        assert all(e.item_id == item.id for e in mine[1:-1]) and mine[-1].item.id == item.id
        assert "".join(e.delta for e in mine[1:-2]) == mine[-2].arguments == item.arguments
        per_call.append(len(mine) - 3)
        if k:  # the calls one after the other, each closed before the next opens
            assert events.index(mine[0]) > max(i for i, e in enumerate(events) if getattr(e, "output_index", None) == k - 1)
    assert max(per_call) > 1  # the arguments came as they were typed


def test_a_required_list_cut_short_streams_its_calls_then_the_message_the_answer_gives(client):
    """Cut by max_output_tokens, the list does not parse: the whole answer is its text as a message. A stream has
    added the call it saw and sent its arguments so far; it ends that call incomplete and adds the same message."""
    for n in range(4, 60):  # the shortest cut a few characters into the first call's arguments
        whole = ask(client, tools=TOOLS, tool_choice="required", max_output_tokens=n)
        if '"parameters":{"' in whole.output_text and not whole.output_text.endswith('{"'):
            break
    (message,) = whole.output
    text = message.content[0].text
    assert whole.status == "incomplete" and message.type == "message" and message.status == "incomplete"
    with client.responses.stream(model=MODEL, input="What is the weather in Paris?", temperature=0,
                                 max_output_tokens=n, tools=TOOLS, tool_choice="required") as stream:
        events, final = call_events(stream)
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    call, streamed = final.output
    assert call.type == "function_call" and call.status == "incomplete"
    assert text == f'[{{"name":"{call.name}","parameters":' + call.arguments
    assert (streamed.type, streamed.status, streamed.content[0].text) == ("message", "incomplete", text)
    assert [e.type for e in events if getattr(e, "output_index", None) == 0][-1] == "response.output_item.done"
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == call.arguments


def test_an_agent_loop_renders_as_chat_messages_do(client, smollm2_server):
    first = ask(client, tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=200)
    call = first.output[0]
    items = [{"role": "user", "content": "What is the weather in Paris?"},
             *[o.model_dump(exclude_none=True) for o in first.output],
             {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    r = ask(client, input=items, tools=TOOLS, tool_choice="none", max_output_tokens=8)
    chat = requests.post(smollm2_server.url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "temperature": 0, "max_tokens": 8, "tools": CHAT_TOOLS, "tool_choice": "none", "messages": [
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function", "function": {
                "name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}]}).json()
    assert r.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert r.output_text == chat["choices"][0]["message"]["content"]
    # an earlier text answer sent back as the SDK returned it (annotations, logprobs) is an assistant turn
    again = ask(client, input=[{"role": "user", "content": "Hi"}, *[o.model_dump() for o in r.output],
                               {"role": "user", "content": [{"type": "input_text", "text": "And tomorrow?"}]}])
    assert again.status in ("completed", "incomplete") and again.usage.input_tokens > r.usage.output_tokens


def test_logprobs_come_with_include(client):
    r = ask(client, max_output_tokens=4, include=["message.output_text.logprobs"], top_logprobs=2)
    logprobs = r.output[0].content[0].logprobs
    assert len(logprobs) == r.usage.output_tokens and all(len(lp.top_logprobs) == 2 for lp in logprobs)
    assert "".join(bytes(lp.bytes).decode("utf-8", "replace") for lp in logprobs) == r.output_text
    assert ask(client, max_output_tokens=4).output[0].content[0].logprobs == []


@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": 3}, "input"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "reasoning": {"effort": "low"}}, "reasoning"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "n": 2}, "n"),
    ({"input": "x", "include": ["file_search_call.results"]}, "include[0]"),
    ({"input": "x", "top_logprobs": 21}, "top_logprobs"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 10_000}, "max_output_tokens"),
    ({"input": "x", "temperature": "hot"}, "temperature"),
    ({"input": "x", "instructions": 5}, "instructions"),
    ({"input": "x", "metadata": {"k": 1}}, "metadata.k"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"properties": {
        "a": {"minLength": "x"}}}}}}, "text.format.schema"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": ["x"]}, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": [], "text": "hi"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": {"a": 1}, "text": "hi"}]}]}, "input[0].content[0].type"),
    ({"input": "x", "verbosity": "low"}, "verbosity"),
    ({"input": "x", "text": {"verbosity": "high"}}, "text.verbosity"),
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}},
     "tool_choice.type"),
    ({"input": "x", "tools": TOOLS, "stop": "}"}, "stop"),  # under auto, the default: it would cut the JSON answer
    ({"input": "x", "tools": [{"type": "web_search"}], "tool_choice": "required"}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function", "name": "a b"}], "tool_choice": "required"}, "tools[0].name"),
    ({"input": "x", "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
     "tools[0].function"),
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"input": "x", "tools": [*TOOLS, TOOLS[0]], "tool_choice": "required"}, "tools[2].name"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "nope"}}}}], "tool_choice": "required"}, "tools[0].parameters"),
    ({"input": "x", "tools": TOOLS, "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
     "tool_choice"),
    ({"input": "x", "stream_options": {"include_obfuscation": False}}, "stream_options"),
    ({"input": "x", "model": "gpt-4o"}, "model"),
])
def test_bad_fields_are_refused_by_name(smollm2_server, body, param):
    r = requests.post(smollm2_server.url + "/v1/responses", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error" and err["message"].startswith(param)


def test_what_the_sdk_sends_by_default_is_taken(client):
    """Fields clients send with their defaults (the Agents SDK's among them) ask for nothing this server lacks."""
    r = ask(client, store=True, truncation="disabled", include=[], parallel_tool_calls=True, service_tier="auto",
            user="u1", safety_identifier="s1", prompt_cache_key="k1", top_p=1.0, tool_choice="none",
            text={"format": {"type": "text"}, "verbosity": "medium"}, max_output_tokens=4,
            extra_body={"verbosity": "medium"})  # the SDK's parse sends verbosity at the top
    assert r.store is False and r.output_text
    assert (r.user, r.safety_identifier, r.prompt_cache_key, r.service_tier) == ("u1", "s1", "k1", "default")
    assert ask(client, max_output_tokens=2).tool_choice == "auto"  # OpenAI's echo of no tool_choice


def test_a_text_format_beside_auto_is_refused_naming_both(smollm2_server):
    r = requests.post(smollm2_server.url + "/v1/responses", timeout=60, json={
        "input": "x", "tools": TOOLS, "text": {"format": {"type": "json_object"}}})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "tool_choice" and "text.format" in err["message"], err


def test_a_conversation_from_openai_continues_here(client):
    """OpenAI asks clients to send an assistant message's `phase` back on every turn."""
    r = ask(client, input=[{"role": "user", "content": "Hi"},
                           {"type": "message", "role": "assistant", "phase": "final_answer", "status": "completed",
                            "content": [{"type": "output_text", "text": "Hello!", "annotations": []}]},
                           {"role": "user", "content": "Bye"}], max_output_tokens=2)
    assert r.usage.input_tokens > 0


def test_responses_are_counted_under_their_own_route(client, smollm2_server):
    before = requests.get(smollm2_server.url + "/stats", timeout=10).json()["generation"]["finished"]
    ask(client, max_output_tokens=3)
    after = requests.get(smollm2_server.url + "/stats", timeout=10).json()["generation"]["finished"]
    assert after["responses"]["length"] == before.get("responses", {}).get("length", 0) + 1


def item_fields(item) -> tuple:
    """An output item ids aside: a call's name, arguments and status, a message's status, text and logprobs tokens."""
    if item.type == "function_call":
        return call_fields(item)
    return item.type, item.status, item.content[0].text, [lp.token for lp in item.content[0].logprobs]


@pytest.mark.parametrize("case, kw", [
    ("a reply cut short", {}),  # greedy: the random model replies, at length
    ("calls", {"input": SEVERAL}),  # greedy: one call
    ("a whole reply", "reply"),
    ("calls cut short", {"input": SEVERAL, "max_output_tokens": 16}),  # into the call's arguments
])
def test_auto_answers_calls_or_a_message_and_streams_them(client, smollm2_engine, case, kw):
    """Tools with no tool_choice: function_call items or a message of the reply's decoded text; the stream's final
    response equals the whole one (a list cut short streams its call first, then the same message)."""
    from test_generate_tools import branch

    kw = {"tools": TOOLS, "max_output_tokens": 60, "include": ["message.output_text.logprobs"],
          **(branch(smollm2_engine, kw) if isinstance(kw, str) else kw)}
    if "logit_bias" in kw:
        kw["extra_body"] = {"logit_bias": kw.pop("logit_bias")}
    r = ask(client, **kw)
    assert r.tool_choice == "auto"
    with client.responses.stream(model=MODEL, temperature=0, **{"input": "What is the weather in Paris?", **kw}) \
            as stream:
        events, final = call_events(stream)
    streamed = [item_fields(o) for o in final.output]
    if case == "calls cut short":
        assert r.status == "incomplete" and [o.type for o in final.output] == ["function_call", "message"]
        assert r.output_text.startswith('{"tool_calls":[{"name":"') and final.output[0].status == "incomplete"
        streamed = streamed[1:]
    assert streamed == [item_fields(o) for o in r.output], case
    if case == "calls":
        assert r.status == "completed" and all(o.type == "function_call" for o in r.output)
        for call in r.output:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    else:
        (message,) = [o for o in final.output if o.type == "message"]
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert deltas == message.content[0].text == r.output_text
        assert r.status == ("completed" if case == "a whole reply" else "incomplete")


def test_an_agent_loop_under_auto_renders_as_chat_does(client, smollm2_server):
    """Function call items sent back under auto read as the model's own `{"tool_calls": ...}` answer, as chat's
    assistant calls do: the same prompt, token for token."""
    items = [{"role": "user", "content": "What is the weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city":"Paris","unit":"celsius"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"}]
    r = ask(client, input=items, tools=TOOLS, max_output_tokens=2)
    chat = requests.post(smollm2_server.url + "/tokenize", timeout=60, json={"tools": CHAT_TOOLS, "messages": [
        items[0], {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": items[1]["arguments"]}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}], "return_token_strs": True}).json()
    assert r.usage.input_tokens == chat["count"]
    assert '<|im_start|>assistant\n{"tool_calls":[{"name":"get_weather","parameters":' in "".join(chat["token_strs"])
