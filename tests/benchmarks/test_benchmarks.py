"""The benchmarks still run, and their baseline is a faithful stand-in (same cache decisions)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import radix_ops

from kvcache import PageAllocator, RadixCacheManager, RequestFlow
from kvcache.examples.source_radix import SourceRadixCacheManager
from kvcache.serving.workloads import mixed, replay


def test_source_design_makes_the_same_cache_decisions():
    jobs = mixed(120, seed=3)
    stats = []
    for make in (SourceRadixCacheManager, RadixCacheManager):
        flow = RequestFlow(make(), PageAllocator(3000))
        samples = replay(flow, jobs)
        stats.append([(s.reused_tokens, s.cached_tokens, s.evicted_tokens) for s in samples])
    assert stats[0] == stats[1]
    assert stats[1][-1][2] > 0  # the pool was small enough for eviction to happen


def test_radix_ops_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(radix_ops, "evict_one_leaf", lambda n, make, calls: 1e-6)
    threads = torch.get_num_threads()
    try:
        result = radix_ops.main(
            [
                "--requests",
                "60",
                "--pages",
                "2000",
                "--repeats",
                "1",
                "--json",
                str(tmp_path / "r.json"),
            ]
        )
    finally:
        torch.set_num_threads(threads)
    assert (tmp_path / "r.json").exists() and result["speedup"] > 0


def test_harness_labels_times_and_writes(tmp_path):
    """The shared harness: a machine label with the commit and what a run adds, a CPU clock that
    keeps the fastest run, and JSON written where asked (nowhere when nothing is asked)."""
    import json

    import harness

    label = harness.machine(clock="thread CPU time", engine="x")
    assert {"cpu", "python", "torch", "threads", "date", "commit"} <= set(label)
    assert label["clock"] == "thread CPU time" and label["engine"] == "x"
    assert harness.cpu_best(lambda: sum(range(1000)), 3) >= 0
    assert harness.write_json({"a": 1}, None) is None
    out = harness.write_json({"machine": label}, tmp_path / "deep" / "r.json", quiet=True)
    assert json.loads(out.read_text())["machine"]["engine"] == "x"


def test_tier_router_benchmark_runs():
    """The all-or-nothing cost benchmark runs, and the tier and the router decide as before."""
    import subprocess

    import pytest
    import tier_router

    repo = Path(__file__).resolve().parents[2]
    have = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--verify", "-q", tier_router.DEFAULT_BASELINE],
        capture_output=True,
    )
    if have.returncode != 0:
        pytest.skip("no git history here: the baseline revision cannot be extracted")
    out = tier_router.main(
        ["--conversations", "3", "--turns", "2", "--requests", "12", "--repeats", "1"]
    )
    assert set(out) == {"tier-write_back", "tier-write_through", "router"}
    assert all(r["baseline_s"] > 0 and r["current_s"] > 0 for r in out.values())


def test_issue_30_benchmarks_run(tmp_path):
    """The policy, tier and disk benchmarks of issue 30 run (smoke sizes) and compare what they
    say they compare."""
    import disk_tier
    import host_policies
    import scheduler_policies

    runs = scheduler_policies.main(["--quick"])
    assert {p for _, p in runs} == set(scheduler_policies.POLICIES)
    tiers = host_policies.main(["--quick"])
    inclusive, exclusive = tiers["write_back_inclusive", 1024][1], tiers["write_back", 1024][1]
    assert inclusive.saved_pages < exclusive.saved_pages  # a load keeps the host copy
    disk = disk_tier.main(["--quick", "--dir", str(tmp_path)])
    assert all(rate > 0 for rate in disk.values())
