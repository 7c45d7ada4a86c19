"""The embedded SmolLM2-135M-Instruct behind `pagoda serve --generate-only` (the default model): what the
OpenAI SDK and `/generate` answer equals `Engine.generate` in-process, token for token. Slow: the GGUF is
dequantised twice (server and reference)."""

from __future__ import annotations

import json

import openai
import pytest
import requests
from serving_support import ServerProcess

from generation import Engine, EngineConfig, SamplingParams

pytestmark = pytest.mark.slow
CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]
TOOLS = [{"type": "function", "function": {"name": name, "description": description, "parameters": {
    "type": "object", "properties": properties, "required": [next(iter(properties))], "additionalProperties": False}}}
    for name, description, properties in [
        ("get_weather", "Get the current weather in a city",
         {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}),
        ("get_time", "Get the current time in a time zone", {"zone": {"type": "string"}})]]


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    proc = ServerProcess(tmp_path_factory.mktemp("smol") / "serve.log",
                         ["--generate-only", "--generate-model", "default", "--generate-torch-threads", "1"])
    yield proc.running(timeout=300)
    proc.stop()


def test_smollm2_over_http_equals_the_engine(smol):
    engine = Engine(EngineConfig(model=None))
    ids = engine.tokenizer.encode(engine.apply_chat_template(CHAT))
    (ref,) = engine.generate([ids], SamplingParams(max_new_tokens=16))
    client = openai.OpenAI(base_url=smol.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=16, temperature=0)
    assert r.choices[0].message.content == ref.text and r.usage.prompt_tokens == len(ids)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=16, temperature=0, stream=True) if c.choices)
    assert streamed == ref.text
    answer = client.responses.create(model="SmolLM2-135M-Instruct", input=CHAT[0]["content"], max_output_tokens=16,
                                     temperature=0)
    assert answer.output_text == ref.text and answer.usage.input_tokens == len(ids)
    native = requests.post(smol.url + "/generate", timeout=120, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 16, "temperature": 0}}).json()
    assert native["output_ids"] == ref.token_ids
    assert native["meta_info"]["cached_tokens"] > 0  # the chat requests left the prompt in the cache


def test_a_frontend_on_this_host_reads_the_default_models_chat_template(smol):
    """`/get_model_info` names the embedded GGUF itself, as SGLang names what it serves, so `HttpBackend` renders
    role blocks with SmolLM2's template without being told where the model is."""
    from generation import lang
    from generation.weights import default_model_path

    info = requests.get(smol.url + "/get_model_info", timeout=10).json()
    assert info["model_path"] == str(default_model_path()) and info["served_model_name"] == "SmolLM2-135M-Instruct"

    @lang.function
    def greet(s):
        s += lang.user("Say hi.")
        s += lang.assistant(lang.gen("reply", max_tokens=4))

    state = greet.run(backend=lang.HttpBackend(smol.url), temperature=0)
    assert state.text().startswith("<|im_start|>") and state["reply"]


def test_smollm2_chooses_between_replying_and_calling_under_auto(smol):
    """Tools with no tool_choice (the SDK's default): told the tools and the answer's format in the system message,
    the 135M model replies to a request no tool serves and calls the one that serves the other (greedy)."""
    client = openai.OpenAI(base_url=smol.url + "/v1", api_key="unused", max_retries=0, timeout=300)

    def ask(question: str):
        return client.chat.completions.create(model="SmolLM2-135M-Instruct", tools=TOOLS, temperature=0, max_tokens=60,
                                              messages=[{"role": "user", "content": question}]).choices[0]

    haiku = ask("Write a haiku about the sea.")
    assert haiku.message.tool_calls is None and haiku.finish_reason == "stop" and "sea" in haiku.message.content
    rain = ask("Is it raining in Tokyo right now?")
    (call,) = rain.message.tool_calls
    assert rain.finish_reason == "tool_calls" and rain.message.content is None
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Tokyo"
