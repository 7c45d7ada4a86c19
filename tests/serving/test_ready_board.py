"""The ready board on its own (serving/ready_board.py): what counts as a loaded sibling, across a fork."""

from __future__ import annotations

import os
import threading
import time

from serving.ready_board import ReadyBoard


def _dead_pid() -> int:
    """The pid of a child that has exited and been reaped."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def test_a_sibling_counts_only_while_it_is_marked_and_alive():
    board = ReadyBoard(workers=2)
    me, sibling = os.getpid(), os.getppid()
    assert not board.other_ready(me)
    board.mark(me)
    assert not board.other_ready(me)          # itself is no sibling
    board.mark(sibling)
    assert board.other_ready(me)
    board.clear(sibling)
    assert not board.other_ready(me)
    dead = _dead_pid()
    board.mark(dead)                          # killed before its pid was cleared
    assert not board.other_ready(me)


def test_a_mark_made_in_a_forked_worker_is_seen_by_its_siblings():
    board = ReadyBoard(workers=2)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        board.mark(os.getpid())
        os.write(write, b"x")
        time.sleep(30)                        # alive until the parent has looked
        os._exit(0)
    try:
        os.read(read, 1)
        assert board.other_ready(os.getpid())
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        os.close(read)
        os.close(write)
    assert not board.other_ready(os.getpid())


def test_a_lock_left_held_by_a_killed_worker_does_not_stop_the_others():
    board = ReadyBoard(workers=2)
    pid = os.fork()
    if pid == 0:
        board._lock.acquire()                 # killed inside mark or clear
        os._exit(0)
    os.waitpid(pid, 0)
    marking = threading.Thread(target=board.mark, args=(os.getppid(),), daemon=True)
    marking.start()
    marking.join(30)                          # without the lock's timeout it waits for ever
    assert not marking.is_alive()
    assert board.other_ready(os.getpid())
