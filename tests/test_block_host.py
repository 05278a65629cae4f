"""`BlockHashCacheManager`'s own NumPy forms (`match_and_lock`, `insert_and_unlock`,
`evict(host=True)`): the same answers and state as the tensor forms, the same refusals (nothing
changed); the flow driving it with tensors; its fused calls deciding as the separate calls do.
`evict(host=True)` is checked beside radix's in `tests/test_host_arrays.py`, which also checks
the base class's fused calls (which this manager's own calls replace)."""

from __future__ import annotations

import operator
from typing import Any

import numpy as np
import pytest
import torch
from conftest import observe
from conftest import unchanged as watch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_host_arrays import OPS, drive_forms

from kvcache import BaseCacheManager, BlockHashCacheManager, PageAllocator, RequestFlow


def state(m: BlockHashCacheManager) -> Any:
    return observe(m), m.free_queue(), m.clock, sorted(m.locked_handles().values())


@settings(max_examples=60, deadline=None)
@given(
    ops=OPS, id_dtype=st.sampled_from([np.int64, np.int32, np.uint8]), ps=st.sampled_from([1, 2])
)
def test_numpy_and_tensor_forms_agree(ops: list, id_dtype: type, ps: int) -> None:
    """Two managers, one driven with tensors and one with NumPy arrays, make identical decisions:
    every answer and handle equal, the whole state (free queue, clock and locks included) equal
    after every step, invariants checked."""
    tm, hm = BlockHashCacheManager(page_size=ps), BlockHashCacheManager(page_size=ps)
    drive_forms(tm, hm, ops, id_dtype, state, operator.eq)


def _populated() -> tuple[BlockHashCacheManager, Any]:
    m = BlockHashCacheManager(page_size=2)
    m.insert_prefix(torch.arange(4), torch.arange(4, dtype=torch.int32))
    handle, _ = m.match_and_lock(np.arange(2))
    return m, handle


@pytest.mark.parametrize(
    ("bad", "exc", "match"),
    [
        (np.array([1.0, 2.0]), TypeError, "input_ids must have an integer dtype, got float64"),
        (np.array([True, False]), TypeError, "input_ids must have an integer dtype, got bool"),
        (np.array([1, 2], dtype=np.uint32), TypeError, "integer dtype, got uint32"),
        (np.array([[1, 2]]), ValueError, r"input_ids must be 1-D, got shape \(1, 2\)"),
        ([1, 2], TypeError, "input_ids"),
    ],
)
def test_bad_numpy_ids_are_refused_changing_nothing(bad, exc, match):
    m, handle = _populated()
    before = state(m)
    with watch(m), pytest.raises(exc, match=match):
        m.match_and_lock(bad)
    slots = np.arange(16, 16 + len(np.reshape(bad, -1)), dtype=np.int32)
    with watch(m), pytest.raises(exc, match=match):
        m.insert_and_unlock(handle, bad, slots)
    assert state(m) == before
    m.lock_handle(handle, unlock=True)
    assert m.size_info.protected_size == 0


def test_bad_numpy_slots_are_refused_changing_nothing():
    m, handle = _populated()
    ids = np.arange(8)  # two pages cached, two new
    good = np.concatenate([np.arange(4), np.arange(16, 20)]).astype(np.int32)
    before = state(m)
    for bad, exc, match in [
        (good.astype(np.int64), TypeError, "indices must have dtype int32, got int64"),
        (good[None, :], ValueError, r"indices must be 1-D, got shape \(1, "),
        (good[:-1], ValueError, r"len\(indices\)"),
        (np.where(good == 16, -8, good).astype(np.int32), ValueError, "-8"),
        (np.where(good == 18, 0, good).astype(np.int32), ValueError, "consecutive|page 0"),
        (list(good), TypeError, "indices"),
    ]:
        with watch(m), pytest.raises(exc, match=match):
            m.insert_and_unlock(handle, ids, bad)
        assert state(m) == before
    res = m.insert_and_unlock(handle, ids, good)
    assert res.cached_len == 4 and m.size_info.protected_size == 0


