"""`RequestFlow`: carries requests through the seven steps of the cache's life, for any manager.

    begin(ids)   1. match_prefix   2. lock_handle   3. allocate what is missing (evicting if short)
    (caller)     6. store K/V of the new tokens at ``request.out_loc``
    cache(req)   insert what is computed so far, keep running (a chunk, a turn that goes on)
    extend(req)  append tokens (decode), allocating pages as the last one fills
    finish(req)  4. insert_prefix  5. free only this request's duplicate pages  7. unlock

Ownership is the point. Every page is at every moment exactly one of: free (in the allocator),
cached (held by the manager's tree), or held by one running request (its own pages, not yet
given to the tree). A request's ``indices[:tree_len]`` belong to the tree and are protected by
its locked handle; ``indices[tree_len:]`` are its own. `check_integrity` proves the partition.

The source document frees ``indices[:already_cached]`` after inserting; when those came from
``match_prefix`` they are the tree's, and freeing them corrupts the cache. Only the request's
own pages in ``[tree_len, already_cached)``, which another request inserted first, are freed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch

from .._validate import check_token_ids
from .allocator import PageAllocator
from ..managers.base import BaseCacheHandle, BaseCacheManager

__all__ = ["Request", "FlowStats", "FlowEvent", "RequestFlow"]


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
    """Token counts over the flow's life (``computed = prompt + decoded - reused``)."""

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
class _Tracer:
    sink: Optional[Callable[[FlowEvent], None]] = None
    events: List[FlowEvent] = field(default_factory=list)

    def __call__(self, rid: int, step: int, name: str, detail: str) -> None:
        event = FlowEvent(rid, step, name, detail)
        self.events.append(event)
        if self.sink is not None:
            self.sink(event)


