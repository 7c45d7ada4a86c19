"""The prefix-cache protocol, the `none` backend, and the `cache_backend` switch.

A cache holds one reference on every block it stores, so a cached block survives the request that
computed it; eviction drops that reference. Only full blocks are cached (a partially filled block
changes as its owner decodes), and `match` never takes a reference itself: the caller that adopts
the blocks does. The backends share no code, only this protocol, so none of them imports another.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any, Protocol, runtime_checkable

from generation.block_hash_cache import BlockHashCache
from generation.block_manager import BlockManager
from generation.radix_cache import RadixCache


@runtime_checkable
class PrefixCache(Protocol):
    evictions: int  # blocks dropped by eviction so far

    def match(self, tokens: Seq[int], salt: Any = None) -> tuple[list[int], Any]:
        """Blocks holding the longest cached block-aligned prefix of `tokens`, and a handle to lock it."""
        ...

    def insert(self, tokens: Seq[int], blocks: Seq[int], salt: Any = None) -> Any:
        """Offer full blocks of computed KV; returns a handle covering the whole inserted prefix."""
        ...

    def lock(self, handle: Any) -> None:
        """Protect a matched/inserted prefix from eviction while a request or pin uses it."""
        ...

    def unlock(self, handle: Any) -> None: ...

    def evict(self, num_blocks: int) -> int:
        """Free up to `num_blocks` least-recently-used unlocked blocks; returns how many were freed."""
        ...

    @property
    def num_cached_blocks(self) -> int: ...


class NoPrefixCache:
    """`none`: every request computes its whole prompt. The baseline the other backends beat."""

    def __init__(self, blocks: BlockManager) -> None:
        self.evictions = 0

    def match(self, tokens: Seq[int], salt: Any = None) -> tuple[list[int], Any]:
        return [], None

    def insert(self, tokens: Seq[int], blocks: Seq[int], salt: Any = None) -> Any:
        return None

    def lock(self, handle: Any) -> None:
        pass

    def unlock(self, handle: Any) -> None:
        pass

    def evict(self, num_blocks: int) -> int:
        return 0

    @property
    def num_cached_blocks(self) -> int:
        return 0


BACKENDS: dict[str, type] = {"none": NoPrefixCache, "radix": RadixCache, "hashed": BlockHashCache}


def make_prefix_cache(backend: str, blocks: BlockManager) -> PrefixCache:
    if backend not in BACKENDS:
        raise ValueError(f"EngineConfig.cache_backend: unknown backend {backend!r} (one of {sorted(BACKENDS)})")
    return BACKENDS[backend](blocks)
