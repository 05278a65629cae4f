"""`DiskKVStore`: a third tier on local disk: K/V pages in files, found again by content.

Pages the host tier gives up (its LRU) are written here, one file per page, named by the
*content hash of their prefix*: a chain of SHA-256 digests, one per page, each over the one
before and the page's token ids, rooted in the model, the page layout and the namespace. So a
page's name says exactly which tokens, under which namespace and model, its K/V belong to, and
any process started later on the same directory finds what an earlier one stored by hashing
the prompt it serves: there is no index to keep or to lose. This is how SGLang's HiCache
storage backends (``python/sglang/srt/mem_cache/hicache_storage.py``: ``HiCacheFile`` writes a
``{key}.bin`` per page under ``SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR``, the keys chained page
hashes) and LMCache's local-disk backend address their pages.

A page is never served unless it is whole and its own:

* a write goes to a temporary file in the page's directory, is flushed and ``fsync``-ed, then
  renamed over the page's name (``os.replace``, atomic on POSIX) and the directory is
  ``fsync``-ed: a reader sees the old state or the whole new page, never part of one;
* each file carries a header: a magic number, the prefix digest it was written for, the layout
  it was written with, the payload's length and the payload's SHA-256. A read checks all of
  them before it returns anything: a torn file (a crash of a writer that did not rename, a
  truncated or flipped file), a page written under another model or layout, or a file moved
  under another name, fails the check, counts as ``rejected``, is deleted, and is a miss;
* a temporary file a crash left behind has no page's name, so no read ever finds it; a store
  opened on the directory deletes those older than a minute (`remove_leftovers`: a live writer
  holds its own for milliseconds).
"""

from __future__ import annotations

import hashlib
import os
import struct
import tempfile
import time
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..storage.mha_pool import MHAKVCache
from .host_pool import HostKVPool

__all__ = ["DiskKVStore", "DiskStats"]

_MAGIC = b"KVCPAGE1"
#: magic, prefix digest, layout digest, payload bytes, payload digest
_HEADER = struct.Struct("<8s32s32sQ32s")
_SUFFIX = ".page"
_TMP = ".tmp"


@dataclass
class DiskStats:
    """What the store did: pages written and read back, bytes each way, files refused."""

    written_pages: int = 0
    loaded_pages: int = 0
    written_bytes: int = 0
    loaded_bytes: int = 0
    rejected_pages: int = 0  # files that failed the check (torn, stale, misnamed): deleted
    leftovers_removed: int = 0  # temporary files of interrupted writes, deleted at open


def _namespace_bytes(extra_key: Hashable) -> bytes:
    """A namespace written down the same way in every process: ``None``, ``bool``, ``int``,
    ``str``, ``bytes`` and tuples of them; ``ValueError`` for anything else (its ``repr`` could
    name a memory address, which another process would not share)."""
    if extra_key is None or isinstance(extra_key, (bool, int, str, bytes)):
        return f"{type(extra_key).__name__}:{extra_key!r}".encode()
    if isinstance(extra_key, tuple):
        return b"tuple(" + b",".join(_namespace_bytes(k) for k in extra_key) + b")"
    raise ValueError(
        "the disk tier needs a namespace every process writes down alike (None, bool, int, str, "
        f"bytes, or a tuple of them), got {type(extra_key).__name__} {extra_key!r:.60}"
    )


