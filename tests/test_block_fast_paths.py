"""`BlockHashCacheManager`'s shortcuts for the usual case against the general code they skip.

Eviction checks a head of the free queue that is one chain, deepest block first, with two byte
comparisons (`block_evict.evict_blocks`); any other head goes through the general check. Locking
a chain none of whose blocks is locked, and releasing one whose blocks are all locked once, write
the counts instead of adding to them (`BlockTable.lock`, `BlockTable.release`). Here the same
random histories run on two managers, one with the shortcuts and one forced onto the general
code, and every answer and the whole state must agree after every step (invariants checked), so
the two cannot drift apart. (The stateful tests also reach both sides of each branch.)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import numpy as np
from conftest import observe
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import BlockHashCacheManager
from kvcache.managers import block_evict
from kvcache.managers.block_pool import BlockTable

PS = 2
POOL_PAGES = 24

#: A history: insert a sequence (a prefix of one of a few token streams, so chains share
#: prefixes and branch), lock the match of one, unlock a locked handle, or evict some tokens.
STEPS = st.lists(
    st.tuples(
        st.sampled_from(["insert", "insert", "lock", "unlock", "evict"]),
        st.integers(0, 3),  # which stream
        st.integers(1, 8),  # how many blocks of it (insert, lock) / pages to evict
    ),
    max_size=40,
)
STREAMS = [np.array([1] * 2 + [s * 10 + i for i in range(16)], dtype=np.int64) for s in range(4)]


def _general_lock(self: BlockTable, pages: np.ndarray) -> None:
    held = self.held(pages)
    self.ref[pages] += 1
    if held < len(pages):
        self.free.remove(pages[held:])
        self.num_locked += len(pages) - held


def _general_release(
    self: BlockTable, pages: np.ndarray, clock: int, chain: np.ndarray | None = None, new: int = 0
) -> None:
    self.ref[pages] -= 1
    n = len(pages) - self.held(pages)
    self.num_locked -= n
    run = None
    if chain is not None:
        n += new
        run = chain[::-1][:n]
    elif n:
        run = pages[::-1][:n]
    if n:
        self.last[run] = clock
        self.free.push(run, n)


@contextmanager
def general_code() -> Iterator[None]:
    """Inside: `BlockTable.lock` and `release` without their shortcuts, and no head of the free
    queue taken for one chain (its pattern never matches), so eviction checks it in general."""
    saved = BlockTable.lock, BlockTable.release, block_evict.chain_children
    BlockTable.lock, BlockTable.release = _general_lock, _general_release  # type: ignore[method-assign]
    block_evict.chain_children = lambda n: b""
    try:
        yield
    finally:
        BlockTable.lock, BlockTable.release, block_evict.chain_children = saved  # type: ignore[method-assign]


def _state(m: BlockHashCacheManager) -> Any:
    m.check_integrity()
    return observe(m), m.free_queue(), m.clock, sorted(m.locked_handles().values())


@settings(max_examples=150, deadline=None)
@given(steps=STEPS)
def test_shortcuts_decide_as_the_general_code(steps: list) -> None:
    fast, slow = BlockHashCacheManager(page_size=PS), BlockHashCacheManager(page_size=PS)
    free = {id(m): list(range(POOL_PAGES)) for m in (fast, slow)}  # pages not cached
    handles: dict[int, list[Any]] = {id(fast): [], id(slow): []}
    for kind, stream, k in steps:
        answers = []
        for m in (fast, slow):
            with general_code() if m is slow else nullcontext():
                answers.append(_step(m, kind, stream, k, free[id(m)], handles[id(m)]))
        assert answers[0] == answers[1]
        assert _state(fast) == _state(slow)


def _step(m: BlockHashCacheManager, kind: str, stream: int, k: int, pool: list, held: list) -> Any:
    """One step of a history on ``m`` (``pool``: its pages not cached; ``held``: its locked
    handles); what it answered."""
    ids = STREAMS[stream][: k * PS]
    if kind == "insert":
        handle, _ = m.match_and_lock(ids)
        have = handle.cached_len // PS
        if k - have > len(pool):
            m.lock_handle(handle, unlock=True)
            return "full"
        slots = np.zeros(k * PS, dtype=np.int32)  # the cached part's are not looked at
        for i in range(have, k):
            page = pool.pop()
            slots[i * PS : (i + 1) * PS] = np.arange(page * PS, page * PS + PS)
        res = m.insert_and_unlock(handle, ids, slots)
        return res.cached_len, res.handle.cached_len
    if kind == "lock":
        handle, slots = m.match_and_lock(ids)
        held.append(handle)
        return handle.cached_len, slots.tolist()
    if kind == "unlock":
        if held:
            m.lock_handle(held.pop(stream % len(held)), unlock=True)
        return len(held)
    out = m.evict(min(k * PS, m.size_info.evictable_size), host=True)
    pool.extend(sorted({s // PS for s in out.tolist()}))
    return out.tolist()
