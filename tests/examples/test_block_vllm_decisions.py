"""`BlockHashCacheManager` decides as the vLLM stand-in does, call by call.

Driven directly (no flow), through arbitrary interleavings of: a request's match and lock (vLLM's
lookup and ``touch``), unlocks (``free_blocks``), inserts of sequences that overlap or repeat
blocks already cached, whether or not the inserting caller holds them (and optionally locking
what the insert returns, as a request that keeps running does), and evictions. After every step
both must agree on the length reused, the slots returned (in order), the slots evicted (in
order), the slots cached and the sizes. A bare match (not locked) is left out: here it refreshes
the matched blocks' LRU place, vLLM's lookup does not (documented on ``match_prefix``).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import BlockHashCacheManager
from kvcache.examples.vllm_standin import VllmStandIn

#: Sequences are made of a few block contents, so inserts overlap and repeat cached chains.
_seq = st.lists(st.integers(0, 3), min_size=1, max_size=6)
_step = st.one_of(
    st.tuples(st.just("match"), st.integers(0, 5), st.integers(0, 7)),
    st.tuples(st.just("insert"), st.integers(0, 5), st.integers(0, 2)),
    st.tuples(st.just("unlock"), st.integers(0, 9), st.just(0)),
    st.tuples(st.just("evict"), st.integers(1, 40), st.just(0)),
)


def _tokens(blocks: list[int], ps: int) -> torch.Tensor:
    """Block ``b`` of a sequence holds ``ps`` tokens ``b * 100 + offset``."""
    return torch.tensor([b * 100 + k for b in blocks for k in range(ps)], dtype=torch.int64)


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.tolist() == b.tolist(), f"{what}: ours {a.tolist()} vs stand-in {b.tolist()}"


def _run(seqs: list[list[int]], steps: list[tuple[str, int, int]], ps: int, pages: int) -> None:
    ours = BlockHashCacheManager("cpu", ps)
    ref = VllmStandIn("cpu", ps)
    free = list(range(pages))  # pages neither cached nor lent out
    locked: list[tuple[object, object]] = []
    for op, a, b in steps:
        if op == "match":
            blocks = seqs[a % len(seqs)]
            ids = _tokens(blocks, ps)[: max(1, len(blocks) * ps - b)]  # maybe a token short
            if b % 2:  # the flow's fused call
                (h1, s1), (h2, s2) = ours.match_and_lock(ids), ref.match_and_lock(ids)
            else:
                (h1, s1), (h2, s2) = ours.match_prefix(ids), ref.match_prefix(ids)
                ours.lock_handle(h1)
                ref.lock_handle(h2)
            assert h1.cached_len == h2.cached_len, f"match {blocks}"
            _same(s1, s2, f"match {blocks}")
            locked.append((h1, h2))
        elif op == "insert":
            blocks = seqs[a % len(seqs)]
            if len(blocks) > len(free):
                continue
            lent, free = free[: len(blocks)], free[len(blocks) :]
            slots = torch.tensor([p * ps + k for p in lent for k in range(ps)], dtype=torch.int32)
            ids = _tokens(blocks, ps)
            if b and locked:  # the flow's fused insert: releases a lock (moves it with relock)
                g1, g2 = locked.pop(a % len(locked))
                r1 = ours.insert_and_unlock(g1, ids, slots, relock=b == 2)  # type: ignore[arg-type]
                r2 = ref.insert_and_unlock(g2, ids, slots, relock=b == 2)  # type: ignore[arg-type]
            else:
                r1, r2 = ours.insert_and_match(ids, slots), ref.insert_and_match(ids, slots)
                if b == 2:  # a running request moves its lock to what it just cached
                    ours.lock_handle(r1.handle)
                    ref.lock_handle(r2.handle)
            assert r1.cached_len == r2.cached_len, f"insert {blocks}"
            assert r1.handle.cached_len == r2.handle.cached_len, f"insert {blocks}"
            free += lent[: r1.cached_len // ps]  # duplicates of cached blocks: the caller's
            if b == 2:
                locked.append((r1.handle, r2.handle))
        elif op == "unlock":
            if not locked:
                continue
            h1, h2 = locked.pop(a % len(locked))
            ours.lock_handle(h1, unlock=True)  # type: ignore[arg-type]
            ref.lock_handle(h2, unlock=True)  # type: ignore[arg-type]
        else:
            size = min(a * ps // 4, ours.size_info.evictable_size)
            e1, e2 = ours.evict(size), ref.evict(size)
            _same(e1, e2, f"evict {size}")
            free += sorted({int(s) // ps for s in e1.tolist()})
        assert ours.size_info == ref.size_info, f"sizes after {op}"
        assert sorted(ours.cached_indices().tolist()) == sorted(ref.cached_indices().tolist())
        ours.check_integrity()


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    seqs=st.lists(_seq, min_size=1, max_size=6),
    steps=st.lists(_step, min_size=1, max_size=40),
    ps=st.sampled_from([1, 16]),
    pages=st.integers(4, 16),
)
def test_decides_as_the_vllm_stand_in(seqs, steps, ps, pages):
    _run(seqs, steps, ps, pages)


def test_a_repeated_cached_block_goes_where_vllms_duplicate_is_freed():
    """The case that once differed: an insert repeats a cached block nobody holds (here one
    that a match a token short did not cover) and adds a child after it. vLLM caches the
    request's copy too and frees it after the child, so the content stays cached until then,
    and the child is evicted first."""
    for ps in (1, 16):
        _run(
            [[0, 1], [2], [0, 1, 3]],
            [
                ("insert", 0, 0),  # [0, 1] cached; queue [1] [0]
                ("insert", 1, 0),  # [2]: queue [1] [0] [2]
                ("match", 0, 1),  # [0, 1] a token short: [0] found and locked
                ("insert", 2, 0),  # [0, 1, 3]: [1] repeated, [3] new; queue [2] [3] [1]
                ("unlock", 0, 0),  # queue [2] [3] [1] [0]
                ("evict", 4, 0),
                ("evict", 4, 0),
                ("evict", 4, 0),
                ("evict", 4, 0),
            ],
            ps,
            8,
        )


def _state(m: BlockHashCacheManager) -> tuple:
    return (m.free_queue(), m.locked_handles(), m.cached_indices().tolist(), m.size_info)


def test_fused_insert_refuses_and_changes_nothing():
    """`insert_and_unlock` of a handle not locked, or with bad slots, raises and changes
    nothing (the handle stays locked); an equal copy of the locked handle goes the checked way."""
    m = BlockHashCacheManager("cpu", 1)
    s = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    m.insert_prefix(_tokens([1, 2], 1), s(0, 1))
    handle, _ = m.match_prefix(_tokens([1, 2, 3], 1))
    before = _state(m)
    with pytest.raises(RuntimeError, match="not locked"):
        m.insert_and_unlock(handle, _tokens([1, 2, 3], 1), s(0, 1, 2))
    assert _state(m) == before
    locked, _ = m.match_and_lock(_tokens([1, 2, 3], 1))
    before = _state(m)
    with pytest.raises(ValueError, match="already"):
        m.insert_and_unlock(locked, _tokens([1, 2, 3], 1), s(0, 1, 1))
    with pytest.raises(TypeError, match="relock"):
        m.insert_and_unlock(locked, _tokens([1, 2, 3], 1), s(0, 1, 2), relock=1)  # type: ignore[arg-type]
    assert _state(m) == before
    copy = m.match_prefix(_tokens([1, 2, 3], 1))[0]
    assert copy == locked and copy is not locked
    res = m.insert_and_unlock(copy, _tokens([1, 2, 3], 1), s(0, 1, 2), relock=True)
    assert res.cached_len == 2 and m.size_info == (0, 3)
    with pytest.raises(RuntimeError, match="not locked"):
        m.lock_handle(locked, unlock=True)
    m.lock_handle(res.handle, unlock=True)
    assert m.size_info == (3, 0) and not m.locked_handles()
    m.check_integrity()
