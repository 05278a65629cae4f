"""Namespaces cost nothing when unused: the default ``extra_key=None`` path against the package
as it was before namespaces, in the same run.

The issue that added ``extra_key`` promised "today's behaviour and speed" for the default key.
This benchmark checks the speed half (the behaviour half is ``tests/test_namespaces.py``): it
extracts the package at ``--baseline`` (a git revision, default the commit before namespaces
landed) into a temporary folder, then replays the same seeded workload through `RequestFlow` with
the radix and block-hash managers, alternating the two packages ``--repeats`` times, each run in
a fresh subprocess. Times are the CPU seconds of the replaying thread (robust on a shared
machine), the best of three replays in each subprocess (the first pays one-time costs); the
ratio is median(current) / median(baseline), so 1.00 is no change. Both packages
must make the same cache decisions (reused and evicted tokens), or the comparison is void.

Run: ``python benchmarks/namespace_overhead.py [--requests N] [--repeats R] [--baseline REV]``.
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
#: The commit before "Namespaces: extra_key on every manager and RequestFlow.begin/begin_batch".
DEFAULT_BASELINE = "2d1bdb1^"

#: Run in a subprocess with the package under test first on sys.path; prints one JSON line.
CHILD = r"""
import json, sys, time
import torch
from kvcache import BlockHashCacheManager, PageAllocator, RadixCacheManager, RequestFlow
from kvcache.serving.workloads import mixed, replay
torch.set_num_threads(1)
requests, pages, page_size = (int(a) for a in sys.argv[1:4])
jobs = mixed(requests, seed=0)
out = {}
for name, make in (("radix", RadixCacheManager), ("block-hash", BlockHashCacheManager)):
    best = float("inf")
    for _ in range(3):  # the first replay pays one-time costs (lazy imports, caches): take the best
        flow = RequestFlow(make(page_size=page_size), PageAllocator(pages, page_size))
        t0 = time.thread_time()
        samples = replay(flow, jobs)
        best = min(best, time.thread_time() - t0)
    last = samples[-1]
    out[name] = [best, last.reused_tokens, last.evicted_tokens]
print(json.dumps(out))
"""


def extract(rev: str, into: Path) -> Path:
    """The ``kvcache`` package at git revision ``rev``, written under ``into``."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", rev, "kvcache"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def run_once(root: Path, requests: int, pages: int, page_size: int) -> dict[str, list[float]]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(requests), str(pages), str(page_size)],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(root), "PYTHONHASHSEED": "0", "PATH": "/usr/bin:/bin"},
    )
    if done.returncode != 0:
        raise RuntimeError(f"the replay under {root} failed:\n{done.stderr[-2000:]}")
    result: dict[str, list[float]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--pages", type=int, default=4000, help="pool pages (small: eviction happens)")
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--baseline", default=DEFAULT_BASELINE, help="git revision to compare with")
    args = ap.parse_args(argv)
    print(f"python {platform.python_version()} on {platform.machine()}, {args.requests} requests,")
    print(f"{args.pages} pages of {args.page_size}; baseline {args.baseline}, current {REPO}")
    times: dict[str, dict[str, list[float]]] = {"baseline": {}, "current": {}}
    decisions: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        roots = {"baseline": extract(args.baseline, Path(tmp)), "current": REPO}
        for _ in range(args.repeats):
            for which, root in roots.items():  # alternate, so drift in load hits both alike
                res = run_once(root, args.requests, args.pages, args.page_size)
                for name, (seconds, *decided) in res.items():
                    times[which].setdefault(name, []).append(seconds)
                    decisions.setdefault(name, {})[which] = decided
    out: dict[str, dict[str, float]] = {}
    for name, by in decisions.items():
        if by["baseline"] != by["current"]:
            raise RuntimeError(f"{name}: different cache decisions {by}; the comparison is void")
        base = statistics.median(times["baseline"][name])
        cur = statistics.median(times["current"][name])
        out[name] = {"baseline_s": base, "current_s": cur, "ratio": cur / base}
        print(
            f"{name:10s} baseline {base * 1e3:8.1f} ms  current {cur * 1e3:8.1f} ms  "
            f"current/baseline {cur / base:.2f}  (median of {args.repeats}; reused "
            f"{int(by['current'][0]):,}, evicted {int(by['current'][1]):,} tokens)"
        )
    return out


if __name__ == "__main__":
    main()
