"""Constrained decoding on SmolLM2's real byte-level BPE vocabulary, through the engine.

The model is a tiny random Llama with SmolLM2's tokenizer (49,152 tokens, rebuilt from the embedded GGUF):
its weights are noise, so whatever structure its outputs have comes from the constraint."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from generation import Engine, EngineConfig, SamplingParams
from generation.constraints import CACHE, Constraint, GrammarCache, processor_from_request
from generation.logits_processor import LogitsProcessor
from tests.generation.grammar_checks import is_arith

# Every string, number and array is bounded, so a model whose weights are noise must still finish:
# compact whitespace leaves it nowhere else to go.
TEST_SCHEMAS: dict[str, dict] = {
    "types": {"type": "object", "properties": {
        "s": {"type": "string", "maxLength": 8}, "i": {"type": "integer", "minimum": -50, "maximum": 50},
        "n": {"type": "number", "minimum": 0, "maximum": 10}, "b": {"type": "boolean"}, "z": {"type": "null"}},
        "required": ["s", "i", "n", "b", "z"], "additionalProperties": False},
    "enum and const": {"type": "object", "properties": {"c": {"enum": ["red", "green", 3, None]},
                                                        "k": {"const": "fixed"}},
                       "required": ["c", "k"], "additionalProperties": False},
    "items, minItems/maxItems": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                                 "minItems": 1, "maxItems": 4},
    "minLength/maxLength": {"type": "array", "items": {"type": "string", "minLength": 2, "maxLength": 6},
                            "minItems": 2, "maxItems": 3},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
                "required": ["code"], "additionalProperties": False},
    "anyOf": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                        {"type": "object", "properties": {"k": {"type": "string", "maxLength": 5}}, "required": ["k"],
                         "additionalProperties": False}]},
    "nested objects": {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "object", "properties": {"c": {"type": "boolean"}}, "required": ["c"],
              "additionalProperties": False}}, "required": ["b"], "additionalProperties": False}},
        "required": ["a"], "additionalProperties": False},
    "optional properties": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                                             "y": {"type": "boolean"}},
                            "additionalProperties": False},
    "3 fields": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                  "age": {"type": "integer", "minimum": 0, "maximum": 130},
                                                  "city": {"type": "string", "maxLength": 12}},
                 "required": ["name", "age", "city"], "additionalProperties": False},
}
PROMPTS = ["Hello", "Extract the fields as JSON:", "<|im_start|>user\nname and age?<|im_end|>\n", "1 2 3"]


def build_tiny_smollm2(folder: Path) -> Path:
    """A 2-layer random Llama whose vocabulary and tokenizer are SmolLM2's own (saved as an HF folder)."""
    from gguf import GGUFReader
    from transformers import LlamaConfig, LlamaForCausalLM

    from generation.tokenizer import TextTokenizer
    from generation.weights import default_model_path

    folder.mkdir(parents=True, exist_ok=True)
    reader = GGUFReader(str(default_model_path()))
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    tok = TextTokenizer.from_gguf_fields(fields)
    tok.tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": tok.bos_token, "eos_token": tok.eos_token, "chat_template": tok.chat_template}))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=tok.tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      initializer_range=0.3, tie_word_embeddings=True, bos_token_id=1,
                      eos_token_id=tok.token_id(tok.eos_token), pad_token_id=0)
    LlamaForCausalLM(cfg).eval().save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_smollm2(tmp_path_factory) -> Path:
    return build_tiny_smollm2(tmp_path_factory.mktemp("tiny-smollm2"))


@pytest.fixture(scope="module")
def engine(tiny_smollm2) -> Engine:
    return Engine(EngineConfig(model=str(tiny_smollm2), num_threads=1))


def constrained(spec: dict, **kw) -> SamplingParams:
    """A constrained request the way callers make one: the engine compiles `SamplingParams.constraint`."""
    kw.setdefault("max_new_tokens", 120)
    return SamplingParams(constraint=spec, **kw)


