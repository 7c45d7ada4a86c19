"""Errors a program's author can act on, each naming the line of the program that made the call.

A program runs its calls on a worker thread, so a traceback from the failure points into the
interpreter, not at the author's code. Every call therefore records where it was written (file, line
and the source line) when it is built, and every error it raises starts with that place.
"""

from __future__ import annotations

import linecache
import sys
from dataclasses import dataclass
from pathlib import Path

_PACKAGE = str(Path(__file__).resolve().parent)


@dataclass(frozen=True)
class CallSite:
    """Where a call was written: `call` is how it reads (`gen('answer')`), `source` the program's line."""

    call: str
    filename: str
    lineno: int
    source: str

    def __str__(self) -> str:
        where = f"{self.call} at {Path(self.filename).name}:{self.lineno}"
        return f"{where} ({self.source})" if self.source else where


def call_site(call: str) -> CallSite:
    """The innermost frame outside this package: the program line that made `call`."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
    if frame is None:
        return CallSite(call, "?", 0, "")
    filename, lineno = frame.f_code.co_filename, frame.f_lineno
    return CallSite(call, filename, lineno, linecache.getline(filename, lineno).strip())


class LangError(Exception):
    """A program call that cannot run: bad arguments, a constraint the backend cannot honour, a failed
    generation. `site` is the call; the message starts with it."""

    def __init__(self, site: CallSite, problem: str) -> None:
        super().__init__(f"{site}: {problem}")
        self.site = site
        self.problem = problem


class UnknownVariable(LangError, KeyError):
    """`state[name]` for a name no call of the program has set."""

    def __init__(self, site: CallSite, name: str, known: list[str]) -> None:
        listed = ", ".join(repr(k) for k in sorted(known)) or "none yet"
        super().__init__(site, f"no variable {name!r} (set so far: {listed})")
        self.name = name

    def __str__(self) -> str:  # KeyError would print the repr of its argument
        return Exception.__str__(self)
