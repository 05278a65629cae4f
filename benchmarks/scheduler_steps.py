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
Times are the CPU time of the thread (the machine is shared), the fastest of ``--repeats`` runs.

With ``--baseline CHECKOUT`` the package of another checkout (its ``kvcache/``, imported as
``kvcache_baseline``) serves the same jobs in the same process, the two taking turns run by
run, and each row prints both and the ratio this / baseline (below 1: this checkout is faster).

Run: ``python benchmarks/scheduler_steps.py [--requests N] [--repeats R] [--baseline PATH]
[--json PATH]``.
"""

from __future__ import annotations

import argparse
import importlib
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import machine, write_json

import kvcache
from kvcache.serving.workloads import Job, TimedManager, mixed

PAGE_SIZE = 16
NUM_PAGES = 2048  # 32,768 token slots: small enough that the run evicts and preempts
TOKEN_BUDGET = 2048
MAX_BATCH = 128
clock = time.thread_time  # CPU time of this thread: what another process's load leaves alone


def timed_flow(pkg: ModuleType) -> type:
    """A subclass of ``pkg``'s `RequestFlow` that adds up the CPU time of its public calls, and
    the part of it spent in its (timed) manager; the scheduler's own calls to the manager (LPM's
    matches) are not in ``seconds``."""
    base = pkg.RequestFlow

    def timed(name: str) -> Any:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            t0, m0 = clock(), self.manager.total_seconds
            try:
                return getattr(base, name)(self, *args, **kwargs)
            finally:
                self.seconds += clock() - t0
                self.manager_seconds += self.manager.total_seconds - m0

        return call

    names = ("begin", "extend", "mark_computed", "cache", "finish", "abort", "available_pages")
    body: dict[str, Any] = {name: timed(name) for name in names}
    body.update(seconds=0.0, manager_seconds=0.0)
    return type("TimedFlow", (base,), body)


#: The runs compared: FCFS; LPM as SGLang runs it (FCFS while more than 128 requests wait);
#: LPM matching every waiting request at every step, what that limit avoids.
CONFIGS: dict[str, dict[str, Any]] = {
    "fcfs": {"policy": "fcfs"},
    "lpm": {"policy": "lpm"},
    "lpm, no queue limit": {"policy": "lpm", "lpm_queue_limit": 10**9},
}


def load_baseline(root: Path) -> ModuleType:
    """``root/kvcache`` imported as the package ``kvcache_baseline`` (its imports are relative)."""
    tmp = Path(tempfile.mkdtemp(prefix="scheduler_steps_"))
    shutil.copytree(root / "kvcache", tmp / "kvcache_baseline")
    sys.path.insert(0, str(tmp))
    return importlib.import_module("kvcache_baseline")


def serve(pkg: ModuleType, jobs: list[Job], config: dict[str, Any]) -> dict[str, float]:
    """Serve ``jobs`` to the end with ``pkg``; CPU seconds of the run and of the manager's calls."""
    manager = TimedManager(pkg.RadixCacheManager(page_size=PAGE_SIZE), clock=clock)
    flow = timed_flow(pkg)(manager, pkg.PageAllocator(NUM_PAGES, PAGE_SIZE))
    sched = pkg.Scheduler(flow, token_budget=TOKEN_BUDGET, max_batch=MAX_BATCH, **config)
    for job in jobs:
        out = job.output if len(job.output) else torch.zeros(1, dtype=torch.int64)
        sched.submit(job.prompt, len(out), forced=out)
    t0 = clock()
    report = sched.run()
    wall = clock() - t0
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


def fastest(pkgs: dict[str, ModuleType], jobs: list[Job], repeats: int) -> dict[str, Any]:
    """Every config served by every package in turn, ``repeats`` times; each run's figures from
    its fastest repeat. Keys: ``config`` for this checkout, ``config (baseline)`` for the other."""
    best: dict[str, dict[str, float]] = {}
    for i in range(repeats):
        for name, config in CONFIGS.items():
            order = list(pkgs) if i % 2 == 0 else list(pkgs)[::-1]  # neither always goes first
            for label in order:
                key = name if label == "this" else f"{name} ({label})"
                r = serve(pkgs[label], jobs, config)
                if key not in best or r["wall_s"] < best[key]["wall_s"]:
                    best[key] = r
    return best


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--baseline", type=Path, default=None, help="a checkout holding kvcache/")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    jobs = mixed(args.requests, seed=0)
    print(
        f"{platform.processor() or platform.machine()}, Python {platform.python_version()}, "
        f"torch {torch.__version__}; {len(jobs)} requests, pool {NUM_PAGES} x {PAGE_SIZE} slots, "
        f"budget {TOKEN_BUDGET}, batch {MAX_BATCH}; CPU time, fastest of {args.repeats}"
    )
    pkgs = {"this": kvcache}
    if args.baseline is not None:
        pkgs["baseline"] = load_baseline(args.baseline)
    for pkg in pkgs.values():
        serve(pkg, jobs[:100], CONFIGS["fcfs"])  # warm-up: first-call costs stay out of the figures
    results = fastest(pkgs, jobs, max(1, args.repeats))
    for name in CONFIGS:
        r = results[name]
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
        if args.baseline is not None:
            b = results[f"{name} (baseline)"]
            own, base_own = r["scheduler_share"] * r["wall_s"], b["scheduler_share"] * b["wall_s"]
            print(
                f"    baseline: {b['steps']:5} steps, {b['us_per_step']:,.0f} us/step; "
                f"this / baseline: per step {r['us_per_step'] / b['us_per_step']:.2f}, "
                f"scheduler's own part {own / r['steps'] / (base_own / b['steps']):.2f}"
            )
    ratio = results["lpm, no queue limit"]["us_per_step"] / results["fcfs"]["us_per_step"]
    print(f"per-step cost of LPM matching the whole queue / FCFS: {ratio:.2f}")
    write_json({"machine": machine(clock="thread CPU time"), **results}, args.json)
    return results


if __name__ == "__main__":
    main()
