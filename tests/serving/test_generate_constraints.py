"""Constrained decoding over HTTP: a real `pagoda serve` on a 2-layer random Llama with SmolLM2's own tokenizer.

The OpenAI SDK's `response_format` (json_schema, json_object) and vLLM's `structured_outputs` on `/v1/*`,
SGLang's `regex` / `json_schema` / `ebnf` on `/generate`: whatever the body asked for, the output parses
and validates (`jsonschema`), `fullmatch`es or is one of the choices; the model's weights are noise, so
the structure comes from the constraint. Served answers equal `SamplingParams(constraint=...)` in-process,
streams equal non-streams, a `max_tokens` cut is a prefix with finish reason `length`, and every refused
constraint is a 400 naming its body field (a schema keyword that would not be enforced: its path).
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
import requests
from serving_support import ServerProcess

from generation import Engine, EngineConfig, SamplingParams
from generation.constraints import processor_from_request
from tests.generation.grammar_checks import is_arith
from tests.generation.test_constraints import TEST_SCHEMAS

MODEL = "tiny-smollm2"
CHAT = [{"role": "user", "content": "Give me the fields as JSON."}]
SCHEMA = TEST_SCHEMAS["3 fields"]
GBNF = 'root ::= expr\nexpr ::= term ("+" term)*\nterm ::= [0-9] | "(" expr ")"'


@pytest.fixture(scope="module")
def server(smollm2_server):
    return smollm2_server


@pytest.fixture(scope="module")
def engine(smollm2_engine):
    return smollm2_engine


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(server, body, **kw):
    return requests.post(server.url + "/generate", json=body, timeout=120, **kw)


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "fields", "schema": schema, "strict": True}}


# ---- OpenAI routes ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["3 fields", "types", "nested objects", "anyOf"])
def test_chat_json_schema_validates_and_equals_the_engine(client, engine, name):
    schema = TEST_SCHEMAS[name]
    for seed in (1, 2):
        r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=120, temperature=1.0, seed=seed,
                                           response_format=response_format(schema))
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)
    ids = engine.tokenizer.encode(engine.apply_chat_template(CHAT))
    (ref,) = engine.generate([ids], SamplingParams(max_new_tokens=120, temperature=1.0, seed=2,
                                                   constraint={"json_schema": schema}))
    assert choice.message.content == ref.text and r.usage.completion_tokens == len(ref.token_ids)


def test_completions_json_schema_for_a_batch_of_prompts(client):
    # the SDK's legacy completions take no response_format argument: clients send it in the body (as for vLLM)
    r = client.completions.create(model=MODEL, prompt=["Hello", "Extract:", "1 2 3"], max_tokens=120,
                                  temperature=1.0, seed=5, n=2, extra_body={"response_format": response_format(SCHEMA)})
    assert len(r.choices) == 6
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.text), SCHEMA)
    assert len({c.text for c in r.choices}) > 1  # six samples, not one answer copied


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_json_object_is_any_json_object(client, engine, route):
    """Any JSON object: on noise its first key is an unbounded string, so most samples run to `max_tokens`
    (a prefix); each answer equals the engine's, every one replays through the grammar, the ended ones parse."""
    spec = {"json_object": True}
    prompt = engine.apply_chat_template(CHAT) if route == "chat" else "JSON:"
    refs = engine.generate([engine.tokenizer.encode(prompt)] * 20, [
        SamplingParams(max_new_tokens=30, temperature=1.0, seed=seed, constraint=spec) for seed in range(20)])
    for seed, ref in enumerate(refs):
        kw = dict(model=MODEL, max_tokens=30, temperature=1.0, seed=seed)
        if route == "chat":
            choice = client.chat.completions.create(messages=CHAT, response_format={"type": "json_object"},
                                                    **kw).choices[0]
            text = choice.message.content
        else:
            choice = client.completions.create(prompt=prompt, extra_body={"response_format": {"type": "json_object"}},
                                               **kw).choices[0]
            text = choice.text
        assert text == ref.text and text.startswith("{") and choice.finish_reason == ref.finish_reason
        replay = processor_from_request(spec, engine).fork()
        for t in ref.token_ids:
            replay.accept(t)
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
    assert any(r.finish_reason == "stop" for r in refs)  # these seeds do end one (the seeds are fixed)


