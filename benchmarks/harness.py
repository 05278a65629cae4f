"""What every benchmark shares: its clocks, the label of the machine a run ran on, and its JSON.

Imported by the scripts beside it (each puts this folder first on ``sys.path``); the kernel
benchmarks import it after they have set (or not) ``TRITON_INTERPRET``. It imports torch but
neither triton (until a CUDA timing needs it) nor kvcache.

Times per call, because a small call's cost can sit on either side of a launch:

* `time_fn`: the median GPU time between two events around one call, with the L2 cache flushed
  before each (``triton.testing.do_bench``); ``torch.utils.benchmark`` off CUDA. Host time shows
  through only where it outlasts the flush queued before the call (about 60-80 us of a 256 MiB
  memset on an H200);
* `wall_time`: seconds per call over back-to-back calls synchronised once, what the caller's
  thread pays when nothing hides the host work (checks, launch);
* `graph_time`: the call captured once in a CUDA graph and replayed: the kernels' own time with
  no Python at all, for calls a graph can capture (no host sync);
* `cpu_best`: the fastest of a few runs in CPU time of the thread, for host-side code on a
  machine shared with other jobs (which inflate wall time, not this).

Labels: `device_label` (the kernel benchmarks: device, versions, date, commit) and `machine`
(the CPU benchmarks: CPU, versions, threads, date, commit, and the engines a run compared with).
`write_json` keeps a result; `import_engine` imports a real engine's module from the folder
``scripts/real_engines_env.sh`` fills.
"""

from __future__ import annotations

import datetime as _dt
import importlib
import json
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "commit",
    "copy_bandwidth",
    "cpu_best",
    "device_label",
    "graph_time",
    "import_engine",
    "machine",
    "time_fn",
    "wall_time",
    "write_json",
]

RESULTS = Path(__file__).resolve().parent / "results"


# ------------------------------------------------------------------ clocks
def time_fn(fn: Callable[[], object], device: torch.device, min_run_time: float) -> float:
    """Median seconds per call: ``triton.testing.do_bench`` on CUDA, ``torch.utils.benchmark``
    elsewhere."""
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


def wall_time(fn: Callable[[], object], device: torch.device, calls: int) -> float:
    """Wall-clock seconds per call of ``calls`` back-to-back calls, synchronised once at the end
    (after a few warm-up calls): the host's checks and launches included."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(max(1, calls // 10)):
        fn()
    sync()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - t) / calls


def graph_time(fn: Callable[[], object], device: torch.device) -> float | None:
    """Median GPU seconds per replay of ``fn`` captured once in a CUDA graph (``None`` off CUDA):
    the kernels alone, without the Python that launches them. ``fn`` must make no host sync."""
    if device.type != "cuda":
        return None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compilation) off the capturing stream
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_fn(graph.replay, device, 0)


def copy_bandwidth(device: torch.device, nbytes: int = 2**30) -> float | None:
    """Bytes/s of a device-to-device copy of ``nbytes`` (read + written, so ``2 * nbytes`` are
    moved): with the default 1 GiB, the ceiling for a scatter or a gather. Measured on CUDA only
    (``None`` elsewhere)."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src), device, 0)
    return 2 * src.numel() * 4 / t


def cpu_best(fn: Callable[[], object], repeats: int) -> float:
    """The fewest CPU seconds of the thread that one call of ``fn`` took over ``repeats`` calls."""
    best = float("inf")
    for _ in range(max(1, repeats)):
        t0 = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t0)
    return best


# ------------------------------------------------------------------ labels
def commit(where: Path | None = None) -> str | None:
    """The short commit of the checkout holding ``where`` (default: this repository), with
    ``+dirty`` when its tracked files differ from it; ``None`` where git cannot tell (a copy of
    the tree without ``.git``)."""
    folder = where.resolve() if where is not None else Path(__file__).resolve().parents[1]
    try:
        rev = subprocess.run(
            ["git", "-C", str(folder), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(folder), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return rev + ("+dirty" if dirty else "") if rev else None


def machine(**extra: Any) -> dict[str, Any]:
    """What a CPU run ran on: CPU, versions, torch threads, date, this repository's commit, and
    ``extra`` (the clock, the versions or commits of the engines it ran)."""
    return {
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit(),
        **extra,
    }


def device_label(device: torch.device) -> dict[str, object]:
    """Where and when a kernel result was measured: device name, versions, date (UTC), CPU
    threads, and the commit of the code measured."""
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
            gpu_multiprocessors=props.multi_processor_count,
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
        commit=commit(),
        **extra,
    )


# ------------------------------------------------------------------ results
def write_json(
    result: dict[str, Any], out: str | Path | None, name: str | None = None, *, quiet: bool = False
) -> Path | None:
    """Write ``result`` as JSON to ``out``; without ``out``, to ``benchmarks/results/{name}.json``
    when a ``name`` is given, or nowhere. Says where (unless ``quiet``: the kernel benchmarks
    also write after each configuration, so that a run stopped by its timeout leaves what it
    measured, marked ``"complete": false``)."""
    if out is None and name is None:
        return None
    path = Path(out) if out is not None else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    if not quiet:
        print(f"# wrote {path}")
    return path


def import_engine(folder: Path | None, module: str, what: str) -> None:
    """Import ``module`` (``folder``, when given, first on the path), or exit naming ``what``
    and the script that makes such a folder."""
    if folder is not None:
        sys.path.insert(0, str(folder.resolve()))
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise SystemExit(
            f"{what} does not import ({e}); make a folder for it with "
            "`bash scripts/real_engines_env.sh DIR` and pass --engines-path DIR"
        ) from None
