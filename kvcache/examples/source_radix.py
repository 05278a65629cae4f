"""The study guide's radix manager, rewritten to run a workload: a baseline to time against.

`SourceRadixCacheManager` works as the code the guide walks through (mini-sglang's
``python/minisgl/kvcache/radix_manager.py`` at commit ``7d9dfc21``): tensor keys; one
``.item()`` per child lookup; a tensor comparison per node; and on every ``evict`` a full scan of
the tree to collect the leaves, heapified anew. The two fixes the book makes that a workload
needs are applied: the eviction loop checks the size first (source error 4), and the split-off
prefix gets the current timestamp (error 3), so that it evicts what `RadixCacheManager` with the
LRU policy evicts and only the speed differs.

`PagedSourceRadixCacheManager` is the same design made page-aware, as a straightforward port to
pages does it (as mini-sglang's later radix cache does): children filed under their first page
as a tuple of token ids, tensor keys compared a node at a time with the match length rounded
down to a whole page, only the page-aligned part inserted. It validates nothing (generous to the
baseline). The appendix chapter and ``benchmarks/radix_ops.py`` time both; the tests check that
they decide as `RadixCacheManager` does.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from kvcache.managers import BaseCacheHandle, BaseCacheManager, SizeInfo


def _default_namespace_only(extra_key: Hashable) -> None:
    """The guide's design has no namespaces: only the default key, ``None``, is served."""
    if extra_key is not None:
        raise ValueError(f"the source design serves only extra_key=None, got {extra_key!r}")


class SourceNode:
    _counter = 0

    def __init__(self, timestamp: int = 0) -> None:
        self.children: dict[Hashable, SourceNode] = {}
        self._parent: SourceNode | None = None
        self.ref_count = 0
        SourceNode._counter += 1
        self.uuid = SourceNode._counter
        self.timestamp = timestamp
        self._key = torch.empty(0, dtype=torch.int64)
        self._value = torch.empty(0, dtype=torch.int32)
        self._length = 0

    def set_key_value(self, key: torch.Tensor, value: torch.Tensor) -> None:
        self._key, self._value, self._length = key, value, len(key)

    def set_parent(self, parent: SourceNode) -> None:
        self._parent = parent
        parent.children[int(self._key[0].item())] = self

    @property
    def length(self) -> int:
        return self._length

    @property
    def parent(self) -> SourceNode:
        if self._parent is None:  # the source asserts; an assert vanishes under python -O
            raise RuntimeError("the root has no parent")
        return self._parent

    @property
    def value(self) -> torch.Tensor:
        return self._value

    def is_root(self) -> bool:
        return self._parent is None

    def is_leaf(self) -> bool:
        return len(self.children) == 0

    def get_match_len(self, input_ids: torch.Tensor) -> int:
        n = min(self._length, len(input_ids))
        diff = (self._key[:n] != input_ids[:n]).nonzero()
        return n if len(diff) == 0 else int(diff[0].item())

    def _split_at(self, pos: int) -> SourceNode:
        parent = self.parent
        new_node = SourceNode(self.timestamp)
        new_node.set_key_value(self._key[:pos], self._value[:pos])
        new_node.set_parent(parent)
        new_node.ref_count = self.ref_count
        self.set_key_value(self._key[pos:], self._value[pos:])
        self.set_parent(new_node)
        return new_node

    def __lt__(self, other: SourceNode) -> bool:
        return self.timestamp < other.timestamp


@dataclass(frozen=True)
class SourceHandle(BaseCacheHandle):
    node: SourceNode


class SourceRadixCacheManager(BaseCacheManager):
    """The guide's radix manager at page size 1: a full scan of the tree on every ``evict``."""

    page_size = 1

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.empty_tensor = torch.empty(0, dtype=torch.int32, device=self.device)
        self.reset()

    def reset(self) -> None:
        self.root_node = SourceNode()
        self.root_node.ref_count = 1
        self.evictable_size = 0
        self.protected_size = 0

    def _walk(self, input_ids: torch.Tensor) -> tuple[SourceNode, int]:
        prefix_len, node, tic = 0, self.root_node, time.monotonic_ns()
        while prefix_len < len(input_ids):
            this_id = int(input_ids[prefix_len].item())
            if this_id not in node.children:
                return node, prefix_len
            node = node.children[this_id]
            match_len = node.get_match_len(input_ids[prefix_len:])
            prefix_len += match_len
            if match_len != node.length:
                node = node._split_at(match_len)
                node.timestamp = tic
                return node, prefix_len
            node.timestamp = tic
        return node, prefix_len

    def match_prefix(
        self, input_ids: torch.Tensor, extra_key: Hashable = None
    ) -> tuple[SourceHandle, torch.Tensor]:
        _default_namespace_only(extra_key)
        node, prefix_len = self._walk(input_ids)
        if prefix_len == 0:
            return SourceHandle(0, node), self.empty_tensor
        value_list, matched = [], node
        while not node.is_root():
            value_list.append(node.value)
            node = node.parent
        value_list.reverse()
        return SourceHandle(prefix_len, matched), torch.cat(value_list)

    def insert_prefix(
        self, input_ids: torch.Tensor, indices: torch.Tensor, extra_key: Hashable = None
    ) -> int:
        _default_namespace_only(extra_key)
        node, prefix_len = self._walk(input_ids)
        if prefix_len < len(input_ids):
            new_node = SourceNode(time.monotonic_ns())
            new_node.set_key_value(input_ids[prefix_len:].clone(), indices[prefix_len:].clone())
            new_node.set_parent(node)
            self.evictable_size += new_node.length
        return prefix_len

    def lock_handle(self, handle: BaseCacheHandle, unlock: bool = False) -> None:
        if not isinstance(handle, SourceHandle):
            raise TypeError(f"not a handle of this manager: {handle!r}")
        node = handle.node
        if unlock:
            while not node.is_root():
                node.ref_count -= 1
                if node.ref_count == 0:
                    self.evictable_size += node.length
                    self.protected_size -= node.length
                node = node.parent
        else:
            while not node.is_root():
                if node.ref_count == 0:
                    self.evictable_size -= node.length
                    self.protected_size += node.length
                node.ref_count += 1
                node = node.parent

    def _collect_leave_nodes_for_evict(self) -> list[SourceNode]:
        stack, leaves = [self.root_node], []
        while stack:
            node = stack.pop()
            if node.is_leaf():
                if node.ref_count == 0:
                    leaves.append(node)
            else:
                stack.extend(node.children.values())
        return leaves

    def _child_key(self, node: SourceNode) -> Hashable:
        """The key ``node`` is filed under in its parent's children (its first token)."""
        return int(node._key[0].item())

    def evict(self, size: int) -> torch.Tensor:
        if size == 0:
            return self.empty_tensor
        if size > self.evictable_size:
            raise RuntimeError(f"cannot evict {size}: only {self.evictable_size} evictable")
        leaves = self._collect_leave_nodes_for_evict()
        heapq.heapify(leaves)
        evicted, evicted_size = [], 0
        while evicted_size < size:
            node = heapq.heappop(leaves)
            evicted_size += node.length
            evicted.append(node.value)
            self.evictable_size -= node.length
            parent = node.parent
            del parent.children[self._child_key(node)]
            if parent.is_leaf() and parent.ref_count == 0:
                heapq.heappush(leaves, parent)
        return torch.cat(evicted)

    @property
    def size_info(self) -> SizeInfo:
        return SizeInfo(self.evictable_size, self.protected_size)

    def check_integrity(self) -> None:
        pass

    def cached_indices(self) -> torch.Tensor:
        """Every slot in the tree (the source has no such call; the flow's page check needs it)."""
        stack, parts = [self.root_node], [self.empty_tensor]
        while stack:
            node = stack.pop()
            if not node.is_root():
                parts.append(node.value)
            stack.extend(node.children.values())
        return torch.cat(parts)


def _page_key(key: torch.Tensor, page_size: int) -> Hashable:
    return int(key[0].item()) if page_size == 1 else tuple(key[:page_size].tolist())


class PagedSourceNode(SourceNode):
    def __init__(self, timestamp: int = 0, page_size: int = 1) -> None:
        super().__init__(timestamp)
        self.page_size = page_size

    def set_parent(self, parent: SourceNode) -> None:
        self._parent = parent
        parent.children[_page_key(self._key, self.page_size)] = self

    def get_match_len(self, input_ids: torch.Tensor) -> int:
        m = super().get_match_len(input_ids)
        return m // self.page_size * self.page_size

    def _split_at(self, pos: int) -> PagedSourceNode:
        parent = self.parent
        new_node = PagedSourceNode(self.timestamp, self.page_size)
        new_node.set_key_value(self._key[:pos], self._value[:pos])
        new_node.set_parent(parent)
        new_node.ref_count = self.ref_count
        self.set_key_value(self._key[pos:], self._value[pos:])
        self.set_parent(new_node)
        return new_node


class PagedSourceRadixCacheManager(SourceRadixCacheManager):
    """The guide's design ported to pages: children filed under their first page, matches
    rounded down to whole pages, the same full scan on every ``evict``."""

    def __init__(self, device: torch.device | str = "cpu", page_size: int = 1) -> None:
        self.page_size = page_size
        super().__init__(device)

    def reset(self) -> None:
        super().reset()
        self.root_node = PagedSourceNode(page_size=self.page_size)
        self.root_node.ref_count = 1

    def _aligned(self, input_ids: torch.Tensor) -> torch.Tensor:
        return input_ids[: len(input_ids) // self.page_size * self.page_size]

    def _walk(self, input_ids: torch.Tensor) -> tuple[SourceNode, int]:
        prefix_len, node, tic = 0, self.root_node, time.monotonic_ns()
        while prefix_len < len(input_ids):
            this_key = _page_key(input_ids[prefix_len:], self.page_size)
            if this_key not in node.children:
                return node, prefix_len
            node = node.children[this_key]
            match_len = node.get_match_len(input_ids[prefix_len:])
            prefix_len += match_len
            if match_len != node.length:
                node = node._split_at(match_len)
                node.timestamp = tic
                return node, prefix_len
            node.timestamp = tic
        return node, prefix_len

    def match_prefix(
        self, input_ids: torch.Tensor, extra_key: Hashable = None
    ) -> tuple[SourceHandle, torch.Tensor]:
        return super().match_prefix(self._aligned(input_ids), extra_key)

    def insert_prefix(
        self, input_ids: torch.Tensor, indices: torch.Tensor, extra_key: Hashable = None
    ) -> int:
        _default_namespace_only(extra_key)
        input_ids = self._aligned(input_ids)
        node, prefix_len = self._walk(input_ids)
        if prefix_len < len(input_ids):
            new_node = PagedSourceNode(time.monotonic_ns(), self.page_size)
            new_node.set_key_value(
                input_ids[prefix_len:].clone(), indices[prefix_len : len(input_ids)].clone()
            )
            new_node.set_parent(node)
            self.evictable_size += new_node.length
        return prefix_len

    def _child_key(self, node: SourceNode) -> Hashable:
        return _page_key(node._key, self.page_size)
