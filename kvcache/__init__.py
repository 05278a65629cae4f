"""kvcache: KV-cache storage and prefix-cache management for LLM serving.

The package is layered as the book teaches it, each layer importing only the ones above it in
this list:

- `kvcache.kernels`: Triton kernels that store K/V and read it in attention (tensors in, tensors out);
- `kvcache.storage`: the K/V pool (`MHAKVCache`), its layouts and tensor-parallel info;
- `kvcache.managers`: prefix-cache managers (`NaiveCacheManager`, `RadixCacheManager`,
  `BlockHashCacheManager`) behind one contract, `BaseCacheManager`;
- `kvcache.serving`: pages and requests (`PageAllocator`, `RequestFlow`), a tiny model and its
  `Engine`, workloads and the `Scheduler`;
- `kvcache.system`: the serving system around one cache, beyond the study guide: the host-memory
  tier (`TieredCacheManager`), the `Router` over replicas with its `PrefixMirror`, tenancy
  (`PublicPrefixCache`);
- `kvcache.viz`: drawings, the recorder, the explorer widget and the static step player;
- `kvcache.examples`: runnable demos (tensor-parallel attention over processes).

Every public name is importable as ``from kvcache import X``. The names of `kvcache.viz` and the
TP demo are loaded on first use, so ``import kvcache`` loads neither graphviz, ipywidgets,
matplotlib, IPython nor multiprocessing code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: The package's version, its one source: pyproject.toml reads it (``[tool.setuptools.dynamic]``).
__version__ = "0.1.0"

from .kernels.attention import (
    gather_kv,
    paged_attention,
    paged_decode_attention,
    paged_decode_backend,
)
from .kernels.store import store_cache, store_cache_backend, store_cache_torch, store_cache_triton
from .managers import (
    EVICTION_POLICIES,
    SUPPORTED_CACHE_MANAGER,
    AllCleared,
    BaseCacheHandle,
    BaseCacheManager,
    BlockHashCacheHandle,
    BlockHashCacheManager,
    BlockRemoved,
    BlockStored,
    CachedBlock,
    CacheEvent,
    CacheManagerFactory,
    InsertResult,
    NaiveCacheHandle,
    NaiveCacheManager,
    RadixCacheHandle,
    RadixCacheManager,
    RadixTreeNode,
    Registry,
    RegistryError,
    SizeInfo,
    Walk,
    create_cache_manager,
    register_eviction_policy,
)
from .serving import (
    ADMISSION_POLICIES,
    LLAMA3_8B_H100,
    STOP_REASONS,
    VICTIM_POLICIES,
    ByteTokenizer,
    CostModel,
    Engine,
    FlowEvent,
    FlowStats,
    PageAllocator,
    Request,
    RequestFlow,
    SchedRequest,
    Scheduler,
    ServeReport,
    StepRecord,
    StopConditions,
    TinyLlama,
    TinyLlamaConfig,
    model_runner,
)
from .storage import (
    BaseKVCache,
    DistributedInfo,
    KVCacheLayout,
    MHAKVCache,
    create_kvcache,
    divide_even,
    get_tp_info,
    reset_tp_info,
    set_tp_info,
    try_get_tp_info,
)
from .system import (
    MEDIA,
    NVLINK_C2C,
    PCIE4_X16,
    PCIE5_X16,
    ROUTING_POLICIES,
    TIER_POLICIES,
    DiskKVStore,
    DiskStats,
    HostKVPool,
    HostLink,
    PrefixMirror,
    PublicPrefixCache,
    Router,
    RouterReport,
    TenantJob,
    TieredCacheManager,
    TieredPrefixMirror,
    TierEvent,
    TierStats,
    multi_tenant,
    poisson_arrivals,
    replay_tenants,
)

if TYPE_CHECKING:
    from .examples.tp_attention import TPConfig, TPResult, run_single_process, run_tp_attention
    from .viz import (
        Explorer,
        StepPlayer,
        TreeRecorder,
        draw_sequence,
        draw_tree,
        predict_evict,
        snapshot,
        step_player,
        tree_text,
    )

#: Names loaded on first access, and the module that holds each.
_LAZY = {
    **{
        name: "kvcache.viz"
        for name in (
            "Explorer",
            "StepPlayer",
            "step_player",
            "TreeRecorder",
            "draw_tree",
            "draw_sequence",
            "tree_text",
            "snapshot",
            "predict_evict",
        )
    },
    **{
        name: "kvcache.examples.tp_attention"
        for name in (
            "TPConfig",
            "TPResult",
            "run_tp_attention",
            "run_single_process",
        )
    },
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvcache' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "BaseKVCache",
    "KVCacheLayout",
    "BaseCacheHandle",
    "SizeInfo",
    "BaseCacheManager",
    "InsertResult",
    "MHAKVCache",
    "NaiveCacheHandle",
    "NaiveCacheManager",
    "RadixTreeNode",
    "Walk",
    "RadixCacheHandle",
    "RadixCacheManager",
    "BlockHashCacheManager",
    "BlockHashCacheHandle",
    "CachedBlock",
    "EVICTION_POLICIES",
    "register_eviction_policy",
    "SUPPORTED_CACHE_MANAGER",
    "create_cache_manager",
    "create_kvcache",
    "CacheManagerFactory",
    "Registry",
    "RegistryError",
    "BlockStored",
    "BlockRemoved",
    "AllCleared",
    "CacheEvent",
    "PageAllocator",
    "RequestFlow",
    "Request",
    "FlowStats",
    "FlowEvent",
    "store_cache",
    "store_cache_backend",
    "store_cache_torch",
    "store_cache_triton",
    "paged_attention",
    "paged_decode_attention",
    "paged_decode_backend",
    "gather_kv",
    "TPConfig",
    "TPResult",
    "run_tp_attention",
    "run_single_process",
    "TinyLlama",
    "TinyLlamaConfig",
    "Engine",
    "ByteTokenizer",
    "Scheduler",
    "SchedRequest",
    "StepRecord",
    "model_runner",
    "StopConditions",
    "STOP_REASONS",
    "ADMISSION_POLICIES",
    "VICTIM_POLICIES",
    "CostModel",
    "LLAMA3_8B_H100",
    "ServeReport",
    "Router",
    "RouterReport",
    "ROUTING_POLICIES",
    "PrefixMirror",
    "poisson_arrivals",
    "PublicPrefixCache",
    "TenantJob",
    "multi_tenant",
    "replay_tenants",
    "TieredCacheManager",
    "TierStats",
    "TIER_POLICIES",
    "DiskKVStore",
    "DiskStats",
    "TierEvent",
    "TieredPrefixMirror",
    "MEDIA",
    "HostKVPool",
    "HostLink",
    "PCIE4_X16",
    "PCIE5_X16",
    "NVLINK_C2C",
    "Explorer",
    "StepPlayer",
    "step_player",
    "TreeRecorder",
    "draw_tree",
    "draw_sequence",
    "tree_text",
    "snapshot",
    "predict_evict",
    "DistributedInfo",
    "set_tp_info",
    "get_tp_info",
    "try_get_tp_info",
    "reset_tp_info",
    "divide_even",
]
