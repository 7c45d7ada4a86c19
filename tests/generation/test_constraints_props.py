"""Property tests: constraints drawn by hypothesis, sampled at temperature 1 from a model of noise.

Whatever hypothesis draws, every output that completes must parse and validate with `jsonschema` (for
schemas), `fullmatch` (for regexes) or be one of the choices. Each test also counts how many outputs
completed and fails if too few did, so it cannot pass by cutting everything at `max_new_tokens`."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from generation import Engine, EngineConfig, SamplingParams
from tests.generation.test_constraints import PROMPTS, tiny_smollm2  # noqa: F401  (the fixture)

SETTINGS = settings(max_examples=20, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
SEEDS = 3

# ---- JSON schemas in the supported subset -----------------------------------------------------------------

short_text = st.text(st.characters(min_codepoint=32, max_codepoint=0x2FF, exclude_characters='"\\'), max_size=6)
scalars = st.one_of(st.integers(-1000, 1000), short_text, st.booleans(), st.none())
strings = st.one_of(
    st.tuples(st.integers(0, 3), st.integers(0, 8)).map(lambda t: {"type": "string", "minLength": t[0],
                                                                   "maxLength": t[0] + t[1]}),
    st.sampled_from(["^[a-z]{1,4}$", "^[A-Z][0-9]{2}$", "^(yes|no)$", "^[0-9]{4}-[0-9]{2}$"]).map(
        lambda p: {"type": "string", "pattern": p}),
)
integers = st.one_of(
    st.just({"type": "integer"}),
    st.tuples(st.integers(-500, 500), st.integers(0, 2000)).map(lambda t: {"type": "integer", "minimum": t[0],
                                                                          "maximum": t[0] + t[1]}),
)
leaves = st.one_of(
    strings, integers, st.just({"type": "number"}), st.just({"type": "boolean"}), st.just({"type": "null"}),
    st.lists(scalars, min_size=1, max_size=4, unique_by=json.dumps).map(lambda v: {"enum": v}),
    scalars.map(lambda v: {"const": v}),
)
names = st.sampled_from(["a", "b", "id", "name", "x_y", "Ünï"])


@st.composite
def objects(draw, children):
    props = draw(st.dictionaries(names, children, min_size=1, max_size=3))
    schema = {"type": "object", "properties": props,
              "required": draw(st.lists(st.sampled_from(sorted(props)), unique=True))}
    if draw(st.integers(0, 4)):  # mostly closed: an open object lets noise invent keys forever
        schema["additionalProperties"] = False
    return schema


@st.composite
def arrays(draw, children):
    low = draw(st.integers(0, 2))
    return {"type": "array", "items": draw(children), "minItems": low, "maxItems": low + draw(st.integers(0, 2))}


json_schemas = st.recursive(
    leaves, lambda kids: st.one_of(objects(kids), arrays(kids), st.lists(kids, min_size=2, max_size=3).map(
        lambda xs: {"anyOf": xs})), max_leaves=6)

# ---- regexes whose meaning Python's `re` and llguidance's (Rust) syntax agree on --------------------------

atoms = st.one_of(st.sampled_from(["[a-z]", "[0-9]", "[A-Z]", "[ab]", r"\.", "-", "x", " ", "é"]),
                  st.lists(st.sampled_from(["cat", "dog", "a1", "Zz"]), min_size=2, max_size=3, unique=True).map(
                      lambda xs: "(" + "|".join(xs) + ")"))
quantifiers = st.sampled_from(["", "", "?", "{2}", "{1,3}", "{0,2}", "+"])
regexes = st.lists(st.tuples(atoms, quantifiers).map("".join), min_size=1, max_size=5).map("".join)
choices = st.lists(st.text(st.characters(min_codepoint=32, max_codepoint=0x24F), min_size=1, max_size=8),
                   min_size=1, max_size=5, unique=True)


@pytest.fixture(scope="module")
def engine(tiny_smollm2):  # noqa: F811
    return Engine(EngineConfig(model=str(tiny_smollm2), num_threads=1))


def _sample(engine: Engine, spec: dict, seed: int, max_new_tokens: int = 120):
    params = [SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, seed=seed * SEEDS + i, constraint=spec)
              for i in range(SEEDS)]
    outs = engine.generate(PROMPTS[:SEEDS], params)
    assert all(o.finish_reason in ("stop", "length") for o in outs), [o.error for o in outs]
    return [o for o in outs if o.finish_reason == "stop"]


def _holds_for_every_draw(engine: Engine, draws, spec, holds, min_completed: float) -> None:
    """`holds(value, text)` for every completed output of every drawn value; at least `min_completed` of
    all outputs must have completed."""
    completed = []

    @SETTINGS
    @given(value=draws, seed=st.integers(0, 2**16))
    def check(value, seed):
        for out in _sample(engine, spec(value), seed):
            holds(value, out.text)
            completed.append(out)

    check()
    total = SETTINGS.max_examples * SEEDS
    assert len(completed) >= min_completed * total, f"only {len(completed)} of {total} outputs completed"


def test_every_completed_output_validates_against_its_drawn_schema(engine):
    def holds(schema, text):
        jsonschema.validate(json.loads(text), schema)

    _holds_for_every_draw(engine, json_schemas, lambda schema: {"json_schema": schema}, holds, 0.5)


def test_every_completed_output_fullmatches_its_drawn_regex(engine):
    def holds(regex, text):
        assert re.fullmatch(regex, text), (regex, text)

    _holds_for_every_draw(engine, regexes, lambda regex: {"regex": regex}, holds, 0.5)


def test_every_output_is_one_of_its_drawn_choices(engine):
    def holds(options, text):
        assert text in options, (options, text)

    _holds_for_every_draw(engine, choices, lambda options: {"choices": options}, holds, 0.9)
