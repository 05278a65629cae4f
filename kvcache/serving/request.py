"""A running `Request`, the flow's `FlowStats` and its step events (`FlowEvent`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch

from ..managers.base import BaseCacheHandle

__all__ = ["Request", "FlowStats", "FlowEvent", "Tracer"]


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
