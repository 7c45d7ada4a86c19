"""One thread owns an Engine and steps it; any thread submits requests, reads their events, aborts them.

The engine is single-threaded by design (one forward per step over every running request), while a
server has many request threads: an OpenAI-style API streaming tokens, SGLang-style batch calls,
prefix pinning. The loop is the one place where those meet. Callers never touch the engine: `submit`
validates in the caller's thread (so bad input fails at once, naming the field) and hands the request
to the loop thread through an inbox; the loop thread adds it between steps, steps while anything is in
flight, and routes every event to its request's queue. Between steps it also runs aborts, deadline
expiries and the few engine calls offered here (`pin`, `unpin`, `stats`).

Every request ends with exactly one `GenerationOutput` on its queue, after its `TokenEvent`s, whatever
happens: a normal end (`stop`, `length`), `abort` (the caller's, or shutdown), `deadline`, or `error`.
An exception inside a step fails every request in flight with `error` set (the KV state of that step
cannot be trusted) and the loop goes on serving new requests; a processor's exception fails only its
own request.
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from functools import partial
from typing import Any, TypeVar

from generation.config import InvalidParam, SamplingParams, thread_count_problem
from generation.engine import Engine, GenerationOutput, Prompt, TokenEvent

log = logging.getLogger(__name__)
T = TypeVar("T")


class QueueFull(RuntimeError):
    """More requests are waiting than `EngineLoop.max_waiting` allows (an HTTP server answers 503)."""


class RequestHandle:
    """One submitted request: its id, and the queue its events arrive on (TokenEvents, then one output)."""

    def __init__(self, request_id: str, loop: EngineLoop, index: int = 0,
                 events: queue.SimpleQueue | None = None) -> None:
        self.request_id = request_id
        self.index = index
        self.events: queue.SimpleQueue[TokenEvent | GenerationOutput] = events or queue.SimpleQueue()
        self.output: GenerationOutput | None = None  # set once a reader has taken the final event
        self._loop = loop

    def __iter__(self) -> Iterator[TokenEvent]:
        """Token events until the request ends; the final output is then `self.output`."""
        while self.output is None:
            event = self.events.get()
            if isinstance(event, GenerationOutput):
                self.output = event
            else:
                yield event

    def result(self, timeout: float | None = None) -> GenerationOutput:
        """Wait for the end (token events are skipped); TimeoutError after `timeout` seconds."""
        end = None if timeout is None else time.monotonic() + timeout
        while self.output is None:
            try:
                event = self.events.get(timeout=None if end is None else max(0.0, end - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"request {self.request_id!r}: no result within {timeout} s") from None
            if isinstance(event, GenerationOutput):
                self.output = event
        return self.output

    def abort(self) -> None:
        self._loop.abort(self.request_id)


class BatchHandle:
    """Requests submitted together (a prompt list, n samples of one prompt): one queue for all their events,
    each tagged with its request's position in the batch (`event.index`), so one reader serves them all."""

    def __init__(self, handles: list[RequestHandle], events: queue.SimpleQueue) -> None:
        self.handles = handles
        self.events = events
        self.outputs: list[GenerationOutput | None] = [None] * len(handles)

    @property
    def request_ids(self) -> list[str]:
        return [h.request_id for h in self.handles]

    def __iter__(self) -> Iterator[TokenEvent | GenerationOutput]:
        """Every event, token events and the outputs, until each request has ended (outputs also land in
        `self.outputs`). `timeout` per event is the caller's business: an abort or deadline always ends it."""
        left = sum(out is None for out in self.outputs)
        while left:
            event = self.events.get()
            if isinstance(event, GenerationOutput):
                self.outputs[event.index] = event
                left -= 1
            yield event

    def abort(self) -> None:
        for handle in self.handles:
            handle.abort()


