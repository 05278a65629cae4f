"""`BlockHashCacheManager` against vLLM 0.33's own prefix cache, in one process.

`block_hash_vs_vllm` times a stand-in written from vLLM's design, which the book can run
everywhere. This runs vLLM's real ``KVCacheManager`` (``vllm.v1.core``: its block pool, free
queue and prefix lookup; prefix caching on, SHA-256 block hashes, its default; no stats, no
events: its leanest setting) on the same three seeded traces, block size 16, the same pool
(49,152 tokens, so both evict), one request at a time, as vLLM's scheduler drives it:

    Request(prompt) -> block hashes           get_computed_blocks -> allocate_slots(prompt)
    append_output_token_ids -> block hashes   allocate_slots(output)      free(request)

Ours is driven through `RequestFlow` as `block_hash_vs_vllm` drives it. vLLM's
``KVCacheManager`` is both a prefix cache and a block allocator (its block pool hands out and
takes back blocks), so ours is timed in the calls to both of its counterparts: the manager
(its own hashing and conversions included) and the `PageAllocator` the flow takes pages from
and gives them back to. vLLM's time is reported twice: its manager's calls alone, and with the
hashing of each request's blocks (which vLLM does only with prefix caching on, when a request
arrives and as it grows). vLLM is handed Python lists and ``Request`` objects; building them is
not timed, nor are the flow's own `Request` objects. Both must reuse the same tokens for every
request, or the run stops. Ratios: vLLM's time over ours (the manager's and the allocator's
calls); ``manager_only`` ratios leave our allocator out.

vLLM is not a dependency of this project: its wheel requires a CUDA build of torch. Make a folder
it imports from with ``bash scripts/real_engines_env.sh DIR``, then run
``python benchmarks/block_hash_vs_real_vllm.py --engines-path DIR [--repeats 5] [--traces chat]
[--json PATH]``. Prints what it ran on.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import block_hash_vs_vllm as stand_in_bench
from harness import import_engine, machine, write_json

from kvcache import BlockHashCacheManager, PageAllocator, RequestFlow
from kvcache.serving.workloads import Job

BLOCK, POOL = 16, 49152
clock = time.perf_counter


class RealVllm:
    """vLLM 0.33's ``KVCacheManager`` for one attention group of ``num_blocks`` blocks of 16."""

    def __init__(self, num_blocks: int) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.request import Request

        kv_cache_utils.init_none_hash(sha256)
        self.hasher = kv_cache_utils.get_request_block_hasher(BLOCK, sha256)
        self.Request, self.SamplingParams = Request, SamplingParams
        spec = FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float16
        )
        config = KVCacheConfig(
            num_blocks=num_blocks + 1,  # block 0 is vLLM's null block
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
        )
        self.manager = KVCacheManager(
            config,
            max_model_len=1 << 20,
            scheduler_block_size=BLOCK,
            hash_block_size=BLOCK,
            enable_caching=True,
        )

    def drive(self, jobs: list[Job]) -> tuple[float, float, list[int]]:
        """(seconds in the manager's calls, seconds hashing blocks, tokens reused per request)."""
        manager, calls, hashing, reused = self.manager, 0.0, 0.0, []
        for i, job in enumerate(jobs):
            prompt, output = job.prompt.tolist(), job.output.tolist()
            req = self.Request(
                str(i), prompt, self.SamplingParams(max_tokens=len(output) or 1), None
            )
            req._block_hasher = self.hasher  # what the engine passes as `block_hasher`
            t0 = clock()
            req.update_block_hashes()  # as Request.__init__ does, timed on its own
            t1 = clock()
            blocks, num_cached, _ = manager.get_computed_blocks(req)
            new = manager.allocate_slots(req, len(prompt) - num_cached, num_cached, blocks)
            t2 = clock()
            hashing, calls = hashing + (t1 - t0), calls + (t2 - t1)
            if new is None:
                raise SystemExit(f"vLLM found no room for request {i}: raise --pool")
            reused.append(num_cached)
            req.num_computed_tokens = len(prompt)
            if output:
                t0 = clock()
                req.append_output_token_ids(output)  # hashes the blocks the output fills
                t1 = clock()
                new = manager.allocate_slots(req, len(output))
                t2 = clock()
                hashing, calls = hashing + (t1 - t0), calls + (t2 - t1)
                if new is None:
                    raise SystemExit(f"vLLM found no room for the output of request {i}")
                req.num_computed_tokens += len(output)
            t0 = clock()
            manager.free(req)
            calls += clock() - t0
        return calls, hashing, reused


