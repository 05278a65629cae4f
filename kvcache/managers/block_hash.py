"""`BlockHashCacheManager`: prefix caching by chained block hashes, as in vLLM and nano-vllm.

A *block* is one page of ``page_size`` tokens. Only full blocks are cached. Block ``i`` of a
sequence is named by a chained hash, ``hash(block i) = H(hash(block i-1), tokens of block i)``
(block 0 chains from a fixed seed), so one hash names a block *and its whole prefix*: looking up
the blocks of a prompt one after another and stopping at the first miss finds the longest cached
prefix without any tree. The manager keeps:

- a table of blocks indexed by page (`block_pool.BlockTable`): per page, in NumPy arrays, the
  tokens, key, parent's page, ref count, child count and time of last use; ``key -> page``;
- a *free queue* (`block_queue.FreeQueue`: a log of pages with lazy removal, a chain's run appended
  in one slice) of the pages whose ref count is 0, in eviction order (head first);
- the locked handles and how often each is locked, so that unlocking a handle that is not locked is
  refused even while its blocks are locked through another handle.

Speed. The default hash (`block_hash_chain`) is computed for every block of a sequence at once with
a few NumPy passes; a lookup is then one dict probe per block, and the parents and tokens of the
whole matched chain are compared in one array operation each (`block_lookup.walk`). Recent
sequences' hashes and chains are remembered (`block_lookup.RequestHashes`): a conversation's next
turn, which resends its whole history, neither hashes nor walks again what is still cached (the
bytes are compared, and each remembered page's serial); a request's insert reuses what its match
found (vLLM's ``Request.block_hashes``), read off the handle it releases (locked, so still cached)
or the memo. A match hashes only up to the first block past that chain; the insert hashes the rest.
Locking, unlocking, queueing, the LRU refresh, the checks of an insert's new blocks and eviction
(but for the key index) are array operations on the chain's pages; no per-block Python object
exists. A handle carries its chain's pages, so locking one made since the last eviction re-checks
nothing; a match's LRU refresh waits for the next call, which skips it when it locks that very
chain. The fused calls and ``evict`` also take and give the flow's host NumPy arrays
(`takes_host_arrays`).

Locking and the flow's fused calls: `block_locks`. Collisions: `block_lookup`. Eviction rule:
`block_evict` (``check_integrity`` verifies the free queue's order).
"""

from __future__ import annotations

import sys
from collections.abc import Hashable, Iterator

import numpy as np
import torch

from .._validate import as_int, check_count, check_device, check_page_size
from . import block_locks, cache_events
from .base import BaseCacheHandle, BaseCacheManager, InsertResult, SizeInfo, takes_host_arrays
from .block_evict import check_table, evict_blocks
from .block_hash_chain import (
    ROOT_HASH_SEED,
    ChainHasher,
    HashFn,
    block_rows,
    default_block_hash,
)
from .block_insert import file_keys, max_pages_for, new_pages, slot_rows
from .block_lookup import Hashes, RequestHashes, handle_pages, hash_rest, walk
from .block_pool import BlockHashCacheHandle, BlockTable, CachedBlock, new_handle
from .cache_events import EventLog, check_extra_key

