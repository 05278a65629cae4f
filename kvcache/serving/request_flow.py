"""`RequestFlow`: carries requests through the seven steps of the cache's life, for any manager,
with the running `Request`, the flow's `FlowStats` and its step events (`FlowEvent`). It is
long because it is one concept read top to bottom: the request and the flow that owns it, each
step on one path with its all-or-nothing order spelled out beside it.

    begin(ids)   1. match_prefix + 2. lock_handle    one manager call: match_and_lock
                 3. allocate the pages the prefix lacks (evicting first if the free list is short)
    (caller)     6. store K/V of the new tokens at ``request.out_loc``, then mark_computed
    extend(req)  append tokens (decode), taking a page when the last one is full
    cache(req)   4. insert what is computed so far and keep running: the lock moves to it
    finish(req)  4. insert_prefix + 7. unlock         one manager call: insert_and_unlock
                 5. free the request's duplicate pages and its partial last page
    abort(req)   unlock, free the request's own pages

Ownership is the point. Every page is at every moment exactly one of: free (in the allocator),
cached (held by the manager), or held by one running request. For a request of ``L`` tokens
whose handle covers ``T`` (``tree_len``), inserting its first ``N`` tokens (whole pages) into a
cache that already held ``C`` of them:

    [0, T)   the tree's: matched at begin (or at the last cache), protected by the request's lock
    [T, L)   the request's own: allocated for it, freed by abort
    then, when it inserts:
    [T, C)   own duplicates: another request inserted these tokens first; freed
    [C, N)   inserted: the tree's from now on
    [N, L)   the partial last page: freed by finish, kept by cache (the request goes on)

`cache` leaves the request reading the tree's slots for ``[0, C)`` and locking the new handle,
so ``indices[:tree_len]`` are always the tree's. The source document frees
``indices[:already_cached]`` after inserting; ``[0, T)`` are the tree's, and freeing them
corrupts the cache. `check_integrity` proves the partition.

All or nothing, whatever a call raises (``KeyboardInterrupt`` too): the manager, the
allocator or the ``on_event`` consumer. Every public method checks and reads first, then makes
its changes in an order where a failure can be undone:

- begin, begin_batch, extend, extend_batch: the lock (``match_and_lock``), then an eviction if
  the free list is short (its pages go to the allocator, a call made again if it raises), then
  the allocation, after which nothing can fail. A failure releases the lock and leaves
  everything as it was, but for the match's LRU refresh and an eviction made first (its
  prefixes are gone, their pages free).
- cache, finish, abort, reset_prefix_cache: the manager's change first (the insert, the
  unlock, the reset), which cannot be undone; what must follow it (giving the pages it
  released to the allocator, reading the tree's slots for a request that moved) is made once
  more if it raises, so the step is whole; then the error propagates. Nothing is ever lost or
  owned twice.
- Events are made and sent only once the call has applied (the consumer sees the state after
  the whole call). If the consumer raises, the call stands, its events are all in ``events``
  (the later ones not sent) and the error propagates; if making them raises (a read for their
  text), the call stands and reports none.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .._validate import (
    aligned_run_pages,
    as_list,
    check_int_in,
    reject_one_tensor,
    slot_array,
    token_ids,
)
from ..managers.base import BaseCacheHandle, BaseCacheManager, InsertResult
from ..managers.cache_events import check_extra_key
from .allocator import PageAllocator

__all__ = ["Request", "FlowStats", "FlowEvent", "RequestFlow", "check_manager"]

_CPU = torch.device("cpu")
# The arrays of a request with no tokens yet (no room: the first write makes its own).
_NO_IDS = np.empty(0, dtype=np.int64)
_NO_SLOTS = np.empty(0, dtype=np.int32)


class Request:
    """A running request's view of the cache.

    ``input_ids`` (CPU int64, shape ``(L,)``) are all its tokens so far and ``indices`` (int32 on
    the pool's device, shape ``(L,)``) their KV slots. ``indices[:tree_len]`` are the tree's,
    locked through ``handle``; the rest are the request's own. ``num_computed`` tokens already
    have K/V stored; ``out_loc`` are the slots still to fill.

    Both live on the host in NumPy arrays with room to grow, which `RequestFlow` computes with;
    the tensors are views of them made on first read (on the CPU they share their memory, so a
    write through ``request.indices`` is a write to the request; on a GPU ``indices`` is a device
    copy). Assigning ``input_ids`` or ``indices`` replaces them (same length as the other).
    """

    __slots__ = (
        "_filled",
        "_ids",
        "_len",
        "_on_cpu",
        "_slots",
        "_views",
        "device",
        "extra_key",
        "finished",
        "handle",
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
    #: The namespace the request matched in and inserts into (``RequestFlow.begin``'s key).
    extra_key: Hashable
    # The host arrays: ids[:len] and slots[:len] are the request's; slots[len:filled] are slots
    # already known past its end (the rest of its last page), so tokens filling it cost nothing.
    _ids: np.ndarray
    _slots: np.ndarray
    _len: int
    _filled: int
    #: The tensors last made, with the length they were made at (None: none yet).
    _views: tuple[int, torch.Tensor, torch.Tensor] | None

    def __init__(
        self,
        rid: int,
        input_ids: torch.Tensor | None,
        indices: torch.Tensor | None,
        handle: BaseCacheHandle,
        reused_len: int,
        num_computed: int,
        finished: bool = False,
    ) -> None:
        """A request over copies of ``input_ids`` and ``indices`` (the same shape; `token_ids`
        and `slot_array` check them). `RequestFlow` passes None for both: it writes the tokens
        and slots of the requests it begins itself, with no tensor in between."""
        self.rid = rid
        self.handle = handle
        self.reused_len = reused_len
        self.num_computed = num_computed
        self.finished = finished
        self.extra_key = None
        self._views = None
        if input_ids is None and indices is None:
            self.device, self._on_cpu = _CPU, True
            self._ids, self._slots, self._len, self._filled = _NO_IDS, _NO_SLOTS, 0, 0
            return
        if input_ids is None or indices is None:
            raise TypeError("input_ids and indices must both be tensors, or both None")
        if input_ids.shape != indices.shape:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and indices {tuple(indices.shape)} differ in shape"
            )
        self.device = indices.device
        self._on_cpu = self.device.type == "cpu"  # asked by every `_tensors`: kept as a bool
        self._hold(token_ids(input_ids), slot_array(indices, indices.device))

    def _hold(self, ids: np.ndarray, slots: np.ndarray, room: int = 0) -> None:
        """Copies of ``ids`` and ``slots`` (as many), with room to grow: for ``room`` entries in
        all, or a quarter more than given."""
        n = ids.shape[0]
        if slots.shape[0] != n:
            raise ValueError(f"{n} ids but {slots.shape[0]} slots")
        cap = max(room, n + 16 + (n >> 2))
        self._ids = np.empty(cap, dtype=np.int64)
        self._slots = np.empty(cap, dtype=np.int32)
        self._ids[:n] = ids
        self._slots[:n] = slots
        self._len = self._filled = n
        self._views = None

    def _reserve(self, size: int) -> None:
        """Room for ``size`` entries in all (doubling), keeping the ids and the known slots."""
        if size > self._ids.shape[0]:
            cap = max(2 * self._ids.shape[0], size)
            ids, slots = np.empty(cap, dtype=np.int64), np.empty(cap, dtype=np.int32)
            ids[: self._len] = self._ids[: self._len]
            slots[: self._filled] = self._slots[: self._filled]
            self._ids, self._slots, self._views = ids, slots, None

    def _tensors(self) -> tuple[int, torch.Tensor, torch.Tensor]:
        views = self._views
        n = self._len
        if views is None or views[0] != n:
            slots = torch.from_numpy(self._slots[:n])
            views = self._views = (
                n,
                torch.from_numpy(self._ids[:n]),
                slots if self._on_cpu else slots.to(self.device),
            )
        return views

    @property
    def input_ids(self) -> torch.Tensor:
        return self._tensors()[1]

    @input_ids.setter
    def input_ids(self, value: torch.Tensor) -> None:
        self._hold(value.numpy(), self._slots[: self._len])

    @property
    def indices(self) -> torch.Tensor:
        return self._tensors()[2]

    @indices.setter
    def indices(self, value: torch.Tensor) -> None:
        self._hold(self._ids[: self._len], value.cpu().numpy())

    @property
    def tree_len(self) -> int:
        return self.handle.cached_len

    @property
    def out_loc(self) -> torch.Tensor:
        """Slots whose K/V the model must still store, in token order."""
        return self.indices[self.num_computed :]

    def __len__(self) -> int:
        return self._len

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


# What the flow calls on a manager: a BaseCacheManager has all of it; a wrapper that forwards to
# one (a timer, a recorder) may instead provide it by delegation.
_MANAGER_API = (
    "match_and_lock",
    "insert_and_unlock",
    "lock_handle",
    "evict",
    "reset",
    "size_info",
    "check_integrity",
    "cached_indices",
    "handle_indices",
    "page_size",
    "device",
)


def check_manager(manager: object, name: str = "manager") -> None:
    """``TypeError`` unless ``manager`` is a `BaseCacheManager` or forwards the calls the flow
    makes on one."""
    if isinstance(manager, BaseCacheManager):
        return
    missing = [a for a in _MANAGER_API if not hasattr(manager, a)]
    if missing:
        raise TypeError(
            f"{name} must be a BaseCacheManager, got {type(manager).__name__} (lacking {', '.join(missing)})"
        )


def _complete(call: Callable[..., object], *args: object) -> BaseException | None:
    """``call(*args)``, which a step makes after a manager change it cannot undo (an eviction,
    an insert, an unlock). If it raises (anything, ``KeyboardInterrupt`` too), it is made once
    more, so that the step is whole: the pages the change released reach the allocator, a
    request the change moved reads its new prefix. Such a call changes nothing when it raises,
    so making it again is safe. Returns what interrupted it (None: nothing), for the step to
    raise once it is done."""
    try:
        call(*args)
    except BaseException as e:
        call(*args)
        return e
    return None


def _inserted(
    insert_and_unlock: Callable[..., InsertResult], *args: object, **kwargs: object
) -> tuple[InsertResult, BaseException | None]:
    """The manager's ``insert_and_unlock(*args, **kwargs)`` and what interrupted it after its
    insert: a manager completes a call interrupted past its insert and raises with the result
    attached (``insert_result``); the step then completes too and raises at its end."""
    try:
        return insert_and_unlock(*args, **kwargs), None
    except BaseException as e:
        res = getattr(e, "insert_result", None)
        if not isinstance(res, InsertResult):
            raise  # nothing changed
        return res, e


class RequestFlow:
    """Drives a `BaseCacheManager` and a `PageAllocator` through the life of requests.

    Args:
        manager: any prefix-cache manager (naive, radix, block-hash, ...).
        allocator: the page free list; same ``page_size`` and ``device`` as the manager's.
        trace: keep a `FlowEvent` for every step in ``events``.
        on_event: optional callback receiving each `FlowEvent` (kept in ``events`` too), once
            the call that took the step has applied.

    Every public method does all it promises or raises and changes nothing (a match's LRU
    refresh and an eviction made before the failure aside); see the module docstring.
    """

    def __init__(
        self,
        manager: BaseCacheManager,
        allocator: PageAllocator,
        *,
        trace: bool = False,
        on_event: Callable[[FlowEvent], None] | None = None,
    ) -> None:
        check_manager(manager)
        if not isinstance(allocator, PageAllocator):
            raise TypeError(f"allocator must be a PageAllocator, got {type(allocator).__name__}")
        if on_event is not None and not callable(on_event):
            raise TypeError(f"on_event must be callable or None, got {type(on_event).__name__}")
        if manager.page_size != allocator.page_size:
            raise ValueError(
                f"manager page_size {manager.page_size} != allocator page_size {allocator.page_size}"
            )
        if torch.device(manager.device) != allocator.device:
            raise ValueError(
                f"manager device {manager.device} != allocator device {allocator.device}"
            )
        if isinstance(manager, BaseCacheManager):
            manager.check_parts(allocator=allocator)  # a host tier: the pages it was built on
        self.manager = manager
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.running: dict[int, Request] = {}
        self.stats = FlowStats()
        self._device = allocator.device
        self._on_cpu = allocator.device.type == "cpu"
        self._on_event = on_event
        # The events of a traced flow (trace, or a consumer) so far; None: not traced, so no
        # call makes any (each call collects its own, and keeps them here once it has applied).
        self._events: list[FlowEvent] | None = [] if trace or on_event is not None else None
        self._next_rid = 0
        self._steps = np.arange(1, self.page_size, dtype=np.int32)  # a page's slot offsets

    @property
    def events(self) -> list[FlowEvent]:
        return self._events if self._events is not None else []

    def _report(self, notes: list[FlowEvent]) -> None:
        """Keep the events of a call that has applied, then send them to the consumer (if it
        raises, the later events are not sent; they are kept all the same)."""
        if self._events is not None:
            self._events.extend(notes)
        if self._on_event is not None:
            for event in notes:
                self._on_event(event)

    def _done(
        self,
        interrupted: BaseException | None,
        events: Callable[..., list[FlowEvent]],
        *args: object,
    ) -> None:
        """The end of a call whose changes are all made: in a traced flow its events, made by
        ``events(*args)``, reported (none if making them raises); then what interrupted a call
        it completed (`_complete`) raised, if anything did."""
        try:
            if self._events is not None:
                self._report(events(*args))
        finally:
            if interrupted is not None:
                raise interrupted

    # ------------------------------------------------------------ pages
    def available_pages(self) -> int:
        """Pages that could be handed out now: free ones plus those eviction could free."""
        return (
            self.allocator.num_free_pages + self.manager.size_info.evictable_size // self.page_size
        )

    def pages_needed(self, req: Request, num_new_tokens: int) -> int:
        """New pages `extend` takes to append ``num_new_tokens`` to ``req``: the last page's free
        slots are filled first."""
        self._get(req)
        k = check_int_in(num_new_tokens, "num_new_tokens", 0, 2**62)
        ps = self.page_size
        rest = k - min(k, -len(req) % ps)
        return -(-rest // ps)

    def _room(self, req: Request, k: int) -> tuple[int, int]:
        """Make ``req``'s arrays hold ``k`` more tokens, and work out where their slots come from:
        ``(filled, pages)``, the slots known past its end (the rest of its last page) and the new
        pages the rest needs, whose slots go at ``filled``. Changes nothing anyone can see: the
        room and the known slots past the end are the request's own business."""
        n, filled, ps = req._len, req._filled, self.page_size
        end = n + k
        if end <= filled:
            return filled, 0
        known = filled
        if filled == n and n % ps:  # the rest of the last page, not written yet
            known = n - n % ps + ps
        pages = -(-(end - known) // ps)
        if known + pages * ps > req._ids.shape[0]:
            req._reserve(known + pages * ps)
        if known > filled:
            np.add(self._steps[: known - n], req._slots[n - 1], out=req._slots[n:known])
            req._filled = known
        return known, pages

    def _make_room(self, rid: int, pages: int, notes: list[FlowEvent] | None) -> None:
        """Step 3's eviction, for a caller about to take ``pages`` pages (more than are free):
        evict the pages the free list lacks and give them to the allocator. ``RuntimeError``
        when the pool cannot hold them; an eviction made before a failure stands (its pages
        are free). The caller then allocates (`allocate_page_slots`), which cannot fail."""
        free = self.allocator.num_free_pages
        ps = self.page_size
        evictable = self.manager.size_info.evictable_size // ps
        short = pages - free
        if short > evictable:
            raise RuntimeError(
                f"out of KV pages: need {pages}, {free} free and {evictable} evictable"
            )
        # A manager evicts what the flow inserted: whole pages, page after page.
        evicted = self.manager.evict(short * ps)
        count = evicted.shape[0]  # len() of a tensor costs several times more
        self.stats.evicted_tokens += count
        self.stats.evictions += 1
        interrupted = _complete(self.allocator.free_page_runs, evicted)
        if interrupted is not None:  # the pages are free: the caller undoes its own part
            raise interrupted
        if notes is not None:
            notes.append(
                FlowEvent(
                    rid,
                    3,
                    "evict",
                    f"evicted {count} cached tokens to free {short} pages",
                )
            )

    def _allocated(self, notes: list[FlowEvent], rid: int, slots: np.ndarray) -> None:
        pages = aligned_run_pages(slots, self.page_size).tolist()
        notes.append(FlowEvent(rid, 3, "allocate", f"pages {pages}"))

    def _get(self, req: Request) -> Request:
        try:  # the common case first: one dict probe (only a Request is ever in ``running``)
            if self.running.get(req.rid) is req and not req.finished:
                return req
        except (AttributeError, TypeError):
            pass
        if not isinstance(req, Request):
            raise TypeError(f"expected a Request, got {type(req).__name__}")
        if req.finished or self.running.get(req.rid) is not req:
            raise RuntimeError(f"request {req.rid} is not running in this flow")
        return req

    def is_running(self, req: Request) -> bool:
        """Whether ``req`` is a request running in this flow (begun, not finished or aborted)."""
        return isinstance(req, Request) and not req.finished and self.running.get(req.rid) is req

    def _host(self, slots: torch.Tensor) -> np.ndarray:
        """Slots a manager returned, on the host (on the CPU, a view). Taken as they come (a
        manager written against int64 slots still works: they are copied into int32 arrays)."""
        return slots.numpy() if self._on_cpu else slots.cpu().numpy()

    def _tensor(self, arr: np.ndarray) -> torch.Tensor:
        """Host slots as a tensor on the pool's device (on the CPU, a view)."""
        out = torch.from_numpy(arr)
        return out if self._on_cpu else out.to(self._device)

    # ------------------------------------------------------------ steps
    def _match(
        self,
        rid: int,
        ids: np.ndarray,
        compute_last: bool,
        key: Hashable,
        notes: list[FlowEvent] | None,
    ) -> Request:
        """Steps 1 and 2 for one prompt: the request over its cached prefix, locked (not yet
        running, no page taken). ``notes`` get the two steps' events."""
        query = ids[:-1] if compute_last else ids
        handle, prefix = self.manager.match_and_lock(torch.from_numpy(query), key)
        try:
            m = handle.cached_len
            req = Request(rid, None, None, handle, m, m)
            req.device, req.extra_key = self._device, key
            # Room for the whole prompt and the rest of its last page: no copy later.
            req._hold(ids[:m], self._host(prefix), ids.shape[0] + self.page_size)
            if notes is not None:
                notes.append(
                    FlowEvent(rid, 1, "match_prefix", f"cached_len={m} indices={prefix.tolist()}")
                )
                protected = self.manager.size_info.protected_size
                notes.append(FlowEvent(rid, 2, "lock_handle", f"protected={protected}"))
        except BaseException:
            self.manager.lock_handle(handle, unlock=True)
            raise
        return req

    def begin(
        self, input_ids: torch.Tensor, *, compute_last: bool = False, extra_key: Hashable = None
    ) -> Request:
        """Steps 1-3: match the longest cached prefix, lock it, allocate pages for the rest.

        ``extra_key``: the namespace (tenant, adapter) it matches in and later inserts into.

        With ``compute_last=True`` the last token is never taken from the cache, so a model
        always has at least one token to run (to get the next-token logits).
        Raises ``RuntimeError`` when the pool cannot hold the request even after eviction; the
        lock is then released and no page changes hands (the match's LRU refresh stays).
        """
        ids = token_ids(input_ids)
        if extra_key is not None:
            check_extra_key(extra_key)
        n = ids.shape[0]
        if n == 0:
            raise ValueError("input_ids must hold at least one token")
        notes: list[FlowEvent] | None = [] if self._events is not None else None
        rid = self._next_rid
        req = self._match(rid, ids, compute_last, extra_key, notes)
        m = req._len
        try:
            filled, pages = self._room(req, n - m)
            if pages:
                if pages > self.allocator.num_free_pages:
                    self._make_room(rid, pages, notes)
                self.allocator.allocate_page_slots(pages, req._slots, filled)
        except BaseException:
            self.manager.lock_handle(req.handle, unlock=True)
            raise
        if pages and notes is not None:
            self._allocated(notes, rid, req._slots[filled : filled + pages * self.page_size])
        self._write(req, ids[m:], filled + pages * self.page_size)
        self.running[rid] = req
        self.stats.count_request(n, m)
        self._next_rid = rid + 1
        if notes:
            self._report(notes)
        return req

    def begin_batch(
        self,
        prompts: Sequence[torch.Tensor],
        *,
        compute_last: bool = False,
        extra_key: Hashable = None,
    ) -> list[Request]:
        """`begin` for several prompts at once (all in namespace ``extra_key``), all or nothing.

        Every prompt is checked first; then all are matched and locked, and only if the pool
        can hold every one of them (after eviction) are pages taken, in one eviction and one
        allocation for the batch. Otherwise every lock is released and ``RuntimeError`` raised:
        nothing evicted, no page taken. Prompts of one batch do not reuse each other (none is
        cached yet).
        """
        reject_one_tensor(prompts, "prompts")
        prompts = as_list(prompts, "prompts", "1-D token-id tensors")
        if not prompts:
            raise ValueError("prompts must hold at least one prompt, got an empty batch")
        arrays = []
        for i, p in enumerate(prompts):
            arrays.append(token_ids(p, f"prompts[{i}]"))
            if p.shape[0] == 0:
                raise ValueError(f"prompts[{i}] must hold at least one token")
        check_extra_key(extra_key)
        notes: list[FlowEvent] | None = [] if self._events is not None else None
        reqs: list[Request] = []
        try:
            for i, ids in enumerate(arrays):
                reqs.append(self._match(self._next_rid + i, ids, compute_last, extra_key, notes))
            self._grow(reqs, [ids[r._len :] for r, ids in zip(reqs, arrays, strict=True)], notes)
        except BaseException:
            for r in reqs:
                self.manager.lock_handle(r.handle, unlock=True)
            raise
        for req, ids in zip(reqs, arrays, strict=True):
            self.running[req.rid] = req
            self.stats.count_request(ids.shape[0], req.reused_len)
        self._next_rid = reqs[-1].rid + 1
        if notes:
            self._report(notes)
        return reqs

    def _grow(
        self, reqs: list[Request], new: list[np.ndarray], notes: list[FlowEvent] | None
    ) -> None:
        """Append ``new[i]`` to ``reqs[i]`` for every ``i``, with one eviction and one allocation
        for them all (all or nothing: a request changes only once every page is taken)."""
        plans = [self._room(r, x.shape[0]) for r, x in zip(reqs, new, strict=True)]
        ps = self.page_size
        total = sum(pages for _, pages in plans)
        got = np.empty(total * ps, dtype=np.int32)
        if total:
            if total > self.allocator.num_free_pages:
                self._make_room(reqs[0].rid, total, notes)
            self.allocator.allocate_page_slots(total, got)
        at = 0
        for r, x, (filled, pages) in zip(reqs, new, plans, strict=True):
            size = pages * ps
            if size:
                r._slots[filled : filled + size] = got[at : at + size]
                at += size
                if notes is not None:
                    self._allocated(notes, r.rid, r._slots[filled : filled + size])
            self._write(r, x, filled + size)

    def _write(self, req: Request, new: np.ndarray, filled: int) -> None:
        """Append ``new`` to ``req``, its slots already in place up to ``filled``."""
        n = req._len
        req._ids[n : n + new.shape[0]] = new
        req._len = n + new.shape[0]
        req._filled = filled

    def mark_computed(self, req: Request, num_tokens: int | None = None) -> None:
        """Record that K/V of the first ``num_tokens`` tokens (default: all) are stored (step 6).

        ``num_tokens``: an integer in ``[req.num_computed, len(req)]`` (``TypeError`` for bool,
        float and other non-integers, ``ValueError`` out of range).
        """
        if num_tokens is None and self._events is None:
            try:  # the common call, checked as `_get` checks it
                if self.running.get(req.rid) is req and not req.finished:
                    req.num_computed = req._len
                    return
            except (AttributeError, TypeError):
                pass
        self._get(req)
        length = req._len
        n = (
            length
            if num_tokens is None
            else check_int_in(num_tokens, "num_tokens", req.num_computed, length)
        )
        if self._events is None:
            req.num_computed = n
            return
        stored = req._slots[req.num_computed : n].tolist()
        req.num_computed = n
        self._report([FlowEvent(req.rid, 6, "store_kv", f"slots {stored}")])

    def extend(self, req: Request, new_ids: torch.Tensor) -> torch.Tensor:
        """Append ``new_ids`` (decode) and return their slots; fills the last page before a new one.

        ``RuntimeError`` (nothing changed but an eviction made first) when the pool cannot take
        the new pages.
        """
        self._get(req)
        new = token_ids(new_ids, "new_ids")
        k = new.shape[0]
        if k == 0:
            return req.indices[:0]
        notes: list[FlowEvent] | None = [] if self._events is not None else None
        n = req._len
        filled, pages = self._room(req, k)
        if pages:
            if pages > self.allocator.num_free_pages:
                self._make_room(req.rid, pages, notes)
            self.allocator.allocate_page_slots(pages, req._slots, filled)
            if notes is not None:
                self._allocated(
                    notes, req.rid, req._slots[filled : filled + pages * self.page_size]
                )
        self._write(req, new, filled + pages * self.page_size)
        self.stats.decoded_tokens += k
        if notes:
            self._report(notes)
        out = torch.from_numpy(req._slots[n : n + k])
        return out if self._on_cpu else out.to(self._device)

    def extend_batch(
        self, reqs: Sequence[Request], new_ids: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """`extend` of ``reqs[i]`` by ``new_ids[i]`` for every ``i``, all or nothing.

        Refused before any request changes: ``ValueError`` for differing lengths or bad ids,
        ``RuntimeError`` for a request not running here or listed twice, or when the pool cannot
        take every new page (one eviction and one allocation for the batch).
        """
        reqs = as_list(reqs, "reqs", "Requests")
        new_ids = as_list(new_ids, "new_ids", "1-D token-id tensors")
        if len(new_ids) != len(reqs):
            raise ValueError(
                f"need one new_ids per request: {len(new_ids)} for {len(reqs)} requests"
            )
        arrays = []
        for i, (r, x) in enumerate(zip(reqs, new_ids, strict=True)):
            self._get(r)
            arrays.append(token_ids(x, f"new_ids[{i}]"))
        if len({id(r) for r in reqs}) != len(reqs):
            raise RuntimeError("every request must be running in this flow, each listed once")
        if not reqs:
            return []
        notes: list[FlowEvent] | None = [] if self._events is not None else None
        ends = [len(r) for r in reqs]
        self._grow(reqs, arrays, notes)
        self.stats.decoded_tokens += sum(x.shape[0] for x in arrays)
        if notes:
            self._report(notes)
        return [self._tensor(r._slots[n : r._len]) for r, n in zip(reqs, ends, strict=True)]

    def _insert_tensors(self, req: Request, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``req``'s first ``n`` ids and slots as the manager takes them (slots on the device):
        its own tensors when it inserts all of itself, views made now otherwise."""
        if n == req._len:
            _, ids, slots = req._tensors()
            return ids, slots
        if self._on_cpu:
            return torch.from_numpy(req._ids[:n]), torch.from_numpy(req._slots[:n])
        return torch.from_numpy(req._ids[:n]), req.indices[:n]

    def cache(self, req: Request) -> int:
        """Insert the computed whole-page prefix of a request that keeps running (step 4).

        Afterwards ``req.indices[:tree_len]`` are the tree's own indices: where another request
        had already inserted the same tokens, this request's duplicate pages are freed and its
        indices now point at the tree's. Returns the length that was already cached.
        """
        self._get(req)
        n = req.num_computed // self.page_size * self.page_size
        lo = req.tree_len
        ids, slots = self._insert_tensors(req, n)
        res, interrupted = _inserted(
            self.manager.insert_and_unlock, req.handle, ids, slots, req.extra_key, relock=True
        )
        # The insert is made and the lock moved: from here on the step only completes.
        already, handle = res.cached_len, res.handle
        hi = min(already, handle.cached_len)  # a manager caching nothing holds none of them
        req.handle = handle
        dup = req._slots[lo:hi].copy() if hi > lo else None
        if dup is not None:
            interrupted = _complete(self._read_tree_slots, req, hi) or interrupted
            # own pages from a page start: whole pages
            interrupted = _complete(self.allocator.free_page_runs, dup) or interrupted
        if interrupted is not None or self._events is not None:
            self._done(interrupted, self._cache_events, req, n, already, dup)
        return already

    def _cache_events(
        self, req: Request, n: int, already: int, dup: np.ndarray | None
    ) -> list[FlowEvent]:
        notes = [FlowEvent(req.rid, 4, "insert_prefix", f"{n} tokens, {already} already cached")]
        if dup is not None:
            pages = aligned_run_pages(dup, self.page_size).tolist()
            notes.append(FlowEvent(req.rid, 5, "free", f"duplicate pages {pages}"))
        moved = f"lock moved to the cached prefix, tree_len={req.tree_len}"
        notes.append(FlowEvent(req.rid, 2, "lock_handle", moved))
        return notes

    def _read_tree_slots(self, req: Request, hi: int) -> None:
        """Point ``req``'s first ``hi`` slots at the tree's (its handle's), in new arrays, so that
        tensors handed out before keep their values."""
        tree = self._host(self.manager.handle_indices(req.handle))
        slots = req._slots[: req._len].copy()
        slots[:hi] = tree[:hi]
        req._hold(req._ids[: req._len], slots)

    def finish(self, req: Request) -> int:
        """Steps 4, 7, 5: insert the request and unlock its prefix, then free its duplicate and
        partial pages.

        Returns the length that was already cached. Requires every token to be computed.
        """
        self._get(req)
        length = req._len
        if req.num_computed != length:
            raise RuntimeError(
                f"request {req.rid} has {length - req.num_computed} tokens without stored K/V; "
                "call mark_computed first"
            )
        n = length - length % self.page_size
        lo = req.tree_len
        ids, slots = self._insert_tensors(req, n)
        res, late = _inserted(self.manager.insert_and_unlock, req.handle, ids, slots, req.extra_key)
        # The insert is made and the lock released: from here on the step only completes.
        already = res.cached_len
        req.finished = True
        del self.running[req.rid]
        own = req._slots
        if already > lo:  # own pages in [lo, already) duplicate what another request inserted
            run = (
                own[lo:already] if n == length else np.concatenate((own[lo:already], own[n:length]))
            )
        else:
            run = own[n:length]
        interrupted = _complete(self.allocator.free_page_runs, run) if len(run) else None
        interrupted = interrupted or late
        if interrupted is not None or self._events is not None:
            self._done(interrupted, self._finish_events, req, n, already, run)
        return already

    def _finish_events(
        self, req: Request, n: int, already: int, freed: np.ndarray
    ) -> list[FlowEvent]:
        pages = aligned_run_pages(freed, self.page_size).tolist()
        protected = self.manager.size_info.protected_size
        return [
            FlowEvent(req.rid, 4, "insert_prefix", f"{n} tokens, {already} already cached"),
            FlowEvent(req.rid, 5, "free", f"pages {pages}"),
            FlowEvent(req.rid, 7, "unlock", f"protected={protected}"),
        ]

    def abort(self, req: Request) -> None:
        """Drop a request without caching it: unlock its prefix and free its own pages."""
        self._get(req)
        self.manager.lock_handle(req.handle, unlock=True)
        req.finished = True
        del self.running[req.rid]
        own = req._slots[req.tree_len : req._len]
        if len(own):  # from a page start: whole pages, the last one possibly partial
            interrupted = _complete(self.allocator.free_page_runs, own)
            if interrupted is not None:
                raise interrupted

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix and return its pages to the allocator.

        Returns the number of cached tokens forgotten. ``RuntimeError``, changing nothing, while
        any request is running (its prefix is locked and its K/V in use) or anything else holds
        a lock on the manager.
        """
        if self.running:
            running = sorted(self.running)
            raise RuntimeError(
                f"cannot reset the prefix cache while {len(running)} requests are running "
                f"(rids {running[:8]}); finish or abort them first"
            )
        locked = self.manager.size_info.protected_size
        if locked:
            raise RuntimeError(
                f"cannot reset the prefix cache while {locked} cached tokens are locked"
            )
        cached = self.manager.cached_indices()
        self.manager.reset()
        interrupted = _complete(self.allocator.free_slots, cached)
        if interrupted is not None:
            raise interrupted
        return int(cached.shape[0])

    # --------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """Prove the page partition: free + cached + held by running requests = all, none twice.

        Runs the manager's own check first; checks each request's ``indices`` against its
        ``input_ids`` and, where the manager can tell (``handle_indices``), that its first
        ``tree_len`` indices are the tree's. ``RuntimeError`` naming the first breach found.
        """
        manager, allocator = self.manager, self.allocator
        manager.check_integrity()
        ps, num_pages = allocator.page_size, allocator.num_pages
        cached = manager.cached_indices()
        total = manager.size_info.total_size
        if cached.shape[0] != total:
            raise RuntimeError(
                f"manager holds {cached.shape[0]} slots but reports total_size {total}"
            )
        if cached.shape[0] % ps:
            raise RuntimeError(f"cache holds {cached.shape[0]} slots, not whole pages of {ps}")
        parts = [
            allocator.free_pages().cpu().numpy().astype(np.int64),
            cached.cpu().numpy()[::ps].astype(np.int64) // ps,
        ]
        for req in self.running.values():
            parts.extend(self._own_pages(req))
        pages = np.concatenate(parts)
        if pages.shape[0] and (pages.min() < 0 or pages.max() >= num_pages):
            raise RuntimeError(f"page outside [0, {num_pages}) in use")
        counts = np.bincount(pages, minlength=num_pages)
        lost = np.flatnonzero(counts == 0).tolist()
        twice = np.flatnonzero(counts > 1).tolist()
        if lost or twice:
            raise RuntimeError(
                f"page accounting broken: lost pages {lost[:16]}, pages owned twice {twice[:16]}"
            )

    def _own_pages(self, req: Request) -> Iterable[np.ndarray]:
        """The pages ``req`` holds of its own, after checking that its tree part is the tree's."""
        if req.indices.shape[0] != req.input_ids.shape[0]:
            raise RuntimeError(
                f"request {req.rid}: {len(req.input_ids)} tokens but {len(req.indices)} indices"
            )
        try:
            ok = torch.equal(self.manager.handle_indices(req.handle), req.indices[: req.tree_len])
        except NotImplementedError:  # a manager that cannot say
            ok = True
        if not ok:
            raise RuntimeError(f"request {req.rid}: its prefix indices are not the tree's")
        own = req.indices[req.tree_len :].cpu().numpy().astype(np.int64)
        if not own.shape[0]:
            return []
        pages = own // self.page_size
        return [pages[np.r_[True, pages[1:] != pages[:-1]]]]