class DiskKVStore:
    """Pages of a host pool kept in files under ``directory`` (see the module docstring).

    Args:
        directory: where the page files live (created if missing); several stores, in one
            process or many, may share it.
        like: the pool whose pages are stored (a device `MHAKVCache` or a `HostKVPool`: the
            shape and dtype of a page, ``(2, num_layers, page_size, heads, head_dim)``).
        model_id: names the model whose K/V these are; pages of another model (or layout) are
            never served, even under the same tokens.
        fsync: ``fsync`` each page and its directory (default); ``False`` only for tests and
            benchmarks that measure the page cache.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        like: MHAKVCache | HostKVPool,
        model_id: str,
        *,
        fsync: bool = True,
    ) -> None:
        if isinstance(like, MHAKVCache):
            shape = (2, like.num_layers, like.page_size, like.local_kv_heads, like.head_dim)
        elif isinstance(like, HostKVPool):
            shape = like.page_shape
        else:
            raise TypeError(
                f"like must be an MHAKVCache or a HostKVPool, got {type(like).__name__}"
            )
        if not isinstance(model_id, str) or not model_id:
            raise ValueError(f"model_id must be a non-empty str, got {model_id!r}")
        if not isinstance(fsync, bool):
            raise TypeError(f"fsync must be a bool, got {type(fsync).__name__}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.page_shape: tuple[int, ...] = shape
        self.dtype = like.dtype if isinstance(like, MHAKVCache) else like.buffer.dtype
        self.page_size = like.page_size
        self.page_bytes = int(np.prod(shape)) * self.dtype.itemsize
        self.fsync = fsync
        self.model_id = model_id
        layout = f"{model_id}|{self.page_shape}|{self.dtype}".encode()
        self.layout = hashlib.sha256(layout).digest()
        self.stats = DiskStats()
        self.remove_leftovers()

    # ------------------------------------------------------------------ names
    def prefix_digests(self, extra_key: Hashable, tokens: np.ndarray | torch.Tensor) -> list[bytes]:
        """The digest of every whole page of ``tokens`` under ``extra_key``: digest ``i`` names
        the prefix ``tokens[:(i + 1) * page_size]`` (chained: each over the one before)."""
        arr = np.asarray(tokens.numpy() if isinstance(tokens, torch.Tensor) else tokens)
        arr = arr.astype("<i8", copy=False)
        ps = self.page_size
        h = hashlib.sha256(self.layout + _namespace_bytes(extra_key)).digest()
        out = []
        for i in range(len(arr) // ps):
            h = hashlib.sha256(h + arr[i * ps : (i + 1) * ps].tobytes()).digest()
            out.append(h)
        return out

    def path(self, digest: bytes) -> Path:
        """The file of the page named ``digest`` (32 bytes, from `prefix_digests`)."""
        if not isinstance(digest, bytes) or len(digest) != 32:
            raise TypeError(f"digest must be 32 bytes from prefix_digests, got {digest!r:.40}")
        name = digest.hex()
        return self.directory / name[:2] / (name + _SUFFIX)

    def contains(self, digest: bytes) -> bool:
        """Whether a file of that name exists (it is checked only when read)."""
        return self.path(digest).is_file()

    def run_length(self, digests: list[bytes]) -> int:
        """How many of ``digests``, from the first on, have a file (a look, nothing read)."""
        n = 0
        while n < len(digests) and self.contains(digests[n]):
            n += 1
        return n

    # ------------------------------------------------------------------ write
    def put(self, digest: bytes, page: torch.Tensor) -> bool:
        """Write one page (``page_shape`` of ``dtype``, from `HostKVPool.read`) under
        ``digest``; ``False`` when a file of that name is there already (same prefix, same
        model: the same K/V). All or nothing: a failure leaves no file under the name (nor a
        temporary one, unless the process dies)."""
        if not isinstance(page, torch.Tensor) or tuple(page.shape) != self.page_shape:
            got = tuple(page.shape) if isinstance(page, torch.Tensor) else type(page).__name__
            raise ValueError(f"page must have shape {self.page_shape}, got {got}")
        if page.dtype != self.dtype:
            raise ValueError(f"page must have dtype {self.dtype}, got {page.dtype}")
        final = self.path(digest)
        if final.is_file():
            return False
        payload = page.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
        header = _HEADER.pack(
            _MAGIC, digest, self.layout, len(payload), hashlib.sha256(payload).digest()
        )
        final.parent.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=final.stem, suffix=_TMP)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(header)
                f.write(payload)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        if self.fsync:
            self._fsync_dir(final.parent)
        self.stats.written_pages += 1
        self.stats.written_bytes += len(payload)
        return True

    @staticmethod
    def _fsync_dir(directory: Path) -> None:
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ read
    def get(self, digest: bytes) -> torch.Tensor | None:
        """The page stored under ``digest`` (``page_shape``, on the CPU), or ``None``: no file,
        or one that fails the check (then it is deleted and counted in ``rejected_pages``)."""
        final = self.path(digest)
        try:
            data = final.read_bytes()
        except FileNotFoundError:
            return None
        page = self._checked(data, digest)
        if page is None:
            self.stats.rejected_pages += 1
            final.unlink(missing_ok=True)
            return None
        self.stats.loaded_pages += 1
        self.stats.loaded_bytes += self.page_bytes
        return page

    def _checked(self, data: bytes, digest: bytes) -> torch.Tensor | None:
        if len(data) != _HEADER.size + self.page_bytes:
            return None
        magic, name, layout, size, sha = _HEADER.unpack_from(data)
        payload = data[_HEADER.size :]
        if magic != _MAGIC or name != digest or layout != self.layout or size != len(payload):
            return None
        if hashlib.sha256(payload).digest() != sha:
            return None
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return flat.view(self.dtype).reshape(self.page_shape)

    # ------------------------------------------------------------------ the directory
    def remove_leftovers(self, older_than_s: float = 60.0) -> int:
        """Delete the temporary files of interrupted writes (no page has their name) last
        modified more than ``older_than_s`` seconds ago; returns how many."""
        now, removed = time.time(), 0
        for tmp in self.directory.glob(f"*/*{_TMP}"):
            try:
                if now - tmp.stat().st_mtime >= older_than_s:
                    tmp.unlink()
                    removed += 1
            except FileNotFoundError:  # another store removed it, or its writer renamed it
                continue
        self.stats.leftovers_removed += removed
        return removed

    def page_files(self) -> list[Path]:
        """Every page file under the directory (of any model; checked only when read)."""
        return sorted(self.directory.glob(f"*/*{_SUFFIX}"))

    def check_integrity(self) -> None:
        """``RuntimeError`` when a page file of this store's layout fails its check (other
        models' files are skipped). Reads every file: for tests, not for serving."""
        for path in self.page_files():
            data = path.read_bytes()
            if len(data) < _HEADER.size:
                raise RuntimeError(f"{path}: shorter than a page header")
            _, name, layout, _, _ = _HEADER.unpack_from(data)
            if layout != self.layout:
                continue
            if path.name != name.hex() + _SUFFIX or self._checked(data, name) is None:
                raise RuntimeError(f"{path}: fails its content check")
