"""A stand-in for SGLang's radix cache (read at 0.5.23), to time `RadixCacheManager` against.

Our own code, written from the published design of SGLang's
``python/sglang/srt/mem_cache/radix_cache.py`` (``RadixKey``, ``TreeNode``, ``RadixCache``, as of
its 2026 core), not copied from it. What it keeps, because that is where SGLang's time goes:

- keys are ``RadixKey`` objects (``__slots__``) over ``array('q')`` token ids; slicing a key
  copies the array slice into a new key, and the walk re-slices the rest of the query after
  every node (``key = key[prefix_len:]``), as SGLang's match and insert helpers do;
- ``RadixKey.match`` finds the first differing token by galloping: slice compares of windows of
  1, 2, 4, ... tokens (each a C memcmp on ``array('q')``), then a binary search of slice compares
  inside the window that differs; rounded down to whole pages;
- a node's children sit in a ``defaultdict`` filed under the first token (page size 1) or a tuple
  of the first page's tokens, ``(extra_key, that)`` in a namespace; a probe is ``k in
  children.keys()`` then ``children[k]``;
- values are int64 torch tensors of KV slots; a split clones both halves, a new leaf clones its
  slice, the insert slices the value tensor after every matched node, a match ``torch.cat``-s
  the values of its path; the caller's int32 slots are copied to int64 first (SGLang's
  ``_insert_cache``, run when a request finishes, does ``kv_indices[:key_len].to(dtype=torch.int64,
  copy=True)``);
- every node carries SGLang's bookkeeping fields (two ``time.monotonic()`` stamps at creation,
  ``priority`` raised along an insert's path, host and hash fields left empty);
- ``inc_lock_ref``/``dec_lock_ref`` walk to the root, move sizes between evictable and protected,
  and update the set of evictable leaves at every node (``_update_leaf_status``);
- ``evict(n)`` builds a heap of ``(strategy priority, node)`` for *every* evictable leaf on each
  call, pops leaves until ``n`` tokens are freed and pushes a parent left childless and
  unlocked.

Adapted to this package's `BaseCacheManager` API so that the same `RequestFlow` (and the same
recorded calls) drive both: token ids arrive as a tensor and are copied into ``array('q')`` (SGLang
builds its key from the request's ``array('q')`` with a concat and a slice: the same copy); the
match result is a handle plus the int64 slot tensor; ``insert_and_match`` returns a handle on the
node the insert ended at (SGLang's ``checkpoint`` runs a second full ``match_prefix``
instead, so this is generous to SGLang); ``evict`` returns the evicted slots in one tensor
(SGLang frees each node's value separately). It validates nothing (generous again).

Two changes make its decisions those of `RadixCacheManager` (the benchmark checks that they are
identical, or the comparison is void), neither changing what a call costs: the access time is a
logical clock (``next`` on an ``itertools.count``, one C call like ``time.monotonic``), so two
leaves never tie; and a node matched only in part keeps its old access time when it is split
(the new upper node gets the new one), where SGLang stamps the node before splitting it.
"""

from __future__ import annotations

import heapq
import itertools
import time
from array import array
from collections import defaultdict
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kvcache.managers import BaseCacheHandle, BaseCacheManager, InsertResult, SizeInfo

__all__ = ["RadixKey", "SglNode", "SglangHandle", "SglangStandIn"]


