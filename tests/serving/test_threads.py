"""Request-thread budgets (serving/threads.py): a finished answer frees its API's slot before the client can read
it; a stream holds its slot until it is closed."""

from __future__ import annotations

from flask import Blueprint, Flask, Response

from serving import threads
from serving.errors import ApiError


def _app() -> Flask:
    app = Flask(__name__)
    bp = Blueprint("api", __name__)
    bp.add_url_rule("/answer", "answer", lambda: "ok")
    bp.add_url_rule("/stream", "stream", lambda: Response(iter(["a", "b"])))
    app.register_blueprint(bp)
    app.register_error_handler(ApiError, lambda e: (e.message, e.status))
    threads.install(app, {"api": (1, "--api-threads / PAGODA_API_THREADS")})
    return app


def test_an_answer_read_but_not_yet_closed_holds_no_slot():
    """The test client does not close an unbuffered response until told to, as a busy server may not have closed a
    socket by the time its client has read the answer and asks again."""
    client = _app().test_client()
    first = client.get("/answer")
    assert first.status_code == 200 and first.get_data() == b"ok"
    assert client.get("/answer").status_code == 200        # the first is still open: its slot is free all the same
    first.close()


def test_a_stream_holds_its_slot_until_closed():
    client = _app().test_client()
    stream = client.get("/stream")
    busy = client.get("/answer")
    assert busy.status_code == 503 and busy.get_data() == (b"server busy: all 1 request threads of the api API are in "
                                                           b"use (--api-threads / PAGODA_API_THREADS)")
    stream.close()
    assert client.get("/answer").status_code == 200
