"""`PageAllocator`: the free list of KV pages, and the mapping between pages and token slots.

A page is ``page_size`` consecutive token slots: page ``p`` holds slots
``p * page_size ... p * page_size + page_size - 1``. The allocator hands out and takes back whole
pages; a request that fills part of its last page keeps the rest of that page for later tokens.

Read top to bottom: the free list (a ring of page ids and a mask of free pages), the calls that
hand pages out (`allocate`, `allocate_slots` as tensors; `allocate_host_slots` and
`allocate_page_slots` into host NumPy arrays, for the request flow, which keeps its requests'
slots there), the calls that take them back (`free` by page, `free_slots` and `free_page_runs` by
slot, `free_page_start` for one page), and the page <-> slot mapping. Every call checks before it
changes anything: a refused call leaves the allocator as it was.
"""

from __future__ import annotations

import numpy as np
import torch

from .._validate import (
    MAX_SLOTS,
    Device,
    check_device,
    check_host_bytes,
    check_id_array,
    check_int_in,
    check_positive_int,
    check_size,
    native_order,
    pages_to_slots,
    slots_to_pages,
)

__all__ = ["PageAllocator"]

#: Up to this many pages, a free runs in plain Python on a list: measured, list work costs less
#: than the fixed cost of the dozen NumPy calls it replaces up to 32-48 pages.
_FEW = 32

_INT_DTYPES = frozenset((torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8))
_I32 = np.dtype(np.int32)
_FALSE = np.zeros((), dtype=np.bool_)


def _unwritable(out: np.ndarray) -> ValueError:
    return ValueError(f"out must be a writeable array, got a read-only one: {out!r:.80}")


