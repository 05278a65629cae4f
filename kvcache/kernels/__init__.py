"""Kernels that move K/V into the cache. See :mod:`kvcache.kernels.store`."""

from .store import (
    TRITON_INTERPRET,
    store_cache,
    store_cache_backend,
    store_cache_torch,
    store_cache_triton,
)

__all__ = [
    "TRITON_INTERPRET",
    "store_cache",
    "store_cache_backend",
    "store_cache_torch",
    "store_cache_triton",
]
