"""kvcache: KV-cache storage and prefix-cache management for LLM serving.

Storage: `MHAKVCache` (one K+V buffer, LayerFirst or PageFirst, split by KV heads under TP).
Management: `NaiveCacheManager`, `RadixCacheManager` (radix tree, LRU/FIFO eviction).
Pages and requests: `PageAllocator`, `RequestFlow`.
"""

from .allocator import PageAllocator
from .attention import gather_kv, paged_attention, paged_decode_attention, paged_decode_backend
from .block_manager import BlockHashCacheHandle, BlockHashCacheManager, CachedBlock
from .base import BaseCacheHandle, BaseCacheManager, BaseKVCache, KVCacheLayout, SizeInfo
from .distributed import (
    DistributedInfo,
    divide_even,
    get_tp_info,
    reset_tp_info,
    set_tp_info,
    try_get_tp_info,
)
from .kernels import store_cache, store_cache_backend, store_cache_torch, store_cache_triton
from .eviction import EVICTION_POLICIES, register_eviction_policy
from .engine import Engine
from .explorer import Explorer, StepPlayer, step_player
from .mha_pool import MHAKVCache
from .model import TinyLlama, TinyLlamaConfig
from .naive_manager import NaiveCacheHandle, NaiveCacheManager
from .radix_manager import RadixCacheHandle, RadixCacheManager, RadixTreeNode
from .request_flow import FlowEvent, FlowStats, Request, RequestFlow
from .tp import TPConfig, TPResult, run_single_process, run_tp_attention

__all__ = [
    "BaseKVCache", "KVCacheLayout", "BaseCacheHandle", "SizeInfo", "BaseCacheManager",
    "MHAKVCache", "NaiveCacheHandle", "NaiveCacheManager",
    "RadixTreeNode", "RadixCacheHandle", "RadixCacheManager",
    "BlockHashCacheManager", "BlockHashCacheHandle", "CachedBlock",
    "EVICTION_POLICIES", "register_eviction_policy",
    "PageAllocator", "RequestFlow", "Request", "FlowStats", "FlowEvent",
    "store_cache", "store_cache_backend", "store_cache_torch", "store_cache_triton",
    "paged_attention", "paged_decode_attention", "paged_decode_backend", "gather_kv",
    "TPConfig", "TPResult", "run_tp_attention", "run_single_process",
    "TinyLlama", "TinyLlamaConfig", "Engine", "Explorer", "StepPlayer", "step_player",
    "DistributedInfo", "set_tp_info", "get_tp_info", "try_get_tp_info", "reset_tp_info", "divide_even",
]
