"""The one switch over prefix caching: `radix`, `apc` or `none`, all over the same block pool.

A cache holds one reference on every block it stores, so a cached block survives the request that
computed it; eviction drops that reference. Only full blocks are cached (a partially filled block
changes as its owner decodes), and `match` never takes a reference itself: the caller that adopts
the blocks does.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from generation.block_manager import BlockManager


class PrefixCache:
    """No caching: every request computes its whole prompt. The baseline the other backends beat."""

    def __init__(self, blocks: BlockManager) -> None:
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.evictions = 0

    def match(self, tokens: Seq[int], salt: Any = None) -> tuple[list[int], Any]:
        """Blocks holding the longest cached block-aligned prefix of `tokens`, and a handle to lock it."""
        return [], None

    def insert(self, tokens: Seq[int], blocks: Seq[int], salt: Any = None) -> Any:
        """Offer full blocks of computed KV; returns a handle covering the whole inserted prefix."""
        return None

    def lock(self, handle: Any) -> None:
        """Protect a matched/inserted prefix from eviction while a request or checkpoint uses it."""

    def unlock(self, handle: Any) -> None:
        pass

    def evict(self, num_blocks: int) -> int:
        """Free up to `num_blocks` least-recently-used unlocked blocks; returns how many were freed."""
        return 0

    @property
    def num_cached_blocks(self) -> int:
        return 0


def make_prefix_cache(backend: str, blocks: BlockManager) -> PrefixCache:
    if backend == "radix":
        from generation.radix_cache import RadixCache

        return RadixCache(blocks)
    if backend == "apc":
        from generation.block_hash_cache import BlockHashCache

        return BlockHashCache(blocks)
    if backend == "none":
        return PrefixCache(blocks)
    raise ValueError(f"EngineConfig.cache_backend: unknown backend {backend!r}")
