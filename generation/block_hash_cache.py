"""The `hashed` backend: automatic prefix caching by chained block hashes (as vLLM does it).

A full block is identified by hash(parent block's hash, its tokens, extra key), so equal hashes mean
equal whole prefixes and lookups need no tree. Each entry keeps its parent hash and tokens too, so a
hash collision can never hand back the wrong KV. Blocks whose only holder is the cache form the LRU
free queue; when a request releases its blocks the tail is queued first, so eviction eats prefixes
from the end and keeps the shared head.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from typing import Any

from generation.block_manager import BlockManager


class BlockHashCache:
    def __init__(self, blocks: BlockManager) -> None:
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.evictions = 0
        self.by_hash: dict[int, tuple[int, int | None, tuple[int, ...], Any]] = {}
        self.hash_of: dict[int, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()

    @property
    def num_cached_blocks(self) -> int:
        return len(self.hash_of)

    def _chain(self, tokens: Seq[int], salt: Any):
        """Yield (page index, hash, parent hash, page tokens) for each full block of `tokens`."""
        bs = self.block_size
        parent = None
        for i in range(len(tokens) // bs):
            page = tuple(tokens[i * bs : (i + 1) * bs])
            h = hash((parent, page, salt))
            yield i, h, parent, page
            parent = h

    def _lookup(self, h: int, parent: int | None, page: tuple[int, ...], salt: Any) -> int | None:
        entry = self.by_hash.get(h)
        if entry is None or entry[1] != parent or entry[2] != page or entry[3] != salt:
            return None
        return entry[0]

    def _touch(self, blocks: Seq[int]) -> None:
        for b in reversed(blocks):  # head ends up most recent, so the tail is evicted first
            self.lru.move_to_end(b)

    def match(self, tokens: Seq[int], salt: Any = None) -> tuple[list[int], Any]:
        matched = []
        for _, h, parent, page in self._chain(tokens, salt):
            block = self._lookup(h, parent, page, salt)
            if block is None:
                break
            matched.append(block)
        self._touch(matched)
        return matched, None

    def insert(self, tokens: Seq[int], blocks: Seq[int], salt: Any = None) -> Any:
        held = []
        for i, h, parent, page in self._chain(tokens, salt):
            if i >= len(blocks):
                break
            block = self._lookup(h, parent, page, salt)
            if block is None and h not in self.by_hash and blocks[i] not in self.hash_of:
                block = blocks[i]
                self.by_hash[h] = (block, parent, page, salt)
                self.hash_of[block] = h
                self.blocks.incref(block)
                self.lru[block] = None
            if block is None:  # a colliding hash owns this slot: stop rather than break the chain
                break
            held.append(block)
        self._touch(held)
        return None

    def lock(self, handle: Any) -> None:
        """Nothing to do: a block a request or pin reads has a second reference, and `evict` skips those."""

    def unlock(self, handle: Any) -> None:
        pass

    def evict(self, num_blocks: int) -> int:
        freed = 0
        for block in list(self.lru):
            if freed >= num_blocks:
                break
            if self.blocks.ref[block] != 1:  # a request or pin still reads it
                continue
            del self.lru[block]
            del self.by_hash[self.hash_of.pop(block)]
            freed += self.blocks.decref(block)
            self.evictions += 1
        return freed
