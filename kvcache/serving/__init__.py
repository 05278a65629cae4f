"""The serving layer: requests on top of a pool and a manager.

`PageAllocator` (the free list of pages), `RequestFlow` (the seven steps of a request for any
manager, with `check_integrity` over pages), `TinyLlama` and `Engine` (a model whose K/V live
only in the pool), the `Scheduler` that serves many requests at once (continuous batching,
chunked prefill, preemption, FCFS/LPM/DFS-weight/priority admission, `StopConditions`) with its
`CostModel`, the `ByteTokenizer`,
and seeded `workloads`. What a server adds around one cache (the host-memory tier, the router
over replicas, tenancy) is the layer above, `kvcache.system`.
"""

from .admission import ADMISSION_POLICIES
from .allocator import PageAllocator
from .cost_model import LLAMA3_8B_H100, CostModel, ServeReport
from .engine import Engine
from .model import TinyLlama, TinyLlamaConfig
from .request_flow import FlowEvent, FlowStats, Request, RequestFlow
from .runner import model_runner
from .sched_records import SchedRequest, StepRecord
from .scheduler import VICTIM_POLICIES, Scheduler
from .stop import STOP_REASONS, StopConditions
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
    "StopConditions",
    "STOP_REASONS",
    "ADMISSION_POLICIES",
    "VICTIM_POLICIES",
    "CostModel",
    "LLAMA3_8B_H100",
    "ServeReport",
]