class RadixKey:
    """Token ids (``array('q')``) and the namespace they live in."""

    __slots__ = ("extra_key", "is_bigram", "token_ids")

    def __init__(self, token_ids: array[int], extra_key: Hashable = None, is_bigram: bool = False):
        self.token_ids = token_ids
        self.extra_key = extra_key
        self.is_bigram = is_bigram  # EAGLE's bigram view: never set here, tested as SGLang does

    def __len__(self) -> int:
        if self.is_bigram:
            return max(len(self.token_ids) - 1, 0)
        return len(self.token_ids)

    def __getitem__(self, idx: slice | int) -> RadixKey:
        """A new key over a copy of the sliced tokens (step 1 only)."""
        if isinstance(idx, int):
            idx = slice(idx, idx + 1)
        start, stop, step = idx.indices(len(self))
        if step != 1:
            raise ValueError(f"a RadixKey slice has step 1, got {step}")
        if self.is_bigram:
            raise NotImplementedError("bigram keys are not part of the stand-in")
        return RadixKey(self.token_ids[start:stop], self.extra_key)

    def page_aligned(self, page_size: int) -> RadixKey:
        return self if page_size == 1 else self[: len(self) // page_size * page_size]

    def maybe_to_bigram_view(self, is_eagle: bool) -> RadixKey:
        if is_eagle and not self.is_bigram:
            raise NotImplementedError("bigram keys are not part of the stand-in")
        return self

    def match(self, other: RadixKey, page_size: int = 1) -> int:
        """Length of the prefix shared with ``other``, rounded down to whole pages."""
        if self.extra_key != other.extra_key:
            raise ValueError(f"keys of namespaces {self.extra_key!r} and {other.extra_key!r}")
        a, b = self.token_ids, other.token_ids
        if type(a) is not type(b):
            raise TypeError(f"token containers differ: {type(a).__name__}, {type(b).__name__}")
        n = min(len(a), len(b))
        same, lo, width = n, 0, 1
        while lo < n:  # windows of 1, 2, 4, ... tokens: one memcmp each
            hi = min(lo + width, n)
            if a[lo:hi] != b[lo:hi]:
                while hi - lo > 1:  # the first difference is in [lo, hi): halve it
                    mid = (lo + hi) // 2
                    if a[lo:mid] == b[lo:mid]:
                        lo = mid
                    else:
                        hi = mid
                same = lo
                break
            lo = hi
            width *= 2
        return same if page_size == 1 else same // page_size * page_size

    def child_key(self, page_size: int = 1) -> Hashable:
        """What the node starting with this key is filed under in its parent's children."""
        t = self.token_ids
        if self.is_bigram:
            raise NotImplementedError("bigram keys are not part of the stand-in")
        first = t[0] if page_size == 1 else tuple(t[:page_size])
        return first if self.extra_key is None else (self.extra_key, first)


class SglNode:
    """SGLang's ``TreeNode``: a plain object with its bookkeeping fields."""

    counter = 0

    def __init__(self, priority: int = 0) -> None:
        self.children: defaultdict[Hashable, SglNode] = defaultdict(SglNode)
        self.parent: SglNode | None = None
        self.key: RadixKey = _EMPTY_KEY
        self.value: Any = None  # int64 slot tensor (a list on the root)
        self.lock_ref = 0
        self.last_access_time: float = time.monotonic()
        self.creation_time = time.monotonic()
        self.hit_count = 0
        self.host_ref_counter = 0
        self.host_value: torch.Tensor | None = None
        self.hash_value: list[str] | None = None
        self.priority = priority
        self.id = SglNode.counter
        SglNode.counter += 1

    @property
    def evicted(self) -> bool:
        return self.value is None

    def __lt__(self, other: SglNode) -> bool:
        return self.last_access_time < other.last_access_time


_EMPTY_KEY = RadixKey(array("q"))


class LRUStrategy:
    def get_priority(self, node: SglNode) -> float:
        return node.last_access_time


@dataclass(frozen=True)
class SglangHandle(BaseCacheHandle):
    node: SglNode | None = None


class SglangStandIn(BaseCacheManager):
    """SGLang-style radix cache behind the `BaseCacheManager` API (see the module docstring)."""

    def __init__(self, device: str = "cpu", page_size: int = 1) -> None:
        self.device = torch.device(device)
        self.page_size = page_size
        self.is_eagle = False
        self.enable_kv_cache_events = False
        self.metrics_collector = None
        self.eviction_strategy = LRUStrategy()
        self.evictable_leaves: set[SglNode] = set()
        self.reset()

    def reset(self) -> None:
        self.root_node = SglNode(priority=-(2**62))
        self.root_node.value = []
        self.root_node.lock_ref = 1
        self.evictable_size_ = 0
        self.protected_size_ = 0
        self.evictable_leaves.clear()
        self._clock = itertools.count(1)
        self._empty = torch.empty((0,), dtype=torch.int64, device=self.device)

    # ---------------------------------------------------------- boundary
    @staticmethod
    def _key(input_ids: torch.Tensor, extra_key: Hashable) -> RadixKey:
        ids = input_ids.numpy()
        if ids.dtype.itemsize != 8:
            ids = ids.astype("int64")
        return RadixKey(array("q", ids.tobytes()), extra_key)

    # ------------------------------------------------------------- match
    def match_prefix(
        self, input_ids: torch.Tensor, extra_key: Hashable = None
    ) -> tuple[SglangHandle, torch.Tensor]:
        key = self._key(input_ids, extra_key).maybe_to_bigram_view(self.is_eagle)
        if len(key) == 0:
            return SglangHandle(0, self.root_node), self._empty
        key = key.page_aligned(self.page_size)
        if len(key) == 0:
            return SglangHandle(0, self.root_node), self._empty
        values, last = self._match_prefix_helper(self.root_node, key)
        value = torch.cat(values) if values else self._empty
        return SglangHandle(value.shape[0], last), value

    def _match_prefix_helper(
        self, node: SglNode, key: RadixKey
    ) -> tuple[list[torch.Tensor], SglNode]:
        now = next(self._clock)
        node.last_access_time = now
        ps = self.page_size
        child_key = key.child_key(ps)
        values = []
        while len(key) > 0 and child_key in node.children.keys():  # noqa: SIM118 (as SGLang probes)
            child = node.children[child_key]
            prefix_len = child.key.match(key, page_size=ps)
            if prefix_len < len(child.key):
                new_node = self._split_node(child.key, child, prefix_len)
                new_node.last_access_time = now
                values.append(new_node.value)
                node = new_node
                break
            child.last_access_time = now
            values.append(child.value)
            node = child
            key = key[prefix_len:]
            if len(key):
                child_key = key.child_key(ps)
        return values, node

    def _split_node(self, key: RadixKey, child: SglNode, split_len: int) -> SglNode:
        """``child`` becomes the lower part; the new node above it holds its first ``split_len``."""
        ps = self.page_size
        new_node = SglNode(priority=child.priority)
        new_node.last_access_time = child.last_access_time
        new_node.children = {key[split_len:].child_key(ps): child}  # type: ignore[assignment]
        new_node.parent = child.parent
        new_node.lock_ref = child.lock_ref
        new_node.key = child.key[:split_len]
        new_node.value = child.value[:split_len].clone()
        child.parent = new_node
        child.key = child.key[split_len:]
        child.value = child.value[split_len:].clone()
        new_node.parent.children[key.child_key(ps)] = new_node  # type: ignore[union-attr]
        return new_node

    # ------------------------------------------------------------ insert
    def insert_prefix(
        self, input_ids: torch.Tensor, indices: torch.Tensor, extra_key: Hashable = None
    ) -> int:
        return self._insert(input_ids, indices, extra_key)[0]

    def insert_and_match(
        self, input_ids: torch.Tensor, indices: torch.Tensor, extra_key: Hashable = None
    ) -> InsertResult:
        prefix_len, node, n = self._insert(input_ids, indices, extra_key)
        return InsertResult(prefix_len, SglangHandle(n, node))

    def _insert(
        self, input_ids: torch.Tensor, indices: torch.Tensor, extra_key: Hashable
    ) -> tuple[int, SglNode, int]:
        # SGLang's _insert_cache: the aligned key, its slots copied to int64; then insert().
        key = self._key(input_ids, extra_key).page_aligned(self.page_size)
        value = indices[: len(key)].to(dtype=torch.int64, copy=True)
        key = key.page_aligned(self.page_size)  # insert() aligns (and cuts the value) again
        value = value[: len(key)]
        prefix_len, node = self._insert_helper(self.root_node, key, value)
        return prefix_len, node, len(key)

    def _insert_helper(
        self, node: SglNode, key: RadixKey, value: torch.Tensor, priority: int = 0
    ) -> tuple[int, SglNode]:
        now = next(self._clock)
        node.last_access_time = now
        node.priority = max(node.priority, priority)
        if len(key) == 0:
            return 0, node
        ps = self.page_size
        child_key = key.child_key(ps)
        total = 0
        while len(key) > 0 and child_key in node.children.keys():  # noqa: SIM118 (as SGLang probes)
            node = node.children[child_key]
            prefix_len = node.key.match(key, page_size=ps)
            total += prefix_len
            key = key[prefix_len:]
            value = value[prefix_len:]
            if prefix_len < len(node.key):
                node = self._split_node(node.key, node, prefix_len)
            node.last_access_time = now
            node.priority = max(node.priority, priority)
            if len(key):
                child_key = key.child_key(ps)
        if len(key):
            new_node = SglNode(priority=priority)
            new_node.last_access_time = now
            new_node.parent = node
            new_node.key = key
            new_node.value = value.clone()
            node.children[child_key] = new_node
            self.evictable_size_ += len(key)
            self._update_leaf_status(node)
            self._update_leaf_status(new_node)
            self._record_store_event(new_node)
            node = new_node
        return total, node

    # ------------------------------------------------------------- locks
    def lock_handle(self, handle: BaseCacheHandle, unlock: bool = False) -> None:
        if not isinstance(handle, SglangHandle) or handle.node is None:
            raise TypeError(f"not a handle of this manager: {handle!r}")
        node = handle.node
        if unlock:
            self.dec_lock_ref(node)
        else:
            self.inc_lock_ref(node)

    def inc_lock_ref(self, node: SglNode) -> int:
        delta = 0
        while node != self.root_node:
            if node.lock_ref == 0:
                self.evictable_size_ -= len(node.key)
                self.protected_size_ += len(node.key)
                delta -= len(node.key)
            node.lock_ref += 1
            self._update_leaf_status(node)
            node = node.parent  # type: ignore[assignment]
        return delta

    def dec_lock_ref(self, node: SglNode) -> int:
        delta = 0
        while node != self.root_node:
            if node.lock_ref == 1:
                self.evictable_size_ += len(node.key)
                self.protected_size_ -= len(node.key)
                delta += len(node.key)
            node.lock_ref -= 1
            self._update_leaf_status(node)
            node = node.parent  # type: ignore[assignment]
        return delta

    def _update_leaf_status(self, node: SglNode) -> None:
        """Keep ``evictable_leaves`` = the unlocked nodes without a live child."""
        leaves = self.evictable_leaves
        if node.evicted or node.lock_ref > 0:
            if node in leaves:
                leaves.remove(node)
            return
        for child in node.children.values():
            if not child.evicted:
                if node in leaves:
                    leaves.remove(node)
                return
        if node not in leaves:
            leaves.add(node)

    # ------------------------------------------------------------- evict
    def evict(self, size: int) -> torch.Tensor:
        """A heap of every evictable leaf, built anew; pop until ``size`` tokens are freed."""
        if size <= 0:
            return self._empty
        start_time = time.perf_counter()
        get_priority = self.eviction_strategy.get_priority
        heap = [(get_priority(node), node) for node in list(self.evictable_leaves)]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        num_evicted = 0
        while num_evicted < size and heap:
            _, x = heapq.heappop(heap)
            freed.append(x.value)
            num_evicted += len(x.value)
            self._delete_leaf(x)
            parent = x.parent
            if parent is not None and len(parent.children) == 0 and parent.lock_ref == 0:
                heapq.heappush(heap, (get_priority(parent), parent))
            self._record_remove_event(x)
        self.update_eviction_metrics(num_evicted, start_time)
        return torch.cat(freed) if freed else self._empty

    # KV events and metrics are off, as in a default server: one test each per call, as in SGLang.
    def _record_store_event(self, node: SglNode) -> None:
        if self.enable_kv_cache_events:
            raise NotImplementedError("KV events are not part of the stand-in")

    def _record_remove_event(self, node: SglNode) -> None:
        if self.enable_kv_cache_events:
            raise NotImplementedError("KV events are not part of the stand-in")

    def update_eviction_metrics(self, num_evicted: int, start_time: float) -> None:
        if self.metrics_collector is not None:
            raise NotImplementedError("metrics are not part of the stand-in")

    def _delete_leaf(self, node: SglNode) -> None:
        key = node.key.child_key(self.page_size)
        removed = node.parent.children.pop(key, None)  # type: ignore[union-attr]
        if removed is not node:
            raise RuntimeError(f"the parent does not file this leaf under {key!r}")
        self.evictable_size_ -= len(node.key)
        if node in self.evictable_leaves:
            self.evictable_leaves.remove(node)
        self._update_leaf_status(node.parent)  # type: ignore[arg-type]

    # ------------------------------------------------------------ the rest
    def handle_indices(self, handle: BaseCacheHandle) -> torch.Tensor:
        if not isinstance(handle, SglangHandle) or handle.node is None:
            raise TypeError(f"not a handle of this manager: {handle!r}")
        parts = []
        node: SglNode | None = handle.node
        while node is not self.root_node and node is not None:
            parts.append(node.value)
            node = node.parent
        parts.reverse()
        return torch.cat(parts) if parts else self._empty

    @property
    def size_info(self) -> SizeInfo:
        return SizeInfo(self.evictable_size_, self.protected_size_)

    def nodes(self) -> Iterator[SglNode]:
        """Every node below the root (depth first)."""
        stack = list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def cached_indices(self) -> torch.Tensor:
        parts = [node.value for node in self.nodes()]
        return torch.cat(parts).to(torch.int32) if parts else torch.empty(0, dtype=torch.int32)

    def check_integrity(self) -> None:
        pass
