"""Server-sent events: the wire format both dialects stream in, and what ends a stream early.

A stream is a plain WSGI iterable, so it holds its request thread until the last event, and the server
closes it when the client goes away (the first write after the peer hung up fails). Closing the generator
raises GeneratorExit at its `yield`; the run's event iterator is closed with it and aborts every choice,
so a disconnected client's blocks go back to the pool within a token or two.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from flask import Response

DONE = "data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(payload: dict[str, Any], event: str | None = None) -> str:
    """One event; `event` names it on its own line (the Responses API's typed events), which SSE readers route by."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def event_stream(events: Iterator[str], run: Any) -> Response:
    """`run` is aborted when the server closes the response, also when the stream never started (the
    client left before the first event): a generator that never ran has no `finally` to do it."""
    response = Response(events, mimetype="text/event-stream", headers=HEADERS)
    response.call_on_close(run.close)
    return response
