"""The router over N replicas: its mirrors, fed only by cache events, equal the replicas' caches
after every step; no request is lost or duplicated; every policy decides as documented; misuse
leaves everything unchanged.

A hypothesis state machine submits prompts with shared prefixes (so the caches fill, split and
evict on small pools), steps the replicas and lets time pass; after every step the events are
delivered (`Router.sync`) and each mirror must equal its manager's cached set page for page,
read through the manager's public API (`cache_mirror.cached_pages`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from cache_mirror import MAKERS, EventMirror, cached_pages, replay
from conftest import ids, observe
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcache import (
    BlockHashCacheManager,
    BlockRemoved,
    BlockStored,
    NaiveCacheManager,
    PageAllocator,
    RadixCacheManager,
    RequestFlow,
    Scheduler,
)
from kvcache.managers.base import BaseCacheManager
from kvcache.serving.workloads import few_shot
from kvcache.system.prefix_mirror import PrefixMirror
from kvcache.system.router import ROUTING_POLICIES, Router, poisson_arrivals

MANAGERS: dict[str, Callable[[], BaseCacheManager]] = {
    "radix-1": lambda: RadixCacheManager(page_size=1, events=True),
    "radix-2": lambda: RadixCacheManager(page_size=2, events=True),
    "block-2": lambda: BlockHashCacheManager(page_size=2, events=True),
}


def replicas(make: str, n: int, pages: int = 24, **kw: Any) -> list[Scheduler]:
    out = []
    for _ in range(n):
        m = MANAGERS[make]()
        out.append(Scheduler(RequestFlow(m, PageAllocator(pages, m.page_size)), **kw))
    return out


def state(router: Router, probe: torch.Tensor) -> Any:
    """Everything a refused call must leave as it was, as plain values."""
    return (
        list(router.placement),
        router.report(),
        router.loads(),
        router.route(probe),
        router.now,
        [m.pages() for m in router.mirrors],
        [observe(s.flow) for s in router.replicas],
        [(list(s.requests), s.clock, s.steps) for s in router.replicas],
    )


# ------------------------------------------------------------------ the state machine
PREFIXES = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10], [1, 2, 3, 11]]


class RoutedReplicas(RuleBasedStateMachine):
    make = "radix-1"
    policy = "cache_aware"

    def __init__(self) -> None:
        super().__init__()
        self.router = Router(
            replicas(self.make, 3, token_budget=8, max_batch=3),
            policy=self.policy,
            balance_abs_threshold=2,
        )
        self.sent: list[tuple[list[int], list[int]]] = []  # router id -> (prompt, forced)

    @rule(
        p=st.integers(0, len(PREFIXES) - 1),
        tail=st.lists(st.integers(20, 23), max_size=4),
        n_out=st.integers(1, 3),
        dt=st.sampled_from([0.0, 0.0, 0.005, 0.05]),
    )
    def submit(self, p: int, tail: list[int], n_out: int, dt: float) -> None:
        prompt, out = PREFIXES[p] + tail, [30 + n_out] * n_out
        r = self.router
        loads, before = r.loads(), len(r.placement)
        r.sync()  # what route sees below is what submit will see
        where, reason, predicted = r.route(ids(*prompt))
        rid = r.submit(ids(*prompt), n_out, ids(*out), at=r.now + dt)
        assert rid == before and r.placement[rid][0] == where
        self.sent.append((prompt, out))
        if self.policy == "round_robin":
            assert where == rid % r.num_replicas
        elif self.policy == "least_loaded" or reason == "load":
            assert loads[where] == min(loads)
        elif reason == "prefix":
            matches = [m.match(ids(*prompt[:-1])) for m in r.mirrors]
            assert predicted == matches[where] == max(matches) > 0

    @precondition(lambda self: any(not s.idle for s in self.router.replicas))
    @rule()
    def step(self) -> None:
        self.router.step()

    @invariant()
    def mirrors_equal_caches_and_nothing_is_lost(self) -> None:
        r = self.router
        r.sync()
        for m, s in zip(r.mirrors, r.replicas, strict=True):
            assert m.pages() == cached_pages(s.flow.manager)
            assert m.cached_tokens == len(m.pages()) * m.page_size
            assert m.cached_tokens == s.flow.manager.size_info.total_size
        r.check_integrity()
        assert len(r.placement) == len(self.sent)
        for rid, (replica, sid) in enumerate(r.placement):
            sreq = r.replicas[replica].requests[sid]
            prompt, out = self.sent[rid]
            assert sreq.prompt.tolist() == prompt
            assert sreq.output == out[: len(sreq.output)]
            if sreq.status == "finished":
                assert sreq.output == out
        assert sum(r.report().routed) == len(self.sent)

    def teardown(self) -> None:
        r = self.router
        while any(not s.idle for s in r.replicas):
            r.step()
        self.mirrors_equal_caches_and_nothing_is_lost()
        assert r.report().requests == len(self.sent)  # every request finished, once


@pytest.mark.parametrize("policy", ROUTING_POLICIES)
@pytest.mark.parametrize("make", list(MANAGERS))
def test_mirrors_follow_the_caches_and_no_request_is_lost(make: str, policy: str) -> None:
    name = f"Routed_{make}_{policy}"
    machine: type[RoutedReplicas] = type(name, (RoutedReplicas,), {"make": make, "policy": policy})
    machine.TestCase.settings = settings(
        max_examples=15, stateful_step_count=40, deadline=None, derandomize=True
    )
    machine.TestCase().runTest()


# ------------------------------------------------------------------ decisions and lag
def test_cache_aware_follows_the_prefix_and_yields_to_imbalance() -> None:
    r = Router(replicas("radix-1", 2, pages=64), balance_abs_threshold=1)
    a = r.submit(ids(1, 2, 3, 4, 5), 1, ids(9))
    while any(not s.idle for s in r.replicas):
        r.step()
    r.sync()
    home = r.placement[a][0]
    assert r.route(ids(1, 2, 3, 4, 6)) == (home, "prefix", 4)
    assert r.route(ids(7, 7, 7, 7, 7))[1:] == ("room", 0)  # the emptier replica
    assert r.route(ids(7, 7, 7, 7, 7))[0] != home
    for _ in range(3):  # load the prefix's home: loads 3 vs 0 exceed both thresholds
        r.replicas[home].submit(ids(5, 5), 1, ids(1))
    assert r.route(ids(1, 2, 3, 4, 6)) == (1 - home, "load", 0)
    with pytest.raises(RuntimeError, match="did not send"):
        r.check_integrity()  # those three bypassed the router


def test_events_reach_the_mirror_only_after_their_delay() -> None:
    r = Router(replicas("radix-2", 2, pages=64), event_delay_s=0.5)
    r.submit(ids(1, 2, 3, 4, 5), 1, ids(9), at=0.0)
    while any(not s.idle for s in r.replicas):
        r.step()
    done = max(s.clock for s in r.replicas)
    assert r.events_in_flight() > 0 and all(m.cached_tokens == 0 for m in r.mirrors)
    r.submit(ids(1, 2, 3, 4, 6), 1, ids(9), at=done + 0.4)  # still in flight: a blind route
    assert r.events_in_flight() > 0 and all(m.cached_tokens == 0 for m in r.mirrors)
    r.submit(ids(8, 8, 8), 1, ids(9), at=done + 0.6)
    assert r.events_in_flight() == 0 and max(m.match(ids(1, 2, 3, 4)) for m in r.mirrors) == 4


def test_a_routed_run_reports_every_request_and_round_robin_spreads_them_evenly() -> None:
    jobs = few_shot(24, num_tasks=3, shots=2, shot_len=10, output_len=(1, 4), seed=1)
    figures = {}
    for policy in ROUTING_POLICIES:
        r = Router(replicas("radix-1", 3, pages=400), policy=policy)
        rep = r.run(jobs, poisson_arrivals(len(jobs), 200.0, seed=0))
        r.check_integrity()
        assert rep.requests == 24 and sum(rep.routed) == 24 and rep.seconds > 0
        assert rep.output_tokens == sum(len(j.output) for j in jobs)
        figures[policy] = rep
    assert figures["round_robin"].routed == (8, 8, 8)
    assert figures["round_robin"].by_load == 24 and figures["least_loaded"].by_prefix == 0
    assert figures["cache_aware"].by_prefix > 0
    assert figures["cache_aware"].hit_rate >= figures["round_robin"].hit_rate


@pytest.mark.parametrize("delay", [0.0, 0.003, 0.05])
def test_a_run_keeps_arrival_times_and_late_mirrors_catch_up(delay: float) -> None:
    jobs = few_shot(30, num_tasks=2, shots=2, shot_len=12, output_len=(1, 5), seed=4)
    arrivals = poisson_arrivals(len(jobs), 300.0, seed=1)
    r = Router(replicas("block-2", 2, pages=40, token_budget=16), event_delay_s=delay)
    rep = r.run(jobs, arrivals)
    r.check_integrity()
    assert rep.requests == len(jobs) and rep.busy_seconds > 0
    for rid, (replica, sid) in enumerate(r.placement):
        sreq = r.replicas[replica].requests[sid]
        assert sreq.arrival_time == arrivals[rid]
        assert sreq.first_token_time is not None and sreq.first_token_time > sreq.arrival_time
    r.sync()
    for m, s in zip(r.mirrors, r.replicas, strict=True):
        assert m.pages() == cached_pages(s.flow.manager)


def test_the_mirror_rejects_events_that_do_not_fit_and_stays_as_it_was() -> None:
    m = PrefixMirror(2)
    m.apply([BlockStored(None, (1, 2, 3, 4), (10, 11, 12, 13))])
    before = m.pages()
    bad = [
        BlockStored(None, (1, 2, 3, 4), (12, 13)),  # held already
        BlockStored(None, (1, 2, 3), (12,)),  # not whole pages
        BlockRemoved(None, (1, 2, 3, 4), (20, 21)),  # other slots
        BlockRemoved("t", (1, 2), (10, 11)),  # another namespace
        BlockRemoved(None, (1, 2, 3, 4, 5, 6), (0, 1)),  # never stored
    ]
    for ev in bad:
        with pytest.raises(ValueError, match="Block"):
            m.apply([ev])
        assert m.pages() == before and m.cached_tokens == 4
    with pytest.raises(TypeError, match="cache events"):
        m.apply(["stored"])  # type: ignore[list-item]
    assert m.match(ids(1, 2, 3, 4, 5)) == 4 and m.match(ids(1, 2, 3)) == 2
    assert m.match(ids(1, 2), extra_key="t") == 0
    m.apply([BlockRemoved(None, (1, 2, 3, 4), (12, 13)), BlockRemoved(None, (1, 2), (10, 11))])
    assert m.pages() == {} and m.cached_tokens == 0


class PrefixMirrorReplay(EventMirror):
    """`test_events`'s machine (inserts, matches that split, locks, evictions, resets under
    several namespaces), with a `PrefixMirror` fed the same events: it must equal both the
    manager's cached set and the test's own replay after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.trie = PrefixMirror(self.ps)

    @invariant()
    def mirror_equals_cache(self) -> None:
        events = self.m.take_events()
        replay(self.mirror, events, self.ps)
        self.trie.apply(events)
        assert self.trie.pages() == self.mirror == cached_pages(self.m)
        assert self.trie.cached_tokens == self.m.size_info.total_size
        for (key, toks), _ in self.mirror.items():
            assert self.trie.match(ids(*toks), extra_key=key) >= len(toks)


