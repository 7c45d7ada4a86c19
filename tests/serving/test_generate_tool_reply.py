"""The reader of a `tool_choice: "auto"` answer (`serving/generate/tool_reply.py`): which branch the model took, the
reply decoded as it comes (escapes and surrogate pairs split across pieces held back until whole), the calls as
`"required"` reads them; its news does not depend on where the text was cut (a stream's tokens or one whole
answer), and a cut answer reads as the whole one does."""

from __future__ import annotations

import json

import pytest

from serving.generate.call_list import Arguments, Begin, CallList, End
from serving.generate.tool_reply import CALLS, REPLY, AutoAnswer, JsonString, Reply, read

REPLIES = [  # {"response": ...} as the model may write them, with every escape JSON has
    '{"response":"Hello there"}',
    '{"response":""}',
    '{"response":"line\\nbreak \\"quoted\\" back\\\\slash \\/ \\b\\f\\r\\t end"}',
    '{"response":"caf\\u00e9 \\u00C9t\\u00e9 \\ud83d\\ude00 \\uD83C\\uDF0A sea"}',
    '{"response":"raw é 😀 and \\u4e2d"}',
    '{"response":"\\\\u0041 is no escape, \\\\\\" is a quote"}',
]
CALL_LISTS = [
    '{"tool_calls":[{"name":"get_time","parameters":{"zone":"UTC"}}]}',
    '{"tool_calls":[{"name":"w","parameters":{"city":"a}\\"]{,:\\\\","n":[1]}},{"name":"t","parameters":{}}]}',
]


def streamed(pieces: list[str]) -> tuple[AutoAnswer, str, list[object]]:
    """The reader after the pieces, the reply as a stream adds it up, and the other events in order (each call's
    arguments joined into one)."""
    answer, reply, events = AutoAnswer(), "", []
    for piece in pieces:
        for e in answer.feed(piece):
            if isinstance(e, Reply):
                reply += e.text
            elif isinstance(e, Arguments) and events and isinstance(events[-1], Arguments) \
                    and events[-1].index == e.index:
                events[-1] = Arguments(e.index, events[-1].text + e.text)
            else:
                events.append(e)
    return answer, reply, events


def every_split(text: str) -> list[list[str]]:
    """The text as one piece, character by character, and cut in two and in three at every place."""
    out = [[text], list(text)]
    out += [[text[:a], text[a:]] for a in range(1, len(text))]
    out += [[text[:a], text[a:b], text[b:]] for a in range(1, len(text), 3) for b in range(a + 1, len(text), 2)]
    return out


@pytest.mark.parametrize("text", REPLIES)
def test_a_reply_decodes_as_json_does_however_it_is_cut(text):
    expected = json.loads(text)["response"]
    for pieces in every_split(text):
        answer, reply, events = streamed(pieces)
        assert (answer.kind, reply, events) == (REPLY, expected, []), pieces
        assert answer.content == expected and answer.calls is None


@pytest.mark.parametrize("text", CALL_LISTS)
def test_calls_read_as_a_required_list_does_however_they_are_cut(text):
    reference = CallList().feed(text[len('{"tool_calls":'):])
    for pieces in every_split(text):
        answer, reply, events = streamed(pieces)
        assert (answer.kind, reply, events) == (CALLS, "", reference), pieces
    calls = read(text).calls
    assert [(c.name, json.loads(c.arguments)) for c in calls] == \
        [(c["name"], c["parameters"]) for c in json.loads(text)["tool_calls"]]
    assert all(c.arguments in text for c in calls)  # as written, not re-serialised


def test_nothing_is_news_until_the_first_key_has_shown():
    answer = AutoAnswer()
    assert [answer.feed(p) for p in ('{"', "tool", "_calls", '":')] == [[], [], [], []]
    assert answer.kind == CALLS and answer.feed('[{"name":"x"') == [Begin(0, "x")]
    answer = AutoAnswer()
    assert [answer.feed(p) for p in ('{"', "response", '":"')] == [[], [], [Reply("")]]  # the branch, no text yet
    assert answer.feed("Hi") == [Reply("Hi")] and answer.feed('"}') == []


@pytest.mark.parametrize("text, content", [
    ('{"response":"ab\\u00', "ab"),  # a half escape at the cut is dropped, not shown as written
    ('{"response":"ab\\', "ab"),
    ('{"response":"a\\ud83d', "a"),  # half of a character: its low surrogate did not come
    ('{"response":"a\\ud83d\\ude', "a"),
    ('{"response":"a\\ud83d\\', "a"),
    ('{"response":"tw\\u00e9', "tw\u00e9"),
    ('{"response":"done"', "done"),  # closed, with its object still open
    ('{"tool_calls":[{"name":"get_time","parameters":{"zo', '{"tool_calls":[{"name":"get_time","parameters":{"zo'),
    ('{"tool_calls":[{"name":"get_time","parameters":{}}]', '{"tool_calls":[{"name":"get_time","parameters":{}}]'),
    ('{"respo', '{"respo'),  # no branch yet: the text as written, as a cut list gives it
    ('', ''),
])
def test_a_cut_answer_reads_as_its_stream_adds_up(text, content):
    answer = read(text)
    assert answer.calls is None and answer.content == content
    for pieces in every_split(text) if text else [[]]:
        _, reply, _ = streamed(pieces)
        assert reply == (content if answer.kind == REPLY else "")


@pytest.mark.parametrize("escaped, decoded", [
    ("\\ud83d x", "\ufffd x"),  # a high half with no low one after it
    ("\\ude00", "\ufffd"),  # a low half alone
    ("\\ud83d\\u0041", "\ufffdA"),  # a high half, then an escape that is not its pair
    ("\\ud83d\\ud83d\\ude00", "\ufffd\U0001F600"),
])
def test_an_unpaired_surrogate_becomes_the_replacement_character(escaped, decoded):
    """JSON allows one and `json.loads` keeps it, but UTF-8, which the server writes, has no form for it."""
    text = '{"response":"' + escaped + '"}'
    for pieces in every_split(text):
        assert streamed(pieces)[1] == decoded, pieces


def test_a_string_stops_at_its_closing_quote():
    string = JsonString()
    assert string.feed('a\\"b"}') == 'a"b' and string.closed and string.feed("more") == ""


def test_a_list_the_answer_closes_is_calls_and_end_events_come_as_each_call_closes():
    _, _, events = streamed([CALL_LISTS[1]])
    assert [e for e in events if not isinstance(e, Arguments)] == [Begin(0, "w"), End(0), Begin(1, "t"), End(1)]
