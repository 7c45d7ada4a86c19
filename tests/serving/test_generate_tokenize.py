"""vLLM's `/tokenize` and `/detokenize` against a real `pagoda serve` (SmolLM2's tokenizer and chat template on a
tiny random Llama): the ids are exactly those the generation routes feed the model (a prompt as
`/v1/completions` encodes it, messages as `/v1/chat/completions` renders them, tools included, as under
`tool_choice` "auto"), a prompt past
the prompt limit is still counted, ids round-trip to text, and bad bodies are 400s in OpenAI's shape naming
the field."""

from __future__ import annotations

import pytest
import requests

MODEL = "tiny-smollm2"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, wörld! 👋"}]
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]


def post(server, path, body):
    return requests.post(server.url + path, json=body, timeout=60)


def test_a_prompt_is_counted_as_completions_feeds_it(smollm2_server, smollm2_engine):
    text = "Hello, wörld! 👋 How many tokens?"
    r = post(smollm2_server, "/tokenize", {"model": MODEL, "prompt": text, "return_token_strs": True}).json()
    ids = smollm2_engine.encode(text)
    assert r["tokens"] == ids and r["count"] == len(ids) and r["max_model_len"] == smollm2_engine.max_model_len
    assert r["token_strs"][-3:] == [" many", " tokens", "?"]
    assert "\ufffd" in "".join(r["token_strs"])  # the emoji's bytes span tokens: each shows U+FFFD, as in logprobs
    done = post(smollm2_server, "/v1/completions", {"prompt": text, "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == r["count"]
    assert post(smollm2_server, "/tokenize", {"prompt": text}).json()["token_strs"] is None
    # SmolLM2's tokenizer adds no BOS, so add_special_tokens changes nothing here
    assert post(smollm2_server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"] == ids


def test_messages_are_counted_as_chat_renders_them(smollm2_server, smollm2_engine):
    r = post(smollm2_server, "/tokenize", {"messages": CHAT}).json()
    assert r["tokens"] == smollm2_engine.encode(smollm2_engine.apply_chat_template(CHAT))
    chat = post(smollm2_server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == r["count"]
    prefix = post(smollm2_server, "/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()
    assert prefix["tokens"] == r["tokens"][:prefix["count"]] and prefix["count"] < r["count"]



def test_messages_with_tools_are_counted_as_chat_renders_them_under_auto(smollm2_server, smollm2_engine):
    """Tools with no tool_choice are auto, OpenAI's default: the system message gains the tools and the answer's
    format, and the template is not given them (its own format would contradict ours)."""
    from serving.generate.config import GenerateConfig
    from serving.generate.tools import offered

    with_tools = post(smollm2_server, "/tokenize", {"messages": CHAT, "tools": TOOLS}).json()
    instruction = offered(TOOLS, GenerateConfig()).instruction()
    shown = [{"role": "system", "content": "Be brief.\n\n" + instruction}, CHAT[1]]
    assert with_tools["tokens"] == smollm2_engine.encode(smollm2_engine.apply_chat_template(shown))
    chat = post(smollm2_server, "/v1/chat/completions", {"messages": CHAT, "tools": TOOLS, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == with_tools["count"]


def test_ids_round_trip_to_text(smollm2_server):
    text = "Ünïcode, emoji 👋 and\nnewlines."
    ids = post(smollm2_server, "/tokenize", {"prompt": text}).json()["tokens"]
    assert post(smollm2_server, "/detokenize", {"tokens": ids}).json() == {"prompt": text}
    assert post(smollm2_server, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


def test_a_prompt_past_the_limit_is_still_counted(tight):
    text = "word " * 100
    r = post(tight, "/tokenize", {"prompt": text})
    assert r.status_code == 200 and r.json()["count"] > 40  # tight's --generate-max-prompt-tokens
    assert post(tight, "/v1/completions", {"prompt": text, "max_tokens": 1}).status_code == 400


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, 400, "prompt"),
    ("/tokenize", {"prompt": ["a"]}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, 400, "add_generation_prompt"),
    ("/tokenize", {"messages": CHAT, "tools": "x"}, 400, "tools"),
    ("/tokenize", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools[0].function"),
    ("/tokenize", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "bad name!"}}]}, 400,
     "tools[0].function.name"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, 400, "continue_final_message"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}}, 400, "chat_template_kwargs"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "truncate": 3}, 400, "truncate"),
    ("/tokenize", {"prompt": "a", "model": "gpt-4o"}, 404, "model"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, "x"]}, 400, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1], "model": "gpt-4o"}, 404, "model"),
])
def test_bad_bodies_name_the_field_in_openai_s_shape(smollm2_server, path, body, status, param):
    r = post(smollm2_server, path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_what_vllm_clients_send_at_their_defaults_is_taken(smollm2_server):
    base = post(smollm2_server, "/tokenize", {"messages": CHAT}).json()
    r = post(smollm2_server, "/tokenize", {"messages": CHAT, "continue_final_message": False,
                                          "chat_template_kwargs": {}, "mm_processor_kwargs": {}})
    assert r.status_code == 200 and r.json() == base
    chat = post(smollm2_server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1,
                                                          "continue_final_message": False, "chat_template_kwargs": {}})
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == base["count"]


def test_add_special_tokens_false_drops_the_bos_a_tokenizer_adds(smollm2_server):
    """No test model's tokenizer adds a BOS (SmolLM2's does not), so the app runs in-process on one that does."""
    from generation import Engine, EngineConfig
    from generation.tokenizer import TextTokenizer
    from serving.app import create_app
    from serving.config import ServeConfig
    from serving.generate.routes import GenerateApi

    engine = Engine(EngineConfig(model=str(smollm2_server.folder), block_size=4, num_blocks=64, num_threads=1))
    tok = engine.tokenizer
    engine.tokenizer = TextTokenizer(tok.tok, chat_template=tok.chat_template, bos_token="<|im_start|>",
                                     eos_token=tok.eos_token, add_bos=True)
    cfg = ServeConfig.from_sources({"generate_only": True}, env={})
    app = create_app(cfg, apis=[GenerateApi(cfg.generate, str(smollm2_server.folder), engine=engine)])
    bos = engine.tokenizer.bos_id
    with app.test_client() as http:
        with_bos = http.post("/tokenize", json={"prompt": "hello world"}).get_json()["tokens"]
        without = http.post("/tokenize", json={"prompt": "hello world", "add_special_tokens": False}).get_json()
    assert with_bos[0] == bos and without["tokens"] == with_bos[1:] and without["count"] == len(with_bos) - 1
