"""`NaiveCacheManager`: the manager that caches nothing, the baseline every other one beats."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from .._validate import check_device, check_indices, check_page_size, check_size, check_token_ids
from .base import BaseCacheHandle, BaseCacheManager, SizeInfo
from .cache_events import check_extra_key

__all__ = ["NaiveCacheHandle", "NaiveCacheManager"]


@dataclass(frozen=True)
class NaiveCacheHandle(BaseCacheHandle):
    """Always ``cached_len == 0``: nothing is ever cached."""


class NaiveCacheManager(BaseCacheManager):
    """Every request recomputes its whole prompt; nothing outlives the request.

    ``insert_prefix`` reports every token as "already cached", so a caller that frees the
    duplicates it allocated frees all of them: allocate, use, free at once, and no leak.
    """

    def __init__(self, device: torch.device | str = "cpu", page_size: int = 1) -> None:
        """``page_size`` only says which pools it serves (``RequestFlow`` checks that it matches
        the allocator's): caching nothing, it works the same at every page size."""
        self.device = check_device(device)
        self.page_size = check_page_size(page_size)
        self.empty_tensor = torch.empty(0, dtype=torch.int32, device=self.device)
        self._locks: dict[int, list[Any]] = {}  # id(handle) -> [handle, times locked]

    def match_prefix(
        self, input_ids: torch.Tensor, extra_key: Hashable = None
    ) -> tuple[NaiveCacheHandle, torch.Tensor]:
        check_token_ids(input_ids)
        check_extra_key(extra_key)
        return NaiveCacheHandle(0), self.empty_tensor

    def lock_handle(self, handle: BaseCacheHandle, unlock: bool = False) -> None:
        """Protects nothing, but keeps the contract: unlocking a handle (object) that is not
        locked raises ``RuntimeError``, as with every manager, so misuse shows here too."""
        if not isinstance(handle, BaseCacheHandle):
            raise TypeError(f"handle must be a BaseCacheHandle, got {type(handle).__name__}")
        entry = self._locks.get(id(handle))
        if not unlock:
            if entry is None:
                self._locks[id(handle)] = [handle, 1]
            else:
                entry[1] += 1
        elif entry is None:
            raise RuntimeError("cannot unlock a handle that is not locked")
        elif entry[1] == 1:
            del self._locks[id(handle)]
        else:
            entry[1] -= 1

    def insert_prefix(
        self, input_ids: torch.Tensor, indices: torch.Tensor, extra_key: Hashable = None
    ) -> int:
        check_token_ids(input_ids)
        check_extra_key(extra_key)
        check_indices(indices, self.device)
        if len(indices) != len(input_ids):
            raise ValueError(
                f"len(indices) ({len(indices)}) must equal len(input_ids) ({len(input_ids)})"
            )
        return len(indices)

    def evict(self, size: int) -> torch.Tensor:
        if check_size(size) == 0:
            return self.empty_tensor
        raise NotImplementedError(
            f"NaiveCacheManager caches nothing and cannot evict {size} tokens"
        )

    def reset(self) -> None:
        pass

    @property
    def size_info(self) -> SizeInfo:
        return SizeInfo(evictable_size=0, protected_size=0)

    def check_integrity(self) -> None:
        pass

    def cached_indices(self) -> torch.Tensor:
        """Slots held by the cache: none."""
        return self.empty_tensor

    def handle_indices(self, handle: BaseCacheHandle) -> torch.Tensor:
        """The slots of a naive handle: none."""
        return self.empty_tensor
