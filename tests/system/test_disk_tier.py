"""The disk tier (`DiskKVStore`, issue 30 item 9): pages the host gives up go to files named by
the content hash of their prefix; another process on the same directory finds them; a torn,
stale or misnamed file is never served, and a crash mid-write leaves no page that passes the
check.

Follows SGLang's HiCache file backend (``python/sglang/srt/mem_cache/hicache_storage.py``,
``HiCacheFile``: one ``{key}.bin`` per page under a directory, keys chained page hashes) and
LMCache's local-disk backend; the write discipline (temporary file, ``fsync``, ``os.replace``,
``fsync`` of the directory) is POSIX's atomic replace.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import ids

from kvcache import (
    DiskKVStore,
    KVCacheLayout,
    MHAKVCache,
    PageAllocator,
    RadixCacheManager,
    RequestFlow,
    TieredCacheManager,
)

pytestmark = pytest.mark.usefixtures("torch_store")
REPO = Path(__file__).resolve().parents[2]


def pool() -> MHAKVCache:
    return MHAKVCache(1, 2, 2, 4, torch.float32, KVCacheLayout.LayerFirst, "cpu", 2)


def page(value: float) -> torch.Tensor:
    return torch.full((2, 2, 2, 1, 2), value)


def test_a_page_round_trips_and_its_name_is_its_prefix(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path, pool(), "m")
    d = store.prefix_digests(None, [1, 2, 3, 4, 5])
    assert len(d) == 2 and d[0] != d[1]
    assert store.prefix_digests(None, [1, 2, 3, 4]) == d  # a page's name: its prefix only
    assert store.prefix_digests("t", [1, 2])[0] != d[0]  # and its namespace
    assert DiskKVStore(tmp_path, pool(), "other").prefix_digests(None, [1, 2])[0] != d[0]
    assert store.put(d[0], page(3.0)) and not store.put(d[0], page(3.0))
    assert torch.equal(store.get(d[0]), page(3.0))
    assert store.get(d[1]) is None and store.run_length(d) == 1
    store.check_integrity()
    with pytest.raises(ValueError, match="namespace"):
        store.prefix_digests(object(), [1, 2])
    with pytest.raises(ValueError, match="shape"):
        store.put(d[1], torch.zeros(3))


@pytest.mark.parametrize("damage", ["truncate", "flip_payload", "flip_header", "rename", "stale"])
def test_a_damaged_page_is_never_served(tmp_path: Path, damage: str) -> None:
    """Whatever happened to a file (torn, bit-flipped, moved under another page's name,
    written by another model), a read checks it and refuses it: a miss, and the file goes."""
    store = DiskKVStore(tmp_path, pool(), "m")
    d0, d1 = store.prefix_digests(None, [1, 2, 3, 4])
    store.put(d0, page(1.0))
    path = store.path(d0)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        path.write_bytes(bytes(data[: len(data) - 5]))
    elif damage == "flip_payload":
        data[-3] ^= 0x10
        path.write_bytes(bytes(data))
    elif damage == "flip_header":
        data[20] ^= 0x01
        path.write_bytes(bytes(data))
    elif damage == "rename":  # a whole, good page, under another prefix's name
        store.path(d1).parent.mkdir(exist_ok=True)
        os.replace(path, store.path(d1))
        path, d0 = store.path(d1), d1
    else:  # the same name written under another model's layout
        other = DiskKVStore(tmp_path / "x", pool(), "other-model")
        other_d = other.prefix_digests(None, [1, 2])[0]
        other.put(other_d, page(1.0))
        os.replace(other.path(other_d), path)
    assert store.get(d0) is None
    assert store.stats.rejected_pages == 1 and not path.exists()


def test_a_crash_mid_write_leaves_no_page(tmp_path: Path) -> None:
    """A writer killed after writing its temporary file, before the rename (``os._exit``, no
    cleanup): no page of that name exists, a reader finds nothing, and a store opened later
    removes the leftover once it is old."""
    script = textwrap.dedent(
        f"""
        import os, sys, torch
        sys.path.insert(0, {str(REPO)!r})
        from kvcache import DiskKVStore, KVCacheLayout, MHAKVCache
        pool = MHAKVCache(1, 2, 2, 4, torch.float32, KVCacheLayout.LayerFirst, "cpu", 2)
        store = DiskKVStore({str(tmp_path)!r}, pool, "m")
        os.replace = lambda *a: os._exit(3)  # the process dies just before the rename
        store.put(store.prefix_digests(None, [1, 2])[0], torch.ones(2, 2, 2, 1, 2))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert done.returncode == 3, done.stderr.decode()
    leftovers = list(tmp_path.glob("*/*.tmp"))
    assert len(leftovers) == 1 and leftovers[0].stat().st_size > 0
    store = DiskKVStore(tmp_path, pool(), "m")
    assert store.get(store.prefix_digests(None, [1, 2])[0]) is None
    assert store.page_files() == []
    assert store.remove_leftovers(older_than_s=0) == 1


