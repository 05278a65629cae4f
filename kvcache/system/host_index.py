"""`HostIndex`: which prefixes a host tier holds, one trie of page keys per namespace, with its
LRU over host leaves; and `page_keys`, the whole pages of a token sequence as the trie's keys.

The index only records what its owner (`TieredCacheManager`) does to the host: it never copies
K/V nor hands out host pages.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable, Iterator

import numpy as np

__all__ = ["HostNode", "HostIndex", "page_keys", "Prefix", "PageKey"]

Prefix = tuple[Hashable, tuple[int, ...]]
PageKey = tuple[int, ...]


def page_keys(tokens: np.ndarray | Iterable[int], page_size: int) -> list[PageKey]:
    """The whole pages of ``tokens`` as tuples (the keys of the host trie)."""
    arr = np.asarray(tokens if isinstance(tokens, np.ndarray) else list(tokens), dtype=np.int64)
    n = len(arr) // page_size * page_size
    return [tuple(r) for r in arr[:n].reshape(-1, page_size).tolist()]


class HostNode:
    """One page of one prefix in the host trie (see `HostIndex`)."""

    __slots__ = ("below", "children", "depth", "key", "last_use", "page", "parent", "pins")

    def __init__(self, key: PageKey, parent: HostNode | None, depth: int) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[PageKey, HostNode] = {}
        self.page: int | None = None  # the host page, or None (pass-through)
        self.below = 0  # host pages strictly below this node
        self.last_use = 0
        self.depth = depth  # pages from the root to this node, this one included
        self.pins = 0  # > 0 while an operation works on its path: never pruned nor evicted

    def tokens(self) -> list[int]:
        """The prefix this node's page ends: every page key from the root down."""
        keys: list[PageKey] = []
        node: HostNode | None = self
        while node is not None and node.parent is not None:
            keys.append(node.key)
            node = node.parent
        return [t for k in reversed(keys) for t in k]