class EngineLoop:
    """Owns `engine` from construction until `close()`; nothing else may call the engine meanwhile.

    `max_waiting` bounds the requests not yet running (submitted but not added, or waiting in the
    scheduler, preempted ones included); past it `submit` raises QueueFull. `num_threads`: torch intra-op
    threads of the loop thread, set in that thread (another model in the same process, stepped by its own
    thread, sets its own)."""

    def __init__(self, engine: Engine, *, max_waiting: int | None = None, num_threads: int | None = None,
                 name: str = "pagoda-engine") -> None:
        if max_waiting is not None and (isinstance(max_waiting, bool) or not isinstance(max_waiting, int)
                                        or max_waiting < 0):
            raise InvalidParam(f"EngineLoop.max_waiting: must be an integer >= 0 (or None), got {max_waiting!r:.40}",
                               "max_waiting")
        problem = thread_count_problem(num_threads)
        if problem:
            raise InvalidParam(f"EngineLoop.num_threads: {problem}", "num_threads")
        self.engine = engine
        self.max_waiting = max_waiting
        self.num_threads = num_threads
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._handles: dict[str, RequestHandle] = {}  # every request not ended yet
        self._not_added = 0  # submitted, still in the inbox
        self._engine_waiting = 0  # the engine's waiting count after the loop's last step
        # monotonic time the last engine step ended: read without the loop (a float is written whole), so a
        # health check can tell a busy engine (steps still ending) from a stuck one
        self.last_step_end = 0.0
        self._deadlines: dict[str, float] = {}  # loop thread only
        self._ids = itertools.count()
        self._closed = False  # no new submissions
        self._stopping = False  # loop thread: leave once the in-flight work allows
        self._drain = False
        self._stopped = False  # loop thread gone: commands still queued are answered, not run
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- any thread -------------------------------------------------------------------------------

    def submit(self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None,
               pin: str | None = None, pin_result: bool = False, deadline: float | None = None) -> RequestHandle:
        """Queue a request; its events arrive on the returned handle.

        `pin`/`pin_result` as in `Engine.add_request`. `deadline` is a `time.monotonic()` instant; a
        request still in flight then ends with finish reason `deadline`. Raises ValueError for bad input,
        QueueFull when `max_waiting` requests are already waiting, RuntimeError once closed."""
        params = params or SamplingParams()
        ids = self.engine.check_request(prompt, params, pin=pin)
        _check_deadline(deadline)
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise InvalidParam(f"request_id: must be a non-empty string, got {request_id!r:.40}", "request_id")
        with self._lock:
            self._admit(1)
            if request_id is None:
                request_id = self._fresh_id()
            elif request_id in self._handles:
                raise ValueError(f"request_id: {request_id!r} is already in flight")
            handle = RequestHandle(request_id, self)
            self._queue_add(handle, ids, params, pin, pin_result, deadline)
        return handle

    def submit_batch(self, prompts: list[Prompt], params: SamplingParams | list[SamplingParams], *,
                     pins: list[str | None] | None = None, deadline: float | None = None) -> BatchHandle:
        """Queue several requests at once, all or none: every prompt is validated first, and QueueFull
        counts the whole batch. `params` and `pins` are one per prompt (or one `params` for all). Their
        events share `BatchHandle.events`; `event.index` is the prompt's position."""
        if not isinstance(prompts, list) or not prompts:
            raise ValueError("prompts: give a non-empty list")
        per = params if isinstance(params, list) else [params] * len(prompts)
        pins = pins if pins is not None else [None] * len(prompts)
        if len(per) != len(prompts) or len(pins) != len(prompts):
            raise ValueError(f"params/pins: one per prompt ({len(prompts)})")
        checked = [self.engine.check_request(p, sp, pin=pin) for p, sp, pin in zip(prompts, per, pins)]
        _check_deadline(deadline)
        events: queue.SimpleQueue = queue.SimpleQueue()
        with self._lock:
            self._admit(len(prompts))
            handles = [RequestHandle(self._fresh_id(), self, i, events) for i in range(len(prompts))]
            for handle, ids, sp, pin in zip(handles, checked, per, pins):
                self._queue_add(handle, ids, sp, pin, False, deadline)
        return BatchHandle(handles, events)

    def _admit(self, count: int) -> None:
        """Under the lock: refuse `count` new requests when closed or when they would pass `max_waiting`."""
        if self._closed:
            raise RuntimeError("EngineLoop: closed")
        if self.max_waiting is not None and self._not_added + self._engine_waiting + count > self.max_waiting:
            raise QueueFull(f"EngineLoop: {self._not_added + self._engine_waiting} requests already waiting, "
                            f"{count} more would pass max_waiting={self.max_waiting}")

    def _fresh_id(self) -> str:
        return next(r for r in (f"req-{n}" for n in self._ids) if r not in self._handles)

    def _queue_add(self, handle: RequestHandle, ids: list[int], params: SamplingParams, pin: str | None,
                   pin_result: bool, deadline: float | None) -> None:
        self._handles[handle.request_id] = handle
        self._not_added += 1
        self._inbox.put(partial(self._add, handle, ids, params, pin, pin_result, deadline))

    def abort(self, request_id: str) -> None:
        """End a request (its blocks go back to the pool); its final event says `abort`. Unknown ids are ignored."""
        self._inbox.put(partial(self._abort, request_id, "abort"))

    def pin(self, prompt: Prompt, *, cache_salt: str | None = None, timeout: float | None = None) -> str:
        """Compute `prompt`'s KV and keep it resident until `unpin`; returns the pin id (see `Engine.pin`)."""
        handle = self.submit(prompt, SamplingParams(max_new_tokens=0, cache_salt=cache_salt), pin_result=True)
        try:
            out = handle.result(timeout)
        except TimeoutError:
            handle.abort()
            late = handle.result()  # the final event always comes; a pin finished meanwhile is let go
            if late.pin is not None:
                self.unpin(late.pin)
            raise
        if out.pin is None:
            raise RuntimeError(f"pin: {out.error or 'request ended with ' + out.finish_reason}")
        return out.pin

    def unpin(self, pin_id: str) -> None:
        """Let a pin go (ValueError naming `pin` if unknown); requests still using it keep it until they end."""
        self._call(lambda engine: engine.unpin(pin_id))

    def stats(self) -> dict[str, float]:
        """The engine's counters, read between steps."""
        return self._call(lambda engine: engine.stats())

    def pins(self) -> dict[str, dict[str, int]]:
        """Every pin with its token and block counts (`Engine.pins`)."""
        return self._call(lambda engine: engine.pins())

    def flush_cache(self) -> int:
        """Drop the prefix cache's unused blocks between steps (`Engine.flush_cache`)."""
        return self._call(lambda engine: engine.flush_cache())

    def close(self, *, drain: bool = False, timeout: float | None = None) -> None:
        """Stop accepting requests and end the loop thread. In-flight requests are aborted, or with
        `drain=True` run to completion first; every one gets its final event either way."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._inbox.put(partial(self._stop, drain))
        self._thread.join(timeout)

    def __enter__(self) -> EngineLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, fn: Callable[[Engine], T]) -> T:
        """Run `fn(engine)` on the loop thread between steps; its result or exception comes back here."""
        future: Future[T] = Future()

        def run() -> None:
            if self._stopped:
                future.set_exception(RuntimeError("EngineLoop: closed"))
                return
            try:
                future.set_result(fn(self.engine))
            except Exception as exc:
                future.set_exception(exc)

        with self._lock:
            if self._closed:
                raise RuntimeError("EngineLoop: closed")
            self._inbox.put(run)
        return future.result()

    # ---- loop thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        if self.num_threads:
            import torch

            torch.set_num_threads(self.num_threads)
        try:
            while True:
                self._run_commands(block=self.engine.num_unfinished == 0 and not self._stopping)
                if self._stopping and (not self._drain or self.engine.num_unfinished == 0):
                    break
                self._expire(time.monotonic())
                if self.engine.num_unfinished:
                    self._step()
        except BaseException:
            log.exception("engine loop crashed; ending every request in flight")
        finally:
            self._shut_down()

    def _run_commands(self, block: bool) -> None:
        try:
            command = self._inbox.get() if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            try:
                command()
            except Exception:
                log.exception("engine loop command failed")
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except Exception as exc:
            log.exception("engine step failed; failing the requests in flight")
            self._fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
            return
        self.last_step_end = time.monotonic()
        for event in events:
            self._deliver(event)
        with self._lock:
            self._engine_waiting = self.engine.num_waiting

    def _add(self, handle: RequestHandle, ids: list[int], params: SamplingParams, pin: str | None,
             pin_result: bool, deadline: float | None) -> None:
        with self._lock:
            self._not_added -= 1
        if self._stopped:
            self._deliver(self._unstarted(handle, ids, "abort"))
            return
        try:
            self.engine.add_request(ids, params, request_id=handle.request_id, index=handle.index, pin=pin,
                                    pin_result=pin_result)
        except Exception as exc:  # e.g. its pin was unpinned after submit checked it
            self._deliver(self._unstarted(handle, ids, "error", str(exc)))
            return
        if deadline is not None:
            self._deadlines[handle.request_id] = deadline
        with self._lock:
            self._engine_waiting = self.engine.num_waiting

    def _abort(self, request_id: str, reason: str, error: str | None = None) -> None:
        if self._stopped:
            return
        out = self.engine.abort(request_id, reason=reason, error=error)
        if out is not None:
            self._deliver(out)

    def _expire(self, now: float) -> None:
        for request_id in [r for r, t in self._deadlines.items() if t <= now]:
            self._abort(request_id, "deadline")

    def _deliver(self, event: TokenEvent | GenerationOutput) -> None:
        with self._lock:
            handle = self._handles.get(event.request_id)
            if isinstance(event, GenerationOutput):
                self._handles.pop(event.request_id, None)
                self._deadlines.pop(event.request_id, None)
        if handle is not None:
            handle.events.put(event)

    def _fail_all(self, error: str) -> None:
        """After a failed step: end every request the engine holds (those still in the inbox are unaffected)."""
        with self._lock:
            in_flight = list(self._handles.values())
        for handle in in_flight:
            try:
                out = self.engine.abort(handle.request_id, reason="error", error=error)
            except Exception:
                log.exception("could not release request %s", handle.request_id)
                out = self._unstarted(handle, [], "error", error)
            if out is not None:
                self._deliver(out)

    @staticmethod
    def _unstarted(handle: RequestHandle, ids: list[int], reason: str, error: str | None = None) -> GenerationOutput:
        return GenerationOutput(handle.request_id, handle.index, ids, [], "", 0, reason, error=error)

    def _stop(self, drain: bool) -> None:
        self._stopping, self._drain = True, drain

    def _shut_down(self) -> None:
        with self._lock:
            self._closed = True
        self._stopped = True
        self._run_commands(block=False)  # queued submissions end as aborts, queued calls raise
        with self._lock:
            left = list(self._handles.values())
        for handle in left:
            try:
                out = self.engine.abort(handle.request_id)
            except Exception:
                log.exception("could not release request %s", handle.request_id)
                out = None
            self._deliver(out or self._unstarted(handle, [], "abort"))


def _check_deadline(deadline: Any) -> None:
    """In the caller's thread: the loop thread compares deadlines with the clock, and a value it cannot compare
    there ended every request in flight and closed the loop."""
    if deadline is None:
        return
    if isinstance(deadline, bool) or not isinstance(deadline, int | float) or not math.isfinite(deadline):
        raise InvalidParam(f"deadline: must be a time.monotonic() instant (a finite number) or None, got "
                           f"{deadline!r:.40}", "deadline")