@pytest.mark.parametrize("make", list(MAKERS))
def test_prefix_mirror_replays_every_namespace(make: str) -> None:
    machine: type[PrefixMirrorReplay] = type(
        f"PrefixMirrorReplay_{make}", (PrefixMirrorReplay,), {"make": make}
    )
    machine.TestCase.settings = settings(
        max_examples=25, stateful_step_count=30, deadline=None, derandomize=True
    )
    machine.TestCase().runTest()


# ------------------------------------------------------------------ misuse
def test_bad_replica_lists_are_refused_and_leave_the_replicas_as_they_were() -> None:
    good = replicas("radix-1", 2)
    snap = [observe(s.flow) for s in good]
    cases: list[tuple[Any, type[Exception], str]] = [
        ([], ValueError, "at least 1"),
        (good[0], TypeError, "replicas must be a list"),
        ([good[0], "x"], TypeError, r"replicas\[1\] must be a Scheduler"),
        ([good[0], good[0]], ValueError, "own scheduler"),
        ([good[0], Scheduler(good[0].flow)], ValueError, "own flow"),
    ]
    for bad, err, msg in cases:
        with pytest.raises(err, match=msg):
            Router(bad)
    naive = Scheduler(RequestFlow(NaiveCacheManager(page_size=1), PageAllocator(8, 1)))
    silent = Scheduler(RequestFlow(RadixCacheManager(page_size=1), PageAllocator(8, 1)))
    warm = replicas("radix-1", 1)[0]
    warm.flow.manager.insert_prefix(ids(1, 2), torch.tensor([0, 1], dtype=torch.int32))
    for bad_one, msg in ((naive, "radix or block-hash"), (silent, "events=True")):
        with pytest.raises(ValueError, match=msg):
            Router([good[0], bad_one])
    with pytest.raises(ValueError, match="empty cache"):
        Router([good[1], warm])
    assert [observe(s.flow) for s in good] == snap
    assert Router(good).num_replicas == 2  # still fresh: usable


