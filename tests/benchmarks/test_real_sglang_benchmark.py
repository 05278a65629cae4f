"""`benchmarks/radix_vs_real_sglang.py`: its driver makes the flow's cache decisions, it says how
to get SGLang when it cannot import it, and where SGLang's radix cache imports it runs."""

import sys
from functools import partial
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import radix_ops
import radix_vs_real_sglang as real

from kvcache import RadixCacheManager
from kvcache.serving.workloads import agent


@pytest.mark.parametrize("ps", [1, 16])
def test_the_driver_decides_as_request_flow_does(ps):
    jobs = agent(120, seed=1)
    slots = 6000  # small enough that both evict
    run = real.drive(real.Ours(ps), jobs, slots, ps)
    flow = radix_ops.run(jobs, partial(RadixCacheManager, page_size=ps), slots, ps, 1)
    assert sum(run["reused"]) == flow["reused_tokens"] > 0
    assert run["evicted"] == flow["evicted_tokens"] > 0


def test_without_sglang_it_names_the_script_that_makes_its_folder(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang.srt.mem_cache", None)  # import fails
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))  # the stub goes with the test
    with pytest.raises(SystemExit, match=r"scripts/real_engines_env\.sh DIR.*--engines-path DIR"):
        real.main(["--traces", "chat", "--repeats", "1"])


def test_real_sglang_runs(monkeypatch):
    monkeypatch.setattr(sys, "meta_path", [real._TorchvisionStub(), *sys.meta_path])
    pytest.importorskip("sglang.srt.mem_cache.radix_cache")
    jobs, slots = radix_ops.TRACES["chat"]()
    monkeypatch.setitem(radix_ops.TRACES, "chat", lambda: (jobs[:150], slots // 8))
    threads = torch.get_num_threads()
    try:
        row = real.compare("chat", 16, 1)
    finally:
        torch.set_num_threads(threads)
    assert row["same_decisions"] and row["reused_tokens"]["ours"] > 0
    assert row["sglang_seconds"] > 0 and row["ours_seconds"] > 0


@pytest.mark.parametrize("ps", [1, 16])
def test_minisgl_decides_as_ours(ps):
    pytest.importorskip("minisgl.kvcache.radix_cache")
    jobs = agent(80, seed=2)
    ours = real.drive(real.Ours(ps), jobs, 5000, ps)
    theirs = real.drive(real.Minisgl(ps), jobs, 5000, ps)
    assert ours["reused"] == theirs["reused"] and ours["evicted"] == theirs["evicted"] > 0
