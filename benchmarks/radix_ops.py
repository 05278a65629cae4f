"""Prefix-cache manager speed: RadixCacheManager against the source document's design, same run.

1. Throughput: a seeded shared-prefix workload (system prompts of a few hundred tokens,
   few-shot tasks, multi-turn chats, branching prompts, random one-offs) driven through
   `RequestFlow` with a pool small enough that eviction happens, once per manager. Reported
   twice: for the whole flow (allocator and request bookkeeping included, the same code for
   both managers) and for the time spent inside the manager's own calls.
2. Evict scaling: the time of ``evict`` of one leaf on trees of 1,000 and 100,000 leaves.

Run: ``python benchmarks/radix_ops.py [--requests N] [--json PATH]``. Prints what it ran on.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from source_radix import SourceRadixCacheManager  # noqa: E402

from kvcache import PageAllocator, RadixCacheManager, RequestFlow  # noqa: E402
from kvcache import BaseCacheManager  # noqa: E402
from kvcache.serving.workloads import TimedManager, mixed, replay  # noqa: E402

MANAGERS: Dict[str, Callable[[], BaseCacheManager]] = {
    "source design": SourceRadixCacheManager,
    "RadixCacheManager": RadixCacheManager,
}


def machine() -> Dict[str, str]:
    return {"cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
            "torch": torch.__version__, "threads": str(torch.get_num_threads()),
            "date": time.strftime("%Y-%m-%d")}


def throughput(num_requests: int, num_pages: int, repeats: int) -> Dict[str, Dict[str, float]]:
    """Best of ``repeats`` runs: the whole flow's time, and the time inside manager calls."""
    jobs = mixed(num_requests, seed=0)
    tokens = sum(len(j.prompt) + len(j.output) for j in jobs)
    out: Dict[str, Dict[str, float]] = {}
    for name, make in MANAGERS.items():
        flow_s, manager_s = [], []
        for _ in range(repeats):
            timed = TimedManager(make())
            flow = RequestFlow(timed, PageAllocator(num_pages))  # type: ignore[arg-type]
            t0 = time.perf_counter()
            replay(flow, jobs)
            flow_s.append(time.perf_counter() - t0)
            manager_s.append(timed.total_seconds)
        out[name] = {"flow_seconds": min(flow_s), "manager_seconds": min(manager_s),
                     "requests_per_s": num_requests / min(flow_s),
                     "manager_requests_per_s": num_requests / min(manager_s),
                     "tokens_per_s": tokens / min(flow_s),
                     "reused_tokens": flow.stats.reused_tokens, "evicted_tokens": flow.stats.evicted_tokens,
                     "evictions": flow.stats.evictions}
    return out


def evict_one_leaf(num_leaves: int, make: Callable[[], BaseCacheManager], calls: int) -> float:
    """Median seconds of ``evict(1)`` on a tree of ``num_leaves`` one-token leaves under 256 parents."""
    m = make()
    parents = 256
    for i in range(num_leaves):
        m.insert_prefix(torch.tensor([i % parents, 1000 + i // parents]),
                        torch.tensor([2 * i, 2 * i + 1], dtype=torch.int32))
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        m.evict(1)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def block_hash_rows(num_requests: int, pool_tokens: int) -> Dict[str, Dict[str, float]]:
    """`BlockHashCacheManager`'s own lines (page sizes 1 and 16): see benchmarks/block_hash_vs_vllm.py."""
    from block_hash_vs_vllm import print_radix_ops_rows, radix_ops_rows

    rows = radix_ops_rows(num_requests, pool_tokens)
    print_radix_ops_rows(rows)
    return rows


def main(argv: List[str] | None = None) -> Dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--pages", type=int, default=100_000, help="pool size in tokens (page_size 1)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    # Bookkeeping tensors are tiny: one thread avoids thread-pool wake-ups on every op.
    torch.set_num_threads(1)

    info = machine()
    print(f"ran on: {info}")
    tp = throughput(args.requests, args.pages, args.repeats)
    base, ours = tp["source design"], tp["RadixCacheManager"]
    if base["reused_tokens"] != ours["reused_tokens"]:
        raise SystemExit("both managers must cache the same prefixes; the comparison is void")
    print(f"\nworkload: {args.requests} mixed requests through RequestFlow, pool of {args.pages} token slots "
          f"({ours['evictions']} evict calls, {ours['evicted_tokens']} tokens evicted, "
          f"{ours['reused_tokens']} reused)")
    print(f"  {'':18s} {'whole flow':>14s} {'manager calls only':>20s}")
    for name, r in tp.items():
        print(f"  {name:18s} {r['requests_per_s']:8.0f} req/s {r['manager_requests_per_s']:14.0f} req/s")
    ratio = ours["requests_per_s"] / base["requests_per_s"]
    manager_ratio = ours["manager_requests_per_s"] / base["manager_requests_per_s"]
    print(f"  {'speed-up':18s} {ratio:12.1f}x {manager_ratio:18.1f}x")
    block_hash = block_hash_rows(args.requests, args.pages)  # block-hash manager, page sizes 1 and 16

    ev = {}
    for n, calls in ((1_000, 200), (100_000, 200)):
        ev[n] = evict_one_leaf(n, RadixCacheManager, calls)
    ev_base = {n: evict_one_leaf(n, SourceRadixCacheManager, 5 if n > 10_000 else 50) for n in (1_000, 100_000)}
    print("\nevict(1), median seconds per call:")
    for n in ev:
        print(f"  {n:>7,} leaves: RadixCacheManager {ev[n] * 1e6:8.1f} µs   source design {ev_base[n] * 1e6:10.1f} µs")
    scale = ev[100_000] / ev[1_000]
    print(f"  RadixCacheManager 100k / 1k leaves: {scale:.2f}x (source design: {ev_base[100_000] / ev_base[1_000]:.0f}x)")

    result = {"machine": info, "throughput": tp, "block_hash": block_hash, "speedup": ratio, "manager_speedup": manager_ratio,
              "evict_seconds": {str(k): v for k, v in ev.items()},
              "evict_seconds_source": {str(k): v for k, v in ev_base.items()}, "evict_scaling": scale}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
