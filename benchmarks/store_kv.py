"""Time ``store_cache`` against torch alternatives for scattering new tokens' K/V into the pool.

    python benchmarks/store_kv.py                 # CPU: up to 4096 tokens, ~1 minute
    python benchmarks/store_kv.py --full          # 1 .. 32768 tokens
    python benchmarks/store_kv.py --interpreter   # CPU: time the Triton kernel in the interpreter

Methods, per row (one pool layer, ``n`` tokens at random distinct slots):

* ``store_cache``: what ``store_cache`` dispatches to on this device (Triton on CUDA). On the CPU
  that is the torch backend unless ``TRITON_INTERPRET=1``; the benchmark times the torch backend
  there (it says so) unless ``--interpreter`` asks for the Triton kernel in the interpreter,
  which measures Python, not memory.
* ``index_put``: ``k_cache[page, offset] = k`` (advanced-index assignment), same for ``v``.
* ``index_copy_``: ``k_cache.view(num_slots, H, D).index_copy_(0, slots, k)``; only where the layer
  view flattens without a copy (not PageFirst with ``page_size > 1``).
* ``store_cache(no bounds check)``: ``check_bounds=False``, the variant a CUDA graph can capture:
  no host read-back of min/max indices, only the kernel's device-side guard (on CUDA, and on the
  CPU with ``--interpreter``).

Which bounds check a row's time includes is in its ``bounds_check`` field: ``"host"`` (the
default ``store_cache``: ``aminmax`` of the indices read back to the host, a sync, then the
launch), ``"device-guard"`` (``check_bounds=False``: the kernel masks out-of-range rows) or
``"none"`` (plain torch indexing, which checks inside the op).

Bandwidth = (bytes of k and v read + bytes written + index bytes) / time. On CUDA each row also
gives the fraction of a measured device-to-device copy's bandwidth, ``wall_s`` (seconds per call
of back-to-back calls: the host's checks and launch included) and, for the unchecked store,
``graph_s`` (the call captured in a CUDA graph and replayed: the kernel alone, no Python); and
``copy_rows`` time a plain ``copy_`` of each batch's bytes, the ceiling at that size. Timing:
median of ``triton.testing.do_bench`` on CUDA (see ``harness`` for what each time
includes), ``torch.utils.benchmark`` on the CPU. Results go to a JSON file with the device name,
versions, date and commit, rewritten after each pool (``"complete": false`` until the last); the
run ends with the issue's two goals read off the rows.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--full", action="store_true", help="batch sizes up to 32768 tokens")
    p.add_argument(
        "--max-tokens", type=int, default=None, help="largest batch (default 4096 CPU, 32768 CUDA)"
    )
    p.add_argument(
        "--interpreter",
        action="store_true",
        help="CPU only: time the Triton kernel under TRITON_INTERPRET=1 (slow; caps tokens at 256)",
    )
    p.add_argument(
        "--heads", nargs="+", default=["8x128"], help="KV-head layouts HxD, e.g. 8x128 2x64"
    )
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"])
    p.add_argument("--page-sizes", nargs="+", type=int, default=[1, 16])
    p.add_argument("--min-run-time", type=float, default=0.05, help="CPU: seconds per timing")
    p.add_argument(
        "--out", default=None, help="JSON path (default benchmarks/results/store_kv-<device>.json)"
    )
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.interpreter:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede importing triton / kvcache

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    copy_bandwidth,
    device_label,
    graph_time,
    time_fn,
    wall_time,
    write_json,
)

from kvcache import KVCacheLayout  # noqa: E402
from kvcache.kernels import store_cache, store_cache_backend, store_cache_torch, store_cache_triton  # noqa: E402
from kvcache.storage.mha_pool import MHAKVCache  # noqa: E402

#: Which bounds check each method's time includes (see the module docstring).
BOUNDS_CHECK = {
    "store_cache[triton]": "host",
    "store_cache[triton](no bounds check)": "device-guard",
    "store_cache[triton-interpreter]": "host",
    "store_cache[triton-interpreter](no bounds check)": "device-guard",
    "store_cache[torch]": "host",
    "index_put": "none",
    "index_copy_": "none",
}


def methods(
    pool: MHAKVCache, idx: torch.Tensor, k: torch.Tensor, v: torch.Tensor, interpreter: bool
) -> dict[str, Callable[[], None]]:
    kc, vc = pool.k_cache(0), pool.v_cache(0)
    dev = pool.device
    idx64 = idx.long()
    page, off = idx64 // pool.page_size, idx64 % pool.page_size
    out: dict[str, Callable[[], None]] = {}
    if dev.type == "cuda":
        out["store_cache[triton]"] = lambda: store_cache(kc, vc, idx, k, v)
        out["store_cache[triton](no bounds check)"] = lambda: store_cache(
            kc, vc, idx, k, v, check_bounds=False
        )
    elif interpreter:
        out["store_cache[triton-interpreter]"] = lambda: store_cache_triton(kc, vc, idx, k, v)
        out["store_cache[triton-interpreter](no bounds check)"] = lambda: store_cache_triton(
            kc, vc, idx, k, v, check_bounds=False
        )
    else:
        out["store_cache[torch]"] = lambda: store_cache_torch(kc, vc, idx, k, v)

    def index_put() -> None:
        kc[page, off] = k
        vc[page, off] = v

    out["index_put"] = index_put
    try:
        kf, vf = (
            kc.view(pool.num_slots, pool.local_kv_heads, pool.head_dim),
            vc.view(pool.num_slots, pool.local_kv_heads, pool.head_dim),
        )
    except RuntimeError:  # PageFirst with page_size > 1: the layer view is not flattenable
        pass
    else:
        out["index_copy_"] = lambda: (kf.index_copy_(0, idx64, k), vf.index_copy_(0, idx64, v))
    return out


#: Calls the wall clock times per row.
WALL_CALLS = 200
UNCHECKED = "store_cache[triton](no bounds check)"


def copy_rows(device: torch.device, sizes: list[int], bytes_per_token: int) -> list[dict]:
    """A plain device-to-device ``copy_`` of what a store of ``n`` tokens moves (half read, half
    written), for each ``n``: the ceiling at that size, launch and ramp-up included."""
    out = []
    for n in sizes:
        src = torch.empty(n * bytes_per_token // 2, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        t = time_fn(lambda dst=dst, src=src: dst.copy_(src), device, 0)
        out.append(
            dict(tokens=n, bytes=2 * src.numel(), time_s=t, bandwidth_Bps=2 * src.numel() / t)
        )
    return out


def goals(rows: list[dict], bw_copy: float | None) -> list[str]:
    """The issue's two goals for the store, read off the rows (CUDA only)."""
    fast = [r for r in rows if r["method"] == UNCHECKED]
    if not bw_copy or not fast:
        return []
    big = [r for r in fast if r["tokens"] >= 4096]
    worst = min(big, key=lambda r: r["fraction_of_copy_bw"]) if big else None
    key = ("layout", "page_size", "heads", "head_dim", "dtype", "tokens")
    torch_best = {}
    for r in rows:
        if r["method"] in ("index_put", "index_copy_"):
            k = tuple(r[x] for x in key)
            torch_best[k] = min(torch_best.get(k, float("inf")), r["time_s"])
    ratios = [
        (r["time_s"] / torch_best[tuple(r[x] for x in key)], r) for r in fast if r["tokens"] <= 64
    ]
    lines = []
    if worst is not None:
        lines.append(
            f"goal: >= 80% of copy bandwidth from 4096 tokens: lowest {worst['fraction_of_copy_bw']:.0%}"
            f" ({worst['layout']}, page {worst['page_size']}, {worst['tokens']} tokens) -> "
            + ("met" if worst["fraction_of_copy_bw"] >= 0.8 else "NOT met")
        )
    if ratios:
        top, r = max(ratios, key=lambda x: x[0])
        lines.append(
            f"goal: <= 1.1x the best torch method at 1-64 tokens: highest {top:.2f}x "
            f"({r['layout']}, page {r['page_size']}, {r['tokens']} tokens) -> "
            + ("met" if top <= 1.1 else "NOT met")
        )
    return lines


