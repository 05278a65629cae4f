"""`BlockHashCacheManager`'s shortcuts for the usual case against the general code they skip.

The shortcuts: arrays compared as bytes before the element-wise test that says where they differ
(`block_pool.same`: a chain's parents and tokens after a lookup, the head of the free queue, the
victims of an eviction taken for one chain, deepest first, the slots of new blocks against the
slot table); `BlockTable.held` reading a chain's two ends instead of counting its locked blocks;
the walk by one dict probe a block instead of trying every probe offset; the memo of recent chains
and the lazy hashing of a match instead of hashing and looking up every block. Here the same random
histories run on two managers, one with the shortcuts and one forced onto the general code, and
every answer and the whole state must agree after every step (invariants checked), so the two
cannot drift apart. (The stateful tests also reach both sides of each branch.)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import numpy as np
import torch
from conftest import observe
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import BlockHashCacheManager
from kvcache.managers import block_hash, block_pool
from kvcache.managers.block_hash import RecentChains
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
STREAMS = [torch.tensor([1] * 2 + [s * 10 + i for i in range(16)]) for s in range(4)]


def _counted_held(self: BlockTable, pages: np.ndarray) -> int:
    return int(np.count_nonzero(self.ref[pages]))


def _every_hash(find: Any) -> Any:
    def general(
        self: Any, rows: Any, raw: Any, key: Any, known: Any, hashes: Any, every: Any
    ) -> Any:
        return find(self, rows, raw, key, known, hashes, True)  # every row hashed, memo or not

    return general


@contextmanager
def general_code() -> Iterator[None]:
    """Inside: no array is ever taken for equal by its bytes, `BlockTable.held` counts, every
    walk tries every probe offset, the memo remembers nothing and every row is hashed."""
    saved = (
        block_pool.same,
        block_hash.same,
        BlockTable.held,
        block_hash.BlockHashCacheManager._walk,
        block_hash.BlockHashCacheManager._find,
        RecentChains.recall,
    )
    manager = block_hash.BlockHashCacheManager
    block_pool.same = block_hash.same = lambda a, b: False
    BlockTable.held = _counted_held  # type: ignore[method-assign]
    manager._walk = manager._walk_probing  # type: ignore[method-assign]
    manager._find = _every_hash(saved[4])  # type: ignore[method-assign]
    RecentChains.recall = lambda self, raw, key: ((), np.zeros(0, dtype=np.int64), b"")  # type: ignore[method-assign]
    try:
        yield
    finally:
        (
            block_pool.same,
            block_hash.same,
            BlockTable.held,
            manager._walk,
            manager._find,
            RecentChains.recall,
        ) = saved  # type: ignore[method-assign]


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
        slots = torch.zeros(k * PS, dtype=torch.int32)  # the cached part's are not looked at
        for i in range(have, k):
            page = pool.pop()
            slots[i * PS : (i + 1) * PS] = torch.arange(page * PS, page * PS + PS)
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
    out = m.evict(min(k * PS, m.size_info.evictable_size))
    pool.extend(sorted({s // PS for s in out.tolist()}))
    return out.tolist()
