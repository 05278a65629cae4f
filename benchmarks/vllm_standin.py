"""A small stand-in for vLLM's automatic prefix caching, to time `BlockHashCacheManager` against.

Our own code, written from vLLM's published design (``vllm/v1/core``: ``kv_cache_utils``,
``block_pool``, ``kv_cache_manager``), not copied from it:

- a block's hash is ``sha256(pickle.dumps((parent_hash, tokens, extra_keys)))`` (vLLM's
  ``sha256`` hash function: a 32-byte digest; block 0 chains from a fixed ``NONE_HASH``);
- ``hash -> block`` in a dict (``cached_block_hash_to_block``); a hit trusts the hash (SHA-256),
  no token comparison;
- free blocks in a doubly linked list (``FreeKVCacheBlockQueue``): a hit ``touch``es its blocks
  (removed from the list, ``ref_cnt += 1``), a finished request frees its blocks in reverse order
  (appended at the tail), and eviction pops from the head;
- ``Request.block_hashes``: the hashes of a request's full blocks are computed once, when the
  request arrives, and extended as it grows (``hash_once=True``, vLLM's design); with
  ``hash_once=False`` they are computed in ``match_prefix`` and again in ``insert_prefix``.

It speaks this package's `BaseCacheManager` API so that the same `RequestFlow` drives both. A
request is recognised at insert by its tokens (its first block, then an exact comparison of the
whole remembered prefix), which is what carrying ``block_hashes`` on a request object amounts to.
Converting the API's tensors (token ids to a list, pages to a slot tensor) is timed separately in
``boundary_seconds``: vLLM's own manager receives lists and returns block ids.
"""

from __future__ import annotations

import hashlib
import pickle
import time
from dataclasses import dataclass

import numpy as np
import torch

from kvcache import BaseCacheHandle, BaseCacheManager, SizeInfo

__all__ = ["VllmStandIn", "StandInHandle"]

NONE_HASH = hashlib.sha256(b"kvcache stand-in NONE_HASH").digest()


