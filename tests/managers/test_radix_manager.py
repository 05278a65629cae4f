"""Unit tests of RadixCacheManager: policies, pages, and check_integrity catching each corruption."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import ids as t
from conftest import slots as s
from hypothesis import given, settings
from hypothesis import strategies as st

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
    # Children are filed under their first page, as the bytes of its int64 token ids.
    (child,) = m.root_node.children
    assert np.frombuffer(child, dtype=np.int64).tolist() == [0, 1, 2, 3]
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

    def no_scan():
        raise AssertionError("evict walked the whole tree")

    m.nodes = no_scan
    assert len(m.evict(2)) == 2
    del m.nodes
    m.check_integrity()


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
    "sizes disagree": (
        lambda m: setattr(m, "_protected_size", m._protected_size + 1),
        "sizes disagree",
    ),
    "negative ref count": (lambda m: setattr(node(m, 1, 4), "ref_count", -1), "negative ref_count"),
    "ref count below a child's": (
        lambda m: setattr(node(m, 1), "ref_count", 0),
        "exceeds its parent",
    ),
    "empty node": (
        lambda m: (
            setattr(node(m, 1, 4), "key_bytes", b""),
            setattr(node(m, 1, 4), "value_array", np.empty(0, np.int32)),
        ),
        "empty node",
    ),
    "filed under wrong token": (
        lambda m: node(m, 1).children.__setitem__(5, node(m, 1).children.pop(4)),
        "filed under 5",
    ),
    "wrong parent link": (
        lambda m: setattr(node(m, 1, 4), "parent", node(m, 1, 3)),
        "parent link",
    ),
    "index twice": (
        lambda m: setattr(node(m, 1, 4), "value_array", np.array([0], np.int32)),
        "more than once",
    ),
    "key/value lengths differ": (
        lambda m: setattr(node(m, 1, 4), "value_array", np.array([3, 9], np.int32)),
        "1 tokens but 2 indices",
    ),
    "slots changed behind the manager": (
        lambda m: setattr(node(m, 1, 4), "value_array", np.array([7], np.int32)),
        "pages disagree with its slots",
    ),
    "held-slot record wrong": (lambda m: m._held.fill(0), "held slots"),
    "evictable leaf not filed": (lambda m: m._leaves.clear(), "missing from the eviction heap"),
}


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_check_integrity_catches(name):
    m = tree()
    corrupt, message = CORRUPTIONS[name]
    corrupt(m)
    with pytest.raises(RuntimeError, match=message):
        m.check_integrity()


# ----------------------------------------------------------------------------- misuse
def state(m):
    """Everything a refused call must leave as it was."""
    nodes = [
        (n.uuid, n.ref_count, n.timestamp, n.length, tuple(n.value.tolist())) for n in m.nodes()
    ]
    return m.size_info, m.clock, m.num_nodes, nodes


@pytest.mark.parametrize("page_size", [1, 4])
def test_unlocking_a_handle_never_locked_is_refused_while_an_ancestor_is_locked(page_size):
    """Issue 9 item 3: the unlock used to pass (the ancestor's ref count was positive) and
    corrupt the counts."""
    ps = page_size
    m = RadixCacheManager(page_size=ps)
    m.insert_prefix(torch.arange(4 * ps), torch.arange(4 * ps, dtype=torch.int32))
    short, _ = m.match_prefix(torch.arange(2 * ps))
    long, _ = m.match_prefix(torch.arange(4 * ps))
    copy, _ = m.match_prefix(torch.arange(4 * ps))  # equal to `long`, but not locked itself
    assert copy == long
    m.lock_handle(long)  # locks the short prefix's node too, through the long handle
    before = state(m)
    for never in (short, copy):
        with pytest.raises(RuntimeError, match="not locked"):
            m.lock_handle(never, unlock=True)
    assert state(m) == before
    m.lock_handle(long, unlock=True)
    with pytest.raises(RuntimeError, match="not locked"):
        m.lock_handle(long, unlock=True)  # once locked, once unlocked: no more
    m.check_integrity()
    assert m.size_info == SizeInfo(4 * ps, 0)


def test_locks_are_counted_per_handle():
    m = RadixCacheManager()
    m.insert_prefix(t(1, 2), s(0, 1))
    h, _ = m.match_prefix(t(1, 2))
    m.lock_handle(h)
    m.lock_handle(h)
    m.lock_handle(h, unlock=True)
    assert m.size_info == SizeInfo(0, 2) and m.num_locked_handles == 1
    m.lock_handle(h, unlock=True)
    assert m.size_info == SizeInfo(2, 0) and m.num_locked_handles == 0
    root = m.match_prefix(t(9))[0]  # an empty handle: its locks are counted too
    with pytest.raises(RuntimeError, match="not locked"):
        m.lock_handle(root, unlock=True)
    m.lock_handle(root)
    m.lock_handle(root, unlock=True)
    m.check_integrity()


def test_naive_manager_refuses_unlocking_a_handle_never_locked():
    from kvcache import NaiveCacheManager

    m = NaiveCacheManager()
    a, _ = m.match_prefix(t(1, 2))
    b, _ = m.match_prefix(t(1, 2))
    m.lock_handle(a)
    with pytest.raises(RuntimeError, match="not locked"):
        m.lock_handle(b, unlock=True)
    m.lock_handle(a, unlock=True)
    with pytest.raises(RuntimeError, match="not locked"):
        m.lock_handle(a, unlock=True)


def test_a_handle_made_invalid_is_refused_clearly():
    m = RadixCacheManager()
    m.insert_prefix(t(1, 2), s(0, 1))
    h, _ = m.match_prefix(t(1, 2))
    m.evict(2)
    before = state(m)
    with pytest.raises(RuntimeError, match="evicted"):
        m.lock_handle(h)
    with pytest.raises(RuntimeError, match="evicted"):
        m.handle_indices(h)
    with pytest.raises(RuntimeError, match="not locked"):
        m.lock_handle(h, unlock=True)
    m.insert_prefix(t(3), s(5))
    old, _ = m.match_prefix(t(3))
    m.reset()
    with pytest.raises(RuntimeError, match="reset"):
        m.lock_handle(old)
    m.insert_prefix(t(3), s(5))
    live, _ = m.match_prefix(t(3))
    with pytest.raises(RuntimeError, match="another manager"):
        RadixCacheManager().lock_handle(live)
    assert state(m)[0] == SizeInfo(1, 0) and before[0] == SizeInfo(0, 0)
    m.check_integrity()


@pytest.mark.parametrize("page_size", [1, 2])
@pytest.mark.parametrize(
    "case", ["held", "twice", "negative", "misaligned", "bool", "float", "complex", "int64"]
)
def test_insert_refuses_slots_it_cannot_hold(page_size, case):
    """Issue 9 item 4: a slot held twice would be freed by one eviction while another prefix
    still serves it."""
    ps = page_size
    m = RadixCacheManager(page_size=ps)
    m.insert_prefix(torch.arange(2 * ps), torch.arange(2 * ps, dtype=torch.int32))
    m.insert_prefix(t(*([7] * ps)), torch.arange(10 * ps, 11 * ps, dtype=torch.int32))
    ids = torch.arange(6 * ps)  # the first two pages are cached: only pages 3..6 are new
    good = torch.arange(20 * ps, 26 * ps, dtype=torch.int32)
    bad = {
        "held": good.clone().index_fill_(0, torch.tensor([3 * ps]), 10 * ps),
        "twice": torch.cat([good[: 4 * ps], good[2 * ps : 4 * ps]]),
        "negative": torch.cat([good[: 5 * ps], torch.arange(-ps, 0, dtype=torch.int32)]),
        "misaligned": good + 1,
        "bool": good.to(torch.bool),
        "float": good.float(),
        "complex": good.to(torch.complex64),
        "int64": good.long(),
    }[case]
    if case == "misaligned" and ps == 1:
        bad = good.clone().index_fill_(0, torch.tensor([4]), 1)  # held: no alignment at page size 1
    before = state(m)
    error = TypeError if case in ("bool", "float", "complex", "int64") else ValueError
    with pytest.raises(error, match="indices"):
        m.insert_prefix(ids, bad)
    assert state(m) == before
    m.check_integrity()
    # The cached part is not the caller's to give: it may hold anything, even held slots.
    assert (
        m.insert_prefix(ids, torch.cat([torch.zeros(2 * ps, dtype=torch.int32), good[2 * ps :]]))
        == 2 * ps
    )
    m.check_integrity()


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    ops=st.lists(
        st.tuples(
            st.lists(st.integers(0, 2), min_size=1, max_size=6),
            st.lists(st.integers(-1, 9), min_size=6, max_size=6),
            st.booleans(),
        ),
        max_size=12,
    )
)
def test_insert_accepts_exactly_the_slots_it_can_hold(ops):
    """Against a model: an insert is refused iff a slot entering the tree is negative, held, or
    listed twice; a refused insert changes nothing; evicting frees slots for reuse."""
    m = RadixCacheManager()
    cached = {}  # prefix tuple -> slot of its last token
    for seq, slots, evict in ops:
        seq = tuple(seq)
        k = 0
        while k < len(seq) and seq[: k + 1] in cached:
            k += 1
        new = slots[k : len(seq)]
        ok = (
            all(x >= 0 for x in new)
            and len(set(new)) == len(new)
            and not set(new) & set(cached.values())
        )
        before = state(m)
        try:
            got = m.insert_prefix(
                torch.tensor(seq), torch.tensor(slots[: len(seq)], dtype=torch.int32)
            )
        except ValueError:
            assert not ok and state(m) == before
        else:
            assert ok and got == k
            cached.update({seq[: i + 1]: slots[i] for i in range(k, len(seq))})
        m.check_integrity()
        assert sorted(m.cached_indices().tolist()) == sorted(cached.values())
        if evict and m.size_info.evictable_size:
            for x in m.evict(1).tolist():
                cached = {p: v for p, v in cached.items() if v != x}
            m.check_integrity()


@pytest.mark.parametrize("page_size", [1, 2])
def test_every_method_works_on_a_chain_1100_nodes_deep(page_size):
    """Issue 9 item 9: a request cached after every decode token makes a chain as deep as its
    length; nothing may recurse over depth."""
    ps, depth = page_size, 1100
    m = RadixCacheManager(page_size=ps)
    ids = torch.arange(depth * ps)
    slots = torch.arange(depth * ps, dtype=torch.int32)
    for d in range(1, depth + 1):
        res = m.insert_and_match(ids[: d * ps], slots[: d * ps])
        assert res.cached_len == (d - 1) * ps and res.handle.cached_len == d * ps
    assert m.num_nodes == depth
    m.check_integrity()
    h, idx = m.match_prefix(ids)
    assert torch.equal(idx, slots) and torch.equal(m.handle_indices(h), slots)
    m.lock_handle(h)
    assert m.size_info == SizeInfo(0, depth * ps)
    m.check_integrity()
    assert len(list(m.nodes())) == depth + 1 and len(m.cached_indices()) == depth * ps
    assert m.eviction_priority(h.node) == (h.node.timestamp, h.node.uuid)
    repr(h)
    assert h == m.match_prefix(ids)[0] and hash(h) == hash(m.match_prefix(ids)[0])
    m.lock_handle(h, unlock=True)
    _half, _ = m.match_prefix(ids[: depth // 2 * ps])  # no split: a node boundary
    assert m.num_nodes == depth
    assert sorted(m.evict(depth * ps).tolist()) == slots.tolist()  # one leaf after another
    m.check_integrity()
    m.insert_prefix(ids, slots)
    m.reset()
    m.check_integrity()


@pytest.mark.parametrize("make", ["naive", "radix1", "radix4"])
@pytest.mark.parametrize(
    "bad",
    [
        torch.tensor([1.0, 2.0]),
        torch.tensor([True, False]),
        torch.tensor([1 + 0j]),
        torch.tensor([[1, 2]]),
        [1, 2],
        np.array([1, 2]),
    ],
)
def test_token_ids_and_counts_must_be_real_integers(make, bad):
    """Issue 9 item 5 for the managers: never truncate a float, never read a bool as a token."""
    from kvcache import NaiveCacheManager

    m = {
        "naive": NaiveCacheManager,
        "radix1": RadixCacheManager,
        "radix4": lambda: RadixCacheManager(page_size=4),
    }[make]()
    m.insert_prefix(torch.arange(8), torch.arange(8, dtype=torch.int32))
    before = (m.size_info, [n.ref_count for n in m.nodes()] if make != "naive" else None)
    with pytest.raises((TypeError, ValueError), match="input_ids"):
        m.match_prefix(bad)
    with pytest.raises((TypeError, ValueError), match="input_ids"):
        m.insert_prefix(bad, torch.zeros(2, dtype=torch.int32))
    for size in (True, 1.0, 2.5, 1 + 0j, "1"):
        with pytest.raises(TypeError, match="size"):
            m.evict(size)
    assert before == (m.size_info, [n.ref_count for n in m.nodes()] if make != "naive" else None)


def test_a_handle_made_by_hand_with_the_wrong_length_is_refused():
    from kvcache import RadixCacheHandle

    m = RadixCacheManager()
    m.insert_prefix(t(1, 2, 3), s(0, 1, 2))
    h, _ = m.match_prefix(t(1, 2, 3))
    forged = RadixCacheHandle(2, h.node)
    before = state(m)
    with pytest.raises(RuntimeError, match="cached_len=2 but its path holds 3"):
        m.lock_handle(forged)
    with pytest.raises(RuntimeError, match="cached_len=2 but its path holds 3"):
        m.handle_indices(forged)
    assert state(m) == before and m.num_locked_handles == 0
    m.check_integrity()


def test_a_subclass_overriding_a_part_takes_the_fused_calls_back():
    """`RequestFlow` makes one call for match + lock and for insert + unlock on a radix manager;
    a subclass overriding ``match_prefix`` (here: counting) that takes the base class's fused
    calls back, as `BaseCacheManager` documents, sees every match. So does one that does not:
    radix's own `match_and_lock` is `match_prefix` then the lock."""
    from kvcache import BaseCacheManager, PageAllocator, RequestFlow

    class Counting(RadixCacheManager):
        matches = 0
        match_and_lock = BaseCacheManager.match_and_lock
        insert_and_unlock = BaseCacheManager.insert_and_unlock

        def match_prefix(self, input_ids, extra_key=None):
            Counting.matches += 1
            return super().match_prefix(input_ids, extra_key)

    class Plain(RadixCacheManager):
        matches = 0

        def match_prefix(self, input_ids, extra_key=None):
            Plain.matches += 1
            return super().match_prefix(input_ids, extra_key)

    for manager in (RadixCacheManager(), Counting(), Plain()):
        flow = RequestFlow(manager, PageAllocator(16))
        for _ in range(2):
            req = flow.begin(torch.tensor([1, 2, 3]))
            flow.mark_computed(req)
            flow.finish(req)
            flow.check_integrity()
        assert manager.size_info.total_size == 3 and manager.num_locked_handles == 0
    assert Counting.matches == 2
    assert Plain.matches == 2


def test_page_alignment_is_checked_past_the_kept_page_rows():
    """Slots past the 4M whose page rows the slot record keeps are checked by arithmetic: the
    same acceptance and the same refusal."""
    m = RadixCacheManager(page_size=16)
    far = 5_000_000 // 16 * 16
    m.insert_prefix(torch.arange(32), torch.arange(far, far + 32, dtype=torch.int32))
    assert m.size_info.total_size == 32
    bad = torch.arange(far + 64, far + 96, dtype=torch.int32)
    bad[17] = far + 200
    with pytest.raises(ValueError, match="consecutive slots of one page"):
        m.insert_prefix(torch.arange(100, 132), bad)
    m.check_integrity()
    assert m.size_info.total_size == 32
