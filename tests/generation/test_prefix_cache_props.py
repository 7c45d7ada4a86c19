"""Radix and hashed backends against a naive reference: random insert / match / lock / evict sequences."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from generation.block_manager import BlockManager
from generation.prefix_cache import make_prefix_cache

BS = 2
POOL = 64


class Naive:
    """Every inserted block-aligned prefix -> its first-inserted block, as a plain dict."""

    def __init__(self) -> None:
        self.blocks: dict[tuple, int] = {}

    def insert(self, tokens, blocks, salt):
        for i in range(min(len(tokens) // BS, len(blocks))):
            self.blocks.setdefault((salt, tuple(tokens[: (i + 1) * BS])), blocks[i])

    def match(self, tokens, salt):
        out = []
        for i in range(len(tokens) // BS):
            b = self.blocks.get((salt, tuple(tokens[: (i + 1) * BS])))
            if b is None:
                break
            out.append(b)
        return out


tokens = st.lists(st.integers(0, 2), min_size=0, max_size=12)
op = st.one_of(
    st.tuples(st.just("insert"), tokens, st.sampled_from([None, "t1"])),
    st.tuples(st.just("match"), tokens, st.sampled_from([None, "t1"])),
    st.tuples(st.just("lock"), tokens, st.sampled_from([None, "t1"])),
    st.tuples(st.just("unlock"), st.integers(0, 10), st.none()),
    st.tuples(st.just("evict"), st.integers(1, 8), st.none()),
)


def run_ops(backend: str, ops) -> None:
    pool = BlockManager(POOL, BS)
    cache = make_prefix_cache(backend, pool)
    naive = Naive()
    locks: list[tuple[list[int], object, list[int]]] = []  # (tokens, handle, blocks held like a request)
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
            naive.insert(arg, fresh, salt)
            for b in fresh:
                pool.decref(b)
        elif kind == "match":
            got, _ = cache.match(arg, salt)
            assert got == naive.match(arg, salt)
        elif kind == "lock":
            got, handle = cache.match(arg, salt)
            for b in got:
                pool.incref(b)
            cache.lock(handle)
            locks.append((arg, salt, handle, got))
        elif kind == "unlock" and locks:
            arg_, salt_, handle, got = locks.pop(arg % len(locks))
            cache.unlock(handle)
            for b in got:
                pool.decref(b)
        elif kind == "evict":
            before = pool.num_free
            freed = cache.evict(arg)
            assert pool.num_free == before + freed
            # the reference forgets whatever the cache dropped; locked prefixes must survive whole
            naive.blocks = {k: b for k, b in naive.blocks.items() if pool.ref[b] > 0 and b in _cached(cache)}
            for arg_, salt_, _, got in locks:
                assert cache.match(arg_, salt_)[0][: len(got)] == got
        held = sum(1 for r in pool.ref if r)
        assert pool.num_free + held == POOL
        assert held == cache.num_cached_blocks  # only the cache (and locks on cached blocks) hold anything
    for _, _, handle, got in locks:
        cache.unlock(handle)
        for b in got:
            pool.decref(b)
    cache.evict(POOL)
    assert pool.num_free == POOL and cache.num_cached_blocks == 0


def _cached(cache) -> set[int]:
    if hasattr(cache, "hash_of"):
        return set(cache.hash_of)
    out, stack = set(), list(cache.roots.values())
    while stack:
        n = stack.pop()
        out.update(n.blocks)
        stack.extend(n.children.values())
    return out


@settings(max_examples=150, deadline=None)
@given(st.lists(op, max_size=40))
def test_radix_matches_reference(ops):
    run_ops("radix", ops)


@settings(max_examples=150, deadline=None)
@given(st.lists(op, max_size=40))
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
