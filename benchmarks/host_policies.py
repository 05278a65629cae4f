"""The host tier's write policies against each other, in one run, on the host-tier chapter's
multi-turn chat (issue 30 item 8).

    python benchmarks/host_policies.py           # the table the chapter quotes
    python benchmarks/host_policies.py --quick   # a smoke run (fewer conversations)

Policies: ``write_back`` (exclusive: a load moves a page back, freeing its host copy: ours from
the start), ``write_back_inclusive`` (a load keeps the host copy, as SGLang's
``HiRadixCache.load_back`` does, so a page evicted again is not copied again),
``write_through`` and ``write_through_selective`` (a page reaches the host on its second hit,
SGLang's ``write_through_threshold`` of 2). Every run serves the same seeded requests with the
scheduler (budget 512, batch 8) over a device pool of 96 pages of 16 tokens and a roomy host
(1,024 pages) or a cramped one (192). Columns: hit rate, tokens computed, tokens copied to host
and back, those bytes at Llama-3-8B's 128 KiB a token, simulated seconds; then the bytes each
policy copies to host as a ratio of the exclusive write-back's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcache import (
    TIER_POLICIES,
    KVCacheLayout,
    MHAKVCache,
    PageAllocator,
    RadixCacheManager,
    RequestFlow,
    Scheduler,
    ServeReport,
    TieredCacheManager,
    TierStats,
)
from kvcache.serving.workloads import Job, multi_turn_chat

PAGE, DEVICE_PAGES = 16, 96
BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # Llama-3-8B's K/V of one token, bf16: 128 KiB


def chat(conversations: int) -> list[Job]:
    return multi_turn_chat(
        num_conversations=conversations,
        turns=6,
        system_len=300,
        message_len=(20, 80),
        output_len=(20, 80),
        seed=0,
    )


def run(jobs: list[Job], policy: str | None, host_pages: int) -> tuple[ServeReport, TierStats]:
    """Serve ``jobs`` on the tier (``policy``), or on the device alone (``None``)."""
    pool = MHAKVCache(1, 1, 1, DEVICE_PAGES, torch.float16, KVCacheLayout.LayerFirst, "cpu", PAGE)
    alloc = PageAllocator(DEVICE_PAGES, PAGE)
    device = RadixCacheManager(page_size=PAGE, events=True)
    tier = (
        None
        if policy is None
        else TieredCacheManager(device, pool, alloc, host_pages, policy=policy)
    )
    sched = Scheduler(RequestFlow(tier or device, alloc), token_budget=512, max_batch=8)
    for job in jobs:
        sched.submit(job.prompt, len(job.output), forced=job.output)
    report = sched.run()
    sched.check_integrity()
    if tier is None:
        return report, TierStats(page_bytes=0)
    tier.check_integrity()
    return report, tier.stats


def table(runs: dict[tuple[str | None, int], tuple[ServeReport, TierStats]]) -> list[str]:
    head = (
        f"{'policy':24} {'host':>5} {'hit rate':>8} {'computed':>9} {'to host':>8} "
        f"{'to device':>9} {'copied':>7} {'sim. s':>7} {'to host / exclusive':>20}"
    )
    lines = [head, "-" * len(head)]
    for (policy, host), (rep, st) in runs.items():
        if policy is None:
            lines.append(
                f"{'device only':24} {'-':>5} {rep.hit_rate:8.1%} {rep.computed_tokens:9,}"
            )
            continue
        base = runs["write_back", host][1].saved_pages
        copied = (st.saved_pages + st.loaded_pages) * PAGE * BYTES_PER_TOKEN
        lines.append(
            f"{policy or 'device only':24} {host:5} {rep.hit_rate:8.1%} {rep.computed_tokens:9,} "
            f"{st.saved_pages * PAGE:8,} {st.loaded_pages * PAGE:9,} {copied / 1e9:5.1f}GB "
            f"{rep.seconds:7.2f} {st.saved_pages / base:20.2f}"
        )
    return lines


def main(
    argv: list[str] | None = None,
) -> dict[tuple[str | None, int], tuple[ServeReport, TierStats]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="6 conversations (a smoke run)")
    args = p.parse_args(argv)
    jobs = chat(6 if args.quick else 24)
    runs: dict[tuple[str | None, int], tuple[ServeReport, TierStats]] = {
        (None, 0): run(jobs, None, 0)
    }
    runs |= {(pol, host): run(jobs, pol, host) for host in (1024, 192) for pol in TIER_POLICIES}
    print("\n".join(table(runs)))
    return runs


if __name__ == "__main__":
    main()
