"""Checks of what a command or API caller hands in, shared by laya's commands and distill's, torch-free.

Torch-free because `distill.runtime` (the edge runtime, no torch installed) needs them too: the forbidden
contract in pyproject.toml holds this module to it (`laya.precision`, whose `check_device` imports torch, could
not hold the thread bound).
"""

from __future__ import annotations

import codecs
import os

# torch takes any positive thread count, but its pool segfaults or hangs at the first op on 99999 (4096 runs),
# and onnxruntime hangs building a session's pool of 99999; more threads than any machine here has cores only
# slows a run down, so a count past this is a typo. The same bound as generation.config.MAX_TORCH_THREADS
# (tests/serving/test_config.py holds them equal).
MAX_THREADS = 1024


def check_threads(threads: int | None, where: str = "--threads") -> int | None:
    """`threads` as given (None: the runtime's default), once it is a count torch and onnxruntime can run; an
    API caller gets the same refusal as the flags, instead of a segfault or a hang at the first op."""
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or not 1 <= threads <= MAX_THREADS):
        raise ValueError(f"{where}: must be an integer from 1 to {MAX_THREADS}, got {threads!r}")
    return threads


def check_utf8(path: str | os.PathLike, flag: str) -> None:
    """Refuse a text data file that is not UTF-8, naming the flag, the first bad byte and where it is.

    Readers met one with a bare "'utf-8' codec can't decode byte 0xe9 in position 14" (a position in one of
    their read buffers, not in the file, and no flag or file named); `datasets`' JSON reader took it and
    failed only when a row's text was read, or kept going on the rows before it."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, lines = 0, 1
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 16), b""):
            pending = decoder.getstate()[0]
            try:
                decoder.decode(block)
            except UnicodeDecodeError as exc:
                _bad(path, flag, offset - len(pending) + exc.start, lines + (pending + block)[:exc.start].count(b"\n"),
                     (pending + block)[exc.start])
            offset += len(block)
            lines += block.count(b"\n")
        pending = decoder.getstate()[0]
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:    # the file ends inside a character
            _bad(path, flag, offset - len(pending), lines, pending[0])


def _bad(path: str | os.PathLike, flag: str, offset: int, line: int, byte: int) -> None:
    raise ValueError(f"{flag}: {path} is not UTF-8: byte {byte:#04x} at offset {offset} (line {line}); "
                     "save it as UTF-8")
