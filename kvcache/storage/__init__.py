"""The storage layer: where K and V live.

`BaseKVCache` and `KVCacheLayout` (the contract), `MHAKVCache` (one paged K+V buffer, LayerFirst
or PageFirst) and `create_kvcache` (one for a model's shape), and the tensor-parallel info that
decides how many KV heads a rank holds. Imports only the kernels below it
(`MHAKVCache.store_kv` calls `store_cache`).
"""

from .base import BaseKVCache, KVCacheLayout
from .distributed import (
    DistributedInfo,
    divide_even,
    get_tp_info,
    reset_tp_info,
    set_tp_info,
    try_get_tp_info,
)
from .factory import create_kvcache
from .mha_pool import MHAKVCache

__all__ = [
    "BaseKVCache",
    "KVCacheLayout",
    "MHAKVCache",
    "create_kvcache",
    "DistributedInfo",
    "divide_even",
    "get_tp_info",
    "reset_tp_info",
    "set_tp_info",
    "try_get_tp_info",
]
