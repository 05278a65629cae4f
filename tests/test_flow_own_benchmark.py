"""`benchmarks/flow_own.py` runs: this checkout against itself as the baseline, on a small trace."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import flow_own

from kvcache.serving.workloads import mixed

ROOT = Path(__file__).resolve().parents[1]


def test_flow_own_runs_against_a_baseline(monkeypatch):
    monkeypatch.setitem(flow_own.TRACES, "tiny", lambda: (mixed(60, seed=1), 2_000))
    threads = torch.get_num_threads()
    try:
        out = flow_own.main(
            [
                "--baseline",
                str(ROOT),
                "--traces",
                "tiny",
                "--page-sizes",
                "1",
                "4",
                "--repeats",
                "1",
            ]
        )
    finally:
        torch.set_num_threads(threads)
    assert set(out) == {"tiny/1", "tiny/4"}
    for row in out.values():
        assert set(row) == {
            "manager_us",
            "baseline_flow_us",
            "this_flow_us",
            "baseline_own_us",
            "this_own_us",
        }
        assert all(v > 0 for v in row.values())
