"""How low `RequestFlow`'s cost could go: its essential work written inline, against the flow.

`radix_ops` prints "whole flow / manager calls" for the mixed workload. This runs the same
jobs three ways, same run, CPU time of the thread, fastest of ``--repeats``:
- ``manager``: the radix manager's calls alone, recorded from the flow and replayed, less the
  replay loop's own time (as `radix_ops.run` measures it);
- ``flow``: `radix_ops.drive` through `RequestFlow` with the bare manager;
- ``floor``: the same manager calls and allocator calls that the flow makes, written out in one
  loop with nothing else: no `Request` objects, no checks, no stats, no events. It is what any
  flow built on these calls must do (the ids and slots as NumPy, the tokens copied once, the
  pages allocated, the new slots returned as a tensor), so its ratio is a floor for the flow's.

It must make the flow's cache decisions (the same reused tokens), or the comparison is void.

Run: ``python benchmarks/flow_floor.py [--page-size P] [--requests N] [--repeats R]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import radix_ops

from kvcache import PageAllocator, RadixCacheManager, RequestFlow
from kvcache.serving.workloads import Job, mixed

_I64, _I32 = np.dtype(np.int64), np.dtype(np.int32)


def _room(m: RadixCacheManager, a: PageAllocator, pages: int, ps: int) -> None:
    """Evict what ``pages`` new pages need beyond the free ones and give their pages back."""
    if pages > a.num_free_pages:
        a.free_page_runs(m.evict((pages - a.num_free_pages) * ps, host=True))


def floor_drive(m: RadixCacheManager, a: PageAllocator, jobs: list[Job]) -> int:
    """`radix_ops.drive`'s requests with the flow's manager and allocator calls and nothing else
    (begin with ``compute_last=True``, extend by the output, finish). Returns the reused tokens."""
    ps, empty, from_numpy = a.page_size, np.empty, torch.from_numpy
    reused = 0
    for job in jobs:
        ids = job.prompt.numpy()
        n = len(ids)
        handle, prefix = m.match_and_lock(ids[:-1])
        cached = handle.cached_len
        cap = n + 16 + (n >> 2) + ps
        own_ids, slots = empty(cap, _I64), empty(cap, _I32)
        k = -(-(n - cached) // ps)
        _room(m, a, k, ps)
        a.allocate_page_slots(k, slots, cached)
        filled = cached + k * ps
        own_ids[:n] = ids
        if cached:
            slots[:cached] = prefix
        reused += cached
        length = n
        if len(job.output):
            new = job.output.numpy()
            end = length + len(new)
            if end > filled:
                more = -(-(end - filled) // ps)
                _room(m, a, more, ps)
                a.allocate_page_slots(more, slots, filled)
                filled += more * ps
            own_ids[length:end] = new
            from_numpy(slots[length:end])  # `extend` returns the new slots as a tensor
            length = end
        whole = length - length % ps
        already = m.insert_and_unlock(handle, own_ids[:whole], slots[:whole]).cached_len
        if already > cached:
            dup = slots[cached:already]
            a.free_page_runs(dup if whole == length else np.concatenate([dup, slots[whole:length]]))
        elif whole < length:
            a.free_page_start(slots.item(whole))
    return reused


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--pages", type=int, default=100_000, help="pool size in token slots")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    ps, jobs = args.page_size, mixed(args.requests, seed=0)

    def fresh() -> tuple[RadixCacheManager, PageAllocator]:
        return RadixCacheManager(page_size=ps), PageAllocator(args.pages // ps, ps)

    recorder = radix_ops.record(RadixCacheManager(page_size=ps))
    radix_ops.replay(RequestFlow(recorder, PageAllocator(args.pages // ps, ps)), jobs)
    best = dict.fromkeys(("manager", "flow", "floor"), float("inf"))
    for _ in range(args.repeats):
        t0 = time.thread_time()
        reused = floor_drive(*fresh(), jobs)
        best["floor"] = min(best["floor"], time.thread_time() - t0)
        flow = RequestFlow(*fresh())
        t0 = time.thread_time()
        radix_ops.drive(flow, jobs)
        best["flow"] = min(best["flow"], time.thread_time() - t0)
        manager = radix_ops.replay_calls(recorder.calls, RadixCacheManager(page_size=ps))
        stub = radix_ops.replay_calls(recorder.calls, radix_ops._Stub())  # type: ignore[arg-type]
        best["manager"] = min(best["manager"], manager - stub)
    if reused != flow.stats.reused_tokens:
        raise SystemExit(f"floor reused {reused} tokens, the flow {flow.stats.reused_tokens}")
    ms = {k: v * 1e3 for k, v in best.items()}
    print(
        f"page size {ps}, {len(jobs)} mixed requests: manager calls {ms['manager']:.1f} ms | "
        f"whole flow {ms['flow']:.1f} ms = {best['flow'] / best['manager']:.2f}x | "
        f"inline floor {ms['floor']:.1f} ms = {best['floor'] / best['manager']:.2f}x"
    )
    return {
        **{f"{k}_seconds": v for k, v in best.items()},
        "flow_ratio": best["flow"] / best["manager"],
        "floor_ratio": best["floor"] / best["manager"],
    }


if __name__ == "__main__":
    main()
