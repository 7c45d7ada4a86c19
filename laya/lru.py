"""A least-recently-used cache bounded by bytes, not entries.

A count bound says nothing about memory when entries differ in size by five orders of magnitude (a
three-word question vs. 900 KB of instructions): 4096 entries of the latter were 30 GB. Written here rather
than taken from `cachetools` (its `LRUCache(getsizeof=)` does the same) because the project has no such
dependency and this is a dozen lines; it needs its own lock either way, since request threads share it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any


class ByteLRU:
    """`get(key, compute)`: the cached value, else `compute()` stored if its `sizeof` fits `max_bytes`.

    `compute` runs outside the lock (two threads may compute the same value once each; both results are
    equal, the second replaces the first). An entry larger than the whole budget is returned, not kept."""

    def __init__(self, max_bytes: int, sizeof: Callable[[Hashable, Any], int]):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._sizeof = sizeof
        self._entries: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return found[0]
            self.misses += 1
        value = compute()
        size = self._sizeof(key, value)
        if size > self.max_bytes:
            return value
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._entries[key] = (value, size)
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, (_, dropped) = self._entries.popitem(last=False)
                self._bytes -= dropped
        return value

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"entries": len(self._entries), "bytes": self._bytes, "max_bytes": self.max_bytes,
                    "hits": self.hits, "misses": self.misses}
