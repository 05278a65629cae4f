"""`RadixCacheManager` against SGLang 0.5.23's own `RadixCache` (and mini-sglang's), in one process.

`radix_ops --traces` times a stand-in written from SGLang's design, which the book can run
everywhere. This runs SGLang's real ``sglang.srt.mem_cache.radix_cache.RadixCache`` (LRU, no
metrics, no events: its leanest setting) on the same three seeded traces (chat, few-shot, agent;
their pools, so both evict) at page sizes 16 and 1, one request at a time, with the calls SGLang's
scheduler makes around a request:

    match_prefix -> path_device_indices -> inc_lock_ref      (a request starts)
    evict(tokens short)                                     (when the free pages run out)
    insert(key, int64 copy of the slots) -> dec_lock_ref    (it finishes: release_kv_cache)

and ours with the calls `RequestFlow` makes (``match_and_lock``, ``evict``,
``insert_and_unlock``, on the flow's NumPy arrays). One driver serves both, with the same
untimed page allocator and the same clock around each call; a pool's pages are handed out and
taken back alike. SGLang's keys are built untimed from ``array('q')`` token ids (its scheduler
keeps them), but the slicing, page alignment and int64 copy inside its insert path are timed, as
they are inside its ``release_kv_cache`` (``RadixCache._insert_cache``).

SGLang stamps access times with ``time.monotonic()``; here its module's clock is a counter (one
call, as the stand-in does), so two nodes never tie and the eviction order is defined. SGLang
also stamps a node before it splits it, where ours keeps the split-off lower part's old stamp;
on traces with partial matches under memory pressure that can make the two evict differently,
so the script prints, for each trace, whether both reused and evicted exactly the same tokens.

With ``--minisgl-path`` (the ``python/`` folder of a mini-sglang checkout) the radix cache of
mini-sglang runs too (``RadixPrefixCache``: torch keys, its C++ ``fast_compare_key``, which
tvm-ffi compiles with the machine's C++ compiler on first use), with the calls its scheduler
makes (``match_prefix``, ``get_matched_indices``, ``lock_handle``; ``insert_prefix``, unlock;
``evict``) and its module's clock made a counter in the same way.

SGLang is not a dependency of this project (its wheel requires a CUDA build of torch): make a
folder it imports from with ``bash scripts/real_engines_env.sh DIR`` and run
``python benchmarks/radix_vs_real_sglang.py --engines-path DIR [--minisgl-path DIR]
[--repeats 5] [--page-size 16 1] [--json PATH]``. SGLang's unrelated multimodal modules import torchvision, which has no build for
this torch here; a stub module stands in for it (nothing of it is ever called).
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import itertools
import sys
import time
import types
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import radix_ops
from harness import commit, import_engine, machine, write_json

from kvcache import RadixCacheManager
from kvcache.serving.workloads import Job

clock = time.perf_counter


class _Stub:
    """Anything torchvision would give: callable, with any attribute, usable as a base class."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Stub:
        return _Stub()

    def __getattr__(self, name: str) -> _Stub:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub()

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (object,)


class _TorchvisionStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``torchvision`` and each of its submodules as an empty stub package."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+stub"  # type: ignore[attr-defined]
        module.__getattr__ = _Stub().__getattr__  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


class _Counter:
    """Stands in for the ``time`` module inside SGLang's radix cache: a logical clock."""

    def __init__(self) -> None:
        self.monotonic = self.monotonic_ns = itertools.count(1).__next__
        self.perf_counter = time.perf_counter