@pytest.mark.parametrize(("structured", "check"), [
    ({"json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"json": json.dumps(SCHEMA)}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"regex": "[a-z]{2,6}-[0-9]{1,3}"}, lambda t: re.fullmatch("[a-z]{2,6}-[0-9]{1,3}", t) is not None),
    ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    ({"grammar": GBNF}, is_arith),
], ids=["json", "json-string", "regex", "choice", "grammar"])
def test_structured_outputs_on_both_routes(client, structured, check):
    body = {"structured_outputs": structured}
    texts = []
    for seed in (1, 2, 3):
        chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=120, temperature=1.0,
                                              seed=seed, extra_body=body).choices[0]
        comp = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=120, temperature=1.0, seed=seed,
                                         extra_body=body).choices[0]
        texts += [(chat.finish_reason, chat.message.content), (comp.finish_reason, comp.text)]
    done = [t for reason, t in texts if reason == "stop"]
    assert len(done) >= 4, texts  # the grammar is unbounded: noise may run past 120 tokens now and then
    assert all(check(t) for t in done), done


def test_a_chat_stream_with_a_constraint_equals_its_answer(client):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=120, temperature=1.0, seed=9, response_format=response_format(SCHEMA))
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_max_tokens_cut_short_is_length_and_a_prefix(client, engine):
    spec = {"json_schema": SCHEMA}
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0,
                                       response_format=response_format(SCHEMA))
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6
    ids = engine.tokenizer.encode(engine.apply_chat_template(CHAT))
    (ref,) = engine.generate([ids], SamplingParams(max_new_tokens=6, constraint=spec))
    assert r.choices[0].message.content == ref.text
    with pytest.raises(json.JSONDecodeError):
        json.loads(ref.text)
    replay = processor_from_request(spec, engine).fork()
    for t in ref.token_ids:
        replay.accept(t)  # raises on any token the grammar did not allow: the cut output is a prefix


# ---- SGLang's /generate -----------------------------------------------------------------------------------


@pytest.mark.parametrize("schema", [SCHEMA, json.dumps(SCHEMA)], ids=["object", "string"])
def test_generate_json_schema_as_object_or_string(server, schema):
    for seed in (1, 2, 3):
        r = post(server, {"text": "Extract:", "sampling_params": {"max_new_tokens": 120, "sampling_seed": seed,
                                                                  "json_schema": schema}})
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["finish_reason"]["type"] == "stop"
        jsonschema.validate(json.loads(r.json()["text"]), SCHEMA)


def test_generate_regex_for_a_batch_equals_the_engine(server, engine):
    pattern = r"[A-Z]{2}-[0-9]{3}"
    texts = ["Hello", "Code:", "1 2 3"]
    r = post(server, {"text": texts, "sampling_params": {"max_new_tokens": 40, "temperature": 0, "regex": pattern}})
    answers = r.json()
    refs = engine.generate([engine.tokenizer.encode(t) for t in texts],
                           SamplingParams(max_new_tokens=40, constraint={"regex": pattern}))
    for answer, ref in zip(answers, refs):
        assert re.fullmatch(pattern, answer["text"]) and answer["output_ids"] == ref.token_ids


def test_generate_ebnf(server):
    done = []
    for seed in range(4):
        r = post(server, {"text": "Sum:", "sampling_params": {"max_new_tokens": 120, "sampling_seed": seed,
                                                              "ebnf": GBNF}}).json()
        if r["meta_info"]["finish_reason"]["type"] == "stop":
            done.append(r["text"])
    assert len(done) >= 2 and all(is_arith(t) for t in done), done


def test_generate_stream_with_a_regex(server):
    body = {"text": "Code:", "sampling_params": {"max_new_tokens": 40, "sampling_seed": 4, "regex": "[a-z]{3,9}"}}
    full = post(server, body).json()
    events = []
    with post(server, {**body, "stream": True}, stream=True) as r:
        for line in r.iter_lines(decode_unicode=True):
            if line and line != "data: [DONE]":
                events.append(json.loads(line.removeprefix("data: ")))
    assert events[-1]["text"] == full["text"] and re.fullmatch("[a-z]{3,9}", full["text"])


