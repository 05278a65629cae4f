"""The serving layer: requests on top of a pool and a manager.

`PageAllocator` (the free list of pages), `RequestFlow` (the seven steps of a request for any
manager, with `check_integrity` over pages), `TinyLlama` and `Engine` (a model whose K/V live
only in the pool), the `Scheduler` that serves many requests at once (continuous batching,
chunked prefill, preemption, FCFS/LPM admission) with its `CostModel`, the `ByteTokenizer`,
seeded `workloads`, the `Router` that spreads requests over replicas, cache-aware through a
`PrefixMirror` of each replica fed by its cache events, and the host-memory tier
(`TieredCacheManager`: evicted prefixes move to a `HostKVPool` and load back on a match;
`HostLink` names the copy bandwidth).
"""

from .allocator import PageAllocator
from .cost_model import LLAMA3_8B_H100, CostModel, ServeReport
from .engine import Engine
from .host_pool import NVLINK_C2C, PCIE4_X16, PCIE5_X16, HostKVPool, HostLink
from .host_tier import TIER_POLICIES, TieredCacheManager, TierStats
from .model import TinyLlama, TinyLlamaConfig
from .prefix_mirror import PrefixMirror
from .request_flow import FlowEvent, FlowStats, Request, RequestFlow
from .router import ROUTING_POLICIES, Router, RouterReport, poisson_arrivals
from .scheduler import SchedRequest, Scheduler, StepRecord, model_runner
from .tokenizer import ByteTokenizer

__all__ = [
    "PageAllocator",
    "RequestFlow",
    "Request",
    "FlowStats",
    "FlowEvent",
    "TinyLlama",
    "TinyLlamaConfig",
    "Engine",
    "ByteTokenizer",
    "Scheduler",
    "SchedRequest",
    "StepRecord",
    "model_runner",
    "CostModel",
    "LLAMA3_8B_H100",
    "ServeReport",
    "Router",
    "RouterReport",
    "ROUTING_POLICIES",
    "PrefixMirror",
    "poisson_arrivals",
    "TieredCacheManager",
    "TierStats",
    "TIER_POLICIES",
    "HostKVPool",
    "HostLink",
    "PCIE4_X16",
    "PCIE5_X16",
    "NVLINK_C2C",
]