# ---- specs and their errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(("spec", "field"), [
    ({"json_schema": "{not json"}, "json_schema: not valid JSON"),
    ({"json_schema": {"type": "array", "uniqueItems": True}}, "json_schema: unsupported keyword 'uniqueItems'"),
    ({"json_schema": {"type": "object", "properties": {"tags": {"type": "array", "items": {"not": {}}}}}},
     "json_schema.properties.tags.items: unsupported keyword 'not'"),
    ({"json_schema": {"anyOf": [{"type": "integer", "nullable": True}]}},
     "json_schema.anyOf[0]: unsupported keyword 'nullable'"),
    ({"json_schema": {"type": "strin"}}, "json_schema: "),
    ({"json_schema": {"type": "string", "pattern": "(a"}}, "json_schema: "),
    ({"json_schema": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}, "json_schema: "),
    ({"json_schema": {"type": "string", "minLength": 5, "maxLength": 2}}, "json_schema: "),
    ({"json_schema": [1]}, "json_schema: must be a JSON object"),
    ({"json_object": "yes"}, "json_object: "),
    ({"regex": "[a-"}, "regex: "),
    ({"regex": r"(a)\1"}, "regex: "),
    ({"grammar": 'root ::= "x" ['}, "grammar: "),
    ({"grammar": 'start: "a" ('}, "grammar: "),
    ({"choices": []}, "choices: "),
    ({"choices": ["a", 1]}, "choices: "),
    ({"regex": "a", "choices": ["a"]}, "choices: give exactly one"),
    ({}, "constraint: give exactly one"),
    ({"rgx": "a"}, "rgx: not a constraint field"),
    ({"regex": "a", "whitespace": "flexible"}, "whitespace: "),
    ({"json_object": True, "whitespace": "wide"}, "whitespace: "),
])
def test_a_bad_spec_is_a_value_error_naming_its_field(engine, spec, field):
    with pytest.raises(ValueError) as err:
        processor_from_request(spec, engine)
    assert str(err.value).startswith(field), str(err.value)


def test_stop_token_ids_outside_the_vocabulary_are_refused(engine):
    with pytest.raises(ValueError, match="^stop_token_ids: "):
        processor_from_request({"regex": "a"}, engine, stop_token_ids=[10**6])


def test_annotations_and_extension_keys_are_not_reported(engine):
    schema = {"title": "T", "description": "d", "$schema": "https://json-schema.org/draft/2020-12/schema",
              "x-order": 1, "type": "object", "properties": {"a": {"type": "integer", "examples": [1], "default": 2}}}
    processor_from_request({"json_schema": schema}, engine)


def test_a_schema_string_and_its_object_are_one_cache_entry(engine):
    schema = {"type": "object", "properties": {"q": {"type": "integer"}}, "required": ["q"]}
    a = processor_from_request({"json_schema": schema}, engine)
    hits = CACHE.hits
    b = processor_from_request({"json_schema": json.dumps(schema, indent=2)}, engine)
    assert b.compiled is a.compiled and CACHE.hits == hits + 1
    c = processor_from_request({"json_schema": schema, "whitespace": "flexible"}, engine)
    assert c.compiled is not a.compiled


def test_the_cache_is_bounded_by_entries_and_bytes(engine):
    vocab = CACHE.vocabulary(engine.tokenizer, engine.model_config.vocab_size, tuple(sorted(engine.eos_ids)))
    cache = GrammarCache(max_entries=2)
    first = cache.compile(Constraint.from_spec({"regex": "a"}), vocab)
    cache.compile(Constraint.from_spec({"regex": "b"}), vocab)
    cache.compile(Constraint.from_spec({"regex": "a"}), vocab)  # a becomes the most recent
    cache.compile(Constraint.from_spec({"regex": "c"}), vocab)  # evicts b
    assert len(cache) == 2 and cache.compile(Constraint.from_spec({"regex": "a"}), vocab) is first
    assert cache.misses == 3 and cache.hits == 2
    small = GrammarCache(max_bytes=1)  # every grammar is bigger: only the newest stays
    for r in ("a", "b", "c"):
        small.compile(Constraint.from_spec({"regex": r}), vocab)
    assert len(small) == 1 and small.nbytes > 0


# ---- masks ------------------------------------------------------------------------------------------------


def _open(logits: torch.Tensor) -> set[int]:
    return set(torch.nonzero(logits != float("-inf")).flatten().tolist())


def test_eos_is_allowed_exactly_when_the_grammar_can_end(engine):
    tok, (eos,) = engine.tokenizer, engine.eos_ids
    seq = processor_from_request({"choices": ["ab", "abc"]}, engine).fork()
    out: list[int] = []
    for piece, can_end in (("", False), ("a", False), ("b", True), ("c", True)):
        if piece:
            (t,) = tok.encode(piece)
            seq.accept(t)
            out.append(t)
        logits = torch.zeros(engine.model_config.vocab_size)
        seq([1], out, logits)
        assert (eos in _open(logits)) == can_end, piece
    assert _open(logits) == {eos}  # "abc" is complete and nothing extends it


