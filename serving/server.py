"""The production server: gunicorn's master around workers whose connections live on an asyncio loop.

Why this shape (measured in docs/operations.md): gunicorn's gthread worker hands a connection to a request
thread as soon as its first byte arrives, and the thread then blocks reading the rest, so clients that
trickle headers or send a body shorter than its Content-Length hold the request threads and freeze the
server. Here each worker reads requests on an event loop (h11 parses HTTP/1.1), under a deadline for the
head and one for the body, with a cap on open connections; only a whole request, body buffered, reaches a
request thread, which runs the Flask app and streams its response back through the loop (SSE included,
one write per event, so a stream never waits for a slow reader's whole backlog). Everything the HTTP
layer itself refuses (bad framing, a 100 KB header, a body over the limit, chunked or not, a stalled
client) is answered in the project's JSON error shape. No maintained WSGI server gives both whole-request
buffering with read deadlines and JSON for its own errors, hence this small front on h11.

gunicorn's master keeps what a decision service needs around it: graceful SIGTERM (stop accepting, let
in-flight requests finish, exit), worker restarts, `--workers` to scale across cores. With `--preload`
(default) the master imports the model code and builds the generation engine before forking (see
`preload`), so a replacement worker after a crash only loads the small decision model. A
worker where any API's model fails to load exits with gunicorn's boot-error status, which stops the whole
server with the reason in the log instead of serving 503s forever.
"""

from __future__ import annotations

import asyncio
import fcntl
import importlib
import io
import json
import logging
import math
import os
import re
import resource
import struct
import sys
import termios
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any
from urllib.parse import unquote_to_bytes

import h11
from gunicorn.app.base import BaseApplication
from gunicorn.workers.base import Worker

from serving.access_log import COUNT_REFUSED_KEY, REQUEST_ID, access_log
from serving.config import FrontSettings, ServeConfig
from serving.errors import DIALECTS_KEY, PEER_GONE_KEY, PeerGone, error_body, in_dialect
from serving.ready_board import ReadyBoard

WORKER_BOOT_ERROR = 3  # gunicorn.arbiter.Arbiter.WORKER_BOOT_ERROR: the master halts on it
log = logging.getLogger("pagoda.serve")
_READ_CHUNK = 64 * 1024
_SIOCOUTQ = getattr(termios, "TIOCOUTQ", None) if sys.platform.startswith("linux") else None
_DRAIN_SLICE_S = 0.25  # how often a write that waits for a slow client checks that it is still taking bytes
_HANDED_MAX = 256 * 1024  # response bytes a request thread may hand the loop before it waits for their write
_REQUEST_LINE_BYTES = 8192  # what a refusal reads its path from (the request line; longer ones go undialected)
_LINGER_S = 2.0  # after an error answer, how long unread request bytes are drained so the answer is not reset
_CLOSE_TIMEOUT_S = 5.0  # at exit, how long each API's model thread gets to end (it may be mid-batch)
_CUT_WAIT_S = 0.2  # past the grace: how long closed connections' request threads get to notice and stop


