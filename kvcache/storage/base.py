"""Abstract base of the storage layer: `BaseKVCache`, and the `KVCacheLayout` of its buffer.

The storage layer owns the tensors that hold keys and values. Indices it receives are *token
slots*: slot ``s`` lives at ``[s // page_size, s % page_size]`` of a per-layer cache view.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod

import torch

__all__ = ["BaseKVCache", "KVCacheLayout"]


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
    def store_kv(
        self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor, layer_id: int
    ) -> None:
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
