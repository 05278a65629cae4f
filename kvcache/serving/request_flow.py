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
from collections.abc import Callable, Hashable

import numpy as np
import torch

from .._validate import check_int_in
from ..managers.base import BaseCacheHandle, BaseCacheManager, fused_calls_safe, host_arrays_safe
from ..managers.cache_events import check_extra_key
from .allocator import PageAllocator
from .flow_batch import FlowBatchCalls
from .flow_pages import FlowPages
from .integrity import check_flow_parts, check_page_partition
from .request import FlowEvent, FlowStats, HostCopy, Request, Tracer, host_ids, keyed

__all__ = ["Request", "FlowStats", "FlowEvent", "RequestFlow"]


class RequestFlow(FlowBatchCalls):
    """Drives a `BaseCacheManager` and a `PageAllocator` through the life of requests.

    Args:
        manager: any prefix-cache manager (naive, radix, block-hash, ...).
        allocator: the page free list; same ``page_size`` and ``device`` as the manager's.
        on_event: optional callback receiving a `FlowEvent` for every step (also kept in ``events``
            when ``trace=True``).

    Every public method either does all it promises or raises and changes nothing (a match's
    LRU refresh and the trace's events aside).
    """

    def __init__(
        self,
        manager: BaseCacheManager,
        allocator: PageAllocator,
        *,
        trace: bool = False,
        on_event: Callable[[FlowEvent], None] | None = None,
    ) -> None:
        check_flow_parts(manager, allocator, on_event)
        self.manager = manager
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.running: dict[int, Request] = {}
        self.stats = FlowStats()
        self._device = allocator.device
        self._on_cpu = allocator.device.type == "cpu"
        self._trace = Tracer(on_event) if (trace or on_event is not None) else None
        self._rids = itertools.count()
        self._pages = FlowPages(manager, allocator, self.stats, self._trace)
        # One manager call for match + lock and for insert + unlock, where that is the same as
        # the separate calls; a traced flow makes them one by one, so each step can be watched.
        self._fused = (
            self._trace is None
            and isinstance(manager, BaseCacheManager)
            and fused_calls_safe(type(manager))
        )
        # ...taking the request's NumPy ids and slots as they are, where both calls say so.
        self._host = self._fused and all(
            host_arrays_safe(type(manager), f) for f in ("match_and_lock", "insert_and_unlock")
        )
        self._pages.fused, self._pages.host = self._fused, self._host
        self._hm = self._pages.hm

    @property
    def events(self) -> list[FlowEvent]:
        return self._trace.events if self._trace is not None else []

    # ------------------------------------------------------------ pages
    def available_pages(self) -> int:
        """Pages that could be handed out now: free ones plus those eviction could free."""
        return self._pages.available()

    def pages_needed(self, req: Request, num_new_tokens: int) -> int:
        """New pages `extend` takes to append ``num_new_tokens`` to ``req``: the last page's free
        slots are filled first."""
        self._get(req)
        k = check_int_in(num_new_tokens, "num_new_tokens", 0, 2**62)
        return self._pages.pages_for(len(req), k)

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

    # ------------------------------------------------------------ steps
    def _start(
        self,
        rid: int,
        ids: np.ndarray,
        handle: BaseCacheHandle,
        prefix: torch.Tensor | np.ndarray,
        key: Hashable,
    ) -> Request:
        """Pages for the tokens past the cached prefix, then the running request (or raise with
        nothing taken)."""
        n, m, ps = len(ids), handle.cached_len, self.page_size
        host = HostCopy.with_room(n, ps)
        if n > m:  # the new pages' slots are written in place, the last page whole
            k = -(-(n - m) // ps)
            if self._trace is None and k <= self.allocator.num_free_pages:
                self.allocator.allocate_page_slots(k, host.slots, m)  # no eviction needed
            else:
                self._pages.allocate_pages(rid, k, host.slots, m)
            host.filled = m + k * ps
        else:
            host.filled = n
        host.ids[:n] = ids
        if m:
            host.slots[:m] = prefix if isinstance(prefix, np.ndarray) else prefix.cpu().numpy()
        host.length = n
        self.running[rid] = req = Request.from_host(rid, host, handle, m, self._device, key)
        self.stats.count_request(n, m)
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
        ids = host_ids(input_ids)
        if extra_key is not None:
            check_extra_key(extra_key)
        if len(ids) == 0:
            raise ValueError("input_ids must hold at least one token")
        rid = next(self._rids)
        handle, prefix = (
            self._hm.match_and_lock(ids[:-1] if compute_last else ids, extra_key)
            if self._host
            else self._pages.match_lock_any(rid, ids, input_ids, compute_last, extra_key)
        )
        try:
            return self._start(rid, ids, handle, prefix, extra_key)
        except BaseException:
            self.manager.lock_handle(handle, unlock=True)
            raise

    def mark_computed(self, req: Request, num_tokens: int | None = None) -> None:
        """Record that K/V of the first ``num_tokens`` tokens (default: all) are stored (step 6).

        ``num_tokens``: an integer in ``[req.num_computed, len(req)]`` (``TypeError`` for bool,
        float and other non-integers, ``ValueError`` out of range).
        """
        if num_tokens is None and self._trace is None:
            try:  # the common call, checked as `_get` checks it
                if self.running.get(req.rid) is req and not req.finished:
                    req.num_computed = req.host.length
                    return
            except (AttributeError, TypeError):
                pass
        self._get(req)
        length = req.host.length
        n = (
            length
            if num_tokens is None
            else check_int_in(num_tokens, "num_tokens", req.num_computed, length)
        )
        if self._trace is not None:
            self._trace(
                req.rid,
                6,
                "store_kv",
                f"slots {req.indices[req.num_computed : n].tolist()}",
            )
        req.num_computed = n

    def extend(self, req: Request, new_ids: torch.Tensor) -> torch.Tensor:
        """Append ``new_ids`` (decode) and return their slots; fills the last page before a new one.

        ``RuntimeError`` (nothing changed) when the pool cannot take the new pages.
        """
        self._get(req)
        new = host_ids(new_ids, "new_ids")
        if len(new) == 0:
            return req.indices[:0]
        out = torch.from_numpy(self._pages.append(req, new))
        return out if self._on_cpu else out.to(self._device)

    def _insert(self, req: Request, n: int, keep_running: bool) -> int:
        """Steps 4, 5 and 7 for ``req``'s first ``n`` tokens (whole pages); returns the length
        that was already cached. Own pages in ``[tree_len, already)`` duplicate what another
        request inserted first. Finishing frees them (and the pages past ``n``) and unlocks; a
        request that keeps running frees those the tree holds, points its indices at the tree's
        and moves its lock to the new handle."""
        h = req.host
        length = h.length
        fused = self._fused
        res = (
            self._pages.insert_fused(req, n, keep_running)
            if fused
            else keyed(
                self.manager.insert_and_match, req.extra_key, *self._pages.insert_tensors(req, n)
            )
        )
        already, lo = res.cached_len, req.tree_len
        if self._trace is not None:
            self._trace(req.rid, 4, "insert_prefix", f"{n} tokens, {already} already cached")
        if not keep_running:
            freed = self._pages.free_finished(h.slots, lo, already, n, length)
            if self._trace is not None:
                self._trace(req.rid, 5, "free", f"pages {freed}")
            if not fused:
                self.manager.lock_handle(req.handle, unlock=True)
            return already
        hi = min(already, res.handle.cached_len)  # a manager caching nothing holds none of them
        if hi > lo:
            self._pages.share_tree_pages(req, res.handle, lo, hi)
        if not fused:
            self.manager.lock_handle(res.handle)
            self.manager.lock_handle(req.handle, unlock=True)
        req.handle = res.handle
        if self._trace is not None:
            moved = f"lock moved to the cached prefix, tree_len={req.tree_len}"
            self._trace(req.rid, 2, "lock_handle", moved)
        return already

    def cache(self, req: Request) -> int:
        """Insert the computed whole-page prefix of a request that keeps running.

        Afterwards ``req.indices[:tree_len]`` are the tree's own indices: where another request
        had already inserted the same tokens, this request's duplicate pages are freed and its
        indices now point at the tree's. Returns the length that was already cached.
        """
        self._get(req)
        return self._insert(
            req, req.num_computed // self.page_size * self.page_size, keep_running=True
        )

    def finish(self, req: Request) -> int:
        """Steps 4, 5, 7: insert the request, free its duplicate and partial pages, unlock.

        Returns the length that was already cached. Requires every token to be computed.
        """
        self._get(req)
        h = req.host
        length = h.length
        if req.num_computed != length:
            raise RuntimeError(
                f"request {req.rid} has {length - req.num_computed} tokens without stored K/V; "
                "call mark_computed first"
            )
        n = length - length % self.page_size
        if self._fused:  # untraced: `_insert`'s steps with nothing to record
            handle = req.handle
            res = (
                self._hm.insert_and_unlock(handle, h.ids[:n], h.slots[:n], req.extra_key)
                if self._host
                else self._pages.insert_fused(req, n)
            )
            already, lo = res.cached_len, handle.cached_len
            if already > lo:
                self._pages.free_finished(h.slots, lo, already, n, length)
            elif n < length:  # only the partial last page: one page, named by its first slot
                self.allocator.free_page_start(h.slots.item(n))
            req.finished = True
            del self.running[req.rid]
            return already
        already = self._insert(req, n, keep_running=False)
        if self._trace is not None:
            self._trace(req.rid, 7, "unlock", f"protected={self.manager.size_info.protected_size}")
        self._end(req)
        return already

    def abort(self, req: Request) -> None:
        """Drop a request without caching it: free its own pages and unlock its prefix."""
        self._get(req)
        self.allocator.free_page_runs(req.host.slots[req.tree_len : len(req)])
        self.manager.lock_handle(req.handle, unlock=True)
        self._end(req)

    def _end(self, req: Request) -> None:
        req.finished = True
        del self.running[req.rid]

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix and return its pages to the allocator.

        Returns the number of cached tokens forgotten. ``RuntimeError``, changing nothing, while
        any request is running (its prefix is locked and its K/V in use) or anything else holds
        a lock on the manager.
        """
        return self._pages.reset_cache(sorted(self.running))

    # --------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """Prove the page partition: free + cached + held by running requests = all, none twice.

        Also runs the manager's own check and, where the manager can tell (``handle_indices``),
        that each request's tree part really is the tree's. ``RuntimeError`` on any breach.
        """
        check_page_partition(self.manager, self.allocator, self.running.values())
