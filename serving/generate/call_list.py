"""The list of calls that `tool_choice: "required"` holds the output to, read as it is generated.

The constraint (`tools.py`, `ToolCalling.constraint`) makes the output a JSON array of `{"name": ...,
"parameters": {...}}` objects, and llguidance writes an object's properties in its schema's order, compactly,
so each call's name comes before its arguments. A stream wants each call as soon as it shows: its name once
that string has closed, then its arguments as they are typed.

Why a scanner of our own rather than a JSON library: `json` reads whole texts only, and a partial-JSON parser
(vLLM's `partial-json-parser`) returns the values parsed so far, not where they stand in the text, so arguments
re-serialised from them are not the bytes the model wrote, and the diff of two re-serialisations can take back
what an earlier one sent. All a stream needs is where each `parameters` value starts and ends, which string
and escape state and bracket depth tell, so this scanner copies those characters verbatim.

A call's `arguments` are thus the text of its `parameters` value exactly as generated, in the whole answer
(`ToolCalling.calls` reads it through this same scanner) and in a stream alike: a stream's fragments add up to
the answer's `arguments` byte for byte, as a forced call's do (its arguments are the text itself).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

CALL = 2  # the depth of a call object's own characters: the list is 1, a call's arguments 3 and deeper
NAME, ARGUMENTS = "name", "parameters"  # the call object's keys, in the order the constraint writes them
WHITESPACE = " \t\n\r"


@dataclass(frozen=True)
class Begin:
    """Call `index` is named: the first thing a stream sends of it."""

    index: int
    name: str


@dataclass(frozen=True)
class Arguments:
    """More of call `index`'s arguments, as generated."""

    index: int
    text: str


@dataclass(frozen=True)
class End:
    """Call `index`'s object has closed: its arguments are whole."""

    index: int


Event = Begin | Arguments | End


@dataclass
class Call:
    name: str | None = None
    arguments: str = ""
    done: bool = False


@dataclass
class CallList:
    """Feed the output's text in pieces of any size; each `feed` returns what the piece showed. The events do
    not depend on where the pieces were cut, so a stream and a whole text give the same calls."""

    calls: list[Call] = field(default_factory=list)
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False
    _key: str | None = None  # the call object's key being read or whose value is being read
    _at_value: bool = False  # past the key's colon
    _string: str = ""  # a key or a name, as written, until its string closes

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        for c in text:
            self._char(c, events)
        return _merged(events)

    def _char(self, c: str, events: list[Event]) -> None:
        level = self._depth  # where c stands: a bracket at the level of the container it opens or closes into
        string = self._in_string or c == '"'  # c is part of a string, its quotes included
        closes = False
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif c == '"':
                self._in_string, closes = False, True
        elif c == '"':
            self._in_string = True
        elif c in "[{":
            self._depth += 1
            if self._depth == CALL:
                self.calls.append(Call())
                self._key, self._at_value = None, False
        elif c in "]}":
            self._depth -= 1
            level = self._depth
            if level == CALL - 1 and c == "}" and self.calls:
                call = self.calls[-1]
                call.done = True
                if call.name is not None:
                    events.append(End(len(self.calls) - 1))
        if level < CALL:
            return
        if level == CALL and not string:
            if c == ":":
                self._at_value = True
                return
            if c == ",":
                self._key, self._at_value = None, False
                return
            if c in WHITESPACE:
                return
        index, call = len(self.calls) - 1, self.calls[-1]
        if not self._at_value or (self._key == NAME and level == CALL):  # a key, or the name: read whole
            if not string:
                return
            self._string += c
            if closes:
                value, self._string = json.loads(self._string), ""
                if not self._at_value:
                    self._key = value
                elif isinstance(value, str):
                    call.name = value
                    events.append(Begin(index, value))
                    if call.arguments:  # arguments before the name (not the constraint's order): held till now
                        events.append(Arguments(index, call.arguments))
        elif self._key == ARGUMENTS:
            call.arguments += c
            if call.name is not None:
                events.append(Arguments(index, c))


def _merged(events: list[Event]) -> list[Event]:
    """Characters of the same call's arguments in a row, as one fragment."""
    out: list[Event] = []
    for e in events:
        last = out[-1] if out else None
        if isinstance(e, Arguments) and isinstance(last, Arguments) and last.index == e.index:
            out[-1] = Arguments(e.index, last.text + e.text)
        else:
            out.append(e)
    return out
