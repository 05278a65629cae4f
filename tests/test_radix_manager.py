"""Unit tests of RadixCacheManager: policies, pages, and check_integrity catching each corruption."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import ids as t, slots as s
from kvcache import EVICTION_POLICIES, RadixCacheManager, SizeInfo, register_eviction_policy


def test_partial_match_refreshes_the_matched_part():
    """Source error 3: the split-off prefix must count as just used."""
    m = RadixCacheManager()
    m.insert_prefix(t(1, 2, 3), s(0, 1, 2))  # [1 2 3] at time 1
    m.insert_prefix(t(9), s(9))  # [9] at time 2
    m.match_prefix(t(1, 2, 7))  # uses [1 2] at time 3 -> split into [1 2] + [3]
    assert sorted(m.evict(1).tolist()) == [2]  # the old suffix [3] goes first
    assert m.evict(1).tolist() == [9]  # then [9] (time 2), before the just-used [1 2] (time 3)
    assert m.evict(1).tolist() == [0, 1]
    m.check_integrity()


def test_lru_and_fifo_differ_on_the_same_sequence():
    out = {}
    for policy in ("lru", "fifo"):
        m = RadixCacheManager(eviction_policy=policy)
        m.insert_prefix(t(1, 1), s(0, 1))  # A, oldest
        m.insert_prefix(t(2, 2), s(2, 3))  # B
        m.match_prefix(t(1, 1))  # A used again
        out[policy] = m.evict(1).tolist()
        m.check_integrity()
    assert out == {"lru": [2, 3], "fifo": [0, 1]}


def test_registering_a_policy():
    name = "longest-first-test"

    @register_eviction_policy(name)
    class LongestFirst:
        def priority(self, node):
            return (-node.length, node.uuid)

    try:
        m = RadixCacheManager(eviction_policy=name)
        m.insert_prefix(t(1), s(0))
        m.insert_prefix(t(2, 2, 2), s(1, 2, 3))
        assert m.evict(1).tolist() == [1, 2, 3]
        with pytest.raises(ValueError, match="already registered"):
            register_eviction_policy(name)(type("X", (), {}))
    finally:
        del EVICTION_POLICIES[name]


def test_page_aligned_match_and_insert():
    m = RadixCacheManager(page_size=4)
    # 10 tokens: only the first 8 (two pages) are inserted.
    assert m.insert_prefix(torch.arange(10), torch.arange(8, 18, dtype=torch.int32)) == 0
    assert m.size_info == SizeInfo(8, 0)
    h, idx = m.match_prefix(torch.arange(10))
    assert h.cached_len == 8 and idx.tolist() == list(range(8, 16))
    # A mismatch inside the second page matches the first page only, and splits on the boundary.
    h, idx = m.match_prefix(t(0, 1, 2, 3, 4, 5, 99, 7))
    assert h.cached_len == 4 and idx.tolist() == [8, 9, 10, 11]
    assert [n.length for n in m.nodes()] == [0, 4, 4]
    # A mismatch in the first page matches nothing.
    assert m.match_prefix(t(0, 1, 2, 99))[0].cached_len == 0
    # Children are filed under their first page.
    (child,) = m.root_node.children
    assert child == (0, 1, 2, 3)
    m.check_integrity()


def test_values_are_copied_on_insert():
    m = RadixCacheManager()
    ids, idx = t(1, 2), s(5, 6)
    m.insert_prefix(ids, idx)
    ids[0], idx[0] = 7, 7  # the caller reuses its buffers
    h, got = m.match_prefix(t(1, 2))
    assert h.cached_len == 2 and got.tolist() == [5, 6]


def test_evict_cost_does_not_grow_with_tree_size():
    """Heap of evictable leaves: popping one never scans the tree (counted, not timed)."""
    m = RadixCacheManager()
    for i in range(2000):
        m.insert_prefix(t(i // 256, i % 256), s(2 * i, 2 * i + 1))
    calls = {"n": 0}
    orig = m._child_key

    def counting(ids, pos=0):
        calls["n"] += 1
        return orig(ids, pos)

    m._child_key = counting
    m.evict(2)
    assert calls["n"] <= 4  # one leaf removed: a constant number of key computations


# ----------------------------------------------------------------------------- integrity
def tree() -> RadixCacheManager:
    m = RadixCacheManager()
    m.insert_prefix(t(1, 2, 3), s(0, 1, 2))
    m.insert_prefix(t(1, 2, 4), s(0, 1, 3))
    h, _ = m.match_prefix(t(1, 2, 3))
    m.lock_handle(h)
    m.check_integrity()
    return m


def node(m: RadixCacheManager, *path: int):
    n = m.root_node
    for tok in path:
        n = n.children[tok]
    return n


CORRUPTIONS = {
    "sizes disagree": (lambda m: setattr(m, "_evictable_size", m._evictable_size + 1), "sizes disagree"),
    "negative ref count": (lambda m: setattr(node(m, 1, 4), "ref_count", -1), "negative ref_count"),
    "ref count below a child's": (lambda m: setattr(node(m, 1), "ref_count", 0), "exceeds its parent"),
    "empty node": (lambda m: (setattr(node(m, 1, 4), "_key", np.empty(0, np.int64)),
                              setattr(node(m, 1, 4), "_value", s())), "empty node"),
    "filed under wrong token": (lambda m: node(m, 1).children.__setitem__(5, node(m, 1).children.pop(4)), "filed under 5"),
    "wrong parent link": (lambda m: setattr(node(m, 1, 4), "_parent", node(m, 1, 3)), "parent link"),
    "index twice": (lambda m: setattr(node(m, 1, 4), "_value", s(0)), "more than once"),
    "key/value lengths differ": (lambda m: setattr(node(m, 1, 4), "_value", s(3, 9)), "1 tokens but 2 indices"),
    "evictable leaf not filed": (lambda m: m._heap.clear(), "missing from the eviction heap"),
}


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_check_integrity_catches(name):
    m = tree()
    corrupt, message = CORRUPTIONS[name]
    corrupt(m)
    with pytest.raises(RuntimeError, match=message):
        m.check_integrity()
