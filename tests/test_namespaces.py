"""Namespaces (``extra_key``): prefixes cached under different keys never match each other.

The property test drives every caching manager with inserts, matches, evictions and lock
pairs under a few keys over a tiny alphabet (so the same tokens recur under every key), and
checks each match page by page against a reference dict ``(key, prefix) -> slots`` of
everything ever inserted: slots are fresh for every insert, so a slot names the one insert
(and key) it came from, and a match that crossed keys would return a slot the reference files
under another key.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import pytest
import torch
from conftest import ids, observe, slots, unchanged
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import (
    BaseCacheManager,
    BlockHashCacheManager,
    NaiveCacheManager,
    PageAllocator,
    RadixCacheManager,
    RequestFlow,
)

KEYS: list[Hashable] = [None, "tenant-a", "tenant-b", 7, b"tenant-a"]
Ref = dict[tuple[Hashable, tuple[int, ...]], list[int]]

MAKERS: dict[str, Callable[[], BaseCacheManager]] = {
    "radix-1": lambda: RadixCacheManager(page_size=1),
    "radix-2": lambda: RadixCacheManager(page_size=2, eviction_policy="fifo"),
    "block-2": lambda: BlockHashCacheManager(page_size=2),
    "block-2-weak-hash": lambda: BlockHashCacheManager(page_size=2, hash_fn=lambda p, t: 0),
}

OPS = st.lists(
    st.tuples(
        st.sampled_from(["insert", "match", "evict", "lock"]),
        st.sampled_from(KEYS),
        st.lists(st.integers(0, 2), min_size=0, max_size=8),
    ),
    min_size=1,
    max_size=30,
)


def _expected(ref: Ref, key: Hashable, toks: list[int], ps: int) -> list[int]:
    """The slots of the longest run of whole pages of ``toks`` the reference has under ``key``."""
    out: list[int] = []
    for end in range(ps, len(toks) // ps * ps + 1, ps):
        page = ref.get((key, tuple(toks[:end])))
        if page is None:
            break
        out.extend(page)
    return out


@pytest.mark.parametrize("make", list(MAKERS), ids=list(MAKERS))
@settings(max_examples=60, deadline=None, derandomize=True)
@given(ops=OPS)
def test_keys_never_cross(make: str, ops: list[tuple[str, Hashable, list[int]]]) -> None:
    m = MAKERS[make]()
    ps = m.page_size
    ref: Ref = {}
    evicted: set[int] = set()
    next_slot = 0
    for op, key, toks in ops:
        n = len(toks) // ps * ps
        if op == "insert":
            fresh = list(range(next_slot, next_slot + len(toks)))
            next_slot += len(toks) + (-len(toks) % ps)  # the next insert starts on a new page
            before = len(_expected(ref, key, toks, ps))
            live = before == len(_expected_live(ref, key, toks, ps, evicted))
            got = m.insert_prefix(ids(*toks), slots(*fresh), extra_key=key)
            if live:
                assert got == before
            for end in range(ps, n + 1, ps):
                k = (key, tuple(toks[:end]))
                if end > got:
                    ref[k] = fresh[end - ps : end]
        elif op == "match":
            handle, got_slots = m.match_prefix(ids(*toks), extra_key=key)
            got_list = got_slots.tolist()
            assert handle.cached_len == len(got_list)
            # Page by page, the slots are those the reference filed under this key and prefix.
            for end in range(ps, len(got_list) + 1, ps):
                assert ref[(key, tuple(toks[:end]))] == got_list[end - ps : end]
            assert len(got_list) <= len(_expected(ref, key, toks, ps))
            assert got_list == _expected_live(ref, key, toks, ps, evicted)
            assert m.handle_indices(handle).tolist() == got_list
        elif op == "lock":
            handle, _ = m.match_prefix(ids(*toks), extra_key=key)
            m.lock_handle(handle)
            assert m.handle_indices(handle).shape[0] == handle.cached_len
            m.lock_handle(handle, unlock=True)
        else:
            size = min(m.size_info.evictable_size, len(toks))
            evicted.update(m.evict(size).tolist())
        m.check_integrity()
        cached = sorted(m.cached_indices().tolist())
        assert len(cached) == m.size_info.total_size
        assert not set(cached) & evicted


def _expected_live(
    ref: Ref, key: Hashable, toks: list[int], ps: int, evicted: set[int]
) -> list[int]:
    """`_expected`, stopping at the first page that was evicted (its slots are gone)."""
    out: list[int] = []
    for end in range(ps, len(toks) // ps * ps + 1, ps):
        page = ref.get((key, tuple(toks[:end])))
        if page is None or page[0] in evicted:
            break
        out.extend(page)
    return out


@pytest.mark.parametrize("make", list(MAKERS), ids=list(MAKERS))
def test_same_tokens_under_two_keys_are_two_prefixes(make: str) -> None:
    m = MAKERS[make]()
    ps = m.page_size
    prompt = ids(*range(4 * ps))
    assert m.insert_prefix(prompt, slots(*range(4 * ps)), extra_key="a") == 0
    assert m.match_prefix(prompt)[0].cached_len == 0  # None is a namespace of its own
    assert m.match_prefix(prompt, extra_key="b")[0].cached_len == 0
    assert m.insert_prefix(prompt, slots(*range(4 * ps, 8 * ps))) == 0
    assert m.match_prefix(prompt, extra_key="a")[1].tolist() == list(range(4 * ps))
    assert m.match_prefix(prompt)[1].tolist() == list(range(4 * ps, 8 * ps))
    assert m.size_info.total_size == 8 * ps
    m.check_integrity()
    m.evict(8 * ps)
    assert m.size_info.total_size == 0 and m.cached_indices().shape[0] == 0
    m.check_integrity()
    m.insert_prefix(prompt, slots(*range(4 * ps)), extra_key=b"x")
    m.reset()
    assert m.match_prefix(prompt, extra_key=b"x")[0].cached_len == 0
    m.check_integrity()


@pytest.mark.parametrize("make", [*MAKERS, "naive"], ids=[*MAKERS, "naive"])
@pytest.mark.parametrize("bad", [[1], {"a": 1}, {2}, bytearray(b"x")])
def test_unhashable_key_is_refused_and_changes_nothing(make: str, bad: object) -> None:
    m = MAKERS[make]() if make != "naive" else NaiveCacheManager(page_size=2)
    ps = m.page_size
    m.insert_prefix(ids(*range(2 * ps)), slots(*range(2 * ps)), extra_key="a")
    before = (observe(m), m.cached_indices().tolist())
    for call in (
        lambda: m.match_prefix(ids(*range(2 * ps)), extra_key=bad),
        lambda: m.insert_prefix(ids(*range(2 * ps)), slots(*range(9 * ps, 11 * ps)), bad),
        lambda: m.insert_and_match(ids(*range(2 * ps)), slots(*range(9 * ps, 11 * ps)), bad),
    ):
        with pytest.raises(TypeError, match="extra_key must be hashable"):
            call()
        assert (observe(m), m.cached_indices().tolist()) == before


@pytest.mark.parametrize("make", ["radix-1", "block-2"])
def test_flow_keeps_tenants_apart(make: str) -> None:
    m = MAKERS[make]()
    ps = m.page_size
    flow = RequestFlow(m, PageAllocator(64, ps))
    prompt = ids(*range(6 * ps))

    def run(key: Hashable) -> int:
        req = flow.begin(prompt, extra_key=key)
        reused = req.reused_len
        flow.mark_computed(req)
        flow.cache(req)
        flow.extend(req, ids(99))
        flow.mark_computed(req)
        flow.finish(req)
        flow.check_integrity()
        return reused

    assert run("alice") == 0
    assert run("bob") == 0  # bob never sees alice's prefix
    assert run("alice") == 6 * ps
    assert run(None) == 0
    assert run(None) == 6 * ps
    reqs = flow.begin_batch([prompt, prompt[: 2 * ps]], extra_key="bob")
    assert [r.reused_len for r in reqs] == [6 * ps, 2 * ps]
    assert all(r.extra_key == "bob" for r in reqs)
    for r in reqs:
        flow.abort(r)
    flow.check_integrity()
    with unchanged(flow), pytest.raises(TypeError, match="extra_key"):
        flow.begin(prompt, extra_key=["alice"])  # type: ignore[arg-type]
    with unchanged(flow), pytest.raises(TypeError, match="extra_key"):
        flow.begin_batch([prompt], extra_key={})  # type: ignore[arg-type]
    assert flow.reset_prefix_cache() == 3 * ((6 * ps + 1) // ps * ps)  # three keys, one prompt
    flow.check_integrity()


def test_default_key_walks_the_same_tree_as_before() -> None:
    """``extra_key=None`` is today's behaviour: one root, ``root_node``, and its nodes."""
    m = RadixCacheManager(page_size=1)
    m.insert_prefix(ids(1, 2, 3), slots(0, 1, 2))
    m.insert_prefix(ids(1, 2, 3), slots(3, 4, 5), extra_key="t")
    assert list(m.roots) == [None, "t"] and m.roots[None] is m.root_node
    assert [n.length for n in m.nodes()] == [0, 3]
    assert [n.value.tolist() for n in m.nodes("t")] == [[], [3, 4, 5]]
    assert list(m.nodes("never inserted")) == []
    assert torch.equal(m.cached_indices().sort().values, torch.arange(6, dtype=torch.int32))