class GunicornServer(BaseApplication):
    def __init__(self, cfg: ServeConfig, engine: Any = None, torch_threads: int | None = None):
        """`engine`: the generation engine the master built (--preload), shared copy-on-write by every worker;
        `torch_threads`: torch's own default, given back to each worker after the fork (see `preload`)."""
        self.serve_cfg = cfg
        self.engine = engine
        self.torch_threads = torch_threads
        self.apis: list = []  # the worker's, once `load` built them (closed as it exits)
        self.board = ReadyBoard(cfg.workers)
        self.models_loaded = threading.Event()  # set in a worker once its models are (`watch_loading`)
        super().__init__(prog="pagoda serve")

    def load_config(self) -> None:
        cfg = self.serve_cfg
        settings = {
            "bind": [f"{cfg.host}:{cfg.port}"],
            "workers": cfg.workers,
            "worker_class": FrontWorker,
            "threads": cfg.threads,
            "graceful_timeout": math.ceil(cfg.graceful_timeout_s + _CUT_WAIT_S) + 1,  # the worker's own drain ends first
            # The heartbeat runs on the worker's event loop, never blocked by a request; a long timeout only
            # matters while a worker loads its models.
            "timeout": max(120, int(cfg.request_timeout_s * 2)),
            "accesslog": None,  # the app writes its own JSON access line
            "errorlog": "-",
            "loglevel": "warning",
            "proc_name": "pagoda-serve",
            "when_ready": _announce,
            "post_fork": self._after_fork,
            "child_exit": lambda server, worker: self.board.clear(worker.pid),
        }
        for key, value in settings.items():
            self.cfg.set(key, value)

    def _after_fork(self, server, worker) -> None:
        if self.torch_threads is not None:
            import torch

            torch.set_num_threads(self.torch_threads)

    def load(self):
        from serving.app import build_apis, create_app

        apis = build_apis(self.serve_cfg)
        if self.engine is not None:
            from serving.generate.routes import GenerateApi

            apis = [GenerateApi(self.serve_cfg.generate, api.model, engine=self.engine) if api.name == "generate"
                    else api for api in apis]
        app = create_app(self.serve_cfg, apis)
        self.watch_loading(apis)
        self.apis = apis
        return app

    def watch_loading(self, apis: list) -> None:
        """In the worker, beside the loads: exit on a failed one (gunicorn's boot-error status stops the whole
        server with the reason in the log, instead of 503s forever); once every model is loaded, say so on the
        board at once (a loading sibling stops accepting within its next look, `FrontWorker._serve`)."""

        def watch() -> None:
            while not all(api.loaded.wait(0.2) for api in apis):
                for api in apis:
                    if api.error is not None:
                        log.error("stopping: the %s model did not load (%s)", api.name, api.error)
                        os._exit(WORKER_BOOT_ERROR)
            self.board.mark(os.getpid())
            self.models_loaded.set()
            log.info("worker %d loaded, accepting", os.getpid())

        threading.Thread(target=watch, name="pagoda-load-watch", daemon=True).start()


# What the master imports with --preload: what a worker's model load imports (found with `python -X importtime`
# on the embedded defaults: torch alone is ~8 s on a loaded 2-core box). Importing defines code only. Not
# onnxruntime: its import starts a native thread, and a worker forked with that thread's handle but not the
# thread aborts at exit (`std::system_error` from its join), so the workers import it themselves (~1.4 s).
PRELOAD_MODULES = {
    "decide": ("tokenizers", "laya.agent", "laya.onnx_engine", "serving.decide.backend", "serving.decide.routes"),
    "student": ("tokenizers", "serving.decide.routes"),
    "generate": ("torch", "gguf", "tokenizers", "generation.engine", "serving.generate.routes"),
}


@dataclass
class Preloaded:
    engine: Any = None              # the generation engine, built in the master
    torch_threads: int | None = None  # torch's default thread count, for the workers to restore
    seconds: float = 0.0


def preload(cfg: ServeConfig) -> Preloaded:
    """Import in the master what every worker would import, and build the generation engine there (weights
    dequantised, KV pool allocated: ~18 s of a replacement worker's ~20 s on the embedded SmolLM2). The fork
    then hands each worker the engine copy-on-write. What must not cross a fork does not: torch runs on one
    thread in the master (no OpenMP pool exists to be lost), and the engine loop's thread, the decision
    model (onnxruntime sessions own thread pools) and the batcher all start in the worker. A module this
    install lacks, or an engine that fails to build, is left to the worker, which reports it by name; but a
    setting the model refuses (`--generate-max-model-len` past its positions) stops `pagoda serve` here, with
    one line naming the flag, since every worker would refuse it too."""
    started = time.monotonic()
    out = Preloaded()
    before = _native_threads()  # numpy's OpenBLAS pool, started when serving imported numpy: not preload's doing,
    kinds = []                  # and OpenBLAS stops it around a fork itself (its pthread_atfork handler)
    if not cfg.generate.only:
        kinds.append("student" if cfg.decide.student else "decide")
    model = cfg.generate.model_path()
    if model is not False:
        kinds.append("generate")
    for name in dict.fromkeys(m for kind in kinds for m in PRELOAD_MODULES[kind]):
        try:
            importlib.import_module(name)
        except ImportError:
            continue
    if model is not False:
        from generation.config import InvalidParam

        try:
            import torch

            out.torch_threads = torch.get_num_threads()
            torch.set_num_threads(1)
            from serving.generate.service import build_engine

            out.engine = build_engine(cfg.generate, model)
        except InvalidParam:  # a setting the model refuses: every worker would too
            raise
        except Exception as exc:  # noqa: BLE001 -- the worker builds it again and stops the server on failure
            log.warning("preload: the generation engine did not build in the master (%s); workers will", exc)
    out.seconds = time.monotonic() - started
    native = _native_threads() - before
    if native > 0:
        log.warning("preload left %d native thread(s) in the master; a forked worker has their handles but not "
                    "the threads (it may abort at exit): a preloaded module starts threads on import", native)
    return out


