"""What a program's state asks of a model: the backend contract, and the process-wide default backend.

Two backends implement it: `LocalBackend` (the engine in this process, `backend_local.py`) and
`HttpBackend` (a `/generate` server, pagoda's or SGLang's, `backend_http.py`). Every call may come from
any thread at once: each program state runs its calls on its own worker thread, and forked states run
side by side, which is what lets the engine batch the branches of a fork.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from generation.lang.chat_template import ChatTemplate
from generation.lang.choices import ChoiceScores
from generation.lang.errors import CallSite
from generation.lang.ir import GenParams

OnText = Callable[[str], None]


class Backend:
    def chat_template(self) -> ChatTemplate | None:
        """The model's role blocks, or None when the backend cannot know the template."""
        return None

    def generate(self, text: str, params: GenParams, site: CallSite, on_text: OnText | None = None,
                 shared: Any = None) -> tuple[str, dict]:
        """Continue `text` with fully resolved `params`; returns the new text and SGLang-shaped meta info
        (`prompt_tokens`, `completion_tokens`, `cached_tokens`, `finish_reason`, logprobs if asked).
        `on_text` receives the new text piece by piece while it is generated; `shared` is the handle of the
        fork prefix `text` starts with, on a branch's first call. Raises `LangError` at `site`."""
        raise NotImplementedError

    def choice_scores(self, text: str, choices: list[str], unconditional: bool, site: CallSite,
                      shared: Any = None) -> ChoiceScores:
        """The scored tokens of each choice after `text` (see `generation.lang.choices`)."""
        raise NotImplementedError

    def share_prefix(self, text: str, site: CallSite) -> Any:
        """Before a fork: make `text` cheap to continue many times. Returns a handle for `release` and for
        each branch's first call."""
        return None

    def release(self, handle: Any) -> None:
        """The fork that shared a prefix has joined (or its program ended)."""


_default: Backend | None = None


def set_default_backend(backend: Backend) -> None:
    """The backend `Program.run` and `run_batch` use when they are not given one."""
    global _default
    if not isinstance(backend, Backend):
        raise TypeError("set_default_backend: give a LocalBackend or an HttpBackend")
    _default = backend


def default_backend() -> Backend | None:
    return _default