def test_a_requests_stop_tokens_follow_eos(engine):
    tok, (eos,) = engine.tokenizer, engine.eos_ids
    (x,) = tok.encode("x")
    seq = processor_from_request({"choices": ["ab", "abx"]}, engine, stop_token_ids=[x, 0]).fork()
    size = engine.model_config.vocab_size
    logits = torch.zeros(size)
    seq([1], [], logits)
    assert not {x, 0, eos} & _open(logits)  # nothing can end yet, and x is not an allowed start
    out = tok.encode("ab")
    for t in out:
        seq.accept(t)
    logits = torch.zeros(size)
    seq([1], out, logits)
    assert {x, 0, eos} <= _open(logits)  # "ab" is complete: EOS and both stop tokens may end it


def test_one_bitmask_call_masks_only_its_rows(engine):
    size = engine.model_config.vocab_size
    a = processor_from_request({"regex": "[0-9]+"}, engine).fork()
    b = processor_from_request({"json_object": True}, engine).fork()
    logits = torch.randn(4, size, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    type(a).apply_batch([a, b], [[1], [1]], [[], []], logits, [1, 3])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    for proc, row in ((processor_from_request({"regex": "[0-9]+"}, engine).fork(), 1),
                      (processor_from_request({"json_object": True}, engine).fork(), 3)):
        alone = before[row].clone()
        proc([1], [], alone)
        assert torch.equal(alone, logits[row])
    digits, braces = _open(logits[1]), _open(logits[3])
    assert digits and all(engine.tokenizer.decode([t]).isdigit() for t in digits)
    assert braces and all(engine.tokenizer.decode([t]).startswith("{") for t in braces)


def test_a_fork_that_missed_tokens_replays_the_output(engine):
    tok, (eos,) = engine.tokenizer, engine.eos_ids
    seq = processor_from_request({"choices": ["hello"]}, engine).fork()
    out = tok.encode("hello")
    logits = torch.zeros(engine.model_config.vocab_size)
    seq([1], out, logits)  # nothing was accepted, yet the output is complete
    assert _open(logits) == {eos}


def test_the_prototype_itself_is_not_a_sequence_state(engine):
    proto = processor_from_request({"regex": "a"}, engine)
    with pytest.raises(RuntimeError, match="fork"):
        proto([1], [], torch.zeros(engine.model_config.vocab_size))


# ---- through the engine -----------------------------------------------------------------------------------


def test_a_constraint_that_allows_every_string_changes_nothing(engine):
    """`(?s:.*)` allows every text, so greedy decoding is unchanged wherever the free output is text.

    A model of noise often emits byte-level tokens that split a UTF-8 character and never finish it; such
    an output is not a string, so those prompts only check that the constrained output is valid UTF-8."""
    prompts = PROMPTS + ["The", "a", "{", "x y", "Once upon", "42"]
    plain = SamplingParams(max_new_tokens=24)
    free = engine.generate(prompts, plain)
    allowed = engine.generate(prompts, constrained({"regex": "(?s:.*)"}, max_new_tokens=24))
    vocab = CACHE.vocabulary(engine.tokenizer, engine.model_config.vocab_size, tuple(sorted(engine.eos_ids)))

    def is_text(ids: list[int]) -> bool:
        try:
            vocab.tokenizer.decode_bytes([t for t in ids if t not in engine.eos_ids]).decode("utf-8")
            return True
        except UnicodeDecodeError:
            return False

    texts = [i for i, o in enumerate(free) if is_text(o.token_ids)]
    assert len(texts) >= 2, "precondition: at least two free outputs are text"
    assert [allowed[i].token_ids for i in texts] == [free[i].token_ids for i in texts]
    assert [allowed[i].finish_reason for i in texts] == [free[i].finish_reason for i in texts]
    assert all(is_text(o.token_ids) for o in allowed)


def test_unconstrained_rows_of_a_mixed_batch_equal_their_solo_runs(engine):
    greedy = SamplingParams(max_new_tokens=20)
    seeded = SamplingParams(max_new_tokens=20, temperature=1.0, seed=11)
    solo_greedy = engine.generate(PROMPTS[0], greedy)[0].token_ids
    solo_seeded = engine.generate(PROMPTS[1], seeded)[0].token_ids
    json_params = constrained({"json_schema": TEST_SCHEMAS["3 fields"]}, temperature=1.0, seed=3)
    regex_params = constrained({"regex": "[a-z]{3,8}"})
    outs = engine.generate([PROMPTS[2], PROMPTS[0], PROMPTS[3], PROMPTS[1]],
                           [json_params, greedy, regex_params, seeded])
    assert outs[1].token_ids == solo_greedy and outs[3].token_ids == solo_seeded
    jsonschema.validate(json.loads(outs[0].text), TEST_SCHEMAS["3 fields"])
    assert re.fullmatch("[a-z]{3,8}", outs[2].text)


@pytest.mark.parametrize("name", list(TEST_SCHEMAS))
def test_random_weights_finish_every_test_schema_within_120_tokens(engine, name):
    schema = TEST_SCHEMAS[name]
    params = [constrained({"json_schema": schema}, temperature=1.0, seed=s) for s in range(4)]
    outs = engine.generate(PROMPTS, params)
    for out in outs:
        assert out.finish_reason == "stop" and len(out.token_ids) <= 120, (out.finish_reason, out.text)
        jsonschema.validate(json.loads(out.text), schema)


def test_any_json_object(engine):
    outs = engine.generate(PROMPTS, [constrained({"json_object": True}, temperature=1.0, seed=s,
                                                 max_new_tokens=60) for s in range(4)])
    done = [o for o in outs if o.finish_reason == "stop"]
    for out in done:
        assert isinstance(json.loads(out.text), dict)
    assert all(o.text.startswith("{") for o in outs)


def test_flexible_whitespace_accepts_pretty_json_and_lets_a_weak_model_wander(engine):
    schema = TEST_SCHEMAS["nested objects"]
    value = {"a": {"b": {"c": True}}}
    (eos,) = engine.eos_ids
    for whitespace, text, ok in (("flexible", json.dumps(value, indent=2), True),
                                 ("compact", json.dumps(value, indent=2), False),
                                 ("compact", json.dumps(value, separators=(",", ":")), True)):
        seq = processor_from_request({"json_schema": schema, "whitespace": whitespace}, engine).fork()
        ids = engine.tokenizer.encode(text)
        accepted = all(seq.matcher.consume_token(t) for t in ids)  # the matcher alone: no error raised
        assert accepted == ok, (whitespace, text)
        if ok:
            seq.consumed = len(ids)
            logits = torch.zeros(engine.model_config.vocab_size)
            seq([1], ids, logits)
            assert eos in _open(logits)
    # noise under flexible whitespace keeps emitting whitespace where compact output has long finished
    outs = engine.generate(PROMPTS, [constrained({"json_schema": schema, "whitespace": "flexible"},
                                                 temperature=1.0, seed=s) for s in range(4)])
    assert all(re.search(r"\s", o.text) for o in outs)
    for out in outs:
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), schema)