def test_generate_length_cut_is_a_prefix(server, engine):
    spec = {"json_schema": SCHEMA}
    r = post(server, {"text": "Extract:", "sampling_params": {"max_new_tokens": 5, "temperature": 0,
                                                              "json_schema": SCHEMA}}).json()
    assert r["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    replay = processor_from_request(spec, engine).fork()
    for t in r["output_ids"]:
        replay.accept(t)


# ---- refusals ---------------------------------------------------------------------------------------------

NESTED_UNIQUE = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                           "uniqueItems": True}}}
OPENAI_REFUSALS = [
    (response_format({"type": "strin"}), None, "response_format.json_schema.schema", None),
    (response_format({"type": "string", "pattern": "(a"}), None, "response_format.json_schema.schema", None),
    (response_format(NESTED_UNIQUE), None, "response_format.json_schema.schema.properties.tags", "uniqueItems"),
    (response_format({"anyOf": [{"type": "integer"}, {"not": {}}]}), None,
     "response_format.json_schema.schema.anyOf[1]", "'not'"),
    (None, {"regex": "[a-"}, "structured_outputs.regex", None),
    (None, {"json": "{not json"}, "structured_outputs.json", "not valid JSON"),
    (None, {"json": NESTED_UNIQUE}, "structured_outputs.json.properties.tags", "uniqueItems"),
    (None, {"choice": []}, "structured_outputs.choice", None),
    (None, {"choice": ["a", 1]}, "structured_outputs.choice", None),
    (None, {"grammar": 'root ::= "x" ['}, "structured_outputs.grammar", None),
    (None, {"regex": "a", "choice": ["a"]}, "structured_outputs", None),
]


@pytest.mark.parametrize(("fmt", "structured", "param", "words"), OPENAI_REFUSALS,
                         ids=[p + (f"-{w}" if w else "") for _, _, p, w in OPENAI_REFUSALS])
@pytest.mark.parametrize("route", ["chat/completions", "completions"])
def test_refused_constraints_are_400_naming_the_field(server, route, fmt, structured, param, words):
    body = {"messages": CHAT} if route == "chat/completions" else {"prompt": "x"}
    body.update({"response_format": fmt} if fmt else {"structured_outputs": structured})
    r = requests.post(f"{server.url}/v1/{route}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert error["message"].startswith(param + ": ") and (words is None or words in error["message"]), error


@pytest.mark.parametrize(("sampling", "field", "words"), [
    ({"regex": "(a)\\1"}, "sampling_params.regex", None),
    # compiled, and answered 200 with an empty text that the regex does not match
    ({"regex": "[^\\x00-\\U0010FFFF]"}, "sampling_params.regex", "matches no text"),
    ({"json_schema": "{nope"}, "sampling_params.json_schema", "not valid JSON"),
    ({"json_schema": {"type": "object", "properties": {"a": {"type": "integer", "nullable": True}}}},
     "sampling_params.json_schema.properties.a", "nullable"),
    ({"ebnf": 'root ::= "x" ['}, "sampling_params.ebnf", None),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "sampling_params.ebnf", None),
])
def test_generate_refusals_name_the_field(server, sampling, field, words):
    r = post(server, {"text": "x", "sampling_params": sampling})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["field"] == field and (words is None or words in error["message"]), error


