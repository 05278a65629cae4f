"""`RadixCacheManager`: prefixes shared through a radix tree, protected by ref counts, evicted by policy.

Each non-root node holds a run of tokens (its key) and the KV slots that hold them (its value);
the path from the root to a node spells a cached prefix. With ``page_size > 1`` every key is a
whole number of pages and children are filed under their first page, so matching, splitting and
eviction all happen at page boundaries.

Costs. Keys are numpy arrays compared a node at a time (one vectorised comparison per node, no
Python work per token). Evictable leaves live in a heap keyed by the eviction policy and kept up
to date as the tree changes, so evicting ``k`` leaves costs ``O(k log n)``; stale heap entries
are skipped when popped and the heap is compacted when they outnumber the live ones.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Dict, Hashable, Iterator, List, Optional, Tuple

import numpy as np
import torch

from .._validate import check_indices, check_positive_int, check_size, check_token_ids
from .base import BaseCacheHandle, BaseCacheManager, SizeInfo
from .eviction import EVICTION_POLICIES, EvictionPolicy

__all__ = ["RadixTreeNode", "RadixCacheHandle", "RadixCacheManager"]

_Priority = Tuple[int, int]
_ITEM = np.dtype(np.int64).itemsize  # bytes per token id in a key


class RadixTreeNode:
    """One edge of the tree: a run of tokens and the KV slots holding them.

    ``children`` maps a child's first token (``page_size == 1``) or first page, as a tuple of
    token ids (``page_size > 1``), to the child. ``ref_count`` counts the locked handles whose
    path runs through this node; a node with ``ref_count > 0`` is protected. ``timestamp`` is the
    manager's logical clock at the node's last match or insert; ``insert_time`` when its tokens
    were inserted.
    """

    __slots__ = (
        "children", "_parent", "ref_count", "uuid", "timestamp", "insert_time",
        "_key", "_kb", "_value", "_in_tree", "_heap_priority",
    )

    def __init__(self, uuid: int, key: np.ndarray, value: torch.Tensor, timestamp: int,
                 insert_time: int) -> None:
        self.children: Dict[Hashable, RadixTreeNode] = {}
        self._parent: Optional[RadixTreeNode] = None
        self.ref_count = 0
        self.uuid = uuid
        self.timestamp = timestamp
        self.insert_time = insert_time
        self._key = key
        self._kb = key.tobytes()  # the same tokens as bytes: whole-node matches are one memcmp
        self._value = value
        self._in_tree = True
        self._heap_priority: Optional[_Priority] = None

    @property
    def parent(self) -> Optional["RadixTreeNode"]:
        return self._parent

    @property
    def key(self) -> torch.Tensor:
        """The node's token ids, shape ``(length,)``, int64 (a view; do not write to it)."""
        return torch.from_numpy(self._key)

    @property
    def value(self) -> torch.Tensor:
        """The KV slots of the node's tokens, shape ``(length,)``, int32 on the manager's device."""
        return self._value

    @property
    def length(self) -> int:
        return len(self._key)

    @property
    def in_tree(self) -> bool:
        """False once the node was evicted (or the tree reset): its handle can no longer be locked."""
        return self._in_tree

    def is_root(self) -> bool:
        return self._parent is None

    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        keys = self._key.tolist()
        shown = keys if len(keys) <= 8 else keys[:4] + ["..."] + keys[-2:]
        return (f"RadixTreeNode(uuid={self.uuid}, key={shown}, ref_count={self.ref_count}, "
                f"timestamp={self.timestamp})")


@dataclass(frozen=True)
class RadixCacheHandle(BaseCacheHandle):
    """The matched prefix ends at the end of ``node``; ``cached_len`` is the path's length."""

    node: RadixTreeNode


