"""Radix and hashed backends against an LRU reference model: random insert / match / lock / evict sequences.

The reference (`LruReference`) knows nothing of either backend's internals: it keys blocks by their whole
prefix and orders eviction by when each prefix was last walked, so an eviction order other than
least-recently-used-leaf-first fails here for both backends.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from generation.block_manager import BlockManager
from generation.prefix_cache import make_prefix_cache

BS = 2
POOL = 64


class LruReference:
    """What a prefix cache should hold, kept without looking inside one.

    A cached block is known by its whole block-aligned prefix (and salt). Every operation that walks a
    prefix (insert, match, lock) stamps the blocks it passes with the operation's number. Eviction takes
    the unlocked leaf (a block no cached block extends) with the oldest stamp, one block at a time, so a
    prefix goes from its tail inwards and the least recently used prefix goes first. Two blocks of one
    path can share a stamp, two leaves cannot (one operation walks one path), so the order is total.
    The hashed backend evicts exactly this order block by block; the radix backend evicts whole tree
    nodes (it may free a few more than asked), and the blocks it frees must be this order's first ones.
    """

    def __init__(self) -> None:
        self.blocks: dict[tuple, int] = {}
        self.stamp: dict[tuple, int] = {}
        self.locks: dict[int, int] = {}     # block -> how many live locks hold it
        self.clock = 0

    def _keys(self, tokens, salt):
        return [(salt, tuple(tokens[: (i + 1) * BS])) for i in range(len(tokens) // BS)]

    def insert(self, tokens, blocks, salt):
        self.clock += 1
        for key, block in zip(self._keys(tokens, salt), blocks):
            self.blocks.setdefault(key, block)
            self.stamp[key] = self.clock

    def match(self, tokens, salt):
        self.clock += 1
        out = []
        for key in self._keys(tokens, salt):
            if key not in self.blocks:
                break
            out.append(self.blocks[key])
            self.stamp[key] = self.clock
        return out

    def lock(self, blocks):
        for b in blocks:
            self.locks[b] = self.locks.get(b, 0) + 1

    def unlock(self, blocks):
        for b in blocks:
            self.locks[b] -= 1

    def evictable(self) -> int:
        return sum(1 for b in self.blocks.values() if not self.locks.get(b))

    def evict(self, n: int) -> list[int]:
        gone = []
        for _ in range(n):
            extended = {(salt, prefix[:-BS]) for salt, prefix in self.blocks}
            leaves = [k for k, b in self.blocks.items() if k not in extended and not self.locks.get(b)]
            if not leaves:
                break
            oldest = min(leaves, key=self.stamp.__getitem__)
            gone.append(self.blocks.pop(oldest))
            del self.stamp[oldest]
        return gone


# Small alphabets make prefixes share heads; inserts and matches outnumber evictions, and evictions ask
# for few blocks, so most evictions have to choose (a pool-wide eviction tests no order at all).
tokens = st.lists(st.integers(0, 3), min_size=2, max_size=10)
salts = st.sampled_from([None, "t1"])
op = st.one_of(
    st.tuples(st.just("insert"), tokens, salts),
    st.tuples(st.just("insert"), tokens, salts),
    st.tuples(st.just("match"), tokens, salts),
    st.tuples(st.just("match"), tokens, salts),
    st.tuples(st.just("lock"), tokens, salts),
    st.tuples(st.just("unlock"), st.integers(0, 10), st.none()),
    st.tuples(st.just("evict"), st.integers(1, 3), st.none()),
    st.tuples(st.just("evict"), st.integers(1, 3), st.none()),
)


def run_ops(backend: str, ops) -> None:
    pool = BlockManager(POOL, BS)
    cache = make_prefix_cache(backend, pool)
    ref = LruReference()
    locks: list[tuple[list[int], object, object, list[int]]] = []  # (tokens, salt, handle, blocks held)
    for kind, arg, salt in ops:
        if kind == "insert":
            # a "request" computes its own fresh blocks, offers them, then lets go of its references
            fresh = [pool.allocate() for _ in range(len(arg) // BS)]
            if None in fresh:
                for b in fresh:
                    if b is not None:
                        pool.decref(b)
                continue
            cache.insert(arg, fresh, salt)
            ref.insert(arg, fresh, salt)
            for b in fresh:
                pool.decref(b)
        elif kind == "match":
            got, _ = cache.match(arg, salt)
            assert got == ref.match(arg, salt)
        elif kind == "lock":
            got, handle = cache.match(arg, salt)
            assert got == ref.match(arg, salt)
            for b in got:
                pool.incref(b)
            cache.lock(handle)
            ref.lock(got)
            locks.append((arg, salt, handle, got))
        elif kind == "unlock" and locks:
            _, _, handle, got = locks.pop(arg % len(locks))
            cache.unlock(handle)
            ref.unlock(got)
            for b in got:
                pool.decref(b)
        elif kind == "evict":
            before, evictable = pool.num_free, ref.evictable()
            freed = cache.evict(arg)
            assert pool.num_free == before + freed
            if backend == "hashed":
                assert freed == min(arg, evictable)
            else:   # whole radix nodes: at least what was asked (or all there is), never a locked block
                assert min(arg, evictable) <= freed <= evictable
            gone = ref.evict(freed)
            assert len(gone) == freed
            assert all(pool.ref[b] == 0 for b in gone), "the cache evicted other blocks than the LRU ones"
            assert cache.num_cached_blocks == len(ref.blocks)
            for arg_, salt_, _, got in locks:   # locked prefixes survive whole
                assert cache.match(arg_, salt_)[0][: len(got)] == got
                ref.match(arg_, salt_)
        held = sum(1 for r in pool.ref if r)
        assert pool.num_free + held == POOL
        assert held == cache.num_cached_blocks  # only the cache (and locks on cached blocks) hold anything
        assert set(ref.blocks.values()) == {b for b, r in enumerate(pool.ref) if r}
    for _, _, handle, got in locks:
        cache.unlock(handle)
        for b in got:
            pool.decref(b)
    cache.evict(POOL)
    assert pool.num_free == POOL and cache.num_cached_blocks == 0


@settings(max_examples=150, deadline=None)
@given(st.lists(op, min_size=8, max_size=48))
def test_radix_matches_reference(ops):
    run_ops("radix", ops)


@settings(max_examples=150, deadline=None)
@given(st.lists(op, min_size=8, max_size=48))
def test_hashed_matches_reference(ops):
    run_ops("hashed", ops)


def test_radix_evicts_lru_leaf_first():
    pool = BlockManager(8, BS)
    cache = make_prefix_cache("radix", pool)
    for seq in ([1, 1, 2, 2], [1, 1, 3, 3]):
        blocks = [pool.allocate(), pool.allocate()]
        cache.insert(seq, blocks, None)
        for b in blocks:
            pool.decref(b)
    cache.match([1, 1, 3, 3], None)  # touch the second branch
    assert cache.evict(1) == 1
    assert len(cache.match([1, 1, 2, 2], None)[0]) == 1  # the [2, 2] leaf went, shared head stays
    assert len(cache.match([1, 1, 3, 3], None)[0]) == 2


def test_both_backends_evict_the_least_recently_used_prefix_first():
    """A hand-checked case beside the property test: three prefixes inserted a, b, c, then a touched."""
    for backend in ("radix", "hashed"):
        pool = BlockManager(16, BS)
        cache = make_prefix_cache(backend, pool)
        for seq in ([1, 1, 2, 2], [3, 3, 4, 4], [5, 5, 6, 6]):
            blocks = [pool.allocate(), pool.allocate()]
            cache.insert(seq, blocks, None)
            for b in blocks:
                pool.decref(b)
        cache.match([1, 1, 2, 2], None)
        assert cache.evict(2) == 2, backend
        assert cache.match([3, 3, 4, 4], None)[0] == [], backend            # b was least recently used
        assert len(cache.match([5, 5, 6, 6], None)[0]) == 2, backend
        assert len(cache.match([1, 1, 2, 2], None)[0]) == 2, backend


def test_salt_keeps_tenants_apart():
    for backend in ("radix", "hashed"):
        pool = BlockManager(8, BS)
        cache = make_prefix_cache(backend, pool)
        blocks = [pool.allocate(), pool.allocate()]
        cache.insert([5, 6, 7, 8], blocks, "tenant-a")
        assert cache.match([5, 6, 7, 8], "tenant-b")[0] == []
        assert cache.match([5, 6, 7, 8], None)[0] == []
        assert cache.match([5, 6, 7, 8], "tenant-a")[0] == blocks


def test_every_configured_backend_implements_the_protocol():
    from generation.config import CACHE_BACKENDS
    from generation.prefix_cache import BACKENDS, PrefixCache

    assert set(BACKENDS) == set(CACHE_BACKENDS)
    for backend in CACHE_BACKENDS:
        assert isinstance(make_prefix_cache(backend, BlockManager(8, BS)), PrefixCache)
