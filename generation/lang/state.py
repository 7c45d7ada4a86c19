"""A running program's state: its text, variables and chat messages, and the worker that runs its calls.

`s += call` returns at once: the call is queued on the state's own worker thread, and the program only
waits where it reads (`s["name"]`, `s.text()`, a fork). So the branches of a fork, each a state with its
own worker, generate at the same time, and the engine batches them. A call that fails stops its state's
later calls; the error (naming the program line) is raised where the program next reads the state, and
by `Program.run` when the program ends.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from generation.lang.backend import Backend
from generation.lang.errors import CallSite, LangError, UnknownVariable, call_site
from generation.lang.ir import (
    Expr,
    Exprs,
    Gen,
    GenParams,
    RoleBegin,
    RoleEnd,
    Select,
    Text,
    as_expr,
    role_block,
)


class Run:
    """One program run: its backend, the defaults of its `gen`s, its states, and the prefixes its forks
    shared (released when their fork joins, or when the run ends)."""

    def __init__(self, backend: Backend, defaults: GenParams, stream: bool) -> None:
        self.backend = backend
        self.defaults = defaults
        self.stream = stream
        self.finished = threading.Event()
        self._lock = threading.Lock()
        self._states: list[ProgramState] = []
        self._handles: list[Any] = []

    def add(self, state: ProgramState) -> None:
        with self._lock:
            self._states.append(state)

    def share(self, handle: Any) -> None:
        if handle is not None:
            with self._lock:
                self._handles.append(handle)

    def unshare(self, handle: Any) -> None:
        with self._lock:
            if handle is None or handle not in self._handles:
                return
            self._handles.remove(handle)
        self.backend.release(handle)

    def finish(self) -> None:
        """Let every state's queued calls end, give back what the forks shared, stop the workers."""
        with self._lock:
            states = list(self._states)
        for state in states:
            state._drain()
        with self._lock:
            handles, self._handles = self._handles, []
        for handle in handles:
            self.backend.release(handle)
        for state in states:
            state._close()
        self.finished.set()
        for state in states:
            state._notify()


@dataclass
class _OpenRole:
    role: str
    content_start: int
    suffix: str