class RequestFlow:
    """Drives a `BaseCacheManager` and a `PageAllocator` through the life of requests.

    Args:
        manager: any prefix-cache manager (naive, radix, block-hash, ...).
        allocator: the page free list; its ``page_size`` must match the manager's, if it has one.
        on_event: optional callback receiving a `FlowEvent` for every step (also kept in ``events``
            when ``trace=True``).
    """

    def __init__(self, manager: BaseCacheManager, allocator: PageAllocator, *, trace: bool = False,
                 on_event: Optional[Callable[[FlowEvent], None]] = None) -> None:
        manager_ps = getattr(manager, "page_size", allocator.page_size)
        if manager_ps != allocator.page_size:
            raise ValueError(f"manager page_size {manager_ps} != allocator page_size {allocator.page_size}")
        manager_dev = getattr(manager, "device", allocator.device)
        if torch.device(manager_dev) != allocator.device:
            raise ValueError(f"manager device {manager_dev} != allocator device {allocator.device}")
        self.manager = manager
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.running: Dict[int, Request] = {}
        self.stats = FlowStats()
        self._trace = _Tracer(on_event) if (trace or on_event is not None) else None
        self._rids = itertools.count()

    @property
    def events(self) -> List[FlowEvent]:
        return self._trace.events if self._trace is not None else []

    def _log(self, rid: int, step: int, name: str, detail: Callable[[], str]) -> None:
        """Record a step; ``detail`` is only formatted when someone listens (it calls ``tolist``)."""
        if self._trace is not None:
            self._trace(rid, step, name, detail())

    # ------------------------------------------------------------ pages
    def available_pages(self) -> int:
        """Pages that could be handed out now: free ones plus those eviction could free."""
        return self.allocator.num_free_pages + self.manager.size_info.evictable_size // self.page_size

    def _allocate(self, rid: int, num_pages: int) -> torch.Tensor:
        """Take ``num_pages`` pages, evicting from the manager first when the free list is short."""
        short = num_pages - self.allocator.num_free_pages
        if short > 0:
            evictable = self.manager.size_info.evictable_size // self.page_size
            if short > evictable:
                raise RuntimeError(
                    f"out of KV pages: need {num_pages}, {self.allocator.num_free_pages} free and "
                    f"{evictable} evictable"
                )
            slots = self.manager.evict(short * self.page_size)
            self.allocator.free(self.allocator.slots_to_pages(slots))
            self.stats.evicted_tokens += len(slots)
            self.stats.evictions += 1
            self._log(rid, 3, "evict", lambda: f"evicted {len(slots)} cached tokens to free {short} pages")
        pages = self.allocator.allocate(num_pages)
        self._log(rid, 3, "allocate", lambda: f"pages {pages.tolist()}")
        return pages

    def _get(self, req: Request) -> Request:
        if not isinstance(req, Request):
            raise TypeError(f"expected a Request, got {type(req).__name__}")
        if req.finished or self.running.get(req.rid) is not req:
            raise RuntimeError(f"request {req.rid} is not running in this flow")
        return req

    # ------------------------------------------------------------ steps
    def begin(self, input_ids: torch.Tensor, *, compute_last: bool = False) -> Request:
        """Steps 1-3: match the longest cached prefix, lock it, allocate pages for the rest.

        With ``compute_last=True`` the last token is never taken from the cache, so a model
        always has at least one token to run (to get the next-token logits).
        Raises ``RuntimeError`` when the pool cannot hold the request even after eviction; the
        lock is then released and no page changes hands (the match's LRU refresh stays).
        """
        check_token_ids(input_ids)
        if len(input_ids) == 0:
            raise ValueError("input_ids must hold at least one token")
        ids = input_ids.to(torch.int64, copy=True)
        rid = next(self._rids)
        handle, prefix = self.manager.match_prefix(ids[:-1] if compute_last else ids)
        m = handle.cached_len
        self._log(rid, 1, "match_prefix", lambda: f"cached_len={m} indices={prefix.tolist()}")
        self.manager.lock_handle(handle)
        self._log(rid, 2, "lock_handle", lambda: f"protected={self.manager.size_info.protected_size}")
        new_tokens = len(ids) - m
        try:
            pages = self._allocate(rid, -(-new_tokens // self.page_size))
        except RuntimeError:
            self.manager.lock_handle(handle, unlock=True)
            raise
        own = self.allocator.pages_to_slots(pages, new_tokens)
        req = Request(rid, ids, torch.cat([prefix, own]) if m else own, handle, m, m)
        self.running[rid] = req
        self.stats.requests += 1
        self.stats.prompt_tokens += len(ids)
        self.stats.reused_tokens += m
        return req

    def mark_computed(self, req: Request, num_tokens: Optional[int] = None) -> None:
        """Record that K/V of the first ``num_tokens`` tokens (default: all) are stored (step 6)."""
        self._get(req)
        n = len(req) if num_tokens is None else num_tokens
        if not req.num_computed <= n <= len(req):
            raise ValueError(f"num_tokens must be in [{req.num_computed}, {len(req)}], got {n}")
        self._log(req.rid, 6, "store_kv", lambda: f"slots {req.indices[req.num_computed:n].tolist()}")
        req.num_computed = n

    def extend(self, req: Request, new_ids: torch.Tensor) -> torch.Tensor:
        """Append ``new_ids`` (decode) and return their slots; fills the last page before a new one."""
        self._get(req)
        check_token_ids(new_ids, "new_ids")
        k, ps, length = len(new_ids), self.page_size, len(req)
        take = min(k, (ps - length % ps) % ps)  # free slots left in the last page
        rest = k - take
        slots = self.allocator.pages_to_slots(self._allocate(req.rid, -(-rest // ps)), rest) if rest else req.indices[:0]
        if take:
            tail = req.indices[-1] + torch.arange(1, take + 1, dtype=torch.int32, device=req.indices.device)
            slots = torch.cat([tail, slots])
        req.input_ids = torch.cat([req.input_ids, new_ids.to(torch.int64)])
        req.indices = torch.cat([req.indices, slots])
        self.stats.decoded_tokens += k
        return slots

    def cache(self, req: Request) -> int:
        """Insert the computed whole-page prefix of a request that keeps running.

        Afterwards ``req.indices[:tree_len]`` are the tree's own indices: where another request
        had already inserted the same tokens, this request's duplicate pages are freed and its
        indices now point at the tree's. Returns the length that was already cached.
        """
        self._get(req)
        n = req.num_computed // self.page_size * self.page_size
        ids, idx = req.input_ids[:n], req.indices[:n]
        already = self.manager.insert_prefix(ids, idx)
        self._log(req.rid, 4, "insert_prefix", lambda: f"{n} tokens, {already} already cached")
        handle, tree_idx = self.manager.match_prefix(ids)
        lo, hi = req.tree_len, handle.cached_len
        if hi > lo:
            ps = self.page_size
            own, theirs = req.indices[lo:hi:ps], tree_idx[lo:hi:ps]
            dup = own != theirs
            if bool(dup.any()):
                pages = torch.div(own[dup], ps, rounding_mode="floor")
                self.allocator.free(pages)
                self._log(req.rid, 5, "free", lambda: f"duplicate pages {pages.tolist()}")
            req.indices = torch.cat([tree_idx, req.indices[hi:]])
        self.manager.lock_handle(handle)
        self.manager.lock_handle(req.handle, unlock=True)
        req.handle = handle
        self._log(req.rid, 2, "lock_handle", lambda: f"lock moved to the cached prefix, tree_len={hi}")
        return already

    def finish(self, req: Request) -> int:
        """Steps 4, 5, 7: insert the request, free its duplicate and partial pages, unlock.

        Returns the length that was already cached. Requires every token to be computed.
        """
        self._get(req)
        if req.num_computed != len(req):
            raise RuntimeError(
                f"request {req.rid} has {len(req) - req.num_computed} tokens without stored K/V; "
                "call mark_computed first"
            )
        n = len(req) // self.page_size * self.page_size
        already = self.manager.insert_prefix(req.input_ids[:n], req.indices[:n])
        self._log(req.rid, 4, "insert_prefix", lambda: f"{n} tokens, {already} already cached")
        to_free = self.allocator.slots_to_pages(torch.cat([req.indices[req.tree_len:already], req.indices[n:]]))
        self.allocator.free(to_free)
        self._log(req.rid, 5, "free", lambda: f"pages {to_free.tolist()}")
        self.manager.lock_handle(req.handle, unlock=True)
        self._log(req.rid, 7, "unlock", lambda: f"protected={self.manager.size_info.protected_size}")
        req.finished = True
        del self.running[req.rid]
        return already

    def abort(self, req: Request) -> None:
        """Drop a request without caching it: free its own pages and unlock its prefix."""
        self._get(req)
        self.allocator.free(self.allocator.slots_to_pages(req.indices[req.tree_len:]))
        self.manager.lock_handle(req.handle, unlock=True)
        req.finished = True
        del self.running[req.rid]

    # --------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """Prove the page partition: free + cached + held by running requests = all, none twice.

        Also runs the manager's own check and, where the manager can tell (``handle_indices``),
        that each request's tree part really is the tree's.
        """
        self.manager.check_integrity()
        ps = self.page_size
        cached = self.manager.cached_indices()
        if len(cached) != self.manager.size_info.total_size:
            raise RuntimeError(
                f"manager holds {len(cached)} slots but reports total_size {self.manager.size_info.total_size}"
            )
        if len(cached) % ps:
            raise RuntimeError(f"cache holds {len(cached)} slots, not whole pages of {ps}")
        parts = [self.allocator.free_pages(), torch.div(cached[::ps], ps, rounding_mode="floor").to(torch.int32)]
        handle_indices = getattr(self.manager, "handle_indices", None)
        for req in self.running.values():
            if len(req.indices) != len(req.input_ids):
                raise RuntimeError(f"request {req.rid}: {len(req.input_ids)} tokens but {len(req.indices)} indices")
            if handle_indices is not None and not torch.equal(handle_indices(req.handle), req.indices[:req.tree_len]):
                raise RuntimeError(f"request {req.rid}: its prefix indices are not the tree's")
            parts.append(self.allocator.slots_to_pages(req.indices[req.tree_len:]))
        pages = torch.cat(parts).long()
        if len(pages) and (int(pages.min()) < 0 or int(pages.max()) >= self.allocator.num_pages):
            raise RuntimeError(f"page outside [0, {self.allocator.num_pages}) in use")
        counts = torch.bincount(pages, minlength=self.allocator.num_pages)
        lost = (counts == 0).nonzero().flatten().tolist()
        twice = (counts > 1).nonzero().flatten().tolist()
        if lost or twice:
            raise RuntimeError(f"page accounting broken: lost pages {lost[:16]}, pages owned twice {twice[:16]}")
