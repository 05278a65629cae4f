"""`RequestFlow`'s own cost, this checkout against a baseline checkout, in one process.

For each trace and page size, per request (CPU time of the thread):
- ``manager``: the radix manager's calls alone, recorded from the flow and replayed (as
  `radix_ops` measures them);
- ``flow``: the whole flow with the real manager (`radix_ops.drive`'s calls), and its ratio to
  ``manager`` (the figure `radix_ops` prints as "whole flow / manager calls");
- ``own``: the flow with a stub manager that replays the real manager's recorded answers at no
  cost: what the flow itself costs, without the manager's share of the machine's caches.

Both flows take every job in turn, in alternating order: the flow that goes second finds the
job's tensors in cache, worth ~10 µs a request on a few-thousand-token prompt, so a fixed order
would favour one side. Runs are repeated and the fastest kept (the machine is shared). Taking
turns also leaves each flow's data colder than a flow running alone (each evicts the other's),
so the ratios here run above `radix_ops`'s: compare the two sides, not these ratios with its.

Run: ``python benchmarks/flow_own.py --baseline /path/to/other/checkout [--traces chat agent]
[--page-sizes 1 16] [--repeats 3]``. Without ``--baseline`` only this checkout is timed.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import radix_ops

import kvcache
from kvcache.managers.base import InsertResult
from kvcache.serving.workloads import Job, agent, long_few_shot, mixed, multi_turn_chat, replay

TRACES: dict[str, Callable[[], tuple[list[Job], int]]] = {
    "mixed": lambda: (mixed(1000, seed=0), 100_000),
    "chat": lambda: (multi_turn_chat(110, 8, seed=0), 40_000),
    "few-shot": lambda: (long_few_shot(800, seed=0), 60_000),
    "agent": lambda: (agent(800, seed=0), 60_000),
}


class Instant:
    """Answers every recorded manager call at once (`radix_ops.replay_calls` on it times the
    replay loop itself, which is taken off the manager's time, as `radix_ops` does)."""

    def __getattr__(self, name: str) -> Callable[..., Any]:
        out = (None, None) if name in ("match_prefix", "match_and_lock") else InsertResult(0, None)  # type: ignore[arg-type]
        return lambda *args, **kwargs: out


def load_baseline(root: Path) -> ModuleType:
    """``root/kvcache`` imported as the package ``kvcache_baseline`` (its imports are relative)."""
    tmp = Path(tempfile.mkdtemp(prefix="flow_own_"))
    shutil.copytree(root / "kvcache", tmp / "kvcache_baseline")
    sys.path.insert(0, str(tmp))
    return importlib.import_module("kvcache_baseline")


def recording(pkg: ModuleType, ps: int) -> Any:
    """A radix manager of ``pkg`` that logs what its fused calls, evict and size_info return."""

    class Recording(pkg.RadixCacheManager):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__(page_size=ps)
            self.log: list[Any] = []

        def match_and_lock(self, *args: Any, **kwargs: Any) -> Any:
            self.log.append(super().match_and_lock(*args, **kwargs))
            return self.log[-1]

        def insert_and_unlock(self, *args: Any, **kwargs: Any) -> Any:
            self.log.append(super().insert_and_unlock(*args, **kwargs))
            return self.log[-1]

        def evict(self, size: int, **kwargs: Any) -> Any:
            self.log.append(super().evict(size, **kwargs))
            return self.log[-1]

        @property
        def size_info(self) -> Any:
            self.log.append(super().size_info)
            return self.log[-1]

    mark_host(pkg, Recording)
    return Recording()


def mark_host(pkg: ModuleType, cls: type) -> None:
    """Where ``pkg``'s flow hands NumPy forms to a manager marked as taking them (a baseline
    from before the flow took one form, tensors), mark ``cls``'s fused calls and evict too, so
    that its flow makes the same calls as on the bare manager (this checkout: nothing to mark)."""
    base = importlib.import_module(pkg.__name__ + ".managers.base")
    if getattr(base, "host_arrays_safe", lambda c, n: False)(pkg.RadixCacheManager, "evict"):
        for name in ("match_and_lock", "insert_and_unlock", "evict"):
            setattr(cls, name, base.takes_host_arrays(vars(cls)[name]))


def answering(pkg: ModuleType, ps: int, log: list[Any]) -> Any:
    """A manager of ``pkg`` that returns ``log``'s answers in order and does nothing else."""
    answers = iter(log)

    def next_answer(self: Any, *args: Any, **kwargs: Any) -> Any:
        return next(answers)

    def unused(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    names = ("match_prefix", "lock_handle", "insert_prefix", "insert_and_match")
    body: dict[str, Any] = {name: unused for name in names}
    body.update(
        page_size=ps,
        match_and_lock=next_answer,
        insert_and_unlock=next_answer,
        evict=next_answer,
        size_info=property(next_answer),
        reset=lambda self: None,
        check_integrity=lambda self: None,
        cached_indices=unused,
        handle_indices=unused,
    )
    cls = type("Answering", (pkg.BaseCacheManager,), body)
    mark_host(pkg, cls)
    return cls()


def job_ns(flow: Any, job: Job) -> int:
    """Thread CPU ns of `radix_ops.drive`'s calls for one job."""
    t0 = time.thread_time_ns()
    radix_ops.drive(flow, [job])
    return time.thread_time_ns() - t0


def lockstep(
    make: dict[str, Callable[[], Any]], jobs: list[Job], repeats: int, manager: Callable[[], float]
) -> tuple[dict[str, float], float]:
    """Fastest of ``repeats`` runs: µs a request for each flow (the flows taking turns) and for
    ``manager()`` (seconds for all jobs), run after them in each repeat, so both see one load."""
    best = {name: float("inf") for name in make}
    best_manager = float("inf")
    for _ in range(repeats):
        flows = {name: m() for name, m in make.items()}
        total = dict.fromkeys(make, 0)
        order = list(make)
        for i, job in enumerate(jobs):
            for name in order if i % 2 else order[::-1]:
                total[name] += job_ns(flows[name], job)
        for name in make:
            best[name] = min(best[name], total[name] / len(jobs) / 1e3)
        best_manager = min(best_manager, manager() / len(jobs) * 1e6)
    return best, best_manager


def main(argv: list[str] | None = None) -> dict[str, dict[str, dict[str, float]]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", type=Path, default=None, help="a checkout holding kvcache/")
    ap.add_argument("--traces", nargs="+", default=list(TRACES), choices=list(TRACES))
    ap.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    pkgs = {"this": kvcache}
    if args.baseline is not None:
        pkgs = {"baseline": load_baseline(args.baseline), **pkgs}
    out: dict[str, dict[str, dict[str, float]]] = {}
    for trace in args.traces:
        jobs, num_slots = TRACES[trace]()
        for ps in args.page_sizes:
            recorder = radix_ops.record(kvcache.RadixCacheManager(page_size=ps))
            replay(kvcache.RequestFlow(recorder, kvcache.PageAllocator(num_slots // ps, ps)), jobs)

            def replayed(ps: int = ps, calls: list[tuple] = recorder.calls) -> float:
                """As radix_ops measures it: less the replay loop's own time."""
                manager = kvcache.RadixCacheManager(page_size=ps)
                return radix_ops.replay_calls(calls, manager) - radix_ops.replay_calls(
                    calls,
                    Instant(),  # type: ignore[arg-type]
                )

            logs = {}
            for name, pkg in pkgs.items():
                rec = recording(pkg, ps)
                flow = pkg.RequestFlow(rec, pkg.PageAllocator(num_slots // ps, ps))
                for job in jobs:
                    job_ns(flow, job)
                logs[name] = rec.log

            def real(pkg: ModuleType, ps: int = ps, n: int = num_slots) -> Callable[[], Any]:
                return lambda: pkg.RequestFlow(
                    pkg.RadixCacheManager(page_size=ps), pkg.PageAllocator(n // ps, ps)
                )

            def stub(pkg: ModuleType, log: list[Any], ps: int = ps, n: int = num_slots) -> Any:
                return lambda: pkg.RequestFlow(
                    answering(pkg, ps, log), pkg.PageAllocator(n // ps, ps)
                )

            whole, manager = lockstep(
                {name: real(pkg) for name, pkg in pkgs.items()}, jobs, args.repeats, replayed
            )
            own, _ = lockstep(
                {name: stub(pkg, logs[name]) for name, pkg in pkgs.items()},
                jobs,
                args.repeats,
                lambda: 0.0,
            )
            cells = " | ".join(
                f"{name}: flow {whole[name]:6.1f} = {whole[name] / manager:.2f}x, own {own[name]:5.1f}"
                for name in pkgs
            )
            print(
                f"{trace:8s} page {ps:2d}: manager {manager:5.1f} µs/request | {cells}", flush=True
            )
            out[f"{trace}/{ps}"] = {
                "manager_us": manager,
                **{f"{name}_flow_us": whole[name] for name in pkgs},
                **{f"{name}_own_us": own[name] for name in pkgs},
            }
    return out


if __name__ == "__main__":
    main()
