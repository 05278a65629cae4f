"""Every misuse in API.md raises the documented error and leaves the object exactly as it was."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import ids as t
from conftest import observe
from conftest import slots as s
from conftest import unchanged as watch

from kvcache import (
    BaseCacheManager,
    NaiveCacheManager,
    PageAllocator,
    RadixCacheManager,
    RequestFlow,
    SizeInfo,
)


def radix_state(m: RadixCacheManager) -> Any:
    """Everything observable about the tree, for before/after comparison (conftest's)."""
    return observe(m)


def populated(page_size: int = 1) -> RadixCacheManager:
    m = RadixCacheManager(page_size=page_size)
    m.insert_prefix(torch.arange(2 * page_size), torch.arange(2 * page_size, dtype=torch.int32))
    m.insert_prefix(
        torch.arange(100, 100 + page_size),
        torch.arange(8 * page_size, 9 * page_size, dtype=torch.int32),
    )
    h, _ = m.match_prefix(torch.arange(page_size))
    m.lock_handle(h)
    return m


def unchanged(m: RadixCacheManager, call: Callable[[], Any], exc: type, match: str) -> None:
    with watch(m), pytest.raises(exc, match=match):
        call()
    m.check_integrity()


RADIX_MISUSES = [
    (
        "insert lengths differ",
        lambda m: m.insert_prefix(t(1, 2, 3), s(1, 2)),
        ValueError,
        r"len\(indices\) \(2\).*\(3\)",
    ),
    (
        "insert float ids",
        lambda m: m.insert_prefix(torch.tensor([1.0]), s(1)),
        TypeError,
        "integer dtype",
    ),
    ("insert 2-D ids", lambda m: m.insert_prefix(t(1, 2).view(1, 2), s(1, 2)), ValueError, "1-D"),
    (
        "insert int64 indices",
        lambda m: m.insert_prefix(t(1), torch.tensor([1])),
        TypeError,
        "torch.int32",
    ),
    ("insert list ids", lambda m: m.insert_prefix([1, 2], s(1, 2)), TypeError, "torch.Tensor"),
    ("match 2-D ids", lambda m: m.match_prefix(t(1, 2).view(2, 1)), ValueError, "1-D"),
    ("match float ids", lambda m: m.match_prefix(torch.tensor([0.5])), TypeError, "integer dtype"),
    (
        "evict more than evictable",
        lambda m: m.evict(3),
        RuntimeError,
        "cannot evict 3 tokens: only 2",
    ),
    ("evict negative", lambda m: m.evict(-1), ValueError, ">= 0, got -1"),
    ("evict float", lambda m: m.evict(1.5), TypeError, "int"),
    ("reset while locked", lambda m: m.reset(), RuntimeError, "locked"),
    ("lock a non-handle", lambda m: m.lock_handle("handle"), TypeError, "RadixCacheHandle"),
]


@pytest.mark.parametrize("name,call,exc,match", RADIX_MISUSES, ids=[r[0] for r in RADIX_MISUSES])
def test_radix_misuse_leaves_tree_unchanged(name, call, exc, match):
    m = populated()
    unchanged(m, lambda: call(m), exc, match)


def test_unlock_never_locked_after_match_leaves_tree_unchanged():
    m = populated()
    h, _ = m.match_prefix(t(100))  # the match itself may refresh timestamps: take it first
    unchanged(m, lambda: m.lock_handle(h, unlock=True), RuntimeError, "not locked")


def test_handle_from_another_manager_is_refused():
    m, other = populated(), populated()
    h, _ = other.match_prefix(t(0, 1))
    unchanged(m, lambda: m.lock_handle(h), RuntimeError, "another manager")


def test_handle_of_evicted_node_is_refused():
    m = RadixCacheManager()
    m.insert_prefix(t(1, 2), s(0, 1))
    h, _ = m.match_prefix(t(1, 2))
    m.evict(2)
    unchanged(m, lambda: m.lock_handle(h), RuntimeError, "evicted")


def test_handle_after_reset_is_refused():
    m = RadixCacheManager()
    m.insert_prefix(t(1, 2), s(0, 1))
    h, _ = m.match_prefix(t(1, 2))
    m.reset()
    assert m.size_info == SizeInfo(0, 0) and m.root_node.is_leaf()
    unchanged(m, lambda: m.lock_handle(h), RuntimeError, "evicted")


def test_page_unaligned_indices_are_refused():
    m = populated(page_size=4)
    unchanged(
        m,
        lambda: m.insert_prefix(torch.arange(50, 54), s(1, 2, 3, 4)),
        ValueError,
        "consecutive slots",
    )
    unchanged(
        m,
        lambda: m.insert_prefix(torch.arange(50, 54), s(4, 5, 7, 6)),
        ValueError,
        "consecutive slots",
    )


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"page_size": 0}, ValueError, ">= 1, got 0"),
        ({"page_size": 2.0}, TypeError, "int"),
        ({"eviction_policy": "random"}, ValueError, "one of \\['fifo', 'lru'\\]"),
    ],
)
def test_radix_constructor_misuse(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        RadixCacheManager(**kwargs)


def test_root_handle_lock_is_a_no_op():
    m = populated()
    h, idx = m.match_prefix(t(7, 7))
    assert h.cached_len == 0 and len(idx) == 0 and idx.dtype == torch.int32
    before = radix_state(m)
    m.lock_handle(h)
    m.lock_handle(h, unlock=True)
    assert radix_state(m) == before


# ----------------------------------------------------------------------------- naive manager
def test_naive_manager_contract():
    m = NaiveCacheManager()
    h, idx = m.match_prefix(t(1, 2, 3))
    assert (
        h.cached_len == 0
        and idx.dtype == torch.int32
        and idx.numel() == 0
        and idx.device == m.device
    )
    assert m.insert_prefix(t(1, 2, 3), s(4, 5, 6)) == 3
    assert m.evict(0).numel() == 0
    with pytest.raises(NotImplementedError, match="cannot evict 1"):
        m.evict(1)
    with pytest.raises(ValueError, match=r"len\(indices\) \(2\).*\(3\)"):
        m.insert_prefix(t(1, 2, 3), s(1, 2))
    with pytest.raises(ValueError, match=">= 0"):
        m.evict(-2)
    assert m.size_info == SizeInfo(0, 0) and m.size_info.total_size == 0
    m.lock_handle(h)
    m.lock_handle(h, unlock=True)
    m.reset()
    m.check_integrity()


# ----------------------------------------------------------------------------- allocator
def test_allocator_misuse_changes_nothing():
    a = PageAllocator(4, page_size=2)
    pages = a.allocate(3)
    assert pages.tolist() == [0, 1, 2] and a.num_free_pages == 1
    before = a.free_pages().tolist()
    for bad, exc, match in [
        (s(3), RuntimeError, "double free"),
        (s(4), ValueError, r"pages: 4 is outside \[0, 4\)"),
        (s(-1), ValueError, r"pages: -1 is outside"),
        (s(0, 0), ValueError, "more than once"),
        (torch.tensor([0.0]), TypeError, "integer"),
    ]:
        with pytest.raises(exc, match=match):
            a.free(bad)
        assert a.free_pages().tolist() == before
    with pytest.raises(RuntimeError, match="cannot allocate 2 pages: only 1"):
        a.allocate(2)
    assert a.free_pages().tolist() == before
    a.free(s(1, 0))
    assert a.free_pages().tolist() == [3, 1, 0]
    assert a.pages_to_slots(s(3, 1), 3).tolist() == [6, 7, 2]
    assert a.slots_to_pages(s(6, 7, 2)).tolist() == [3, 1]


@pytest.mark.parametrize(
    "kwargs,exc", [({"num_pages": 0}, ValueError), ({"num_pages": 4, "page_size": 0}, ValueError)]
)
def test_allocator_constructor_misuse(kwargs, exc):
    with pytest.raises(exc):
        PageAllocator(**kwargs)


# ----------------------------------------------------------------------------- request flow
def flow_state(flow: RequestFlow) -> Any:
    return (
        flow.allocator.free_pages().tolist(),
        radix_state(flow.manager),
        {rid: (r.indices.tolist(), r.num_computed, r.tree_len) for rid, r in flow.running.items()},
    )


def test_flow_out_of_pages_changes_no_ownership():
    flow = RequestFlow(RadixCacheManager(), PageAllocator(4))
    r = flow.begin(t(1, 2, 3))
    flow.mark_computed(r)
    flow.cache(r)  # 3 cached, all locked by r
    free_before = flow.allocator.free_pages().tolist()
    with pytest.raises(RuntimeError, match="out of KV pages: need 2, 1 free and 0 evictable"):
        flow.begin(t(9, 9))
    assert flow.allocator.free_pages().tolist() == free_before
    assert flow.manager.size_info == SizeInfo(0, 3)
    flow.check_integrity()


def test_flow_misuse():
    flow = RequestFlow(RadixCacheManager(), PageAllocator(8))
    with pytest.raises(ValueError, match="at least one token"):
        flow.begin(t())
    r = flow.begin(t(1, 2))
    before = flow_state(flow)
    with pytest.raises(RuntimeError, match="without stored K/V"):
        flow.finish(r)
    with pytest.raises(ValueError, match=r"num_tokens must be in \[0, 2\], got 3"):
        flow.mark_computed(r, 3)
    assert flow_state(flow) == before
    flow.mark_computed(r)
    flow.finish(r)
    for call in (flow.finish, flow.abort, flow.cache, flow.mark_computed):
        with pytest.raises(RuntimeError, match="not running"):
            call(r)
    with pytest.raises(ValueError, match="page_size"):
        RequestFlow(RadixCacheManager(page_size=4), PageAllocator(8, page_size=2))


def test_flow_extend_fills_the_last_page_first():
    flow = RequestFlow(RadixCacheManager(page_size=4), PageAllocator(8, page_size=4))
    r = flow.begin(t(1, 2, 3, 4, 5, 6))
    assert r.indices.tolist() == [0, 1, 2, 3, 4, 5]
    flow.mark_computed(r)
    assert flow.extend(r, t(7, 8, 9)).tolist() == [6, 7, 8]
    flow.mark_computed(r)
    flow.check_integrity()
    flow.finish(r)  # 8 tokens cached, the partial third page freed
    assert flow.manager.size_info == SizeInfo(8, 0)
    assert flow.allocator.num_free_pages == 6
    flow.check_integrity()


def test_flow_cache_replaces_duplicates_with_the_trees_pages():
    """Two requests with the same prompt computed at once: the second's pages become duplicates."""
    flow = RequestFlow(RadixCacheManager(), PageAllocator(8))
    a, b = flow.begin(t(1, 2, 3)), flow.begin(t(1, 2, 3))
    for r in (a, b):
        flow.mark_computed(r)
    flow.cache(a)
    flow.cache(b)
    assert torch.equal(a.indices, b.indices)  # b now points at a's (the tree's) pages
    assert flow.allocator.num_free_pages == 5  # b's three duplicates were freed
    flow.check_integrity()
    flow.finish(a)
    flow.finish(b)
    assert flow.manager.size_info == SizeInfo(3, 0)
    flow.check_integrity()


def test_flow_with_naive_manager_cache_keeps_pages():
    flow = RequestFlow(NaiveCacheManager(), PageAllocator(4))
    r = flow.begin(t(1, 2, 3))
    flow.mark_computed(r)
    flow.cache(r)  # the naive manager's "already cached" is a lie: nothing may be freed
    assert r.indices.tolist() == [0, 1, 2] and flow.allocator.num_free_pages == 1
    flow.check_integrity()
    flow.finish(r)
    assert flow.allocator.num_free_pages == 4


class PlainCalls(RadixCacheManager):
    """A radix manager driven through the base class's fused calls (the public calls in turn)."""

    match_and_lock = BaseCacheManager.match_and_lock
    insert_and_unlock = BaseCacheManager.insert_and_unlock


@pytest.mark.parametrize("make", [RadixCacheManager, PlainCalls])
def test_insert_and_unlock_of_a_handle_not_locked_inserts_nothing(make):
    """The fused insert (radix's own, and the base default): an unlocked handle is refused
    before anything is inserted; a refused insert leaves the handle locked and nothing changed."""
    m = make()
    m.insert_prefix(t(1, 2), s(0, 1))
    handle, _ = m.match_prefix(t(1, 2, 3))
    unchanged(
        m, lambda: m.insert_and_unlock(handle, t(1, 2, 3), s(0, 1, 2)), RuntimeError, "not locked"
    )
    locked, _ = m.match_and_lock(t(1, 2, 3))
    assert m.size_info.protected_size == 2
    wide = torch.tensor([0, 1, 2])  # int64 slots
    unchanged(m, lambda: m.insert_and_unlock(locked, t(1, 2, 3), wide), TypeError, "int32")
    unchanged(m, lambda: m.insert_and_unlock(locked, t(1, 2, 3), s(0, 1, 1)), ValueError, "already")
    res = m.insert_and_unlock(locked, t(1, 2, 3), s(0, 1, 2), relock=True)
    assert res.cached_len == 2 and m.size_info == SizeInfo(0, 3)
    with pytest.raises(RuntimeError, match="not locked"):
        m.lock_handle(locked, unlock=True)
    m.lock_handle(res.handle, unlock=True)
    assert m.size_info == SizeInfo(3, 0) and m.num_locked_handles == 0
    m.check_integrity()