class _Pool:
    """The untimed page allocator both caches share: a list of free pages, FIFO."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.free = list(range(num_pages))
        self.page_size = page_size
        self.offsets = np.arange(page_size, dtype=np.int32)

    def take(self, k: int) -> np.ndarray:
        pages = np.array(self.free[:k], dtype=np.int32)
        del self.free[:k]
        return (pages[:, None] * self.page_size + self.offsets).reshape(-1)

    def give(self, slots: np.ndarray) -> None:
        """Take back the pages of slots laid out page after page from a page start."""
        self.free.extend((np.asarray(slots)[:: self.page_size] // self.page_size).tolist())


class Ours:
    """`RadixCacheManager` with the calls `RequestFlow` makes on it."""

    # Its keys and values as the flow hands them over: CPU tensors over the host arrays.
    key = values = staticmethod(torch.from_numpy)

    def __init__(self, page_size: int) -> None:
        self.cache = RadixCacheManager(page_size=page_size)

    def match_lock(self, ids: torch.Tensor) -> tuple[int, torch.Tensor, Any]:
        handle, prefix = self.cache.match_and_lock(ids)
        return handle.cached_len, prefix, handle

    def insert_unlock(self, lock: Any, ids: torch.Tensor, slots: torch.Tensor) -> int:
        return self.cache.insert_and_unlock(lock, ids, slots).cached_len

    def evict(self, tokens: int) -> np.ndarray:
        return self.cache.evict(tokens).numpy()


class Sglang:
    """SGLang's ``RadixCache`` with the calls its scheduler makes around a request."""

    # Keys as its scheduler keeps them (``array('q')``), slots as a tensor (its int64 copy is
    # made inside `insert_unlock`, timed, as inside SGLang's ``_insert_cache``).
    key = staticmethod(lambda ids: array("q", ids.tobytes()))
    values = staticmethod(torch.from_numpy)

    def __init__(self, page_size: int) -> None:
        from sglang.srt.mem_cache import radix_cache
        from sglang.srt.mem_cache.base_prefix_cache import (
            EvictParams,
            InsertParams,
            MatchPrefixParams,
        )
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams

        radix_cache.time = _Counter()  # type: ignore[attr-defined]
        self.Key, self.Match, self.Insert, self.Evict = (
            radix_cache.RadixKey,
            MatchPrefixParams,
            InsertParams,
            EvictParams,
        )
        self.freed: list[torch.Tensor] = []
        self.device = "cpu"  # read by RadixCache as its allocator's device
        self.page_size = page_size
        params = CacheInitParams(
            disable=False,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=self,
            page_size=page_size,
        )
        self.cache = radix_cache.RadixCache(params)

    def free_segment(self, value: torch.Tensor, start_pos: int = 0) -> None:
        self.freed.append(value)  # SGLang's allocator frees an evicted node's slots here

    def match_lock(self, ids: array) -> tuple[int, torch.Tensor, Any]:
        res = self.cache.match_prefix(self.Match(key=self.Key(ids)))
        node = res.last_device_node
        prefix = self.cache.path_device_indices(node)
        self.cache.inc_lock_ref(node)
        return res.device_prefix_len, prefix, node

    def insert_unlock(self, node: Any, ids: array, slots: torch.Tensor) -> int:
        key = self.Key(ids).page_aligned(self.page_size)
        values = slots[: len(key)].to(dtype=torch.int64, copy=True)
        prefix_len = self.cache.insert(self.Insert(key=key, value=values)).prefix_len
        self.cache.dec_lock_ref(node)
        return prefix_len

    def evict(self, tokens: int) -> np.ndarray:
        self.cache.evict(self.Evict(num_tokens=tokens))
        freed = torch.cat(self.freed).numpy() if self.freed else np.zeros(0, np.int64)
        self.freed = []
        return freed


class Minisgl:
    """mini-sglang's ``RadixPrefixCache`` with the calls its scheduler makes around a request."""

    key = values = staticmethod(torch.from_numpy)  # CPU tensors

    def __init__(self, page_size: int) -> None:
        import minisgl.core as core
        from minisgl.kvcache import radix_cache

        core._GLOBAL_CTX = None  # one context a process; mini-sglang's own tests reset it so
        core.set_global_ctx(core.Context(page_size=page_size))
        radix_cache.time = _Counter()  # type: ignore[attr-defined]
        self.cache = radix_cache.RadixPrefixCache(torch.device("cpu"))
        self.empty = torch.empty(0, dtype=torch.int32)

    def match_lock(self, ids: torch.Tensor) -> tuple[int, torch.Tensor, Any]:
        handle = self.cache.match_prefix(ids).cuda_handle
        prefix = handle.get_matched_indices() if handle.cached_len else self.empty
        self.cache.lock_handle(handle)
        return handle.cached_len, prefix, handle

    def insert_unlock(self, handle: Any, ids: torch.Tensor, slots: torch.Tensor) -> int:
        cached_len = self.cache.insert_prefix(ids, slots).cached_len
        self.cache.lock_handle(handle, unlock=True)
        return cached_len

    def evict(self, tokens: int) -> np.ndarray:
        return self.cache.evict(tokens).numpy()