@pytest.mark.parametrize(("grammar", "check"), [
    ('root ::= expr\nexpr ::= term ("+" term)*\nterm ::= [0-9] | "(" expr ")"', "arith"),
    ('start: expr\nexpr: term ("+" term)*\nterm: /[0-9]/ | "(" expr ")"', "arith"),
])
def test_grammars_in_gbnf_and_lark(engine, grammar, check):
    outs = engine.generate(PROMPTS, [constrained({"grammar": grammar}, temperature=1.0, seed=s)
                                     for s in range(4)])
    done = [o for o in outs if o.finish_reason == "stop"]
    assert done
    assert all(is_arith(o.text) for o in done), [o.text for o in done]


@pytest.mark.parametrize(("grammar", "text", "ok"), [
    (r'root ::= "a" [\U00010000-\U0010FFFF]', "a\U0001F600", True),
    (r'root ::= "a" [\U00010000-\U0010FFFF]', "ab", False),
    (r'root ::= "\U0010FFFF"', "\U0010FFFF", True),
    (r'root ::= "\u00e9\U0001F600"', "\u00e9\U0001F600", True),
    (r'root ::= [\u005D\u002D]+', "]-]", True),           # `]` and `-` keep their escaped meaning
    (r'root ::= [\u005D\u002D]+', "a", False),
    (r'root ::= [^\u005D]', "]", False),
    (r'root ::= "\u0022\u005C"', '"\\', True),           # a quote and a backslash inside a string literal
    (r'root ::= "\\U0010FFFF"', "\\U0010FFFF", True),     # an escaped backslash: the text itself
    ('root ::= "x" # \\U0010FFFF, "\\u12" in a comment\n', "x", True),
])
def test_gbnf_unicode_escapes_mean_their_characters(engine, grammar, text, ok):
    """llama.cpp's `\\uXXXX` / `\\UXXXXXXXX`: llguidance's GBNF translation dropped their leading zeros
    (`\\U10FFFF`), which its lexers refused, so every grammar with one was a 400."""
    seq = processor_from_request({"grammar": grammar}, engine).fork()
    ids = engine.tokenizer.encode(text)
    assert (all(seq.matcher.consume_token(t) for t in ids) and seq.matcher.is_accepting()) == ok