@pytest.mark.parametrize(
    ("kw", "err", "msg"),
    [
        ({"policy": "random"}, ValueError, "policy must be one of"),
        ({"cache_threshold": 1.5}, ValueError, "cache_threshold"),
        ({"cache_threshold": "0.3"}, ValueError, "cache_threshold"),
        ({"balance_abs_threshold": -1}, ValueError, "balance_abs_threshold"),
        ({"balance_abs_threshold": 2.0}, TypeError, "balance_abs_threshold"),
        ({"balance_rel_threshold": 0.5}, ValueError, "balance_rel_threshold"),
        ({"event_delay_s": -0.1}, ValueError, "event_delay_s"),
        ({"event_delay_s": True}, ValueError, "event_delay_s"),
    ],
)
def test_bad_settings_are_refused(kw: dict[str, Any], err: type[Exception], msg: str) -> None:
    reps = replicas("block-2", 2)
    snap = [observe(s.flow) for s in reps]
    with pytest.raises(err, match=msg):
        Router(reps, **kw)
    assert [observe(s.flow) for s in reps] == snap


@pytest.mark.parametrize("policy", ROUTING_POLICIES)
def test_refused_calls_leave_the_router_unchanged(policy: str) -> None:
    r = Router(replicas("radix-1", 2, pages=16), policy=policy)
    r.submit(ids(1, 2, 3), 2, ids(5, 5), at=1.0)
    r.step()
    probe = ids(1, 2, 4)
    before = state(r, probe)
    calls: list[tuple[Callable[[], object], type[Exception], str]] = [
        (lambda: r.submit(ids(1, 2), 2, ids(5, 5), at=0.5), ValueError, "at must be"),
        (lambda: r.submit(ids(), 1, ids(5)), ValueError, "at least one token"),
        (lambda: r.submit(ids(1, 2), 0, ids(5)), ValueError, "max_new_tokens"),
        (lambda: r.submit(ids(1, 2), 2, ids(5)), ValueError, "forced"),
        (lambda: r.submit(ids(*range(17)), 2, ids(5, 5)), ValueError, "never fit"),
        (lambda: r.submit(torch.tensor([1.0]), 1, ids(5)), TypeError, "prompt"),
        (lambda: r.submit([1, 2], 1, ids(5)), TypeError, "prompt must be a torch.Tensor"),
        (lambda: r.route(ids(1, 2).reshape(1, 2)), ValueError, "prompt must be 1-D"),
        (lambda: r.run([], [1.0]), ValueError, "arrivals holds 1"),
        (lambda: r.run(few_shot(2, seed=0), [2.0, 1.5]), ValueError, r"arrivals\[1\]"),
    ]
    for call, err, msg in calls:
        with pytest.raises(err, match=msg):
            call()
        assert state(r, probe) == before
    while any(not s.idle for s in r.replicas):
        r.step()
    with pytest.raises(RuntimeError, match="no replica"):
        r.step()
    r.check_integrity()


def test_poisson_arrivals_are_seeded_and_checked() -> None:
    a = poisson_arrivals(50, 10.0, seed=3)
    assert a == poisson_arrivals(50, 10.0, seed=3) and a == sorted(a) and a[0] > 0
    assert 2.0 < a[-1] < 10.0  # 50 arrivals at 10/s: about 5 s
    for n, rate in ((-1, 1.0), (True, 1.0), (3, 0.0), (3, float("inf")), (3, "1")):
        with pytest.raises(ValueError, match=r"n must|rate must"):
            poisson_arrivals(n, rate)  # type: ignore[arg-type]