def _native_threads() -> int:
    """Threads of this process that Python did not start (0 where /proc is not there to count them)."""
    if not os.path.isdir("/proc/self/task"):
        return 0
    return len(os.listdir("/proc/self/task")) - threading.active_count()


def _announce(server) -> None:
    for listener in server.LISTENERS:
        server.log.warning("pagoda serving on %s (pid %d)", listener, os.getpid())


def serve(cfg: ServeConfig) -> None:
    loaded = Preloaded()
    if cfg.preload:
        loaded = preload(cfg)
        log.warning("preloaded in the master in %.1fs (model code%s)", loaded.seconds,
                    ", generation engine" if loaded.engine is not None else "")
    GunicornServer(cfg, loaded.engine, loaded.torch_threads).run()


# ---- the worker ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Limits:
    """What the front enforces before a request thread sees a request (ServeConfig's fields, by meaning)."""

    max_connections: int
    keepalive_s: float      # an idle connection (before its first request, or between two) closes after this
    header_timeout_s: float  # request line and headers, from their first byte
    body_timeout_s: float    # the whole body, from the end of the headers
    write_timeout_s: float   # a client reading nothing of its response for this long is dropped
    max_header_bytes: int
    max_body_bytes: int

    @classmethod
    def of(cls, cfg: FrontSettings) -> Limits:
        return cls(cfg.max_connections, cfg.keepalive_s, cfg.header_timeout_s, cfg.body_timeout_s,
                   cfg.write_timeout_s, cfg.max_header_bytes, cfg.max_body_bytes)


class Refused(Exception):
    """A request the front answers itself, with the JSON error shape, then closes the connection."""

    def __init__(self, status: int, message: str, type_: str):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type_
        # Where the request was read, from its first bytes (`_Start`): its path (its API's dialect words the
        # error, and the refusal is counted under its route), the client's X-Request-ID, when it began.
        self.path: str | None = None
        self.method: str | None = None
        self.request_id: str | None = None
        self.began: float | None = None


class FrontWorker(Worker):
    """A gunicorn worker: connections on an asyncio loop, whole requests run on `threads` request threads."""

    def init_process(self) -> None:
        _raise_fd_limit()
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        super().init_process()  # loads the app, installs signal handlers, then calls run()

    def run(self) -> None:
        cfg: ServeConfig = self.app.serve_cfg
        front = Front(self.wsgi, Limits.of(cfg), cfg.threads, self.loop, multiprocess=cfg.workers > 1)
        try:
            self.loop.run_until_complete(self._serve(front, cfg))
        finally:
            front.pool.shutdown(wait=False, cancel_futures=True)
            self.loop.close()
            for api in self.app.apis:
                api.close(_CLOSE_TIMEOUT_S)

    async def _serve(self, front: Front, cfg: ServeConfig) -> None:
        """Accept while loaded, or while no sibling is (`ReadyBoard`): a loading worker beside a loaded one
        leaves the shared socket to it. Each pause closes this worker's listening copies (dups of gunicorn's
        sockets; connections already taken go on) and a resume opens new ones."""
        board: ReadyBoard = self.app.board
        servers: list[asyncio.Server] = []
        try:
            while self.alive:
                self.notify()
                if self.ppid != os.getppid():
                    log.warning("the master went away; worker %d stops", self.pid)
                    break
                loaded = self.app.models_loaded.is_set()
                accept = loaded or not board.other_ready(self.pid)
                if accept and not servers:
                    servers = [await asyncio.start_server(front.connection, sock=s.sock.dup(), limit=_READ_CHUNK,
                                                          backlog=2048) for s in self.sockets]
                elif not accept and servers:
                    for server in servers:
                        server.close()
                    servers = []
                await asyncio.sleep(0.5 if loaded else 0.02)
        finally:
            board.clear(self.pid)
            for server in servers:
                server.close()
        await front.drain(cfg.graceful_timeout_s)
        # connections drain aborted are still tasks on the loop until they run again: end them here, so that closing
        # the loop destroys none pending (asyncio logged "Task was destroyed but it is pending!" for each)
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in rest:
            task.cancel()
        await asyncio.gather(*rest, return_exceptions=True)


