"""`RadixCacheManager`: prefixes shared through a radix tree, protected by locks, evicted by policy.

Read it top to bottom: `RadixTreeNode` (one edge of the tree), `RadixCacheHandle`, `Walk`; then
the manager: its state, the walk (the one loop that follows ids down the tree), the split, match,
insert, locks, eviction and the integrity check. The eviction policies are in ``eviction.py``.

A node's tokens are the bytes of their int64 ids (``key_bytes``): a whole node matches with one
``bytes.startswith`` (a memcmp) against the ids' bytes, no Python work per token. Children are
filed under their first token id (``page_size == 1``) or their first page's bytes, one dict probe
away. Slots are int32 NumPy arrays on the host; the public calls take and return tensors.

Each count changes in one place: lock counts and the protected size in `_add_locks`; the tokens
held in `_hold` and `_release`, the record of the pages the tree holds (the evictable size is
the held tokens less the protected ones); nodes are made by `_split` and `_add_leaf`, removed by
`_remove_leaf`, and filed for eviction (`LeafHeap.file`) where they become evictable leaves.
All or nothing: every check a call makes comes before its first change.
"""

from __future__ import annotations

import struct
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from .._validate import (
    check_device,
    check_page_aligned,
    check_page_size,
    check_same_length,
    check_size,
    slot_array,
    token_ids,
)
from .base import BaseCacheHandle, BaseCacheManager, InsertResult, SizeInfo
from .cache_events import CacheEvent, EventLog, check_extra_key, events_off
from .eviction import EVICTION_POLICIES, LeafHeap, is_monotone

__all__ = ["RadixTreeNode", "RadixCacheHandle", "RadixCacheManager", "Walk"]

ITEM = 8  # bytes per token id in a key (int64)
_first_id = struct.Struct("=q").unpack_from  # the first token id of a key, as an int


class RadixTreeNode:
    """One edge of the tree: a run of tokens and the KV slots that hold them.

    Fields (the manager keeps them consistent; `RadixCacheManager.check_integrity` catches code
    that does not): ``children`` maps a child's first token (``page_size == 1``) or the bytes
    of its first page's int64 ids to the child; ``parent`` (``None`` for a root);
    ``ref_count``, the locked handles whose path runs through the node (``> 0``: protected);
    ``timestamp``, the manager's clock at the node's last match or insert; ``insert_time``,
    when its tokens were inserted; ``hit_count``, how many matches and inserts used it;
    ``uuid``, a serial number; ``key_bytes``, its token ids as native-order int64 bytes;
    ``value_array``, its slots (int32 NumPy on the host); ``pages``, the pages of those slots,
    one per page (``intp``: what eviction hands back to the manager's record of held pages);
    ``in_tree``, false once the node was evicted or the tree reset.
    """

    __slots__ = (
        "children",
        "device",
        "hit_count",
        "in_tree",
        "insert_time",
        "key_bytes",
        "pages",
        "parent",
        "ref_count",
        "timestamp",
        "uuid",
        "value_array",
    )

    def __init__(
        self,
        uuid: int,
        key_bytes: bytes,
        value_array: np.ndarray,
        pages: np.ndarray,
        timestamp: int,
        device: torch.device,
        parent: RadixTreeNode | None = None,
    ) -> None:
        self.children: dict[Hashable, RadixTreeNode] = {}
        self.parent = parent
        self.ref_count = 0
        self.uuid = uuid
        self.timestamp = self.insert_time = timestamp
        self.hit_count = 0 if parent is None else 1
        self.key_bytes = key_bytes
        self.value_array = value_array
        self.pages = pages
        self.in_tree = True
        self.device = device  # where `value` returns the slots

    @property
    def key(self) -> torch.Tensor:
        """The node's token ids, shape ``(length,)``, int64 on the CPU (a copy)."""
        return torch.from_numpy(np.frombuffer(self.key_bytes, dtype=np.int64).copy())

    @property
    def value(self) -> torch.Tensor:
        """The KV slots of the node's tokens, shape ``(length,)``, int32 on the manager's device.

        On the CPU this shares memory with the node: read it, do not write to it.
        """
        out = torch.from_numpy(self.value_array)
        return out if self.device.type == "cpu" else out.to(self.device)

    @property
    def length(self) -> int:
        return len(self.value_array)

    def is_root(self) -> bool:
        return self.parent is None

    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        keys = np.frombuffer(self.key_bytes, dtype=np.int64).tolist()
        shown = keys if len(keys) <= 8 else [*keys[:4], "...", *keys[-2:]]
        return (
            f"RadixTreeNode(uuid={self.uuid}, key={shown}, ref_count={self.ref_count}, "
            f"timestamp={self.timestamp})"
        )


