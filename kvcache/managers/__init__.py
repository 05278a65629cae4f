"""The management layer: which prefixes keep their K/V slots.

`BaseCacheManager` (the contract every manager keeps), `NaiveCacheManager` (caches nothing),
`RadixCacheManager` (a radix tree with pluggable eviction policies) and `BlockHashCacheManager`
(chained block hashes, vLLM style). Managers see token ids and slot indices only: they import
neither the storage, the kernels nor anything that serves or draws.
"""

from .base import BaseCacheHandle, BaseCacheManager, InsertResult, SizeInfo
from .block_hash import BlockHashCacheHandle, BlockHashCacheManager, CachedBlock
from .eviction import EVICTION_POLICIES, register_eviction_policy
from .naive import NaiveCacheHandle, NaiveCacheManager
from .radix import RadixCacheHandle, RadixCacheManager, RadixTreeNode

__all__ = [
    "BaseCacheHandle",
    "BaseCacheManager",
    "InsertResult",
    "SizeInfo",
    "NaiveCacheHandle",
    "NaiveCacheManager",
    "RadixTreeNode",
    "RadixCacheHandle",
    "RadixCacheManager",
    "BlockHashCacheManager",
    "BlockHashCacheHandle",
    "CachedBlock",
    "EVICTION_POLICIES",
    "register_eviction_policy",
]
