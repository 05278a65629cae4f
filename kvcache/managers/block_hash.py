"""`BlockHashCacheManager`: prefix caching by chained block hashes, as in vLLM and nano-vllm.

A *block* is one page of ``page_size`` tokens. Only full blocks are cached. Block ``i`` of a
sequence is named by a chained hash, ``hash(block i) = H(hash(block i-1), tokens of block i)``
(block 0 chains from a fixed seed), so one hash names a block *and its whole prefix*: looking up
the blocks of a prompt one after another and stopping at the first miss finds the longest cached
prefix without any tree. The manager keeps:

- ``hash -> CachedBlock``: the page, the tokens, the parent's hash, a ref count, a child count and
  the logical time of last use;
- a *free queue* (an ``OrderedDict``) of the blocks whose ref count is 0. It is also the eviction
  order: ``evict`` takes blocks from its head;
- the locked handles and how often each is locked, so that unlocking a handle that is not locked
  is refused even while its blocks are locked through another handle.

Speed. The default hash (`block_hash_chain`) is computed for every block of a sequence at once
with a few NumPy passes; a lookup is then one dict probe per block, and the parents and tokens of
the whole matched chain are compared in one go each (`block_lookup.walk`). A request's hashes
and matched chain are remembered from `match_prefix` to its insert (`block_lookup.RequestHashes`,
vLLM's ``Request.block_hashes``), so the insert hashes only new tokens and re-walks nothing still
cached. Slots are built in NumPy; an insert validates its new blocks only. A handle carries the
blocks it was made for, so locking one made since the last eviction re-checks nothing, and a
match's LRU refresh waits for the next call, which skips it when it locks that very chain.

Collisions: see `block_lookup`. Eviction rule: see `block_evict`; ``check_integrity`` verifies the free queue's order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from itertools import repeat
from operator import attrgetter

import numpy as np
import torch

from .._validate import check_count, check_indices, check_positive_int, check_token_ids
from .base import BaseCacheHandle, BaseCacheManager, InsertResult, SizeInfo
from .block_evict import evict_blocks
from .block_hash_chain import (
    ROOT_HASH_SEED,
    ChainHasher,
    HashFn,
    default_block_hash,
    key_seed,
    token_array,
)
from .block_lookup import RequestHashes, walk
from .block_pool import (
    BlockHashCacheHandle,
    CachedBlock,
    chain_slots,
    check_pool,
    handle_chain,
    lock_blocks,
    new_blocks,
    new_pages,
    release_blocks,
)
from .cache_events import CacheEvent, EventLog, check_extra_key, events_off

__all__ = [
    "CachedBlock",
    "BlockHashCacheHandle",
    "BlockHashCacheManager",
    "ROOT_HASH_SEED",
    "default_block_hash",
]

_KEY = attrgetter("block_hash")


class BlockHashCacheManager(BaseCacheManager):
    """Prefix cache over full blocks named by chained hashes, with ref counts and an LRU free queue.

    Args:
        device: where the KV-slot indices live (values returned by ``match_prefix``/``evict``).
        page_size: tokens per block (= per page); only whole blocks are matched and cached.
        hash_fn: ``hash_fn(parent_hash, tokens) -> int``, the chained block hash (keyword only;
            default `default_block_hash`, computed for a whole sequence at once). ``tokens`` is a
            tuple of ints. A deliberately weak one (say ``lambda p, t: 0``) exercises the
            collision handling; results stay correct, lookups get slower.
        events: keep the log `take_events` returns (keyword only; off by default: no cost).

    Namespaces: a chain under ``extra_key`` starts from `key_seed` (not `ROOT_HASH_SEED`);
    each block keeps the key, compared on every hit.
    """

    def __init__(
        self,
        device: torch.device | str = "cpu",
        page_size: int = 16,
        *,
        hash_fn: HashFn | None = None,
        events: bool = False,
    ) -> None:
        check_positive_int(page_size, "page_size")
        if not isinstance(events, bool):
            raise TypeError(f"events must be a bool, got {type(events).__name__}")
        if hash_fn is not None and not callable(hash_fn):
            raise TypeError(f"hash_fn must be callable, got {type(hash_fn).__name__}")
        self.device = torch.device(device)
        self.page_size = page_size
        self._hasher = ChainHasher(page_size, hash_fn)
        self.hash_fn: HashFn = self._hasher.hash_fn
        self.empty_tensor = torch.empty(0, dtype=torch.int32, device=self.device)
        self._offsets = np.arange(page_size, dtype=np.int32)
        self._clock = 0
        self._token = object()  # names this manager in the handles it makes
        self._epoch = 0  # bumped whenever a block leaves the cache
        self._events = EventLog() if events else None
        self._init_state()

    # ------------------------------------------------------------------ state
    def _init_state(self) -> None:
        self._blocks: dict[int, CachedBlock] = {}
        self._free: OrderedDict[int, None] = OrderedDict()  # head = next to evict
        self._page_owner: dict[int, int] = {}  # page -> block hash
        self._num_locked = 0  # blocks with ref_count > 0
        self._max_probe = 0
        # locked handle -> (times locked, the blocks it locked)
        self._locks: dict[BlockHashCacheHandle, tuple[int, tuple[CachedBlock, ...]]] = {}
        self._pending = RequestHashes(self.page_size)
        # A match's refresh of the LRU order (chain, clock), applied by the next call unless that
        # call locks the very chain: the flow matches and locks at once, and a lock takes the
        # blocks out of the queue anyway.
        self._touch: tuple[tuple[CachedBlock, ...], int] | None = None
        self._epoch += 1

    @property
    def size_info(self) -> SizeInfo:
        ps = self.page_size
        return SizeInfo(evictable_size=len(self._free) * ps, protected_size=self._num_locked * ps)

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def clock(self) -> int:
        """The logical clock: incremented by every ``match_prefix`` and ``insert_prefix``."""
        return self._clock

    @property
    def max_probe(self) -> int:
        """The largest collision offset ever used (0 while no two blocks' hashes have collided)."""
        return self._max_probe

    def blocks(self) -> Iterator[CachedBlock]:
        """Every cached block, in insertion order (a parent before its children)."""
        self._flush()
        return iter(list(self._blocks.values()))

    def get_block(self, block_hash: int) -> CachedBlock | None:
        self._flush()
        return self._blocks.get(block_hash)

    def free_queue(self) -> list[int]:
        """Hashes of the evictable blocks in eviction order (head first)."""
        self._flush()
        return list(self._free)

    def locked_handles(self) -> dict[BlockHashCacheHandle, int]:
        """Each locked handle and how many times it is locked (a copy)."""
        return {h: n for h, (n, _) in self._locks.items()}

    def _slots(self, chain: Sequence[CachedBlock]) -> torch.Tensor:
        """The slots of ``chain``'s pages, block after block (1-D int32 on ``device``)."""
        return chain_slots(chain, self._offsets, self.device) if chain else self.empty_tensor

    def cached_indices(self) -> torch.Tensor:
        return self._slots(list(self._blocks.values()))

    def reset(self) -> None:
        self._flush()
        if self._num_locked:
            raise RuntimeError(
                f"cannot reset while {self._num_locked * self.page_size} tokens are locked; "
                "unlock every handle first"
            )
        self._init_state()
        if self._events is not None:
            self._events.cleared()

    def take_events(self) -> list[CacheEvent]:
        """What was stored, removed and cleared since the last call, oldest first; empties the log.

        ``RuntimeError`` unless the manager was built with ``events=True``.
        """
        if self._events is None:
            raise events_off(type(self).__name__)
        return self._events.take()

    # ----------------------------------------------------------- lookups
    def _rows(self, input_ids: torch.Tensor) -> np.ndarray:
        """The full blocks of ``input_ids`` (validated) as an ``(n, page_size)`` int64 array."""
        ids = token_array(check_token_ids(input_ids))
        nb = len(ids) // self.page_size
        return ids[: nb * self.page_size].reshape(nb, self.page_size)

    def _flush(self) -> None:
        """Apply the last match's deferred LRU refresh, if any."""
        if self._touch is not None:
            chain, tic = self._touch
            self._touch = None
            self._use(chain, tic)

    def _use(self, chain: Sequence[CachedBlock], tic: int) -> None:
        """Mark ``chain`` used at ``tic``: its free blocks move to the queue's tail, deepest first."""
        move = self._free.move_to_end
        for block in reversed(chain):
            if block.ref_count:
                break  # locked blocks are a prefix of any chain; their release sets ``last_use``
            block.last_use = tic
            move(block.block_hash)

    def _handle(self, chain: list[CachedBlock]) -> BlockHashCacheHandle:
        hashes = tuple(map(_KEY, chain))
        return BlockHashCacheHandle(
            len(chain) * self.page_size, hashes, tuple(chain), (self._token, self._epoch, hashes)
        )

    # ------------------------------------------------------------- public
    def match_prefix(
        self, input_ids: torch.Tensor, extra_key: Hashable = None
    ) -> tuple[BlockHashCacheHandle, torch.Tensor]:
        """Longest chain of full blocks of ``input_ids`` cached under ``extra_key``, and its slots.

        Not read-only: the matched blocks count as used (they move to the tail of the free queue).
        """
        rows = self._rows(input_ids)
        if extra_key is None:
            hashes = self._hasher.chain(rows)
        else:
            hashes = self._hasher.chain(rows, key_seed(check_extra_key(extra_key)))
        self._flush()
        chain = walk(self._blocks, self._max_probe, rows, hashes, (), extra_key)
        self._pending.remember(rows, hashes, chain, extra_key)
        self._clock += 1
        handle = self._handle(chain)
        if chain:
            self._touch = (handle.blocks, self._clock)
        return handle, self._slots(chain)

    def insert_prefix(
        self, input_ids: torch.Tensor, indices: torch.Tensor, extra_key: Hashable = None
    ) -> int:
        """Cache the full blocks of ``input_ids`` (at ``indices``) under ``extra_key``; return
        the length already cached there.

        Only the blocks past the cached prefix are added (each takes the page of its indices);
        ``indices[:returned]`` (duplicates of cached blocks) and the tail past the last full block
        stay the caller's, to free or keep, and are not inspected. New blocks are evictable until
        a handle covering them is locked. Each new block's indices must be the ``page_size``
        consecutive slots of one page, and its page must not already belong to the cache.
        Everything that can raise (including ``hash_fn``) runs before anything changes.
        """
        return self._insert(input_ids, indices, extra_key)[0]

    def insert_and_match(
        self, input_ids: torch.Tensor, indices: torch.Tensor, extra_key: Hashable = None
    ) -> InsertResult:
        """`insert_prefix` and the (unlocked) handle on the whole inserted chain, in one walk."""
        cached, chain = self._insert(input_ids, indices, extra_key)
        return InsertResult(cached, self._handle(chain))

    def _insert(
        self, input_ids: torch.Tensor, indices: torch.Tensor, extra_key: Hashable
    ) -> tuple[int, list[CachedBlock]]:
        rows = self._rows(input_ids)
        if extra_key is not None:
            check_extra_key(extra_key)
        check_indices(indices, self.device)
        if indices.shape[0] != input_ids.shape[0]:
            raise ValueError(
                f"len(indices) ({len(indices)}) must equal len(input_ids) ({len(input_ids)})"
            )
        self._flush()
        hashes, known = self._pending.recall(rows, self._blocks, self._hasher, extra_key)
        chain = walk(self._blocks, self._max_probe, rows, hashes, known, extra_key)
        ps, m, nb = self.page_size, len(chain), len(rows)
        if m == nb:
            self._clock += 1
            self._use(chain, self._clock)
            self._pending.remember(rows, hashes, chain, extra_key)
            return m * ps, chain
        pages = new_pages(indices[m * ps : nb * ps], ps, self._page_owner)
        # Validation done; from here on nothing raises.
        self._clock += 1
        tic = self._clock
        parent = chain[-1].block_hash if m else None
        keys, created, probe_max = new_blocks(
            hashes[m:], parent, rows[m:], pages, self._blocks, self._max_probe, tic, extra_key
        )
        if m:
            chain[-1].num_children += 1
        self._blocks.update(zip(keys, created, strict=True))
        self._page_owner.update(zip(pages, keys, strict=True))
        self._free.update(zip(reversed(keys), repeat(None)))  # deepest first
        self._max_probe = probe_max
        self._use(chain, tic)
        chain += created
        self._pending.remember(rows, hashes, chain, extra_key)
        if self._events is not None:
            slots = indices[m * ps : nb * ps]
            self._events.stored(extra_key, rows.reshape(-1).tolist(), slots.tolist())
        return m * ps, chain

    def _chain(self, handle: BaseCacheHandle) -> tuple[CachedBlock, ...]:
        """The blocks behind ``handle``, root first, after checking the handle names them."""
        return handle_chain(handle, self._blocks, self.page_size, (self._token, self._epoch))

    def handle_indices(self, handle: BaseCacheHandle) -> torch.Tensor:
        """The slots of the prefix behind ``handle`` (read-only: the LRU order does not change)."""
        return self._slots(self._chain(handle))

    def lock_handle(self, handle: BaseCacheHandle, unlock: bool = False) -> None:
        """Lock (``ref_count += 1``) or unlock every block of ``handle``.

        Unlocking a handle that is not locked (never locked, or unlocked as often as locked)
        raises ``RuntimeError``, even while its blocks are locked through another handle. A block
        whose count drops to 0 joins the tail of the free queue; the chain is released deepest
        block first, so its tail is evicted before its head. A handle of length 0 needs no
        protection: nothing happens.
        """
        if not isinstance(unlock, bool):
            raise TypeError(f"unlock must be a bool, got {type(unlock).__name__}")
        if unlock:
            self._unlock(handle)
            return
        chain = self._chain(handle)
        if not chain:
            return
        if self._touch is not None:
            if self._touch[0] is chain:
                self._touch = None  # the lock takes the matched blocks out of the queue: moot
            else:
                self._flush()
        record = self._locks.get(handle)  # type: ignore[call-overload]
        self._locks[handle] = (record[0] + 1, record[1]) if record else (1, chain)  # type: ignore[index]
        self._num_locked += lock_blocks(chain, self._free)

    def _unlock(self, handle: BaseCacheHandle) -> None:
        if not isinstance(handle, BlockHashCacheHandle) or not handle.cached_len:
            self._chain(handle)  # a wrong type or length raises; an empty handle needs nothing
            return
        record = self._locks.get(handle)
        if record is None:
            self._chain(handle)  # a handle that is not even valid says so first
            raise RuntimeError(
                f"cannot unlock a handle that is not locked ({len(handle.block_hashes)} blocks, "
                f"cached_len={handle.cached_len})"
            )
        times, locked_chain = record
        self._flush()
        # Locked blocks cannot leave the cache: the handle that locked them needs no re-check.
        chain = locked_chain if handle.blocks is locked_chain else self._chain(handle)
        if times == 1:
            del self._locks[handle]
        else:
            self._locks[handle] = (times - 1, locked_chain)
        self._num_locked -= release_blocks(chain, self._free, self._clock)

    def evict(self, size: int) -> torch.Tensor:
        """Evict free blocks from the head of the free queue until at least ``size`` tokens are freed.

        Returns their slots, block after block. Only blocks no cached block chains from are
        evicted (the queue's order guarantees the head is one). Raises ``RuntimeError``
        (evicting nothing) when fewer than ``size`` tokens are evictable.
        """
        size = check_count(size)
        if size == 0:
            return self.empty_tensor
        self._flush()
        evictable = self.size_info.evictable_size
        if size > evictable:
            raise RuntimeError(
                f"cannot evict {size} tokens: only {evictable} are evictable "
                f"({self._num_locked * self.page_size} are locked)"
            )
        victims = evict_blocks(
            self._blocks, self._free, self._page_owner, size, self.page_size, self._events
        )
        self._epoch += 1
        return self._slots(victims)

    def check_integrity(self) -> None:
        """Check every block, the free queue, the locked handles and the sizes; ``RuntimeError`` on the first fault."""
        self._flush()
        check_pool(
            self._blocks,
            self._free,
            self._page_owner,
            self._num_locked,
            self._max_probe,
            self._hasher,
            self.page_size,
            self.locked_handles(),
        )
