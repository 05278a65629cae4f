"""Eviction order under every kind of policy (issue 27 items 9 and 10).

SGLang's strategies (``python/sglang/srt/mem_cache/evict_policy.py``: LRU ``last_access_time``,
LFU ``(hit_count, last_access_time)``, FIFO ``creation_time``, MRU ``-last_access_time``, FILO
``-creation_time``) are registered here as a user would, with `register_eviction_policy`, over
the node fields they read (``timestamp``, ``hit_count``, ``insert_time``). MRU and FILO do not
declare ``monotone`` (MRU's priority falls with every use), LRU, FIFO and LFU do; LFU is also
registered without the declaration, to check the exact path on a monotone priority.

The reference is SGLang's own ``evict``: scan the tree for the evictable leaves, heap them by
priority (ties to the smaller uuid), pop, and push a parent that is left an unlocked leaf.
Under random sequences of match, insert, lock, unlock and evict over several namespaces,
`evict` must free exactly the reference's nodes in the reference's order, and `predict_evict`
(which the drawings use) must name them before the call.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import EVICTION_POLICIES, RadixCacheManager, register_eviction_policy
from kvcache.viz import predict_evict, snapshot, tree_text
from kvcache.viz.snapshot import evict_order

#: name -> (priority over the node's fields, as SGLang writes it; declared monotone?)
SGLANG: dict[str, tuple[Callable[[Any], Any], bool]] = {
    "sglang-lru": (lambda n: n.timestamp, True),
    "sglang-fifo": (lambda n: n.insert_time, True),
    "sglang-lfu": (lambda n: (n.hit_count, n.timestamp), True),
    "sglang-lfu-undeclared": (lambda n: (n.hit_count, n.timestamp), False),
    "sglang-mru": (lambda n: -n.timestamp, False),
    "sglang-filo": (lambda n: -n.insert_time, False),
}


@pytest.fixture(scope="module", autouse=True)
def registered():
    for name, (priority, monotone) in SGLANG.items():
        body: dict[str, Any] = {"priority": lambda self, node, f=priority: f(node)}
        if monotone:
            body["monotone"] = True
        register_eviction_policy(name)(type(name, (), body))
    yield
    for name in SGLANG:
        del EVICTION_POLICIES[name]


def reference_order(m: RadixCacheManager, size: int, priority: Callable[[Any], Any]) -> list[Any]:
    """SGLang's evict on ``m``'s tree as it is now (read only): the nodes in eviction order."""
    nodes = [n for key in m.roots for n in m.nodes(key)]
    left = {id(n): len(n.children) for n in nodes}
    heap = [
        (priority(n), n.uuid, n)
        for n in nodes
        if not n.is_root() and n.ref_count == 0 and not n.children
    ]
    heapq.heapify(heap)
    order, freed = [], 0
    while freed < size:
        _, _, node = heapq.heappop(heap)
        order.append(node)
        freed += node.length
        parent = node.parent
        left[id(parent)] -= 1
        if not parent.is_root() and parent.ref_count == 0 and left[id(parent)] == 0:
            heapq.heappush(heap, (priority(parent), parent.uuid, parent))
    return order


KEYS: list[Hashable] = [None, "tenant-a", 7]
OPS = st.lists(
    st.tuples(
        st.sampled_from(  # weighted: inserts, uses of whole prompts again and evictions
            ["insert"] * 3 + ["again"] * 3 + ["evict"] * 2 + ["match", "lock", "unlock", "fused"]
        ),
        st.lists(st.integers(0, 3), max_size=10),  # few tokens: prefixes are shared
        st.integers(0, 10**6),
    ),
    min_size=8,  # long enough to insert, use again and evict
    max_size=40,
)


@pytest.mark.parametrize("name", sorted(SGLANG))
@settings(max_examples=60, deadline=None, derandomize=True)
@given(ops=OPS, ps=st.sampled_from([1, 2]))
def test_evict_takes_the_reference_order(name: str, ops: list, ps: int) -> None:
    priority = SGLANG[name][0]
    m = RadixCacheManager(page_size=ps, eviction_policy=name)
    locked: list[Any] = []  # handles locked now
    seen: list[tuple[list[int], Hashable]] = []  # what was inserted: matched "again" whole
    fresh = 0
    for op, toks, x in ops:
        key = KEYS[x % len(KEYS)]
        if op == "again" and seen:  # a whole prompt used again: its leaf's priority moves
            toks, key = seen[x % len(seen)]
        ids = torch.tensor(toks, dtype=torch.int64)
        if op in ("match", "again"):
            m.match_prefix(ids, key)
        elif op == "lock":
            handle, _ = m.match_prefix(ids, key)
            m.lock_handle(handle)
            locked.append(handle)
        elif op == "unlock" and locked:
            m.lock_handle(locked.pop(x % len(locked)), unlock=True)
        elif op in ("insert", "fused"):
            cached = m.walk(ids, key).length
            slots = list(range(fresh, fresh + len(toks)))
            fresh += -(-len(toks) // ps) * ps
            if cached:  # the cached part's slots are the tree's; the rest are new
                handle, prefix = m.match_prefix(ids[:cached], key)
                slots[:cached] = prefix.tolist()
            seen.append((toks, key))
            if op == "insert":
                m.insert_prefix(ids, torch.tensor(slots, dtype=torch.int32), key)
            else:  # the flow's fused pair, the lock moving to the inserted prefix
                handle, _ = m.match_and_lock(ids[:cached], key)
                res = m.insert_and_unlock(
                    handle, ids, torch.tensor(slots, dtype=torch.int32), key, relock=True
                )
                locked.append(res.handle)
        elif op == "evict":
            size = min(x % 7 + 1, m.size_info.evictable_size)
            want = reference_order(m, size, priority)
            predicted = predict_evict(m, size)
            slots = m.evict(size).tolist()
            assert slots == [s for n in want for s in n.value.tolist()], name
            assert predicted == [n.uuid for n in want]
            assert all(not n.in_tree for n in want)
        m.check_integrity()


def test_mru_and_filo_take_the_newest_first() -> None:
    """The cases the lazy heap got wrong: a leaf used again under MRU goes first, the newest
    insert first under FILO."""
    for name, want in (("sglang-mru", [[0, 1]]), ("sglang-filo", [[4, 5]])):
        m = RadixCacheManager(eviction_policy=name)
        m.insert_prefix(torch.tensor([1, 1]), torch.tensor([0, 1], dtype=torch.int32))
        m.insert_prefix(torch.tensor([2, 2]), torch.tensor([2, 3], dtype=torch.int32))
        m.insert_prefix(torch.tensor([3, 3]), torch.tensor([4, 5], dtype=torch.int32))
        m.match_prefix(torch.tensor([1, 1]))  # [1 1] is now the most recently used
        assert [m.evict(2).tolist()] == want, name
        m.check_integrity()


def test_a_policy_falsely_declared_monotone_is_caught_by_check_integrity() -> None:
    name = "mru-claimed-monotone"
    register_eviction_policy(name)(
        type(name, (), {"monotone": True, "priority": lambda self, n: (-n.timestamp, n.uuid)})
    )
    try:
        m = RadixCacheManager(eviction_policy=name)
        m.insert_prefix(torch.tensor([1]), torch.tensor([0], dtype=torch.int32))
        m.check_integrity()
        m.match_prefix(torch.tensor([1]))  # its priority falls: the lazy heap is not told
        with pytest.raises(RuntimeError, match="missing from the eviction heap"):
            m.check_integrity()
    finally:
        del EVICTION_POLICIES[name]


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_monotone_must_be_a_bool(bad: object) -> None:
    with pytest.raises(TypeError, match="monotone must be a bool"):
        register_eviction_policy("bad-monotone")(
            type("Bad", (), {"monotone": bad, "priority": lambda self, n: (n.timestamp,)})
        )
    assert "bad-monotone" not in EVICTION_POLICIES


def test_a_policy_needs_a_priority() -> None:
    with pytest.raises(TypeError, match="priority"):
        register_eviction_policy("no-priority")(type("X", (), {}))
    assert "no-priority" not in EVICTION_POLICIES


# ----------------------------------------------------------------------------- the preview
@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    prompts=st.lists(
        st.tuples(st.integers(0, 2), st.lists(st.integers(0, 3), min_size=1, max_size=8)),
        min_size=1,
        max_size=12,
    ),
    locks=st.lists(st.integers(0, 10**6), max_size=3),
    size=st.integers(1, 30),
    policy=st.sampled_from(["lru", "fifo", "sglang-mru"]),
)
def test_the_preview_names_what_evict_takes_across_namespaces(
    prompts: list, locks: list, size: int, policy: str
) -> None:
    """`predict_evict`, and the ranks `draw_tree(evict_size=...)` and `tree_text` mark on the
    drawing of each namespace, name exactly the nodes ``evict`` then takes, in order, whatever
    the other namespaces cache."""
    m = RadixCacheManager(eviction_policy=policy)
    fresh = 0
    for k, toks in prompts:
        ids = torch.tensor(toks)
        cached = m.walk(ids, KEYS[k]).length
        _, prefix = m.match_prefix(ids[:cached], KEYS[k])
        slots = prefix.tolist() + list(range(fresh, fresh + len(toks) - cached))
        fresh += len(toks)
        m.insert_prefix(ids, torch.tensor(slots, dtype=torch.int32), KEYS[k])
    for x in locks:
        k, toks = prompts[x % len(prompts)]
        m.lock_handle(m.match_prefix(torch.tensor(toks), KEYS[k])[0])
    size = min(size, m.size_info.evictable_size)
    if size == 0:
        return
    shots = {key: snapshot(m, extra_key=key, evict_size=size) for key in m.roots}
    predicted = predict_evict(m, size)
    assert all(predict_evict(s, size) == predicted for s in shots.values())
    ranks = {key: evict_order(s, size) for key, s in shots.items()}
    texts = {key: tree_text(s, evict_size=size) for key, s in shots.items()}
    before = {n.uuid: n for key in m.roots for n in m.nodes(key)}
    slots = m.evict(size).tolist()
    gone = [u for u, n in before.items() if not n.in_tree]
    assert sorted(gone) == sorted(predicted)
    assert slots == [s for u in predicted for s in before[u].value.tolist()]
    for key, s in shots.items():
        mine = {n.uuid for n in s.nodes}
        assert ranks[key] == {u: i + 1 for i, u in enumerate(predicted) if u in mine}
        assert texts[key].count("evict #") == len(ranks[key])
