"""Where a small kernel call's time goes: the host (Python, argument checks, read-backs) or the
device.

    python benchmarks/host_cost.py                       # on CUDA: the figures
    python benchmarks/host_cost.py --device cpu --quick  # a smoke run on the CPU

Each call gets two numbers:

* ``device_s``: the median of ``triton.testing.do_bench`` on CUDA, the GPU time between two
  events (host time shows through only where it outlasts the cache flush that ``do_bench``
  queues before each call); ``torch.utils.benchmark`` on the CPU;
* ``wall_s``: wall-clock seconds per call over a loop of calls with one synchronize at the end,
  what the caller's thread pays: checks, read-backs and launch included.

Calls, on one layer of a page-16 LayerFirst pool (8 KV heads x 128, bf16):

* ``store_cache`` with its host bounds check, with ``check_bounds=False``, and torch's
  ``index_copy_`` on the flat view, at 1, 64 and 4096 tokens;
* ``aminmax``: the indices' minimum and maximum read back to the host (the check alone);
* ``paged_decode_attention`` with and without the slots' range check (``check_bounds``), for 1,
  8 and 32 requests of 512 tokens.

Results go to a JSON file labelled with the device, versions and date.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import device_label, time_fn, wall_time, write_json

from kvcache import KVCacheLayout, MHAKVCache, store_cache
from kvcache.kernels import paged_decode_attention


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, few calls (a smoke run)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/)")
    return p.parse_args(argv)


def store_calls(
    kc: torch.Tensor, vc: torch.Tensor, idx: torch.Tensor, k: torch.Tensor
) -> dict[str, Callable[[], object]]:
    """Storing ``k`` (as K and V) at slots ``idx`` of a paged layer ``kc``, ``vc``, four ways."""
    flat_k, flat_v, idx64 = kc.view(-1, *kc.shape[2:]), vc.view(-1, *vc.shape[2:]), idx.long()
    return {
        "store_cache (host check)": lambda: store_cache(kc, vc, idx, k, k),
        "store_cache (check_bounds=False)": lambda: store_cache(
            kc, vc, idx, k, k, check_bounds=False
        ),
        "index_copy_ (torch)": lambda: (
            flat_k.index_copy_(0, idx64, k),
            flat_v.index_copy_(0, idx64, k),
        ),
        "aminmax read back": lambda: torch.stack(torch.aminmax(idx)).tolist(),
    }


def decode_calls(
    q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, slots: list[torch.Tensor]
) -> dict[str, Callable[[], object]]:
    """Decode attention of ``q`` over each request's ``slots``, with and without the range check."""
    return {
        "paged_decode_attention (range check)": lambda: paged_decode_attention(q, kc, vc, slots),
        "paged_decode_attention (check_bounds=False)": lambda: paged_decode_attention(
            q, kc, vc, slots, check_bounds=False
        ),
    }


def main(args: argparse.Namespace) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(0)
    calls, min_run = (20, 0.001) if args.quick else (1000, 0.05)
    rows: list[dict[str, object]] = []

    def record(what: str, size: int, fn: Callable[[], object]) -> None:
        row = dict(
            call=what,
            size=size,
            device_s=time_fn(fn, device, min_run),
            wall_s=wall_time(fn, device, calls),
        )
        rows.append(row)
        print(
            f"{what:<44} {size:>6}  device {row['device_s'] * 1e6:9.1f} us"
            f"  wall {row['wall_s'] * 1e6:9.1f} us",
            flush=True,
        )

    bf16 = torch.bfloat16
    pool = MHAKVCache(8, 1, 128, 1024, bf16, KVCacheLayout.LayerFirst, device, page_size=16)
    kc, vc = pool.k_cache(0), pool.v_cache(0)
    for n in (1, 64) if args.quick else (1, 64, 4096):
        idx = torch.randperm(pool.num_slots, device=device)[:n].to(torch.int32)
        k = torch.randn(n, 8, 128, device=device).to(bf16)
        for what, fn in store_calls(kc, vc, idx, k).items():
            record(what, n, fn)
    context = 16 if args.quick else 512
    for batch in (1, 2) if args.quick else (1, 8, 32):
        flat = torch.randperm(pool.num_slots, device=device)[: batch * context].to(torch.int32)
        q = torch.randn(batch, 32, 128, device=device).to(bf16)
        for what, fn in decode_calls(q, kc, vc, list(flat.split(context))).items():
            record(what, batch, fn)
    result = dict(benchmark="host_cost", **device_label(device), rows=rows)
    write_json(result, args.out, f"host_cost-{device.type}")
    return result


if __name__ == "__main__":
    main(parse_args())
