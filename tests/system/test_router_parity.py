"""The router's namespaces and replica membership (issue 30 item 7), against SGLang's router:

* sgl-router routes by the tenant's cached prefix (its cache-aware tree is per model; a
  request's ``extra_key`` / ``cache_salt`` keeps tenants apart in SGLang's radix cache,
  ``RadixKey(token_ids, extra_key)``): our mirrors match only under the request's namespace;
* sgl-router's ``CacheAwarePolicy::remove_worker`` drops the worker from its tree
  (``tree.remove_tenant(url)``, ``sgl-router/src/policies/cache_aware.rs``, checked at
  sgl-project/sglang ``b6f20641``) and routes nothing more to it; the requests in flight there
  are retried elsewhere. Here `remove_replica` moves them itself, and nothing is lost: every
  request's output, across the replicas it ran on, is the whole output it was asked for.
"""

from __future__ import annotations

import pytest
import torch
from conftest import ids
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcache import PageAllocator, RadixCacheManager, RequestFlow, Router, Scheduler


def replica(pages: int = 48, **kw) -> Scheduler:
    m = RadixCacheManager(events=True)
    return Scheduler(RequestFlow(m, PageAllocator(pages)), token_budget=8, max_batch=3, **kw)


def drain(router: Router) -> None:
    while any(not s.idle for s in router.replicas):
        router.step()
        router.check_integrity()


def test_routing_by_namespace() -> None:
    """Tenant A's system prompt is cached on one replica; a request of tenant A goes there by
    prefix, the same prompt of tenant B finds nothing of it anywhere."""
    router = Router([replica(), replica()], cache_threshold=0.3)
    system = [5, 6, 7, 8, 9, 10, 11, 12]
    first = router.submit(torch.tensor([*system, 1]), 1, ids(0), extra_key="A")
    drain(router)
    router.sync()
    home = router.placement[first][0]
    assert router.route(torch.tensor([*system, 2]), extra_key="A") == (home, "prefix", 8)
    _, reason, predicted = router.route(torch.tensor([*system, 2]), extra_key="B")
    assert reason != "prefix" and predicted == 0
    rid = router.submit(torch.tensor([*system, 3]), 1, ids(0), extra_key="A")
    assert router.placement[rid][0] == home
    assert router.replicas[home].requests[router.placement[rid][1]].extra_key == "A"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    jobs=st.lists(
        st.tuples(st.integers(0, 2), st.lists(st.integers(0, 5), max_size=4), st.integers(1, 6)),
        min_size=1,
        max_size=8,
    ),
    steps_before=st.integers(0, 6),
    victim=st.integers(0, 2),
    back_after=st.one_of(st.none(), st.integers(0, 4)),
    policy=st.sampled_from(["cache_aware", "round_robin", "least_loaded"]),
)
def test_removing_a_replica_in_flight_loses_nothing(jobs, steps_before, victim, back_after, policy):
    """Remove a replica with requests waiting and running on it (some decoding, some
    prefilling), maybe bring it back later: every request still ends with exactly the output
    it was asked for, each token once, across the replicas it ran on."""
    router = Router([replica(), replica(), replica()], policy=policy)
    systems = [[1, 2, 3, 4, 5], [9, 9, 8, 8], [7]]
    want = {}
    for sys_i, tail, n in jobs:
        out = torch.arange(n) + 40
        rid = router.submit(torch.tensor(systems[sys_i] + tail + [30]), n, out)
        want[rid] = out.tolist()
    for _ in range(steps_before):
        if all(s.idle for s in router.replicas):
            break
        router.step()
    on_victim = {rid for rid, (r, sid) in enumerate(router.placement) if r == victim}
    live = {rid for rid in on_victim if router.output(rid) != want[rid]}
    moved = router.remove_replica(victim)
    assert live <= set(moved) <= on_victim
    assert not router.mirrors[victim].cached_tokens and router.replicas[victim].idle
    router.check_integrity()
    for rid in moved:
        r, _ = router.placement[rid]
        assert r != victim or router.output(rid) == want[rid]
    if back_after is not None:
        for _ in range(back_after):
            if all(s.idle for s in router.replicas):
                break
            router.step()
        assert router.add_replica(router.replicas[victim]) == victim
    drain(router)
    for rid, out in want.items():
        r, sid = router.placement[rid]
        assert router.output(rid) == out, (rid, router.output(rid), out)
        assert router.replicas[r].requests[sid].status == "finished"
    assert router.report().requests == len(want)


