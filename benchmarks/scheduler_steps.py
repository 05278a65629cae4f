"""Scheduler bookkeeping speed: steps per second on a 2,000-request workload, and the manager's share.

A seeded mixed workload (system prompts, few-shot, multi-turn chat, branching, one-offs) is
submitted at once and served to the end by `Scheduler` over `RequestFlow` and a
`RadixCacheManager`, with no model: this measures only what the host does per step (queues,
admission, chunking, preemption, the flow's page bookkeeping and the manager's calls). The
manager is wrapped in `TimedManager` and the flow's public calls are timed too, so the run
splits each step into the manager's share (``match_prefix``, ``lock_handle``, ``insert_prefix``,
``evict``), the rest of the flow (allocator, ``extend``, ``cache``...) and the scheduler's own
queues and batch building.
Both admission policies run in the same process, and the ratio of their step rates is printed.

Run: ``python benchmarks/scheduler_steps.py [--requests N] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvcache import PageAllocator, RadixCacheManager, RequestFlow, Scheduler
from kvcache.serving.workloads import Job, TimedManager, mixed

PAGE_SIZE = 16
NUM_PAGES = 2048  # 32,768 token slots: small enough that the run evicts and preempts
TOKEN_BUDGET = 2048
MAX_BATCH = 128


class TimedFlow(RequestFlow):
    """A `RequestFlow` that adds up the wall time of its public calls (manager calls included)."""

    seconds = 0.0

    def _timed(name: str):
        def call(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return getattr(RequestFlow, name)(self, *args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        return call

    for _name in (
        "begin",
        "extend",
        "mark_computed",
        "cache",
        "finish",
        "abort",
        "available_pages",
    ):
        locals()[_name] = _timed(_name)
    del _name, _timed


def serve(jobs: list[Job], policy: str) -> dict[str, float]:
    """Serve ``jobs`` to the end; wall seconds of the run and of the manager's calls."""
    manager = TimedManager(RadixCacheManager(page_size=PAGE_SIZE))
    flow = TimedFlow(manager, PageAllocator(NUM_PAGES, PAGE_SIZE))
    sched = Scheduler(flow, token_budget=TOKEN_BUDGET, max_batch=MAX_BATCH, policy=policy)
    for job in jobs:
        out = job.output if len(job.output) else torch.zeros(1, dtype=torch.int64)
        sched.submit(job.prompt, len(out), forced=out)
    t0 = time.perf_counter()
    report = sched.run()
    wall = time.perf_counter() - t0
    flow.check_integrity()
    return {
        "steps": report.steps,
        "wall_s": wall,
        "manager_s": manager.total_seconds,
        "steps_per_s": report.steps / wall,
        "us_per_step": 1e6 * wall / report.steps,
        "manager_share": manager.total_seconds / wall,
        "flow_share": flow.seconds / wall,
        "preemptions": report.preemptions,
        "hit_rate": report.hit_rate,
        "simulated_throughput": report.throughput,
    }


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    jobs = mixed(args.requests, seed=0)
    print(
        f"{platform.processor() or platform.machine()}, Python {platform.python_version()}, "
        f"torch {torch.__version__}; {len(jobs)} requests, pool {NUM_PAGES} x {PAGE_SIZE} slots, "
        f"budget {TOKEN_BUDGET}, batch {MAX_BATCH}"
    )
    results = {policy: serve(jobs, policy) for policy in ("fcfs", "lpm")}
    for policy, r in results.items():
        print(
            f"{policy:4}: {r['steps']:5} steps in {r['wall_s']:.2f} s = {r['steps_per_s']:,.0f} steps/s "
            f"({r['us_per_step']:,.0f} us/step); {r['preemptions']} preemptions, "
            f"hit rate {r['hit_rate']:.1%}"
        )
        own = 1 - r["flow_share"]
        print(
            f"      of each step: manager {100 * r['manager_share']:.0f} %, rest of the flow "
            f"(allocator, extend, cache) {100 * (r['flow_share'] - r['manager_share']):.0f} %, "
            f"scheduler's own queues and batch {100 * own:.0f} %"
        )
    ratio = results["fcfs"]["us_per_step"] / results["lpm"]["us_per_step"]
    print(f"per-step cost, FCFS / LPM: {ratio:.2f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
