"""Cutting an upstream connection loose when the gateway's client leaves.

A request whose answer is whole (it has a length) writes nothing to its client until the upstream has
finished, so no failed write can tell the gateway that the client went; without a cut the upstream generates
to the end for nobody. The front notices the close on its own (`serving.errors.PeerGone`), and `Cut` passes
it on to the one socket the request is waiting on.
"""

from __future__ import annotations

import socket
import threading
from typing import Any

from urllib3.connection import HTTPConnection, HTTPSConnection

from serving.errors import PeerGone


class Cut:
    """Ties one request's upstream connection to its client: when the client goes (the front sets `PeerGone`),
    the upstream socket is shut down from the front's thread. The request thread, blocked reading the upstream,
    wakes at once instead of waiting out the whole answer, and the upstream sees its client go as it would
    directly (`pagoda serve` aborts the generation; vLLM and SGLang abort on a closed connection too).

    The connection is known only inside urllib3's `urlopen`, so the pool's connections bind themselves to the
    request thread's `Cut` as they send (`TrackedHTTPConnection`). A connection is unbound before it goes back
    to the pool, so a late cut never reaches the request that takes it next."""

    def __init__(self, gone: PeerGone | None):
        self._lock = threading.Lock()
        self._conn: HTTPConnection | None = None
        self.fired = False
        self._cancel = gone.when_set(self._fire) if gone is not None else (lambda: None)

    def bind(self, conn: HTTPConnection) -> None:
        with self._lock:
            if self.fired:
                raise ConnectionAbortedError("the client closed the connection")
            self._conn = conn

    def _fire(self) -> None:
        with self._lock:
            self.fired = True
            self._shut()

    def _shut(self) -> None:
        sock = self._conn.sock if self._conn is not None else None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # already closed: nothing is waiting on it
                pass

    def sent(self) -> None:
        """After the request went out: a cut that came while the socket was still connecting had none to shut."""
        with self._lock:
            if self.fired:
                self._shut()

    def release(self) -> bool:
        """Unbind and stop watching; True when the client had gone (the connection must not be reused)."""
        self._cancel()
        with self._lock:
            self._conn = None
            return self.fired


bound = threading.local()  # the request thread's Cut while urlopen runs (`TrackedHTTPConnection.request`)


class _Tracked:
    def request(self, *args: Any, **kwargs: Any) -> None:
        cut: Cut | None = getattr(bound, "cut", None)
        if cut is not None:
            cut.bind(self)  # type: ignore[arg-type]
        super().request(*args, **kwargs)  # type: ignore[misc]
        if cut is not None:
            cut.sent()


class TrackedHTTPConnection(_Tracked, HTTPConnection):
    pass


class TrackedHTTPSConnection(_Tracked, HTTPSConnection):
    pass