def drive(
    cache: Ours | Sglang | Minisgl, jobs: list[Job], num_slots: int, ps: int
) -> dict[str, Any]:
    """The flow's requests (begin on all but the last token, decode the output, finish) with
    only ``cache``'s calls timed. Returns the seconds, reused tokens per request and evicted
    tokens."""
    pool = _Pool(num_slots // ps, ps)
    seconds, reused, evicted = 0.0, [], 0

    def room(pages: int) -> None:
        nonlocal seconds, evicted
        if pages > len(pool.free):
            t0 = clock()
            slots = cache.evict((pages - len(pool.free)) * ps)
            seconds += clock() - t0
            evicted += len(slots)
            pool.give(slots)

    for job in jobs:
        ids = np.concatenate((job.prompt.numpy(), job.output.numpy()))
        n, total = len(job.prompt), len(ids)
        key = cache.key(ids[: n - 1])  # untimed, like the rest of the driver's own work
        t0 = clock()
        m, prefix, lock = cache.match_lock(key)
        seconds += clock() - t0
        reused.append(m)
        k = -(-(n - m) // ps)  # the prompt's pages (at `begin`)
        room(k)
        slots = np.concatenate((np.asarray(prefix, dtype=np.int32), pool.take(k)))
        more = -(-(total - len(slots)) // ps)  # the output's (at `extend`)
        if more > 0:
            room(more)
            slots = np.concatenate((slots, pool.take(more)))
        whole = total - total % ps
        key, values = cache.key(ids[:whole]), cache.values(slots[:whole])
        t0 = clock()
        already = cache.insert_unlock(lock, key, values)
        seconds += clock() - t0
        own = slots[m:already]  # the request's duplicates of what another request cached
        if whole < total:
            own = np.concatenate((own, slots[whole:total]))  # and its partial last page
        if len(own):
            pool.give(own)
    return {"seconds": seconds, "reused": reused, "evicted": evicted}


def compare(trace: str, ps: int, repeats: int, minisgl: bool = False) -> dict[str, Any]:
    """Best of ``repeats`` for each cache, interleaved, on ``trace`` at page size ``ps``."""
    jobs, num_slots = radix_ops.TRACES[trace]()
    makers: dict[str, Callable[[int], Ours | Sglang | Minisgl]] = {"ours": Ours, "sglang": Sglang}
    if minisgl:
        makers["minisgl"] = Minisgl
    best: dict[str, dict[str, Any]] = {}
    for _ in range(repeats):
        for name, make in makers.items():
            run = drive(make(ps), jobs, num_slots, ps)
            if name not in best or run["seconds"] < best[name]["seconds"]:
                best[name] = run
    ours, sglang = best["ours"], best["sglang"]
    row = {
        "requests": len(jobs),
        "same_decisions": ours["reused"] == sglang["reused"]
        and ours["evicted"] == sglang["evicted"],
        "reused_tokens": {k: sum(v["reused"]) for k, v in best.items()},
        "evicted_tokens": {k: v["evicted"] for k, v in best.items()},
        "ours_seconds": ours["seconds"],
        "sglang_seconds": sglang["seconds"],
        "ratio": sglang["seconds"] / ours["seconds"],
    }
    if minisgl:
        other = best["minisgl"]
        row["minisgl_same_decisions"] = (
            ours["reused"] == other["reused"] and ours["evicted"] == other["evicted"]
        )
        row["minisgl_seconds"] = other["seconds"]
        row["minisgl_ratio"] = other["seconds"] / ours["seconds"]
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--engines-path", type=Path, default=None, help="a folder from scripts/real_engines_env.sh"
    )
    ap.add_argument(
        "--minisgl-path",
        type=Path,
        default=None,
        help="the python/ folder of a mini-sglang checkout",
    )
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--page-size", type=int, nargs="+", default=[16, 1])
    ap.add_argument(
        "--traces", nargs="+", choices=list(radix_ops.TRACES), default=list(radix_ops.TRACES)
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if not any(isinstance(f, _TorchvisionStub) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchvisionStub())
    import_engine(args.engines_path, "sglang.srt.mem_cache.radix_cache", "SGLang's radix cache")
    if args.minisgl_path is not None:
        sys.path.insert(0, str(args.minisgl_path.resolve()))
        from minisgl.kernel import fast_compare_key  # compiled here, not inside a timed call

        fast_compare_key(torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))
    torch.set_num_threads(1)
    info = machine(
        sglang="0.5.23",
        minisgl=commit(args.minisgl_path) if args.minisgl_path else None,
        clock="wall (perf_counter)",
    )
    print(f"ran on: {info}")
    result: dict[str, Any] = {"machine": info}
    for ps in args.page_size:
        for trace in args.traces:
            row = result[f"{trace}, page size {ps}"] = compare(
                trace, ps, args.repeats, args.minisgl_path is not None
            )
            same = (
                "same decisions"
                if row["same_decisions"]
                else (
                    f"decisions differ: reused {row['reused_tokens']['ours']} vs "
                    f"{row['reused_tokens']['sglang']}"
                )
            )
            print(
                f"  page size {ps:2d} {trace:9s}: ours {row['ours_seconds']:.3f} s | SGLang "
                f"{row['sglang_seconds']:.3f} s = {row['ratio']:.2f}x ({same})"
            )
            if "minisgl_seconds" in row:
                same = "same" if row["minisgl_same_decisions"] else "different"
                print(
                    f"{'':22s} mini-sglang {row['minisgl_seconds']:.3f} s = "
                    f"{row['minisgl_ratio']:.2f}x ({same} decisions)"
                )
    write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
