"""``MHAKVCache``: one buffer that holds K and V of every layer, split over TP ranks by KV head.

Buffer (``MHAKVCache.buffer``), in storage order:

* ``LayerFirst``: ``(2, num_layers, num_pages, page_size, local_kv_heads, head_dim)``
* ``PageFirst``:  ``(2, num_pages, num_layers, page_size, local_kv_heads, head_dim)``

Index 0 of the first dimension is K, 1 is V. Either way the pool *views* the buffer layer-first
(PageFirst through a ``permute``, never a copy), so ``k_cache(layer)`` always has shape
``(num_pages, page_size, local_kv_heads, head_dim)``; only its strides differ.
"""

from __future__ import annotations

import torch

from .._validate import MAX_SLOTS, as_int, check_device, check_positive_int
from ..kernels.store import store_cache
from .base import BaseKVCache, KVCacheLayout
from .distributed import DistributedInfo, divide_even, try_get_tp_info

__all__ = ["MHAKVCache"]


class MHAKVCache(BaseKVCache):
    """K/V storage for a multi-head (or grouped-query) attention model.

    Args:
        num_kv_heads: KV heads of the whole model; this process keeps
            ``local_kv_heads = divide_even(num_kv_heads, tp.size)`` of them, where ``tp`` is the
            info set with :func:`kvcache.storage.distributed.set_tp_info` (rank 0 of size 1 if none).
        num_layers, head_dim, num_pages, page_size: positive ints; the pool has
            ``num_slots = num_pages * page_size`` token slots, slot ``s`` at
            ``[s // page_size, s % page_size]`` of each layer view.
        dtype: a floating-point ``torch.dtype``.
        kv_layout: a :class:`KVCacheLayout`.
        device: where the buffer lives.

    The buffer is zero-initialised, so reads of never-written slots are deterministic.
    Errors: ``TypeError``/``ValueError`` for bad arguments (naming the value and the limit);
    ``layer_id`` outside ``[0, num_layers)`` raises ``IndexError``. A call that raises writes
    nothing.
    """

    def __init__(
        self,
        num_kv_heads: int,
        num_layers: int,
        head_dim: int,
        num_pages: int,
        dtype: torch.dtype,
        kv_layout: KVCacheLayout,
        device: torch.device | str,
        page_size: int = 1,
    ) -> None:
        # Kept as Python ints (never a NumPy or torch scalar, whose products wrap or stay tensors).
        num_kv_heads = check_positive_int(num_kv_heads, "num_kv_heads")
        num_layers = check_positive_int(num_layers, "num_layers")
        head_dim = check_positive_int(head_dim, "head_dim")
        num_pages = check_positive_int(num_pages, "num_pages")
        page_size = check_positive_int(page_size, "page_size")
        if num_pages * page_size > MAX_SLOTS:
            raise ValueError(
                f"num_pages * page_size = {num_pages * page_size} slots do not fit in int32 "
                f"(at most {MAX_SLOTS}): slots are torch.int32"
            )
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
        if not isinstance(kv_layout, KVCacheLayout):
            raise TypeError(f"kv_layout must be a KVCacheLayout, got {kv_layout!r}")
        device = check_device(device)

        tp = try_get_tp_info() or DistributedInfo(rank=0, size=1)
        try:
            local_kv_heads = divide_even(num_kv_heads, tp.size)
        except ValueError:
            raise ValueError(
                f"num_kv_heads={num_kv_heads} cannot be split evenly over TP size {tp.size}"
            ) from None
        nbytes = 2 * num_layers * num_pages * page_size * local_kv_heads * head_dim * dtype.itemsize
        if nbytes > 2**63 - 1:  # torch.zeros would fail to read the shape, naming no argument
            raise ValueError(
                f"the pool would take {nbytes} bytes (2 * num_layers * num_pages * page_size * "
                f"local_kv_heads * head_dim * itemsize), more than one tensor can hold (2**63 - 1)"
            )

        self.num_kv_heads = num_kv_heads
        self.local_kv_heads = local_kv_heads
        self.head_dim = head_dim
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        self.kv_layout = kv_layout
        self.tp_info = tp
        self._num_layers = num_layers

        per_page = (page_size, local_kv_heads, head_dim)
        if kv_layout is KVCacheLayout.LayerFirst:
            self._buffer = torch.zeros(
                (2, num_layers, num_pages, *per_page), dtype=dtype, device=device
            )
            self._kv = self._buffer
        else:
            self._buffer = torch.zeros(
                (2, num_pages, num_layers, *per_page), dtype=dtype, device=device
            )
            # (2, pages, layers, ...) -> (2, layers, pages, ...): a strided view, no copy.
            self._kv = self._buffer.permute(0, 2, 1, 3, 4, 5)
        # Each layer's (K, V) views, made once: `store_kv` runs per layer per step, and indexing
        # the buffer anew costs a few microseconds of host time a call. Never handed out
        # (`k_cache` makes a fresh view), so no caller can change their shape or strides.
        self._layers = [(self._kv[0, i], self._kv[1, i]) for i in range(num_layers)]

    # -- views ----------------------------------------------------------------------------------

    def _check_layer(self, layer_id: object) -> int:
        layer_id = as_int(layer_id, "layer_id")
        if not 0 <= layer_id < self._num_layers:
            raise IndexError(f"layer_id {layer_id} is outside [0, num_layers={self._num_layers})")
        return layer_id

    def k_cache(self, index: int) -> torch.Tensor:
        """Keys of layer ``index``: a view ``(num_pages, page_size, local_kv_heads, head_dim)``."""
        return self._kv[0, self._check_layer(index)]

    def v_cache(self, index: int) -> torch.Tensor:
        """Values of layer ``index``: a view ``(num_pages, page_size, local_kv_heads, head_dim)``."""
        return self._kv[1, self._check_layer(index)]

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        out_loc: torch.Tensor,
        layer_id: int,
        *,
        check_bounds: bool = True,
    ) -> None:
        """Write ``k[i]``, ``v[i]`` to slot ``out_loc[i]`` of layer ``layer_id``.

        ``k``, ``v``: ``(n, local_kv_heads, head_dim)`` (or rows ``(n, local_kv_heads * head_dim)``,
        as mini-sglang passes them) in the pool's dtype, on its device;
        ``out_loc``: ``(n,)`` int32 (int64 is accepted too) slots ``page * page_size + offset``.
        Errors as :func:`kvcache.kernels.store_cache` (``ValueError`` for mismatches,
        ``IndexError`` for a slot outside ``[0, num_slots)``), plus ``IndexError`` for a bad
        ``layer_id``; nothing is written when it raises. ``check_bounds=False`` is passed on to
        ``store_cache``: no host sync (a CUDA graph can capture the call) and out-of-range slots
        are dropped by the kernel's device-side guard instead of raising.
        """
        k_cache, v_cache = self._layers[self._check_layer(layer_id)]
        store_cache(k_cache, v_cache, out_loc, k, v, check_bounds=check_bounds)

    # -- facts ----------------------------------------------------------------------------------

    @property
    def buffer(self) -> torch.Tensor:
        """The raw storage tensor, in storage order (see the module docstring). Treat as read-only."""
        return self._buffer

    @property
    def nbytes(self) -> int:
        """Bytes the buffer holds: ``2 * num_layers * num_slots * local_kv_heads * head_dim * itemsize``."""
        return self._buffer.numel() * self._buffer.element_size()

    @property
    def device(self) -> torch.device:
        return self._buffer.device

    @property
    def dtype(self) -> torch.dtype:
        return self._buffer.dtype

    @property
    def num_layers(self) -> int:
        return self._num_layers

    def __repr__(self) -> str:
        return (
            f"MHAKVCache(layout={self.kv_layout.name}, layers={self._num_layers}, "
            f"pages={self.num_pages}, page_size={self.page_size}, "
            f"local_kv_heads={self.local_kv_heads}/{self.num_kv_heads}, head_dim={self.head_dim}, "
            f"dtype={self.dtype}, device={self.device}, nbytes={self.nbytes})"
        )