def _raise_fd_limit() -> None:
    """Every open connection is a descriptor; the soft limit (often 1024) would cap connections first."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass


class Front:
    """Reads requests off connections under the limits and runs each whole one on the request threads."""

    def __init__(self, app, limits: Limits, threads: int, loop: asyncio.AbstractEventLoop, multiprocess: bool):
        self.app, self.limits, self.loop = app, limits, loop
        self.dialects = getattr(app, "extensions", {}).get(DIALECTS_KEY, {})
        self.count_refused = getattr(app, "extensions", {}).get(COUNT_REFUSED_KEY)
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="pagoda-request")
        self.multiprocess = multiprocess
        self.idle: dict[asyncio.StreamWriter, None] = {}   # waiting for a request to begin (evictable), oldest first
        self.open: set[asyncio.StreamWriter] = set()
        self.busy = 0                                      # requests being answered
        self.stopping = False

    # ---- connections ----------------------------------------------------------------------------------------

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername") or ("", 0)
        local = writer.get_extra_info("sockname") or ("", 0)
        if len(self.open) >= self.limits.max_connections and not self._evict_idle():
            await self._refuse(writer, reader, Refused(
                503, f"server busy: {self.limits.max_connections} connections open (--max-connections)",
                "overloaded"), None, {"Retry-After": "1"})
            return
        self.open.add(writer)
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=self.limits.max_header_bytes)
        try:
            while not self.stopping:
                try:
                    request = await self._read_request(conn, reader, writer)
                except Refused as refused:
                    await self._refuse(writer, reader, refused, conn)
                    return
                if request is None:
                    return
                keep = await self._answer(conn, reader, writer, request, peer, local)
                if not keep or conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        except (ConnectionError, OSError, asyncio.IncompleteReadError):
            pass
        finally:
            self.idle.pop(writer, None)
            self.open.discard(writer)
            writer.close()

    def _evict_idle(self) -> bool:
        """At the cap, a new connection takes the place of the longest-idle one: an idle connection costs its
        client only a reconnect, a refused one costs a request."""
        for writer in self.idle:
            del self.idle[writer]
            self.open.discard(writer)
            writer.transport.abort()
            return True
        return False

    async def drain(self, grace_s: float) -> None:
        """SIGTERM: idle connections close now, requests being answered get `grace_s` to finish."""
        self.stopping = True
        for writer in list(self.idle):
            writer.transport.abort()
        deadline = time.monotonic() + grace_s
        while self.busy and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.busy:
            # Past the grace the worker exits and its connections die with it; closing them here first fails
            # the writes their threads wait on, so each stops as for a client that left (its generation
            # aborted) instead of writing to a closed loop.
            log.warning("--graceful-timeout-s (%gs) passed with %d request(s) unfinished: closing them", grace_s,
                        self.busy)
            for writer in list(self.open):
                writer.transport.abort()
            cut = time.monotonic() + _CUT_WAIT_S
            while self.busy and time.monotonic() < cut:
                await asyncio.sleep(0.01)

    # ---- reading ----------------------------------------------------------------------------------------------

    async def _read_request(self, conn: h11.Connection, reader: asyncio.StreamReader,
                            writer: asyncio.StreamWriter) -> tuple[h11.Request, bytes] | None:
        """The next whole request (head, body), or None when the client closed or stayed idle too long.
        A refusal carries the request's path, from its parsed head or else its first line's bytes."""
        start = _Start()
        try:
            return await self._read_whole(conn, reader, writer, start)
        except Refused as refused:
            start.describe(refused)
            raise

    async def _read_whole(self, conn: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                          start: _Start) -> tuple[h11.Request, bytes] | None:
        lim = self.limits
        head: h11.Request | None = None
        body = bytearray()
        deadline: float | None = None  # None: idle, nothing of this request received yet
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                status = exc.error_status_hint
                if status == 431:
                    raise Refused(431, f"request line and headers over the {lim.max_header_bytes} byte limit "
                                       "(--max-header-bytes)", "headers_too_large") from None
                raise Refused(status, f"malformed HTTP request: {exc}", "bad_request") from None
            if event is h11.NEED_DATA:
                if deadline is None and conn.their_state is h11.IDLE and not conn.trailing_data[0]:
                    self.idle[writer] = None
                    try:
                        data = await asyncio.wait_for(reader.read(_READ_CHUNK), lim.keepalive_s)
                    except TimeoutError:
                        return None
                    finally:
                        self.idle.pop(writer, None)
                    if not data:
                        return None
                    deadline = time.monotonic() + lim.header_timeout_s
                else:
                    if deadline is None:
                        deadline = time.monotonic() + lim.header_timeout_s
                    data = await self._read_until(reader, deadline, head is None)
                if head is None:
                    start.add(data)
                conn.receive_data(data)
            elif isinstance(event, h11.Request):
                head = event
                deadline = self._check_head(event, conn, writer)
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > lim.max_body_bytes:
                    raise Refused(413, f"request body over the {lim.max_body_bytes} byte limit (--max-body-bytes)",
                                  "payload_too_large")
            elif isinstance(event, h11.EndOfMessage):
                return head, bytes(body)
            elif isinstance(event, h11.ConnectionClosed):
                return None

    async def _read_until(self, reader: asyncio.StreamReader, deadline: float, in_head: bool) -> bytes:
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            data = await asyncio.wait_for(reader.read(_READ_CHUNK), left)
        except TimeoutError:
            lim = self.limits
            part, limit, flag = (("request line and headers", lim.header_timeout_s, "--header-timeout-s") if in_head
                                 else ("request body", lim.body_timeout_s, "--body-timeout-s"))
            raise Refused(408, f"the {part} did not arrive within {limit:g}s ({flag})", "request_timeout") from None
        if not data:  # the client closed mid-request: nobody is left to answer
            raise ConnectionResetError
        return data

    def _check_head(self, request: h11.Request, conn: h11.Connection, writer: asyncio.StreamWriter) -> float:
        """Refuse what the headers already tell (ambiguous framing, a declared size over the limit); returns
        the body's deadline."""
        # h11 bounds a head still arriving (max_incomplete_event_size); one that came whole in a single read
        # is parsed at any size, so measure it here: request line, each header line, the blank line
        size = len(request.method) + len(request.target) + 11 + sum(len(n) + len(v) + 4 for n, v in request.headers) + 2
        if size > self.limits.max_header_bytes:
            raise Refused(431, f"request line and headers over the {self.limits.max_header_bytes} byte limit "
                               "(--max-header-bytes)", "headers_too_large")
        names = {name for name, _ in request.headers}
        if b"content-length" in names and b"transfer-encoding" in names:
            raise Refused(400, "both Content-Length and Transfer-Encoding given: the body's length is ambiguous",
                          "bad_request")
        length = dict(request.headers).get(b"content-length")
        if length is not None and int(length) > self.limits.max_body_bytes:
            raise Refused(413, f"request body over the {self.limits.max_body_bytes} byte limit (--max-body-bytes)",
                          "payload_too_large")
        if conn.they_are_waiting_for_100_continue:
            writer.write(conn.send(h11.InformationalResponse(status_code=100, headers=[])))
        return time.monotonic() + self.limits.body_timeout_s

    # ---- answering ----------------------------------------------------------------------------------------

    async def _answer(self, conn: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      request: tuple[h11.Request, bytes], peer, local) -> bool:
        """Run the app on a request thread; False when the connection must close after it."""
        head, body = request
        environ = self._environ(head, body, peer, local)
        gone = environ[PEER_GONE_KEY] = PeerGone()
        watch = self.loop.create_task(self._watch_peer(conn, reader, gone))
        self.busy += 1
        try:
            return await self.loop.run_in_executor(self.pool, self._run_app, environ, conn, writer)
        finally:
            self.busy -= 1
            watch.cancel()

    async def _watch_peer(self, conn: h11.Connection, reader: asyncio.StreamReader, gone: PeerGone) -> None:
        """While the app runs: set `gone` when the client closes its connection, so a request that writes nothing
        until its end (a whole answer, not a stream) stops generating for nobody. What arrives meanwhile (a
        pipelined next request) goes to h11's buffer, up to one request's worth; past that the watch stops
        reading, and the client is noticed at the answer's first write instead. A client that only shuts down
        its sending side counts as gone, as in uvicorn (which vLLM runs on)."""
        lim = self.limits
        room = lim.max_header_bytes + lim.max_body_bytes
        while room > 0:
            try:
                data = await reader.read(min(_READ_CHUNK, room))
            except (ConnectionError, OSError):  # a reset (RST: a killed client, a proxy's timeout) is gone too
                data = b""
            if not data:
                gone.set()
                return
            conn.receive_data(data)
            room -= len(data)

    def _run_app(self, environ: dict, conn: h11.Connection, writer: asyncio.StreamWriter) -> bool:
        """On a request thread: the app's response, each chunk written through the loop as it comes (`_Output`
        says when a write waits for the client, so a stream keeps its pace)."""
        started: list = []
        output = _Output(self, conn, writer)

        def start_response(status: str, headers: list[tuple[str, str]], exc_info=None):
            if exc_info and started:
                raise exc_info[1].with_traceback(exc_info[2])
            started[:] = [status, headers]
            return _no_write

        response = None
        sent_head = False
        try:
            response = self.app(environ, start_response)
            for chunk in response:
                if not chunk:
                    continue
                if type(chunk) is not bytes:  # written later, on the loop: a buffer the app refills must not change
                    chunk = bytes(chunk)
                if not sent_head:
                    output.send(self._response_head(started), h11.Data(data=chunk))
                    sent_head = True
                else:
                    output.send(h11.Data(data=chunk))
            # Closed before the end of the message goes out: a client that has read the whole answer and asks
            # again at once must not find this request still holding its thread slot (serving/threads.py).
            finished, response = response, None
            _close(finished)
            if sent_head:
                output.send(h11.EndOfMessage(), wait=True)
            else:
                output.send(self._response_head(started), h11.EndOfMessage(), wait=True)
        except (ConnectionError, OSError, TimeoutError):
            return False  # the client left, or stopped reading: the stream is closed below (GeneratorExit)
        except Exception:  # noqa: BLE001 -- the app's iterable failed: the client gets an answer, the log the cause
            log.exception("the response to %s %s failed", environ["REQUEST_METHOD"], environ["PATH_INFO"])
            if not sent_head:
                body = json.dumps(error_body("internal error; see the server log", "internal_error", None,
                                             None), separators=(",", ":")).encode()
                started[:] = ["500 Internal Server Error", [("Content-Type", "application/json"),
                                                            ("Content-Length", str(len(body))),
                                                            ("Connection", "close")]]
                try:
                    output.send(self._response_head(started), h11.Data(data=body), h11.EndOfMessage(), wait=True)
                except Exception:  # noqa: BLE001 -- nobody left to tell
                    pass
            return False
        finally:
            _close(response)
        return not self.stopping

    def _response_head(self, started: list) -> h11.Response:
        status, headers = started
        out = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]
        if self.stopping:
            out.append((b"connection", b"close"))
        return h11.Response(status_code=int(status.split(" ", 1)[0]), headers=out, reason=status[4:].encode())

    def _environ(self, head: h11.Request, body: bytes, peer, local) -> dict:
        target = head.target.decode("latin-1")
        path, _, query = target.partition("?")
        if path.startswith(("http://", "https://")):  # absolute-form (a proxy's): keep the path part
            path = "/" + path.split("/", 3)[3] if path.count("/") >= 3 else "/"
        environ = {
            "REQUEST_METHOD": head.method.decode("ascii"),
            "SCRIPT_NAME": "",
            "PATH_INFO": unquote_to_bytes(path).decode("latin-1"),
            "QUERY_STRING": query,
            "SERVER_NAME": str(local[0]), "SERVER_PORT": str(local[1]),
            "SERVER_PROTOCOL": f"HTTP/{head.http_version.decode()}",
            "REMOTE_ADDR": str(peer[0]), "REMOTE_PORT": str(peer[1]),
            "CONTENT_LENGTH": str(len(body)),  # also for a chunked body: it is whole by now
            "wsgi.version": (1, 0), "wsgi.url_scheme": "http", "wsgi.input": io.BytesIO(body),
            "wsgi.errors": sys.stderr, "wsgi.multithread": True, "wsgi.multiprocess": self.multiprocess,
            "wsgi.run_once": False, "wsgi.input_terminated": True,
        }
        for name, value in head.headers:
            key = name.decode("latin-1").upper().replace("-", "_")
            if key in ("CONTENT_LENGTH", "TRANSFER_ENCODING"):
                continue
            key = key if key == "CONTENT_TYPE" else "HTTP_" + key
            text = value.decode("latin-1")
            environ[key] = f"{environ[key]},{text}" if key in environ else text
        return environ

    # ---- the front's own answers --------------------------------------------------------------------------

    async def _refuse(self, writer: asyncio.StreamWriter, reader: asyncio.StreamReader, refused: Refused,
                      conn: h11.Connection | None, headers: dict[str, str] | None = None) -> None:
        """The JSON error, written raw (h11 may be in its error state), then a lingering close: the client may
        still be sending, and closing on unread bytes would reset the connection before it reads the answer."""
        if conn is not None and conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return  # a response already started: nothing can be said any more
        request_id = refused.request_id or uuid.uuid4().hex
        if self.count_refused is not None:
            latency = time.monotonic() - refused.began if refused.began is not None else 0.0
            self.count_refused(refused.method, refused.path, refused.status, latency)
        body = in_dialect(error_body(refused.message, refused.type, None, request_id), refused.path, self.dialects)
        body = json.dumps(body, separators=(",", ":")).encode()
        reason = HTTPStatus(refused.status).phrase if refused.status in HTTPStatus._value2member_map_ else "Error"
        lines = [f"HTTP/1.1 {refused.status} {reason}", "Content-Type: application/json",
                 f"Content-Length: {len(body)}", "Connection: close", f"X-Request-ID: {request_id}",
                 *(f"{k}: {v}" for k, v in (headers or {}).items())]
        access_log.info(json.dumps({"ts": round(time.time(), 3), "request_id": request_id, "route": "front",
                                    "method": refused.method, "path": refused.path, "status": refused.status,
                                    "type": refused.type}))
        try:
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
            await asyncio.wait_for(writer.drain(), self.limits.write_timeout_s)
            if writer.can_write_eof():
                writer.write_eof()
            deadline = time.monotonic() + _LINGER_S
            while time.monotonic() < deadline:
                data = await asyncio.wait_for(reader.read(_READ_CHUNK), deadline - time.monotonic())
                if not data:
                    break
        except (ConnectionError, OSError, TimeoutError):
            pass
        finally:
            writer.close()


