"""The scanner that reads a `"required"` list of calls as it is generated (`serving/generate/call_list.py`): its
news does not depend on where the text was cut into pieces (a stream's tokens or one whole answer), each call's
arguments are its `parameters` value exactly as written, and brackets, quotes and escapes inside strings do not
fool it."""

from __future__ import annotations

import json
import random

import pytest

from serving.generate.call_list import Arguments, Begin, CallList, End

TEXTS = [
    '[{"name":"get_time","parameters":{"zone":"UTC"}}]',
    '[{"name":"w","parameters":{"city":"a}\\"]{,:\\\\","n":[1,{"x":[]}],"t":true}},{"name":"t","parameters":{}}]',
    '[ {"name" : "w" , "parameters" : { "a" : [ 1 , 2 ] } } ,\n {"name":"t","parameters":{"zone":"é😀"}} ]',
    '[{"name":"w","parameters":{"city":"Par',  # cut by max_tokens
    '[{"name":"get_ti',
]


def read(pieces: list[str]) -> tuple[list[object], dict[int, list[str]]]:
    """The events but the argument fragments, and each call's name and arguments as a stream adds them up."""
    scanner, events, calls = CallList(), [], {}
    for piece in pieces:
        for e in scanner.feed(piece):
            if isinstance(e, Begin):
                assert e.index == len(calls)
                calls[e.index] = [e.name, ""]
            elif isinstance(e, Arguments):
                calls[e.index][1] += e.text
            if not isinstance(e, Arguments):
                events.append(e)
    return events, calls


@pytest.mark.parametrize("text", TEXTS)
def test_the_news_is_the_same_however_the_text_is_cut(text):
    events, calls = read([text])
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(12, len(text) - 1))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert read(pieces) == (events, calls)
    assert read(list(text)) == (events, calls)


@pytest.mark.parametrize("text", [t for t in TEXTS if t.endswith("]")])
def test_each_calls_arguments_are_its_parameters_as_written(text):
    events, calls = read([text])
    listed = json.loads(text)
    assert [name for name, _ in calls.values()] == [c["name"] for c in listed]
    for (_, arguments), call in zip(calls.values(), listed):
        assert json.loads(arguments) == call["parameters"] and arguments.startswith("{") and arguments.endswith("}")
        assert arguments in text
    assert events == [x for k in range(len(listed)) for x in (Begin(k, listed[k]["name"]), End(k))]


def test_a_cut_list_names_what_it_has_and_leaves_its_last_call_open():
    events, calls = read([TEXTS[3]])
    assert events == [Begin(0, "w")] and calls == {0: ["w", '{"city":"Par']}
    assert read([TEXTS[4]]) == ([], {})  # the name has not closed: nothing to send yet


def test_arguments_written_before_the_name_wait_for_it():
    """Not the constraint's order (it writes name first), but no fragment goes out without its call's name."""
    scanner = CallList()
    assert scanner.feed('[{"parameters":{"a":') == []
    assert scanner.feed('1},"name":"x"}]') == [Begin(0, "x"), Arguments(0, '{"a":1}'), End(0)]
