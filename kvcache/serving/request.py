"""A running `Request`, the flow's `FlowStats` and its step events (`FlowEvent`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional

import numpy as np
import torch

from ..managers.base import BaseCacheHandle

__all__ = ["Request", "FlowStats", "FlowEvent", "Tracer", "HostCopy"]


@dataclass
class Request:
    """A running request's view of the cache.

    ``input_ids`` (CPU int64, shape ``(L,)``) are all its tokens so far and ``indices`` (int32 on
    the pool's device, shape ``(L,)``) their KV slots. ``indices[:tree_len]`` are the tree's,
    locked through ``handle``; the rest are the request's own. ``num_computed`` tokens already
    have K/V stored; ``out_loc`` are the slots still to fill.
    """

    rid: int
    input_ids: torch.Tensor
    indices: torch.Tensor
    handle: BaseCacheHandle
    reused_len: int
    num_computed: int
    finished: bool = False

    @property
    def tree_len(self) -> int:
        return self.handle.cached_len

    @property
    def out_loc(self) -> torch.Tensor:
        """Slots whose K/V the model must still store, in token order."""
        return self.indices[self.num_computed:]

    def __len__(self) -> int:
        return self.input_ids.shape[0]


@dataclass
class FlowStats:
    """Token counts over the flow's life (``computed = prompt + decoded - reused``).

    A request counts from `RequestFlow.begin` on, whether it is later finished or aborted.
    """

    requests: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    decoded_tokens: int = 0
    evicted_tokens: int = 0
    evictions: int = 0

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens + self.decoded_tokens - self.reused_tokens

    @property
    def hit_rate(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True)
class FlowEvent:
    """One step taken for a request, as the source document numbers them (0: not one of the seven)."""

    rid: int
    step: int
    name: str
    detail: str


@dataclass
class Tracer:
    """Keeps the events of a traced flow and passes each to ``sink``."""

    sink: Optional[Callable[[FlowEvent], None]] = None
    events: List[FlowEvent] = field(default_factory=list)

    def __call__(self, rid: int, step: int, name: str, detail: str) -> None:
        event = FlowEvent(rid, step, name, detail)
        self.events.append(event)
        if self.sink is not None:
            self.sink(event)


class HostCopy:
    """`RequestFlow`'s host-side copy of one running request: token ids and slots in NumPy.

    ``ids[:length]`` (int64) and ``slots[:length]`` (int32) keep spare capacity, so appending
    ``k`` tokens costs O(k) and no torch op. The flow computes with these arrays and publishes
    torch views of them as the request's ``input_ids`` and ``indices`` (``ids_t``/``slots_t``:
    the tensors last published; on the CPU they share memory with the arrays, so an in-place
    write through ``request.indices`` is seen here too).
    """

    __slots__ = ("ids", "slots", "length", "ids_t", "slots_t")

    def __init__(self, ids: np.ndarray, *slots: np.ndarray) -> None:
        """Copies of ``ids`` and of the ``slots`` arrays laid end to end (as many slots as ids)."""
        n = ids.shape[0]
        cap = n + max(16, n // 2)
        self.ids = np.empty(cap, dtype=np.int64)
        self.slots = np.empty(cap, dtype=np.int32)
        self.ids[:n] = ids
        if len(slots) == 1:
            self.slots[:n] = slots[0]
        else:
            np.concatenate(slots, out=self.slots[:n])
        self.length = n
        self.ids_t: Optional[torch.Tensor] = None
        self.slots_t: Optional[torch.Tensor] = None

    def append(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Append ``ids`` and their ``slots`` (same length), growing the arrays by doubling."""
        n, k = self.length, ids.shape[0]
        if n + k > self.ids.shape[0]:
            cap = max(2 * self.ids.shape[0], n + k)
            self.ids = np.concatenate([self.ids[:n], np.empty(cap - n, dtype=np.int64)])
            self.slots = np.concatenate([self.slots[:n], np.empty(cap - n, dtype=np.int32)])
        self.ids[n:n + k] = ids
        self.slots[n:n + k] = slots
        self.length = n + k
