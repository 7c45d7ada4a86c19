"""Token radix tree over paged KV (SGLang RadixAttention, page-granular).

Edges are labelled with whole blocks of tokens, so a split always falls on a block boundary and
every node owns whole pool blocks. Running requests lock the path they use (`lock_ref` counts up to
the root), and eviction removes least-recently-used unlocked leaves, so a prefix disappears from the
tail inwards and a shared system prompt outlives the answers that hung off it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence as Seq
from typing import Any

from generation.block_manager import BlockManager

_clock = itertools.count()


class Node:
    __slots__ = ("key", "blocks", "children", "parent", "lock_ref", "last_access")

    def __init__(self, key: tuple[int, ...] = (), blocks: list[int] | None = None, parent: Node | None = None):
        self.key = key
        self.blocks = blocks or []
        self.children: dict[tuple[int, ...], Node] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = next(_clock)


class RadixCache:
    def __init__(self, blocks: BlockManager) -> None:
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.evictions = 0
        self.roots: dict[Any, Node] = {}
        self._num_cached = 0

    @property
    def num_cached_blocks(self) -> int:
        return self._num_cached

    def _root(self, salt: Any) -> Node:
        root = self.roots.get(salt)
        if root is None:
            root = self.roots[salt] = Node()
            root.lock_ref = 1  # roots are never evicted
        return root

    def _page(self, tokens: Seq[int], start: int) -> tuple[int, ...]:
        return tuple(tokens[start : start + self.block_size])

    def _split(self, node: Node, pages: int) -> Node:
        """Cut `node` after `pages` blocks; the new upper half inherits its parent link and locks."""
        bs = self.block_size
        upper = Node(node.key[: pages * bs], node.blocks[:pages], node.parent)
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        upper.children = {node.key[pages * bs : (pages + 1) * bs]: node}
        node.parent.children[node.key[:bs]] = upper
        node.key = node.key[pages * bs :]
        node.blocks = node.blocks[pages:]
        node.parent = upper
        return upper

    def _walk(self, tokens: Seq[int], salt: Any, create: bool) -> tuple[Node, int, list[int]]:
        """Descend as far as `tokens` agrees with the tree, splitting a partly matched edge."""
        bs = self.block_size
        node = self._root(salt) if create else self.roots.get(salt)
        if node is None:
            return None, 0, []
        n_pages = len(tokens) // bs
        pos, matched = 0, []
        stamp = next(_clock)
        node.last_access = stamp
        while pos < n_pages:
            child = node.children.get(self._page(tokens, pos * bs))
            if child is None:
                break
            child_pages = len(child.blocks)
            k = 1
            while k < child_pages and pos + k < n_pages and self._page(child.key, k * bs) == self._page(tokens, (pos + k) * bs):
                k += 1
            if k < child_pages:
                child = self._split(child, k)
            child.last_access = stamp
            matched.extend(child.blocks)
            pos += k
            node = child
        return node, pos, matched

    def match(self, tokens: Seq[int], salt: Any = None) -> tuple[list[int], Any]:
        node, _, matched = self._walk(tokens, salt, create=False)
        if node is None or not matched:
            return [], None
        return matched, node

    def insert(self, tokens: Seq[int], blocks: Seq[int], salt: Any = None) -> Any:
        bs = self.block_size
        n_pages = min(len(tokens) // bs, len(blocks))
        if n_pages == 0:
            return None
        node, pos, _ = self._walk(tokens[: n_pages * bs], salt, create=True)
        if pos < n_pages:
            new = Node(tuple(tokens[pos * bs : n_pages * bs]), list(blocks[pos:n_pages]), node)
            node.children[new.key[:bs]] = new
            for b in new.blocks:
                self.blocks.incref(b)
            self._num_cached += len(new.blocks)
            node = new
        return node

    def lock(self, handle: Any) -> None:
        node = handle
        while node is not None:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, handle: Any) -> None:
        node = handle
        while node is not None:
            if node.lock_ref <= 0:
                raise RuntimeError("radix cache: unlock without lock")
            node.lock_ref -= 1
            node = node.parent

    def _leaves(self) -> list[Node]:
        out, stack = [], [r for r in self.roots.values()]
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            elif n.parent is not None and n.lock_ref == 0:
                out.append(n)
        return out

    def evict(self, num_blocks: int) -> int:
        heap = [(n.last_access, id(n), n) for n in self._leaves()]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_blocks:
            _, _, node = heapq.heappop(heap)
            for b in node.blocks:
                freed += self.blocks.decref(b)
            self._num_cached -= len(node.blocks)
            self.evictions += len(node.blocks)
            parent = node.parent
            del parent.children[node.key[: self.block_size]]
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed
