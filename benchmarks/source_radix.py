"""The radix manager written the way the source document's code works, as a benchmark baseline.

Tensor keys; one ``.item()`` per child lookup; a tensor comparison per node; and on every
``evict`` a full scan of the tree to collect the leaves, heapified anew. The two fixes the
book makes that are needed to run a workload at all are applied: the eviction loop checks the
size first (source error 4), and the split-off prefix gets the current timestamp (error 3),
so that both managers evict the same things and only their speed differs.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from kvcache import BaseCacheHandle, BaseCacheManager, SizeInfo


class SourceNode:
    _counter = 0

    def __init__(self, timestamp: int = 0) -> None:
        self.children: dict[int, SourceNode] = {}
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
        assert self._parent is not None
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

    def match_prefix(self, input_ids: torch.Tensor) -> tuple[SourceHandle, torch.Tensor]:
        node, prefix_len = self._walk(input_ids)
        if prefix_len == 0:
            return SourceHandle(0, node), self.empty_tensor
        value_list, matched = [], node
        while not node.is_root():
            value_list.append(node.value)
            node = node.parent
        value_list.reverse()
        return SourceHandle(prefix_len, matched), torch.cat(value_list)

    def insert_prefix(self, input_ids: torch.Tensor, indices: torch.Tensor) -> int:
        node, prefix_len = self._walk(input_ids)
        if prefix_len < len(input_ids):
            new_node = SourceNode(time.monotonic_ns())
            new_node.set_key_value(input_ids[prefix_len:].clone(), indices[prefix_len:].clone())
            new_node.set_parent(node)
            self.evictable_size += new_node.length
        return prefix_len

    def lock_handle(self, handle: BaseCacheHandle, unlock: bool = False) -> None:
        node = handle.node  # type: ignore[attr-defined]
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
