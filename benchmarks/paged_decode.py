"""Time decode attention over a paged KV cache: the Triton kernels against torch.

    python benchmarks/paged_decode.py                 # CPU: torch only, small batches, ~1 min
    python benchmarks/paged_decode.py --interpreter   # CPU: the Triton kernels in the interpreter (tiny)
    python benchmarks/paged_decode.py --out book/data/paged_decode_gpu_v2.json --splits-sweep 1 2 4 8 16
                                                      # on CUDA: the full grid (what make gpu-record runs)

Each row: ``batch`` requests, each ``context`` tokens in one layer of a pool (``--layouts``,
``--page-sizes``), one query token per request, ``group`` query heads per KV head. The slots of
a request are ``random`` distinct slots of the pool (``torch.randperm``; the old record's
distribution) or whole ``pages`` taken at random and filled in order (what a page allocator
hands out; the same as ``random`` at page size 1). Methods:

* ``paged_decode_attention[<backend>]``: the Triton kernels (CUDA, or the interpreter with
  ``--interpreter``) with the default range check (one read-back of the slots: a host sync);
* ``paged_decode_attention[<backend>](no bounds check)``: ``check_bounds=False``, the call a
  serving loop makes for slots checked when they were built: no host sync;
* ``paged_attention[torch]``: the torch reference (gathers each request's K/V, then attends);
  on the CPU this is what ``paged_decode_attention`` falls back to;
* ``gather + sdpa``: torch's best method for paged K/V: gather the batch's K/V into dense
  tensors by fancy indexing, then ``scaled_dot_product_attention``, both timed;
* ``sdpa on dense K/V``: ``scaled_dot_product_attention`` on K/V already gathered (the gather
  not timed): the floor a paged kernel is compared with.

Before timing, each configuration checks the kernels' output against ``gather + sdpa``'s and
stops on a mismatch. With ``--splits-sweep N ...`` the unchecked kernel is also timed with
``num_splits`` forced to each N at two batch sizes of 4096 tokens, for tuning the default.

Bandwidth = bytes of K and V the requests read (``2 * batch * context * kv_heads * head_dim *
itemsize``) / time. On CUDA each row also gives the fraction of a device-to-device copy's
bandwidth measured in the same run, its time under a wall clock (``wall_s``: host work
included, see ``harness``), and the run ends with the issue's goals read off the rows.
Results go to a JSON file with the device, versions, date and commit, rewritten after each
configuration (``"complete": false`` until the last).
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
        help="CPU only: time the Triton kernels under TRITON_INTERPRET=1 (slow: tiny sizes)",
    )
    p.add_argument("--batches", nargs="+", type=int, default=None, help="requests per call")
    p.add_argument("--contexts", nargs="+", type=int, default=None, help="tokens per request")
    p.add_argument("--heads", default="8x128", help="KV heads x head_dim, e.g. 8x128")
    p.add_argument("--group", type=int, default=4, help="query heads per KV head (GQA)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--page-sizes", nargs="+", type=int, default=[1, 16])
    p.add_argument("--layouts", nargs="+", choices=["LayerFirst", "PageFirst"], default=None)
    p.add_argument(
        "--slots",
        nargs="+",
        choices=["random", "pages"],
        default=["random", "pages"],
        help="slot distributions (pages is timed only where page_size > 1)",
    )
    p.add_argument("--block-n", type=int, default=32, help="the kernel's slots per step")
    p.add_argument(
        "--splits-sweep",
        nargs="*",
        type=int,
        default=[],
        help="also time the unchecked kernel with num_splits forced to each of these",
    )
    p.add_argument(
        "--sweep-at",
        nargs="*",
        default=["32x4096", "8x4096"],
        help="batch x context where --splits-sweep runs (first layout, largest page size, random slots)",
    )
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
from harness import copy_bandwidth, device_label, time_fn, wall_time, write_json  # noqa: E402

from kvcache import KVCacheLayout  # noqa: E402
from kvcache.kernels import (  # noqa: E402
    decode_launch_shape,
    paged_attention,
    paged_decode_attention,
    paged_decode_backend,
)
from kvcache.storage.mha_pool import MHAKVCache  # noqa: E402

KERNEL = "paged_decode_attention[{}]"
UNCHECKED = "paged_decode_attention[{}](no bounds check)"
#: Calls the wall clock times per row, where one call takes under a millisecond.
WALL_CALLS = 50


def request_slots(
    pool: MHAKVCache, batch: int, context: int, how: str, device: torch.device
) -> list[torch.Tensor]:
    """``batch`` lists of ``context`` distinct slots: ``random`` slots, or whole random ``pages``
    filled in order (the last one cut)."""
    if how == "random":
        flat = torch.randperm(pool.num_slots, device=device)[: batch * context]
        return list(flat.to(torch.int32).split(context))
    ps = pool.page_size
    per = -(-context // ps)
    pages = torch.randperm(pool.num_pages, device=device)[: batch * per].view(batch, per)
    slots = (pages[:, :, None] * ps + torch.arange(ps, device=device)).view(batch, per * ps)
    return list(slots[:, :context].to(torch.int32))


def methods(
    pool: MHAKVCache,
    q: torch.Tensor,
    slots: list[torch.Tensor],
    block_n: int,
    backend: str,
    splits: list[int],
) -> dict[str, Callable[[], torch.Tensor]]:
    kc, vc = pool.k_cache(0), pool.v_cache(0)
    ps = pool.page_size
    out: dict[str, Callable[[], torch.Tensor]] = {}
    if backend != "torch":
        out[KERNEL.format(backend)] = lambda: paged_decode_attention(
            q, kc, vc, slots, block_n=block_n
        )
        out[UNCHECKED.format(backend)] = lambda: paged_decode_attention(
            q, kc, vc, slots, block_n=block_n, check_bounds=False
        )
        for n in splits:
            out[f"{UNCHECKED.format(backend)[:-1]}, num_splits={n})"] = lambda n=n: (
                paged_decode_attention(
                    q, kc, vc, slots, block_n=block_n, num_splits=n, check_bounds=False
                )
            )
    out["paged_attention[torch]"] = lambda: paged_attention(q, kc, vc, slots)
    qd = q[:, :, None, :]  # (B, Hq, 1, D)

    def gather_sdpa() -> torch.Tensor:
        s = torch.stack(slots).long()  # (B, T): every request has `context` slots here
        kd = kc[s // ps, s % ps].transpose(1, 2)  # (B, Hkv, T, D)
        vd = vc[s // ps, s % ps].transpose(1, 2)
        return F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True)[:, :, 0]

    out["gather + sdpa"] = gather_sdpa
    # The floor: (B, Hkv, T, D) gathered once, outside the timing.
    s = torch.stack(slots).long()
    kd = kc[s // ps, s % ps].transpose(1, 2).contiguous()
    vd = vc[s // ps, s % ps].transpose(1, 2).contiguous()
    out["sdpa on dense K/V"] = lambda: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True)[
        :, :, 0
    ]
    return out


def check_outputs(fns: dict[str, Callable[[], torch.Tensor]], tol: float) -> float:
    """The largest difference between a kernel call's output and ``gather + sdpa``'s; raises
    when one exceeds ``tol`` (a wrong kernel is not timed)."""
    want = fns["gather + sdpa"]().float()
    worst = 0.0
    for name, fn in fns.items():
        if name.startswith("paged_decode_attention"):
            diff = (fn().float() - want).abs().max().item()
            if not diff <= tol:
                raise RuntimeError(f"{name}: output differs from gather + sdpa by {diff}")
            worst = max(worst, diff)
    return worst


def goals(rows: list[dict], bw_copy: float | None) -> list[str]:
    """The issue's two goals for the decode kernel, read off the rows (CUDA only)."""
    if not bw_copy:
        return []
    lines = []
    kernel = [r for r in rows if r["method"].endswith("(no bounds check)")]
    big = [r for r in kernel if r["batch"] >= 32 and r["context"] == 4096]
    if big:
        worst = min(big, key=lambda r: r["fraction_of_copy_bw"])
        lines.append(
            f"goal: >= 70% of copy bandwidth at batch >= 32, context 4096: lowest "
            f"{worst['fraction_of_copy_bw']:.0%} ({worst['layout']}, page {worst['page_size']}, "
            f"{worst['slots']} slots, batch {worst['batch']}) -> "
            + ("met" if worst["fraction_of_copy_bw"] >= 0.7 else "NOT met")
        )
    key = ("batch", "context", "layout", "page_size", "slots")
    by = {(*(r[k] for k in key), r["method"]): r for r in rows}
    slower = [
        r for r in kernel if r["time_s"] > by[(*(r[k] for k in key), "gather + sdpa")]["time_s"]
    ]
    lines.append(
        f"goal: never slower than gather + sdpa: slower in {len(slower)} of {len(kernel)} rows"
        + "".join(
            f"\n  batch {r['batch']} x {r['context']} {r['layout']} page {r['page_size']} "
            f"{r['slots']}: {r['time_s'] * 1e6:.1f} us"
            for r in slower
        )
    )
    return lines