@dataclass(frozen=True)
class RadixCacheHandle(BaseCacheHandle):
    """The matched prefix ends at the end of ``node``; ``cached_len`` is the path's length."""

    node: RadixTreeNode


class Walk(NamedTuple):
    """Where a prompt's whole pages lead in a tree (`RadixCacheManager.walk`).

    ``path``: the nodes matched whole, the root's child first; ``partial``: the node after
    them that matches only its first ``cut`` tokens (whole pages), or ``None``; ``length``:
    the tokens matched in all (the path's, plus ``cut``).
    """

    path: list[RadixTreeNode]
    partial: RadixTreeNode | None
    cut: int
    length: int


_NO_WALK = Walk([], None, 0, 0)  # read only: what a namespace never inserted into gives
_NOWHERE = object()  # a namespace key no manager has


def common_tokens(key_bytes: bytes, ids: np.ndarray, pos: int) -> int:
    """How many leading tokens of ``key_bytes`` equal ``ids[pos:]`` (one vectorised compare)."""
    key = np.frombuffer(key_bytes, dtype=np.int64)
    m = min(len(key), len(ids) - pos)
    differ = key[:m] != ids[pos : pos + m]
    return int(differ.argmax()) if differ.any() else m


class RadixCacheManager(BaseCacheManager):
    """Prefix cache on a radix tree.

    Args:
        device: where the KV-slot indices live (values returned by ``match_prefix``/``evict``).
        page_size: tokens per page; matching and insertion only ever cover whole pages.
        eviction_policy: a name registered in `EVICTION_POLICIES` (``"lru"`` or ``"fifo"``
            built in; `register_eviction_policy` adds one).
        events: record what is stored, removed and cleared for `take_events` (keyword only).

    Namespaces: each ``extra_key`` has its own root, made by its first insert (``None``'s is
    ``root_node``); eviction, sizes and integrity cover every root.
    """

    def __init__(
        self,
        device: torch.device | str = "cpu",
        page_size: int = 1,
        eviction_policy: str = "lru",
        *,
        events: bool = False,
    ) -> None:
        page_size = check_page_size(page_size)
        if not isinstance(events, bool):
            raise TypeError(f"events must be a bool, got {type(events).__name__}")
        names = sorted(EVICTION_POLICIES)
        if not isinstance(eviction_policy, str):
            raise TypeError(
                f"eviction_policy must be a str (one of {names}), "
                f"got {type(eviction_policy).__name__} {eviction_policy!r}"
            )
        if eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction_policy must be one of {names}, got {eviction_policy!r}")
        self.device = check_device(device)
        self.page_size = page_size
        self.eviction_policy = eviction_policy
        policy = EVICTION_POLICIES[eviction_policy]()
        self._priority = policy.priority
        self._leaves: LeafHeap[RadixTreeNode] = LeafHeap(policy.priority, is_monotone(policy))
        self._refile_on_use = not self._leaves.monotone  # see `_visit`
        self.empty_tensor = torch.empty(0, dtype=torch.int32, device=self.device)
        self._on_cpu = self.device.type == "cpu"  # asked on every call: kept as a plain bool
        self._events = EventLog() if events else None
        self._uuid = self._clock = 0
        self._clear()

    # ------------------------------------------------------------------ state
    def _clear(self) -> None:
        """An empty tree: one root (``None``'s namespace), no locks, nothing held."""
        self.root_node = self._new_root()
        self._roots: dict[Hashable, RadixTreeNode] = {None: self.root_node}
        self._namespace_of: dict[int, Hashable] = {self.root_node.uuid: None}  # root's uuid -> key
        self._locks: dict[int, tuple[RadixCacheHandle, int]] = {}  # id(handle) -> (it, times)
        self._protected_size = 0  # tokens in nodes with ref_count > 0
        self._held_tokens = 0  # tokens in the tree
        self._held = np.zeros(1024, dtype=np.int32)  # per page: 0 free, else held
        self._rows, self._page_of = self._page_rows(1024)  # see `_hold`
        self._marks = np.arange(1, 1025, dtype=np.int32)  # 1, 2, 3, ...: see `_hold`
        self._num_nodes = 0  # excluding the roots
        self._leaves.clear()

    def _new_node(
        self,
        key_bytes: bytes,
        slots: np.ndarray,
        pages: np.ndarray,
        parent: RadixTreeNode | None,
    ) -> RadixTreeNode:
        """A node stamped with the clock, under the next uuid."""
        self._uuid += 1
        return RadixTreeNode(
            self._uuid - 1, key_bytes, slots, pages, self._clock, self.device, parent
        )

    def _new_root(self) -> RadixTreeNode:
        """An empty node holding one lock for ever: a root is never evicted."""
        root = self._new_node(b"", np.empty(0, np.int32), np.empty(0, np.intp), None)
        root.ref_count = 1
        return root

    def _child_key(self, key_bytes: bytes) -> Hashable:
        """The key a node whose tokens are ``key_bytes`` is filed under in its parent."""
        if self.page_size == 1:
            first: int = _first_id(key_bytes)[0]
            return first
        return key_bytes[: self.page_size * ITEM]

    def _out(self, values: np.ndarray) -> torch.Tensor:
        out = torch.from_numpy(values)
        return out if self._on_cpu else out.to(self.device)

    @property
    def size_info(self) -> SizeInfo:
        return SizeInfo(self._held_tokens - self._protected_size, self._protected_size)

    @property
    def num_nodes(self) -> int:
        """Nodes in the tree, the roots excluded."""
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
        """The root of each namespace (``extra_key``) inserted into since the reset (a copy)."""
        return dict(self._roots)

    def nodes(self, extra_key: Hashable = None) -> Iterator[RadixTreeNode]:
        """Every node of namespace ``extra_key``'s tree (default ``None``'s), the root first,
        depth first, children in insertion order."""
        root = self._roots.get(check_extra_key(extra_key))
        stack = [root] if root is not None else []
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.children.values()))

    def cached_indices(self) -> torch.Tensor:
        values = [n.value_array for k in self._roots for n in self.nodes(k) if n.parent is not None]
        return self._out(np.concatenate(values)) if values else self.empty_tensor

    def take_events(self) -> list[CacheEvent]:
        """What was stored, removed and cleared since the last call, oldest first; empties the
        log. ``RuntimeError`` unless the manager was built with ``events=True``."""
        if self._events is None:
            raise events_off(type(self).__name__)
        return self._events.take()

    def reset(self) -> None:
        """Forget every prefix. Locks on empty (root) handles are forgotten with them."""
        if self._protected_size > 0:
            raise RuntimeError(
                f"cannot reset while {self._protected_size} tokens are locked; "
                "unlock every handle first"
            )
        for key in self._roots:
            for node in self.nodes(key):
                node.in_tree = False
        self._clear()
        if self._events is not None:
            self._events.cleared()

    # ------------------------------------------------------------------ the walk
    def walk(self, input_ids: torch.Tensor, extra_key: Hashable = None) -> Walk:
        """Where the whole pages of ``input_ids`` lead in namespace ``extra_key``'s tree, read
        only: nothing is split, stamped or locked (`match_prefix` does that with what this
        finds). Same checks as `match_prefix`."""
        ids = token_ids(input_ids)
        root = self._roots.get(check_extra_key(extra_key))
        return Walk([], None, 0, 0) if root is None else self._walk(ids, root)

    def _walk(self, ids: np.ndarray, node: RadixTreeNode, start: int = 0) -> Walk:
        """Follow the whole pages of ``ids`` (C-contiguous int64) from token ``start`` down from
        ``node``, whose path from its root spells ``ids[:start]`` (a root, or where
        `insert_and_unlock` resumes). Per node: one dict probe for the child filed under the next
        token (or page), one memcmp of its key against the ids' bytes in place. A child matching
        only in part ends the walk, cut at whole pages (at least one: its first page matched).
        Positions are byte offsets into the ids' bytes (``ITEM`` per token), as the keys are."""
        ps = self.page_size
        data = ids.data.cast("B")  # the ids' own bytes: compared in place, never copied
        end, page = (len(ids) - len(ids) % ps) * ITEM, ps * ITEM
        path: list[RadixTreeNode] = []
        pos = start * ITEM
        while pos < end:
            child = node.children.get(
                ids.item(pos // ITEM) if ps == 1 else data[pos : pos + page].tobytes()
            )
            if child is None:
                break
            key = child.key_bytes
            stop = pos + len(key)
            if stop > end or not key.startswith(data[pos:stop]):
                cut = common_tokens(key, ids, pos // ITEM) // ps * ps
                return Walk(path, child, cut, pos // ITEM + cut)
            path.append(child)
            pos = stop
            node = child
        return Walk(path, None, 0, pos // ITEM)

    def _visit(self, walk: Walk, start: RadixTreeNode, tic: int) -> RadixTreeNode:
        """Apply ``walk`` (made from ``start``): stamp the nodes it matched with ``tic`` (a hit
        each), split its partial node after the cut and stamp the first part; return the node
        the match ends at (``start`` when nothing matched)."""
        end = up = start
        while up.parent is not None:  # a resumed walk: the path down to it matched too
            up.timestamp = tic
            up.hit_count += 1
            up = up.parent
        for end in walk.path:
            end.timestamp = tic
            end.hit_count += 1
        if walk.partial is not None:
            end = self._split(walk.partial, walk.cut)
            end.timestamp = tic
            end.hit_count += 1
        if self._refile_on_use:  # a priority may have fallen: the heap must be told
            for node in (end, walk.partial):
                if node is not None and self._is_evictable_leaf(node):
                    self._leaves.file(node)
        return end

    def _split(self, node: RadixTreeNode, cut: int) -> RadixTreeNode:
        """Cut ``node`` after ``cut`` tokens: a new node takes the first ``cut`` tokens and slots
        and ``node``'s place under its parent; ``node`` keeps the rest and becomes the new
        node's only child. Returns the new node.

        The new node copies ``ref_count`` (every lock through ``node`` also runs through its
        first part), ``timestamp``, ``insert_time`` and ``hit_count``. ``node`` stays the same
        object, so a handle on it still names the same prefix. Sizes do not change.
        """
        parent = node.parent
        if parent is None:
            raise RuntimeError("internal error: a root holds no tokens to split")
        at, pcut = cut * ITEM, cut // self.page_size
        new = self._new_node(node.key_bytes[:at], node.value_array[:cut], node.pages[:pcut], parent)
        new.ref_count, new.hit_count = node.ref_count, node.hit_count
        new.timestamp, new.insert_time = node.timestamp, node.insert_time
        parent.children[self._child_key(new.key_bytes)] = new
        node.key_bytes, node.value_array = node.key_bytes[at:], node.value_array[cut:]
        node.pages = node.pages[pcut:]
        node.parent = new
        new.children[self._child_key(node.key_bytes)] = node
        self._num_nodes += 1
        return new

    # ------------------------------------------------------------------ match
    def match_prefix(
        self, input_ids: torch.Tensor, extra_key: Hashable = None
    ) -> tuple[RadixCacheHandle, torch.Tensor]:
        """Longest whole-page prefix of ``input_ids`` cached under ``extra_key``, and its slots.

        Not read-only: a node matched only in part is split so that the handle can point at the
        end of the match, and the matched path's timestamps are refreshed (`walk` reads only).
        A miss returns a handle on ``root_node`` with ``cached_len == 0``.
        """
        ids = token_ids(input_ids)
        root = self.root_node if extra_key is None else self._roots.get(check_extra_key(extra_key))
        self._clock += 1  # the logical clock: one tick per match and insert
        walk = _NO_WALK if root is None else self._walk(ids, root)
        if root is None or not walk.length:
            return RadixCacheHandle(0, self.root_node), self.empty_tensor
        end = self._visit(walk, root, self._clock)
        values = [node.value_array for node in walk.path]
        if walk.partial is not None:
            values.append(end.value_array)
        slots = np.concatenate(values) if len(values) > 1 else values[0].copy()
        return RadixCacheHandle(walk.length, end), self._out(slots)

    def match_and_lock(
        self, input_ids: torch.Tensor, extra_key: Hashable = None
    ) -> tuple[RadixCacheHandle, torch.Tensor]:
        """`match_prefix`, then `lock_handle` of its handle (the flow's steps 1 and 2)."""
        handle, slots = self.match_prefix(input_ids, extra_key)
        self._lock(handle)
        return handle, slots

    # ------------------------------------------------------------------ insert
    def insert_prefix(
        self, input_ids: torch.Tensor, indices: torch.Tensor, extra_key: Hashable = None
    ) -> int:
        """Cache the whole-page part of ``input_ids`` with ``indices`` under ``extra_key``; return
        the length already cached there.

        Only ``indices[returned:aligned]`` enter the tree (copied); ``indices[:returned]`` and the
        tail past the last whole page stay the caller's, to free or keep. Raises ``ValueError``
        (changing nothing) when a slot that would enter is negative, already held by the tree,
        listed twice, or (``page_size > 1``) not part of a whole aligned page.
        """
        return self.insert_and_match(input_ids, indices, extra_key).cached_len

    def insert_and_match(
        self, input_ids: torch.Tensor, indices: torch.Tensor, extra_key: Hashable = None
    ) -> InsertResult:
        """`insert_prefix` and the (unlocked) handle of the whole inserted prefix, in one walk."""
        return InsertResult(*self._insert(input_ids, indices, extra_key, None))

    def _insert(
        self,
        input_ids: torch.Tensor,
        indices: torch.Tensor,
        extra_key: Hashable,
        after: RadixCacheHandle | None,
    ) -> tuple[int, RadixCacheHandle]:
        """`insert_and_match`'s length already cached and handle. The walk starts at ``after.node``
        where that handle names a prefix of ``input_ids`` in this namespace (`insert_and_unlock`
        passes its locked handle)."""
        ids = token_ids(input_ids)
        slots = slot_array(indices, self.device)
        check_same_length(len(slots), len(ids))
        key = None if extra_key is None else check_extra_key(extra_key)
        root = self._roots.get(key)
        n = len(ids) - len(ids) % self.page_size
        start, pos = root, 0
        if root is not None and after is not None and self._spells(after, ids, root):
            start, pos = after.node, after.cached_len
        if start is None:
            walk = _NO_WALK
        elif pos and not start.children:  # resumed at a leaf (the flow's usual case): no walk
            walk = Walk([], None, 0, pos)
        else:
            walk = self._walk(ids, start, pos)
        cached = walk.length
        new_slots = slots[cached:n]
        if cached < n:
            pages = self._hold(new_slots)  # the last check, and the first change
        if root is None:  # the namespace's first insert: its root, now that nothing can fail
            root = self._roots[key] = self._new_root()
            self._namespace_of[root.uuid] = key
        self._clock += 1
        end = self._visit(walk, start or root, self._clock)
        if cached < n:
            end = self._add_leaf(end, ids[cached:n].tobytes(), new_slots.copy(), pages)
            if self._events is not None:
                self._events.stored(key, ids[:n].tolist(), new_slots.tolist())
        return cached, RadixCacheHandle(n, end)

    def _spells(self, handle: RadixCacheHandle, ids: np.ndarray, root: RadixTreeNode) -> bool:
        """Whether the path from ``root`` down to ``handle.node`` (a locked handle: whole pages)
        spells ``ids[:cached_len]``, a non-empty prefix: one memcmp a node, from the node up."""
        data, hi, node = ids.data.cast("B"), handle.cached_len * ITEM, handle.node
        if not 0 < hi <= len(data):
            return False
        while node.parent is not None:
            key = node.key_bytes
            lo = hi - len(key)
            if lo < 0 or not key.startswith(data[lo:hi]):
                return False
            hi = lo
            node = node.parent
        return hi == 0 and node is root

    def _add_leaf(
        self, parent: RadixTreeNode, key_bytes: bytes, slots: np.ndarray, pages: np.ndarray
    ) -> RadixTreeNode:
        """Hang a new leaf (unlocked: evictable) under ``parent``."""
        leaf = self._new_node(key_bytes, slots, pages, parent)
        parent.children[self._child_key(key_bytes)] = leaf
        self._num_nodes += 1
        self._leaves.file(leaf)
        return leaf

    def insert_and_unlock(
        self,
        handle: BaseCacheHandle,
        input_ids: torch.Tensor,
        indices: torch.Tensor,
        extra_key: Hashable = None,
        *,
        relock: bool = False,
    ) -> InsertResult:
        """`insert_and_match`, then one unlock of ``handle``; with ``relock=True`` the returned
        handle is locked first (the lock moves to the longer prefix).

        ``RuntimeError`` (nothing inserted) when ``handle`` is not locked, and the errors of
        `insert_prefix` with ``handle`` still locked. Nothing after the insert can fail. Where
        the handle's prefix starts ``input_ids`` (the flow's case), the walk resumes at its node:
        the prefix costs one memcmp a node instead of a walk from the root.
        """
        locked = self._locked(handle)  # refuses a handle not locked now
        if not isinstance(relock, bool):
            raise TypeError(f"relock must be a bool, got {type(relock).__name__}")
        cached, new = self._insert(input_ids, indices, extra_key, locked)
        if relock:
            self._lock(new)  # first: the shared path never looks unlocked
        self._unlock(locked)
        return InsertResult(cached, new)

    def _hold(self, slots: np.ndarray) -> np.ndarray:
        """Record the pages of ``slots`` (the new part of an insert) as held by the tree, and
        return them (``intp``, one per page) for the new node to keep; or ``ValueError`` naming
        the value, holding nothing, when a slot is negative, a page is not ``page_size``
        consecutive slots from a multiple of ``page_size``, held already, or listed twice.

        The record is one array indexed by page (0: free), grown to the largest page seen: the
        cost is that of the new pages, never the pool's; beside it, two tables (`_page_rows`):
        each slot's page if it starts one, and each page's slots, so that one lookup finds the
        pages (no division) and one gather proves whole aligned pages. For arrays of a few
        hundred entries a NumPy call's overhead is its cost, so the calls are the cheap ones:
        ``intp`` indices (``int32`` ones are converted at every use), ``count_nonzero`` rather
        than ``any``, a bytes compare rather than ``array_equal`` (each several times cheaper).
        """
        ps = self.page_size
        try:
            if ps == 1:
                # Read as unsigned, a negative slot is a page past any table: it fails the gather.
                index = slots.view(np.uint32).astype(np.intp)
                before = self._held[index]
            else:
                # A slot that starts no page looks up -1 and a negative one wraps round: either
                # gathers a row of slots that differs from the given ones, refused below.
                index = self._page_of.take(slots[::ps])
                before = self._held[index]
                if self._rows.take(index, axis=0).tobytes() != slots.tobytes():
                    if slots.min() < 0:
                        raise ValueError(f"indices must be >= 0, got {int(slots.min())}")
                    check_page_aligned(slots, ps)  # raises, naming the slots
        except IndexError:  # past the tables (or far below 0): the slow path decides
            index, before = self._hold_outside(slots)
        if np.count_nonzero(before):
            raise ValueError(
                f"indices holds slots the cache already holds (pages starting at "
                f"{(index[before != 0] * ps).tolist()[:8]}); a slot can hold one token's K/V only"
            )
        # Each page is marked with its position (from 1): a page listed twice keeps one mark.
        if len(self._marks) < len(index):
            self._marks = np.arange(1, 2 * len(index) + 1, dtype=np.int32)
        marks = self._marks[: len(index)]
        self._held[index] = marks
        if self._held[index].tobytes() != marks.tobytes():
            twice = np.unique(index[self._held[index] != marks]) * ps
            self._held[index] = 0
            raise ValueError(f"indices lists the same slot more than once: {twice.tolist()[:8]}")
        self._held_tokens += len(slots)
        return index

    def _hold_outside(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`_hold`'s slow path, for slots past the tables: refuse a negative slot or pages that
        are not whole and aligned, grow the record (and the tables) to every page; return the
        pages (``intp``) and what the record held there (all 0 where it grew)."""
        ps = self.page_size
        if slots.min() < 0:
            raise ValueError(f"indices must be >= 0, got {int(slots.min())}")
        check_page_aligned(slots, ps)  # raises, naming the slots
        index = slots[::ps].astype(np.intp) // ps
        if index.max() >= len(self._held):  # grown by doubling, zeros: nothing held
            grown = np.zeros(max(int(index.max()) + 1, 2 * len(self._held)), np.int32)
            grown[: len(self._held)] = self._held
            self._held = grown
            self._rows, self._page_of = self._page_rows(len(grown))
        return index, self._held[index]

    def _page_rows(self, num_pages: int) -> tuple[np.ndarray, np.ndarray]:
        """Row ``p``: the slots of page ``p`` (int32); and per slot its page if it is a page's
        first slot, else -1 (``intp``: a lookup there is cheaper than dividing); for the first
        ``num_pages`` pages but at most the first 2M slots' (8 + 16 MiB); none at page size 1.
        `_hold_outside` computes the rest."""
        ps = self.page_size
        n = min(num_pages, (1 << 21) // ps) if ps > 1 else 0
        page_of = np.full(n * ps, -1, dtype=np.intp)
        page_of[::ps] = np.arange(n)
        return np.arange(n * ps, dtype=np.int32).reshape(n, ps), page_of

    def _release(self, node: RadixTreeNode) -> None:
        """Mark the pages of ``node`` (a leaf leaving the tree) as free again."""
        self._held[node.pages] = 0
        self._held_tokens -= len(node.value_array)

    # ------------------------------------------------------------------ locks
    def lock_handle(self, handle: BaseCacheHandle, unlock: bool = False) -> None:
        """Lock (``ref_count += 1``) or unlock every node from ``handle.node`` up to the root.

        Locks are counted per handle object: unlocking a handle not locked now raises
        ``RuntimeError``, changing nothing, even when an equal handle or an ancestor is locked.
        An empty (root) handle protects nothing, but its locks are counted all the same.
        """
        if unlock:
            self._unlock(self._locked(handle))
        else:
            self._lock(self._checked(handle))

    def _checked(self, handle: object) -> RadixCacheHandle:
        """``handle``, after proving that it names a live prefix of this manager: ``TypeError``
        or ``RuntimeError`` otherwise (read-only)."""
        if not isinstance(handle, RadixCacheHandle):
            raise TypeError(f"handle must be a RadixCacheHandle, got {type(handle).__name__}")
        node = handle.node
        if not isinstance(node, RadixTreeNode):
            raise TypeError(f"handle.node must be a RadixTreeNode, got {type(node).__name__}")
        if not node.in_tree:
            raise RuntimeError(
                f"handle's node {node.uuid} was evicted (or the tree reset); match the prefix again"
            )
        length = 0
        while node.parent is not None:
            length += node.length
            node = node.parent
        if self._roots.get(self._namespace_of.get(node.uuid, _NOWHERE)) is not node:  # not ours
            raise RuntimeError("handle belongs to another manager")
        if length != handle.cached_len:
            raise RuntimeError(
                f"handle says cached_len={handle.cached_len} but its path holds {length} tokens"
            )
        return handle

    def _locked(self, handle: object) -> RadixCacheHandle:
        """``handle``, locked now; ``RuntimeError`` (``TypeError`` for a non-handle) when it is
        not locked."""
        entry = self._locks.get(id(handle))  # the entry keeps the handle, so its id is unique
        if entry is None:
            if not isinstance(handle, RadixCacheHandle):
                raise TypeError(f"handle must be a RadixCacheHandle, got {type(handle).__name__}")
            raise RuntimeError(
                f"cannot unlock a handle that is not locked (cached_len={handle.cached_len})"
            )
        return entry[0]

    def _lock(self, handle: RadixCacheHandle) -> None:
        """One more lock of ``handle`` (a live handle of this manager)."""
        key = id(handle)
        entry = self._locks.get(key)
        self._locks[key] = (handle, 1 if entry is None else entry[1] + 1)
        self._add_locks(handle.node, 1)

    def _unlock(self, handle: RadixCacheHandle) -> None:
        """One lock less of ``handle`` (locked now)."""
        key = id(handle)
        times = self._locks[key][1]
        if times == 1:
            del self._locks[key]
        else:
            self._locks[key] = (handle, times - 1)
        self._add_locks(handle.node, -1)

    def _add_locks(self, node: RadixTreeNode, delta: int) -> None:
        """``ref_count += delta`` (1 or -1) on ``node`` and each ancestor below the root: the one
        place lock counts change. A node's tokens count as protected while its count is above
        0; ``node``, left an unlocked leaf, is filed for eviction."""
        end, moved = node, 0
        if delta > 0:
            while node.parent is not None:
                if not node.ref_count:
                    moved += len(node.value_array)  # locked now: protected
                node.ref_count += 1
                node = node.parent
        else:
            while node.parent is not None:
                node.ref_count -= 1
                if not node.ref_count:
                    moved -= len(node.value_array)  # unlocked now: evictable
                node = node.parent
            if self._is_evictable_leaf(end):
                self._leaves.file(end)
        self._protected_size += moved

    def handle_indices(self, handle: BaseCacheHandle) -> torch.Tensor:
        """The slots of the prefix behind ``handle`` (read-only: no split, no timestamp change)."""
        node = self._checked(handle).node
        values = []
        while node.parent is not None:
            values.append(node.value_array)
            node = node.parent
        return self._out(np.concatenate(values[::-1])) if values else self.empty_tensor

    # ------------------------------------------------------------------ eviction
    def eviction_priority(self, node: RadixTreeNode) -> tuple[int, ...]:
        """``node``'s key under this manager's policy: the evictable leaf with the smallest goes
        first. ``TypeError`` unless ``node`` is a `RadixTreeNode`."""
        if not isinstance(node, RadixTreeNode):
            raise TypeError(f"node must be a RadixTreeNode, got {type(node).__name__}")
        priority = self._priority(node)
        return tuple(priority) if isinstance(priority, tuple) else (priority,)

    def _is_evictable_leaf(self, node: RadixTreeNode) -> bool:
        """In the tree, unlocked, childless, not a root."""
        return node.in_tree and not node.ref_count and not node.children and node.parent is not None

    def evict(self, size: int) -> torch.Tensor:
        """Evict unlocked leaves in policy order until at least ``size`` tokens are freed; return
        their slots, in the order evicted.

        A parent left childless and unlocked becomes a candidate at once. Raises ``RuntimeError``
        (evicting nothing) when fewer than ``size`` tokens are evictable.
        """
        size = check_size(size)
        if size == 0:
            return self.empty_tensor
        evictable = self._held_tokens - self._protected_size
        if size > evictable:
            raise RuntimeError(
                f"cannot evict {size} tokens: only {evictable} are evictable "
                f"({self._protected_size} are locked)"
            )
        freed: list[np.ndarray] = []
        count = 0
        while count < size:
            leaf = self._leaves.pop(self._is_evictable_leaf)
            freed.append(leaf.value_array)
            count += len(leaf.value_array)
            self._remove_leaf(leaf)
        return self._out(np.concatenate(freed) if len(freed) > 1 else freed[0])

    def _remove_leaf(self, leaf: RadixTreeNode) -> None:
        """Take the evictable ``leaf`` out of the tree and free its pages; its parent, left an
        unlocked leaf, is filed for eviction."""
        parent = leaf.parent
        if parent is None:
            raise RuntimeError("internal error: a root is never evicted")
        if self._events is not None:
            tokens, root = [leaf.key_bytes], parent
            while root.parent is not None:
                tokens.append(root.key_bytes)
                root = root.parent
            ids = np.frombuffer(b"".join(reversed(tokens)), dtype=np.int64).tolist()
            self._events.removed(self._namespace_of[root.uuid], ids, leaf.value_array.tolist())
        del parent.children[self._child_key(leaf.key_bytes)]
        leaf.in_tree = False
        self._release(leaf)
        self._num_nodes -= 1
        if self._is_evictable_leaf(parent):
            self._leaves.file(parent)

    # ------------------------------------------------------------------ integrity
    def check_integrity(self) -> None:
        """Walk every namespace's tree (no recursion) and raise ``RuntimeError`` on the first
        inconsistency: a malformed node or link, a lock count that is negative or below a
        child's, an evictable leaf the eviction heap cannot find, a slot held twice, or counts
        (sizes, nodes, held pages) that disagree with the nodes."""
        evictable = protected = count = 0
        every: list[np.ndarray] = [np.empty(0, dtype=np.int32)]
        kept: list[np.ndarray] = [np.empty(0, dtype=np.intp)]
        for root in self._roots.values():
            if root.ref_count != 1 or root.key_bytes or root.parent is not None:
                raise RuntimeError("root must be empty, parentless and hold ref_count 1")
            stack = [root]
            while stack:
                node = stack.pop()
                for key, child in node.children.items():
                    self._check_child(node, key, child)
                    if child.ref_count == 0:
                        evictable += child.length
                    else:
                        protected += child.length
                    count += 1
                    every.append(child.value_array)
                    kept.append(child.pages)
                    stack.append(child)
        slots = np.concatenate(every)
        uniq, times = np.unique(slots, return_counts=True)
        if len(uniq) != len(slots):
            raise RuntimeError(
                f"indices appear more than once in the tree: {uniq[times > 1][:8].tolist()}"
            )
        if count != self._num_nodes:
            raise RuntimeError(f"recorded {self._num_nodes} nodes, counted {count}")
        if (evictable, protected) != tuple(self.size_info):
            raise RuntimeError(
                f"sizes disagree with the nodes: recorded {self.size_info}, counted "
                f"(evictable={evictable}, protected={protected})"
            )
        ps = self.page_size
        pages = slots[::ps] // ps if ps > 1 else slots
        if not np.array_equal(np.concatenate(kept), pages):
            raise RuntimeError("a node's pages disagree with its slots")
        held = np.flatnonzero(self._held)
        if len(held) != len(pages) or not np.array_equal(held, np.sort(pages)):
            raise RuntimeError("the record of held slots disagrees with the slots in the tree")

    def _check_child(self, node: RadixTreeNode, key: Hashable, child: RadixTreeNode) -> None:
        """``RuntimeError`` if ``child``, filed under ``key`` in ``node.children``, is malformed."""
        where = f"node {child.uuid}"
        if child.parent is not node:
            raise RuntimeError(f"{where}: parent link does not point to the node that files it")
        if child.length == 0 or not child.key_bytes:
            raise RuntimeError(f"{where}: empty node")
        if len(child.key_bytes) != child.length * ITEM:
            raise RuntimeError(
                f"{where}: {len(child.key_bytes) // ITEM} tokens but {child.length} indices"
            )
        if child.length % self.page_size:
            raise RuntimeError(
                f"{where}: length {child.length} is not whole pages of {self.page_size}"
            )
        if self._child_key(child.key_bytes) != key:
            raise RuntimeError(
                f"{where}: filed under {key!r} but starts with {self._child_key(child.key_bytes)!r}"
            )
        if child.ref_count < 0:
            raise RuntimeError(f"{where}: negative ref_count {child.ref_count}")
        if node.parent is not None and node.ref_count < child.ref_count:
            raise RuntimeError(
                f"{where}: ref_count {child.ref_count} exceeds its parent's {node.ref_count}"
            )
        if node.parent is not None and node.timestamp < child.timestamp:
            raise RuntimeError(
                f"{where}: used at {child.timestamp}, after its parent ({node.timestamp})"
            )
        if not child.in_tree:
            raise RuntimeError(f"{where}: marked evicted but still in the tree")
        if self._is_evictable_leaf(child) and not self._leaves.is_filed(child):
            raise RuntimeError(f"{where}: evictable leaf missing from the eviction heap")
