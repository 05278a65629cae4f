"""The kernel benchmarks run (tiny sizes, the CPU) and label what they write."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import host_cost
import paged_decode
import store_kv

LABEL = {"device", "device_name", "torch", "triton", "python", "date", "copy_bandwidth_Bps"}


def test_store_kv_runs_and_labels_its_json(tmp_path):
    out = tmp_path / "s.json"
    threads = torch.get_num_threads()
    try:
        store_kv.main(
            store_kv.parse_args(
                [
                    "--device",
                    "cpu",
                    "--max-tokens",
                    "4",
                    "--dtypes",
                    "bfloat16",
                    "--page-sizes",
                    "4",
                    "--min-run-time",
                    "0.001",
                    "--out",
                    str(out),
                ]
            )
        )
    finally:
        torch.set_num_threads(threads)
    rec = json.loads(out.read_text())
    assert set(rec) >= LABEL and rec["rows"]
    assert {r["bounds_check"] for r in rec["rows"]} <= {"host", "device-guard", "none"}
    assert {r["tokens"] for r in rec["rows"]} == {1, 4}


def test_paged_decode_runs_and_labels_its_json(tmp_path):
    out = tmp_path / "d.json"
    paged_decode.main(
        paged_decode.parse_args(
            [
                "--device",
                "cpu",
                "--batches",
                "2",
                "--contexts",
                "8",
                "--heads",
                "2x8",
                "--page-size",
                "4",
                "--min-run-time",
                "0.001",
                "--out",
                str(out),
            ]
        )
    )
    rec = json.loads(out.read_text())
    assert set(rec) >= LABEL
    methods = {r["method"] for r in rec["rows"]}
    assert "paged_attention[torch]" in methods and "sdpa on dense K/V" in methods
    assert all(r["bandwidth_Bps"] > 0 for r in rec["rows"])


def test_host_cost_runs_and_labels_its_json(tmp_path):
    out = tmp_path / "h.json"
    host_cost.main(host_cost.parse_args(["--device", "cpu", "--quick", "--out", str(out)]))
    rec = json.loads(out.read_text())
    assert set(rec) >= LABEL - {"copy_bandwidth_Bps"} and rec["benchmark"] == "host_cost"
    calls = {r["call"] for r in rec["rows"]}
    assert "store_cache (check_bounds=False)" in calls and len(calls) == 6
    assert all(r["device_s"] > 0 and r["wall_s"] > 0 for r in rec["rows"])
