"""`PageAllocator`: the free list of KV pages, and the mapping between pages and token slots.

A page is ``page_size`` consecutive token slots: page ``p`` holds slots
``p * page_size ... p * page_size + page_size - 1``. The allocator hands out and takes back whole
pages; a request that fills part of its last page keeps the rest of that page for later tokens.
"""

from __future__ import annotations

import numpy as np
import torch

from .._validate import (
    MAX_SLOTS,
    Device,
    check_device,
    check_id_array,
    check_int_in,
    check_positive_int,
    check_size,
    pages_to_slots,
    slots_to_pages,
)

__all__ = ["PageAllocator"]


class PageAllocator:
    """Free list of ``num_pages`` pages, handed out in FIFO order as int32 tensors on ``device``.

    The bookkeeping lives on the host in NumPy, as in vLLM's block pool: a ring buffer for the
    free list and a mask of free pages, a few small array operations per call, where the same
    work as torch ops costs a dispatch each (and, on a GPU, a kernel launch and a sync for every
    check). Only the pages handed out travel to ``device``.

    Promises: a page is either free or handed out, never both; ``free`` refuses a page that is
    out of range (checked before any cast: ``2**32 + 1`` is not page 1), already free, listed
    twice, or not given as an integer tensor, and changes nothing when it refuses. Every slot fits
    in ``int32`` (``num_pages * page_size <= 2**31 - 1``).
    """

    def __init__(self, num_pages: int, page_size: int = 1, device: Device = "cpu") -> None:
        num_pages = check_positive_int(num_pages, "num_pages")
        page_size = check_positive_int(page_size, "page_size")
        if num_pages * page_size > MAX_SLOTS:
            raise ValueError(
                f"num_pages * page_size = {num_pages * page_size} slots do not fit in int32 (at most {MAX_SLOTS})"
            )
        self.device = check_device(device)
        self.num_pages, self.page_size = num_pages, page_size
        self._on_cpu = self.device.type == "cpu"
        self._offsets = np.arange(page_size, dtype=np.int64)
        # Each page's slots as a row, so a page's slots are one row gather, not two broadcast
        # ops; kept for pools up to 4M slots (16 MiB), larger ones compute them.
        self._rows = (
            np.arange(num_pages * page_size, dtype=np.int32).reshape(num_pages, page_size)
            if page_size > 1 and num_pages * page_size <= 1 << 22
            else None
        )
        self.reset()

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def num_free_pages(self) -> int:
        return self._count

    def free_pages(self) -> torch.Tensor:
        """The free pages, in the order they will be handed out (1-D int32 on ``device``, a copy)."""
        return self._out(self._take(self._head, self._count).astype(np.int32))

    def reset(self) -> None:
        """Every page free again, in order ``0 .. num_pages - 1``."""
        # The free list is a ring of capacity num_pages (it never holds more): allocate reads at
        # the head, free writes after the tail, so both cost O(pages moved), not O(pool).
        # int64 (NumPy's index type): fancy indexing with it skips a conversion on every call.
        self._ring = np.arange(self.num_pages, dtype=np.int64)
        self._head = 0
        self._count = self.num_pages
        self._is_free = np.ones(self.num_pages, dtype=np.bool_)

    def _out(self, arr: np.ndarray) -> torch.Tensor:
        out = torch.from_numpy(arr)
        return out if self._on_cpu else out.to(self.device)

    def _take(self, start: int, n: int) -> np.ndarray:
        """A copy of ``n`` ring entries from ``start``, wrapping around."""
        end = start + n
        if end <= self.num_pages:
            return self._ring[start:end].copy()
        return np.concatenate([self._ring[start:], self._ring[: end - self.num_pages]])

    def _pop(self, num_pages: int) -> np.ndarray:
        if num_pages > self._count:
            raise RuntimeError(f"cannot allocate {num_pages} pages: only {self._count} are free")
        pages = self._take(self._head, num_pages)
        self._head = (self._head + num_pages) % self.num_pages
        self._count -= num_pages
        self._is_free[pages] = False
        return pages

    def allocate(self, num_pages: int) -> torch.Tensor:
        """Take ``num_pages`` pages off the free list; ``RuntimeError`` if fewer are free."""
        return self._out(self._pop(check_size(num_pages, "num_pages")).astype(np.int32))

    def allocate_slots(self, num_tokens: int) -> torch.Tensor:
        """Slots for ``num_tokens`` tokens on ``ceil(num_tokens / page_size)`` new pages, page after
        page, the last page's unused tail left out: ``(num_tokens,)`` int32 on ``device``.

        ``RuntimeError`` (nothing taken) if too few pages are free.
        """
        return self._out(self.allocate_host_slots(num_tokens))

    def allocate_host_slots(self, num_tokens: int, out: np.ndarray | None = None) -> np.ndarray:
        """`allocate_slots` as a host NumPy ``int32`` array (for bookkeeping on the host), written
        into ``out`` (an int32 array of ``num_tokens`` entries) when given."""
        n = (
            num_tokens
            if type(num_tokens) is int and num_tokens >= 0
            else check_size(num_tokens, "num_tokens")
        )
        if out is not None and (
            not isinstance(out, np.ndarray) or out.dtype != np.int32 or out.shape != (n,)
        ):
            raise ValueError(f"out must be an int32 NumPy array of shape ({n},), got {out!r:.80}")
        ps = self.page_size
        k = -(-n // ps)
        if k > self._count:
            raise RuntimeError(f"cannot allocate {k} pages: only {self._count} are free")
        head = self._head
        if out is not None and k == 1:
            # One page (a short prompt or a decode step): scalar work, no fancy indexing.
            p = int(self._ring[head])
            self._head = head + 1 if head + 1 < self.num_pages else 0
            self._count -= 1
            self._is_free[p] = False
            if ps == 1:
                out[0] = p
            elif self._rows is not None:
                out[:] = self._rows[p, :n]
            else:
                out[:] = p * ps + self._offsets[:n]
            return out
        # A view of the ring where the pages do not wrap (no copy: they are read once, below).
        pages = self._ring[head : head + k] if head + k <= self.num_pages else self._take(head, k)
        self._head = (head + k) % self.num_pages
        self._count -= k
        self._is_free[pages] = False
        if ps == 1:
            slots = pages
        elif self._rows is not None:
            slots = self._rows.take(pages, axis=0).reshape(-1)[:n]
        else:
            slots = (pages[:, None] * ps + self._offsets).reshape(-1)[:n]
        if out is None:
            return slots.astype(np.int32)
        out[:] = slots
        return out

    def free(self, pages: torch.Tensor | np.ndarray) -> None:
        """Return ``pages`` (1-D integer tensor or NumPy array of page ids) to the end of the free list."""
        if type(pages) is np.ndarray and pages.shape == (1,) and pages.dtype.kind in "iu":
            p = int(pages[0])  # one page (a request's partial last one): checked in Python
            if not 0 <= p < self.num_pages:
                raise ValueError(f"pages: {p} is outside [0, {self.num_pages})")
            self._push(pages)
            return
        self._push(check_id_array(pages, "pages", self.num_pages))

    def free_slots(self, slots: torch.Tensor | np.ndarray) -> None:
        """Return the pages that ``slots`` (1-D integer tensor or NumPy array) touch:
        ``free(slots_to_pages(slots))``."""
        arr = check_id_array(slots, "slots", self.num_slots)
        self._push(slots_to_pages(arr, self.page_size))

    def _push(self, pages: np.ndarray) -> None:
        """Free ``pages`` (page ids already known to be in range), or change nothing and raise."""
        n = pages.shape[0]
        if n == 0:
            return
        if n == 1:  # the common case of a request's partial last page: plain Python, no array ops
            p = int(pages[0])
            if self._is_free[p]:
                raise RuntimeError(f"double free: pages [{p}] are already free")
            self._is_free[p] = True
            self._ring[(self._head + self._count) % self.num_pages] = p
            self._count += 1
            return
        arr = pages.astype(np.int64)
        already = self._is_free[arr]
        if np.count_nonzero(already):  # count_nonzero: cheaper than any() on small arrays
            raise RuntimeError(f"double free: pages {arr[already].tolist()} are already free")
        if n <= 64:  # a set of a few dozen Python ints is cheaper than a sort
            if len(set(arr.tolist())) != n:
                raise ValueError(f"pages listed more than once: {arr.tolist()}")
        else:
            ordered = np.sort(arr)
            if np.count_nonzero(ordered[1:] == ordered[:-1]):
                raise ValueError(f"pages listed more than once: {arr.tolist()}")
        self._is_free[arr] = True
        # Pages not free are handed out, so the ring has room for them: no overflow possible.
        tail = (self._head + self._count) % self.num_pages
        first = min(n, self.num_pages - tail)
        self._ring[tail : tail + first] = arr[:first]
        if first < n:
            self._ring[: n - first] = arr[first:]
        self._count += n

    # ------------------------------------------------------- pages <-> slots
    def pages_to_slots(self, pages: torch.Tensor, num_tokens: int | None = None) -> torch.Tensor:
        """Slots of ``pages`` in order, cut to the first ``num_tokens`` (default: all): int32 on
        the device of ``pages``. ``pages`` must be a 1-D integer tensor of ids in ``[0, num_pages)``."""
        arr = check_id_array(pages, "pages", self.num_pages)
        total = arr.shape[0] * self.page_size
        n = total if num_tokens is None else check_int_in(num_tokens, "num_tokens", 0, total)
        out = torch.from_numpy(pages_to_slots(arr, self.page_size)[:n])
        return (
            out
            if not isinstance(pages, torch.Tensor) or pages.device.type == "cpu"
            else out.to(pages.device)
        )

    def slots_to_pages(self, slots: torch.Tensor | np.ndarray) -> torch.Tensor:
        """The distinct pages that ``slots`` touch, in first-touch order: int32 on the device of
        ``slots`` (CPU for a NumPy array). ``slots`` must be a 1-D integer tensor or NumPy array of
        slots in ``[0, num_slots)``.

        Slots of one request are laid out page after page, so a run of slots on one page gives
        that page once.
        """
        arr = check_id_array(slots, "slots", self.num_slots)
        out = torch.from_numpy(slots_to_pages(arr, self.page_size))
        return (
            out
            if not isinstance(slots, torch.Tensor) or slots.device.type == "cpu"
            else out.to(slots.device)
        )
