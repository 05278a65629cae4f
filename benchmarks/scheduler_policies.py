"""SGLang's cache-aware admission policies against FCFS and LPM, in one run, on the scheduling
chapter's workloads (issue 30 item 6).

    python benchmarks/scheduler_policies.py            # the table the chapter quotes
    python benchmarks/scheduler_policies.py --quick    # a smoke run (fewer requests)

Policies: ``fcfs``; ``lpm``; ``lpm+in-batch`` (LPM with SGLang's in-batch prefix caching,
threshold 32 tokens: ``IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD`` and ``..._DEPRIORITIZE_...``
in ``python/sglang/srt/managers/schedule_policy.py``); ``dfs-weight`` (SGLang's
``CacheAwarePolicy.DFS_WEIGHT``). Every run serves the same seeded requests (three arrive before
each step) on the same pool (160 pages of 16 tokens), budget (1,024 tokens a step), batch (16)
and cost model (`LLAMA3_8B_H100`: the seconds are simulated, deterministic), as the chapter's
FCFS/LPM table. Columns: the share of prompt tokens read from the cache, output tokens per
simulated second, the longest time a request waited in steps, and each policy's hit rate and
throughput as a ratio of FCFS's and of LPM's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcache import PageAllocator, RadixCacheManager, RequestFlow, Scheduler, ServeReport
from kvcache.serving.workloads import Job, few_shot, mixed, shared_system_prompts

POLICIES = {
    "fcfs": {"policy": "fcfs"},
    "lpm": {"policy": "lpm"},
    "lpm+in-batch": {"policy": "lpm", "in_batch_prefix": 32},
    "dfs-weight": {"policy": "dfs_weight"},
}


def serve(jobs: list[Job], per_step: int = 3, **policy: object) -> ServeReport:
    """Submit ``per_step`` jobs before each step until all are in, run until done."""
    flow = RequestFlow(RadixCacheManager(page_size=16), PageAllocator(160, 16))
    sched = Scheduler(flow, token_budget=1024, max_batch=16, starvation_bound=64, **policy)  # type: ignore[arg-type]
    queue = list(jobs)
    while queue or not sched.idle:
        for job in queue[:per_step]:
            out = job.output if len(job.output) else torch.zeros(1, dtype=torch.int64)
            sched.submit(job.prompt, len(out), forced=out)
        del queue[:per_step]
        sched.step()
    sched.check_integrity()
    return sched.report()


def workloads(n: int) -> dict[str, list[Job]]:
    return {
        "system prompts": shared_system_prompts(n, num_prompts=8, vocab=1000, seed=1),
        "few-shot": few_shot(n, num_tasks=6, vocab=1000, seed=1),
        "mixed": mixed(n, vocab=1000, seed=1),
    }


def table(runs: dict[tuple[str, str], ServeReport]) -> list[str]:
    head = (
        f"{'workload':15} {'policy':13} {'hit rate':>8} {'tok/s':>7} {'worst wait':>10} "
        f"{'hit/FCFS':>8} {'hit/LPM':>7} {'tput/FCFS':>9} {'tput/LPM':>8}"
    )
    lines = [head, "-" * len(head)]
    for (w, p), r in runs.items():
        f, lp = runs[w, "fcfs"], runs[w, "lpm"]
        lines.append(
            f"{w:15} {p:13} {r.hit_rate:8.1%} {r.throughput:7,.0f} {r.max_wait_steps:6} steps "
            f"{r.hit_rate / f.hit_rate:8.2f} {r.hit_rate / lp.hit_rate:7.2f} "
            f"{r.throughput / f.throughput:9.2f} {r.throughput / lp.throughput:8.2f}"
        )
    return lines


def main(argv: list[str] | None = None) -> dict[tuple[str, str], ServeReport]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="40 requests a workload (a smoke run)")
    args = p.parse_args(argv)
    runs = {
        (w, name): serve(jobs, **kw)
        for w, jobs in workloads(40 if args.quick else 200).items()
        for name, kw in POLICIES.items()
    }
    print("\n".join(table(runs)))
    return runs


if __name__ == "__main__":
    main()
