"""The source document's radix design made page-aware, as the second benchmark baseline.

`SourceRadixCacheManager` (``source_radix.py``) only knows ``page_size == 1``. A server runs
pages of 16 tokens, so this variant does what a straightforward port of that design to pages
does (as mini-sglang's later radix cache does): children filed under their first page as a
tuple of token ids, tensor keys compared a node at a time with the match length rounded down to
a whole page, only the page-aligned part inserted. Everything else is the source design
unchanged: one ``tolist`` per child lookup, a full tree scan and a fresh heap on every
``evict``. It validates nothing (generous to the baseline). Same cache decisions as
`RadixCacheManager` with the LRU policy, which ``tests/test_benchmarks.py`` checks.
"""

from __future__ import annotations

import time
from collections.abc import Hashable

import torch
from source_radix import SourceHandle, SourceNode, SourceRadixCacheManager


def _page_key(key: torch.Tensor, page_size: int) -> Hashable:
    return int(key[0].item()) if page_size == 1 else tuple(key[:page_size].tolist())


class PagedSourceNode(SourceNode):
    def __init__(self, timestamp: int = 0, page_size: int = 1) -> None:
        super().__init__(timestamp)
        self.page_size = page_size

    def set_parent(self, parent: SourceNode) -> None:  # type: ignore[override]
        self._parent = parent
        parent.children[_page_key(self._key, self.page_size)] = self  # type: ignore[index]

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
            node = node.children[this_key]  # type: ignore[index]
            match_len = node.get_match_len(input_ids[prefix_len:])
            prefix_len += match_len
            if match_len != node.length:
                node = node._split_at(match_len)
                node.timestamp = tic
                return node, prefix_len
            node.timestamp = tic
        return node, prefix_len

    def match_prefix(self, input_ids: torch.Tensor) -> tuple[SourceHandle, torch.Tensor]:
        return super().match_prefix(self._aligned(input_ids))

    def insert_prefix(self, input_ids: torch.Tensor, indices: torch.Tensor) -> int:
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
