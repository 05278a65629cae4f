"""Eviction policies for prefix trees, registered by name, and the heap of evictable leaves.

A policy maps a tree node to a sortable priority; of the evictable leaves, the one with the
smallest priority is evicted first. The priority is a function of the node's own fields that
the manager changes: ``timestamp`` (the logical clock at the node's last match or insert),
``insert_time`` (when its tokens were inserted), ``hit_count`` (how many calls used it),
``length`` and ``uuid`` (a tie-breaker). SGLang's strategies, written this way::

    LRU  (timestamp, uuid)       MRU  (-timestamp, uuid)      LFU  (hit_count, timestamp, uuid)
    FIFO (insert_time, uuid)     FILO (-insert_time, uuid)

A policy also says whether its priorities are **monotone**: whether a node's priority never
decreases while it is in the tree (every access only makes it larger, as a time does). The
manager keeps the evictable leaves in a `LeafHeap` ordered by priority. For a monotone policy
the heap may be lazy: a match stamps the nodes and leaves the heap alone, and `LeafHeap.pop`
notices an entry older than its node and files the node again instead of returning it (the
entry can only be too small, so the minimum is never missed). For a policy that is not
monotone (MRU's ``-timestamp`` falls with every access) the manager files the leaf again at
every access, and the heap drops the superseded entry when it meets it. A policy that does not
say is taken as not monotone: exact, at the cost of a heap push per access.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from .registry import Registry

__all__ = [
    "EvictableNode",
    "EvictionPolicy",
    "LRUPolicy",
    "FIFOPolicy",
    "EVICTION_POLICIES",
    "register_eviction_policy",
    "is_monotone",
    "LeafHeap",
]


class EvictableNode(Protocol):
    """What a policy may read of a tree node (`RadixTreeNode` has these fields)."""

    timestamp: int
    insert_time: int
    hit_count: int
    uuid: int

    @property
    def length(self) -> int: ...


class EvictionPolicy(Protocol):
    """A class registered with `register_eviction_policy` (which sets ``name``).

    ``monotone`` (a class attribute, ``False`` when absent): whether ``priority(node)`` never
    decreases while the node is in the tree. Declare it only when it is true: a lazy heap
    evicts in the wrong order under a policy whose priority falls (`check_integrity` notices).
    """

    name: str

    def priority(self, node: Any) -> tuple[int, ...]:
        """Smaller goes first: a pure function of the node's fields."""
        ...


#: The eviction policies by name (``"lru"``, ``"fifo"``); `register_eviction_policy` adds one.
EVICTION_POLICIES: Registry[type[EvictionPolicy]] = Registry("eviction policy")


def register_eviction_policy(name: str) -> Callable[[type[Any]], type[Any]]:
    """Class decorator: make a policy available as ``RadixCacheManager(eviction_policy=name)``.

    The class must define ``priority(node)``; ``monotone``, if set, must be a bool. A taken
    name raises `RegistryError` (a ``ValueError``) at once, a class without ``priority``
    ``TypeError``; nothing is registered then.
    """
    file = EVICTION_POLICIES.register(name)

    def wrap(cls: type[Any]) -> type[Any]:
        if not isinstance(cls, type) or not callable(getattr(cls, "priority", None)):
            raise TypeError(
                f"eviction policy {name!r} must be a class with a priority(node) method"
            )
        is_monotone(cls)  # refuses a non-bool before the class is filed
        cls.name = name
        return file(cls)

    return wrap


def is_monotone(policy: object) -> bool:
    """Whether ``policy`` (a policy class or instance) declares monotone priorities."""
    monotone = getattr(policy, "monotone", False)
    if not isinstance(monotone, bool):
        raise TypeError(f"an eviction policy's monotone must be a bool, got {monotone!r}")
    return monotone


@register_eviction_policy("lru")
class LRUPolicy:
    """Least recently used first: the leaf whose last match or insert is oldest."""

    name = "lru"
    monotone = True  # a node's timestamp only grows

    def priority(self, node: EvictableNode) -> tuple[int, int]:
        return (node.timestamp, node.uuid)