def test_the_flow_drives_it_with_tensors():
    """RequestFlow makes the fused calls with tensors, and decides as a flow over fused calls
    that take tensors only does."""

    class TensorsOnly(BlockHashCacheManager):  # fused calls that refuse anything but tensors
        def match_and_lock(self, input_ids, extra_key=None):
            assert isinstance(input_ids, torch.Tensor)
            return super().match_and_lock(input_ids, extra_key)

        def insert_and_unlock(self, handle, input_ids, indices, extra_key=None, *, relock=False):
            assert isinstance(input_ids, torch.Tensor) and isinstance(indices, torch.Tensor)
            return super().insert_and_unlock(handle, input_ids, indices, extra_key, relock=relock)

    seen: list[type] = []

    class Spy(BlockHashCacheManager):
        def match_and_lock(self, input_ids, extra_key=None):
            seen.append(type(input_ids))
            return super().match_and_lock(input_ids, extra_key)

        def insert_and_unlock(self, handle, input_ids, indices, extra_key=None, *, relock=False):
            seen.extend((type(input_ids), type(indices)))
            return super().insert_and_unlock(handle, input_ids, indices, extra_key, relock=relock)

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 4, int(rng.integers(1, 40))) for _ in range(60)]
    results = []
    for make in (Spy, TensorsOnly):
        m = make(page_size=4)
        flow = RequestFlow(m, PageAllocator(24, 4))
        reused = []
        for p in prompts:
            req = flow.begin(torch.from_numpy(p))
            reused.append(req.reused_len)
            flow.mark_computed(req)
            flow.finish(req)
            flow.check_integrity()
        results.append((reused, flow.stats.evicted_tokens, sorted(m.cached_indices().tolist())))
    assert results[0] == results[1]
    assert seen and set(seen) == {torch.Tensor}


class SeparateCalls(BlockHashCacheManager):
    """The same manager driven through the base class's fused calls (the separate public calls)."""

    match_and_lock = BaseCacheManager.match_and_lock
    insert_and_unlock = BaseCacheManager.insert_and_unlock


def decided(m: BlockHashCacheManager) -> Any:
    """What the cache decided (blocks, their pages and locks, the eviction order), not when."""
    blocks = sorted((b.tokens, b.page, b.ref_count, b.num_children) for b in m.blocks())
    return blocks, m.free_queue(), m.size_info, sorted(m.locked_handles().values())


@settings(max_examples=60, deadline=None)
@given(ops=OPS, ps=st.sampled_from([1, 2]))
def test_own_fused_calls_decide_as_the_separate_calls(ops: list, ps: int) -> None:
    """The fused calls' shortcuts (the handle's chain as the insert's start, the new blocks
    queued with the released ones in one run, no memo entry from the match) change nothing
    the cache decides: same answers, blocks, locks and eviction order after every step."""
    fm, sm = BlockHashCacheManager(page_size=ps), SeparateCalls(page_size=ps)
    held: list[tuple[Any, Any, list[int]]] = []
    fresh = 0
    for kind, toks, k in ops:
        if kind == "match" or (not held and kind in ("insert", "relock")):
            fh, fidx = fm.match_and_lock(torch.tensor(toks, dtype=torch.int64))
            sh, sidx = sm.match_and_lock(torch.tensor(toks, dtype=torch.int64))
            assert fh == sh and fidx.tolist() == sidx.tolist()
            held.append((fh, sh, toks))
        elif kind in ("insert", "relock"):
            fh, sh, base = held.pop(k % len(held))
            seq = base + toks
            n = len(seq)
            prefix = fm.handle_indices(fh).tolist() if fh.cached_len else []
            new = [fresh * ps + j for j in range(-(-(n - len(prefix)) // ps) * ps)]
            fresh += -(-(n - len(prefix)) // ps)
            slots = torch.tensor((prefix + new)[:n], dtype=torch.int32)
            relock = kind == "relock"
            ids = torch.tensor(seq, dtype=torch.int64)
            fres = fm.insert_and_unlock(fh, ids, slots, relock=relock)
            sres = sm.insert_and_unlock(sh, ids, slots, relock=relock)
            assert fres.cached_len == sres.cached_len and fres.handle == sres.handle
            if relock:
                held.append((fres.handle, sres.handle, seq))
        else:
            size = min(k * ps, fm.size_info.evictable_size)
            assert fm.evict(size, host=True).tolist() == sm.evict(size, host=True).tolist()
        assert decided(fm) == decided(sm)
        fm.check_integrity()
        sm.check_integrity()
