"""`FlowPageCalls`: the `PageAllocator` calls the request flow makes on every request.

Written for the flow's hot path, where a call's fixed cost is most of its cost: whole pages
written straight into a request's host array (so the tokens that later fill its last page cost
nothing), and one page given back by its first slot (a finished request's partial last page),
each checked with a few scalar tests before anything changes.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .._validate import check_size

__all__ = ["FlowPageCalls", "write_slots"]

_I32 = np.dtype(np.int32)
_FALSE = np.zeros((), dtype=np.bool_)


def _unwritable(out: np.ndarray) -> ValueError:
    return ValueError(f"out must be a writeable array, got a read-only one: {out!r:.80}")


def write_slots(out: np.ndarray, values: np.ndarray | int) -> None:
    """``out[:] = values``, with ``ValueError`` naming ``out`` when it is read-only."""
    try:
        out[:] = values
    except ValueError as e:
        raise _unwritable(out) from e


class FlowPageCalls:
    """The flow's half of `PageAllocator` (not an allocator on its own)."""

    # The allocator's state these calls read and write (set by `PageAllocator`).
    num_pages: int
    page_size: int
    _ring: np.ndarray
    _head: int
    _count: int
    _free_bytes: bytearray
    _is_free: np.ndarray
    _rows: np.ndarray | None
    _offsets: np.ndarray
    _pow2: bool
    _shift: int

    _take: Callable[[int, int], np.ndarray]

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
