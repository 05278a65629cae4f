"""`FlowPages`: the page budget of a `RequestFlow`, taking pages from it (evicting first) and
giving them back, and the flow's steps one manager call at a time (traced or unfused)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import cast

import numpy as np
import torch

from .._validate import aligned_run_pages
from ..managers.base import (
    BaseCacheHandle,
    BaseCacheManager,
    HostArrayCalls,
    InsertResult,
    host_arrays_safe,
)
from .allocator import PageAllocator
from .request import FlowStats, HostCopy, Request, Tracer, keyed

__all__ = ["FlowPages"]


class FlowPages:
    """Pages for a flow's requests: the allocator's free pages, plus what evicting unlocked
    prefixes from the manager would free. Evictions are counted in ``stats`` and traced (step 3)
    to ``trace`` when given."""

    def __init__(
        self,
        manager: BaseCacheManager,
        allocator: PageAllocator,
        stats: FlowStats,
        trace: Tracer | None,
    ) -> None:
        self.manager = manager
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.stats = stats
        self.trace = trace
        self._steps = np.arange(1, self.page_size, dtype=np.int32)
        self._evict_host = host_arrays_safe(type(manager), "evict")  # slots as NumPy, no tensor
        self._on_cpu = allocator.device.type == "cpu"
        # Set by the flow: whether it makes the fused calls, and with NumPy arrays.
        self.fused = self.host = False
        self.hm = cast(HostArrayCalls, manager)  # the same manager, typed with its NumPy forms

    def match_lock_any(
        self, rid: int, ids: np.ndarray, input_ids: torch.Tensor, last: bool, key: Hashable
    ) -> tuple[BaseCacheHandle, torch.Tensor | np.ndarray]:
        """Steps 1 and 2 for ``input_ids`` (``ids``: its NumPy view): the fused call in the form
        the manager takes (``host``, ``fused``), or one call at a time."""
        if self.host:
            return self.hm.match_and_lock(ids[:-1] if last else ids, key)
        if self.fused:
            return self.manager.match_and_lock(input_ids[:-1] if last else input_ids, key)
        return self.match_lock(rid, input_ids, last, key)

    def insert_tensors(self, req: Request, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``req``'s first ``n`` ids and slots as tensors (slots on the device)."""
        h = req.host
        idx = torch.from_numpy(h.slots[:n]) if self._on_cpu else req.indices[:n]
        return torch.from_numpy(h.ids[:n]), idx

    def insert_fused(self, req: Request, n: int, relock: bool = False) -> InsertResult:
        """`insert_and_unlock` of ``req``'s first ``n`` tokens, in the form the manager takes."""
        h = req.host
        if self.host:
            return self.hm.insert_and_unlock(
                req.handle, h.ids[:n], h.slots[:n], req.extra_key, relock=relock
            )
        ids, idx = self.insert_tensors(req, n)
        return self.manager.insert_and_unlock(req.handle, ids, idx, req.extra_key, relock=relock)

    def match_lock(
        self, rid: int, ids: torch.Tensor, compute_last: bool, key: Hashable
    ) -> tuple[BaseCacheHandle, torch.Tensor]:
        """Steps 1 and 2 one call at a time (traced, or a manager without fused calls)."""
        handle, prefix = keyed(self.manager.match_prefix, key, ids[:-1] if compute_last else ids)
        m = handle.cached_len
        if self.trace is not None:
            self.trace(rid, 1, "match_prefix", f"cached_len={m} indices={prefix.tolist()}")
        self.manager.lock_handle(handle)
        if self.trace is not None:
            self.trace(rid, 2, "lock_handle", f"protected={self.manager.size_info.protected_size}")
        return handle, prefix

    def reset_cache(self, running: list[int]) -> int:
        """`RequestFlow.reset_prefix_cache` (``running``: the rids still running)."""
        if running:
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
        self.allocator.free_slots(cached)  # validates every page first: raises changing nothing
        self.manager.reset()
        return int(cached.shape[0])

    def available(self) -> int:
        """Pages that could be handed out now: free ones plus those eviction could free."""
        return (
            self.allocator.num_free_pages + self.manager.size_info.evictable_size // self.page_size
        )

    def pages_for(self, length: int, k: int) -> int:
        """New pages that ``k`` more tokens take after ``length`` (the last page filled first)."""
        ps = self.page_size
        rest = k - min(k, -length % ps)
        return -(-rest // ps)

    def make_room(self, rid: int, num_pages: int) -> None:
        """Evict from the manager until ``num_pages`` pages are free, or raise changing nothing."""
        short = num_pages - self.allocator.num_free_pages
        if short <= 0:
            return
        evictable = self.manager.size_info.evictable_size // self.page_size
        if short > evictable:
            raise RuntimeError(
                f"out of KV pages: need {num_pages}, {self.allocator.num_free_pages} free and {evictable} evictable"
            )
        slots = (
            self.hm.evict(short * self.page_size, host=True)
            if self._evict_host
            else self.manager.evict(short * self.page_size)
        )
        # A manager evicts what the flow inserted: whole pages, page after page, so their pages
        # are every page_size-th slot (O(pages) to check); anything else takes the full check.
        if len(slots) % self.page_size:
            self.allocator.free_slots(slots)
        else:
            self.allocator.free_page_runs(slots)
        stats = self.stats
        stats.evicted_tokens += len(slots)
        stats.evictions += 1
        if self.trace is not None:
            self.trace(
                rid, 3, "evict", f"evicted {slots.shape[0]} cached tokens to free {short} pages"
            )

    def allocate_pages(self, rid: int, num_pages: int, out: np.ndarray, start: int) -> None:
        """Every slot of ``num_pages`` new pages into ``out`` from ``start`` on
        (`PageAllocator.allocate_page_slots`), evicting first when the free list is short;
        ``RuntimeError`` changing nothing when the pool cannot hold them."""
        if num_pages > self.allocator.num_free_pages:
            self.make_room(rid, num_pages)
        self.allocator.allocate_page_slots(num_pages, out, start)
        if self.trace is not None:
            slots = out[start : start + num_pages * self.page_size]
            self.trace(rid, 3, "allocate", f"pages {self.allocator.slots_to_pages(slots).tolist()}")

    def append(self, req: Request, new_ids: np.ndarray) -> np.ndarray:
        """Append ``new_ids`` (1-D, at least one) to ``req``'s host copy with their slots: the last
        page's free slots first, then new pages (written whole: the tokens after these fill
        their rest). Returns the new slots (a view of the copy); ``RuntimeError`` changing
        nothing when the pool cannot take the new pages."""
        h = req.host
        k, length, filled = len(new_ids), h.length, h.filled
        end = length + k
        if end > filled:
            ps = self.page_size
            if filled == length and length % ps:  # the last page's rest not known: work it out
                filled = length - length % ps + ps
                h.reserve(filled - length)
                self._fill_last_page(h.slots, length, filled)
                h.filled = filled
            if end > filled:
                num_pages = -(-(end - filled) // ps)
                if filled + num_pages * ps > len(h.slots):
                    h.reserve(filled + num_pages * ps - length)  # keeps slots[:filled]
                if self.trace is None and num_pages <= self.allocator.num_free_pages:
                    self.allocator.allocate_page_slots(num_pages, h.slots, filled)
                else:
                    self.allocate_pages(req.rid, num_pages, h.slots, filled)
                h.filled = filled + num_pages * ps
        h.ids[length:end] = new_ids
        h.length = end
        self.stats.decoded_tokens += k
        return h.slots[length:end]

    def _fill_last_page(self, slots: np.ndarray, length: int, stop: int) -> None:
        """``slots[length:stop]``: the slots after ``slots[length - 1]`` on its page."""
        np.add(self._steps[: stop - length], slots[length - 1], out=slots[length:stop])

    def free_finished(
        self, slots: np.ndarray, lo: int, already: int, n: int, length: int
    ) -> list[int]:
        """Free what a request with host ``slots`` frees on finishing after inserting its first
        ``n`` of ``length`` tokens: its own pages in ``[lo, already)`` (the tree had them first)
        and those past ``n``. Both runs start on a page, so each page is named by its first slot
        (`PageAllocator.free_page_runs`): one call, all or nothing. Returns the pages freed
        when the flow is traced (``[]`` otherwise)."""
        if already > lo:
            run = (
                slots[lo:already]
                if n == length
                else np.concatenate([slots[lo:already], slots[n:length]])
            )
        elif n < length:
            run = slots[n:length]
        else:
            return []
        self.allocator.free_page_runs(run)
        return aligned_run_pages(run, self.page_size).tolist() if self.trace is not None else []

    def share_tree_pages(self, req: Request, handle: BaseCacheHandle, lo: int, hi: int) -> None:
        """After the insert of a request that keeps running: its own pages in ``[lo, hi)``
        duplicate the tree's (another request inserted those tokens first). Frees them and points
        the request's slots there at the tree's (``handle``'s), in a new host copy, so tensors
        handed out before keep their values."""
        h = req.host
        dup = h.slots[lo:hi].copy()
        self.allocator.free_page_runs(dup)  # own pages from a page start: whole pages
        if self.trace is not None:
            pages = aligned_run_pages(dup, self.page_size).tolist()
            self.trace(req.rid, 5, "free", f"duplicate pages {pages}")
        slots = h.slots[: h.length].copy()
        slots[:hi] = self.manager.handle_indices(handle)[:hi].cpu().numpy()
        req.host = HostCopy(h.ids[: h.length], slots)
