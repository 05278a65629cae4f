"""The free queue of `BlockHashCacheManager`: its evictable pages in eviction order, kept as *runs*.

The manager queues pages a chain at a time: an unlock releases a chain's unlocked blocks, an insert
adds a chain's new blocks, a match or insert moves a chain's free blocks to the tail. Each such
call appends one run (an int64 array of pages, in queue order) in ``O(1)`` Python steps, whatever
its length, instead of one dict operation per page. Leaving the queue is lazy: every page records
the run it was last queued in (``where``, ``-1`` when it is not queued), so a lock only writes
``-1`` for its pages (one array operation) and a page moved to the tail simply gets its new run's
number; a run's entry for a page counts only while ``where`` still names that run. Reading the
head (``evict``) filters the first runs by that test and drops those left empty; a run cut in
the middle keeps its place at the head. A compaction drops the stale entries once they outnumber
the live ones (plus a constant), so memory and the time spent skipping them stay within a constant
factor of the queued pages (amortised over the runs that made them).

The order is exactly that of a queue in which each page is removed when locked and appended
(in run order) when queued or moved: run numbers only grow, so a page's last run is the only one
that names it.
"""

from __future__ import annotations

from itertools import count

import numpy as np

__all__ = ["FreeQueue"]

#: Stale entries tolerated beyond the live ones before a compaction.
_SLACK = 256


class FreeQueue:
    """Pages in eviction order (head first), stored as runs; see the module docstring.

    ``where`` (int64, one entry per page id plus a spare ``-1`` at the end, grown by `reserve`)
    is the run each queued page belongs to, ``-1`` for a page not queued. ``len()`` is the number
    of queued pages.
    """

    def __init__(self) -> None:
        self.runs: dict[int, np.ndarray] = {}
        self.where = np.full(1, -1, dtype=np.int64)
        self.size = 0  # queued pages
        self.entries = 0  # entries of every run, stale ones included
        self._next = count(1).__next__

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
        """Append ``pages`` (int64, in queue order, none twice; not written to later) at the tail.

        ``new``: how many of them were not queued (the others move from where they were).
        """
        run = self._next()
        self.where[pages] = run
        self.runs[run] = pages
        self.size += new
        self.entries += len(pages)
        if self.entries > 2 * self.size + _SLACK:
            self._compact()

    def remove(self, pages: np.ndarray) -> None:
        """Take ``pages`` (int64, every one queued, none twice) out of the queue."""
        self.where[pages] = -1
        self.size -= len(pages)

    def head(self, n: int) -> tuple[np.ndarray, list[tuple[int, np.ndarray | None]]]:
        """The first ``n`` queued pages (``0 < n <= len(self)``), and the plan that `drop` follows
        to remove them (nothing changes here)."""
        where, parts, plan = self.where, [], []
        for run, pages in self.runs.items():
            live = pages[where[pages] == run]
            if len(live) < n:
                parts.append(live)
                plan.append((run, None))
                n -= len(live)
                continue
            parts.append(live[:n])
            plan.append((run, None if len(live) == n else live[n:]))
            break
        return (parts[0] if len(parts) == 1 else np.concatenate(parts)), plan

    def drop(self, pages: np.ndarray, plan: list[tuple[int, np.ndarray | None]]) -> None:
        """Remove the head ``pages`` that `head` returned with ``plan``."""
        runs = self.runs
        for run, rest in plan:
            self.entries -= len(runs[run])
            if rest is None:
                del runs[run]
            else:
                runs[run] = rest  # keeps its place at the head
                self.entries += len(rest)
        self.remove(pages)

    def _compact(self) -> None:
        """Drop every stale entry (and every run left empty)."""
        where, kept = self.where, {}
        for run, pages in self.runs.items():
            live = pages[where[pages] == run]
            if len(live):
                kept[run] = live
        self.runs = kept
        self.entries = self.size

    # ------------------------------------------------------------ reading
    def pages(self) -> np.ndarray:
        """Every queued page, head first (int64)."""
        where = self.where
        parts = [pages[where[pages] == run] for run, pages in self.runs.items()]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def holds(self, page: int) -> bool:
        return bool(self.where[page] >= 0)