@pytest.mark.parametrize(("grammar", "needle"), [
    (r'root ::= "\uD800"', r"grammar: \\uD800 is a UTF-16 surrogate"),
    (r'root ::= [\U00110000]', r"grammar: \\U00110000 is past U\+10FFFF"),
])
def test_a_gbnf_escape_that_is_no_character_is_refused_by_name(engine, grammar, needle):
    with pytest.raises(ValueError, match=needle):
        processor_from_request({"grammar": grammar}, engine)


def test_max_new_tokens_cuts_a_prefix_with_finish_reason_length(engine):
    spec = {"json_schema": TEST_SCHEMAS["3 fields"]}
    (out,) = engine.generate(PROMPTS[0], constrained(spec, max_new_tokens=5))
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)
    replay = processor_from_request(spec, engine).fork()
    for t in out.token_ids:
        replay.accept(t)  # every token was one the grammar allowed: the output is a prefix


def test_preemption_mid_generation_still_yields_valid_outputs(tiny_smollm2):
    small = Engine(EngineConfig(model=str(tiny_smollm2), num_threads=1, block_size=4, num_blocks=32,
                                max_num_batched_tokens=64))
    schema = TEST_SCHEMAS["types"]
    params = [constrained({"json_schema": schema}, temperature=1.0, seed=s) for s in range(8)]
    outs = small.generate([f"{p} {i}" for i, p in enumerate(PROMPTS * 2)], params)
    assert small.stats()["preemptions"] > 0
    for out in outs:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), schema)
    alone = Engine(EngineConfig(model=str(tiny_smollm2), num_threads=1))
    again = alone.generate([f"{p} {i}" for i, p in enumerate(PROMPTS * 2)], params)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]  # preemption changed no token


def test_an_engine_loop_serves_constrained_requests_compiled_on_many_threads(tiny_smollm2):
    """The server path: request threads validate and compile `SamplingParams.constraint` (in `submit`, into
    the shared cache; the served engine's vocabulary is its own, so every schema compiles there afresh)
    while the loop thread forks and masks; every answer validates and equals the same request run alone."""
    import threading

    from generation import EngineLoop

    alone = Engine(EngineConfig(model=str(tiny_smollm2), num_threads=1))
    names = list(TEST_SCHEMAS)
    jobs = [(PROMPTS[i % len(PROMPTS)], names[i % len(names)], i) for i in range(12)]

    def params(name, seed):
        return constrained({"json_schema": TEST_SCHEMAS[name]}, temperature=1.0, seed=seed)

    expected = [alone.generate(p, params(n, s))[0].token_ids for p, n, s in jobs]
    served = Engine(EngineConfig(model=str(tiny_smollm2), num_threads=1))
    results: dict[int, object] = {}
    with EngineLoop(served) as loop:
        def client(k: int) -> None:
            for j in range(k, len(jobs), 4):
                prompt, name, seed = jobs[j]
                results[j] = loop.submit(prompt, params(name, seed)).result(timeout=300)

        threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for j, (_, name, _) in enumerate(jobs):
        out = results[j]
        assert out.finish_reason == "stop" and out.token_ids == expected[j]
        jsonschema.validate(json.loads(out.text), TEST_SCHEMAS[name])


class _Force(LogitsProcessor):
    """Writes the given token ids, then EOS."""

    def __init__(self, ids: list[int], eos: int):
        self.ids, self.eos = ids, eos

    def __call__(self, prompt_ids, output_ids, logits) -> None:
        logits.fill_(float("-inf"))
        logits[self.ids[len(output_ids)] if len(output_ids) < len(self.ids) else self.eos] = 0.0


def test_a_stop_string_inside_a_long_token_is_found_where_it_begins(engine):
    """SmolLM2 has tokens of 80 characters (runs of '#', a newline and spaces): a stop string early in one must
    be cut where it begins, however much text the token adds after it."""
    tok = engine.tokenizer
    hashes = tok.encode("#" * 80)
    assert len(hashes) == 1  # one token
    ids = tok.encode("Hello") + hashes + tok.encode(" world")
    eos = next(iter(engine.eos_ids))
    out = engine.generate(["Hi"], SamplingParams(max_new_tokens=10, stop=["###"],
                                                 logits_processors=[_Force(ids, eos)]))[0]
    assert out.finish_reason == "stop" and out.matched_stop == "###" and out.text == "Hello"
