"""Frozen pictures of a radix tree: `snapshot`, `diff_snapshots` and `predict_evict`.

`snapshot(manager)` copies a `RadixCacheManager`'s tree into a `TreeSnapshot` of plain,
immutable `NodeSnapshot` records (uuid, parent, tokens, slots, ref count, timestamps, eviction
priority). `diff_snapshots` says what one call changed (new, split, shrunk and evicted nodes);
`predict_evict` names the leaves ``evict(size)`` would take, in order, without touching the
manager. Every walk here is a loop, never a recursion, so a chain thousands of nodes deep (a
request cached after every decode token) is as easy as a wide tree.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, Protocol, TypeAlias, runtime_checkable

from .._validate import as_list, check_size
from ..managers.radix import RadixCacheManager, RadixTreeNode

__all__ = [
    "NodeSnapshot",
    "TreeSnapshot",
    "SnapshotSource",
    "snapshot",
    "diff_snapshots",
    "as_snapshot",
    "snapshot_list",
    "predict_evict",
    "evict_order",
]


@dataclass(frozen=True)
class NodeSnapshot:
    """One tree node, frozen. ``parent`` is ``None`` for the root; ``children`` in insertion order.

    ``priority`` is the eviction policy's key for the node (smaller goes first), ``None`` for
    the root.
    """

    uuid: int
    parent: int | None
    tokens: tuple[int, ...]
    indices: tuple[int, ...]
    ref_count: int
    timestamp: int
    insert_time: int
    priority: tuple[Any, ...] | None
    children: tuple[int, ...]

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def is_leaf(self) -> bool:
        return not self.children

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class TreeSnapshot:
    """A whole tree at one moment, plus what the call that produced it changed.

    ``nodes`` holds the root first, then depth first with children in insertion order (the
    order of `RadixCacheManager.nodes`), of the namespace drawn; ``others`` the nodes of every
    other namespace, frozen alike (eviction takes leaves from every namespace, so
    `predict_evict` looks at them too; nothing draws them). ``new`` are uuids of nodes inserted by the call,
    ``split`` the prefix nodes a split created, ``shrunk`` the old nodes that kept the suffix,
    ``evicted`` the nodes the call removed (as they were before it). ``evict_size`` is set when
    the call was ``evict(evict_size)``, so a sequence can preview it on the snapshot before.
    """

    nodes: tuple[NodeSnapshot, ...]
    page_size: int = 1
    eviction_policy: str = "lru"
    clock: int = 0
    evictable_size: int = 0
    protected_size: int = 0
    caption: str = ""
    new: frozenset[int] = frozenset()
    split: frozenset[int] = frozenset()
    shrunk: frozenset[int] = frozenset()
    evicted: tuple[NodeSnapshot, ...] = ()
    evict_size: int | None = None
    others: tuple[NodeSnapshot, ...] = ()

    @cached_property
    def by_uuid(self) -> dict[int, NodeSnapshot]:
        return {n.uuid: n for n in self.nodes}

    @property
    def root(self) -> NodeSnapshot:
        return self.nodes[0]

    @property
    def num_nodes(self) -> int:
        """Nodes other than the root."""
        return len(self.nodes) - 1

    def depths(self) -> dict[int, int]:
        """Depth of every node (root 0) and of every evicted ghost (under its old parent)."""
        depth: dict[int, int] = {}
        for n in self.nodes:  # parents come before their children in ``nodes``
            depth[n.uuid] = 0 if n.parent is None else depth[n.parent] + 1
        for g in self.evicted:  # parents before children: evicted in the order they were found
            depth[g.uuid] = depth.get(g.parent, 0) + 1 if g.parent is not None else 1
        return depth

    def preorder(self, reverse: bool = False) -> list[NodeSnapshot]:
        """Nodes depth first from the root; children in insertion order, or reversed with ``reverse``."""
        if not reverse:
            return list(self.nodes)
        out, stack = [], [self.root.uuid]
        while stack:
            node = self.by_uuid[stack.pop()]
            out.append(node)
            stack.extend(node.children)  # popped last-first: children reversed
        return out


@runtime_checkable
class SnapshotSource(Protocol):
    """Anything that can give the tree it shows now as a `TreeSnapshot` (a `TreeRecorder` does)."""

    def to_snapshot(self) -> TreeSnapshot: ...


def snapshot(
    manager: RadixCacheManager,
    caption: str = "",
    *,
    previous: TreeSnapshot | None = None,
    evict_size: int | None = None,
    extra_key: Hashable = None,
) -> TreeSnapshot:
    """Freeze ``manager``'s tree (any ``page_size``). Reads only: the manager is not changed.

    ``extra_key``: the namespace whose tree to freeze (default ``None``'s); ``ValueError`` for
    one never inserted into. The size counts (evictable, protected) are the whole manager's.

    With ``previous``, the result also carries what changed since (see `diff_snapshots`).
    Raises ``TypeError`` for anything but a `RadixCacheManager` (other managers keep no tree
    to draw), a non-``str`` caption or a ``previous`` that is not a `TreeSnapshot`.
    """
    if not isinstance(manager, RadixCacheManager):
        raise TypeError(
            f"manager must be a RadixCacheManager (only a radix tree can be drawn), "
            f"got {type(manager).__name__}"
        )
    if not isinstance(caption, str):
        raise TypeError(f"caption must be a str, got {type(caption).__name__}")
    if previous is not None and not isinstance(previous, TreeSnapshot):
        raise TypeError(f"previous must be a TreeSnapshot or None, got {type(previous).__name__}")
    if evict_size is not None:
        check_size(evict_size, "evict_size")
    nodes = [_frozen(manager, node) for node in manager.nodes(extra_key)]
    if not nodes:
        raise ValueError(f"extra_key {extra_key!r} names no namespace of this manager")
    drawn = nodes[0].uuid
    others = tuple(
        _frozen(manager, node)
        for key, root in manager.roots.items()
        if root.uuid != drawn
        for node in manager.nodes(key)
    )
    info = manager.size_info
    snap = TreeSnapshot(
        nodes=tuple(nodes),
        page_size=manager.page_size,
        eviction_policy=manager.eviction_policy,
        clock=manager.clock,
        evictable_size=info.evictable_size,
        protected_size=info.protected_size,
        caption=caption,
        evict_size=evict_size,
        others=others,
    )
    return diff_snapshots(previous, snap) if previous is not None else snap


def _frozen(manager: RadixCacheManager, node: RadixTreeNode) -> NodeSnapshot:
    """``node`` of ``manager`` as a `NodeSnapshot`."""
    root = node.is_root()
    return NodeSnapshot(
        uuid=node.uuid,
        parent=None if root else node.parent.uuid,  # type: ignore[union-attr]
        tokens=tuple(node.key.tolist()),
        indices=tuple(node.value.tolist()),
        ref_count=node.ref_count,
        timestamp=node.timestamp,
        insert_time=node.insert_time,
        priority=None if root else manager.eviction_priority(node),
        children=tuple(c.uuid for c in node.children.values()),
    )


def diff_snapshots(before: TreeSnapshot, after: TreeSnapshot) -> TreeSnapshot:
    """``after`` with ``new``/``split``/``shrunk``/``evicted`` filled in by comparing with ``before``.

    A split keeps the old node as the suffix and creates a new prefix node, so: an old node
    whose key got shorter was split (``shrunk``); a new node with an old child is the split-off
    prefix (``split``); every other new node was inserted (``new``). Nodes of ``before`` missing
    from ``after`` were evicted (the roots are never counted).
    """
    for name, value in (("before", before), ("after", after)):
        if not isinstance(value, TreeSnapshot):
            raise TypeError(f"{name} must be a TreeSnapshot, got {type(value).__name__}")
    old = before.by_uuid
    cur = after.by_uuid
    fresh = {u for u, n in cur.items() if u not in old and not n.is_root}
    split = frozenset(u for u in fresh if any(c in old for c in cur[u].children))
    shrunk = frozenset(u for u, n in cur.items() if u in old and n.length < old[u].length)
    evicted = tuple(n for n in before.nodes if n.uuid not in cur and not n.is_root)
    return replace(after, new=frozenset(fresh - split), split=split, shrunk=shrunk, evicted=evicted)


Tree: TypeAlias = RadixCacheManager | TreeSnapshot | SnapshotSource


def as_snapshot(tree: Tree, name: str = "tree") -> TreeSnapshot:
    """``tree`` as a `TreeSnapshot`: itself, the recorder's latest, or a fresh snapshot of a manager.

    Raises ``TypeError`` naming the argument ``name`` for anything else.
    """
    if isinstance(tree, TreeSnapshot):
        return tree
    if isinstance(tree, RadixCacheManager):
        return snapshot(tree)
    if isinstance(tree, SnapshotSource):
        return tree.to_snapshot()
    raise TypeError(
        f"{name} must be a RadixCacheManager, TreeRecorder or TreeSnapshot, "
        f"got {type(tree).__name__}"
    )


def snapshot_list(snapshots: Iterable[TreeSnapshot], name: str = "snapshots") -> list[TreeSnapshot]:
    """``snapshots`` (any iterable of `TreeSnapshot`, a `TreeRecorder` included) as a list.

    Raises ``TypeError`` naming the argument ``name`` for anything else.
    """
    if isinstance(snapshots, (str, bytes, TreeSnapshot)) or not isinstance(snapshots, Iterable):
        raise TypeError(
            f"{name} must be a TreeRecorder or an iterable of TreeSnapshot, "
            f"got {type(snapshots).__name__}"
        )
    snaps = as_list(snapshots, name, "TreeSnapshot")  # a 0-d tensor or array is Iterable too
    for s in snaps:
        if not isinstance(s, TreeSnapshot):
            raise TypeError(f"{name} must hold TreeSnapshot objects, got {type(s).__name__}")
    return snaps


def predict_evict(tree: Tree, size: int) -> list[int]:
    """Uuids of the nodes ``evict(size)`` would remove, in the order it would remove them.

    Replays the manager's rule on a snapshot: pop the evictable leaf (``ref_count == 0``, no
    children, not a root) with the smallest policy priority, ties to the smaller uuid, until
    ``size`` tokens are freed; a parent left childless and unlocked becomes a candidate at once.
    Every namespace counts (the snapshot's ``others`` too), as for ``evict``: a uuid returned may
    be of a node the drawing of one namespace does not show. The manager is not changed.
    Raises ``TypeError`` for a ``size`` that is not an int, ``ValueError`` for a negative one and
    ``RuntimeError`` (like ``evict``) when more than the evictable size is asked for.
    """
    snap = as_snapshot(tree)
    if isinstance(size, bool) or not isinstance(size, int):
        raise TypeError(f"size must be an int, got {type(size).__name__}")
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    if size > snap.evictable_size:
        raise RuntimeError(f"cannot evict {size} tokens: only {snap.evictable_size} are evictable")
    nodes = {n.uuid: n for n in (*snap.nodes, *snap.others)}
    live_children = {u: len(n.children) for u, n in nodes.items()}
    heap = [
        (n.priority, u)
        for u, n in nodes.items()
        if not n.is_root and n.ref_count == 0 and not n.children
    ]
    heapq.heapify(heap)
    order: list[int] = []
    freed = 0
    while freed < size and heap:
        _, u = heapq.heappop(heap)
        order.append(u)
        freed += nodes[u].length
        parent = nodes[nodes[u].parent]  # type: ignore[index]
        live_children[parent.uuid] -= 1
        if not parent.is_root and parent.ref_count == 0 and live_children[parent.uuid] == 0:
            heapq.heappush(heap, (parent.priority, parent.uuid))
    return order


def evict_order(snap: TreeSnapshot, evict_size: int | None) -> dict[int, int]:
    """``{uuid: rank}`` of the nodes of ``snap``'s namespace that ``evict(evict_size)`` would
    take, ``rank`` their place (from 1) among every node it takes, other namespaces' included;
    empty if it would fail."""
    if not evict_size:
        return {}
    try:
        order = predict_evict(snap, evict_size)
    except RuntimeError:
        return {}
    return {u: i + 1 for i, u in enumerate(order) if u in snap.by_uuid}