class ProgramState:
    """What a program function receives as `s`."""

    def __init__(self, run: Run, *, text: str = "", variables: dict | None = None, messages: list | None = None,
                 role: _OpenRole | None = None, shared: Any = None) -> None:
        self._run = run
        self._shared = shared  # the fork prefix this branch starts with, until its first model call
        self._text = text
        self._fork_start = len(text)
        self._vars: dict[str, Any] = dict(variables or {})
        self._meta: dict[str, Any] = {}
        self._messages: list[dict[str, str]] = list(messages or [])
        self._role = role
        self._streaming: dict[str, str] = {}  # a variable's text so far, while its gen streams
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagoda-lang")
        self._last: Future | None = None
        self._closed = False
        self.ret_value: Any = None  # what the program function returned
        run.add(self)

    # ---- appending calls --------------------------------------------------------------------------

    def __iadd__(self, other: Expr | str) -> ProgramState:
        self._submit(as_expr(other, call_site("s += ...")))
        return self

    def _submit(self, expr: Expr) -> None:
        with self._cond:
            if self._closed:
                raise LangError(expr.site, "this state is finished (its program ended or its fork joined)")
            self._last = self._worker.submit(self._execute, expr)

    def _role_scope(self, role: str, expr: Expr | str | None, site: CallSite):
        if expr is not None:
            self._submit(role_block(role, expr, site))
            return None

        @contextmanager
        def scope() -> Iterator[None]:
            self._submit(RoleBegin(role, site))
            yield
            self._submit(RoleEnd(role, site))

        return scope()

    def system(self, expr: Expr | str | None = None):
        """`s.system("...")` appends a system block; `with s.system():` wraps what the body appends."""
        return self._role_scope("system", expr, call_site("s.system()"))

    def user(self, expr: Expr | str | None = None):
        return self._role_scope("user", expr, call_site("s.user()"))

    def assistant(self, expr: Expr | str | None = None):
        return self._role_scope("assistant", expr, call_site("s.assistant()"))

    # ---- reading ----------------------------------------------------------------------------------

    def sync(self) -> None:
        """Wait until every call appended so far has run."""
        last = self._last
        if last is not None:
            last.result()

    def text(self) -> str:
        self.sync()
        return self._text

    def messages(self) -> list[dict[str, str]]:
        """The role blocks so far as chat messages (`{"role", "content"}`)."""
        self.sync()
        return [dict(m) for m in self._messages]

    def error(self) -> BaseException | None:
        """The failure that stopped this state's calls, if any."""
        self.sync()
        return self._error

    def __getitem__(self, name: str) -> Any:
        site = call_site(f"s[{name!r}]")
        self.sync()
        if name in self._vars:
            return self._vars[name]
        if self._error is not None:
            raise self._error
        raise UnknownVariable(site, name, list(self._vars))

    def __setitem__(self, name: str, value: Any) -> None:
        self.sync()
        self._vars[name] = value

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self._vars

    def get_meta_info(self, name: str) -> dict | None:
        """What the backend said about the call that set `name` (token counts, finish reason, choice
        scores); None for a variable the program set itself."""
        site = call_site(f"get_meta_info({name!r})")
        self.sync()
        if name not in self._vars:
            raise UnknownVariable(site, name, list(self._vars))
        return self._meta.get(name)

    def text_iter(self, name: str | None = None) -> Iterator[str]:
        """The text as it is written, piece by piece, until the program ends (with `name`: that variable's
        text until its call ends). Pieces arrive token by token for `run(stream=True)`; otherwise the
        text comes in one piece once written."""
        site = call_site(f"text_iter({name!r})" if name else "text_iter()")
        if not self._run.stream:
            yield self.text() if name is None else self[name]
            return
        sent = 0
        while True:
            with self._cond:
                while True:
                    current, done = self._progress(name)
                    if (current is not None and len(current) > sent) or done:
                        break
                    self._cond.wait()
            if current is not None and len(current) > sent:
                yield current[sent:]
                sent = len(current)
                continue
            if name is not None and current is None:
                raise self._error if self._error is not None else UnknownVariable(site, name, list(self._vars))
            return

    def _progress(self, name: str | None) -> tuple[str | None, bool]:
        """Under the lock: the text so far and whether it is complete."""
        ended = self._run.finished.is_set() or self._error is not None
        if name is None:
            return self._text, ended
        if name in self._streaming:
            return self._streaming[name], ended
        value = self._vars.get(name)
        return (None if value is None else str(value)), ended or name in self._vars

    def fork(self, size: int = 1) -> ForkGroup:
        """`size` states that continue this one's text (variables and messages copied). Before more than
        one, the backend shares the prefix (the local engine pins its KV), so every branch starts with it
        computed."""
        site = call_site(f"fork({size})")
        if not isinstance(size, int) or size < 1:
            raise LangError(site, "fork needs a positive int number of branches")
        self.sync()
        if self._error is not None:
            raise self._error
        handle = None
        if size > 1 and self._text:
            handle = self._run.backend.share_prefix(self._text, site)
            self._run.share(handle)
        role = None if self._role is None else _OpenRole(self._role.role, self._role.content_start, self._role.suffix)
        branches = [ProgramState(self._run, text=self._text, variables=self._vars, messages=self._messages, role=role,
                                 shared=handle) for _ in range(size)]
        return ForkGroup(branches, self, handle)

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"

    # ---- the worker -------------------------------------------------------------------------------

    def _execute(self, expr: Expr) -> None:
        if self._error is not None:
            return
        try:
            self._run_expr(expr)
        except LangError as exc:
            self._fail(exc)
        except Exception as exc:
            error = LangError(expr.site, f"{type(exc).__name__}: {exc}")
            error.__cause__ = exc
            self._fail(error)

    def _run_expr(self, expr: Expr) -> None:
        if isinstance(expr, Exprs):
            for item in expr.items:
                self._run_expr(item)
        elif isinstance(expr, Text):
            self._append(expr.value)
        elif isinstance(expr, Gen):
            self._gen(expr)
        elif isinstance(expr, Select):
            self._select(expr)
        elif isinstance(expr, RoleBegin):
            self._role_begin(expr)
        elif isinstance(expr, RoleEnd):
            self._role_end(expr)
        else:
            raise LangError(expr.site, f"cannot run a {type(expr).__name__}")

    def _append(self, piece: str, name: str | None = None) -> None:
        with self._cond:
            self._text += piece
            if name is not None and name in self._streaming:
                self._streaming[name] += piece
            self._cond.notify_all()

    def _set(self, name: str | None, value: Any, meta: dict | None) -> None:
        if name is None:
            return
        with self._cond:
            self._vars[name] = value
            self._meta[name] = meta
            self._streaming.pop(name, None)
            self._cond.notify_all()

    def _gen(self, expr: Gen) -> None:
        params = expr.params.over(self._run.defaults)
        start = len(self._text)
        on_text: Callable[[str], None] | None = None
        if self._run.stream:
            with self._cond:
                if expr.name is not None:
                    self._streaming[expr.name] = ""

            def on_text(piece: str) -> None:
                self._append(piece, expr.name)

        shared, self._shared = self._shared, None
        out, meta = self._run.backend.generate(self._text, params, expr.site, on_text, shared)
        with self._cond:
            self._text = self._text[:start] + out  # a stream's pieces add up to `out`; this keeps it exact
        self._set(expr.name, out, meta)

    def _select(self, expr: Select) -> None:
        shared, self._shared = self._shared, None
        scores = self._run.backend.choice_scores(self._text, expr.choices, expr.method.needs_unconditional, expr.site,
                                                 shared)
        index, meta = expr.method(scores)
        self._append(expr.choices[index])
        self._set(expr.name, expr.choices[index], meta)

    def _role_begin(self, expr: RoleBegin) -> None:
        if self._role is not None:
            raise LangError(expr.site, f"a {expr.role} block inside the open {self._role.role} block: roles do not nest")
        template = self._run.backend.chat_template()
        if template is None:
            raise LangError(expr.site, "the backend knows no chat template for this model (an HttpBackend reads "
                                       "it from the model's files: give HttpBackend(..., model_path=...))")
        try:
            prefix, suffix = template.wrap(expr.role, self._messages)
        except Exception as exc:
            raise LangError(expr.site, f"the chat template failed: {type(exc).__name__}: {exc}") from exc
        self._append(prefix)
        self._role = _OpenRole(expr.role, len(self._text), suffix)

    def _role_end(self, expr: RoleEnd) -> None:
        if self._role is None or self._role.role != expr.role:
            open_role = f"the open block is {self._role.role}" if self._role else "no block is open"
            raise LangError(expr.site, f"ends a {expr.role} block, but {open_role}")
        content = self._text[self._role.content_start:].lstrip()  # as SGLang keeps a message's content
        self._append(self._role.suffix)
        self._messages.append({"role": expr.role, "content": content})
        self._role = None

    def _fail(self, error: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()

    def _drain(self) -> None:
        """Wait for the queued calls without raising (their failures are recorded on the state)."""
        last = self._last
        if last is not None:
            last.exception()

    def _close(self) -> None:
        with self._cond:
            self._closed = True
        self._worker.shutdown(wait=False)

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify_all()


class ForkGroup:
    """The branches `fork(n)` made. `forks += x` appends `x` to each (a callable is called with the branch's
    index, a list gives one item per branch); `join()` brings their variables back."""

    def __init__(self, states: list[ProgramState], parent: ProgramState, handle: Any) -> None:
        self.states = states
        self._parent = parent
        self._handle = handle

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: Any) -> ForkGroup:
        if isinstance(other, list | tuple):
            if len(other) != len(self.states):
                raise LangError(call_site("forks += [...]"), f"{len(other)} items for {len(self.states)} branches")
            for state, item in zip(self.states, other):
                state += item
        elif callable(other) and not isinstance(other, Expr):
            for i, state in enumerate(self.states):
                state += other(i)
        else:
            for state in self.states:
                state += other
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every branch, then, with `gather_variable`, give the parent each variable the branches
        set (and it had not) as a list in branch order (None for a branch that did not set it); with
        `concate_and_append`, append each branch's new text to the parent's, in branch order. A branch's
        failure is raised here."""
        site = call_site(f"join({mode!r})")
        if mode not in ("gather_variable", "concate_and_append"):
            raise LangError(site, f"join mode must be 'gather_variable' or 'concate_and_append', got {mode!r}")
        for state in self.states:
            state._drain()
        try:
            failed = next((s._error for s in self.states if s._error is not None), None)
            if failed is not None:
                raise failed
            parent = self._parent
            parent.sync()
            if mode == "gather_variable":
                new = [k for k in dict.fromkeys(k for s in self.states for k in s._vars) if k not in parent._vars]
                for k in new:
                    parent._vars[k] = [s._vars.get(k) for s in self.states]
                    parent._meta[k] = [s._meta.get(k) for s in self.states]
            else:
                parent += "".join(s._text[s._fork_start:] for s in self.states)
        finally:
            self._parent._run.unshare(self._handle)
            for state in self.states:
                state._close()
