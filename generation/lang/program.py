"""`@function` programs and how they run: `run` (optionally streaming), `run_batch`, `bind`.

A program is a Python function whose first parameter is the state (`s`); its other parameters are the
program's arguments. `run`'s keyword arguments are the program's arguments, except the sampling
defaults every `gen` of the run starts from (SGLang's names and values: `max_new_tokens=128`,
`temperature=1.0`, `top_p`, `top_k=-1`, `min_p`, `frequency_penalty`, `presence_penalty`, `stop`,
`stop_token_ids`, `ignore_eos`, plus `seed`, `return_logprob`, `top_logprobs_num`), unless the program
itself has a parameter of that name.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from generation.lang.backend import Backend, default_backend
from generation.lang.ir import SGLANG_DEFAULTS, GenParams
from generation.lang.state import ProgramState, Run

SAMPLING_DEFAULTS = tuple(f.name for f in dataclasses.fields(GenParams) if f.name not in ("regex", "json_schema"))


class Program:
    def __init__(self, func: Callable[..., Any], bound: dict[str, Any] | None = None) -> None:
        params = list(inspect.signature(func).parameters.values())
        if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
            raise TypeError(f"@function {func.__name__}: the first parameter must be the state (`s`)")
        self.func = func
        self.bound = dict(bound or {})
        self._signature = inspect.signature(func)
        self.arg_names = [p.name for p in params[1:]]
        functools.update_wrapper(self, func)

    def bind(self, **kwargs: Any) -> Program:
        """The same program with some arguments fixed."""
        unknown = sorted(set(kwargs) - set(self.arg_names))
        if unknown:
            raise TypeError(f"{self.func.__name__}.bind: no parameter {unknown[0]!r}")
        return Program(self.func, {**self.bound, **kwargs})

    def _split(self, args: tuple, kwargs: dict[str, Any]) -> tuple[dict[str, Any], GenParams]:
        """(the program's keyword arguments, the run's gen defaults); TypeError for arguments that fit
        neither, before anything runs."""
        sampling = {k: kwargs.pop(k) for k in list(kwargs) if k in SAMPLING_DEFAULTS and k not in self.arg_names}
        kwargs = {**self.bound, **kwargs}
        self._signature.bind(None, *args, **kwargs)
        return kwargs, dataclasses.replace(SGLANG_DEFAULTS, **sampling)

    def run(self, *args: Any, backend: Backend | None = None, stream: bool = False, **kwargs: Any) -> ProgramState:
        """Run the program and return its final state. A failed call raises its `LangError` here (naming
        the program line). With `stream=True` the program runs in the background and the state is returned
        at once: read it with `state.text_iter()`; a failure is then `state.error()`."""
        kwargs, defaults = self._split(args, kwargs)
        state = ProgramState(Run(_backend(backend), defaults, stream))
        if stream:
            threading.Thread(target=self._body, args=(state, args, kwargs), name="pagoda-lang-program",
                             daemon=True).start()
            return state
        try:
            state.ret_value = self.func(state, *args, **kwargs)
        finally:
            state._run.finish()
        if state._error is not None:
            raise state._error
        return state

    def run_batch(self, batch: list[dict[str, Any] | list | tuple], *, backend: Backend | None = None,
                  num_threads: int | str = "auto", progress_bar: bool = False, **sampling: Any) -> list[ProgramState]:
        """Run the program once per argument set (a dict of keyword arguments, or a list of positional
        ones), `num_threads` at a time ("auto", SGLang's default: all, up to 64), so the backend batches their
        calls.
        Returns the states in order; a failed one is not raised but kept as `state.error()`."""
        unknown = sorted(set(sampling) - set(SAMPLING_DEFAULTS))
        if unknown:
            raise TypeError(f"run_batch: {unknown[0]!r} is not a sampling default ({', '.join(SAMPLING_DEFAULTS)})")
        backend = _backend(backend)
        prepared = []
        for item in batch:
            args, kwargs = (tuple(item), {}) if isinstance(item, list | tuple) else ((), dict(item))
            kwargs, defaults = self._split(args, {**kwargs, **sampling})
            prepared.append((args, kwargs, defaults))
        if not prepared:
            return []
        if num_threads == "auto" or num_threads is None:
            threads = min(len(prepared), 64)
        elif isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"run_batch: num_threads must be 'auto' or an integer >= 1, got {num_threads!r}")
        else:
            threads = num_threads

        def one(item: tuple) -> ProgramState:
            args, kwargs, defaults = item
            state = ProgramState(Run(backend, defaults, False))
            self._body(state, args, kwargs)
            return state

        with ThreadPoolExecutor(threads, thread_name_prefix="pagoda-lang-batch") as pool:
            results = pool.map(one, prepared)
            if progress_bar:
                from tqdm import tqdm

                results = tqdm(results, total=len(prepared), desc=self.func.__name__, unit="program")
            return list(results)

    def _body(self, state: ProgramState, args: tuple, kwargs: dict[str, Any]) -> None:
        """Run the function, keeping any failure on the state rather than raising it."""
        try:
            state.ret_value = self.func(state, *args, **kwargs)
        except BaseException as exc:
            state._fail(exc)
        finally:
            state._run.finish()


def _backend(backend: Backend | None) -> Backend:
    backend = backend or default_backend()
    if backend is None:
        raise ValueError("no backend: pass backend=... or call generation.lang.set_default_backend first")
    return backend


def function(func: Callable[..., Any] | None = None) -> Program | Callable[[Callable[..., Any]], Program]:
    """Decorator: `@function def f(s, question): s += ...` makes `f` a Program (`f.run(question=...)`)."""
    if func is not None:
        return Program(func)
    return Program