@register_eviction_policy("fifo")
class FIFOPolicy:
    """First in, first out: the leaf whose tokens were inserted earliest, whatever their use."""

    name = "fifo"
    monotone = True  # a node's insert_time never changes

    def priority(self, node: EvictableNode) -> tuple[int, int]:
        return (node.insert_time, node.uuid)


#: The node type a `LeafHeap` holds (`pop` returns the type that was filed).
N = TypeVar("N", bound=EvictableNode)
#: ``(priority, uuid, serial, node)``: ties in priority go by uuid, as `predict_evict` breaks
#: them; the serial (one per entry) keeps two entries from ever comparing their nodes.
_Entry = tuple[Any, int, int, N]


class LeafHeap(Generic[N]):
    """The evictable leaves of a tree, smallest priority first.

    Each filed node has one live entry (``_live``), made by its latest `file`; an older entry
    of the node is superseded and dropped when met. With a ``monotone`` key the live entry may
    hold a priority older (smaller) than the node's: `pop` files such a node again under its
    current priority instead of returning it, so what it returns is the true minimum. Without,
    the caller must `file` a leaf again whenever its priority changes. An entry for a node that
    is no longer an evictable leaf is dropped when popped; a node must be filed when it becomes
    one.

    Entries live in two places: a run in increasing order, where an entry larger than the
    run's last goes (a new leaf under LRU or FIFO: its time is the clock's), and a heap for
    the rest. Filing and popping cost ``O(1)`` on the run, ``O(log n)`` on the heap; the run
    touches only its two ends, so evicting from a tree of 100k leaves touches hardly more
    memory than from one of 1k (``benchmarks/radix_ops.py`` measures it).
    """

    def __init__(self, key: Callable[[N], Any], monotone: bool) -> None:
        self._key = key
        self.monotone = monotone
        self.clear()

    def clear(self) -> None:
        self._run: deque[_Entry[N]] = deque()
        self._heap: list[_Entry[N]] = []
        self._live: dict[int, _Entry[N]] = {}  # uuid -> the node's live entry
        self._serial = 0

    def __len__(self) -> int:
        """Entries held, superseded ones included."""
        return len(self._heap) + len(self._run)

    def file(self, node: N) -> None:
        """Give ``node`` a live entry under its current priority, unless its entry will do (the
        same priority, or with a monotone key an older one, which `pop` refreshes)."""
        entry = self._live.get(node.uuid)
        if entry is not None and self.monotone:
            return  # its priority can only have grown since: `pop` refreshes the entry
        priority = self._key(node)
        if entry is None or entry[0] != priority:
            self._push(priority, node)

    def _push(self, priority: Any, node: N) -> None:
        self._serial += 1
        if not self._serial % 1024 and len(self) > 2 * len(self._live) + 1024:
            self._compact()  # superseded entries pile up: sweep them out now and then
        entry = (priority, node.uuid, self._serial, node)
        self._live[node.uuid] = entry
        if not self._run or self._run[-1] < entry:
            self._run.append(entry)
        else:
            heapq.heappush(self._heap, entry)

    def _compact(self) -> None:
        """Keep the live entries only, in one heap."""
        self._run, self._heap = deque(), list(self._live.values())
        heapq.heapify(self._heap)

    def pop(self, evictable: Callable[[N], bool]) -> N:
        """Remove and return the evictable node with the smallest current priority.

        ``RuntimeError`` when no filed node is evictable (the caller's sizes are wrong).
        """
        heap, run, live = self._heap, self._run, self._live
        while heap or run:
            entry = run.popleft() if run and (not heap or run[0] < heap[0]) else heapq.heappop(heap)
            priority, uuid, _, node = entry
            if live.get(uuid) is not entry:
                continue  # superseded by a later filing
            del live[uuid]
            if not evictable(node):
                continue  # locked or given a child since: filed again when a leaf again
            current = self._key(node)
            if current != priority:  # used since it was filed (a monotone key's lazy entry)
                self._push(current, node)
                continue
            return node
        raise RuntimeError("internal error: no evictable leaf is filed")

    def is_filed(self, node: N) -> bool:
        """Whether ``node``'s live entry lets `pop` find it in order: its current priority, or
        with a monotone key one no larger."""
        entry = self._live.get(node.uuid)
        if entry is None:
            return False
        current = self._key(node)
        return bool(entry[0] == current or (self.monotone and entry[0] < current))
