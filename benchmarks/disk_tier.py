"""The disk tier's write and load bandwidth against plain sequential file I/O of the same bytes,
on this machine, in one run (issue 30 item 9).

    python benchmarks/disk_tier.py                 # 64 pages of 2 MiB (Llama-3-8B, 16 tokens)
    python benchmarks/disk_tier.py --quick         # 8 pages (a smoke run)
    python benchmarks/disk_tier.py --dir /mnt/nvme # where to write (default: a temp directory)

A page is what `DiskKVStore` writes per file: K and V of 32 layers x 16 tokens x 8 KV heads x
128 dims in bf16, 2 MiB. Measured:

* ``store write``: `DiskKVStore.put` of every page: SHA-256 of the payload, a temporary file,
  write, ``fsync``, ``os.replace``, ``fsync`` of the directory;
* ``store load``: `DiskKVStore.get` of every page: read the file, check its header and its
  payload's SHA-256, return the tensor; cold (the files dropped from the page cache first with
  ``posix_fadvise(DONTNEED)``) and warm (in the page cache);
* the baseline: the same bytes written as one file with one ``fsync``, read back cold and warm,
  and ``shutil.copyfile`` of that file (a plain sequential copy) with an ``fsync``.

Each figure is bytes over seconds (the best of ``--repeat`` runs), and the store's as a ratio of
the baseline's. The ratio is what the checks and the one-file-per-page layout cost.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcache import DiskKVStore, KVCacheLayout, MHAKVCache

LAYERS, HEADS, DIM, PAGE = 32, 8, 128, 16  # Llama-3-8B's K/V per page of 16 tokens


def drop_cache(path: Path) -> None:
    """Ask the kernel to drop ``path``'s clean pages from the page cache (no root needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def best(fn: Callable[[], None], repeat: int, before: Callable[[], None] | None = None) -> float:
    """The fastest of ``repeat`` timed calls of ``fn`` (``before`` runs untimed before each)."""
    times = []
    for _ in range(repeat):
        if before is not None:
            before()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="8 pages, 1 repeat")
    p.add_argument("--pages", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the files go (default: a temp directory)")
    args = p.parse_args(argv)
    n, repeat = (8, 1) if args.quick else (args.pages, args.repeat)
    root = Path(tempfile.mkdtemp(prefix="kvdisk-bench-", dir=args.dir))
    try:
        pool = MHAKVCache(
            HEADS, LAYERS, DIM, 1, torch.bfloat16, KVCacheLayout.LayerFirst, "cpu", PAGE
        )
        g = torch.Generator().manual_seed(0)
        shape = (2, LAYERS, PAGE, HEADS, DIM)
        pages = [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(n)]
        nbytes = sum(x.numel() * x.element_size() for x in pages)
        store_dir = root / "store"

        def fresh_store() -> DiskKVStore:
            shutil.rmtree(store_dir, ignore_errors=True)
            return DiskKVStore(store_dir, pool, "bench")

        names = fresh_store().prefix_digests(None, list(range(n * PAGE)))
        holder: dict[str, DiskKVStore] = {}

        def prepare_write() -> None:
            holder["s"] = fresh_store()

        def write() -> None:
            for d, x in zip(names, pages, strict=True):
                holder["s"].put(d, x)

        results = {"store write": nbytes / best(write, repeat, prepare_write)}

        def load() -> None:
            for d in names:
                if holder["s"].get(d) is None:
                    raise RuntimeError("a page failed its check")

        def cold_store() -> None:
            for f in holder["s"].page_files():
                drop_cache(f)

        results["store load, cold"] = nbytes / best(load, repeat, cold_store)
        results["store load, warm"] = nbytes / best(load, repeat)

        blob = b"".join(x.view(torch.uint8).numpy().tobytes() for x in pages)
        plain, copy = root / "plain.bin", root / "copy.bin"

        def plain_write() -> None:
            with open(plain, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())

        results["plain write"] = nbytes / best(plain_write, repeat)

        def plain_read() -> None:
            plain.read_bytes()

        results["plain read, cold"] = nbytes / best(plain_read, repeat, lambda: drop_cache(plain))
        results["plain read, warm"] = nbytes / best(plain_read, repeat)

        def plain_copy() -> None:
            shutil.copyfile(plain, copy)
            fd = os.open(copy, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

        results["plain copy"] = nbytes / best(plain_copy, repeat, lambda: drop_cache(plain))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base = {
        "store write": "plain write",
        "store load, cold": "plain read, cold",
        "store load, warm": "plain read, warm",
    }
    print(f"{n} pages of {nbytes // n / 2**20:.0f} MiB, {nbytes / 2**20:.0f} MiB in all")
    print(f"{'what':18} {'MB/s':>8} {'vs plain':>9}  (plain: one file, sequential)")
    for what, rate in results.items():
        vs = f"{rate / results[base[what]]:8.2f}x" if what in base else ""
        print(f"{what:18} {rate / 1e6:8,.0f} {vs:>9}")
    return results


if __name__ == "__main__":
    main()
