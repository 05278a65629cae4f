"""`SlotOwners`: which pages a prefix tree holds, so an insert can refuse a slot it cannot hold.

A flag per page in a NumPy array that grows to the largest page seen; one sort of the new
pages finds a negative slot, the largest page and a page listed twice at once: a handful of
array operations over the *new* part of an insert, never over the pool or the tree.
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
        self._held = np.zeros(1024, dtype=np.bool_)
        self._count = 0

    @property
    def count(self) -> int:
        """Pages held."""
        return self._count

    def held(self, pages: np.ndarray) -> np.ndarray:
        """Which of ``pages`` (non-negative) are held, as a bool array."""
        out = np.zeros(len(pages), dtype=np.bool_)
        inside = pages < len(self._held)
        out[inside] = self._held[pages[inside]]
        return out

    def pages_of(self, slots: np.ndarray, name: str = "indices") -> np.ndarray:
        """Check ``slots`` (1-D int32, a multiple of ``page_size`` long) and return their pages.

        Raises ``ValueError`` naming the value when a slot is negative, a page is not
        ``page_size`` consecutive slots starting at a multiple of ``page_size``, a page is
        already held, or a page appears twice. Changes nothing.
        """
        ps = self.page_size
        if ps == 1:
            pages = slots
        else:
            grid = slots.reshape(-1, ps)
            pages = grid[:, 0] // ps
            if (grid != pages[:, None] * ps + self._offsets).any():
                raise ValueError(
                    f"with page_size={ps} every {ps} {name} must be the consecutive slots of one "
                    f"page (first slot a multiple of {ps}); got {slots.tolist()}"
                )
        if len(pages) == 0:
            return pages
        # One sort gives the smallest, the largest and any repeat (timsort: runs stay cheap).
        ordered = np.sort(pages, kind="stable")
        lo, hi = int(ordered[0]), int(ordered[-1])
        if lo < 0:
            raise ValueError(f"{name} must be >= 0, got {lo * ps}")
        if len(ordered) > 1 and (ordered[1:] == ordered[:-1]).any():
            twice = np.unique(ordered[1:][ordered[1:] == ordered[:-1]])
            raise ValueError(f"{name} lists the same slot more than once: {(twice * ps).tolist()[:8]}")
        if hi >= len(self._held):
            self._grow(hi + 1)
        taken = self._held[pages]
        if taken.any():
            bad = (pages[taken] * ps).tolist()[:8]
            raise ValueError(f"{name} holds slots the cache already holds (pages starting at {bad}); "
                             "a slot can hold one token's K/V only")
        return pages

    def _grow(self, size: int) -> None:
        size = max(size, 2 * len(self._held))
        held = np.zeros(size, dtype=np.bool_)
        held[: len(self._held)] = self._held
        self._held = held

    def claim(self, pages: np.ndarray) -> None:
        """Mark ``pages`` (checked by `pages_of`) as held."""
        self._held[pages] = True
        self._count += len(pages)

    def release(self, slots: np.ndarray) -> None:
        """Mark the pages of ``slots`` (whole pages the tree held) as free again."""
        pages = slots[:: self.page_size] // self.page_size if self.page_size > 1 else slots
        self._held[pages] = False
        self._count -= len(pages)
