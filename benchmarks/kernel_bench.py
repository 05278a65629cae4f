"""What the kernel benchmarks share: timing, the copy-bandwidth ceiling, the device label and
where their JSON goes.

Imported by ``benchmarks/store_kv.py`` and ``benchmarks/paged_decode.py`` after they have set (or
not) ``TRITON_INTERPRET``; it imports torch but not triton or kvcache.
"""

from __future__ import annotations

import datetime as _dt
import json
import platform
from collections.abc import Callable
from pathlib import Path

import torch


def time_fn(fn: Callable[[], object], device: torch.device, min_run_time: float) -> float:
    """Median seconds per call: ``triton.testing.do_bench`` on CUDA, ``torch.utils.benchmark`` elsewhere."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3
    from torch.utils import benchmark

    fn()  # warm-up (and the interpreter's first trace)
    return (
        benchmark.Timer(stmt="fn()", globals={"fn": fn})
        .blocked_autorange(min_run_time=min_run_time)
        .median
    )


def copy_bandwidth(device: torch.device) -> float | None:
    """Bytes/s of a 1 GiB device-to-device copy (read + write): the ceiling for a scatter or a
    gather. Measured on CUDA only (``None`` elsewhere)."""
    if device.type != "cuda":
        return None
    src = torch.empty(256 * 2**20, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src), device, 0)
    return 2 * 256 * 2**20 * 4 / t


def device_label(device: torch.device) -> dict[str, object]:
    """Where and when a result was measured: device name, versions, date (UTC), CPU threads."""
    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name = torch.cuda.get_device_name(device)
        extra: dict[str, object] = dict(
            cuda=torch.version.cuda,
            gpu_memory_bytes=props.total_memory,
            gpu_capability=f"{props.major}.{props.minor}",
        )
    else:
        name = platform.processor() or platform.machine()
        extra = {}
    return dict(
        device=str(device),
        device_name=name,
        torch=torch.__version__,
        triton=triton_version,
        python=platform.python_version(),
        cpu_threads=torch.get_num_threads(),
        date=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        **extra,
    )


def write_result(result: dict[str, object], out: str | Path | None, name: str) -> Path:
    """Write ``result`` as JSON to ``out``, or to ``benchmarks/results/{name}.json``; say where."""
    path = Path(out or Path(__file__).resolve().parent / "results" / f"{name}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"# wrote {path}")
    return path
