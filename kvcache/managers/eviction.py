"""Eviction policies for prefix trees, kept in a registry so that variants plug in by name.

A policy maps an evictable leaf to a sortable priority; the leaf with the smallest priority is
evicted first. The manager keeps the evictable leaves in a heap keyed by this priority, so the
priority of a node may only change when the manager is told (it re-pushes the node then).

A policy may also offer ``flat_priority(node) -> int``, ordered exactly as ``priority``: the
heap then compares plain ints (the built-in policies pack ``(time, uuid)`` as
``time << 64 | uuid``), which keeps the hot path free of tuple building.
"""

from __future__ import annotations

from typing import Callable, Dict, Protocol, Tuple, Type

__all__ = ["EvictableNode", "EvictionPolicy", "LRUPolicy", "FIFOPolicy", "EVICTION_POLICIES", "register_eviction_policy"]


class EvictableNode(Protocol):
    """What a policy may read of a tree node (`RadixTreeNode` has these fields)."""

    timestamp: int
    insert_time: int
    uuid: int


class EvictionPolicy(Protocol):
    name: str

    def priority(self, node: EvictableNode) -> Tuple[int, ...]:
        """Smaller goes first. Must be a pure function of the node's fields."""
        ...


EVICTION_POLICIES: Dict[str, Type[EvictionPolicy]] = {}


def register_eviction_policy(name: str) -> Callable[[Type[EvictionPolicy]], Type[EvictionPolicy]]:
    """Class decorator: make a policy available as ``RadixCacheManager(eviction_policy=name)``."""

    def wrap(cls: Type[EvictionPolicy]) -> Type[EvictionPolicy]:
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

    def priority(self, node: EvictableNode) -> Tuple[int, int]:
        return (node.timestamp, node.uuid)

    def flat_priority(self, node: EvictableNode) -> int:
        return node.timestamp << 64 | node.uuid


@register_eviction_policy("fifo")
class FIFOPolicy:
    """First in, first out: the leaf whose tokens were inserted earliest, whatever their use."""

    name = "fifo"

    def priority(self, node: EvictableNode) -> Tuple[int, int]:
        return (node.insert_time, node.uuid)

    def flat_priority(self, node: EvictableNode) -> int:
        return node.insert_time << 64 | node.uuid
