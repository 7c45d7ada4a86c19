"""The answer under `tool_choice: "auto"`, read as it is generated: which branch the model took, and that branch's news.

The constraint (`tools.py`, `ToolCalling.constraint`) holds the output to exactly one of two JSON objects, written
compactly: `{"tool_calls":[<call>,...]}` or `{"response":"<text>"}`. So the first key tells the branch, and what
follows it has a fixed start: a list of calls, read by `call_list.py` as a `"required"` list is, or one JSON
string, whose text a client wants decoded (`\\n` a newline, `\\u00e9` an é), not as the model wrote it.

One reader serves a stream and the whole answer alike (the whole text is one feed), so they cannot disagree: the
reply's deltas add up to the whole answer's content, and the calls' fragments to its arguments.

Why a string decoder of our own: `json` decodes whole documents only, and a stream must send each piece of the
reply as its token comes, holding back just an escape that is not complete yet (`\\u00` waits for its last two
digits, a high surrogate for the low half that may follow it). None of the installed libraries decodes a JSON
string incrementally. An unpaired surrogate (JSON allows one; `json.loads` keeps it) becomes U+FFFD here, as the
server's bytes are UTF-8, which has no form for it; a reply cut short (`max_tokens`) ends before a half escape.
(llguidance, today, lets the model write `\\uXXXX` only for control characters and every other character as it
is, so surrogate escapes do not come from the constraint; the decoder reads all of JSON's escapes all the same.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from serving.generate.call_list import Arguments, Begin, Call, CallList, End

CALLS_HEAD = '{"tool_calls":'  # what the model writes before its list of calls
REPLY_HEAD = '{"response":"'  # ... before the text of its reply
CALLS, REPLY = "calls", "reply"
ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
HEX = frozenset("0123456789abcdefABCDEF")
REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class Reply:
    """More of the reply's text, decoded. The first one comes as the branch shows, possibly empty."""

    text: str


Event = Reply | Begin | Arguments | End


@dataclass
class JsonString:
    """The inside of one JSON string, fed in pieces after its opening quote: each `feed` returns the text now
    certain; `closed` once the closing quote has come (what follows it is not read)."""

    closed: bool = False
    _held: str = ""  # the start of an escape not complete yet, from its backslash on

    def feed(self, text: str) -> str:
        s, out, i = self._held + text, [], 0
        while i < len(s) and not self.closed:
            c = s[i]
            if c == '"':
                self.closed = True
                i += 1
            elif c != "\\":
                out.append(c)
                i += 1
            else:
                step = _escape(s, i)
                if step is None:  # the rest is an escape's start: wait for more
                    break
                decoded, i = step
                out.append(decoded)
        self._held = "" if self.closed else s[i:]
        return "".join(out)


def _escape(s: str, i: int) -> tuple[str, int] | None:
    """The escape at `s[i]` (a backslash): its text and where the next character starts, None if `s` ends first."""
    if i + 1 >= len(s):
        return None
    kind = s[i + 1]
    if kind != "u":
        return ESCAPES.get(kind, "\\" + kind), i + 2
    code = _code_unit(s, i)
    if code is None:
        return None
    if code < 0 or 0xDC00 <= code <= 0xDFFF:  # not hex (no constraint writes it), or a low half with no high one
        return (s[i:i + 6] if code < 0 else REPLACEMENT), i + 6
    if code < 0xD800 or code > 0xDBFF:
        return chr(code), i + 6
    low = _code_unit(s, i + 6)  # a high half: a pair if a low half's escape follows at once
    if low is None:  # what follows may still become one
        return None
    if 0xDC00 <= low <= 0xDFFF:
        return chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)), i + 12
    return REPLACEMENT, i + 6


def _code_unit(s: str, i: int) -> int | None:
    """The code unit of the `\\uXXXX` at `s[i]`: None if `s` ends first, -1 if it is not a `\\u` escape of hex."""
    head, digits = s[i:i + 2], s[i + 2:i + 6]
    if head != "\\u"[:len(head)] or not all(h in HEX for h in digits):
        return -1
    return int(digits, 16) if len(digits) == 4 else None


@dataclass
class AutoAnswer:
    """Feed the output's text in pieces of any size; each `feed` returns what the piece showed: nothing until the
    first key is written, then `Reply` text, or the list's `Begin`/`Arguments`/`End` events."""

    text: str = ""  # everything fed, as written
    kind: str | None = None  # CALLS or REPLY once the first key shows
    reply: str = ""  # the reply's text so far, decoded
    _list: CallList = field(default_factory=CallList)
    _string: JsonString = field(default_factory=JsonString)

    def feed(self, text: str) -> list[Event]:
        self.text += text
        if self.kind is None:
            for kind, head in ((CALLS, CALLS_HEAD), (REPLY, REPLY_HEAD)):
                if self.text.startswith(head):
                    self.kind = kind
                    return self._read(self.text[len(head):], first=True)
            return []
        return self._read(text)

    def _read(self, text: str, first: bool = False) -> list[Event]:
        if self.kind == CALLS:
            return self._list.feed(text)
        decoded = self._string.feed(text)
        self.reply += decoded
        return [Reply(decoded)] if decoded or first else []

    @property
    def calls(self) -> list[Call] | None:
        """The calls, once the whole answer is a list of them that parses; None otherwise (a reply, a cut list)."""
        if self.kind != CALLS:
            return None
        try:
            json.loads(self.text)
        except json.JSONDecodeError:
            return None
        return self._list.calls

    @property
    def content(self) -> str:
        """The answer as text, where it is no calls: a reply's text (as far as it got), else what was written (a
        list cut short, or an answer cut before its first key), as a cut `"required"` list gives it."""
        return self.reply if self.kind == REPLY else self.text


def read(text: str) -> AutoAnswer:
    """A whole answer, read as a stream of it would be."""
    answer = AutoAnswer()
    answer.feed(text)
    return answer
