"""What making the host tier and the router all or nothing costs: the same runs on the package
before that work and after it, in the same run.

The tier now keeps its own picture of the device (a `PrefixMirror` fed by the device's events),
checks an insert's new slots before the insert, and chooses host pages before one save; the
router keeps what it delivers so that a refused submit can take it back. This benchmark
extracts the package at ``--baseline`` (a git revision, default the commit before that work)
into a temporary folder, and runs, alternating the two packages ``--repeats`` times, each run in
a fresh subprocess:

* ``tier-<policy>``: a `Scheduler` over a `TieredCacheManager` serving a seeded multi-turn chat
  whose working set is several times the device pool (most steps evict to host, many matches
  load back), write-back and write-through;
* ``router``: `Router.run` of a seeded few-shot workload over three replicas, cache-aware, with
  an event delay (so that every submit delivers events first).

Times are the CPU seconds of the running thread (robust on a shared machine), the best of three
runs in each subprocess (the first pays one-time costs); the ratio is median(current) /
median(baseline), so 1.00 is no change. Both packages must make the same decisions (tokens
computed, pages copied each way, requests routed), or the comparison is void.

Run: ``python benchmarks/tier_router.py [--conversations N] [--repeats R] [--baseline REV]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: The commit before the host tier and the router were made all or nothing (issue 27).
DEFAULT_BASELINE = "4aeddb0"

#: Run in a subprocess with the package under test first on sys.path; prints one JSON line.
CHILD = r"""
import json, sys, time
import torch
from kvcache import (KVCacheLayout, MHAKVCache, PageAllocator, RadixCacheManager, RequestFlow,
                     Router, Scheduler, TieredCacheManager)
from kvcache.serving.workloads import few_shot, multi_turn_chat
torch.set_num_threads(1)
conversations, turns, requests = (int(a) for a in sys.argv[1:4])
chat = multi_turn_chat(num_conversations=conversations, turns=turns, system_len=300,
                       message_len=(20, 80), output_len=(20, 80), seed=0)
shots = few_shot(requests, num_tasks=4, shots=3, shot_len=40, output_len=(2, 8), seed=1)
PAGE, DEVICE, HOST = 16, 48, 256


def tier_run(policy):
    pool = MHAKVCache(1, 1, 1, DEVICE, torch.float16, KVCacheLayout.LayerFirst, "cpu", PAGE)
    alloc = PageAllocator(DEVICE, PAGE)
    tier = TieredCacheManager(RadixCacheManager(page_size=PAGE, events=True), pool, alloc, HOST,
                              policy=policy)
    sched = Scheduler(RequestFlow(tier, alloc), token_budget=512, max_batch=8)
    for job in chat:
        sched.submit(job.prompt, len(job.output), forced=job.output)
    t0 = time.thread_time()
    rep = sched.run()
    return time.thread_time() - t0, [rep.computed_tokens, tier.stats.saved_pages,
                                     tier.stats.loaded_pages, tier.stats.host_evicted_pages]


def router_run():
    reps = [Scheduler(RequestFlow(RadixCacheManager(page_size=1, events=True),
                                  PageAllocator(600, 1)), token_budget=256, max_batch=8)
            for _ in range(3)]
    router = Router(reps, policy="cache_aware", event_delay_s=0.002)
    gaps = [0.001 * i for i in range(len(shots))]
    t0 = time.thread_time()
    rep = router.run(shots, gaps)
    return time.thread_time() - t0, [rep.computed_tokens, list(rep.routed), rep.by_prefix]


out = {}
for name, fn in (("tier-write_back", lambda: tier_run("write_back")),
                 ("tier-write_through", lambda: tier_run("write_through")),
                 ("router", router_run)):
    best, decided = float("inf"), None
    for _ in range(3):  # the first run pays one-time costs (lazy imports, caches): take the best
        seconds, decided = fn()
        best = min(best, seconds)
    out[name] = [best, decided]
print(json.dumps(out))
"""


def extract(rev: str, into: Path) -> Path:
    """The ``kvcache`` package at git revision ``rev``, written under ``into``."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", rev, "kvcache"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def run_once(root: Path, conversations: int, turns: int, requests: int) -> dict[str, list]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(conversations), str(turns), str(requests)],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(root), "PYTHONHASHSEED": "0", "PATH": "/usr/bin:/bin"},
    )
    if done.returncode != 0:
        raise RuntimeError(f"the run under {root} failed:\n{done.stderr[-2000:]}")
    result: dict[str, list] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--requests", type=int, default=120, help="routed few-shot requests")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--baseline", default=DEFAULT_BASELINE, help="git revision to compare with")
    args = ap.parse_args(argv)
    print(f"python {platform.python_version()} on {platform.machine()}; baseline {args.baseline}")
    times: dict[str, dict[str, list[float]]] = {"baseline": {}, "current": {}}
    decisions: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        roots = {"baseline": extract(args.baseline, Path(tmp)), "current": REPO}
        for _ in range(args.repeats):
            for which, root in roots.items():  # alternate, so drift in load hits both alike
                res = run_once(root, args.conversations, args.turns, args.requests)
                for name, (seconds, decided) in res.items():
                    times[which].setdefault(name, []).append(seconds)
                    decisions.setdefault(name, {})[which] = decided
    out: dict[str, dict[str, float]] = {}
    for name, by in decisions.items():
        if by["baseline"] != by["current"]:
            raise RuntimeError(f"{name}: different decisions {by}; the comparison is void")
        base = statistics.median(times["baseline"][name])
        cur = statistics.median(times["current"][name])
        out[name] = {"baseline_s": base, "current_s": cur, "ratio": cur / base}
        print(
            f"{name:20s} baseline {base * 1e3:8.1f} ms  current {cur * 1e3:8.1f} ms  "
            f"current/baseline {cur / base:.2f}  (median of {args.repeats}; {by['current']})"
        )
    return out


if __name__ == "__main__":
    main()
