"""`RadixRoots`: what a `RadixCacheManager` keeps per namespace and over all of them.

Each ``extra_key`` has its own root (``None``'s is ``root_node``, made with the tree; any other
is made by the key's first insert), so prefixes under different keys never share a node. This
base class holds the parts that see every root at once: the node listings, the cached slots,
the event log, eviction (one heap of leaves over every namespace) and the integrity check.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from typing import Any, Literal, overload

import numpy as np
import torch

from .._validate import check_size
from . import cache_events
from .base import BaseCacheManager, SizeInfo, takes_host_arrays
from .cache_events import EventLog, check_extra_key
from .eviction import EvictionPolicy, LeafHeap
from .radix_node import ITEM, RadixTreeNode, TreeInfo, census_tree, detach_leaf
from .slot_owners import SlotOwners

__all__ = ["RadixRoots", "evictable_leaf", "path_tokens"]


def evictable_leaf(node: RadixTreeNode) -> bool:
    """Whether ``node`` may be evicted now: in the tree, unlocked, childless, not a root."""
    return node.in_tree and node.ref_count == 0 and not node.children and node.parent is not None


def path_tokens(node: RadixTreeNode) -> tuple[list[int], RadixTreeNode]:
    """The tokens from ``node``'s root down through ``node``, and that root."""
    parts = []
    while (up := node.parent) is not None:
        parts.append(node.key_bytes)
        node = up
    return np.frombuffer(b"".join(reversed(parts)), dtype=np.int64).tolist(), node


class RadixRoots(BaseCacheManager):
    """The namespace-wide half of `RadixCacheManager` (not a manager on its own)."""

    root_node: RadixTreeNode
    empty_tensor: torch.Tensor
    _roots: dict[Hashable, RadixTreeNode]
    _root_keys: dict[int, Hashable]  # a root's uuid -> its extra_key
    _events: EventLog | None
    _tree: TreeInfo
    _leaves: LeafHeap[RadixTreeNode]
    _owners: SlotOwners
    _evictable_size: int
    _protected_size: int
    _num_nodes: int
    _clock: int
    _locks: dict[int, list[Any]]  # id(handle) -> [handle, times locked]
    _key_of: Callable[[bytes, int], Hashable]
    _policy: EvictionPolicy
    _on_cpu: bool
    _is_evictable_leaf: Callable[[RadixTreeNode], bool]

    @property
    def size_info(self) -> SizeInfo:
        return SizeInfo(evictable_size=self._evictable_size, protected_size=self._protected_size)

    @property
    def num_nodes(self) -> int:
        """Nodes in the tree, the root excluded."""
        return self._num_nodes

    @property
    def clock(self) -> int:
        """The logical clock: incremented by every ``match_prefix`` and ``insert_prefix``."""
        return self._clock

    @property
    def num_locked_handles(self) -> int:
        """Distinct handles locked now (each counted once however often it was locked)."""
        return len(self._locks)

    @property
    def roots(self) -> dict[Hashable, RadixTreeNode]:
        """The root of each namespace (``extra_key``) inserted into since the last reset (a copy)."""
        return dict(self._roots)

    take_events = cache_events.take_events

    def nodes(self, extra_key: Hashable = None) -> Iterator[RadixTreeNode]:
        """Every node of namespace ``extra_key``'s tree (default ``None``'s), the root first,
        depth first, children in insertion order."""
        root = self._roots.get(check_extra_key(extra_key))
        stack = [root] if root is not None else []
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(list(node.children.values())))

    def cached_indices(self) -> torch.Tensor:
        values = [n.value_array for k in self._roots for n in self.nodes(k) if not n.is_root()]
        return (
            torch.from_numpy(np.concatenate(values)).to(self.device)
            if values
            else self.empty_tensor
        )

    # ---------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """Walk every namespace's tree (no recursion) and raise ``RuntimeError`` on the first inconsistency."""
        evictable = protected = count = 0
        every: list[np.ndarray] = []
        for root in self._roots.values():
            part = census_tree(
                root,
                self._tree,
                self.page_size,
                self._key_of,
                lambda c: evictable_leaf(c) and not self._leaves.is_filed(c),
            )
            evictable, protected = evictable + part.evictable, protected + part.protected
            count += part.num_nodes
            every.append(part.slots)
        allv = np.concatenate(every)
        if len(self._roots) > 1 and len(np.unique(allv)) != len(allv):
            raise RuntimeError("a slot is held by two namespaces")
        if (evictable, protected) != (self._evictable_size, self._protected_size):
            raise RuntimeError(
                f"sizes disagree with the nodes: recorded (evictable={self._evictable_size}, "
                f"protected={self._protected_size}), counted (evictable={evictable}, protected={protected})"
            )
        if count != self._num_nodes:
            raise RuntimeError(f"recorded {self._num_nodes} nodes, counted {count}")
        ps = self.page_size
        pages = allv[::ps] // ps if ps > 1 else allv
        if self._owners.count != len(pages) or not self._owners.held(pages.astype(np.int64)).all():
            raise RuntimeError("the record of held slots disagrees with the slots in the tree")

    # ------------------------------------------------------------ eviction
    def eviction_priority(self, node: RadixTreeNode) -> tuple[int, ...]:
        """``node``'s key under this manager's policy: the evictable leaf with the smallest goes
        first. ``TypeError`` unless ``node`` is a `RadixTreeNode`."""
        if not isinstance(node, RadixTreeNode):
            raise TypeError(f"node must be a RadixTreeNode, got {type(node).__name__}")
        return tuple(self._policy.priority(node))

    @overload
    def evict(self, size: int, *, host: Literal[False] = False) -> torch.Tensor: ...

    @overload
    def evict(self, size: int, *, host: Literal[True]) -> np.ndarray: ...

    @takes_host_arrays
    def evict(self, size: int, *, host: bool = False) -> torch.Tensor | np.ndarray:
        """Evict unlocked leaves in policy order until at least ``size`` tokens are freed.

        A parent left childless and unlocked becomes a candidate at once. Raises ``RuntimeError``
        (evicting nothing) when fewer than ``size`` tokens are evictable. ``host=True``: the
        slots come back as NumPy int32 on the host.
        """
        if type(size) is not int or size < 0:  # the common case costs one type() call
            size = check_size(size)
        if host is not False and host is not True:
            raise TypeError(f"host must be a bool, got {type(host).__name__}")
        if size == 0:
            return np.empty(0, dtype=np.int32) if host else self.empty_tensor
        if size > self._evictable_size:
            raise RuntimeError(
                f"cannot evict {size} tokens: only {self._evictable_size} are evictable "
                f"({self._protected_size} are locked)"
            )
        values: list[np.ndarray] = []
        freed, pop, events, release = 0, self._leaves.pop, self._events, self._owners.release_pages
        evictable, file, pb = self._is_evictable_leaf, self._leaves.file, self.page_size * ITEM
        while freed < size:
            node = pop(evictable)
            value = node.value_array
            if events is not None:
                tokens, root = path_tokens(node)
                events.removed(self._root_keys[root.uuid], tokens, value.tolist())
            values.append(value)
            release(node.page_array)  # a scatter per leaf costs less than joining the pages
            freed += len(value)
            parent = detach_leaf(node, pb)
            self._num_nodes -= 1
            if not parent.children and parent.ref_count == 0 and parent.parent is not None:
                file(parent)
        self._evictable_size -= freed
        out = values[0] if len(values) == 1 else np.concatenate(values)
        if host:
            return out
        return torch.from_numpy(out) if self._on_cpu else torch.from_numpy(out).to(self.device)