class HostIndex:
    """Which prefixes the host tier holds: per namespace (``extra_key``) a trie of page keys.

    A node stands for one page of one prefix: the path of page keys (tuples of ``page_size``
    token ids) from its namespace's root spells the prefix. A node holds a host page (``page``)
    or is a *pass-through*: a page that lives only on the device but has host pages below it. A
    node with no host page at or below it is pruned at once, so the trie is exactly the host's
    pages and their ancestors.

    The LRU victim is a *host leaf*: a node holding a page with no host page below it, least
    recently used first (ties by age). Taking leaves only means no host page ever loses an
    ancestor to the host's own eviction. The index only records: it never copies K/V nor hands
    out host pages, its owner does.
    """

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._roots: dict[Hashable, HostNode] = {}
        self._clock = itertools.count(1)
        self._pages = 0

    @property
    def num_pages(self) -> int:
        """Host pages recorded."""
        return self._pages

    def clear(self) -> None:
        self._roots.clear()
        self._pages = 0

    def tick(self) -> int:
        return next(self._clock)

    def path(self, extra_key: Hashable, keys: Iterable[PageKey]) -> list[HostNode]:
        """The nodes along ``keys`` from ``extra_key``'s root, as far as the trie goes."""
        node = self._roots.get(extra_key)
        out: list[HostNode] = []
        if node is None:
            return out
        for k in keys:
            node = node.children.get(k)
            if node is None:
                break
            out.append(node)
        return out

    def ensure_path(self, extra_key: Hashable, keys: list[PageKey]) -> list[HostNode]:
        """`path` along all of ``keys``, creating pass-through nodes where missing.

        The nodes come back pinned (see `pin`); the caller must `unpin` them when done.
        """
        node = self._roots.get(extra_key)
        if node is None:
            node = self._roots[extra_key] = HostNode((), None, 0)
        out = []
        for k in keys:
            child = node.children.get(k)
            if child is None:
                child = node.children[k] = HostNode(k, node, node.depth + 1)
            out.append(child)
            node = child
        self.pin(out)
        return out

    def set_page(self, node: HostNode, page: int) -> None:
        """Record that ``node``'s page is now held at host page ``page`` (it held none)."""
        node.page = page
        node.last_use = self.tick()
        self._pages += 1
        up = node.parent
        while up is not None:
            up.below += 1
            up = up.parent

    def drop_page(self, node: HostNode) -> int:
        """Forget ``node``'s host page and return it; prune what is left empty above."""
        page = node.page
        if page is None:
            raise RuntimeError("drop_page of a node that holds no host page")
        node.page = None
        self._pages -= 1
        up = node.parent
        while up is not None:
            up.below -= 1
            up = up.parent
        self._prune(node)
        return page

    def pin(self, nodes: Iterable[HostNode]) -> None:
        """Keep ``nodes`` in the trie (not pruned, not an LRU victim) until `unpin`."""
        for n in nodes:
            n.pins += 1

    def unpin(self, nodes: list[HostNode]) -> None:
        """Undo `pin` and prune whatever the operation left empty (deepest first)."""
        for n in nodes:
            n.pins -= 1
        for n in reversed(nodes):
            self._prune(n)

    def _prune(self, node: HostNode) -> None:
        while node.parent is not None and node.page is None and node.below == 0 and not node.pins:
            parent = node.parent
            del parent.children[node.key]
            node.parent = None
            node = parent

    def subtree_pages(self, node: HostNode) -> list[HostNode]:
        """The nodes holding a host page at or below ``node``, deepest first."""
        stack, out = [node], []
        while stack:
            n = stack.pop()
            if n.page is not None:
                out.append(n)
            if n.below:
                stack.extend(n.children.values())
        out.sort(key=lambda n: -n.depth)
        return out

    def host_leaves(self) -> Iterator[tuple[Hashable, HostNode]]:
        """Every node holding a page with no host page below it, with its namespace."""
        for key, root in self._roots.items():
            stack = list(root.children.values())
            while stack:
                n = stack.pop()
                if n.page is not None and n.below == 0:
                    yield key, n
                elif n.below:
                    stack.extend(n.children.values())

    def root(self, extra_key: Hashable) -> HostNode | None:
        """``extra_key``'s root (holds no page), or None when it holds nothing."""
        return self._roots.get(extra_key)

    def lru_leaf(self) -> tuple[Hashable, HostNode] | None:
        """The least recently used unpinned host leaf and its namespace; None if there is none."""
        best: tuple[Hashable, HostNode] | None = None
        for key, n in self.host_leaves():
            if not n.pins and (best is None or n.last_use < best[1].last_use):
                best = (key, n)
        return best

    def nodes(self) -> Iterator[tuple[Hashable, HostNode]]:
        """Every non-root node with its namespace, parents before children."""
        for key, root in self._roots.items():
            stack = list(root.children.values())
            while stack:
                n = stack.pop()
                yield key, n
                stack.extend(n.children.values())

    def prefixes(self) -> dict[Prefix, int]:
        """``(extra_key, prefix tokens through the page) -> host page`` for every host page."""
        return {(k, tuple(n.tokens())): n.page for k, n in self.nodes() if n.page is not None}

    def check(self) -> list[int]:
        """Recount ``below`` and the pages, check the pruning; return every host page held.

        ``RuntimeError`` on the first disagreement.
        """
        pages: list[int] = []
        for root in self._roots.values():
            order: list[HostNode] = []
            stack = [root]
            while stack:
                n = stack.pop()
                order.append(n)
                for k, c in n.children.items():
                    if c.parent is not n or c.key != k or len(k) != self.page_size:
                        raise RuntimeError(f"host trie: child {k} is filed wrongly")
                    if c.depth != n.depth + 1:
                        raise RuntimeError(f"host trie: node {k} has the wrong depth")
                    stack.append(c)
            for n in reversed(order):  # children before parents
                below = sum(c.below + (c.page is not None) for c in n.children.values())
                if below != n.below:
                    raise RuntimeError(
                        f"host trie: node records {n.below} pages below, holds {below}"
                    )
                if n.parent is not None and n.page is None and below == 0:
                    raise RuntimeError("host trie: an empty pass-through node was not pruned")
                if n.page is not None:
                    pages.append(n.page)
        if len(pages) != self._pages:
            raise RuntimeError(f"host trie records {self._pages} pages, holds {len(pages)}")
        return pages
