"""Which workers of one server are serving with their models loaded, shared across gunicorn's fork.

Why: every worker accepts on the same listening socket, so a worker still loading its models (a replacement
after a crash, a slow starter beside a fast one) takes its share of connections and answers them 503
`not_ready` while a sibling could have answered. A worker that sees a loaded sibling on this board does not
accept until it is loaded itself; with none on it (the server's first start) it accepts at once, so `/ready`
answers 503 while loading as a single worker does.

The board is a small array of pids in anonymous shared memory, made by the master before it forks; a worker
writes its pid once its models are loaded and clears it when it stops accepting, and the master clears the
pid of a worker that exited without doing so (killed, crashed). A pid whose process is gone never counts.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections.abc import Iterator

_SLACK = 8  # replacements that start while the workers they replace are still being reaped
_LOCK_WAIT_S = 1.0


class ReadyBoard:
    def __init__(self, workers: int):
        ctx = multiprocessing.get_context("fork")
        self._pids = ctx.RawArray("i", workers + _SLACK)
        self._lock = ctx.Lock()

    def mark(self, pid: int) -> None:
        """Record `pid` as serving loaded; a full board (more live workers than slots) records nothing, which
        only costs that worker's siblings the wait."""
        with self._locked():
            if pid in self._pids[:]:
                return
            for i, held in enumerate(self._pids):
                if held == 0 or not _alive(held):
                    self._pids[i] = pid
                    return

    def clear(self, pid: int) -> None:
        with self._locked():
            for i, held in enumerate(self._pids):
                if held == pid:
                    self._pids[i] = 0

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The lock, or after a second without it none: a worker SIGKILLed inside `mark` or `clear` would hold
        it for good, and a rare race over one slot costs less than a worker that never says it loaded."""
        got = self._lock.acquire(timeout=_LOCK_WAIT_S)
        try:
            yield
        finally:
            if got:
                self._lock.release()

    def other_ready(self, pid: int) -> bool:
        """Whether a live worker other than `pid` is serving loaded."""
        return any(held not in (0, pid) and _alive(held) for held in self._pids[:])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process now holds the pid
        return False
    return True