def test_a_removed_replica_gets_nothing_and_a_new_one_does() -> None:
    router = Router([replica(), replica()], policy="round_robin")
    router.remove_replica(0)
    for i in range(3):
        assert router.placement[router.submit(ids(i, 1), 1, ids(0))][0] == 1
    new = router.add_replica(replica())
    assert new == 2 and router.num_replicas == 3
    assert {router.placement[router.submit(ids(i, 2), 1, ids(0))][0] for i in range(4)} == {1, 2}
    drain(router)
    router.check_integrity()


def test_removal_refused_changes_nothing() -> None:
    router = Router([replica(), replica(pages=4)], policy="round_robin")
    big = router.submit(torch.arange(6), 4, ids(0, 0, 0, 0))  # 9 pages: only replica 0 has them
    assert router.placement[big][0] == 0
    before = (list(router.placement), list(router.healthy), router.loads())
    with pytest.raises(ValueError, match="never fit"):
        router.remove_replica(0)
    assert (list(router.placement), list(router.healthy), router.loads()) == before
    router.remove_replica(1)
    with pytest.raises(RuntimeError, match="no other is healthy"):
        router.remove_replica(0)
    with pytest.raises(ValueError, match="healthy"):
        router.remove_replica(1)
    with pytest.raises(ValueError, match="in this router already"):
        router.add_replica(router.replicas[0])
    with pytest.raises(ValueError, match="own flow"):
        router.add_replica(Scheduler(router.replicas[0].flow))
    drain(router)
    assert router.output(big) == [0, 0, 0, 0]


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_a_removal_that_fails_part_way_loses_nothing(exc) -> None:
    """Every call the removal makes into the flows and the schedulers (a withdrawal's abort, a
    resubmission) fails in turn: the requests moved so far stay moved, the rest stay on the
    replica, out of routing; removing it again moves them, and every request ends whole."""
    from faults import Faults

    n = 1
    while True:
        router = Router([replica(), replica(), replica()], policy="round_robin")
        want = {}
        for i in range(6):
            out = torch.arange(4) + 10 * i
            want[router.submit(torch.tensor([1, 2, 3, i]), 4, out)] = out.tolist()
        for _ in range(3):
            router.step()
        faults = Faults(n, exc)
        for s in router.replicas:
            faults.patch(s.flow, "flow", ["abort"])
            faults.patch(s, "sched", ["submit", "withdraw"])
        try:
            router.remove_replica(0)
        except (RuntimeError, KeyboardInterrupt) as e:
            assert faults.is_mine(e), repr(e)
            faults.fail_at = None
            router.check_integrity()
            assert not router.healthy[0]
            router.remove_replica(0)  # moves the rest
        router.check_integrity()
        assert router.replicas[0].idle
        drain(router)
        assert {rid: router.output(rid) for rid in want} == want
        if faults.raised is None:
            break
        n += 1
    assert n > 3


def test_misuse_is_refused_and_changes_nothing(tmp_path) -> None:
    from kvcache import DiskKVStore, KVCacheLayout, MHAKVCache

    router = Router([replica(), replica()])
    rid = router.submit(ids(1, 2, 3), 2, ids(0, 0))
    with pytest.raises(ValueError, match="rid"):
        router.output(rid + 1)
    with pytest.raises(TypeError, match="extra_key"):
        router.route(ids(1, 2), extra_key=[1])
    with pytest.raises(ValueError, match="replica 5"):
        router.remove_replica(5)
    sched = router.replicas[router.placement[rid][0]]
    with pytest.raises(RuntimeError, match="not waiting or running"):
        sched.withdraw(99)
    with pytest.raises(TypeError, match="chunked_prefill"):
        Scheduler(sched.flow, chunked_prefill="no")
    with pytest.raises(TypeError, match="reset_running_requests"):
        sched.reset_prefix_cache(reset_running_requests=1)
    assert router.loads() == [1, 0] or router.loads() == [0, 1]
    pool = MHAKVCache(1, 1, 2, 4, torch.float32, KVCacheLayout.LayerFirst, "cpu", 2)
    store = DiskKVStore(tmp_path, pool, "m")
    with pytest.raises(TypeError, match="digest"):
        store.get("abc")
    with pytest.raises(ValueError, match="model_id"):
        DiskKVStore(tmp_path, pool, "")
