"""The SGLang-style stand-in (``kvcache.examples.sglang_standin``) is a faithful baseline: the same
cache decisions as `RadixCacheManager` at page sizes 1 and 16 (or the benchmark's comparison
with it is void), a galloping key compare that finds the first difference, and its line in
``radix_ops.py``'s JSON."""

import sys
from array import array
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import radix_ops

from kvcache import PageAllocator, RadixCacheManager, RequestFlow
from kvcache.examples.sglang_standin import RadixKey, SglangStandIn
from kvcache.serving.workloads import agent, mixed, replay


@pytest.mark.parametrize("page_size", [1, 16])
def test_standin_makes_the_same_cache_decisions(page_size):
    jobs = mixed(60, seed=7) + agent(30, seed=7, system_len=(50, 150), step_len=(5, 40))
    stats, sizes = [], []
    for make in (
        lambda: SglangStandIn(page_size=page_size),
        lambda: RadixCacheManager(page_size=page_size),
    ):
        manager = make()
        flow = RequestFlow(manager, PageAllocator(3200 // page_size, page_size))
        samples = replay(flow, jobs)
        flow.check_integrity()  # free + cached + held pages are all the pages, none twice
        stats.append([(s.reused_tokens, s.cached_tokens, s.evicted_tokens) for s in samples])
        sizes.append(manager.size_info)
    assert stats[0] == stats[1]
    assert sizes[0] == sizes[1]
    assert stats[1][-1][2] > 0  # the pool was small enough for eviction to happen
    assert sum(s[0] for s in stats[1]) > 0  # and prefixes were reused


def _first_difference(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


@settings(max_examples=200, deadline=None)
@given(
    shared=st.lists(st.integers(0, 5), max_size=70),
    a=st.lists(st.integers(0, 5), max_size=20),
    b=st.lists(st.integers(0, 5), max_size=20),
    page_size=st.sampled_from([1, 4, 16]),
)
def test_galloping_match_finds_the_first_difference(shared, a, b, page_size):
    x, y = shared + a, shared + b
    got = RadixKey(array("q", x)).match(RadixKey(array("q", y)), page_size)
    assert got == _first_difference(x, y) // page_size * page_size


def test_keys_of_two_namespaces_do_not_match():
    with pytest.raises(ValueError, match="namespaces"):
        RadixKey(array("q", [1]), "a").match(RadixKey(array("q", [1]), "b"))


def test_radix_ops_reports_the_sglang_ratio(monkeypatch):
    monkeypatch.setattr(radix_ops, "evict_one_leaf", lambda n, make, calls: 1e-6)
    monkeypatch.setattr(radix_ops, "TRACES", {"chat": lambda: (mixed(30, seed=2), 2500)})
    monkeypatch.setattr(radix_ops, "throughput", lambda *a: _tiny_throughput())
    monkeypatch.setattr(radix_ops, "block_hash_rows", lambda *a: {})
    threads = torch.get_num_threads()
    try:
        result = radix_ops.main(["--repeats", "1", "--traces"])
    finally:
        torch.set_num_threads(threads)
    by_ps = result["traces"]["chat"]
    for ps in ("1", "16"):
        assert radix_ops.SGLANG in by_ps[ps]
        expected = (
            by_ps[ps][radix_ops.SGLANG]["manager_seconds"]
            / by_ps[ps]["RadixCacheManager"]["manager_seconds"]
        )
        assert result["sglang_ratio"]["chat"][ps] == pytest.approx(expected)


def _tiny_throughput():
    row = {
        "flow_seconds": 1.0,
        "manager_seconds": 1.0,
        "manager_seconds_with_replay": 1.0,
        "replay_overhead_seconds": 0.0,
        "requests_per_s": 1.0,
        "manager_requests_per_s": 1.0,
        "reused_tokens": 0,
        "evicted_tokens": 0,
        "evictions": 0,
    }
    return {"page-aware source": dict(row), "RadixCacheManager": dict(row)}
