"""`RadixCacheManager`: prefixes shared through a radix tree, protected by ref counts, evicted by policy.

Each non-root node holds a run of tokens (its key) and the KV slots that hold them (its value);
the path from the root to a node spells a cached prefix. With ``page_size > 1`` every key is a
whole number of pages and children are filed under their first page, so matching, splitting and
eviction all happen at page boundaries.

Costs (measured in ``benchmarks/radix_ops.py``): a few C calls per node on the path, never
Python work per token, and no copy of the caller's ids. Keys are int64 bytes: a node matches
with one ``bytes.startswith`` against a byte view of the ids, and the next child is one dict
probe away (filed under its first token, or its first page's bytes). Slots live on the host as
NumPy int32, with their page numbers beside them for eviction. An insert walks without changing
anything, checks only the *new* slots (`SlotOwners`), then changes the tree, so a refused call
leaves no trace. Evictable leaves sit in a lazy heap of flat integer priorities (`LeafHeap`): a
match never touches it, a new leaf is appended to a sorted run beside it, and evicting ``k``
leaves costs ``O(k)`` to ``O(k log n)``. No method recurses over the tree's depth. The flow's
fused calls (`match_and_lock`, `insert_and_unlock`, in radix_locks.py) lock the path as the
match walks it, and resume the insert at the locked handle's node once the keys on its path
compare equal to the new ids (one memcmp a node); with ``relock`` the lock moves in that walk.
They and ``evict(host=True)`` also take and give the flow's host NumPy arrays as they are, so
a request crosses between torch and NumPy only where its caller hands in or reads a tensor.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import numpy as np
import torch

from .._validate import check_device, check_page_size
from .base import SLOT_DTYPES, InsertResult, host_array
from .cache_events import EventLog, check_extra_key
from .eviction import EVICTION_POLICIES, EvictionPolicy, LeafHeap
from .radix_locks import RadixLocks
from .radix_node import (
    ITEM,
    RadixCacheHandle,
    RadixTreeNode,
    TreeInfo,
    common_tokens,
    key_reader,
    slot_array,
    spells,
    stamp_path,
    token_array,
)
from .slot_owners import SlotOwners

__all__ = ["RadixTreeNode", "RadixCacheHandle", "RadixCacheManager"]

_Walk = tuple[list[RadixTreeNode], int, RadixTreeNode | None, int]
_NO_WALK: _Walk = ([], 0, None, 0)  # read only: what a walk from a missing root finds


class RadixCacheManager(RadixLocks):
    """Prefix cache on a radix tree.

    Args:
        device: where the KV-slot indices live (values returned by ``match_prefix``/``evict``).
        page_size: tokens per page; matching and insertion only ever cover whole pages.
        eviction_policy: a name registered in `kvcache.managers.eviction.EVICTION_POLICIES`
            (``"lru"`` or ``"fifo"`` built in).
        events: record what is stored, removed and cleared for `take_events` (keyword only;
            off by default, when the log costs one ``is None`` test per insert and eviction).

    Namespaces: each ``extra_key`` has its own root, made by its first insert (``None``'s is
    ``root_node``); eviction, sizes and integrity cover every root.
    """

    # The fused calls are written in radix_locks.py; named here, they count as this class's own
    # (`fused_calls_safe`): a subclass overriding match_prefix is then driven by the plain calls.
    match_and_lock = RadixLocks.match_and_lock
    insert_and_unlock = RadixLocks.insert_and_unlock

    def __init__(
        self,
        device: torch.device | str = "cpu",
        page_size: int = 1,
        eviction_policy: str = "lru",
        *,
        events: bool = False,
    ) -> None:
        # Stored as the Python int; the bound keeps the page's byte width a C long.
        page_size = check_page_size(page_size)
        if not isinstance(events, bool):
            raise TypeError(f"events must be a bool, got {type(events).__name__}")
        if not isinstance(eviction_policy, str):
            raise TypeError(
                f"eviction_policy must be a str (one of {sorted(EVICTION_POLICIES)}), "
                f"got {type(eviction_policy).__name__} {eviction_policy!r}"
            )
        if eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"eviction_policy must be one of {sorted(EVICTION_POLICIES)}, got {eviction_policy!r}"
            )
        self.device = check_device(device)
        self.page_size = page_size
        self.eviction_policy = eviction_policy
        self._policy: EvictionPolicy = EVICTION_POLICIES[eviction_policy]()
        self._leaves: LeafHeap[RadixTreeNode] = LeafHeap(
            getattr(self._policy, "flat_priority", None) or self._policy.priority
        )
        self.empty_tensor = torch.empty(0, dtype=torch.int32, device=self.device)
        self._on_cpu = self.device.type == "cpu"
        self._key_of = key_reader(page_size)
        self._owners = SlotOwners(page_size)
        self._uuid = self._clock = 0
        self._events = EventLog() if events else None
        self._init_tree()

    # ------------------------------------------------------------------ state
    def _init_tree(self) -> None:
        self._tree = TreeInfo(self.device)
        self.root_node = self._new_root()
        self._roots: dict[Hashable, RadixTreeNode] = {None: self.root_node}
        self._root_keys: dict[int, Hashable] = {self.root_node.uuid: None}
        self._evictable_size = self._protected_size = 0
        self._num_nodes = 0  # excluding the root
        self._leaves.clear()
        self._locks: dict[int, list[Any]] = {}  # id(handle) -> [handle, times locked]
        self._owners.clear()

    def _new_root(self) -> RadixTreeNode:
        empty = np.empty(0, dtype=np.int32)
        root = self._node(b"", empty, empty.astype(np.intp), self._clock, self._clock)
        root.ref_count = 1  # a root is never evicted
        return root

    def _node(
        self, kb: bytes, value: np.ndarray, pages: np.ndarray, timestamp: int, insert_time: int
    ) -> RadixTreeNode:
        """A new node of this tree under the next uuid."""
        self._uuid = uuid = self._uuid + 1
        return RadixTreeNode(uuid - 1, kb, value, pages, timestamp, insert_time, self._tree)

    def _is_evictable_leaf(self, node: RadixTreeNode) -> bool:
        """`evictable_leaf` through the slots (it is the eviction loop's test)."""
        return (
            node._in_tree and not node.ref_count and not node.children and node._parent is not None
        )

    def _out(self, values: np.ndarray) -> torch.Tensor:
        out = torch.from_numpy(values)
        return out if self._on_cpu else out.to(self.device)

    def reset(self) -> None:
        """Forget every prefix. Locks on empty (root) handles are forgotten with them."""
        if self._protected_size > 0:
            raise RuntimeError(
                f"cannot reset while {self._protected_size} tokens are locked; unlock every handle first"
            )
        for key in self._roots:
            for node in self.nodes(key):
                node._in_tree = False
        self._init_tree()
        if self._events is not None:
            self._events.cleared()

    # --------------------------------------------------------------- tree
    def _split_at(self, node: RadixTreeNode, pos: int) -> RadixTreeNode:
        """Cut ``node`` after ``pos`` tokens; return the new parent holding the first ``pos``.

        The new node inherits ``ref_count`` (every lock through ``node`` also ran through its
        first part), ``timestamp`` and ``insert_time``. Sizes do not change.
        """
        parent, kb, cut, pcut = node._parent, node._kb, pos * ITEM, pos // self.page_size
        new = self._node(
            kb[:cut], node._value[:pos], node._pages[:pcut], node.timestamp, node.insert_time
        )
        new.ref_count = node.ref_count
        new._parent = parent
        key_of = self._key_of
        parent.children[key_of(kb, 0)] = new  # type: ignore[union-attr]
        node._kb = kb = kb[cut:]
        node._value = node._value[pos:]
        node._pages = node._pages[pcut:]
        node._parent = new
        new.children[key_of(kb, 0)] = node
        self._num_nodes += 1
        return new

    def _walk(
        self,
        ids_b: bytes | memoryview,
        ids: np.ndarray,
        node: RadixTreeNode | None = None,
        pos: int = 0,
    ) -> _Walk:
        """Follow ``ids_b`` (the bytes of ``ids``' whole pages, or a byte view of them) down the
        tree from ``node`` (a namespace's root, default ``None``'s, or a node whose path spells
        ``ids_b[:pos]``); change nothing.

        Returns ``(path, matched_bytes, partial, cut)``: the nodes matched whole (``node``
        excluded), and the node after them matching only its first ``cut`` tokens (whole
        pages), or ``None``. Per node: one dict probe (its filing key is one page of
        ``ids_b``, or one ``ids.item`` at page size 1) and one memcmp against a view.
        """
        mv = memoryview(ids_b)
        path: list[RadixTreeNode] = []
        n, ps = len(mv), self.page_size
        pb, node = ps * ITEM, node or self.root_node
        while pos < n:
            child = node.children.get(
                ids.item(pos >> 3) if ps == 1 else mv[pos : pos + pb].tobytes()
            )
            if child is None:
                break
            kb = child._kb
            stop = pos + len(kb)
            if stop > n or not kb.startswith(mv[pos:stop]):  # it matches in part
                cut = common_tokens(kb, ids, pos >> 3) // ps * ps
                return path, pos + cut * ITEM, child, cut
            path.append(child)
            pos = stop
            node = child
        return path, pos, None, 0

    def _commit(self, walk: _Walk, tic: int, end: RadixTreeNode | None = None) -> RadixTreeNode:
        """Apply a walk from ``end`` (default: ``None``'s root): stamp the matched path with
        ``tic``, split the partial node; return the node the walk ended at."""
        path, _, partial, cut = walk
        for node in path:
            node.timestamp = tic
        if partial is not None:
            end = self._split_at(partial, cut)
            end.timestamp = tic
            return end
        return path[-1] if path else end or self.root_node

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # ------------------------------------------------------------- public
    def match_prefix(
        self, input_ids: torch.Tensor, extra_key: Hashable = None
    ) -> tuple[RadixCacheHandle, torch.Tensor]:
        """Longest whole-page prefix of ``input_ids`` cached under ``extra_key``, and its slots.

        Not read-only: a node matched only in part is split so that the handle can point at the
        end of the match, and the matched path's timestamps are refreshed.
        """
        handle, out, _, _ = self._match(input_ids, extra_key)
        return handle, self._out(out) if out is not None else self.empty_tensor

    def _match(
        self, input_ids: torch.Tensor | np.ndarray, extra_key: Hashable, lock: bool = False
    ) -> tuple[RadixCacheHandle, np.ndarray | None, RadixTreeNode | None, int]:
        """`match_prefix`'s handle and slots (host NumPy, a new array; ``None`` for none), the
        namespace root, and
        (``lock``: the handle's path is locked on the way down, the caller records the lock)
        the tokens that the lock took from the evictable ones.

        The walk changes the tree as it goes (nothing after the token check can raise): each
        node matched is stamped (and locked), one matched in part is split at the last whole
        page they share and the walk stops there.
        """
        ids = token_array(input_ids, lock)  # the NumPy form only for match_and_lock
        root: RadixTreeNode | None
        if extra_key is None:
            root = self.root_node
        else:
            root = self._roots.get(check_extra_key(extra_key))
            if root is None:  # a namespace never inserted into: nothing to match
                self._clock += 1
                return RadixCacheHandle(0, self.root_node), None, None, 0
        ps, n = self.page_size, len(ids)
        mv = ids.data.cast("B")  # the ids' own bytes: compared in place, never copied
        self._clock = tic = self._clock + 1
        node, pos, end, pb = root, 0, (n - n % ps) * ITEM, ps * ITEM
        values: list[np.ndarray] = []
        taken = 0
        while pos < end:
            child = node.children.get(
                ids.item(pos >> 3) if ps == 1 else mv[pos : pos + pb].tobytes()
            )
            if child is None:
                break
            kb = child._kb
            stop = pos + len(kb)
            if stop <= end and kb.startswith(mv[pos:stop]):  # the whole node matches: one memcmp
                pos = stop
            else:  # at least its first page matches: split it after the pages it shares
                cut = common_tokens(kb, ids, pos >> 3) // ps * ps
                child = self._split_at(child, cut)
                pos = end = pos + cut * ITEM
            child.timestamp = tic
            values.append(child._value)
            if lock:
                if not child.ref_count:
                    taken += len(child._value)
                child.ref_count += 1
            node = child
        if not pos:
            return RadixCacheHandle(0, self.root_node), None, root, 0
        out = values[0].copy() if len(values) == 1 else np.concatenate(values)
        return RadixCacheHandle(pos >> 3, node), out, root, taken

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
        return self._insert(input_ids, indices, extra_key)[0][0]

    def insert_and_match(
        self, input_ids: torch.Tensor, indices: torch.Tensor, extra_key: Hashable = None
    ) -> InsertResult:
        """`insert_prefix` and the (unlocked) handle of the whole inserted prefix, in one walk."""
        return self._insert(input_ids, indices, extra_key)[0]

    def _insert(
        self,
        input_ids: torch.Tensor | np.ndarray,
        indices: torch.Tensor | np.ndarray,
        extra_key: Hashable,
        lock: list[Any] | None = None,
        relock: bool = False,
    ) -> tuple[InsertResult, RadixTreeNode, bool]:
        """The insert, resumed at the node of ``lock`` (a `_locks` entry) where it names a prefix
        of ``input_ids`` in this namespace (checked against the keys on its path); also the
        namespace root, and
        whether the lock moved: with ``relock`` and a resumed walk, the nodes below the lock's
        node down to the returned handle's are locked once more (the path above keeps its
        counts: one lock leaves it, one arrives), and the caller only moves the `_locks` entry."""
        fused = lock is not None  # insert_and_unlock: the NumPy forms are taken
        ids = token_array(input_ids, fused)
        root = self.root_node if extra_key is None else self._roots.get(check_extra_key(extra_key))
        all_slots = (
            host_array(indices, "indices", SLOT_DTYPES)
            if fused and isinstance(indices, np.ndarray)
            else slot_array(indices, self.device, self._on_cpu)  # type: ignore[arg-type]  # refuses NumPy
        )
        if len(all_slots) != len(ids):
            raise ValueError(
                f"len(indices) ({len(all_slots)}) must equal len(input_ids) ({len(ids)})"
            )
        ps, n = self.page_size, len(ids)
        if ps != 1:
            n -= n % ps
        mv = ids.data.cast("B")[: n * ITEM]  # the ids' own bytes, never copied whole
        start, walk = None, _NO_WALK
        if lock is not None and len(lock) > 2 and lock[2] is root is not None:
            held = lock[0].cached_len * ITEM
            if 0 < held <= len(mv) and spells(lock[0].node, mv, held):
                start = lock[0].node  # its path spells mv[:held]: walk on from there
                if held < len(mv) and start.children:  # else nothing below it to follow
                    walk = self._walk(mv, ids, start, held)
                else:
                    walk = ([], held, None, 0)
        if start is None and root is not None:
            walk = self._walk(mv, ids, root)
        pos = walk[1]
        prefix_len = pos >> 3
        if prefix_len < n:  # check what would enter before anything changes
            slots = all_slots[prefix_len:n]
            pages = self._owners.claim_new(slots)  # the last check: holds the pages if it passes
        if root is None:  # the namespace's first insert: its root, now that nothing can raise
            root = self._roots[extra_key] = self._new_root()
            self._root_keys[root.uuid] = extra_key
        self._clock = tic = self._clock + 1
        end = self._commit(walk, tic, start or root) if walk[0] or walk[2] else start or root
        moved = relock and start is not None
        if start is not None:  # the path above the resumed walk is stamped as a walk would
            stamp_path(start, tic)
        if prefix_len < n:
            new = self._node(mv[pos:].tobytes(), slots.copy(), pages, tic, tic)
            new._parent = end
            end.children[ids.item(prefix_len) if ps == 1 else new._kb[: ps * ITEM]] = new
            end = new
            self._num_nodes += 1
            self._evictable_size += n - prefix_len
            if not moved:  # a node locked at once is filed when it is unlocked
                self._leaves.file(new)
            if self._events is not None:
                self._events.stored(extra_key, ids[:n].tolist(), slots.tolist())
        if moved:
            taken, node = 0, end
            while node is not start:
                if not node.ref_count:
                    taken += len(node._value)
                node.ref_count += 1
                node = node._parent
            self._evictable_size -= taken
            self._protected_size += taken
        return InsertResult(prefix_len, RadixCacheHandle(n, end)), root, moved
