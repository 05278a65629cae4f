"""Scheduler bookkeeping speed: steps per second on a 2,000-request workload, and the manager's share.

A seeded mixed workload (system prompts, few-shot, multi-turn chat, branching, one-offs) is
submitted at once and served to the end by `Scheduler` over `RequestFlow` and a
`RadixCacheManager`, with no model: this measures only what the host does per step (queues,
admission, chunking, preemption, the flow's page bookkeeping and the manager's calls). The
manager is wrapped in `TimedManager` and the flow's public calls are timed too, so the run
splits each step into the manager's share (``match_prefix``, ``lock_handle``, ``insert_prefix``,
``evict``), the rest of the flow (allocator, ``extend``, ``cache``...) and the scheduler's own
queues and batch building.
FCFS, LPM as SGLang runs it (FCFS while more than 128 requests wait) and LPM matching the whole
queue at every step run in the same process; the ratio of the last to FCFS per step is printed.

Run: ``python benchmarks/scheduler_steps.py [--requests N] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvcache import PageAllocator, RadixCacheManager, RequestFlow, Scheduler
from kvcache.serving.workloads import Job, TimedManager, mixed

PAGE_SIZE = 16
NUM_PAGES = 2048  # 32,768 token slots: small enough that the run evicts and preempts
TOKEN_BUDGET = 2048
MAX_BATCH = 128


class TimedFlow(RequestFlow):
    """A `RequestFlow` that adds up the wall time of its public calls, and the part of it spent
    in its (timed) manager; the scheduler's own calls to the manager (LPM's matches) are not in
    ``seconds``."""

    seconds = 0.0
    manager_seconds = 0.0

    def _timed(name: str):
        def call(self, *args, **kwargs):
            t0, m0 = time.perf_counter(), self.manager.total_seconds
            try:
                return getattr(RequestFlow, name)(self, *args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.manager_seconds += self.manager.total_seconds - m0

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


#: The runs compared: FCFS; LPM as SGLang runs it (FCFS while more than 128 requests wait);
#: LPM matching every waiting request at every step, what that limit avoids.
CONFIGS: dict[str, dict[str, Any]] = {
    "fcfs": {"policy": "fcfs"},
    "lpm": {"policy": "lpm"},
    "lpm, no queue limit": {"policy": "lpm", "lpm_queue_limit": 10**9},
}


def serve(jobs: list[Job], config: dict[str, Any]) -> dict[str, float]:
    """Serve ``jobs`` to the end; wall seconds of the run and of the manager's calls."""
    manager = TimedManager(RadixCacheManager(page_size=PAGE_SIZE))
    flow = TimedFlow(manager, PageAllocator(NUM_PAGES, PAGE_SIZE))
    sched = Scheduler(flow, token_budget=TOKEN_BUDGET, max_batch=MAX_BATCH, **config)
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
        "flow_only_share": (flow.seconds - flow.manager_seconds) / wall,
        "scheduler_share": 1 - (flow.seconds + manager.total_seconds - flow.manager_seconds) / wall,
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
    serve(jobs[:100], CONFIGS["fcfs"])  # warm-up: first-call costs stay out of the figures
    results = {name: serve(jobs, config) for name, config in CONFIGS.items()}
    for name, r in results.items():
        print(
            f"{name}: {r['steps']:5} steps in {r['wall_s']:.2f} s = {r['steps_per_s']:,.0f} steps/s "
            f"({r['us_per_step']:,.0f} us/step); {r['preemptions']} preemptions, "
            f"hit rate {r['hit_rate']:.1%}"
        )
        print(
            f"    of each step: manager {100 * r['manager_share']:.0f} %, rest of the flow "
            f"(allocator, extend, cache) {100 * r['flow_only_share']:.0f} %, "
            f"scheduler's own queues and batch {100 * r['scheduler_share']:.0f} %"
        )
    ratio = results["lpm, no queue limit"]["us_per_step"] / results["fcfs"]["us_per_step"]
    print(f"per-step cost of LPM matching the whole queue / FCFS: {ratio:.2f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
