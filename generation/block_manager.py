"""Reference-counted bookkeeping for the paged KV pool.

The KV tensors themselves live in the model runner; this class only decides which block ids are in
use and by how many holders (running sequences, the prefix cache, pins). A block
goes back to the free list when its last holder lets go, so "free + held = pool" is an invariant the
tests can check after every request.
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self) -> int | None:
        """A fresh block with one reference, or None when the pool is exhausted (caller evicts or preempts)."""
        if not self.free:
            return None
        block = self.free.popleft()
        self.ref[block] = 1
        return block

    def incref(self, block: int) -> None:
        if self.ref[block] <= 0:
            raise RuntimeError(f"block {block} is free; cannot share it")
        self.ref[block] += 1

    def decref(self, block: int) -> bool:
        """Drop one reference; True when that freed the block."""
        if self.ref[block] <= 0:
            raise RuntimeError(f"block {block} released more often than held")
        self.ref[block] -= 1
        if self.ref[block] == 0:
            self.free.append(block)
            return True
        return False

    def shared(self, block: int) -> bool:
        """Another holder sees this block, so writing into it needs a private copy first."""
        return self.ref[block] > 1

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)
