"""The kernel benchmarks run (tiny sizes, the CPU) and label what they write."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

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
                "--page-sizes",
                "4",
                "--splits-sweep",
                "1",
                "3",
                "--sweep-at",
                "2x8",
                "--min-run-time",
                "0.001",
                "--out",
                str(out),
            ]
        )
    )
    rec = json.loads(out.read_text())
    assert set(rec) >= LABEL | {"commit"} and rec["complete"] is True
    methods = {r["method"] for r in rec["rows"]}
    assert {"paged_attention[torch]", "gather + sdpa", "sdpa on dense K/V"} <= methods
    assert {r["slots"] for r in rec["rows"]} == {"random", "pages"}
    assert all(r["bandwidth_Bps"] > 0 for r in rec["rows"])
    kernel = [r for r in rec["rows"] if r["method"].startswith("paged_decode_attention")]
    if paged_decode.paged_decode_backend("cpu") == "torch":
        assert not kernel
    else:  # the interpreter: both calls, the forced split counts, each checked before timing
        assert {r["num_splits"] for r in kernel} == {1, 3}
        assert all(r["max_abs_diff_vs_gather_sdpa"] < 1e-2 for r in kernel)


def test_request_slots_are_distinct_and_pages_are_whole():
    pool = paged_decode.MHAKVCache(
        1, 1, 4, 12, torch.float32, paged_decode.KVCacheLayout.PageFirst, "cpu", page_size=4
    )
    for how in ("random", "pages"):
        slots = paged_decode.request_slots(pool, 3, 6, how, torch.device("cpu"))
        flat = torch.cat(slots)
        assert [len(s) for s in slots] == [6, 6, 6] and len(set(flat.tolist())) == 18
        assert flat.dtype == torch.int32 and int(flat.max()) < pool.num_slots
    for s in paged_decode.request_slots(pool, 3, 6, "pages", torch.device("cpu")):
        assert s[0] % 4 == 0 and torch.equal(s[:4], s[0] + torch.arange(4, dtype=torch.int32))


def decode_row(method, time_s, batch=32, **kw):
    return dict(
        batch=batch, context=4096, layout="LayerFirst", page_size=16, slots="random",
        method=method, time_s=time_s, fraction_of_copy_bw=kw.get("frac", 0.5),
    )  # fmt: skip


def test_decode_goals_are_read_off_the_rows():
    rows = [
        decode_row("paged_decode_attention[triton](no bounds check)", 1.0, frac=0.75),
        decode_row("gather + sdpa", 2.0),
        decode_row("paged_decode_attention[triton](no bounds check)", 3.0, batch=1, frac=0.1),
        decode_row("gather + sdpa", 2.0, batch=1),
    ]
    lines = paged_decode.goals(rows, 1.0)
    assert "lowest 75%" in lines[0] and lines[0].endswith("met")
    assert "slower in 1 of 2 rows" in lines[1] and "batch 1 x 4096" in lines[1]
    assert paged_decode.goals(rows, None) == []


def store_row(method, time_s, tokens, frac=0.5):
    return dict(
        layout="PageFirst", page_size=16, heads=8, head_dim=128, dtype="bfloat16",
        tokens=tokens, method=method, time_s=time_s, fraction_of_copy_bw=frac,
    )  # fmt: skip


def test_store_goals_are_read_off_the_rows():
    fast = store_kv.UNCHECKED
    rows = [
        store_row(fast, 1.2, 4, frac=0.001),
        store_row("index_put", 1.0, 4),
        store_row("index_copy_", 2.0, 4),
        store_row(fast, 1.0, 4096, frac=0.79),
        store_row("index_put", 3.0, 4096),
    ]
    lines = store_kv.goals(rows, 1.0)
    assert "lowest 79%" in lines[0] and "NOT met" in lines[0]
    assert "highest 1.20x" in lines[1] and "NOT met" in lines[1]
    rows[0]["time_s"] = 1.05
    assert store_kv.goals(rows, 1.0)[1].endswith("-> met")
    copies = store_kv.copy_rows(torch.device("cpu"), [1, 4], 64)
    assert [r["bytes"] for r in copies] == [64, 256] and all(r["time_s"] > 0 for r in copies)


def test_host_cost_runs_and_labels_its_json(tmp_path):
    out = tmp_path / "h.json"
    host_cost.main(host_cost.parse_args(["--device", "cpu", "--quick", "--out", str(out)]))
    rec = json.loads(out.read_text())
    assert set(rec) >= LABEL - {"copy_bandwidth_Bps"} and rec["benchmark"] == "host_cost"
    calls = {r["call"] for r in rec["rows"]}
    assert "store_cache (check_bounds=False)" in calls and len(calls) == 6
    assert all(r["device_s"] > 0 and r["wall_s"] > 0 for r in rec["rows"])
