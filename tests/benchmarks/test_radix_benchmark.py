"""The radix benchmark's baselines are faithful stand-ins (same cache decisions) at every page
size it reports, and its trace and page-size options run."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import radix_ops

from kvcache import PageAllocator, RadixCacheManager, RequestFlow
from kvcache.examples.source_radix import PagedSourceRadixCacheManager
from kvcache.serving.workloads import agent, long_few_shot, mixed, replay


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_page_aware_source_makes_the_same_cache_decisions(page_size):
    jobs = mixed(80, seed=5) + agent(40, seed=5, system_len=(50, 150), step_len=(5, 40))
    stats = []
    for make in (
        lambda: PagedSourceRadixCacheManager(page_size=page_size),
        lambda: RadixCacheManager(page_size=page_size),
    ):
        flow = RequestFlow(make(), PageAllocator(4000 // page_size, page_size))
        samples = replay(flow, jobs)
        stats.append([(s.reused_tokens, s.cached_tokens, s.evicted_tokens) for s in samples])
    assert stats[0] == stats[1]
    assert stats[1][-1][2] > 0  # the pool was small enough for eviction to happen


def test_new_workload_shapes_share_what_they_claim():
    few = long_few_shot(30, num_tasks=2, prefix_len=(2048, 2100), seed=1)
    assert all(len(j.prompt) >= 2048 for j in few)
    firsts = {tuple(j.prompt[:2048].tolist()) for j in few}
    assert len(firsts) <= 2  # every request starts with one of the two task prefixes
    runs = agent(60, num_agents=2, seed=1)
    # Multi-turn: some prompt continues an earlier prompt + output exactly.
    seen = [torch.cat([j.prompt, j.output]) for j in runs]
    assert any(
        len(b.prompt) > len(a) and torch.equal(b.prompt[: len(a)], a)
        for i, a in enumerate(seen)
        for b in runs[i + 1 :]
    )


def test_radix_ops_runs_at_page_size_16_with_traces(tmp_path, monkeypatch):
    monkeypatch.setattr(radix_ops, "evict_one_leaf", lambda n, make, calls: 1e-6)
    small = {"chat": lambda: (mixed(40, seed=1), 3000)}
    monkeypatch.setattr(radix_ops, "TRACES", small)
    threads = torch.get_num_threads()
    try:
        result = radix_ops.main(
            [
                "--requests",
                "40",
                "--pages",
                "2000",
                "--repeats",
                "1",
                "--page-size",
                "16",
                "--traces",
                "--json",
                str(tmp_path / "r.json"),
            ]
        )
    finally:
        torch.set_num_threads(threads)
    tp = result["throughput"]
    assert "source design" not in tp and tp["RadixCacheManager"]["flow_seconds"] > 0
    # The driving loop's own time is reported beside the flow's, and is part of it.
    ours = tp["RadixCacheManager"]
    assert 0 < ours["driver_overhead_seconds"] < ours["flow_seconds"]
    # The block-hash manager's line: same keys, at this page size and at 1 and 16 beside it.
    block = tp["BlockHashCacheManager"]
    assert block["flow_seconds"] > 0 and block["manager_seconds"] > 0
    assert set(result["block_hash"]) == {"page_size_1", "page_size_16"}
    assert set(result["traces"]["chat"]) == {"1", "16"}
    assert "source design" in result["traces"]["chat"]["1"]