def sha256_block_hash(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    return hashlib.sha256(
        pickle.dumps((parent, tokens, None), protocol=pickle.HIGHEST_PROTOCOL)
    ).digest()


class _Block:
    __slots__ = ("block_hash", "next", "page", "prev", "ref_cnt")

    def __init__(self, page: int, block_hash: bytes) -> None:
        self.page = page
        self.ref_cnt = 0
        self.block_hash = block_hash
        self.prev: _Block | None = None
        self.next: _Block | None = None


class _FreeQueue:
    """vLLM's free-block list: doubly linked, O(1) remove/append/popleft, with sentinels."""

    def __init__(self) -> None:
        self.head = _Block(-1, b"")
        self.tail = _Block(-1, b"")
        self.head.next, self.tail.prev = self.tail, self.head
        self.num_free = 0

    def append(self, block: _Block) -> None:
        last = self.tail.prev
        last.next, block.prev, block.next, self.tail.prev = block, last, self.tail, block  # type: ignore[union-attr]
        self.num_free += 1

    def remove(self, block: _Block) -> None:
        block.prev.next, block.next.prev = block.next, block.prev  # type: ignore[union-attr]
        block.prev = block.next = None
        self.num_free -= 1

    def popleft(self) -> _Block:
        block = self.head.next
        self.remove(block)  # type: ignore[arg-type]
        return block  # type: ignore[return-value]


@dataclass(frozen=True)
class StandInHandle(BaseCacheHandle):
    blocks: tuple[_Block, ...] = ()


class VllmStandIn(BaseCacheManager):
    """vLLM-style prefix cache behind the `BaseCacheManager` API (see the module docstring)."""

    def __init__(self, device: str = "cpu", page_size: int = 16, *, hash_once: bool = True) -> None:
        self.device = torch.device(device)
        self.page_size = page_size
        self.hash_once = hash_once
        self.boundary_seconds = 0.0
        self.hash_seconds = 0.0  # inside the SHA-256 loop (vLLM hashes when a request arrives)
        self.clock = time.perf_counter  # what boundary_seconds is measured with
        self.reset()

    def reset(self) -> None:
        self.cached: dict[bytes, _Block] = {}
        self.free = _FreeQueue()
        self.num_locked = 0
        self.requests: dict[
            tuple[int, ...], tuple[list[int], list[bytes]]
        ] = {}  # first block -> request

    # --------------------------------------------------------- boundary
    def _tokens(self, input_ids: torch.Tensor) -> list[int]:
        t0 = self.clock()
        out = input_ids.numpy().tolist()
        self.boundary_seconds += self.clock() - t0
        return out

    def _slots(self, blocks: list[_Block]) -> torch.Tensor:
        t0 = self.clock()
        ps = self.page_size
        pages = np.fromiter([b.page for b in blocks], dtype=np.int64, count=len(blocks))
        out = torch.from_numpy((pages[:, None] * ps + np.arange(ps)).reshape(-1).astype(np.int32))
        self.boundary_seconds += self.clock() - t0
        return out

    # ------------------------------------------------------------ hashes
    def _block_hashes(self, ids: list[int]) -> list[bytes]:
        """``Request.block_hashes``: every full block's hash, reusing the request's earlier ones."""
        ps = self.page_size
        nb = len(ids) // ps
        if nb == 0:
            return []
        known: list[bytes] = []
        key = tuple(ids[:ps])
        if self.hash_once and key in self.requests:
            old_ids, old_hashes = self.requests[key]
            n = min(len(old_hashes), nb)
            if old_ids[: n * ps] == ids[: n * ps]:
                known = old_hashes[:n]
        hashes = list(known)
        parent = hashes[-1] if hashes else NONE_HASH
        t0 = self.clock()
        for i in range(len(hashes), nb):
            parent = sha256_block_hash(parent, tuple(ids[i * ps : (i + 1) * ps]))
            hashes.append(parent)
        self.hash_seconds += self.clock() - t0
        if self.hash_once:
            self.requests[key] = (ids, hashes)
        return hashes

    def _computed(self, hashes: list[bytes]) -> list[_Block]:
        out = []
        for h in hashes:
            block = self.cached.get(h)
            if block is None:
                break
            out.append(block)
        return out

    # ------------------------------------------------------------ the API
    def match_prefix(self, input_ids: torch.Tensor) -> tuple[StandInHandle, torch.Tensor]:
        blocks = self._computed(self._block_hashes(self._tokens(input_ids)))
        return StandInHandle(len(blocks) * self.page_size, tuple(blocks)), self._slots(blocks)

    def lock_handle(self, handle: BaseCacheHandle, unlock: bool = False) -> None:
        blocks = handle.blocks  # type: ignore[attr-defined]
        if unlock:  # free: in reverse order, so the tail of a chain is evicted first
            for block in reversed(blocks):
                block.ref_cnt -= 1
                if block.ref_cnt == 0:
                    self.free.append(block)
                    self.num_locked -= 1
        else:  # touch
            for block in blocks:
                if block.ref_cnt == 0:
                    self.free.remove(block)
                    self.num_locked += 1
                block.ref_cnt += 1

    def insert_prefix(self, input_ids: torch.Tensor, indices: torch.Tensor) -> int:
        """``cache_full_blocks``: the new full blocks join the table; returns the length already cached."""
        ps = self.page_size
        hashes = self._block_hashes(self._tokens(input_ids))
        m = len(self._computed(hashes))
        t0 = self.clock()
        pages = (indices[m * ps : len(hashes) * ps : ps].numpy() // ps).tolist()
        self.boundary_seconds += self.clock() - t0
        new = []
        for h, page in zip(hashes[m:], pages, strict=True):
            block = _Block(page, h)
            self.cached[h] = block
            new.append(block)
        for block in reversed(new):  # held by the request until it ends: freed deepest first
            self.free.append(block)
        return m * ps

    def evict(self, size: int) -> torch.Tensor:
        n = -(-size // self.page_size)
        if n > self.free.num_free:
            raise RuntimeError(f"cannot evict {size} tokens")
        victims = [self.free.popleft() for _ in range(n)]
        for block in victims:
            del self.cached[block.block_hash]
        return self._slots(victims) if victims else torch.empty(0, dtype=torch.int32)

    @property
    def size_info(self) -> SizeInfo:
        return SizeInfo(self.free.num_free * self.page_size, self.num_locked * self.page_size)

    def cached_indices(self) -> torch.Tensor:
        return (
            self._slots(list(self.cached.values()))
            if self.cached
            else torch.empty(0, dtype=torch.int32)
        )

    def check_integrity(self) -> None:
        pass