def _write_slots(out: np.ndarray, values: np.ndarray | int) -> None:
    """``out[:] = values``, with ``ValueError`` naming ``out`` when it is read-only."""
    try:
        out[:] = values
    except ValueError as e:
        raise _unwritable(out) from e


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
        # The free ring (int64), the scratch stamps (int32) and the free mask (a byte) per page.
        check_host_bytes(13 * num_pages, f"PageAllocator of num_pages={num_pages}")
        self.device = check_device(device)
        self.num_pages, self.page_size = num_pages, page_size
        self._on_cpu = self.device.type == "cpu"
        self._offsets = np.arange(page_size, dtype=np.int64)
        # Power-of-two pages (the usual case): page of a slot by shift, page start by mask.
        self._pow2 = page_size & (page_size - 1) == 0
        self._shift = page_size.bit_length() - 1
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
        # The free mask, for Python (one page: a bytearray index) and NumPy (a view of it) alike.
        self._free_bytes = bytearray(b"\x01") * self.num_pages
        self._is_free = np.frombuffer(self._free_bytes, dtype=np.bool_)
        # Scratch for `_push_new`'s check for a page listed twice (only the stamps just written
        # are ever read back, so none needs clearing).
        self._stamp = np.zeros(self.num_pages, dtype=np.int32)
        self._seq = np.arange(1, 1025, dtype=np.int32)

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
        # ``out`` is written before the free list changes: a write that fails (``out`` read-only)
        # must leave the pages free.
        if out is not None and k == 1:
            # One page (a short prompt or a decode step): scalar work, no fancy indexing.
            p = int(self._ring[head])
            _write_slots(
                out,
                p
                if ps == 1
                else self._rows[p, :n]
                if self._rows is not None
                else p * ps + self._offsets[:n],
            )
            self._head = head + 1 if head + 1 < self.num_pages else 0
            self._count -= 1
            self._free_bytes[p] = 0
            return out
        # A view of the ring where the pages do not wrap (no copy: they are read once, below).
        pages = self._ring[head : head + k] if head + k <= self.num_pages else self._take(head, k)
        if ps == 1:
            slots = pages
        elif self._rows is not None:
            slots = self._rows.take(pages, axis=0).reshape(-1)[:n]
        else:
            slots = (pages[:, None] * ps + self._offsets).reshape(-1)[:n]
        if out is None:
            slots = slots.astype(np.int32)  # a copy: ``pages`` is a view of the ring
        else:
            _write_slots(out, slots)
        self._head = (head + k) % self.num_pages
        self._count -= k
        self._is_free[pages] = False
        if out is None:
            return slots
        return out

    def allocate_page_slots(self, num_pages: int, out: np.ndarray, start: int = 0) -> None:
        """Take ``num_pages`` pages off the free list and write every slot of them, page after
        page, into ``out[start : start + num_pages * page_size]`` (``out``: a C-contiguous 1-D
        int32 NumPy array of at least that many entries; the rest is left as it was).

        For a caller that keeps the unused tail of its last page at hand (the request flow: a
        request's next tokens fill it with no call at all). ``TypeError``/``ValueError`` for a bad
        ``num_pages``, ``out`` or ``start``, ``RuntimeError`` if fewer pages are free; nothing is
        taken then.
        """
        k = (
            num_pages
            if type(num_pages) is int and num_pages >= 0
            else check_size(num_pages, "num_pages")
        )
        if type(start) is not int or start < 0:
            start = check_size(start, "start")
        ps = self.page_size
        size = k * ps
        end = start + size
        if (
            type(out) is not np.ndarray
            or out.dtype is not _I32
            or out.ndim != 1
            or len(out) < end
            or (out.strides[0] != 4 and not out.flags.c_contiguous)  # a reshape must be a view
        ):
            raise ValueError(
                f"out must be a C-contiguous 1-D int32 NumPy array of at least {end} entries, "
                f"got {out!r:.80}"
            )
        if k > self._count:
            raise RuntimeError(f"cannot allocate {k} pages: only {self._count} are free")
        head = self._head
        # ``out`` is written before the free list changes: a write that fails (``out`` read-only)
        # must leave the pages free.
        if k == 1:  # one page (a short prompt, a decode step): scalar work, no fancy indexing
            p = self._ring.item(head)
            try:
                if ps == 1:
                    out[start] = p
                else:
                    out[start:end] = (
                        self._rows[p] if self._rows is not None else p * ps + self._offsets
                    )
            except ValueError as e:
                raise _unwritable(out) from e
            self._head = head + 1 if head + 1 < self.num_pages else 0
            self._count -= 1
            self._free_bytes[p] = 0
            return
        stop = head + k
        pages = self._ring[head:stop] if stop <= self.num_pages else self._take(head, k)
        try:
            if ps == 1:
                out[start:end] = pages
            elif self._rows is not None:  # a gather of the pages' rows, straight into ``out``
                self._rows.take(pages, axis=0, out=out[start:end].reshape(k, ps), mode="clip")
            else:
                out[start:end].reshape(k, ps)[:] = pages[:, None] * ps + self._offsets
        except ValueError as e:
            raise _unwritable(out) from e
        self._head = stop if stop < self.num_pages else stop - self.num_pages
        self._count -= k
        self._is_free[pages] = _FALSE  # a 0-d array: no conversion of a Python bool per call

    def free_page_start(self, slot: int) -> None:
        """Return the one page whose first slot is ``slot`` (a Python int) to the end of the free
        list: a request's partial last page. ``TypeError`` when ``slot`` is not an int,
        ``ValueError`` when it is not in ``[0, num_slots)`` or does not start a page,
        ``RuntimeError`` when its page is free already; nothing changes then."""
        if type(slot) is not int:
            raise TypeError(f"slot must be an int, got {type(slot).__name__}")
        ps = self.page_size
        p = slot >> self._shift if self._pow2 else slot // ps
        if not 0 <= p < self.num_pages or p * ps != slot:
            raise ValueError(
                f"slot must start one of the {self.num_pages} pages of {ps} slots, got {slot}"
            )
        if self._free_bytes[p]:
            raise RuntimeError(f"double free: page {p} is already free")
        self._free_bytes[p] = 1
        tail = self._head + self._count
        self._ring[tail - self.num_pages if tail >= self.num_pages else tail] = p
        self._count += 1

    def free(self, pages: torch.Tensor | np.ndarray) -> None:
        """Return ``pages`` (1-D integer tensor or NumPy array of page ids) to the end of the free list."""
        if type(pages) is np.ndarray and pages.shape == (1,) and pages.dtype.kind in "iu":
            p = int(pages[0])  # one page (a request's partial last one): checked in Python
            if not 0 <= p < self.num_pages:
                raise ValueError(f"pages: {p} is outside [0, {self.num_pages})")
            self._push_list([p])
            return
        self._push(check_id_array(pages, "pages", self.num_pages))

    def free_slots(self, slots: torch.Tensor | np.ndarray) -> None:
        """Return the pages that ``slots`` (1-D integer tensor or NumPy array) touch:
        ``free(slots_to_pages(slots))``."""
        arr = check_id_array(slots, "slots", self.num_slots)
        self._push(slots_to_pages(arr, self.page_size))

    def free_page_runs(self, slots: torch.Tensor | np.ndarray) -> None:
        """Return the pages of ``slots`` laid out page after page from a page start, the last
        page possibly partial: what a manager evicts, or a request's own slots from a page
        boundary on. Their pages are ``slots[::page_size] // page_size``.

        Only those first slots are read (a page's other slots are its own by layout), so this
        costs O(pages), where `free_slots` reads every slot. ``ValueError`` when one of them is
        outside ``[0, num_slots)`` or not a page start, and as `free` otherwise (``RuntimeError``
        for a page already free, ``ValueError`` for one listed twice); nothing changes on a raise.
        """
        ps = self.page_size
        if (
            type(slots) is np.ndarray
            and slots.ndim == 1
            and 0 < slots.shape[0] <= ps
            and slots.dtype.kind in "iu"
        ):
            # One page (a request's partial last one): scalar work; anything amiss falls through
            # to the checks below, which raise.
            s = int(slots[0])
            p = s // ps
            if 0 <= s < self.num_slots and p * ps == s and not self._free_bytes[p]:
                self._free_bytes[p] = 1
                tail = self._head + self._count
                self._ring[tail - self.num_pages if tail >= self.num_pages else tail] = p
                self._count += 1
                return
        if isinstance(slots, np.ndarray):
            if slots.dtype.kind not in "iu":
                check_id_array(slots, "slots", self.num_slots)  # raises naming the dtype
            arr = native_order(slots)
        else:
            if not isinstance(slots, torch.Tensor) or slots.dtype not in _INT_DTYPES:
                check_id_array(slots, "slots", self.num_slots)  # raises naming what it got
            try:
                arr = slots.numpy() if slots.is_cpu else slots.cpu().numpy()
            except (TypeError, RuntimeError, NotImplementedError):  # sparse, meta: no host copy
                check_id_array(slots, "slots", self.num_slots)  # raises naming why
                raise
        if arr.ndim != 1:
            raise ValueError(f"slots must be 1-D, got shape {tuple(arr.shape)}")
        starts = arr[::ps] if ps > 1 else arr
        k = starts.shape[0]
        if k <= _FEW and self._free_starts(starts.tolist()):
            return  # otherwise one of them is amiss: the checks below raise naming it
        if k == 0:
            return
        if starts.dtype == np.int32 and self._pow2:  # what managers evict: fewest array ops
            # As intp (NumPy's index type: a gather or scatter with it costs a fraction of one
            # with int32); read unsigned first, so a negative slot is a huge page.
            pages = starts.view(np.uint32).astype(np.intp)
            if ps > 1:
                pages >>= self._shift
            try:  # the gather checks the range
                already: np.ndarray | None = self._is_free[pages]
            except IndexError:
                already = None  # out of range: raised below, naming the slot
            if already is not None and (ps == 1 or not np.count_nonzero(starts & (ps - 1))):
                self._push_new(pages, already)
                return
        starts = check_id_array(starts, "slots", self.num_slots)  # range, on the starts only
        if ps == 1:
            self._push(starts)
            return
        off = starts & (ps - 1) if self._pow2 else starts % ps
        if np.count_nonzero(off):
            bad = int(starts[np.flatnonzero(off)[0]])
            raise ValueError(f"slots: {bad} does not start a page of {ps} slots")
        self._push(starts >> self._shift if self._pow2 else starts // ps)

    def _free_starts(self, starts: list[int]) -> bool:
        """Free the pages whose first slots are ``starts`` (Python ints) in one pass: each is
        checked (in range, a page start, its page handed out and not listed before) as it is
        marked free. Returns False, having changed nothing, at the first that fails, for the
        caller's full checks to raise naming it; a few dozen ints cost less this way than the
        dozen array calls of the NumPy path."""
        free, limit, ps = self._free_bytes, self.num_pages * self.page_size, self.page_size
        pages = []
        if self._pow2:
            mask, shift = ps - 1, self._shift
            for s in starts:
                if not 0 <= s < limit or s & mask or free[s >> shift]:
                    break
                free[s >> shift] = 1
                pages.append(s >> shift)
        else:
            for s in starts:
                if not 0 <= s < limit or s % ps or free[s // ps]:
                    break
                free[s // ps] = 1
                pages.append(s // ps)
        n = len(pages)
        if n < len(starts):  # a page listed twice fails here too: it was marked free above
            for p in pages:
                free[p] = 0
            return False
        self._append_ring(pages)
        return True

    def _push_list(self, pages: list[int]) -> None:
        """`_push` of a short Python list of pages in range: no array ops but the ring write."""
        free = self._free_bytes
        already = [p for p in pages if free[p]]
        if already:
            raise RuntimeError(f"double free: pages {already} are already free")
        n = len(pages)
        if n > 1 and len(set(pages)) != n:
            raise ValueError(f"pages listed more than once: {pages}")
        for p in pages:
            free[p] = 1
        self._append_ring(pages)

    def _append_ring(self, pages: list[int]) -> None:
        """Queue ``pages`` (already marked free) at the ring's tail, wrapping around its end."""
        n = len(pages)
        tail, size = self._head + self._count, self.num_pages
        if tail >= size:
            tail -= size
        if n == 1:
            self._ring[tail] = pages[0]
        elif tail + n <= size:
            self._ring[tail : tail + n] = pages
        else:
            first = size - tail
            self._ring[tail:] = pages[:first]
            self._ring[: n - first] = pages[first:]
        self._count += n

    def _push(self, pages: np.ndarray) -> None:
        """Free ``pages`` (page ids already known to be in range), or change nothing and raise."""
        n = pages.shape[0]
        if n <= _FEW:
            if n:
                self._push_list(pages.tolist())
            return
        self._push_new(pages, self._is_free[pages])

    def _push_new(self, arr: np.ndarray, already: np.ndarray) -> None:
        """`_push` of pages ``arr`` (in range) whose free flags are ``already``."""
        n = arr.shape[0]
        if np.count_nonzero(already):  # count_nonzero: cheaper than any() on small arrays
            raise RuntimeError(f"double free: pages {arr[already].tolist()} are already free")
        # A page listed twice: stamp each page with its position and read the stamps back (a
        # page listed twice keeps one of them); O(pages), where sorting to find it is not.
        if self._seq.shape[0] < n:
            self._seq = np.arange(1, 2 * n + 1, dtype=np.int32)
        seq = self._seq[:n]
        self._stamp[arr] = seq
        if self._stamp[arr].tobytes() != seq.tobytes():
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
