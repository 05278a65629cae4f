"""The management layer: which prefixes keep their K/V slots.

`BaseCacheManager` (the contract every manager keeps), `NaiveCacheManager` (caches nothing),
`RadixCacheManager` (a radix tree with pluggable eviction policies) and `BlockHashCacheManager`
(chained block hashes, vLLM style), each also by name (`create_cache_manager`). Every manager
keeps prefixes of different namespaces (``extra_key``) apart; the radix and block-hash ones can
log `BlockStored`, `BlockRemoved` and `AllCleared` events (``events=True``, read with
``take_events()``) for a mirror outside. Managers see token ids and slot indices only: they
import neither the storage, the kernels nor anything that serves or draws.
"""

from .base import BaseCacheHandle, BaseCacheManager, InsertResult, SizeInfo
from .block_hash import BlockHashCacheHandle, BlockHashCacheManager, CachedBlock
from .cache_events import AllCleared, BlockRemoved, BlockStored, CacheEvent
from .eviction import EVICTION_POLICIES, register_eviction_policy
from .naive import NaiveCacheHandle, NaiveCacheManager
from .radix import RadixCacheHandle, RadixCacheManager, RadixTreeNode, Walk
from .registry import (
    SUPPORTED_CACHE_MANAGER,
    CacheManagerFactory,
    Registry,
    RegistryError,
    create_cache_manager,
)

SUPPORTED_CACHE_MANAGER.register("naive")(NaiveCacheManager)
SUPPORTED_CACHE_MANAGER.register("radix")(RadixCacheManager)
SUPPORTED_CACHE_MANAGER.register("block_hash")(BlockHashCacheManager)

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
    "Walk",
    "BlockHashCacheManager",
    "BlockHashCacheHandle",
    "CachedBlock",
    "EVICTION_POLICIES",
    "register_eviction_policy",
    "SUPPORTED_CACHE_MANAGER",
    "create_cache_manager",
    "CacheManagerFactory",
    "Registry",
    "RegistryError",
    "BlockStored",
    "BlockRemoved",
    "AllCleared",
    "CacheEvent",
]
