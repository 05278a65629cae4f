"""`benchmarks/flow_floor.py`: its inline floor makes the flow's calls, so it must leave the
manager and the pool as the flow leaves them, and the benchmark must run."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import flow_floor
import radix_ops

from kvcache import PageAllocator, RadixCacheManager, RequestFlow
from kvcache.serving.workloads import mixed


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_floor_leaves_the_cache_and_pool_as_the_flow_does(ps):
    jobs = mixed(80, seed=2)  # a pool of 2000 slots: evictions happen
    m, a = RadixCacheManager(page_size=ps), PageAllocator(2000 // ps, ps)
    reused = flow_floor.floor_drive(m, a, jobs)
    flow = RequestFlow(RadixCacheManager(page_size=ps), PageAllocator(2000 // ps, ps))
    radix_ops.drive(flow, jobs)
    assert flow.stats.evictions > 0
    assert reused == flow.stats.reused_tokens
    assert m.size_info == flow.manager.size_info
    assert a.free_pages().tolist() == flow.allocator.free_pages().tolist()
    assert sorted(m.cached_indices().tolist()) == sorted(flow.manager.cached_indices().tolist())


def test_flow_floor_runs():
    threads = torch.get_num_threads()
    try:
        out = flow_floor.main(["--requests", "60", "--pages", "2000", "--repeats", "1"])
    finally:
        torch.set_num_threads(threads)
    assert out["floor_ratio"] > 0 and out["flow_ratio"] > 0


@pytest.mark.parametrize("ps", [1, 16])
def test_flow_floor_prices_its_calls(ps):
    """``--parts``: every call the floor makes besides the manager's is counted per request and
    timed; a small pool (fewer pages than a timing run's 500 calls) must not run dry."""
    threads = torch.get_num_threads()
    try:
        argv = ["--requests", "60", "--pages", "2000", "--repeats", "1", "--page-size", str(ps)]
        out = flow_floor.main([*argv, "--parts"])
    finally:
        torch.set_num_threads(threads)
    assert out["parts_us_per_request"] > 0
    parts = flow_floor.parts(mixed(60, seed=0), ps, 2000)
    assert all(calls >= 0 and us > 0 for calls, us in parts.values())
    assert parts["np.empty"][0] == 2.0
