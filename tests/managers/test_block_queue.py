"""`block_pool.FreeQueue` (the block-hash manager's free queue, a log with lazy removal) against a
plain list: the same pages in the same order after every step, through pushes that move queued
pages, removals, reads of the head and the compactions and growth they trigger."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.managers.block_pool import FreeQueue

PAGES = 40

STEPS = st.lists(
    st.tuples(
        st.sampled_from(["push", "push", "remove", "evict"]),
        st.lists(st.integers(0, PAGES - 1), min_size=1, max_size=12, unique=True),
        st.integers(1, 12),
    ),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(steps=STEPS)
def test_the_queue_is_a_list_with_moves(steps):
    q = FreeQueue()
    q.reserve(PAGES)
    ref: list[int] = []  # the queue, head first
    for kind, pages, n in steps:
        if kind == "push":  # queued pages move to the tail, the others join it
            new = [p for p in pages if p not in ref]
            ref = [p for p in ref if p not in pages] + pages
            q.push(np.array(pages, dtype=np.int64), len(new))
        elif kind == "remove":
            gone = [p for p in pages if p in ref]
            ref = [p for p in ref if p not in gone]
            if gone:
                q.remove(np.array(gone, dtype=np.int64))
        elif ref:
            n = min(n, len(ref))
            head, lo = q.head(n)
            assert head.tolist() == ref[:n]
            assert q.pages().tolist() == ref  # head() changes nothing
            q.drop(head, lo)
            ref = ref[n:]
        assert len(q) == len(ref)
        assert q.pages().tolist() == ref
        queued = np.flatnonzero(q.where[:PAGES] >= 0).tolist()
        assert sorted(queued) == sorted(ref)


def test_a_long_run_of_moves_stays_bounded():
    """Moving the same pages again and again leaves stale entries behind; compaction keeps the log
    within a constant factor of the queued pages."""
    q = FreeQueue()
    q.reserve(8)
    pages = np.arange(8, dtype=np.int64)
    q.push(pages, 8)
    for _ in range(10_000):
        q.push(pages[::-1].copy(), 0)
    assert len(q) == 8 and len(q.log) <= 1024
    assert q.pages().tolist() == pages[::-1].tolist()
