"""`make gpu-record` and what it left in book/data/.

The recording itself needs a CUDA GPU. Here: the script refuses without one and writes nothing,
it names files that exist, runs under five minutes and never overwrites the first record, and
the committed JSON has the fields the appendix (book/23_against_engines.ipynb) reads and was measured on a CUDA device.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_record.sh"
DATA = ROOT / "book" / "data"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script records for real")
def test_refuses_without_cuda_and_writes_nothing(tmp_path):
    run = subprocess.run(
        ["bash", str(SCRIPT), sys.executable],
        env={"PATH": "/usr/bin:/bin", "GPU_DATA": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0
    assert "sees no CUDA device; nothing recorded" in run.stderr
    assert list(tmp_path.iterdir()) == []


def test_script_names_files_that_exist():
    text = SCRIPT.read_text()
    named = set(re.findall(r"(?:tests|benchmarks)/[\w/]+\.py", text))
    assert {"benchmarks/store_kv.py", "benchmarks/paged_decode.py"} <= named
    assert any(n.startswith("tests/") for n in named)
    for name in named:
        assert (ROOT / name).is_file(), name
    assert "bash scripts/gpu_record.sh $(PY)" in (ROOT / "Makefile").read_text()


def test_script_keeps_the_first_record_and_its_five_minutes():
    """The second record goes beside the first (``*_gpu_v2.json``), and the steps' timeouts add
    up to five minutes at most."""
    text = SCRIPT.read_text()
    outs = re.findall(r'--out "\$DATA/([\w.]+)"', text)
    assert set(outs) == {
        "store_kv_gpu_v2.json",
        "paged_decode_gpu_v2.json",
        "host_cost_gpu_v2.json",
    }
    limits = [int(s) for s in re.findall(r"^step (\d+) ", text, flags=re.M)]
    assert len(limits) == 4 and sum(limits) <= 300


LABEL = {"device", "device_name", "torch", "triton", "date", "cuda", "copy_bandwidth_Bps"}
ROW = {
    "store_kv_gpu.json": {"layout", "page_size", "heads", "head_dim", "dtype", "tokens"},
    "paged_decode_gpu.json": {"batch", "context", "heads", "head_dim", "group", "page_size"},
}
ROW["store_kv_gpu_v2.json"] = ROW["store_kv_gpu.json"] | {"wall_s"}
ROW["paged_decode_gpu_v2.json"] = ROW["paged_decode_gpu.json"] | {"layout", "slots"}


@pytest.mark.parametrize("name", sorted(ROW))
def test_recorded_json_is_from_a_gpu(name):
    path = DATA / name
    if not path.exists():
        pytest.skip(f"{name} not recorded")
    rec = json.loads(path.read_text())
    assert rec.keys() >= LABEL
    assert rec["device"].startswith("cuda") and rec["cuda"] and not rec.get("interpreter")
    assert rec["copy_bandwidth_Bps"] > 0
    common = {"method", "time_s", "bytes", "bandwidth_Bps", "fraction_of_copy_bw"}
    for row in rec["rows"]:
        assert ROW[name] | common <= row.keys()
        assert row["time_s"] > 0
        assert row["bandwidth_Bps"] == pytest.approx(row["bytes"] / row["time_s"])
        assert row["fraction_of_copy_bw"] == pytest.approx(
            row["bandwidth_Bps"] / rec["copy_bandwidth_Bps"]
        )


@pytest.mark.parametrize("name", ["store_kv_gpu_v2.json", "paged_decode_gpu_v2.json"])
def test_second_record_covers_what_the_goals_are_read_on(name):
    """Every layout and page sizes 1 and 16, the unchecked kernel beside torch's best method,
    a complete run with its commit."""
    path = DATA / name
    if not path.exists():
        pytest.skip(f"{name} not recorded yet: `make gpu-record` on a CUDA machine writes it")
    rec = json.loads(path.read_text())
    assert rec["complete"] is True and rec["commit"]
    rows = rec["rows"]
    assert {r["layout"] for r in rows} == {"LayerFirst", "PageFirst"}
    assert {r["page_size"] for r in rows} >= {1, 16}
    methods = {r["method"] for r in rows}
    if name.startswith("store"):
        assert {"store_cache[triton](no bounds check)", "index_put"} <= methods
        assert {r["tokens"] for r in rows} >= {1, 64, 4096}
    else:
        assert {"paged_decode_attention[triton](no bounds check)", "gather + sdpa"} <= methods
        assert {(r["batch"], r["context"]) for r in rows} >= {(32, 4096), (128, 4096)}