def main(args: argparse.Namespace) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.interpreter and device.type != "cpu":
        raise SystemExit("--interpreter is for the CPU")
    backend = paged_decode_backend(device)
    cuda = device.type == "cuda"
    batches = args.batches or (
        [1, 8, 32, 128] if cuda else [1, 2] if args.interpreter else [1, 8, 32]
    )
    contexts = args.contexts or (
        [512, 4096] if cuda else [16, 64] if args.interpreter else [128, 1024]
    )
    layouts = args.layouts or (["LayerFirst", "PageFirst"] if cuda else ["LayerFirst"])
    heads, dim = (int(x) for x in args.heads.lower().split("x"))
    dtype = getattr(torch, args.dtype)
    tol = {torch.float32: 1e-4}.get(dtype, 3e-2)
    torch.manual_seed(0)
    bw_copy = copy_bandwidth(device)
    label = device_label(device)
    sms = label.get("gpu_multiprocessors", 1)
    print(
        f"# device: {device} ({label['device_name']}); torch {label['torch']}, triton {label['triton']}"
        f"; commit {label['commit']}"
    )
    print(f"# paged_decode_attention backend here: {backend}")
    if bw_copy:
        print(f"# device-to-device copy bandwidth: {bw_copy / 1e9:.1f} GB/s")
    print(
        f"{'layout':<10} {'ps':>3} {'slots':<6} {'batch':>5} {'context':>7} {'splits':>6}  "
        f"{'method':<52} {'time us':>10} {'GB/s':>8}" + ("  %copy  wall us" if bw_copy else "")
    )

    rows: list[dict] = []
    result = dict(
        benchmark="paged_decode",
        **label,
        paged_decode_backend=backend,
        interpreter=bool(args.interpreter),
        copy_bandwidth_Bps=bw_copy,
        block_n=args.block_n,
        slot_distributions={
            "random": "random distinct slots of the pool (torch.randperm)",
            "pages": "whole random pages, filled in order (the last one cut)",
        },
        complete=False,
        rows=rows,
    )
    out_name = f"paged_decode-{device.type}"
    sweep_at = {tuple(int(x) for x in bt.lower().split("x")) for bt in args.sweep_at}
    # The most telling cases first, so that a run stopped by its timeout still holds them:
    # random slots (the first record's case) before whole pages, the largest page size first.
    cases = sorted(
        (
            (layout_name, ps, how)
            for layout_name in layouts
            for ps in args.page_sizes
            for how in args.slots
            if not (how == "pages" and ps == 1)  # pages of one slot: the same as random
        ),
        key=lambda case: (case[2] != "random", -case[1]),
    )
    for layout_name, ps, how in cases:
        layout = KVCacheLayout[layout_name]
        for context in contexts:
            for batch in batches:
                tokens = batch * context
                num_pages = -(-2 * tokens // ps)
                pool = MHAKVCache(heads, 1, dim, num_pages, dtype, layout, device, page_size=ps)
                slots = request_slots(pool, batch, context, how, device)
                flat = torch.cat(slots)
                k = torch.randn(tokens, heads, dim, device=device).to(dtype)
                pool.store_kv(k, torch.randn_like(k), flat, 0)
                del k, flat
                q = torch.randn(batch, heads * args.group, dim, device=device).to(dtype)
                sweep = (
                    args.splits_sweep
                    if (layout_name, ps, how) == (layouts[0], max(args.page_sizes), "random")
                    and (batch, context) in sweep_at
                    else []
                )
                fns = methods(pool, q, slots, args.block_n, backend, sweep)
                max_diff = check_outputs(fns, tol) if backend != "torch" else None
                chosen = decode_launch_shape(
                    batch,
                    heads,
                    args.group,
                    dim,
                    context,
                    block_n=args.block_n,
                    num_sms=sms if cuda else 1,
                )["NUM_SPLITS"]
                moved = 2 * tokens * heads * dim * q.element_size()
                for name, fn in fns.items():
                    t = time_fn(fn, device, args.min_run_time)
                    row = dict(
                        batch=batch,
                        context=context,
                        heads=heads,
                        head_dim=dim,
                        group=args.group,
                        dtype=args.dtype,
                        page_size=ps,
                        layout=layout_name,
                        slots=how,
                        method=name,
                        time_s=t,
                        bytes=moved,
                        bandwidth_Bps=moved / t,
                    )
                    if name.startswith("paged_decode_attention"):
                        row["num_splits"] = (
                            int(name.split("num_splits=")[1][:-1])
                            if "num_splits=" in name
                            else chosen
                        )
                        row["max_abs_diff_vs_gather_sdpa"] = max_diff
                    if bw_copy:
                        row["fraction_of_copy_bw"] = moved / t / bw_copy
                        if t < 1e-3:
                            row["wall_s"] = wall_time(fn, device, WALL_CALLS)
                    rows.append(row)
                    line = (
                        f"{layout_name:<10} {ps:>3} {how:<6} {batch:>5} {context:>7} "
                        f"{row.get('num_splits', ''):>6}  {name:<52} {t * 1e6:>10.1f} "
                        f"{moved / t / 1e9:>8.2f}"
                    )
                    if bw_copy:
                        wall = row.get("wall_s")
                        line += f"  {row['fraction_of_copy_bw']:>5.1%}" + (
                            f" {wall * 1e6:>8.1f}" if wall else ""
                        )
                    print(line, flush=True)
                del pool, fns
                write_json(result, args.out, out_name, quiet=True)

    result["complete"] = True
    for line in goals(rows, bw_copy):
        print("#", line)
    write_json(result, args.out, out_name)
    return result


if __name__ == "__main__":
    main(ARGS)
