"""kvcache: KV-cache storage and prefix-cache management for LLM serving.

Storage: `MHAKVCache` (one K+V buffer, LayerFirst or PageFirst, split by KV heads under TP).
Management: `NaiveCacheManager`, `RadixCacheManager` (radix tree, LRU/FIFO eviction).
Pages and requests: `PageAllocator`, `RequestFlow`.
"""

from .allocator import PageAllocator
from .base import BaseCacheHandle, BaseCacheManager, BaseKVCache, KVCacheLayout, SizeInfo
from .distributed import (
    DistributedInfo,
    divide_even,
    get_tp_info,
    reset_tp_info,
    set_tp_info,
    try_get_tp_info,
)
from .eviction import EVICTION_POLICIES, register_eviction_policy
from .mha_pool import MHAKVCache
from .naive_manager import NaiveCacheHandle, NaiveCacheManager
from .radix_manager import RadixCacheHandle, RadixCacheManager, RadixTreeNode
from .request_flow import FlowEvent, FlowStats, Request, RequestFlow

__all__ = [
    "BaseKVCache", "KVCacheLayout", "BaseCacheHandle", "SizeInfo", "BaseCacheManager",
    "MHAKVCache", "NaiveCacheHandle", "NaiveCacheManager",
    "RadixTreeNode", "RadixCacheHandle", "RadixCacheManager",
    "EVICTION_POLICIES", "register_eviction_policy",
    "PageAllocator", "RequestFlow", "Request", "FlowStats", "FlowEvent",
    "DistributedInfo", "set_tp_info", "get_tp_info", "try_get_tp_info", "reset_tp_info", "divide_even",
]
