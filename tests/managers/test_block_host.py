"""`BlockHashCacheManager`'s own fused calls (`match_and_lock`, `insert_and_unlock`): tensors at
the boundary, one form (a NumPy array is refused as `match_prefix` refuses it); bad input refused
with the whole state unchanged (the LRU clock included) and the handle still locked; the flow
driving it with tensors; and the same decisions as the separate public calls, for the handle a
match returned and for an equal copy of it alike. (This file once checked NumPy forms of the
fused calls and of ``evict``; they are gone, and their refusals are checked here on tensors.)"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch
from conftest import unchanged as watch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_host_arrays import OPS

from kvcache import (
    BaseCacheManager,
    BlockHashCacheHandle,
    BlockHashCacheManager,
    PageAllocator,
    RequestFlow,
)


def _populated() -> tuple[BlockHashCacheManager, Any]:
    m = BlockHashCacheManager(page_size=2)
    m.insert_prefix(torch.arange(4), torch.arange(4, dtype=torch.int32))
    handle, _ = m.match_and_lock(torch.arange(2))
    return m, handle


@pytest.mark.parametrize(
    ("bad", "exc", "match"),
    [
        (torch.tensor([1.0, 2.0]), TypeError, "input_ids must have an integer dtype"),
        (torch.tensor([True, False]), TypeError, "input_ids must have an integer dtype"),
        (torch.tensor([[1, 2]]), ValueError, r"input_ids must be 1-D, got shape \(1, 2\)"),
        (np.array([1, 2]), TypeError, r"input_ids must be a torch\.Tensor, got ndarray"),
        ([1, 2], TypeError, r"input_ids must be a torch\.Tensor, got list"),
    ],
)
def test_bad_ids_are_refused_changing_nothing(bad, exc, match):
    m, handle = _populated()
    with watch(m), pytest.raises(exc, match=match):
        m.match_and_lock(bad)
    slots = torch.arange(16, 18, dtype=torch.int32)  # every bad input holds two ids
    with watch(m), pytest.raises(exc, match=match):
        m.insert_and_unlock(handle, bad, slots)
    m.lock_handle(handle, unlock=True)  # still locked after the refusals: one unlock works
    assert m.size_info.protected_size == 0


def test_bad_slots_are_refused_changing_nothing():
    m, handle = _populated()
    ids = torch.arange(8)  # two pages cached, two new
    good = torch.cat([torch.arange(4), torch.arange(16, 20)]).to(torch.int32)
    for bad, exc, match in [
        (good.long(), TypeError, "indices must have dtype torch.int32, got torch.int64"),
        (good[None, :], ValueError, r"indices must be 1-D, got shape \(1, "),
        (good[:-1], ValueError, r"len\(indices\)"),
        (torch.where(good == 16, -8, good).to(torch.int32), ValueError, "-8"),
        (torch.where(good == 18, 0, good).to(torch.int32), ValueError, "consecutive|page 0"),
        (torch.tensor([0, 1, 2, 3, 2, 3, 4, 5], dtype=torch.int32), ValueError, "page 1"),
        (good.numpy(), TypeError, r"indices must be a torch\.Tensor, got ndarray"),
    ]:
        with watch(m), pytest.raises(exc, match=match):
            m.insert_and_unlock(handle, ids, bad)
    res = m.insert_and_unlock(handle, ids, good)
    assert res.cached_len == 4 and m.size_info.protected_size == 0
    m.check_integrity()


def test_evict_takes_no_host_form():
    m, _ = _populated()
    with watch(m), pytest.raises(TypeError, match="host"):
        m.evict(2, host=True)  # type: ignore[call-arg]


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


def equal_copy(handle: Any, how: int) -> Any:
    """``handle`` itself (``how == 0``), a copy of it, or a handle rebuilt from its fields: the
    two last are equal to it and not it."""
    if how == 0:
        return handle
    if how == 1:
        return copy.copy(handle)
    return BlockHashCacheHandle(handle.cached_len, handle.block_hashes, handle.tokens)


@settings(max_examples=60, deadline=None)
@given(ops=OPS, ps=st.sampled_from([1, 2]), copies=st.lists(st.integers(0, 2), min_size=25))
def test_own_fused_calls_decide_as_the_separate_calls(ops: list, ps: int, copies: list) -> None:
    """The fused calls' shortcuts (the lock of the chain the match found, the released handle's
    chain as the insert's start) change nothing the cache decides: same answers, blocks, locks
    and eviction order after every step, whether the insert is handed the handle the match
    returned or an equal copy of it."""
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
            fres = fm.insert_and_unlock(equal_copy(fh, copies.pop()), ids, slots, relock=relock)
            sres = sm.insert_and_unlock(sh, ids, slots, relock=relock)
            assert fres.cached_len == sres.cached_len and fres.handle == sres.handle
            if relock:
                held.append((fres.handle, sres.handle, seq))
        else:
            size = min(k * ps, fm.size_info.evictable_size)
            assert fm.evict(size).tolist() == sm.evict(size).tolist()
        assert decided(fm) == decided(sm)
        fm.check_integrity()
        sm.check_integrity()
