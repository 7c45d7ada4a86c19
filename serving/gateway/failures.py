"""What went wrong with an upstream, in the words the error body and the metrics use.

urllib3 nests the cause (a `ProtocolError` around a `ConnectionResetError`; a `NewConnectionError`, which is
a `ConnectTimeoutError` subclass, around a refused connect), so the kind is read from the chain once, here:
`connect` (refused or unreachable: 502), `timeout` (connect or read: 504), `reset` (the connection closed
or broke mid-request: 502), `invalid_response` (not HTTP, a bad chunk: 502).
"""

from __future__ import annotations

import http.client
from dataclasses import dataclass

from urllib3 import exceptions as u3

STATUS = {"connect": 502, "timeout": 504, "reset": 502, "invalid_response": 502}
ERROR_TYPES = {"connect": "upstream_unreachable", "timeout": "upstream_timeout", "reset": "upstream_reset",
               "invalid_response": "upstream_invalid_response"}


@dataclass(frozen=True)
class Failure:
    kind: str     # connect | timeout | reset | invalid_response
    words: str    # e.g. "connection refused"

    @property
    def status(self) -> int:
        return STATUS[self.kind]

    @property
    def type(self) -> str:
        return ERROR_TYPES[self.kind]


def classify(exc: BaseException) -> Failure:
    if isinstance(exc, u3.NewConnectionError):  # before ConnectTimeoutError, its base class
        cause = exc.__context__
        words = "connection refused" if isinstance(cause, ConnectionRefusedError) else f"cannot connect: {cause or exc}"
        return Failure("connect", words)
    if isinstance(exc, u3.ConnectTimeoutError):
        return Failure("timeout", "connect timed out")
    if isinstance(exc, u3.ReadTimeoutError | TimeoutError):
        return Failure("timeout", "no answer within the timeout")
    if isinstance(exc, u3.NameResolutionError):
        return Failure("connect", f"cannot resolve the host: {exc}")
    cause = exc.args[1] if isinstance(exc, u3.ProtocolError) and len(exc.args) > 1 else exc
    if isinstance(cause, http.client.RemoteDisconnected):
        return Failure("reset", "closed the connection without an answer")
    if isinstance(cause, ConnectionError):
        return Failure("reset", f"connection broke ({type(cause).__name__})")
    if isinstance(cause, u3.InvalidChunkLength):  # before IncompleteRead, its base class: a bad chunk, not a short one
        return Failure("invalid_response", f"invalid answer: {cause}")
    if isinstance(cause, http.client.IncompleteRead) or "ended prematurely" in str(exc):
        return Failure("reset", "the answer ended before its end")
    if isinstance(cause, http.client.HTTPException | u3.DecodeError | u3.HeaderParsingError):
        return Failure("invalid_response", f"invalid answer: {cause}")
    if isinstance(exc, OSError):
        return Failure("reset", f"connection broke ({type(exc).__name__}: {exc})")
    return Failure("invalid_response", f"invalid answer: {exc}")