_new_tuple = tuple.__new__
__all__ = [
    "CachedBlock",
    "BlockHashCacheHandle",
    "BlockHashCacheManager",
    "ROOT_HASH_SEED",
    "default_block_hash",
]


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
        max_pages: page ids ``>= max_pages`` are refused (keyword only; the table keeps a row per
            page id; default: 4 GiB of rows, `block_insert.max_pages_for`).

    Namespaces: a chain under ``extra_key`` starts from `key_seed` (not `ROOT_HASH_SEED`);
    each first block keeps the key, compared on every hit.
    """

    # Locking is written in block_locks.py; the fused calls named here count as this class's own
    # (`fused_calls_safe`), so the flow makes them (a subclass overriding match_prefix gets the
    # separate calls).
    lock_handle = block_locks.lock_handle
    match_and_lock = block_locks.match_and_lock
    insert_and_unlock = block_locks.insert_and_unlock

    def __init__(
        self,
        device: torch.device | str = "cpu",
        page_size: int = 16,
        *,
        hash_fn: HashFn | None = None,
        events: bool = False,
        max_pages: int | None = None,
    ) -> None:
        page_size = check_page_size(page_size)
        self._max_pages = max_pages_for(max_pages, page_size)
        if not isinstance(events, bool):
            raise TypeError(f"events must be a bool, got {type(events).__name__}")
        if hash_fn is not None and not callable(hash_fn):
            raise TypeError(f"hash_fn must be callable, got {type(hash_fn).__name__}")
        self.device = check_device(device)
        self._on_cpu = self.device.type == "cpu"
        self.page_size = page_size
        self._hasher = ChainHasher(page_size, hash_fn)
        self.hash_fn: HashFn = self._hasher.hash_fn
        self.empty_tensor = torch.empty(0, dtype=torch.int32, device=self.device)
        self._clock = 0
        self._token = object()  # names this manager in the handles it makes
        self._epoch = 0  # bumped whenever a block leaves the cache
        self._events = EventLog() if events else None
        self._plain_match = type(self).match_prefix is BlockHashCacheManager.match_prefix
        self._init_state()

    # ------------------------------------------------------------------ state
    def _init_state(self) -> None:
        self._table = BlockTable(self.page_size, self._max_pages)
        # locked handle -> (times locked, the pages it locked)
        self._locks: dict[BlockHashCacheHandle, tuple[int, np.ndarray]] = {}
        self._pending = RequestHashes(self.page_size)
        # A match's refresh of the LRU order (pages, clock), applied by the next call unless that
        # call locks the very chain: the flow matches and locks at once, and a lock takes the
        # blocks out of the queue anyway.
        self._touch: tuple[np.ndarray, int] | None = None
        self._epoch += 1

    @property
    def size_info(self) -> SizeInfo:
        t, ps = self._table, self.page_size
        # (evictable, protected), made as NamedTuple's own __new__ makes it, minus its frame
        return _new_tuple(SizeInfo, (t.free.size * ps, t.num_locked * ps))

    @property
    def num_blocks(self) -> int:
        return len(self._table.page_of)

    @property
    def clock(self) -> int:
        """The logical clock: incremented by every ``match_prefix`` and ``insert_prefix``."""
        return self._clock

    @property
    def max_probe(self) -> int:
        """The largest collision offset ever used (0 while no two blocks' hashes have collided)."""
        return self._table.max_probe

    def blocks(self) -> Iterator[CachedBlock]:
        """A copy of every cached block, in insertion order (a parent before its children)."""
        self._flush()
        return iter(list(self._table.snapshots()))

    def get_block(self, block_hash: int) -> CachedBlock | None:
        """A copy of the block cached under key ``block_hash`` (an integer), or ``None``."""
        page = self._table.page_of.get(as_int(block_hash, "block_hash"))  # True, 1.0: not 1
        self._flush()  # the LRU refresh only: it moves no block
        return None if page is None else self._table.snapshot(page, self._table.namespace(page))

    def free_queue(self) -> list[int]:
        """Keys of the evictable blocks in eviction order (head first)."""
        self._flush()
        return self._table.keys_of(self._table.free.pages())

    def locked_handles(self) -> dict[BlockHashCacheHandle, int]:
        """Each locked handle and how many times it is locked (a copy)."""
        return {h: n for h, (n, _) in self._locks.items()}

    def _slots(self, pages: np.ndarray) -> torch.Tensor:
        """The slots of ``pages``, page after page (1-D int32 on ``device``)."""
        if not len(pages):
            return self.empty_tensor
        out = torch.from_numpy(self._table.slots.take(pages, axis=0).reshape(-1))  # rows: take
        return out if self._on_cpu else out.to(self.device)

    def cached_indices(self) -> torch.Tensor:
        t = self._table
        return self._slots(np.fromiter(t.page_of.values(), dtype=np.int64, count=len(t.page_of)))

    def reset(self) -> None:
        self._flush()
        if self._table.num_locked:
            raise RuntimeError(
                f"cannot reset while {self._table.num_locked * self.page_size} tokens are locked; "
                "unlock every handle first"
            )
        self._init_state()
        if self._events is not None:
            self._events.cleared()

    take_events = cache_events.take_events

    # ----------------------------------------------------------- lookups
    def _flush(self) -> None:
        """Apply the last match's deferred LRU refresh, if any."""
        if self._touch is not None:
            pages, tic = self._touch
            self._touch = None
            self._table.use(pages, tic)

    def _handle(
        self, pages: np.ndarray, hashes: Hashes, raw: bytes, gens: bytes | None
    ) -> BlockHashCacheHandle:
        k = len(pages)
        if self._table.max_probe:
            keys = tuple(self._table.keys_of(pages))
        else:
            keys = tuple(hashes if k == len(hashes) else hashes[:k])
        pages.setflags(write=False)  # shared by the handle, its lock record and the memo
        # ``raw``: the request's tokens; the chain's are its first ``k`` blocks.
        stamp = (self._token, self._epoch, keys)
        return new_handle(k * self.page_size, keys, raw, pages, stamp, gens)

    # ------------------------------------------------------------- public
    def match_prefix(
        self, input_ids: torch.Tensor, extra_key: Hashable = None
    ) -> tuple[BlockHashCacheHandle, torch.Tensor]:
        """Longest chain of full blocks of ``input_ids`` cached under ``extra_key``, and its slots.

        Not read-only: the matched blocks count as used (they move to the tail of the free queue).
        vLLM's lookup is read-only (its ``touch`` comes with the allocation); the flow locks at
        once (`match_and_lock`), which takes the blocks out of the queue, so only a match that
        is not locked decides differently.
        """
        return self._match(input_ids, extra_key, True)

    def _match(
        self, input_ids: torch.Tensor, extra_key: Hashable, keep: bool, host: bool = False
    ) -> tuple[BlockHashCacheHandle, torch.Tensor]:
        """`match_prefix`; ``keep``: remember its hashes for the insert (the fused insert takes
        them from the handle it releases); ``host``: the NumPy form (ids and slots)."""
        rows = block_rows(input_ids, self.page_size, host)
        if extra_key is not None:
            check_extra_key(extra_key)
        table = self._table
        raw = rows.tobytes()
        hasher = self._hasher
        hashes, known, gens, _ = self._pending.recall(rows, raw, table, hasher, extra_key, True)
        self._flush()
        pages = walk(table, rows, hashes, known, extra_key)
        if len(pages) == len(hashes) < len(rows) and table.nchild.item(pages.item(-1)):  # on
            hashes = hash_rest(hasher, rows, hashes, extra_key)
            pages = walk(table, rows, hashes, pages, extra_key)
        if keep:
            if pages is not known:
                gens = table.gen[pages].tobytes()
            self._pending.remember(raw, hashes, pages, gens, extra_key)
        self._clock += 1
        handle = self._handle(pages, hashes, raw, gens if pages is known else None)
        if len(pages):
            self._touch = (pages, self._clock)
        if host:
            return handle, self._table.slots.take(pages, axis=0).reshape(-1)  # type: ignore[return-value]
        return handle, self._slots(pages)

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
        cached, handle = self._insert(input_ids, indices, extra_key)
        return InsertResult(cached, handle)

    def _insert(
        self,
        input_ids: torch.Tensor,
        indices: torch.Tensor,
        extra_key: Hashable,
        held: BlockHashCacheHandle | None = None,
        host: bool = False,
        defer: list[int] | None = None,
    ) -> tuple[int, BlockHashCacheHandle]:
        """The insert; ``held``: a handle of this manager's that is locked (by the caller), whose
        chain (still cached, then) is taken as known when ``input_ids`` extends its tokens;
        ``host``: NumPy ids and slots are taken too; ``defer``: when the new blocks extend
        ``held``'s chain, they are left out of the free queue and their number appended to it
        (the caller releases ``held`` at once and queues them with it: `BlockTable.release`)."""
        rows = block_rows(input_ids, self.page_size, host)
        if extra_key is not None:
            check_extra_key(extra_key)
        slots = slot_rows(indices, self.device, self._on_cpu, host)
        if len(slots) != input_ids.shape[0]:
            raise ValueError(
                f"len(indices) ({len(slots)}) must equal len(input_ids) ({input_ids.shape[0]})"
            )
        if self._touch is not None:
            self._flush()
        table = self._table
        raw = rows.tobytes()
        hasher = self._hasher
        carried = (
            None
            if held is None
            else self._pending.carried(held, rows, raw, table, hasher, extra_key)
        )
        if carried is None:
            carried = self._pending.recall(rows, raw, table, hasher, extra_key)
            held = None
        hashes, known, gens, tail = carried  # with ``held``: ``known`` is locked (no LRU refresh)
        i0 = len(known)
        if i0 and not table.max_probe and (i0 == len(hashes) or hashes[i0] not in table.page_of):
            pages = known  # `walk`'s usual case for an insert: nothing cached past the match
        else:
            pages = walk(table, rows, hashes, known, extra_key)
            tail = None  # ``hashes[len(known):]``: not the new blocks' when the walk went on
        ps, m, nb = self.page_size, len(pages), len(rows)
        if m == nb:
            self._clock += 1
            if held is None or pages is not known:
                table.use(pages, self._clock)
            if pages is not known:
                gens = table.gen[pages].tobytes()
            self._pending.remember(raw, hashes, pages, gens, extra_key)
            return m * ps, self._handle(pages, hashes, raw, gens)
        slots = slots[m * ps : nb * ps]
        fresh, listed, top = new_pages(slots, ps, table)
        keys, probes = file_keys(table, hashes[m:], listed)
        # Validation done; from here on nothing raises.
        self._clock += 1
        tic = self._clock
        up = pages.item(-1) if m else -1
        queue = defer is None or held is None or pages is not known
        key_values = keys if probes is not None or tail is None else tail  # tail: ``hashes[m:]``
        serial = table.add(
            fresh, listed, top, key_values, probes, rows[m:], up, tic, extra_key, queue
        )
        if not queue:
            defer.append(len(listed))  # type: ignore[union-attr]
        if held is None or pages is not known:
            table.use(pages, tic)
        if pages is not known:
            gens = table.gen[pages].tobytes()
        gens += serial.to_bytes(8, sys.byteorder) * len(listed)  # the int64 serials of the new
        pages = np.concatenate((pages, fresh)) if m else fresh
        self._pending.remember(raw, hashes, pages, gens, extra_key)
        if self._events is not None:
            self._events.stored(extra_key, rows.reshape(-1).tolist(), slots.tolist())
        return m * ps, self._handle(pages, hashes, raw, gens)

    def _chain(self, handle: BaseCacheHandle) -> np.ndarray:
        """The pages behind ``handle``, root first, after checking the handle names them."""
        return handle_pages(handle, self._table, self.page_size, (self._token, self._epoch))

    def handle_indices(self, handle: BaseCacheHandle) -> torch.Tensor:
        """The slots of the prefix behind ``handle`` (read-only: the LRU order does not change)."""
        return self._slots(self._chain(handle))

    @takes_host_arrays
    def evict(self, size: int, *, host: bool = False) -> torch.Tensor:
        """Evict free blocks from the head of the free queue until at least ``size`` tokens are freed.

        Returns their slots, block after block (``host=True``: as a 1-D NumPy int32 array). Only
        blocks no cached block chains from are evicted (the queue's order guarantees the head is
        one). Raises ``RuntimeError`` (evicting nothing) when fewer than ``size`` tokens are
        evictable.
        """
        if type(size) is not int or size < 0:
            size = check_count(size)
        if type(host) is not bool:
            raise TypeError(f"host must be a bool, got {type(host).__name__}")
        if size == 0:
            return np.zeros(0, dtype=np.int32) if host else self.empty_tensor  # type: ignore[return-value]
        if self._touch is not None:
            self._flush()
        evictable = self._table.free.size * self.page_size
        if size > evictable:
            raise RuntimeError(
                f"cannot evict {size} tokens: only {evictable} are evictable "
                f"({self._table.num_locked * self.page_size} are locked)"
            )
        victims = evict_blocks(self._table, size, self._events)
        self._epoch += 1
        if host:
            return self._table.slots.take(victims, axis=0).reshape(-1)  # type: ignore[return-value]
        return self._slots(victims)

    def check_integrity(self) -> None:
        """Check every block, the free queue, the locked handles and the sizes; ``RuntimeError`` on the first fault."""
        self._flush()
        check_table(self._table, self._hasher, self.locked_handles())
