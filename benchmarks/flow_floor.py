"""How low `RequestFlow`'s cost could go: its essential work written inline, against the flow.

`radix_ops` prints "whole flow / manager calls" for the mixed workload. This runs the same
jobs three ways, same run, CPU time of the thread, fastest of ``--repeats``:
- ``manager``: the radix manager's calls alone, recorded from the flow and replayed, less the
  replay loop's own time (as `radix_ops.run` measures it);
- ``flow``: `radix_ops.drive` through `RequestFlow` with the bare manager;
- ``floor``: the same manager calls and allocator calls that the flow makes, written out in one
  loop with nothing else: no `Request` objects, no checks, no stats, no events. It is what any
  flow built on these calls must do (the ids and slots as NumPy, handed to the manager as tensor
  views, the tokens copied once, the pages allocated, the new slots returned as a tensor), so
  its ratio is a floor for the flow's.

It must make the flow's cache decisions (the same reused tokens), or the comparison is void.

With ``--parts`` it also prices the floor per request: each call it makes (tensor <-> NumPy,
host arrays, copies, allocator calls), counted in one run and timed on its own with arguments of
the run's median size; what is left of the floor beyond those and the manager is its own loop.

Run: ``python benchmarks/flow_floor.py [--page-size P] [--requests N] [--repeats R] [--parts]``.
"""

from __future__ import annotations

import argparse
import sys
import time
import timeit
from collections.abc import Callable
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
        a.free_page_runs(m.evict((pages - a.num_free_pages) * ps))


def floor_drive(m: RadixCacheManager, a: PageAllocator, jobs: list[Job]) -> int:
    """`radix_ops.drive`'s requests with the flow's manager and allocator calls and nothing else
    (begin with ``compute_last=True``, extend by the output, finish). Returns the reused tokens."""
    ps, empty, from_numpy = a.page_size, np.empty, torch.from_numpy
    reused = 0
    for job in jobs:
        ids = job.prompt.numpy()
        n = len(ids)
        handle, prefix = m.match_and_lock(from_numpy(ids[:-1]))
        cached = handle.cached_len
        cap = n + 16 + (n >> 2) + ps
        own_ids, slots = empty(cap, _I64), empty(cap, _I32)
        k = -(-(n - cached) // ps)
        _room(m, a, k, ps)
        a.allocate_page_slots(k, slots, cached)
        filled = cached + k * ps
        own_ids[:n] = ids
        if cached:
            slots[:cached] = prefix.numpy()
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
        res = m.insert_and_unlock(handle, from_numpy(own_ids[:whole]), from_numpy(slots[:whole]))
        already = res.cached_len
        if already > cached:
            dup = slots[cached:already]
            a.free_page_runs(dup if whole == length else np.concatenate([dup, slots[whole:length]]))
        elif whole < length:
            a.free_page_runs(slots[whole:length])
    return reused


class _Counting(PageAllocator):
    """A `PageAllocator` that counts the flow's calls to it and notes their sizes."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        super().__init__(num_pages, page_size)
        self.seen: dict[str, list[int]] = {"allocate": [], "free_runs": []}

    def allocate_page_slots(self, num_pages: int, out: np.ndarray, start: int = 0) -> None:
        self.seen["allocate"].append(num_pages)
        super().allocate_page_slots(num_pages, out, start)

    def free_page_runs(self, slots: torch.Tensor | np.ndarray) -> None:
        self.seen["free_runs"].append(-(-len(slots) // self.page_size))
        super().free_page_runs(slots)


def _us(
    stmt: Callable[[], object], setup: Callable[[], object] | None = None, n: int = 500
) -> float:
    """Microseconds per call of ``stmt``, fastest of 5 runs of ``n`` (``setup`` before each run)."""
    best = float("inf")
    for _ in range(5):
        if setup is not None:
            setup()
        best = min(best, timeit.timeit(stmt, number=n) / n)
    return best * 1e6


def parts(jobs: list[Job], ps: int, num_slots: int) -> dict[str, tuple[float, float]]:
    """``name -> (calls per request, µs per call)`` for each call `floor_drive` makes besides the
    manager's: counted in one run, timed on their own at the run's median sizes."""
    a = _Counting(num_slots // ps, ps)
    floor_drive(RadixCacheManager(page_size=ps), a, jobs)
    # Timed below with what they are handed (the lambda and iterator around each add ~0.1 µs).
    r = len(jobs)
    n = int(np.median([len(j.prompt) for j in jobs]))
    k_new = int(np.median([len(j.output) for j in jobs]))
    med = {key: int(np.median(v)) if v else 1 for key, v in a.seen.items()}
    with_output = sum(len(j.output) > 0 for j in jobs) / r
    prompt, out = torch.arange(n), np.empty(n + 64, _I32)
    ids, own = prompt.numpy(), np.empty(n + 64, _I64)
    state: dict[str, object] = {}

    def handed_out(pages: int) -> None:
        """A fresh allocator with every page handed out, and its slots in runs of ``pages``."""
        alloc = PageAllocator(num_slots // ps, ps)
        slots = alloc.allocate_slots(alloc.num_slots).numpy()
        state["a"] = alloc
        state["runs"] = iter([slots[i : i + pages * ps] for i in range(0, len(slots), pages * ps)])

    def fresh() -> None:
        state["a"] = PageAllocator(num_slots // ps, ps)

    kk, kr, most = med["allocate"], med["free_runs"], num_slots // ps
    room = np.empty(kk * ps, _I32)
    calls = {key: len(v) / r for key, v in a.seen.items()}

    def allocate() -> None:
        state["a"].allocate_page_slots(kk, room)  # type: ignore[attr-defined]

    def free_runs() -> None:
        state["a"].free_page_runs(next(state["runs"]))  # type: ignore[attr-defined, call-overload]

    return {
        "tensor.numpy()": (2 + with_output, _us(prompt.numpy, n=5000)),
        "torch.from_numpy": (3 + with_output, _us(lambda: torch.from_numpy(out[:k_new]), n=5000)),
        "np.empty": (2.0, _us(lambda: np.empty(n + 64, _I64), n=5000)),
        "copies (ids, prefix, output)": (
            2 + with_output,
            _us(lambda: own.__setitem__(slice(0, n), ids), n=5000),
        ),
        f"allocate_page_slots ({kk} pages)": (
            calls["allocate"],
            _us(allocate, fresh, n=min(500, most // kk)),
        ),
        f"free_page_runs ({kr} pages)": (
            calls["free_runs"],
            _us(free_runs, lambda: handed_out(kr), n=min(500, most // kr)),
        ),
    }


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--pages", type=int, default=100_000, help="pool size in token slots")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--parts", action="store_true", help="price the floor's calls per request")
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
    result = {
        **{f"{k}_seconds": v for k, v in best.items()},
        "flow_ratio": best["flow"] / best["manager"],
        "floor_ratio": best["floor"] / best["manager"],
    }
    if args.parts:
        per = 1e6 / len(jobs)
        print(
            f"per request (µs): manager calls {best['manager'] * per:.1f}, floor {best['floor'] * per:.1f}"
        )
        total = 0.0
        for name, (calls, us) in parts(jobs, ps, args.pages).items():
            total += calls * us
            print(f"  {name:34s} {calls:5.2f} calls x {us:5.2f} µs = {calls * us:5.2f} µs")
        rest = (best["floor"] - best["manager"]) * per - total
        print(
            f"  {'those calls together':34s} {total:25.2f} µs; the floor's own loop: {rest:.2f} µs"
        )
        result["parts_us_per_request"] = total
    return result


if __name__ == "__main__":
    main()
