"""A running `Request`, the flow's `FlowStats` and its step events (`FlowEvent`)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch

from .._validate import check_token_ids
from ..managers.base import TOKEN_DTYPES, BaseCacheHandle

__all__ = ["Request", "FlowStats", "FlowEvent", "Tracer", "HostCopy", "keyed", "host_ids"]

_I64 = np.dtype(np.int64)
_I32 = np.dtype(np.int32)
_empty = np.empty


def host_ids(input_ids: torch.Tensor, name: str = "input_ids") -> np.ndarray:
    """``input_ids`` checked as `check_token_ids` checks (same errors), seen as NumPy (a view):
    one ``numpy()`` call and two attribute reads where the tensor checks take four calls."""
    try:
        ids = input_ids.numpy()  # only a CPU tensor gets past here
    except (AttributeError, TypeError, RuntimeError):
        ids = None
    if ids is None or ids.ndim != 1 or (ids.dtype is not _I64 and ids.dtype not in TOKEN_DTYPES):
        check_token_ids(input_ids, name)  # raises with the standard message
        raise TypeError(f"{name} must be a 1-D integer tensor on the CPU, got {input_ids!r:.80}")
    return ids


T = TypeVar("T")


class Request:
    """A running request's view of the cache.

    ``input_ids`` (CPU int64, shape ``(L,)``) are all its tokens so far and ``indices`` (int32 on
    the pool's device, shape ``(L,)``) their KV slots. ``indices[:tree_len]`` are the tree's,
    locked through ``handle``; the rest are the request's own. ``num_computed`` tokens already
    have K/V stored; ``out_loc`` are the slots still to fill.

    Both live on the host in ``host`` (a `HostCopy`, which `RequestFlow` computes with); the
    tensors are views of it made on first read (on the CPU they share its memory, so a write
    through ``request.indices`` is a write to the request; on a GPU ``indices`` is a device copy).
    Assigning ``input_ids`` or ``indices`` replaces the host copy (same length as the other).
    """

    __slots__ = (
        "_views",
        "device",
        "extra_key",
        "finished",
        "handle",
        "host",
        "num_computed",
        "reused_len",
        "rid",
    )
    rid: int
    handle: BaseCacheHandle
    reused_len: int
    num_computed: int
    finished: bool
    device: torch.device
    host: HostCopy
    #: The namespace the request matched in and inserts into (``RequestFlow.begin``'s key).
    extra_key: Hashable
    #: The tensors last made, with the host copy and length they were made of (None: none yet).
    _views: tuple[HostCopy, int, torch.Tensor, torch.Tensor] | None

    def __init__(
        self,
        rid: int,
        input_ids: torch.Tensor,
        indices: torch.Tensor,
        handle: BaseCacheHandle,
        reused_len: int,
        num_computed: int,
        finished: bool = False,
    ) -> None:
        if input_ids.shape != indices.shape:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and indices {tuple(indices.shape)} differ in shape"
            )
        self.rid, self.handle, self.reused_len, self.num_computed, self.finished = (
            rid,
            handle,
            reused_len,
            num_computed,
            finished,
        )
        self.device = indices.device
        self.host = HostCopy(input_ids.numpy(), indices.cpu().numpy())
        self._views = None
        self.extra_key = None

    @classmethod
    def from_host(
        cls,
        rid: int,
        host: HostCopy,
        handle: BaseCacheHandle,
        reused_len: int,
        device: torch.device,
        extra_key: Hashable = None,
    ) -> Request:
        """A request over ``host`` (taken as it is, not copied), ``num_computed = reused_len``."""
        req = cls.__new__(cls)
        req.rid = rid
        req.handle = handle
        req.reused_len = req.num_computed = reused_len
        req.finished = False
        req.device = device
        req.host = host
        req.extra_key = extra_key
        req._views = None
        return req

    def _tensors(self) -> tuple[HostCopy, int, torch.Tensor, torch.Tensor]:
        h = self.host
        views = self._views
        if views is None or views[0] is not h or views[1] != h.length:
            n = h.length
            slots = torch.from_numpy(h.slots[:n])
            views = self._views = (
                h,
                n,
                torch.from_numpy(h.ids[:n]),
                slots if self.device.type == "cpu" else slots.to(self.device),
            )
        return views

    @property
    def input_ids(self) -> torch.Tensor:
        return self._tensors()[2]

    @input_ids.setter
    def input_ids(self, value: torch.Tensor) -> None:
        self.host = HostCopy(value.numpy(), self.host.slots[: self.host.length])

    @property
    def indices(self) -> torch.Tensor:
        return self._tensors()[3]

    @indices.setter
    def indices(self, value: torch.Tensor) -> None:
        self.host = HostCopy(self.host.ids[: self.host.length], value.cpu().numpy())

    @property
    def tree_len(self) -> int:
        return self.handle.cached_len

    @property
    def out_loc(self) -> torch.Tensor:
        """Slots whose K/V the model must still store, in token order."""
        return self.indices[self.num_computed :]

    def __len__(self) -> int:
        return self.host.length

    def __repr__(self) -> str:
        return (
            f"Request(rid={self.rid}, len={len(self)}, tree_len={self.tree_len}, "
            f"num_computed={self.num_computed}, finished={self.finished})"
        )


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

    def count_request(self, prompt_tokens: int, reused_tokens: int) -> None:
        """Count a request that begins with ``prompt_tokens``, ``reused_tokens`` of them cached."""
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        self.reused_tokens += reused_tokens

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

    sink: Callable[[FlowEvent], None] | None = None
    events: list[FlowEvent] = field(default_factory=list)

    def __call__(self, rid: int, step: int, name: str, detail: str) -> None:
        event = FlowEvent(rid, step, name, detail)
        self.events.append(event)
        if self.sink is not None:
            self.sink(event)


class HostCopy:
    """The host-side copy of one request's token ids and slots, in NumPy.

    ``ids[:length]`` (int64) and ``slots[:length]`` (int32) keep spare capacity, so appending
    ``k`` tokens costs O(k) and no torch op; `RequestFlow` computes with these arrays, and a
    `Request` shows them as tensors. ``slots[length:filled]`` (``filled >= length``) are slots
    already known past the end: the rest of the request's last page, which the flow writes when
    it takes the page, so that the tokens that fill it later cost no work.
    """

    __slots__ = ("filled", "ids", "length", "slots")
    ids: np.ndarray
    slots: np.ndarray
    length: int
    filled: int

    def __init__(
        self, ids: np.ndarray, slots: np.ndarray, prefix: np.ndarray | None = None
    ) -> None:
        """Copies of ``ids`` and their slots: ``prefix`` (if given) then ``slots``, as many as ids."""
        n = ids.shape[0]
        cap = n + 16 + (n >> 2)
        self.ids = np.empty(cap, dtype=np.int64)
        self.slots = np.empty(cap, dtype=np.int32)
        self.ids[:n] = ids
        if prefix is None:
            if slots.shape[0] != n:
                raise ValueError(f"{n} ids but {slots.shape[0]} slots")
            self.slots[:n] = slots
        else:
            m = prefix.shape[0]
            if m + slots.shape[0] != n:
                raise ValueError(f"{n} ids but {m + slots.shape[0]} slots")
            self.slots[:m] = prefix
            self.slots[m:n] = slots
        self.length = self.filled = n

    @classmethod
    def with_room(cls, n: int, page_size: int = 1) -> HostCopy:
        """An empty copy (``length == filled == 0``) with room for ``n`` tokens and then some,
        at least ``n`` rounded up to whole pages of ``page_size``."""
        h = cls.__new__(cls)
        cap = n + 16 + (n >> 2) + page_size
        h.ids = _empty(cap, _I64)  # dtypes as objects, passed by position: the fastest call
        h.slots = _empty(cap, _I32)
        h.length = h.filled = 0
        return h

    def reserve(self, k: int) -> None:
        """Make room for ``k`` more tokens past ``length`` (doubling), keeping the contents
        (the known slots past ``length`` too)."""
        n = self.length
        if n + k > self.ids.shape[0]:
            cap = max(2 * self.ids.shape[0], n + k)
            grown_ids, grown_slots = np.empty(cap, dtype=np.int64), np.empty(cap, dtype=np.int32)
            grown_ids[:n], grown_slots[: self.filled] = self.ids[:n], self.slots[: self.filled]
            self.ids, self.slots = grown_ids, grown_slots

    def append(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Append ``ids`` and their ``slots`` (same length)."""
        n, k = self.length, ids.shape[0]
        self.reserve(k)
        self.ids[n : n + k] = ids
        self.slots[n : n + k] = slots
        self.length = self.filled = n + k


def keyed(method: Callable[..., T], extra_key: Hashable, *args: Any) -> T:
    """``method(*args, extra_key)``, or ``method(*args)`` for the ``None`` key, so that a manager
    written before namespaces (no ``extra_key`` parameter) still serves the default one."""
    return method(*args) if extra_key is None else method(*args, extra_key)