class RadixCacheManager(BaseCacheManager):
    """Prefix cache on a radix tree.

    Args:
        device: where the KV-slot indices live (values returned by ``match_prefix``/``evict``).
        page_size: tokens per page; matching and insertion only ever cover whole pages.
        eviction_policy: a name registered in `kvcache.managers.eviction.EVICTION_POLICIES`
            (``"lru"`` or ``"fifo"`` built in).
    """

    def __init__(self, device: torch.device | str = "cpu", page_size: int = 1,
                 eviction_policy: str = "lru") -> None:
        check_positive_int(page_size, "page_size")
        if eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"eviction_policy must be one of {sorted(EVICTION_POLICIES)}, got {eviction_policy!r}"
            )
        self.device = torch.device(device)
        self.page_size = page_size
        self.eviction_policy = eviction_policy
        self._policy: EvictionPolicy = EVICTION_POLICIES[eviction_policy]()
        self.empty_tensor = torch.empty(0, dtype=torch.int32, device=self.device)
        self._uuid = 0
        self._clock = 0
        self._init_tree()

    # ------------------------------------------------------------------ state
    def _init_tree(self) -> None:
        self.root_node = RadixTreeNode(self._next_uuid(), np.empty(0, dtype=np.int64),
                                       self.empty_tensor, self._clock, self._clock)
        self.root_node.ref_count = 1  # the root is never evicted
        self._evictable_size = 0
        self._protected_size = 0
        self._num_nodes = 0  # excluding the root
        self._heap: List[Tuple[_Priority, RadixTreeNode]] = []

    def _next_uuid(self) -> int:
        self._uuid += 1
        return self._uuid - 1

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _child_key(self, ids: np.ndarray, pos: int = 0) -> Hashable:
        if self.page_size == 1:
            return int(ids[pos])
        return tuple(ids[pos:pos + self.page_size].tolist())

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

    def nodes(self) -> Iterator[RadixTreeNode]:
        """Every node, the root first, depth first, children in insertion order."""
        stack = [self.root_node]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(list(node.children.values())))

    def cached_indices(self) -> torch.Tensor:
        values = [n.value for n in self.nodes() if not n.is_root()]
        return torch.cat(values) if values else self.empty_tensor

    def reset(self) -> None:
        if self._protected_size > 0:
            raise RuntimeError(
                f"cannot reset while {self._protected_size} tokens are locked; unlock every handle first"
            )
        for node in self.nodes():
            node._in_tree = False
        self._init_tree()

    # ----------------------------------------------------------- arguments
    def _token_array(self, input_ids: torch.Tensor) -> np.ndarray:
        check_token_ids(input_ids)
        return (input_ids if input_ids.dtype == torch.int64 else input_ids.to(torch.int64)).numpy()

    def _check_page_aligned(self, indices: torch.Tensor, n: int) -> None:
        """Each page of ``indices[:n]`` must be ``page_size`` consecutive slots of one page."""
        ps = self.page_size
        if ps == 1 or n == 0:
            return
        pages = indices[:n].view(-1, ps)
        offsets = pages - pages[:, :1]
        expected = torch.arange(ps, dtype=torch.int32, device=indices.device)
        if bool(((pages[:, 0] % ps) != 0).any()) or not bool((offsets == expected).all()):
            raise ValueError(
                f"with page_size={ps} every {ps} indices must be the consecutive slots of one page "
                f"(first slot a multiple of {ps}); got {indices[:n].tolist()}"
            )

    # --------------------------------------------------------------- heap
    def _is_evictable_leaf(self, node: RadixTreeNode) -> bool:
        return node._in_tree and node.ref_count == 0 and not node.children and not node.is_root()

    def _push(self, node: RadixTreeNode) -> None:
        priority = self._policy.priority(node)
        node._heap_priority = priority
        heapq.heappush(self._heap, (priority, node))
        if len(self._heap) > 2 * self._num_nodes + 64:
            self._compact_heap()

    def _entry_is_live(self, priority: _Priority, node: RadixTreeNode) -> bool:
        return self._is_evictable_leaf(node) and node._heap_priority == priority

    def _compact_heap(self) -> None:
        live = []
        for priority, node in self._heap:
            if node._heap_priority != priority:
                continue  # superseded by a newer entry for the same node
            if self._is_evictable_leaf(node):
                live.append((priority, node))
            else:
                node._heap_priority = None  # its entry is dropped: it must be pushed again
        self._heap = live
        heapq.heapify(self._heap)

    def _refresh(self, node: RadixTreeNode) -> None:
        """Re-file ``node`` in the heap if it is an evictable leaf whose priority changed."""
        if self._is_evictable_leaf(node) and node._heap_priority != self._policy.priority(node):
            self._push(node)

    # --------------------------------------------------------------- tree
    def _split_at(self, node: RadixTreeNode, pos: int) -> RadixTreeNode:
        """Cut ``node`` after ``pos`` tokens; return the new parent holding the first ``pos``.

        The new node inherits ``ref_count`` (every lock through ``node`` also ran through its
        first part), ``timestamp`` and ``insert_time``. Sizes do not change.
        """
        parent = node._parent
        assert parent is not None and 0 < pos < node.length and pos % self.page_size == 0
        new = RadixTreeNode(self._next_uuid(), node._key[:pos], node._value[:pos],
                            node.timestamp, node.insert_time)
        new.ref_count = node.ref_count
        new._parent = parent
        parent.children[self._child_key(node._key)] = new
        node._key = node._key[pos:]
        node._kb = node._kb[pos * _ITEM:]
        node._value = node._value[pos:]
        node._parent = new
        new.children[self._child_key(node._key)] = node
        self._num_nodes += 1
        return new

    def _walk(self, ids: np.ndarray, tic: int) -> Tuple[RadixTreeNode, int]:
        """Follow ``ids`` (page-aligned length) down the tree; split where a node half-matches.

        Every node on the matched path, the split-off part included, gets timestamp ``tic``:
        the whole matched prefix was just used.
        """
        node, pos, n = self.root_node, 0, len(ids)
        ids_b = ids.tobytes()
        while pos < n:
            child = node.children.get(self._child_key(ids, pos))
            if child is None:
                break
            key = child._key
            m = min(len(key), n - pos)
            kb = child._kb if m == len(key) else child._kb[: m * _ITEM]
            if kb != ids_b[pos * _ITEM:(pos + m) * _ITEM]:
                m = int((key[:m] != ids[pos:pos + m]).argmax()) // self.page_size * self.page_size
            pos += m
            if m < child.length:
                child = self._split_at(child, m)
            child.timestamp = tic
            node = child
            if m < len(key):
                break
        self._refresh(node)
        return node, pos

    # ------------------------------------------------------------- public
    def match_prefix(self, input_ids: torch.Tensor) -> Tuple[RadixCacheHandle, torch.Tensor]:
        """Longest cached whole-page prefix of ``input_ids`` and its slots, in order.

        Not read-only: a node matched only in part is split so that the handle can point at the
        end of the match, and the matched path's timestamps are refreshed.
        """
        ids = self._token_array(input_ids)
        ids = ids[: len(ids) // self.page_size * self.page_size]
        node, prefix_len = self._walk(ids, self._tick())
        if prefix_len == 0:
            return RadixCacheHandle(0, self.root_node), self.empty_tensor
        values: List[torch.Tensor] = []
        handle = RadixCacheHandle(prefix_len, node)
        while not node.is_root():
            values.append(node._value)
            node = node._parent  # type: ignore[assignment]
        values.reverse()
        return handle, torch.cat(values)

    def insert_prefix(self, input_ids: torch.Tensor, indices: torch.Tensor) -> int:
        """Cache the whole-page part of ``input_ids`` with ``indices``; return the length already cached.

        Only ``indices[returned:aligned]`` enter the tree (copied); ``indices[:returned]`` and the
        tail past the last whole page stay the caller's, to free or keep.
        """
        ids = self._token_array(input_ids)
        check_indices(indices, self.device)
        if indices.shape[0] != len(ids):
            raise ValueError(f"len(indices) ({indices.shape[0]}) must equal len(input_ids) ({len(ids)})")
        n = len(ids) // self.page_size * self.page_size
        self._check_page_aligned(indices, n)
        tic = self._tick()
        node, prefix_len = self._walk(ids[:n], tic)
        if prefix_len < n:
            new = RadixTreeNode(self._next_uuid(), ids[prefix_len:n].copy(),
                                indices[prefix_len:n].clone(), tic, tic)
            new._parent = node
            node.children[self._child_key(new._key)] = new
            self._num_nodes += 1
            self._evictable_size += new.length
            self._push(new)
        return prefix_len

    def _path(self, handle: BaseCacheHandle) -> List[RadixTreeNode]:
        """Nodes from ``handle.node`` up to (not including) the root, after checking the handle."""
        if not isinstance(handle, RadixCacheHandle):
            raise TypeError(f"handle must be a RadixCacheHandle, got {type(handle).__name__}")
        path: List[RadixTreeNode] = []
        node = handle.node
        length = 0
        while not node.is_root():
            if not node._in_tree:
                raise RuntimeError(f"handle's node {node.uuid} was evicted; match the prefix again")
            path.append(node)
            length += node.length
            node = node._parent  # type: ignore[assignment]
        if node is not self.root_node:
            raise RuntimeError("handle belongs to another manager, or to a tree that was reset")
        if length != handle.cached_len:
            raise RuntimeError(f"handle says cached_len={handle.cached_len} but its path holds {length} tokens")
        return path

    def eviction_priority(self, node: RadixTreeNode) -> Tuple[int, ...]:
        """``node``'s key under this manager's policy: the evictable leaf with the smallest goes first."""
        return tuple(self._policy.priority(node))

    def handle_indices(self, handle: BaseCacheHandle) -> torch.Tensor:
        """The slots of the prefix behind ``handle`` (read-only: no split, no timestamp change)."""
        path = self._path(handle)
        return torch.cat([n._value for n in reversed(path)]) if path else self.empty_tensor

    def lock_handle(self, handle: BaseCacheHandle, unlock: bool = False) -> None:
        """Lock (``ref_count += 1``) or unlock every node from ``handle.node`` up to the root.

        A handle of length 0 (the root) needs no protection: locking and unlocking it do nothing.
        """
        path = self._path(handle)
        if not path:
            return
        if unlock:
            if path[0].ref_count <= 0:
                raise RuntimeError(f"cannot unlock a handle that is not locked (node {path[0].uuid})")
            for node in path:
                node.ref_count -= 1
                if node.ref_count == 0:
                    self._evictable_size += node.length
                    self._protected_size -= node.length
            self._refresh(path[0])
        else:
            for node in path:
                if node.ref_count == 0:
                    self._evictable_size -= node.length
                    self._protected_size += node.length
                node.ref_count += 1

    def evict(self, size: int) -> torch.Tensor:
        """Evict unlocked leaves in policy order until at least ``size`` tokens are freed.

        A parent left childless and unlocked becomes a candidate at once. Raises ``RuntimeError``
        (evicting nothing) when fewer than ``size`` tokens are evictable.
        """
        check_size(size)
        if size == 0:
            return self.empty_tensor
        if size > self._evictable_size:
            raise RuntimeError(
                f"cannot evict {size} tokens: only {self._evictable_size} are evictable "
                f"({self._protected_size} are locked)"
            )
        evicted: List[torch.Tensor] = []
        freed = 0
        while freed < size:
            node = self._pop_leaf()
            evicted.append(node._value)
            freed += node.length
            self._evictable_size -= node.length
            self._num_nodes -= 1
            parent = node._parent
            assert parent is not None
            del parent.children[self._child_key(node._key)]
            node._in_tree = False
            self._refresh(parent)
        return torch.cat(evicted)

    def _pop_leaf(self) -> RadixTreeNode:
        while self._heap:
            priority, node = heapq.heappop(self._heap)
            if node._heap_priority != priority:
                continue  # superseded by a newer entry for the same node
            # This was the node's entry; it is gone now, so a node that is not evictable at
            # the moment must be pushed again when it becomes an evictable leaf.
            node._heap_priority = None
            if self._is_evictable_leaf(node):
                return node
        raise RuntimeError("internal error: evictable size is positive but no evictable leaf is filed")

    # ---------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """Walk the whole tree and raise ``RuntimeError`` on the first inconsistency found."""
        root = self.root_node
        if root.ref_count != 1 or root.length != 0 or root._parent is not None:
            raise RuntimeError("root must be empty, parentless and hold ref_count 1")
        live = {id(n) for p, n in self._heap if self._entry_is_live(p, n)}
        evictable = protected = count = 0
        values: List[torch.Tensor] = []
        stack = [root]
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                where = f"node {child.uuid}"
                if child._parent is not node:
                    raise RuntimeError(f"{where}: parent link does not point to the node that files it")
                if child.length == 0:
                    raise RuntimeError(f"{where}: empty node")
                if child._kb != child._key.tobytes():
                    raise RuntimeError(f"{where}: key bytes disagree with the key")
                if len(child._value) != child.length:
                    raise RuntimeError(f"{where}: {child.length} tokens but {len(child._value)} indices")
                if child.length % self.page_size:
                    raise RuntimeError(f"{where}: length {child.length} is not whole pages of {self.page_size}")
                if self._child_key(child._key) != key:
                    raise RuntimeError(f"{where}: filed under {key!r} but starts with {self._child_key(child._key)!r}")
                if child.ref_count < 0:
                    raise RuntimeError(f"{where}: negative ref_count {child.ref_count}")
                if not node.is_root() and node.ref_count < child.ref_count:
                    raise RuntimeError(f"{where}: ref_count {child.ref_count} exceeds its parent's {node.ref_count}")
                if not node.is_root() and node.timestamp < child.timestamp:
                    raise RuntimeError(f"{where}: used at {child.timestamp}, after its parent ({node.timestamp})")
                if not child._in_tree:
                    raise RuntimeError(f"{where}: marked evicted but still in the tree")
                if self._is_evictable_leaf(child) and id(child) not in live:
                    raise RuntimeError(f"{where}: evictable leaf missing from the eviction heap")
                if child.ref_count == 0:
                    evictable += child.length
                else:
                    protected += child.length
                count += 1
                values.append(child._value)
                stack.append(child)
        if (evictable, protected) != (self._evictable_size, self._protected_size):
            raise RuntimeError(
                f"sizes disagree with the nodes: recorded (evictable={self._evictable_size}, "
                f"protected={self._protected_size}), counted (evictable={evictable}, protected={protected})"
            )
        if count != self._num_nodes:
            raise RuntimeError(f"recorded {self._num_nodes} nodes, counted {count}")
        if values:
            allv = torch.cat(values)
            uniq, counts = torch.unique(allv, return_counts=True)
            if len(uniq) != len(allv):
                dup = uniq[counts > 1][:8].tolist()
                raise RuntimeError(f"indices appear more than once in the tree: {dup}")
