"""Eviction policies for prefix trees, kept in a registry so that variants plug in by name.

A policy maps an evictable leaf to a sortable priority; the leaf with the smallest priority is
evicted first. The manager keeps the evictable leaves in a heap keyed by this priority, so the
priority of a node may only change when the manager is told (it re-pushes the node then).

A policy may also offer ``flat_priority(node) -> int``, ordered exactly as ``priority``: the
heap then compares plain ints (the built-in policies pack ``(time, uuid)`` as
``time << 64 | uuid``), which keeps the hot path free of tuple building.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

__all__ = [
    "EvictableNode",
    "EvictionPolicy",
    "LRUPolicy",
    "FIFOPolicy",
    "EVICTION_POLICIES",
    "register_eviction_policy",
    "LeafHeap",
]


class EvictableNode(Protocol):
    """What a policy may read of a tree node (`RadixTreeNode` has these fields)."""

    timestamp: int
    insert_time: int
    uuid: int


class EvictionPolicy(Protocol):
    name: str

    def priority(self, node: EvictableNode) -> tuple[int, ...]:
        """Smaller goes first. A pure function of the node's fields that never decreases while
        the node is in the tree (`LeafHeap` relies on it)."""
        ...


#: The eviction policies by name (``"lru"``, ``"fifo"``); `register_eviction_policy` adds one.
EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {}


def register_eviction_policy(name: str) -> Callable[[type[EvictionPolicy]], type[EvictionPolicy]]:
    """Class decorator: make a policy available as ``RadixCacheManager(eviction_policy=name)``."""

    def wrap(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
        if name in EVICTION_POLICIES:
            raise ValueError(f"eviction policy {name!r} is already registered")
        cls.name = name
        EVICTION_POLICIES[name] = cls
        return cls

    return wrap


@register_eviction_policy("lru")
class LRUPolicy:
    """Least recently used first: the leaf whose last match or insert is oldest."""

    name = "lru"

    def priority(self, node: EvictableNode) -> tuple[int, int]:
        return (node.timestamp, node.uuid)

    def flat_priority(self, node: EvictableNode) -> int:
        return node.timestamp << 64 | node.uuid


@register_eviction_policy("fifo")
class FIFOPolicy:
    """First in, first out: the leaf whose tokens were inserted earliest, whatever their use."""

    name = "fifo"

    def priority(self, node: EvictableNode) -> tuple[int, int]:
        return (node.insert_time, node.uuid)

    def flat_priority(self, node: EvictableNode) -> int:
        return node.insert_time << 64 | node.uuid


#: The node type a `LeafHeap` holds (`pop` returns the type that was filed).
N = TypeVar("N", bound=EvictableNode)


class LeafHeap(Generic[N]):
    """The evictable leaves of a tree, smallest priority first, at most one entry per node.

    Lazy by design: a node's entry may hold a priority older (smaller) than the node's current
    one, because a match only stamps times and never touches the heap. `pop` files such an
    entry again under the current priority instead of returning it, so what it returns is the
    true minimum as long as priorities only grow while a node is in the tree (as the times of
    the built-in policies do). A node with no entry must be filed (`file`) when it becomes an
    evictable leaf; an entry for a node that is no longer one is dropped when popped.

    Filing and popping cost ``O(1)`` for an entry larger than every entry filed before it (a
    new leaf under either built-in policy), ``O(log n)`` otherwise: such entries form a sorted
    run beside the heap, so evicting from a tree of 100k leaves touches hardly more memory
    than from one of 1k.
    """

    def __init__(self, key: Callable[[N], object]) -> None:
        self._key = key
        self.clear()

    def clear(self) -> None:
        # Entries ``(priority, uuid, node)``, in two places: a run in increasing order (an entry
        # larger than the run's last is appended there: what a new leaf is, its time being the
        # clock's) and a heap for the rest. The smaller of the two heads is the minimum; popping
        # from the run touches its head only, where a heap pop walks a path down the heap.
        self._run: deque[tuple[object, int, N]] = deque()
        self._heap: list[tuple[object, int, N]] = []
        self._filed: dict[int, object] = {}  # uuid -> priority of the node's entry

    def __len__(self) -> int:
        return len(self._heap) + len(self._run)

    def file(self, node: N) -> None:
        """Give ``node`` an entry under its current priority, unless it has one."""
        uuid = node.uuid
        if uuid not in self._filed:
            priority = self._key(node)
            self._filed[uuid] = priority
            entry, run = (priority, uuid, node), self._run
            if not run or run[-1] < entry:  # `_push`, inlined: this is every insert's path
                run.append(entry)
            else:
                heapq.heappush(self._heap, entry)

    def _push(self, entry: tuple[object, int, N]) -> None:
        run = self._run
        if not run or run[-1] < entry:
            run.append(entry)
        else:
            heapq.heappush(self._heap, entry)

    def pop(self, evictable: Callable[[N], bool]) -> N:
        """Remove and return the evictable node with the smallest current priority.

        Raises ``RuntimeError`` when no filed node is evictable (the caller's sizes are wrong).
        """
        heap, run, filed, key = self._heap, self._run, self._filed, self._key
        while heap or run:
            if run and (not heap or run[0] < heap[0]):
                priority, uuid, node = run.popleft()
            else:
                priority, uuid, node = heapq.heappop(heap)
            del filed[uuid]
            if not evictable(node):
                continue  # it gained a child or a lock since: filed again when a leaf again
            current = key(node)
            if current == priority:
                return node
            filed[uuid] = current  # used since it was filed: file it under its new priority
            self._push((current, uuid, node))
        raise RuntimeError("internal error: no evictable leaf is filed")

    def is_filed(self, node: N) -> bool:
        """Whether ``node`` has an entry no newer than its current priority (what `pop` needs)."""
        priority = self._filed.get(node.uuid)
        return priority is not None and not self._key(node) < priority  # type: ignore[operator]