class _Output:
    """One response's writes, from its request thread through the loop, in order.

    A write waits for the loop only when it must: when it ends the response (the thread then returns and the
    connection may take its next request); when the last write left bytes in asyncio's buffer (the kernel's
    send buffer is full, so the client is behind and the thread waits on `drain`, until the client has taken
    nothing for --write-timeout-s); or when the loop has not yet written `_HANDED_MAX` of the bytes handed to
    it (a fast producer must not queue a whole body in callbacks before the loop sees that the client is
    behind).
    Otherwise the thread hands the bytes over and goes on: one wake-up of the loop per streamed event instead
    of a task, a timeout and a round trip between threads, which took the gateway's CPU per relayed token
    from ~240 to ~140 us and `pagoda serve`'s streamed tokens/s up by a third on the tiny test model. A
    failure found by a write the thread did not wait for (the client left, or `_Stall` gave up on it) is
    raised by the thread's next write."""

    def __init__(self, front: Front, conn: h11.Connection, writer: asyncio.StreamWriter):
        self.front, self.conn, self.writer = front, conn, writer
        self.loop = front.loop
        self.stall = _Stall(front.limits.write_timeout_s)
        self.error: BaseException | None = None
        self.behind = False   # the last write left bytes in asyncio's buffer
        self.queued = 0       # data bytes handed to the loop (counted by the request thread only)
        self.dequeued = 0     # ... and of those, the ones the loop has written (counted by the loop only)

    def send(self, *events: h11.Event, wait: bool = False) -> None:
        if self.error is not None:
            raise self.error
        size = sum(len(e.data) for e in events if isinstance(e, h11.Data))
        self.queued += size
        try:
            if wait or self.behind or self.queued - self.dequeued > _HANDED_MAX:
                asyncio.run_coroutine_threadsafe(self._write_and_drain(events, size), self.loop).result()
            else:
                self.loop.call_soon_threadsafe(self._write, events, size)
        except RuntimeError:
            if not self.loop.is_closed():
                raise
            # The worker stopped past --graceful-timeout-s while this request ran (`Front.drain`).
            raise ConnectionAbortedError("the server stopped before the answer was finished") from None

    def _write(self, events: tuple[h11.Event, ...], size: int) -> None:
        """In the loop."""
        self.dequeued += size
        if self.error is not None:
            return
        try:
            if self.writer.is_closing():
                raise ConnectionResetError
            written = 0
            for event in events:
                data = self.conn.send(event)
                if data:
                    self.writer.write(data)
                    written += len(data)
            buffered = self.writer.transport.get_write_buffer_size()
            self.behind = buffered > 0
            self.stall.check(written, buffered + _kernel_unsent(self.writer))
        except Exception as exc:  # noqa: BLE001 -- handed to the request thread, which ends the response
            self.error = exc

    async def _write_and_drain(self, events: tuple[h11.Event, ...], size: int) -> None:
        """`_write`, then wait until asyncio's buffer is below its low mark. The wait is not bounded by
        --write-timeout-s as a whole: a client reading a large answer slowly but steadily may need longer, and
        only one that takes nothing for that long is dropped (`_Stall`, checked every `_DRAIN_SLICE_S`)."""
        self._write(events, size)
        while self.error is None:
            try:
                await asyncio.wait_for(self.writer.drain(), min(_DRAIN_SLICE_S, self.front.limits.write_timeout_s))
            except TimeoutError:
                try:
                    self.stall.check(0, self.writer.transport.get_write_buffer_size() + _kernel_unsent(self.writer))
                except TimeoutError as exc:
                    self.error = exc
            except Exception as exc:  # noqa: BLE001 -- as in _write
                self.error = exc
            else:
                self.behind = self.writer.transport.get_write_buffer_size() > 0
                return
        raise self.error


