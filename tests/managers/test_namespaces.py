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
    Engine,
    NaiveCacheManager,
    PageAllocator,
    RadixCacheManager,
    RequestFlow,
    Scheduler,
    TinyLlama,
    TinyLlamaConfig,
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


# ------------------------------------------------------------------ the scheduler's and engine's path
def _sched(policy: str = "fcfs") -> Scheduler:
    flow = RequestFlow(RadixCacheManager(page_size=2), PageAllocator(64, 2))
    return Scheduler(flow, token_budget=64, max_batch=1, policy=policy)


def _one(sched: Scheduler, prompt: torch.Tensor, key: Hashable) -> int:
    """Submit and run ``prompt`` under ``key``; the tokens it reused from the cache."""
    before = sched.reused_tokens
    sched.submit(prompt, 1, forced=ids(0), extra_key=key)
    sched.run()
    sched.check_integrity()
    return sched.reused_tokens - before


def test_scheduler_admits_each_request_in_its_namespace() -> None:
    sched = _sched()
    prompt = ids(*range(9))
    assert _one(sched, prompt, "alice") == 0
    assert _one(sched, prompt, "bob") == 0  # bob's first request does not see alice's prefix
    assert _one(sched, prompt, "alice") == 8  # whole pages of the prompt less its last token
    assert _one(sched, prompt, None) == 0
    assert [s.extra_key for s in sched.done] == ["alice", "bob", "alice", None]


def test_lpm_orders_by_the_prefix_cached_in_the_requests_own_namespace() -> None:
    orders = {}
    for key in ("alice", "bob"):
        sched = _sched("lpm")
        _one(sched, ids(7, 7, 7, 7, 1), "alice")
        sched.submit(ids(4, 4, 4, 4, 4), 1, forced=ids(0), extra_key=key)
        sched.submit(ids(7, 7, 7, 7, 2), 1, forced=ids(0), extra_key=key)
        sched.run()
        orders[key] = [a for r in sched.history for a in r.admitted][1:]
    # Under alice's key the cached 7 7 7 7 goes first; bob has nothing cached: arrival order.
    assert orders == {"alice": [2, 1], "bob": [1, 2]}


def test_scheduler_refuses_an_unhashable_key_and_changes_nothing() -> None:
    sched = _sched()
    _one(sched, ids(1, 2, 3), "alice")
    with unchanged(sched.flow), pytest.raises(TypeError, match="extra_key"):
        sched.submit(ids(1, 2, 3), 1, forced=ids(0), extra_key=["alice"])
    assert not sched.waiting and len(sched.requests) == 1


def test_engine_prefills_and_generates_in_a_namespace() -> None:
    model = TinyLlama(TinyLlamaConfig(num_layers=1, seed=0))
    engine = Engine(
        model, model.new_kv_cache(32, 2), RadixCacheManager(page_size=2), PageAllocator(32, 2)
    )
    prompt = ids(*range(1, 10))
    out = engine.generate(prompt, 3, extra_key="alice")
    req, logits = engine.prefill(prompt, extra_key="bob")
    assert req.reused_len == 0 and req.extra_key == "bob"
    engine.flow.abort(req)
    req, again = engine.prefill(prompt, extra_key="alice")
    assert req.reused_len == 8 and int(again.argmax()) == int(out[0])
    assert torch.allclose(again, logits, atol=1e-4)  # reuse changes no logit
    engine.flow.abort(req)
    with unchanged(engine), pytest.raises(TypeError, match="extra_key"):
        engine.prefill_batch([prompt], extra_key={"a": 1})


def test_a_snapshot_freezes_one_namespace_tree() -> None:
    from kvcache.viz import snapshot

    m = RadixCacheManager(page_size=1)
    m.insert_prefix(ids(1, 2, 3), slots(0, 1, 2), extra_key="alice")
    m.insert_prefix(ids(1, 2, 9), slots(3, 4, 5), extra_key="bob")
    m.insert_prefix(ids(1, 2, 3, 4), slots(6, 7, 8, 9), extra_key="bob")
    alice, bob = snapshot(m, extra_key="alice"), snapshot(m, extra_key="bob")
    assert [n.tokens for n in alice.nodes] == [(), (1, 2, 3)]
    assert sorted(n.tokens for n in bob.nodes) == [(), (1, 2), (3, 4), (9,)]
    assert len(snapshot(m).nodes) == 1  # None's tree: only its root
    with pytest.raises(ValueError, match="carol"):
        snapshot(m, extra_key="carol")
    with pytest.raises(TypeError, match="extra_key"):
        snapshot(m, extra_key=["alice"])


def _paths(m: RadixCacheManager, key: Hashable) -> list[list[int]]:
    """Every root-to-node token sequence of namespace ``key``'s tree."""
    out = []
    for node in m.nodes(key):
        toks: list[int] = []
        n = node
        while n is not None and not n.is_root():
            toks[:0] = n.key.tolist()
            n = n.parent
        out.append(toks)
    return out


REQUESTS = st.lists(
    st.tuples(
        st.sampled_from(["a", "b", None]),
        st.lists(st.integers(0, 2), min_size=1, max_size=10),
        st.integers(1, 3),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(reqs=REQUESTS, policy=st.sampled_from(["fcfs", "lpm"]), page_size=st.sampled_from([1, 2]))
def test_scheduler_never_caches_a_request_under_another_key(
    reqs: list[tuple[Hashable, list[int], int]], policy: str, page_size: int
) -> None:
    """Chunked prefill, preemption and LPM with several tenants: after every step, each cached
    path of a namespace is a prefix of a sequence some request of that namespace ran."""
    flow = RequestFlow(
        RadixCacheManager(page_size=page_size),
        PageAllocator(16 // page_size, page_size),  # small: preemption happens
    )
    sched = Scheduler(flow, token_budget=6, max_batch=3, chunk_size=4, policy=policy)
    seqs: dict[Hashable, list[list[int]]] = {}
    for i, (key, prompt, new) in enumerate(reqs):
        forced = [(i + j) % 3 for j in range(new)]
        sched.submit(ids(*prompt), new, forced=ids(*forced), extra_key=key)
        seqs.setdefault(key, []).append(prompt + forced)
    for _ in range(500):
        if sched.idle:
            break
        sched.step()
        sched.check_integrity()
        for key in flow.manager.roots:
            for path in _paths(flow.manager, key)[1:]:  # the root's empty path aside
                assert any(s[: len(path)] == path for s in seqs.get(key, [])), (key, path)
    assert sched.idle and len(sched.done) == len(reqs)
