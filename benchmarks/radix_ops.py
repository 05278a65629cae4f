"""Prefix-cache manager speed: RadixCacheManager against the source document's design, same run.

1. Throughput: a seeded shared-prefix workload (system prompts of a few hundred tokens,
   few-shot tasks, multi-turn chats, branching prompts, random one-offs) driven through
   `RequestFlow` with a pool small enough that eviction happens, once per manager, at
   ``--page-size``. Reported twice: for the whole flow (allocator and request bookkeeping
   included, the same code for every manager) and for the time spent inside the manager's own
   calls.
   Times are CPU seconds of the thread (robust on a shared machine). The flow's: the flow's
   calls for every job (`drive`; `replay`'s per-request samples left out). The manager's: its
   calls alone, recorded from the flow and replayed without a timer around each call, less the
   replay loop's own time (the same calls answered at once by a stub), which is reported too.
2. Traces (``--traces``): three request shapes a server sees, each at page sizes 1 and 16 —
   chat (880 requests, 110 conversations of 8 turns), few-shot (800 requests on 2-8k-token
   shared prefixes) and agent (800 branching multi-turn requests) — the time inside manager
   calls for `RadixCacheManager`, the source design (page size 1 only), its page-aware
   variant and a stand-in for SGLang's radix cache (``kvcache.examples.sglang_standin``), and the whole
   flow against the manager calls. Every manager must make the same cache decisions (reused and
   evicted tokens), or the comparison is void. Prints, per trace and page size,
   ``RadixCacheManager vs SGLang-style stand-in: N.Nx`` (the stand-in's time over ours; also
   under ``sglang_ratio`` in the JSON).
3. Evict scaling: the time of ``evict`` of one leaf on trees of 1,000 and 100,000 leaves.

Run: ``python benchmarks/radix_ops.py [--page-size P] [--requests N] [--traces] [--json PATH]``.
Prints what it ran on.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import machine, write_json

from kvcache import (
    BaseCacheManager,
    BlockHashCacheManager,
    PageAllocator,
    RadixCacheManager,
    RequestFlow,
    SizeInfo,
)
from kvcache.examples.sglang_standin import SglangStandIn
from kvcache.examples.source_radix import PagedSourceRadixCacheManager, SourceRadixCacheManager
from kvcache.managers.base import InsertResult
from kvcache.serving.workloads import Job, agent, long_few_shot, mixed, multi_turn_chat, replay

# name -> factory(page_size); None where the manager has no such page size.
MANAGERS: dict[str, Callable[[int], BaseCacheManager | None]] = {
    "source design": lambda ps: SourceRadixCacheManager() if ps == 1 else None,
    "page-aware source": lambda ps: PagedSourceRadixCacheManager(page_size=ps),
    "SGLang-style stand-in": lambda ps: SglangStandIn(page_size=ps),
    "RadixCacheManager": lambda ps: RadixCacheManager(page_size=ps),
}

SGLANG = "SGLang-style stand-in"

# name -> (jobs, pool size in tokens: small enough that every trace evicts)
TRACES: dict[str, Callable[[], tuple]] = {
    "chat": lambda: (multi_turn_chat(110, 8, seed=0), 40_000),
    "few-shot": lambda: (long_few_shot(800, seed=0), 60_000),
    "agent": lambda: (agent(800, seed=0), 60_000),
}


def _recorded(name: str) -> Callable[..., Any]:
    def call(self: RecordedCalls, *args: Any, **kwargs: Any) -> Any:
        return self.call(name, *args, **kwargs)

    call.__name__ = name
    return call


class RecordedCalls(BaseCacheManager):
    """Forwards everything to ``manager`` and records its public calls, to replay them later.

    The manager's time is then measured by `replay_calls` alone, with no timer around each call
    (a timer call costs about as much as a small manager call on a busy machine) and in CPU
    time of the thread, which a machine shared with other jobs does not inflate. A manager
    subclass itself, forwarding the fused calls (`match_and_lock`, `insert_and_unlock`) that the
    flow makes: the same calls it makes on the bare manager, replayed as such (a manager without
    fused calls of its own answers them with the base class's defaults, as it does bare).
    """

    def __init__(self, manager: BaseCacheManager) -> None:
        self.manager = manager
        self.calls: list[tuple] = []  # (method, args) with handles as ("handle", call number)
        # id(handle) -> (the handle, its call number): kept alive, so that no later argument
        # can reuse the id of a handle that was freed and be replayed as that handle.
        self._handles: dict[int, tuple[object, int]] = {}

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self.manager.device

    @property
    def page_size(self) -> int:  # type: ignore[override]
        return self.manager.page_size

    @property
    def size_info(self) -> SizeInfo:
        return self.manager.size_info

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        saved = [
            ("handle", self._handles[id(a)][1])
            if id(a) in self._handles
            else a.clone()
            if isinstance(a, torch.Tensor)
            else a.copy()
            if isinstance(a, np.ndarray)
            else a
            for a in args
        ]
        out = getattr(self.manager, name)(*args, **kwargs)
        handle = out[0] if name in _MATCHES else getattr(out, "handle", None)
        if handle is not None:
            self._handles[id(handle)] = (handle, len(self.calls))
        self.calls.append((name, saved, kwargs))
        return out

    match_prefix = _recorded("match_prefix")
    lock_handle = _recorded("lock_handle")
    insert_prefix = _recorded("insert_prefix")
    insert_and_match = _recorded("insert_and_match")
    match_and_lock = _recorded("match_and_lock")
    insert_and_unlock = _recorded("insert_and_unlock")
    evict = _recorded("evict")
    reset = _recorded("reset")
    check_integrity = _recorded("check_integrity")
    cached_indices = _recorded("cached_indices")
    handle_indices = _recorded("handle_indices")


def record(manager: BaseCacheManager) -> RecordedCalls:
    """A recorder through which the flow makes the calls it would make on ``manager``."""
    return RecordedCalls(manager)


_MATCHES = ("match_prefix", "match_and_lock")


def replay_calls(calls: list[tuple], manager: BaseCacheManager) -> float:
    """CPU seconds of the thread to make ``calls`` (from `RecordedCalls`) on ``manager``."""
    handles: dict[int, object] = {}
    t0 = time.thread_time()
    for k, (name, args, kwargs) in enumerate(calls):
        out = getattr(manager, name)(
            *[handles[a[1]] if type(a) is tuple else a for a in args], **kwargs
        )
        if name in _MATCHES:
            handles[k] = out[0]
        elif name in _INSERTS:
            handles[k] = out.handle
    return time.thread_time() - t0


_INSERTS = ("insert_and_match", "insert_and_unlock")


class _Stub:
    """Answers every recorded call at once: replaying on it measures `replay_calls`' own loop
    (argument lookup, dispatch, keeping handles), which `run` subtracts from the manager's time."""

    def __getattr__(self, name: str) -> Callable[..., Any]:
        out = (None, None) if name in _MATCHES else InsertResult(0, None)  # type: ignore[arg-type]
        method = lambda *args, **kwargs: out  # noqa: E731
        setattr(self, name, method)  # found without __getattr__ from the second call on
        return method


class _StubFlow:
    """Answers `drive`'s calls at once: driving it measures `drive`'s own loop (the jobs'
    attributes, the calls themselves), reported beside the flow's time as
    ``driver_overhead_seconds`` (counted in ``flow_seconds``, not subtracted from it)."""

    def begin(self, input_ids: torch.Tensor, **kwargs: Any) -> None:
        return None

    def mark_computed(self, req: Any) -> None:
        return None

    def extend(self, req: Any, new_ids: torch.Tensor) -> None:
        return None

    def finish(self, req: Any) -> None:
        return None


def drive(flow: RequestFlow, jobs: list[Job]) -> None:
    """The calls `replay` makes on ``flow`` for each job (begin with ``compute_last=True``, store,
    decode, store, finish), without its per-request `Sample` bookkeeping, which is the
    workload's, not the flow's: the manager calls the flow makes here are those `run` records
    through `replay` and times on their own."""
    for job in jobs:
        req = flow.begin(job.prompt, compute_last=True)
        flow.mark_computed(req)
        if job.output.shape[0]:
            flow.extend(req, job.output)
            flow.mark_computed(req)
        flow.finish(req)


def run(
    jobs: list[Job],
    make: Callable[[], BaseCacheManager],
    num_slots: int,
    page_size: int,
    repeats: int,
) -> dict[str, float]:
    """Best of ``repeats``: CPU seconds of the whole flow, and of the manager's calls alone.

    The flow runs with the bare manager (`drive`); its manager calls are recorded in one more
    run and replayed on a fresh manager for the manager's time (`replay_calls`), less the
    replay loop's own time (the same calls answered by `_Stub`: ``replay_overhead_seconds``).
    """
    flow_s, manager_s, stub_s, driver_s = [], [], [], []
    recorder = record(make())
    replay(RequestFlow(recorder, PageAllocator(num_slots // page_size, page_size)), jobs)
    for _ in range(repeats):
        flow = RequestFlow(make(), PageAllocator(num_slots // page_size, page_size))
        t0 = time.thread_time()
        drive(flow, jobs)
        flow_s.append(time.thread_time() - t0)
        manager_s.append(replay_calls(recorder.calls, make()))
        stub_s.append(replay_calls(recorder.calls, _Stub()))  # type: ignore[arg-type]
        t0 = time.thread_time()
        drive(_StubFlow(), jobs)  # type: ignore[arg-type]
        driver_s.append(time.thread_time() - t0)
    n, overhead = len(jobs), min(stub_s)
    manager = min(manager_s) - overhead
    return {
        "flow_seconds": min(flow_s),
        "manager_seconds": manager,
        "manager_seconds_with_replay": min(manager_s),
        "replay_overhead_seconds": overhead,
        "driver_overhead_seconds": min(driver_s),
        "requests_per_s": n / min(flow_s),
        "manager_requests_per_s": n / manager,
        "reused_tokens": flow.stats.reused_tokens,
        "evicted_tokens": flow.stats.evicted_tokens,
        "evictions": flow.stats.evictions,
    }


def throughput(
    num_requests: int, num_slots: int, repeats: int, page_size: int = 1
) -> dict[str, dict[str, float]]:
    """The mixed workload through every manager that has ``page_size``."""
    jobs = mixed(num_requests, seed=0)
    tokens = sum(len(j.prompt) + len(j.output) for j in jobs)
    out: dict[str, dict[str, float]] = {}
    for name, make in MANAGERS.items():
        if make(page_size) is None:
            continue
        r = run(jobs, partial(make, page_size), num_slots, page_size, repeats)  # type: ignore[arg-type, return-value]
        r["tokens_per_s"] = tokens / r["flow_seconds"]
        out[name] = r
    return out


def traces(
    page_sizes: list[int], repeats: int
) -> dict[str, dict[str, dict[str, dict[str, float]]]]:
    """``result[trace][page_size][manager]``, each as `run` returns it."""
    out: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    for trace, build in TRACES.items():
        jobs, num_slots = build()
        out[trace] = {}
        for ps in page_sizes:
            res = {
                name: run(jobs, partial(make, ps), num_slots, ps, repeats)  # type: ignore[arg-type, return-value]
                for name, make in MANAGERS.items()
                if make(ps) is not None
            }
            decisions = {(r["reused_tokens"], r["evicted_tokens"]) for r in res.values()}
            if len(decisions) != 1:
                raise SystemExit(
                    f"{trace}, page size {ps}: managers made different cache decisions {res}"
                )
            out[trace][str(ps)] = res
    return out


def evict_one_leaf(num_leaves: int, make: Callable[[], BaseCacheManager], calls: int) -> float:
    """Median CPU seconds of ``evict(1)`` on a tree of ``num_leaves`` one-token leaves under 256 parents.

    Each sample times up to 20 calls in a row (a CPU-clock read costs about as much as a call)."""
    m = make()
    parents = 256
    for i in range(num_leaves):
        m.insert_prefix(
            torch.tensor([i % parents, 1000 + i // parents]),
            torch.tensor([2 * i, 2 * i + 1], dtype=torch.int32),
        )
    group = min(20, calls)
    times = []
    for _ in range(max(1, calls // group)):
        t0 = time.thread_time()
        for _ in range(group):
            m.evict(1)
        times.append((time.thread_time() - t0) / group)
    return statistics.median(times)


def block_hash_rows(
    num_requests: int, num_slots: int, repeats: int, page_sizes: tuple[int, ...] = (1, 16)
) -> dict[str, dict[str, float]]:
    """`BlockHashCacheManager` on the mixed workload, measured as `run` measures every manager,
    one row per page size (``page_size_<P>``). It makes its own cache decisions (whole blocks,
    its own eviction order), so its reuse is printed beside its times, not compared."""
    jobs = mixed(num_requests, seed=0)
    return {
        f"page_size_{ps}": run(
            jobs, partial(BlockHashCacheManager, "cpu", ps), num_slots, ps, repeats
        )
        for ps in page_sizes
    }


def print_traces(tr: dict[str, dict[str, dict[str, dict[str, float]]]]) -> None:
    print(
        "\ntraces: milliseconds inside manager calls (speed-up of RadixCacheManager), and its whole flow"
    )
    for trace, by_ps in tr.items():
        for ps, res in by_ps.items():
            ours = res["RadixCacheManager"]
            cells = [
                f"{name} {r['manager_seconds'] * 1e3:7.1f} ms ({r['manager_seconds'] / ours['manager_seconds']:5.1f}x)"
                for name, r in res.items()
                if name != "RadixCacheManager"
            ]
            print(
                f"  {trace:9s} page {ps:>2s}: ours {ours['manager_seconds'] * 1e3:6.1f} ms | "
                + " | ".join(cells)
                + f" | flow {ours['flow_seconds'] * 1e3:6.1f} ms = {ours['flow_seconds'] / ours['manager_seconds']:.1f}x"
                f" manager ({ours['evictions']} evictions)"
            )


def sglang_ratios(
    tr: dict[str, dict[str, dict[str, dict[str, float]]]],
) -> dict[str, dict[str, float]]:
    """``result[trace][page_size]``: the SGLang-style stand-in's time inside manager calls over
    `RadixCacheManager`'s (above 1: ours is faster), where both ran; printed one line each."""
    out: dict[str, dict[str, float]] = {}
    for trace, by_ps in tr.items():
        for ps, res in by_ps.items():
            if SGLANG in res:
                ratio = res[SGLANG]["manager_seconds"] / res["RadixCacheManager"]["manager_seconds"]
                out.setdefault(trace, {})[ps] = ratio
                print(
                    f"  {trace:9s} page {ps:>2s}: RadixCacheManager vs SGLang-style stand-in: {ratio:.1f}x"
                )
    return out


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--pages", type=int, default=100_000, help="pool size in token slots")
    ap.add_argument(
        "--page-size", type=int, default=1, help="tokens per page for the mixed workload"
    )
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--traces", action="store_true", help="also run the chat, few-shot and agent traces"
    )
    ap.add_argument("--trace-page-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    # Bookkeeping tensors are tiny: one thread avoids thread-pool wake-ups on every op.
    torch.set_num_threads(1)

    info = machine()
    print(f"ran on: {info}")
    ps = args.page_size
    tp = throughput(args.requests, args.pages, args.repeats, ps)
    ours = tp["RadixCacheManager"]
    base = tp["source design"] if "source design" in tp else tp["page-aware source"]
    if any(r["reused_tokens"] != ours["reused_tokens"] for r in tp.values()):
        raise SystemExit("every manager must cache the same prefixes; the comparison is void")
    print(
        f"\nworkload: {args.requests} mixed requests through RequestFlow, pool of {args.pages} token slots, "
        f"page size {ps} ({ours['evictions']} evict calls, {ours['evicted_tokens']} tokens evicted, "
        f"{ours['reused_tokens']} reused)"
    )
    print(f"  {'':21s} {'whole flow':>14s} {'manager calls only':>20s}")
    for name, r in tp.items():
        print(
            f"  {name:21s} {r['requests_per_s']:8.0f} req/s {r['manager_requests_per_s']:14.0f} req/s"
        )
    ratio = ours["requests_per_s"] / base["requests_per_s"]
    manager_ratio = ours["manager_requests_per_s"] / base["manager_requests_per_s"]
    print(f"  {'speed-up':21s} {ratio:12.1f}x {manager_ratio:18.1f}x")
    print(
        f"  RadixCacheManager whole flow / manager calls: {ours['flow_seconds'] / ours['manager_seconds']:.2f}x"
        f" (manager calls: {ours['manager_seconds_with_replay'] * 1e3:.1f} ms replayed, less the "
        f"replay loop's own {ours['replay_overhead_seconds'] * 1e3:.1f} ms measured on a stub; "
        f"the whole flow includes the driving loop's own "
        f"{ours.get('driver_overhead_seconds', 0.0) * 1e3:.1f} ms)"
    )
    block_hash = block_hash_rows(args.requests, args.pages, args.repeats)
    for key, r in block_hash.items():
        print(
            f"  {'BlockHash ' + key.replace('page_size_', 'ps='):21s} {r['requests_per_s']:8.0f} req/s "
            f"{r['manager_requests_per_s']:14.0f} req/s  (flow / manager calls "
            f"{r['flow_seconds'] / r['manager_seconds']:.2f}x, {r['reused_tokens']} reused)"
        )
    if f"page_size_{ps}" in block_hash:
        tp["BlockHashCacheManager"] = block_hash[f"page_size_{ps}"]

    result: dict[str, object] = {
        "machine": info,
        "page_size": ps,
        "throughput": tp,
        "speedup": ratio,
        "manager_speedup": manager_ratio,
    }
    if args.traces:
        tr = traces(args.trace_page_sizes, args.repeats)
        print_traces(tr)
        result["traces"] = tr
        result["sglang_ratio"] = sglang_ratios(tr)

    ev = {n: evict_one_leaf(n, RadixCacheManager, 400) for n in (1_000, 100_000)}
    ev_base = {
        n: evict_one_leaf(n, SourceRadixCacheManager, 5 if n > 10_000 else 100)
        for n in (1_000, 100_000)
    }
    print("\nevict(1), median seconds per call:")
    for n in ev:
        print(
            f"  {n:>7,} leaves: RadixCacheManager {ev[n] * 1e6:8.1f} µs   source design {ev_base[n] * 1e6:10.1f} µs"
        )
    scale = ev[100_000] / ev[1_000]
    print(
        f"  RadixCacheManager 100k / 1k leaves: {scale:.2f}x (source design: {ev_base[100_000] / ev_base[1_000]:.0f}x)"
    )
    result.update(
        {
            "evict_seconds": {str(k): v for k, v in ev.items()},
            "evict_seconds_source": {str(k): v for k, v in ev_base.items()},
            "evict_scaling": scale,
        }
    )
    result["block_hash"] = block_hash
    write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