class _Stall:
    """`--write-timeout-s` for a stream of small writes. `drain()` waits only once asyncio's buffer is full, and
    that fills only after the socket's kernel buffer (megabytes, autotuned): a streaming client that stops
    reading would hold its request thread and KV for the whole answer. So each write also asks how much is still
    unsent: the bytes the client has taken are those written less those. When they have not grown for the timeout
    while some wait, the client is taking none (its receive window is full) and the request ends as a slow drain
    does (TimeoutError: the stream is closed and aborted). A client that reads slowly keeps taking, and stays."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.written = self.taken = 0
        self.since = time.monotonic()

    def check(self, written: int, pending: int) -> None:
        now = time.monotonic()
        self.written += written
        taken = self.written - pending
        if pending == 0 or taken > self.taken:
            self.since = now
        self.taken = max(self.taken, taken)
        if pending and now - self.since > self.timeout_s:
            raise TimeoutError(f"the client took none of {pending} bytes for {self.timeout_s:g}s")


def _kernel_unsent(writer: asyncio.StreamWriter) -> int:
    """Bytes in the socket's send queue (Linux's SIOCOUTQ); 0 where the platform cannot say."""
    sock = writer.get_extra_info("socket")
    if sock is None or _SIOCOUTQ is None:
        return 0
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), _SIOCOUTQ, b"\0\0\0\0"))[0]
    except OSError:
        return 0


class _Start:
    """A request's first bytes (up to `_REQUEST_LINE_BYTES`) and when they came: what a refusal says of the
    request it refuses, whether or not h11 got as far as parsing its head."""

    _ID = re.compile(rb"\r\nx-request-id:[ \t]*([^\r\n]*?)[ \t]*\r\n", re.I)

    def __init__(self) -> None:
        self.data = bytearray()
        self.began: float | None = None

    def add(self, data: bytes) -> None:
        if self.began is None:
            self.began = time.monotonic()
        if len(self.data) < _REQUEST_LINE_BYTES:
            self.data += data[:_REQUEST_LINE_BYTES - len(self.data)]

    def describe(self, refused: Refused) -> None:
        refused.began = self.began
        line, sep, _ = self.data.partition(b"\r\n")
        parts = line.split(b" ")
        if not sep or len(parts) != 3 or not parts[1].startswith(b"/"):
            return  # the request line has not all arrived
        refused.method = parts[0].decode("latin-1")
        refused.path = parts[1].split(b"?", 1)[0].decode("latin-1")
        head = self.data.split(b"\r\n\r\n", 1)[0] + b"\r\n"
        found = self._ID.search(head)
        if found is not None and REQUEST_ID.fullmatch(given := found.group(1).decode("latin-1")):
            refused.request_id = given


def _close(response: Any) -> None:
    """WSGI: the server calls the iterable's close(), if it has one, once it is done with it."""
    close = getattr(response, "close", None)
    if close is not None:
        close()


def _no_write(data: bytes) -> None:
    raise RuntimeError("pagoda's server does not support the WSGI write() callable; return an iterable")