def main(args: argparse.Namespace) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.interpreter and device.type != "cpu":
        raise SystemExit("--interpreter is for the CPU")
    max_n = args.max_tokens or (32768 if args.full or device.type == "cuda" else 4096)
    if args.interpreter:
        max_n = min(max_n, 256)
    sizes = [n for n in (1, 4, 16, 64, 256, 1024, 4096, 16384, 32768) if n <= max_n]
    if max_n not in sizes:
        sizes.append(max_n)
    torch.manual_seed(0)
    bw_copy = copy_bandwidth(device)
    label = device_label(device)
    note = {
        "cuda": "store_cache runs the Triton kernel",
        "cpu": (
            "store_cache timed as the Triton kernel in the interpreter (measures Python, not memory)"
            if args.interpreter
            else "store_cache timed on its torch backend: what it dispatches to on the CPU without TRITON_INTERPRET"
        ),
    }[device.type]
    print(
        f"# device: {device} ({label['device_name']}); torch {label['torch']}, triton {label['triton']}"
        f"; commit {label['commit']}"
    )
    print(f"# store_cache backend here: {store_cache_backend(device)}; {note}")
    if bw_copy:
        print(f"# device-to-device copy bandwidth: {bw_copy / 1e9:.1f} GB/s")
    header = f"{'layout':<10} {'ps':>3} {'HxD':>6} {'dtype':<9} {'tokens':>6}  {'method':<48} {'time us':>10} {'GB/s':>8}"
    print(header + ("  %copy  wall us graph us" if bw_copy else ""))

    rows: list[dict] = []
    result = dict(
        benchmark="store_kv",
        **label,
        store_cache_backend=store_cache_backend(device),
        interpreter=bool(args.interpreter),
        note=note,
        copy_bandwidth_Bps=bw_copy,
        bounds_check_meaning={
            "host": "aminmax of the indices read back to the host, then the launch",
            "device-guard": "check_bounds=False: no host sync, the kernel masks out-of-range rows",
            "none": "torch indexing, checked inside the op",
        },
        times_meaning={
            "time_s": "median do_bench GPU time between two events, L2 flushed before each call",
            "wall_s": f"wall clock per call over {WALL_CALLS} back-to-back calls, one sync",
            "graph_s": "median do_bench time of the call replayed from a CUDA graph (no Python)",
        },
        index_distribution="random distinct slots (torch.randperm)",
        complete=False,
        rows=rows,
        copy_rows=[],
    )
    out_name = f"store_kv-{device.type}"
    for hd in args.heads:
        heads, dim = (int(x) for x in hd.lower().split("x"))
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            for layout in KVCacheLayout:
                for ps in args.page_sizes:
                    num_pages = -(-2 * max_n // ps)
                    pool = MHAKVCache(heads, 2, dim, num_pages, dtype, layout, device, page_size=ps)
                    for n in sizes:
                        idx = torch.randperm(pool.num_slots, device=device)[:n].to(torch.int32)
                        k = torch.randn(n, heads, dim, device=device).to(dtype)
                        v = torch.randn(n, heads, dim, device=device).to(dtype)
                        moved = (
                            2 * 2 * k.numel() * k.element_size() + idx.numel() * idx.element_size()
                        )
                        for name, fn in methods(pool, idx, k, v, args.interpreter).items():
                            t = time_fn(fn, device, args.min_run_time)
                            row = dict(
                                layout=layout.name,
                                page_size=ps,
                                heads=heads,
                                head_dim=dim,
                                dtype=dtype_name,
                                tokens=n,
                                method=name,
                                bounds_check=BOUNDS_CHECK[name],
                                time_s=t,
                                bytes=moved,
                                bandwidth_Bps=moved / t,
                            )
                            line = (
                                f"{layout.name:<10} {ps:>3} {hd:>6} {dtype_name:<9} {n:>6}  {name:<48} "
                                f"{t * 1e6:>10.1f} {moved / t / 1e9:>8.2f}"
                            )
                            if bw_copy:
                                row["fraction_of_copy_bw"] = moved / t / bw_copy
                                row["wall_s"] = wall_time(fn, device, WALL_CALLS)
                                line += f"  {row['fraction_of_copy_bw']:>5.1%} {row['wall_s'] * 1e6:>7.1f}"
                                if name == UNCHECKED:
                                    row["graph_s"] = graph_time(fn, device)
                                    line += f" {row['graph_s'] * 1e6:>8.1f}"
                            rows.append(row)
                            print(line, flush=True)
                    del pool
                    write_json(result, args.out, out_name, quiet=True)
    if bw_copy:
        heads, dim = (int(x) for x in args.heads[0].lower().split("x"))
        per_token = 2 * 2 * heads * dim * getattr(torch, args.dtypes[0]).itemsize
        result["copy_rows"] = copy_rows(device, sizes, per_token)
        for r in result["copy_rows"]:
            r["fraction_of_copy_bw"] = r["bandwidth_Bps"] / bw_copy
            print(
                f"copy_ of {r['bytes'] / 2:>12,.0f} bytes ({r['tokens']:>5} tokens' K/V): "
                f"{r['time_s'] * 1e6:8.1f} us, {r['fraction_of_copy_bw']:.0%} of the 1 GiB copy"
            )
    result["complete"] = True
    for line in goals(rows, bw_copy):
        print("#", line)
    write_json(result, args.out, out_name)
    return result


if __name__ == "__main__":
    main(ARGS)
