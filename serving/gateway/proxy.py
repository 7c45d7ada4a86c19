"""One request through the gateway to one upstream: headers, the exchange, and the answer back.

Bodies go as sent, byte for byte; headers too, less the hop-by-hop ones (they describe one connection, not
the request) and plus `X-Request-ID`, the gateway's id for the request, so the upstream's log and error
bodies carry the id the client sees. The answer comes back the same way: a whole body (it has a length)
is read and returned at once; a body without one (a stream) is forwarded chunk by chunk as it arrives,
never gathered. An SSE stream is forwarded in whole events: the tail of an event still arriving is held
until its blank line, so when an upstream breaks mid-stream the client gets every complete event, then
one error event and `data: [DONE]`, never half an event glued to an error.

Closing is the other half of forwarding: when the client goes away the upstream sees its client go exactly as
it would directly. A stream notices at its next write (the WSGI server closes the response, which closes the
upstream connection); a request still waiting on the upstream (a whole answer, which writes nothing until its
end, or a stream before its first event) is cut loose by `Cut` the moment the front sees the client go.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from flask import Response
from urllib3 import HTTPResponse
from urllib3.exceptions import HTTPError
from urllib3.util import SKIP_HEADER

from serving.errors import PeerGone, client_gone
from serving.gateway.cut import Cut, bound
from serving.gateway.failures import Failure, classify
from serving.gateway.upstreams import Upstream

# RFC 9110 7.6.1, plus the proxy ones: they belong to one connection. Content-Length is the sender's to set.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization",
                        "te", "trailer", "transfer-encoding", "upgrade"})
REQUEST_DROP = HOP_BY_HOP | {"host", "content-length", "expect"}  # the gateway answered any Expect itself
# The gateway's WSGI server writes its own Date and Server (a second copy would be two headers).
RESPONSE_DROP = HOP_BY_HOP | {"content-length", "date", "server"}
READ_SIZE = 1 << 16
SEQUENCE_NUMBER = b'"sequence_number"'

# the event that ends a broken stream, from what broke and the last whole events the client got that carried a
# `sequence_number` (the Responses API numbers its events; the error event takes the next number)
ErrorEvent = Callable[[Failure, Upstream, bytes], bytes]


class UpstreamFailed(Exception):
    """No answer from `upstream` (nothing reached the client yet, so the request may go elsewhere)."""

    def __init__(self, upstream: Upstream, failure: Failure):
        super().__init__(f"upstream {upstream.group} ({upstream.url}): {failure.words}")
        self.upstream = upstream
        self.failure = failure


def request_headers(items: Iterator[tuple[str, str]], request_id: str) -> dict[str, str]:
    named = set()
    out: dict[str, str] = {}
    for key, value in items:
        lower = key.lower()
        if lower == "connection":
            named.update(token.strip().lower() for token in value.split(","))
        if lower not in REQUEST_DROP and lower != "x-request-id":
            out[key] = value
    for key in [k for k in out if k.lower() in named]:
        del out[key]
    lowered = {k.lower() for k in out}
    for absent in ("User-Agent", "Accept-Encoding"):  # urllib3 would add its own; send only what the client did
        if absent.lower() not in lowered:
            out[absent] = SKIP_HEADER
    out["X-Request-ID"] = request_id
    return out


def response_headers(resp: HTTPResponse) -> list[tuple[str, str]]:
    named = {token.strip().lower() for token in resp.headers.get("Connection", "").split(",")}
    return [(k, v) for k, v in resp.headers.iteritems() if k.lower() not in RESPONSE_DROP and k.lower() not in named]


def exchange(upstream: Upstream, method: str, path: str, body: bytes, headers: dict[str, str],
             extra_headers: dict[str, str], error_event: ErrorEvent, gone: PeerGone | None = None) -> Response:
    """Send the request and answer with what came back; `UpstreamFailed` when nothing usable did, a 499
    `ApiError` when the client went first (nothing to retry: nobody is waiting)."""
    series = upstream.series
    cut = Cut(gone)
    upstream.enter()
    sent = time.monotonic()
    bound.cut = cut
    try:
        resp = upstream.pool.urlopen(method, upstream.base_path + path, body=body, headers=headers, retries=False,
                                     redirect=False, preload_content=False, decode_content=False)
    except (HTTPError, OSError) as exc:
        upstream.leave()
        if cut.release():
            series.disconnects.inc()
            raise client_gone() from None
        failure = classify(exc)
        series.error(failure.kind)
        if failure.kind == "connect":
            upstream.failed(f"request: {failure.words}")
        raise UpstreamFailed(upstream, failure) from None
    finally:
        bound.cut = None
    series.answered(resp.status)
    headers_out = response_headers(resp) + list(extra_headers.items())
    if resp.headers.get("Content-Length") is not None and not resp.chunked:
        try:
            data = _read_by(resp, sent + upstream.cfg.upstream_timeout_s)
        except (HTTPError, OSError) as exc:
            resp.close()
            if cut.fired:
                series.disconnects.inc()
                raise client_gone() from None
            failure = classify(exc)
            series.error(failure.kind)
            raise UpstreamFailed(upstream, failure) from None
        finally:
            if cut.release():  # the client went as the answer ended: the socket is shut, not for reuse
                resp.close()
            resp.release_conn()
            upstream.leave()
        now = time.monotonic()
        series.first_byte(now - sent)
        series.finished(now - sent)
        upstream.passed(by_check=False)
        return Response(data, status=resp.status, headers=headers_out)
    events = resp.headers.get("Content-Type", "").startswith("text/event-stream")
    relay = Relay(upstream, resp, sent, error_event if events else None, cut)
    return Response(relay, status=resp.status, headers=headers_out)


def _read_by(resp: HTTPResponse, deadline: float) -> bytes:
    """A whole body by `deadline` (monotonic). urllib3's read timeout bounds each wait for the next byte, not
    the answer: an upstream trickling a byte a second would hold the request without end. So each read may wait
    only for what is left of the deadline."""
    parts = []
    sock = getattr(resp.connection, "sock", None)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the whole answer did not arrive within --upstream-timeout-s")
        if sock is not None:
            sock.settimeout(left)
        chunk = resp.read1(READ_SIZE, decode_content=False)
        if not chunk:
            return b"".join(parts)
        parts.append(chunk)


class Relay:
    """A body without a length, forwarded as it arrives; `close` (the WSGI server's, at the end or when the
    client left) releases the upstream side exactly once."""

    def __init__(self, upstream: Upstream, resp: HTTPResponse, sent: float, error_event: ErrorEvent | None,
                 cut: Cut):
        self.upstream, self.resp, self.sent, self.error_event, self.cut = upstream, resp, sent, error_event, cut
        self.finished = False
        self.closed = False

    def __iter__(self) -> Iterator[bytes]:
        resp, series = self.resp, self.upstream.series
        source = (resp.read_chunked(decode_content=False) if resp.chunked
                  else iter(lambda: resp.read1(READ_SIZE, decode_content=False), b""))
        events = self.error_event is not None
        tail = numbered = b""
        first = True
        while True:
            try:
                chunk = next(source, None)
            except (HTTPError, OSError) as exc:
                failure = classify(exc)
                break
            if chunk is None:
                failure = None
                break
            if first:
                series.first_byte(time.monotonic() - self.sent)
                first = False
            if not events:
                yield chunk
                continue
            data = tail + chunk if tail else chunk
            end = _events_end(data)
            if end == len(data):
                tail, whole = b"", data
            elif end:
                tail, whole = data[end:], data[:end]
            else:
                tail = data
                continue
            if SEQUENCE_NUMBER in whole:  # numbers only grow: the last numbered events hold the highest
                numbered = whole
            yield whole
        self.finished = True
        if failure is None:
            if tail:
                yield tail
            self._release(ok=True)
            return
        if self.cut.fired:  # the client went while the upstream was silent: nobody reads an error event
            self.close()
            return
        series.error(failure.kind)
        self._release(ok=False)
        if not events:  # a plain body has no in-band error: cut the connection so the client sees it short
            raise UpstreamFailed(self.upstream, failure)
        yield self.error_event(failure, self.upstream, numbered)

    def _release(self, ok: bool) -> None:
        if self.closed:
            return
        self.closed = True
        if self.cut.release():
            ok = False  # its socket was shut: not for reuse
        if ok:
            self.resp.release_conn()
            self.upstream.passed(by_check=False)
        else:
            self.resp.close()
            self.resp.release_conn()
        self.upstream.series.finished(time.monotonic() - self.sent)
        self.upstream.leave()

    def close(self) -> None:
        if not self.closed and (not self.finished or self.cut.fired):
            self.upstream.series.disconnects.inc()
        self._release(ok=False)


def _events_end(data: bytes) -> int:
    """Where the last complete SSE event in `data` ends (0: none yet)."""
    lf = data.rfind(b"\n\n")
    crlf = data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
