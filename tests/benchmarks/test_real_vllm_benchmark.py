"""`benchmarks/block_hash_vs_real_vllm.py`: it says how to get vLLM when it cannot import it, and
where vLLM's prefix cache imports (a folder from `scripts/real_engines_env.sh` on ``PYTHONPATH``)
it runs and finds the same reused tokens as `BlockHashCacheManager`."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import block_hash_vs_real_vllm as real
import block_hash_vs_vllm as stand_in_bench


def test_without_vllm_it_names_the_script_that_makes_its_folder(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm.v1.core.kv_cache_manager", None)  # import fails
    with pytest.raises(SystemExit, match=r"scripts/real_engines_env\.sh DIR.*--engines-path DIR"):
        real.main(["--traces", "chat", "--repeats", "1"])


def test_the_real_vllm_reuses_what_ours_reuses(monkeypatch):
    pytest.importorskip("vllm.v1.core.kv_cache_manager")
    jobs = stand_in_bench.TRACES["agent"]()[:120]
    monkeypatch.setitem(stand_in_bench.TRACES, "agent", lambda: jobs)
    threads = torch.get_num_threads()
    try:
        row = real.compare("agent", 1)
    finally:
        torch.set_num_threads(threads)
    assert row["requests"] == 120 and row["reused_tokens"] > 0
    assert row["vllm_with_hashing_seconds"] > row["vllm_seconds"] > 0


def test_our_side_times_the_allocator_and_decides_as_the_stand_in_benchmark():
    jobs = stand_in_bench.TRACES["chat"]()[:150]
    manager, pages, reused = real.drive_ours(jobs)
    _, _, decisions = stand_in_bench.drive(
        lambda: real.BlockHashCacheManager("cpu", 16), jobs, real.POOL, 16
    )
    assert reused == decisions["reused"] and sum(reused) > 0
    assert manager > 0 and pages > 0