def test_a_failed_write_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    store = DiskKVStore(tmp_path, pool(), "m")
    d = store.prefix_digests(None, [1, 2])[0]

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError, match="disk full"):
        store.put(d, page(1.0))
    assert not store.contains(d) and not list(tmp_path.glob("*/*.tmp"))


def tier(directory: Path, host_pages: int = 2):
    p = pool()
    alloc = PageAllocator(4, 2)
    store = DiskKVStore(directory, p, "m")
    t = TieredCacheManager(
        RadixCacheManager(page_size=2, events=True), p, alloc, host_pages, disk=store
    )
    return t, RequestFlow(t, alloc), p


def serve(flow: RequestFlow, p: MHAKVCache, tokens: list[int]) -> int:
    """Begin, store K/V = the token id at every new slot (V = -K), finish; the reused count."""
    req = flow.begin(ids(*tokens))
    new = req.indices[req.reused_len :].long()
    vals = torch.tensor(tokens[req.reused_len :], dtype=torch.float32)
    kv = vals.view(-1, 1, 1).expand(-1, 1, 2).contiguous()
    for layer in range(2):
        p.store_kv(kv, -kv, new.int(), layer)
    flow.mark_computed(req)
    flow.finish(req)
    return req.reused_len


def test_pages_the_host_gives_up_come_back_from_disk(tmp_path: Path) -> None:
    t, flow, p = tier(tmp_path)
    serve(flow, p, [1, 2, 3, 4, 5, 6])
    for other in ([11, 12, 13, 14], [21, 22, 23, 24], [31, 32, 33, 34]):
        serve(flow, p, other)  # the device and the 2-page host overflow: pages go to disk
    assert t.stats.disk_saved_pages >= 3
    assert t.peek_prefix(ids(1, 2, 3, 4, 5, 6, 0)) == 6
    req = flow.begin(ids(1, 2, 3, 4, 5, 6, 7))
    assert req.reused_len == 6 and t.stats.disk_loaded_pages >= 1
    k = p.k_cache(1).reshape(-1, 2)[req.indices[:6].long(), 0]
    assert k.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # the K/V of those very tokens
    flow.abort(req)
    t.check_integrity()
    flow.check_integrity()


def test_a_new_process_finds_what_an_earlier_one_stored(tmp_path: Path) -> None:
    """A process serves a prompt until its pages reach the disk, and exits; a new tier on the
    same directory, in this process, reuses them, K/V and all."""
    script = textwrap.dedent(
        f"""
        import sys, torch
        sys.path.insert(0, {str(REPO)!r})
        sys.path.insert(0, {str(REPO / "tests")!r})
        sys.path.insert(0, {str(REPO / "tests" / "system")!r})
        from pathlib import Path
        from test_disk_tier import serve, tier
        t, flow, p = tier(Path({str(tmp_path)!r}))
        serve(flow, p, [1, 2, 3, 4, 5, 6])
        for other in ([11, 12, 13, 14], [21, 22, 23, 24], [31, 32, 33, 34]):
            serve(flow, p, other)
        # the rest of the host goes to disk too: push out what the host still holds
        for other in ([41, 42, 43, 44], [51, 52, 53, 54]):
            serve(flow, p, other)
        print(t.stats.disk_saved_pages)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        timeout=120,
        env={**os.environ, "TRITON_INTERPRET": "0"},
    )
    assert done.returncode == 0, done.stderr.decode()
    assert int(done.stdout.split()[-1]) >= 3
    t, flow, p = tier(tmp_path)
    assert t.peek_prefix(ids(1, 2, 3, 4, 5, 6, 0)) == 6
    req = flow.begin(ids(1, 2, 3, 4, 5, 6, 7))
    assert req.reused_len == 6 and t.stats.disk_loaded_pages == 3
    k = p.k_cache(0).reshape(-1, 2)[req.indices[:6].long(), 0]
    assert k.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    flow.abort(req)
    t.disk.check_integrity()


def test_a_disk_of_another_shape_is_refused(tmp_path: Path) -> None:
    other = MHAKVCache(1, 1, 2, 4, torch.float32, KVCacheLayout.LayerFirst, "cpu", 2)
    store = DiskKVStore(tmp_path, other, "m")
    p = pool()
    with pytest.raises(ValueError, match="disk pages"):
        TieredCacheManager(
            RadixCacheManager(page_size=2, events=True), p, PageAllocator(4, 2), 2, disk=store
        )
    with pytest.raises(TypeError, match="disk"):
        TieredCacheManager(
            RadixCacheManager(page_size=2, events=True), p, PageAllocator(4, 2), 2, disk="d"
        )
