"""Request-thread budgets: how many of the worker's request threads each API may hold at once.

A worker has a fixed pool of request threads (serving/server.py) and a streamed response keeps its thread
until the last byte, so one API could take all of them. Each API's routes take a slot before the view runs and give
it back when the answer is built: a streamed response when it is closed (after the last chunk, or when the client
went away), any other one before its bytes are written, so a client that has read an answer and asks again at once
never finds its own finished request still holding a slot. With no slot free the request gets 503 at once, and the
other API still has its own. Plain WSGI/Flask hooks only, so the budget holds under any threaded WSGI server.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from flask import Flask, Response, g, request

from serving.errors import ApiError


def install(app: Flask, budgets: Mapping[str, tuple[int, str]]) -> None:
    """`budgets`: blueprint name -> (threads its routes may hold, the setting that says so: `--decide-threads /
    PAGODA_DECIDE_THREADS`), so a refused client's operator is told what to raise."""
    slots = {name: threading.BoundedSemaphore(n) for name, (n, _) in budgets.items()}

    @app.before_request
    def take_slot() -> None:
        slot = slots.get(request.blueprint or "")
        if slot is None:
            return
        if not slot.acquire(blocking=False):
            n, where = budgets[request.blueprint]
            raise ApiError(503, f"server busy: all {n} request threads of the {request.blueprint} API are in use "
                                f"({where})", "overloaded", headers={"Retry-After": "1"})
        g.thread_slot = slot

    @app.after_request
    def release_when_built(response: Response) -> Response:
        slot = g.pop("thread_slot", None)
        if slot is not None:
            if response.is_streamed:
                response.call_on_close(slot.release)
            else:
                slot.release()
        return response

    @app.teardown_request
    def release_if_unanswered(exc: BaseException | None) -> None:
        slot = g.pop("thread_slot", None)  # after_request never ran (an error escaped it)
        if slot is not None:
            slot.release()
