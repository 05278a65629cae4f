"""`SlotOwners`: which pages a prefix tree holds, so an insert can refuse a slot it cannot hold.

A stamp per page in a NumPy array that grows to the largest page seen (0: free). Checking and
holding the new pages of an insert is a handful of array operations over those pages only,
never over the pool or the tree: an ``argmin`` for negative slots, one gather to find pages
already held, and a scatter of each page's position read back to find a page listed twice (it
keeps only one of its positions). The choices are measured: ``intp`` indices, ``count_nonzero``
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
        self._offsets = np.arange(page_size, dtype=np.int32)
        self.clear()

    def clear(self) -> None:
        self._owner = np.zeros(1024, dtype=np.int32)  # per page: 0 free, else held
        self._stamps = np.arange(1, 1025, dtype=np.int32)
        self._zeros = np.zeros(1024, dtype=np.int32)
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

    def claim_new(self, slots: np.ndarray, name: str = "indices") -> None:
        """Hold the pages of ``slots`` (1-D int32, a multiple of ``page_size`` long), or refuse.

        Raises ``ValueError`` naming the value, holding nothing, when a slot is negative, a page
        is not ``page_size`` consecutive slots starting at a multiple of ``page_size``, a page is
        already held, or a page appears twice.
        """
        ps = self.page_size
        if ps == 1:
            first = slots
        else:
            grid = slots.reshape(-1, ps)
            first = grid[:, 0] // ps
            if grid.tobytes() != (first[:, None] * ps + self._offsets).tobytes():
                raise ValueError(
                    f"with page_size={ps} every {ps} {name} must be the consecutive slots of one "
                    f"page (first slot a multiple of {ps}); got {slots.tolist()}"
                )
        n = len(first)
        if n == 0:
            return
        if first[first.argmin()] < 0:  # a negative index would wrap around below
            raise ValueError(f"{name} must be >= 0, got {int(slots.min())}")
        pages = first.astype(np.intp)  # intp indices: gathers and scatters skip a cast
        owner = self._owner
        try:
            before = owner[pages]
        except IndexError:  # a page past the end: grow (rare), then look again
            self._grow(int(pages.max()) + 1)
            owner = self._owner
            before = owner[pages]
        if np.count_nonzero(before):
            bad = pages[before != 0]
            raise ValueError(
                f"{name} holds slots the cache already holds (pages starting at "
                f"{(bad * ps).tolist()[:8]}); a slot can hold one token's K/V only"
            )
        # Stamp each page with its position (from 1): a page listed twice keeps one stamp only.
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

    def _grow(self, size: int) -> None:
        owner = np.zeros(max(size, 2 * len(self._owner)), dtype=np.int32)
        owner[: len(self._owner)] = self._owner
        self._owner = owner

    def release(self, slots: np.ndarray) -> None:
        """Mark the pages of ``slots`` (whole pages the tree held) as free again."""
        pages = slots[:: self.page_size] // self.page_size if self.page_size > 1 else slots
        pages = pages.astype(np.intp)
        self._owner[pages] = self._zeros[: len(pages)] if len(pages) <= len(self._zeros) else 0
        self._count -= len(pages)