@pytest.mark.parametrize(("route", "body", "field"), [
    # values that used to fail inside the engine (NaN probabilities, an int64 overflow, a tokenizer TypeError);
    # a temperature under 1e-5 is greedy on every route, as vLLM reads it, so a refusal is above the range
    ("generate", {"text": "x", "sampling_params": {"temperature": 1e7, "regex": "[0-9]+"}},
     "sampling_params.temperature"),
    ("generate", {"text": "x", "sampling_params": {"sampling_seed": 2**100, "regex": "[0-9]+"}},
     "sampling_params.sampling_seed"),
    ("generate", {"text": "a \ud800 b", "sampling_params": {"regex": "[0-9]+"}}, "text"),
    ("v1/chat/completions", {"messages": CHAT, "temperature": -1e-300, "response_format": {"type": "json_object"}},
     "temperature"),
    ("v1/chat/completions", {"messages": CHAT, "seed": 2**100, "response_format": {"type": "json_object"}}, "seed"),
    # JSON can spell a lone surrogate, which no tokenizer or grammar engine takes (in-process the engine and
    # SamplingParams refuse it by name; the server's body reader already does, with the value's own path)
    ("v1/completions", {"prompt": "\udfff", "structured_outputs": {"regex": "[0-9]+"}}, "prompt"),
    ("v1/chat/completions", {"messages": CHAT, "response_format": response_format({"const": "\ud800"})},
     "response_format.json_schema.schema.const"),
    ("v1/completions", {"prompt": "x", "structured_outputs": {"choice": ["ok", "\ud83d"]}},
     "structured_outputs.choice[1]"),
    ("generate", {"text": "x", "sampling_params": {"regex": "[a-z]\udc00"}}, "sampling_params.regex"),
    ("generate", {"text": "x", "sampling_params": {"ebnf": 'root ::= "\udfff"'}}, "sampling_params.ebnf"),
])
def test_unusable_sampling_values_and_prompts_are_400_naming_the_field(server, route, body, field):
    r = requests.post(f"{server.url}/{route}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error.get("param", error.get("field")) == field, error
    assert "surrogate" in error["message"] or "\\u" not in json.dumps(body), error


def test_a_completions_stream_with_a_constraint_equals_its_answer(client):
    kw = dict(model=MODEL, prompt="Code:", max_tokens=40, temperature=1.0, seed=6,
              extra_body={"structured_outputs": {"regex": "[a-z]{2,6}-[0-9]{1,3}"}})
    full = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.finish_reason == "stop"
    assert re.fullmatch("[a-z]{2,6}-[0-9]{1,3}", full.text)


def test_a_batch_takes_one_constraint(server):
    r = post(server, {"text": ["a", "b"], "sampling_params": [{"regex": "[0-9]+"}, {"regex": "[a-z]+"}]})
    assert r.status_code == 400 and r.json()["error"]["field"] == "sampling_params[1].regex", r.text
    same = post(server, {"text": ["a", "b"], "sampling_params": [{"regex": "[0-9]+", "max_new_tokens": 8}] * 2})
    assert same.status_code == 200 and all(re.fullmatch("[0-9]+", a["text"]) or a["meta_info"]["finish_reason"]
                                           ["type"] == "length" for a in same.json())


def test_the_server_stays_up(server, client):
    """After every refusal above the server still answers constrained requests."""
    for _ in range(2):
        r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=120, temperature=0,
                                           response_format=response_format(TEST_SCHEMAS["enum and const"]))
        jsonschema.validate(json.loads(r.choices[0].message.content), TEST_SCHEMAS["enum and const"])
    assert requests.get(server.url + "/health", timeout=30).status_code == 200


# ---- the real model -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_over_http_answers_the_extraction_tasks_with_valid_json(tmp_path):
    """The embedded SmolLM2-135M-Instruct (`--generate-model default`): the benchmark's extraction tasks
    through the OpenAI SDK with `response_format` json_schema, and a regex through `/generate`. Every
    answer parses and validates; the first equals the engine's in-process answer token for token."""
    from generation.bench_constraints import extraction_message, extraction_prompts

    proc = ServerProcess(tmp_path / "serve.log", ["--generate-only", "--generate-model", "default",
                                                  "--generate-torch-threads", "1"])
    smol = proc.running(timeout=300)
    try:
        client = openai.OpenAI(base_url=smol.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        name = "SmolLM2-135M-Instruct"
        tasks = extraction_prompts()[:4]
        answers = []
        for task in tasks:
            messages = [{"role": "user", "content": extraction_message(task)}]
            r = client.chat.completions.create(model=name, messages=messages, max_tokens=160, temperature=0,
                                               response_format=response_format(task["schema"]))
            assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
            jsonschema.validate(json.loads(r.choices[0].message.content), task["schema"])
            answers.append(r)
        code = post(smol, {"text": "The ticket code (two capitals, a dash, three digits) is",
                           "sampling_params": {"max_new_tokens": 16, "temperature": 0, "regex": r"[A-Z]{2}-[0-9]{3}"}})
        assert code.status_code == 200 and re.fullmatch(r"[A-Z]{2}-[0-9]{3}", code.json()["text"]), code.text
    finally:
        proc.stop()
    engine = Engine(EngineConfig(model=None, num_threads=1))
    messages = [{"role": "user", "content": extraction_message(tasks[0])}]
    (ref,) = engine.generate([engine.tokenizer.encode(engine.apply_chat_template(messages))],
                             SamplingParams(max_new_tokens=160, constraint={"json_schema": tasks[0]["schema"]}))
    assert answers[0].choices[0].message.content == ref.text