def _timed(name: str) -> Any:
    def call(self: TimedAllocator, *args: Any, **kwargs: Any) -> Any:
        t0 = clock()
        try:
            return getattr(PageAllocator, name)(self, *args, **kwargs)
        finally:
            self.seconds += clock() - t0

    call.__name__ = name
    return call


class TimedAllocator(PageAllocator):
    """A `PageAllocator` that adds up the seconds spent in the calls that move pages."""

    seconds = 0.0
    allocate = _timed("allocate")
    allocate_slots = _timed("allocate_slots")
    allocate_host_slots = _timed("allocate_host_slots")
    allocate_page_slots = _timed("allocate_page_slots")
    free = _timed("free")
    free_slots = _timed("free_slots")
    free_page_runs = _timed("free_page_runs")
    free_page_start = _timed("free_page_start")


def drive_ours(jobs: list[Job]) -> tuple[float, float, list[int]]:
    """(seconds in the manager's calls, in the allocator's, tokens reused per request): the
    requests of `block_hash_vs_vllm.drive`, through `RequestFlow`."""
    manager = stand_in_bench.timed(BlockHashCacheManager("cpu", BLOCK))
    allocator = TimedAllocator(POOL // BLOCK, BLOCK)
    reused = stand_in_bench.serve(RequestFlow(manager, allocator), jobs)
    return manager.seconds, allocator.seconds, reused


def compare(trace: str, repeats: int) -> dict[str, Any]:
    """Best of ``repeats`` for each side, interleaved; stops when the reused tokens differ."""
    jobs = stand_in_bench.TRACES[trace]()
    names = ("ours", "ours_with_allocator", "vllm", "vllm_with_hashing")
    best = dict.fromkeys(names, float("inf"))
    for _ in range(repeats):
        calls, hashing, theirs = RealVllm(POOL // BLOCK).drive(jobs)
        ours, pages, reused = drive_ours(jobs)
        if reused != theirs:
            raise SystemExit(
                f"vLLM reused other tokens than BlockHashCacheManager on {trace}: void"
            )
        for name, secs in zip(names, (ours, ours + pages, calls, calls + hashing), strict=True):
            best[name] = min(best[name], secs)
    both = best["ours_with_allocator"]
    return {
        "requests": len(jobs),
        "reused_tokens": sum(theirs),
        **{f"{k}_seconds": v for k, v in best.items()},
        "ratio": best["vllm"] / both,
        "ratio_with_hashing": best["vllm_with_hashing"] / both,
        "ratio_manager_only": best["vllm"] / best["ours"],
        "ratio_with_hashing_manager_only": best["vllm_with_hashing"] / best["ours"],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--engines-path", type=Path, default=None, help="a folder from scripts/real_engines_env.sh"
    )
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--traces",
        nargs="+",
        choices=list(stand_in_bench.TRACES),
        default=list(stand_in_bench.TRACES),
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import_engine(args.engines_path, "vllm.v1.core.kv_cache_manager", "vLLM's prefix cache")
    torch.set_num_threads(1)
    info = machine(vllm="0.33.0", clock="wall (perf_counter)", block_size=BLOCK, pool_tokens=POOL)
    print(f"ran on: {info}")
    result: dict[str, Any] = {"machine": info}
    for trace in args.traces:
        row = result[trace] = compare(trace, args.repeats)
        print(
            f"  {trace:9s} ({row['requests']} requests, {row['reused_tokens']} reused): "
            f"ours {row['ours_with_allocator_seconds']:.3f} s ({row['ours_seconds']:.3f} s in "
            f"the manager) | vLLM's calls {row['vllm_seconds']:.3f} s = {row['ratio']:.2f}x | "
            f"with its block hashing {row['vllm_with_hashing_seconds']:.3f} s = "
            f"{row['ratio_with_hashing']:.2f}x"
        )
    write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
