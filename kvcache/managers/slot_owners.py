"""`SlotOwners`: which pages a prefix tree holds, so an insert can refuse a slot it cannot hold.

A stamp per page in a NumPy array that grows to the largest page seen (0: free). Checking and
holding the new pages of an insert is a handful of array operations over those pages only,
never over the pool or the tree: a gather that fails for a negative slot (read as unsigned at
page size 1; at larger sizes the one gather of each page's row that proves whole aligned pages
cannot match one), one gather to find pages already held, and a scatter of each page's position
read back to find a page listed twice (it keeps only one of its positions). Only a refused call
works out which rule failed. The pages are returned, so that a node keeps them and eviction
frees them without recomputing them. The choices are measured: ``intp`` indices, ``count_nonzero``
and comparing arrays as bytes are each several times cheaper than an ``int32`` gather, ``any()``
or ``(a != b).any()`` on arrays of a few hundred entries.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SlotOwners"]


class SlotOwners:
    """Pages (``slot // page_size``) held by a tree; slots arrive as whole aligned pages."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._ps = np.intp(page_size)
        self.clear()

    def clear(self) -> None:
        self._owner = np.zeros(1024, dtype=np.int32)  # per page: 0 free, else held
        self._rows, self._page_of = self._page_rows(1024)
        self._stamps = np.arange(1, 1025, dtype=np.int32)
        self._count = 0

    @property
    def count(self) -> int:
        """Pages held."""
        return self._count

    def held(self, pages: np.ndarray) -> np.ndarray:
        """Which of ``pages`` (non-negative) are held, as a bool array."""
        out = np.zeros(len(pages), dtype=np.bool_)
        inside = pages < len(self._owner)
        out[inside] = self._owner[pages[inside]] != 0
        return out

    def claim_new(self, slots: np.ndarray, name: str = "indices") -> np.ndarray:
        """Hold the pages of ``slots`` (1-D int32, a multiple of ``page_size`` long), or refuse;
        return those pages (``intp``, one per page: what `release_pages` takes back).

        Raises ``ValueError`` naming the value, holding nothing, when a slot is negative, a page
        is not ``page_size`` consecutive slots starting at a multiple of ``page_size``, a page is
        already held, or a page appears twice.
        """
        ps = self.page_size
        owner = self._owner
        if ps == 1:
            # Read as unsigned, a negative slot is a page past any table: it fails the gather.
            pages = slots.view(np.uint32).astype(np.intp)
            try:
                before = owner[pages]
            except IndexError:
                self._outside(slots, pages, name)
                owner = self._owner
                before = owner[pages]
        else:
            # Each page's first slot looks its page up (-1: not a page's first slot), then one
            # gather of those pages' rows and one memcmp prove whole aligned pages, and no
            # negative slot: a negative index wraps to a row of non-negative slots, unequal.
            try:
                pages = self._page_of.take(slots[::ps])
                aligned = self._rows.take(pages, axis=0).tobytes() == slots.tobytes()
            except IndexError:  # past the tables kept (or far below 0): the slow path decides
                pages = slots[::ps].astype(np.intp)
                pages //= self._ps
                aligned = self._outside(slots, pages, name)
                owner = self._owner
            if not aligned:
                self._refuse_alignment(slots, name)
            before = owner[pages]
        if np.count_nonzero(before):
            bad = pages[before != 0]
            raise ValueError(
                f"{name} holds slots the cache already holds (pages starting at "
                f"{(bad * ps).tolist()[:8]}); a slot can hold one token's K/V only"
            )
        # Stamp each page with its position (from 1): a page listed twice keeps one stamp only.
        n = len(pages)
        if len(self._stamps) < n:
            self._stamps = np.arange(1, 2 * n + 1, dtype=np.int32)
        stamps = self._stamps[:n]
        owner[pages] = stamps
        if owner[pages].tobytes() != stamps.tobytes():  # compared as bytes: one memcmp
            twice = owner[pages] != stamps
            owner[pages] = 0
            raise ValueError(
                f"{name} lists the same slot more than once: {(pages[twice] * ps).tolist()[:8]}"
            )
        self._count += n
        return pages

    def _outside(self, slots: np.ndarray, pages: np.ndarray, name: str) -> bool:
        """The slow path for ``pages`` past the tables: refuse a negative slot, grow the tables
        to hold every page, and say whether ``slots`` are whole aligned pages (the caller
        refuses them if not)."""
        if len(slots) and slots[slots.argmin()] < 0:
            raise ValueError(f"{name} must be >= 0, got {int(slots.min())}")
        if int(pages.max()) >= len(self._owner):
            self._grow(int(pages.max()) + 1)
        return self.page_size == 1 or self._rows_of(pages).tobytes() == slots.tobytes()

    def _refuse_alignment(self, slots: np.ndarray, name: str) -> None:
        """The error for ``slots`` that are not whole aligned pages (a negative one named first)."""
        if slots[slots.argmin()] < 0:
            raise ValueError(f"{name} must be >= 0, got {int(slots.min())}")
        ps = self.page_size
        raise ValueError(
            f"with page_size={ps} every {ps} {name} must be the consecutive slots of one "
            f"page (first slot a multiple of {ps}); got {slots.tolist()}"
        )

    def _rows_of(self, pages: np.ndarray) -> np.ndarray:
        """The slots of ``pages`` (non-negative), row after row."""
        try:
            return self._rows.take(pages, axis=0)
        except IndexError:  # past the rows kept: computed
            ps = self.page_size
            return (pages[:, None] * ps + np.arange(ps)).astype(np.int32)

    def _page_rows(self, num_pages: int) -> tuple[np.ndarray, np.ndarray]:
        """Row ``p``: the slots of page ``p`` (int32, ``(num_pages, page_size)``), and per slot
        its page if it is a page's first slot, else -1 (``intp``: a gather there is cheaper
        than dividing), for the pages the tree has seen, up to 2M slots (none needed, and none
        kept, for ``page_size == 1``)."""
        ps = self.page_size
        n = min(num_pages, (1 << 21) // ps) if ps > 1 else 0  # at most 8 + 16 MiB
        page_of = np.full(n * ps, -1, dtype=np.intp)
        page_of[::ps] = np.arange(n)
        return np.arange(n * ps, dtype=np.int32).reshape(n, ps), page_of

    def _grow(self, size: int) -> None:
        # Never past 2**31 pages (int32 slots have fewer): a negative slot read as unsigned, as
        # `claim_new` reads it at page size 1, is then always past the end.
        owner = np.zeros(min(max(size, 2 * len(self._owner)), 1 << 31), dtype=np.int32)
        owner[: len(self._owner)] = self._owner
        self._owner = owner
        self._rows, self._page_of = self._page_rows(len(owner))

    def release(self, slots: np.ndarray) -> None:
        """Mark the pages of ``slots`` (whole pages the tree held) as free again."""
        pages = slots[:: self.page_size] // self.page_size if self.page_size > 1 else slots
        self.release_pages(pages.astype(np.intp))

    def release_pages(self, pages: np.ndarray) -> None:
        """Mark ``pages`` (``intp``, as `claim_new` returned them) as free again."""
        self._owner[pages] = 0
        self._count -= len(pages)
