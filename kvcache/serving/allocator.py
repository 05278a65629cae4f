"""`PageAllocator`: the free list of KV pages, and the mapping between pages and token slots.

A page is ``page_size`` consecutive token slots: page ``p`` holds slots
``p * page_size ... p * page_size + page_size - 1``. The allocator hands out and takes back whole
pages; a request that fills part of its last page keeps the rest of that page for later tokens.
"""

from __future__ import annotations

import numpy as np
import torch

from .._validate import check_positive_int, check_size

__all__ = ["PageAllocator"]


class PageAllocator:
    """Free list of ``num_pages`` pages, handed out in FIFO order as int32 tensors on ``device``.

    The bookkeeping lives on the host in NumPy, as in vLLM's block pool: a ring buffer for the
    free list and a mask of free pages, a few small array operations per call, where the same
    work as torch ops costs a dispatch each (and, on a GPU, a kernel launch and a sync for every
    check). Only the pages handed out travel to ``device``.

    Promises: a page is either free or handed out, never both; ``free`` refuses a page that is
    out of range, already free, or listed twice, and changes nothing when it refuses.
    """

    def __init__(self, num_pages: int, page_size: int = 1, device: torch.device | str = "cpu") -> None:
        self.num_pages = check_positive_int(num_pages, "num_pages")
        self.page_size = check_positive_int(page_size, "page_size")
        self.device = torch.device(device)
        self.reset()

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def num_free_pages(self) -> int:
        return self._count

    def free_pages(self) -> torch.Tensor:
        """The free pages, in the order they will be handed out (1-D int32 on ``device``, a copy)."""
        return torch.from_numpy(self._take(self._head, self._count)).to(self.device)

    def reset(self) -> None:
        """Every page free again, in order ``0 .. num_pages - 1``."""
        # The free list is a ring of capacity num_pages (it never holds more): allocate reads at
        # the head, free writes after the tail, so both cost O(pages moved), not O(pool).
        self._ring = np.arange(self.num_pages, dtype=np.int32)
        self._head = 0
        self._count = self.num_pages
        self._is_free = np.ones(self.num_pages, dtype=np.bool_)

    def _take(self, start: int, n: int) -> np.ndarray:
        """A copy of ``n`` ring entries from ``start``, wrapping around."""
        end = start + n
        if end <= self.num_pages:
            return self._ring[start:end].copy()
        return np.concatenate([self._ring[start:], self._ring[: end - self.num_pages]])

    def allocate(self, num_pages: int) -> torch.Tensor:
        """Take ``num_pages`` pages off the free list; ``RuntimeError`` if fewer are free."""
        check_size(num_pages, "num_pages")
        if num_pages > self._count:
            raise RuntimeError(f"cannot allocate {num_pages} pages: only {self._count} are free")
        pages = self._take(self._head, num_pages)
        self._head = (self._head + num_pages) % self.num_pages
        self._count -= num_pages
        self._is_free[pages] = False
        out = torch.from_numpy(pages)
        return out if self.device.type == "cpu" else out.to(self.device)

    def free(self, pages: torch.Tensor) -> None:
        """Return ``pages`` (1-D integer tensor) to the end of the free list."""
        if not isinstance(pages, torch.Tensor) or pages.dim() != 1 or pages.is_floating_point():
            raise TypeError(f"pages must be a 1-D integer tensor, got {pages!r}")
        if pages.shape[0] == 0:
            return
        arr = pages.cpu().numpy().astype(np.int32, copy=True)
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= self.num_pages:
            bad = lo if lo < 0 else hi
            raise ValueError(f"page {bad} is outside [0, {self.num_pages})")
        already = self._is_free[arr]
        if already.any():
            raise RuntimeError(f"double free: pages {arr[already].tolist()} are already free")
        if arr.shape[0] > 1:
            ordered = np.sort(arr)
            if (ordered[1:] == ordered[:-1]).any():
                raise ValueError(f"pages listed more than once: {arr.tolist()}")
        self._is_free[arr] = True
        # Pages not free are handed out, so the ring has room for them: no overflow possible.
        tail = (self._head + self._count) % self.num_pages
        first = min(arr.shape[0], self.num_pages - tail)
        self._ring[tail:tail + first] = arr[:first]
        self._ring[: arr.shape[0] - first] = arr[first:]
        self._count += arr.shape[0]

    # ------------------------------------------------------- pages <-> slots
    def pages_to_slots(self, pages: torch.Tensor, num_tokens: int | None = None) -> torch.Tensor:
        """Slots of ``pages`` in order, cut to the first ``num_tokens`` (default: all), int32."""
        ps = self.page_size
        if ps == 1:
            slots = pages if pages.dtype == torch.int32 else pages.to(torch.int32)
        else:
            offsets = torch.arange(ps, dtype=torch.int32, device=pages.device)
            slots = (pages.to(torch.int32)[:, None] * ps + offsets).reshape(-1)
        if num_tokens is not None:
            if not 0 <= num_tokens <= len(slots):
                raise ValueError(f"num_tokens must be in [0, {len(slots)}], got {num_tokens}")
            slots = slots[:num_tokens]
        return slots

    def slots_to_pages(self, slots: torch.Tensor) -> torch.Tensor:
        """The distinct pages that ``slots`` touch, in first-touch order (int32).

        Slots of one request are laid out page after page, so this is every ``page_size``-th
        slot divided by ``page_size`` when the run starts on a page boundary.
        """
        if slots.shape[0] == 0 or self.page_size == 1:
            return slots if slots.dtype == torch.int32 else slots.to(torch.int32)
        pages = torch.div(slots, self.page_size, rounding_mode="floor").to(torch.int32)
        keep = torch.ones(len(pages), dtype=torch.bool, device=pages.device)
        keep[1:] = pages[1:] != pages[:-1]
        return pages[keep]
