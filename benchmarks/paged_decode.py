"""Time decode attention over a paged KV cache: the Triton kernel against torch.

    python benchmarks/paged_decode.py                 # CPU: torch only, small batches, ~30 s
    python benchmarks/paged_decode.py --interpreter   # CPU: the Triton kernel in the interpreter (tiny)
    python benchmarks/paged_decode.py --out book/data/paged_decode_gpu.json   # on CUDA: the full grid

Each row: ``batch`` requests, each ``context`` tokens at random distinct slots of one layer of a
pool (``--layout``, ``--page-size``), one query token per request, ``group`` query heads per KV
head. Methods:

* ``paged_decode_attention[<backend>]``: the Triton decode kernel (CUDA, or the interpreter with
  ``--interpreter``); its time includes the bounds check of the slots (a host read-back) and the
  concatenation of the per-request slot lists, i.e. what one call costs a caller.
* ``paged_attention[torch]``: the torch reference (gathers each request's K/V, then attends);
  on the CPU this is what ``paged_decode_attention`` falls back to.
* ``sdpa on dense K/V``: ``scaled_dot_product_attention`` on K/V already gathered into one dense
  padded tensor (the gather not timed): the floor a paged kernel is compared with.

Bandwidth = bytes of K and V the requests read (``2 * batch * context * kv_heads * head_dim *
itemsize``) / time. On CUDA each row also gives the fraction of a device-to-device copy's
bandwidth measured in the same run. Results go to a JSON file with the device, versions and date.
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
    p.add_argument(
        "--interpreter",
        action="store_true",
        help="CPU only: time the Triton kernel under TRITON_INTERPRET=1 (slow: tiny sizes)",
    )
    p.add_argument("--batches", nargs="+", type=int, default=None, help="requests per call")
    p.add_argument("--contexts", nargs="+", type=int, default=None, help="tokens per request")
    p.add_argument("--heads", default="8x128", help="KV heads x head_dim, e.g. 8x128")
    p.add_argument("--group", type=int, default=4, help="query heads per KV head (GQA)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--layout", choices=["LayerFirst", "PageFirst"], default="LayerFirst")
    p.add_argument("--block-n", type=int, default=32, help="the kernel's tokens per step")
    p.add_argument("--min-run-time", type=float, default=0.05, help="CPU: seconds per timing")
    p.add_argument(
        "--out",
        default=None,
        help="JSON path (default benchmarks/results/paged_decode-<device>.json)",
    )
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.interpreter:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede importing triton / kvcache

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_bench import copy_bandwidth, device_label, time_fn, write_result  # noqa: E402

from kvcache import KVCacheLayout  # noqa: E402
from kvcache.kernels import paged_attention, paged_decode_attention, paged_decode_backend  # noqa: E402
from kvcache.storage.mha_pool import MHAKVCache  # noqa: E402


def methods(
    pool: MHAKVCache, q: torch.Tensor, slots: list[torch.Tensor], block_n: int, with_kernel: bool
) -> dict[str, Callable[[], object]]:
    kc, vc = pool.k_cache(0), pool.v_cache(0)
    out: dict[str, Callable[[], object]] = {}
    if with_kernel:
        out[f"paged_decode_attention[{paged_decode_backend(q.device)}]"] = lambda: (
            paged_decode_attention(q, kc, vc, slots, block_n=block_n)
        )
    out["paged_attention[torch]"] = lambda: paged_attention(q, kc, vc, slots)
    # Dense floor: (B, Hkv, T, D) gathered once, outside the timing.
    s = torch.stack(slots).long()
    ps = pool.page_size
    kd = kc[s // ps, s % ps].transpose(1, 2).contiguous()
    vd = vc[s // ps, s % ps].transpose(1, 2).contiguous()
    qd = q[:, :, None, :]  # (B, Hq, 1, D)
    out["sdpa on dense K/V"] = lambda: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True)
    return out


def main(args: argparse.Namespace) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.interpreter and device.type != "cpu":
        raise SystemExit("--interpreter is for the CPU")
    backend = paged_decode_backend(device)
    with_kernel = backend != "torch"
    cuda = device.type == "cuda"
    batches = args.batches or (
        [1, 8, 32, 128] if cuda else [1, 2] if args.interpreter else [1, 8, 32]
    )
    contexts = args.contexts or (
        [512, 4096] if cuda else [16, 64] if args.interpreter else [128, 1024]
    )
    heads, dim = (int(x) for x in args.heads.lower().split("x"))
    dtype = getattr(torch, args.dtype)
    layout = KVCacheLayout[args.layout]
    torch.manual_seed(0)
    bw_copy = copy_bandwidth(device)
    label = device_label(device)
    print(
        f"# device: {device} ({label['device_name']}); torch {label['torch']}, triton {label['triton']}"
    )
    print(f"# paged_decode_attention backend here: {backend}")
    if bw_copy:
        print(f"# device-to-device copy bandwidth: {bw_copy / 1e9:.1f} GB/s")
    print(
        f"{'batch':>5} {'context':>7}  {'method':<40} {'time us':>10} {'GB/s':>8}"
        + ("  %copy" if bw_copy else "")
    )

    rows = []
    for context in contexts:
        for batch in batches:
            tokens = batch * context
            num_pages = -(-2 * tokens // args.page_size)
            pool = MHAKVCache(
                heads, 1, dim, num_pages, dtype, layout, device, page_size=args.page_size
            )
            flat = torch.randperm(pool.num_slots, device=device)[:tokens].to(torch.int32)
            k = torch.randn(tokens, heads, dim, device=device).to(dtype)
            pool.store_kv(k, torch.randn_like(k), flat, 0)
            slots = list(flat.split(context))
            q = torch.randn(batch, heads * args.group, dim, device=device).to(dtype)
            moved = 2 * tokens * heads * dim * k.element_size()
            for name, fn in methods(pool, q, slots, args.block_n, with_kernel).items():
                t = time_fn(fn, device, args.min_run_time)
                row = dict(
                    batch=batch,
                    context=context,
                    heads=heads,
                    head_dim=dim,
                    group=args.group,
                    dtype=args.dtype,
                    page_size=args.page_size,
                    layout=args.layout,
                    method=name,
                    time_s=t,
                    bytes=moved,
                    bandwidth_Bps=moved / t,
                )
                if bw_copy:
                    row["fraction_of_copy_bw"] = moved / t / bw_copy
                rows.append(row)
                line = (
                    f"{batch:>5} {context:>7}  {name:<40} {t * 1e6:>10.1f} {moved / t / 1e9:>8.2f}"
                )
                print(
                    line + (f"  {row['fraction_of_copy_bw']:>5.1%}" if bw_copy else ""), flush=True
                )
            del pool

    result = dict(
        benchmark="paged_decode",
        **label,
        paged_decode_backend=backend,
        interpreter=bool(args.interpreter),
        copy_bandwidth_Bps=bw_copy,
        block_n=args.block_n,
        slot_distribution="random distinct slots (torch.randperm)",
        rows=rows,
    )
    write_result(result, args.out, f"paged_decode-{device.type}")
    return result


if __name__ == "__main__":
    main(ARGS)
