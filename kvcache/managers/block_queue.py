"""The free queue of `BlockHashCacheManager`: its evictable pages in eviction order, in one array.

The manager queues pages a chain at a time: an unlock releases a chain's unlocked blocks, an insert
adds a chain's new blocks, a match or insert moves a chain's free blocks to the tail. The queue is
a *log*, an int64 array of pages to which each such call appends its run with one slice
assignment, whatever its length, instead of one dict operation per page. Leaving the queue is
lazy: every page records the position of its live entry in the log (``where``, ``-1`` when it is
not queued), so a lock only writes ``-1`` for its pages (one array operation) and a page moved to
the tail simply records its new position; an entry counts only while ``where`` still points at
it. Reading the head (``evict``) compares a window of the log with ``where`` in one pass and
moves the head past the entries taken. When the log is full, its live entries are copied to the
front (and the array grown when they fill half of it), so memory stays within a constant factor
of the most pages ever queued and each entry is copied ``O(1)`` times (amortised).

The order is exactly that of a queue in which each page is removed when locked and appended (in
run order) when queued or moved: positions only grow between compactions, which keep the order,
so a page's last entry is the only live one.
"""

from __future__ import annotations

import numpy as np

__all__ = ["FreeQueue"]

_MIN = 256  # entries the log starts with


class FreeQueue:
    """Pages in eviction order (head first), as a log with lazy removal; see the module docstring.

    ``where`` (int64, one entry per page id plus a spare ``-1`` at the end, grown by `reserve`)
    is the position of each queued page's entry in ``log``, ``-1`` for a page not queued; the
    entries in ``log[lo:hi]`` whose position ``where`` names are the queue. ``len()`` is the
    number of queued pages.
    """

    def __init__(self) -> None:
        self.log = np.full(_MIN, -1, dtype=np.int64)
        self.pos = np.arange(_MIN, dtype=np.int64)  # ``pos[i] == i``: compared with ``where``
        self._pos_bytes = self.pos.tobytes()  # a slice of it costs less than one of ``pos``
        self.where = np.full(1, -1, dtype=np.int64)
        self.lo = self.hi = 0
        self.size = 0  # queued pages

    def __len__(self) -> int:
        return self.size

    def reserve(self, size: int) -> None:
        """Room for page ids below ``size`` (the table's capacity); the spare entry stays last."""
        old = len(self.where) - 1
        if size > old:
            where = np.full(size + 1, -1, dtype=np.int64)
            where[:old] = self.where[:old]
            self.where = where

    # ------------------------------------------------------------ changes
    def push(self, pages: np.ndarray, new: int) -> None:
        """Append ``pages`` (int64, in queue order, none twice) at the tail.

        ``new``: how many of them were not queued (the others move from where they were).
        """
        hi = self.hi
        end = hi + len(pages)
        if end > len(self.log):
            self._compact(len(pages))
            hi = self.hi
            end = hi + len(pages)
        self.log[hi:end] = pages
        self.where[pages] = self.pos[hi:end]
        self.hi = end
        self.size += new

    def remove(self, pages: np.ndarray) -> None:
        """Take ``pages`` (int64, every one queued, none twice) out of the queue."""
        self.where[pages] = -1
        self.size -= len(pages)

    def head(self, n: int) -> tuple[np.ndarray, int]:
        """The first ``n`` queued pages (``0 < n <= len(self)``; read-only, valid until the next
        change), and where the head moves once they are gone (for `drop`; nothing changes
        here)."""
        lo, hi, log, where, pos = self.lo, self.hi, self.log, self.where, self.pos
        window = log[lo : lo + n]
        if where[window].tobytes() == self._pos_bytes[8 * lo : 8 * (lo + n)]:  # none is stale
            return window, lo + n
        span = 2 * n + 16
        while True:
            end = min(lo + span, hi)
            window = log[lo:end]
            live = (where[window] == pos[lo:end]).nonzero()[0]
            if len(live) >= n or end == hi:
                break
            span *= 4
        return window[live[:n]], lo + int(live[n - 1]) + 1

    def drop(self, pages: np.ndarray, lo: int) -> None:
        """Remove the head ``pages`` that `head` returned with ``lo``."""
        self.remove(pages)
        self.lo = lo

    def _compact(self, room: int) -> None:
        """Move the live entries to the front, with room for ``room`` more (the log grown when
        they would fill more than half of it)."""
        live = self.pages()
        size = len(live) + room
        if 2 * size > len(self.log):
            cap = max(2 * size, 2 * len(self.log))
            self.log = np.full(cap, -1, dtype=np.int64)
            self.pos = np.arange(cap, dtype=np.int64)
            self._pos_bytes = self.pos.tobytes()
        self.log[: len(live)] = live
        self.where[live] = self.pos[: len(live)]
        self.lo, self.hi = 0, len(live)

    # ------------------------------------------------------------ reading
    def pages(self) -> np.ndarray:
        """Every queued page, head first (int64)."""
        lo, hi = self.lo, self.hi
        window = self.log[lo:hi]
        out: np.ndarray = window[self.where[window] == self.pos[lo:hi]]
        return out
