"""Abstract bases of the two layers: storage (`BaseKVCache`) under management (`BaseCacheManager`).

The storage layer owns the tensors that hold keys and values; the management layer decides which
token prefixes stay in those tensors, which may be evicted, and which are in use. Indices that
travel between the two are *token slots*: slot ``s`` lives at ``[s // page_size, s % page_size]``
of a per-layer cache view.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import NamedTuple, Tuple

import torch

__all__ = [
    "BaseKVCache",
    "KVCacheLayout",
    "BaseCacheHandle",
    "SizeInfo",
    "BaseCacheManager",
]


class KVCacheLayout(enum.Enum):
    """Order in which the pool's buffer is stored in memory.

    ``LayerFirst``: ``(2, num_layers, num_pages, page_size, heads, head_dim)``, one layer's pages
    contiguous. ``PageFirst``: ``(2, num_pages, num_layers, page_size, heads, head_dim)``, all
    layers of one page contiguous; the pool still *views* it layer-first.
    """

    LayerFirst = enum.auto()
    PageFirst = enum.auto()


class BaseKVCache(ABC):
    """Storage of K and V for every layer of a model."""

    @abstractmethod
    def k_cache(self, index: int) -> torch.Tensor:
        """Keys of layer ``index``, shape ``(num_pages, page_size, local_kv_heads, head_dim)``."""

    @abstractmethod
    def v_cache(self, index: int) -> torch.Tensor:
        """Values of layer ``index``, shape ``(num_pages, page_size, local_kv_heads, head_dim)``."""

    @abstractmethod
    def store_kv(self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor, layer_id: int) -> None:
        """Write ``k[i]``, ``v[i]`` (each ``(n, local_kv_heads, head_dim)``) to slot ``out_loc[i]``."""

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype: ...

    @property
    @abstractmethod
    def num_layers(self) -> int: ...


@dataclass(frozen=True)
class BaseCacheHandle:
    """A claim on a cached prefix: how long it is, and (in subclasses) where it lives.

    The handle is what a request locks and unlocks; the indices returned beside it are the slots
    that hold the prefix's K/V.
    """

    cached_len: int


class SizeInfo(NamedTuple):
    """Tokens held by a manager: ``evictable_size`` may be evicted, ``protected_size`` is locked."""

    evictable_size: int
    protected_size: int

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size


class BaseCacheManager(ABC):
    """Decides which token prefixes keep their K/V slots.

    Promises of every implementation: ``match_prefix`` returns ``handle.cached_len`` indices;
    ``insert_prefix`` returns the length that was already cached (the caller keeps ownership of
    the indices that were not inserted); ``evict(0)`` returns an empty tensor; a call that raises
    leaves the manager unchanged.
    """

    @abstractmethod
    def match_prefix(self, input_ids: torch.Tensor) -> Tuple[BaseCacheHandle, torch.Tensor]:
        """Longest cached prefix of ``input_ids`` (1-D, CPU) and its slots (1-D int32)."""

    @abstractmethod
    def lock_handle(self, handle: BaseCacheHandle, unlock: bool = False) -> None:
        """Protect (or release) the prefix behind ``handle`` from eviction."""

    @abstractmethod
    def insert_prefix(self, input_ids: torch.Tensor, indices: torch.Tensor) -> int:
        """Cache ``input_ids`` whose K/V sit at ``indices``; return the length already cached."""

    @abstractmethod
    def evict(self, size: int) -> torch.Tensor:
        """Forget unlocked prefixes holding at least ``size`` tokens; return their slots."""

    @abstractmethod
    def reset(self) -> None:
        """Forget every prefix."""

    @property
    @abstractmethod
    def size_info(self) -> SizeInfo:
        """Evictable and protected token counts."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise ``RuntimeError`` if the manager's bookkeeping is inconsistent."""

    def cached_indices(self) -> torch.Tensor:
        """Every slot the cache holds (1-D int32, any order); used to account for pages.

        Not abstract so that managers written against the original interface keep working;
        `RequestFlow.check_integrity` needs it.
        """
        raise NotImplementedError(f"{type(self).__name__} does not report its cached indices")
