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
  request arrives (here: its ``match_prefix``; every block of the prompt, as vLLM's
  ``Request.__init__`` does, even when an earlier request had the same prefix), and extended as
  it grows (its insert hashes only the blocks past them) (``hash_once=True``, vLLM's design);
  with ``hash_once=False`` they are computed in ``match_prefix`` and again in ``insert_prefix``;
- a block an insert finds already cached, past those the request holds: vLLM's
  ``cache_full_blocks`` caches the request's own copy as well (no de-duplication) and the
  request frees it after its new blocks; this API keeps one copy, so that one takes the place of
  the request's (moved to the tail, deepest first, after the new blocks).

It speaks this package's `BaseCacheManager` API so that the same `RequestFlow` drives both. A
request is recognised at insert by its tokens (its first block, then an exact comparison of the
whole remembered prefix), which is what carrying ``block_hashes`` on a request object amounts to.
Converting the API's tensors (token ids to a list; pages to a slot tensor) and finding the request's
record are timed separately in ``boundary_seconds``: vLLM's own manager receives lists and a
request object and returns block ids.

Per block it does no more than vLLM, and in places less: a lookup is one dict probe (vLLM also
builds a ``BlockHashWithGroupId`` key and goes through ``BlockHashToBlockMap.get_one_block``);
an insert starts past the blocks its match found (vLLM's ``num_cached_blocks``) instead of
walking them again; ``insert_and_match`` returns the chain it just built, without a second
lookup (vLLM's ``cache_full_blocks`` looks nothing up); a page's block object is made once and
reused, as in vLLM's ``BlockPool``.
"""

from __future__ import annotations

import hashlib
import pickle
import time
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np
import torch

from kvcache.managers import BaseCacheHandle, BaseCacheManager, InsertResult, SizeInfo

__all__ = ["VllmStandIn", "StandInHandle"]

NONE_HASH = hashlib.sha256(b"kvcache stand-in NONE_HASH").digest()


def _default_namespace_only(extra_key: Hashable) -> None:
    """The stand-in serves the default namespace only (vLLM's ``cache_salt`` left out)."""
    if extra_key is not None:
        raise ValueError(f"the vLLM stand-in serves only extra_key=None, got {extra_key!r}")


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
        # One block object per page, made once and reused (vLLM's BlockPool makes one
        # KVCacheBlock per GPU block up front; caching a block sets its hash, evicting resets it).
        self.pool: list[_Block] = []
        # first block -> (ids, block hashes, blocks found cached by the last match)
        self.requests: dict[tuple[int, ...], tuple[list[int], list[bytes], list[_Block]]] = {}

    # --------------------------------------------------------- boundary
    def _tokens(self, input_ids: torch.Tensor) -> list[int]:
        t0 = self.clock()
        out: list[int] = input_ids.numpy().tolist()
        self.boundary_seconds += self.clock() - t0
        return out

    def _slots(self, blocks: list[_Block]) -> torch.Tensor:
        t0 = self.clock()
        ps = self.page_size
        pages = np.fromiter([b.page for b in blocks], dtype=np.int64, count=len(blocks))
        out = (pages[:, None] * ps + np.arange(ps)).reshape(-1).astype(np.int32)
        self.boundary_seconds += self.clock() - t0
        return torch.from_numpy(out)

    # ------------------------------------------------------------ hashes
    def _block_hashes(self, ids: list[int], arrival: bool) -> tuple[list[bytes], list[_Block]]:
        """``Request.block_hashes``: every full block's hash, reusing the request's earlier ones
        unless it has just ``arrival``-ed; and the blocks the request's match found (held by it
        while it runs)."""
        ps = self.page_size
        nb = len(ids) // ps
        if nb == 0:
            return [], []
        t0 = self.clock()  # finding the request: vLLM is handed the request object
        known: list[bytes] = []
        held: list[_Block] = []
        key = tuple(ids[:ps])
        if self.hash_once and not arrival and key in self.requests:
            old_ids, old_hashes, old_held = self.requests[key]
            n = min(len(old_hashes), nb)
            if old_ids[: n * ps] == ids[: n * ps]:
                known = old_hashes[:n]
                held = old_held[: min(n, len(old_held))]
                # Still those blocks? (Handed the request, vLLM knows; here its record may be
                # older than an eviction that gave the pages to other blocks.)
                if held and any(b.block_hash != h for b, h in zip(held, known, strict=False)):
                    held = []
        self.boundary_seconds += self.clock() - t0
        hashes = list(known)
        parent = hashes[-1] if hashes else NONE_HASH
        t0 = self.clock()
        for i in range(len(hashes), nb):
            parent = sha256_block_hash(parent, tuple(ids[i * ps : (i + 1) * ps]))
            hashes.append(parent)
        self.hash_seconds += self.clock() - t0
        return hashes, held

    def _computed(self, hashes: list[bytes], start: int = 0) -> list[_Block]:
        out = []
        for h in hashes[start:] if start else hashes:
            block = self.cached.get(h)
            if block is None:
                break
            out.append(block)
        return out

    # ------------------------------------------------------------ the API
    def _remember(self, ids: list[int], hashes: list[bytes], blocks: list[_Block]) -> None:
        if self.hash_once and hashes:
            t0 = self.clock()
            self.requests[tuple(ids[: self.page_size])] = (ids, hashes, blocks)
            self.boundary_seconds += self.clock() - t0

    def match_prefix(
        self, input_ids: torch.Tensor, extra_key: Hashable = None
    ) -> tuple[StandInHandle, torch.Tensor]:
        _default_namespace_only(extra_key)
        ids = self._tokens(input_ids)
        hashes, _ = self._block_hashes(ids, arrival=True)
        blocks = self._computed(hashes)
        self._remember(ids, hashes, blocks)
        slots = self._slots(blocks)
        return StandInHandle(len(blocks) * self.page_size, tuple(blocks)), slots

    def lock_handle(self, handle: BaseCacheHandle, unlock: bool = False) -> None:
        if not isinstance(handle, StandInHandle):
            raise TypeError(f"not a handle of this manager: {handle!r}")
        blocks = handle.blocks
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

    # The flow's fused calls: the same work as the separate calls (vLLM's allocate_slots looks
    # up and touches in one call; its request's end caches and frees).
    def match_and_lock(
        self, input_ids: torch.Tensor, extra_key: Hashable = None
    ) -> tuple[StandInHandle, torch.Tensor]:
        handle, slots = self.match_prefix(input_ids, extra_key)
        self.lock_handle(handle)
        return handle, slots

    def insert_and_unlock(
        self,
        handle: BaseCacheHandle,
        input_ids: torch.Tensor,
        indices: torch.Tensor,
        extra_key: Hashable = None,
        *,
        relock: bool = False,
    ) -> InsertResult:
        res = self.insert_and_match(input_ids, indices, extra_key)
        if relock:
            self.lock_handle(res.handle)
        self.lock_handle(handle, unlock=True)
        return res

    def insert_prefix(
        self, input_ids: torch.Tensor, indices: torch.Tensor, extra_key: Hashable = None
    ) -> int:
        """``cache_full_blocks``: the new full blocks join the table; returns the length
        already cached."""
        _default_namespace_only(extra_key)
        return self._insert(input_ids, indices)[0]

    def insert_and_match(
        self, input_ids: torch.Tensor, indices: torch.Tensor, extra_key: Hashable = None
    ) -> InsertResult:
        """The insert, and a handle on the chain it leaves cached (no second lookup)."""
        _default_namespace_only(extra_key)
        m, blocks = self._insert(input_ids, indices)
        return InsertResult(m, StandInHandle(len(blocks) * self.page_size, tuple(blocks)))

    def _insert(self, input_ids: torch.Tensor, indices: torch.Tensor) -> tuple[int, list[_Block]]:
        ps = self.page_size
        ids = self._tokens(input_ids)
        hashes, held = self._block_hashes(ids, arrival=False)
        # vLLM's num_cached_blocks: the blocks the request's match found are held by it (locked),
        # so they are still cached; look up only past them (to learn what another request added).
        if not held or held[-1].ref_cnt == 0:
            held = []
        blocks = held + self._computed(hashes, len(held))
        m = len(blocks)
        t0 = self.clock()
        cut = indices[m * ps : len(hashes) * ps : ps]
        pages: list[int] = (cut.numpy() // ps).tolist()
        self.boundary_seconds += self.clock() - t0
        new = []
        pool = self.pool
        if pages and max(pages) >= len(pool):
            pool.extend(_Block(i, b"") for i in range(len(pool), max(pages) + 1))
        for h, page in zip(hashes[m:], pages, strict=True):
            block = pool[page]
            block.block_hash = h
            block.ref_cnt = 0
            self.cached[h] = block
            new.append(block)
        for block in reversed(new):  # held by the request until it ends: freed deepest first
            self.free.append(block)
        # Cached blocks this request computed again, past those it held (another request cached
        # them meanwhile, or its match stopped one token short): vLLM caches the request's own
        # copies too (it never de-duplicates) and frees them with the request, after its new
        # blocks, so the content stays cached until that copy goes; the older copy's eviction
        # later frees a page and loses nothing. This API keeps one copy (the caller frees its
        # duplicate pages): it takes the place of the request's.
        for block in reversed(blocks[len(held) :]):
            if block.ref_cnt == 0:
                self.free.remove(block)
                self.free.append(block)
        blocks += new
        self._remember(ids, hashes, blocks)
        return m * ps, blocks

    def evict(self, size: int) -> torch.Tensor:
        n = -(-size // self.page_size)
        if n > self.free.num_free:
            raise RuntimeError(f"cannot evict {size} tokens")
        victims = [self.free.popleft() for _ in range(n)]
        for block in victims:
            del self.cached[block.block_hash]
            block.block_hash = b""  # vLLM's reset_hash
        return self._slots(victims)

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
