"""`BlockHashCacheManager`: prefix caching by chained block hashes, as in vLLM and nano-vllm.

A *block* is one page of ``page_size`` tokens; only full blocks are cached. Block ``i`` of a
sequence is named by a chained hash, ``hash(block i) = H(hash(block i-1), tokens of block i)``
(block 0 chains from a fixed seed, one per namespace), so one hash names a block *and its whole
prefix*: looking the blocks of a prompt up one after another and stopping at the first miss finds
the longest cached prefix without any tree. The manager keeps (`block_pool`):

- a table of blocks indexed by page: per page, in NumPy arrays, the tokens, the key, the parent's
  page, the ref count, the number of children and the time of last use; ``key -> page``;
- a *free queue* of the pages whose ref count is 0, in eviction order (least recently used first,
  a block always before its parent, so that the head is a leaf);
- the locked handles and how often each is locked, so that unlocking a handle that is not locked
  is refused even while its blocks are locked through another handle.

In this module, top to bottom: the hash (`default_block_hash`, and `ChainHasher`, which computes a
whole sequence's chain at once), the handle, the memo of recent chains (`RecentChains`), and the
manager: match, insert, lock and unlock (and the request flow's two fused calls), evict, and the
integrity check.

Collisions. A 64-bit hash can collide (and a caller's ``hash_fn`` may be weak on purpose). Every
block keeps its tokens and its parent, and a lookup compares both, so a collision can cost a cache
hit but never returns another prefix's K/V. A block whose hash a cached block already holds is
filed under the next free key (``hash + 1``, ...; its ``probe`` offset), and lookups try every
offset up to the largest ever used (``max_probe``, 0 unless a collision happened). A child's hash
chains from its parent's hash, not its key, so probing changes no other block's name.

Speed. The default hash of every block of a sequence is a few NumPy passes; a lookup is then one
``dict`` probe per block, and the parents and tokens of the whole matched chain are compared in
one array operation each. Locking, unlocking, queueing and evicting are array operations on a
chain's pages. The flow's insert releases the handle it locked at its match: that chain is still
cached, so the insert hashes and looks up only the blocks past it (vLLM's ``Request.block_hashes``
carried from the lookup to the allocation). A request that resends a recent one's tokens (a
conversation's history, a task's few-shot examples) takes the hashes and pages of the part in
common from the memo, checked by each page's generation, and a match hashes no block past the
point where its lookup must stop.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from operator import mul

import numpy as np
import torch

from .._validate import (
    as_int,
    check_count,
    check_device,
    check_page_size,
    check_same_length,
    slot_array,
    token_ids,
)
from .base import BaseCacheHandle, BaseCacheManager, InsertResult, SizeInfo
from .block_pool import BlockTable, CachedBlock, max_pages_for, same
from .cache_events import CacheEvent, EventLog, check_extra_key, events_off

__all__ = [
    "CachedBlock",
    "BlockHashCacheHandle",
    "BlockHashCacheManager",
    "ROOT_HASH_SEED",
    "default_block_hash",
]

# ------------------------------------------------------------------------------ the hash
# ``h_i = H(h_{i-1}, tokens of block i)``, ``h_{-1}`` the seed. The default ``H`` is chosen so that
# a whole chain is a few NumPy operations over every block together:
#
#     c_i = mix(sum_k t_{i,k} * P^(k+1))        (the block's content hash, mod 2**64)
#     h_i = h_{i-1} * M + c_i                     (mod 2**64; M odd, hence invertible)
#
# so ``h_i = M^i * (seed * M + sum_{j<=i} c_j * M^-j)``: a cumulative sum. ``mix(x) = (x ^ (x >>
# 32)) * K`` folds the high bits (which every token reaches) into the low ones. Not cryptographic:
# the manager compares tokens on every hit. Values depend on nothing but the tokens.

HashFn = Callable[[int, tuple[int, ...]], int]

_MASK = (1 << 64) - 1
#: What block 0 of every sequence outside a namespace chains from.
ROOT_HASH_SEED = 0x6B7663616368655F  # "kvcache_"
_P = 0x9E3779B97F4A7C15  # token weights: powers of the golden-ratio constant
_M = 0xD6E8FEB86659FD93  # chain multiplier (odd)
_M_INV = pow(_M, -1, 1 << 64)
_K = 0xBF58476D1CE4E5B9  # mix's multiplier


def default_block_hash(parent_hash: int, tokens: tuple[int, ...]) -> int:
    """``H(parent_hash, tokens)`` as an unsigned 64-bit int (the formula above), one block at a
    time; equal to what `ChainHasher` computes for a whole sequence at once. Tokens are taken as
    64-bit two's-complement integers."""
    c, w = 0, 1
    for t in tokens:
        w = (w * _P) & _MASK
        c = (c + (t & _MASK) * w) & _MASK
    return (parent_hash * _M + (((c ^ (c >> 32)) * _K) & _MASK)) & _MASK


def key_seed(extra_key: Hashable) -> int:
    """What block 0 chains from under namespace ``extra_key``: `ROOT_HASH_SEED` for ``None``,
    else the seed mixed with a digest of ``repr(extra_key)`` and its type (the same in every
    process, unlike ``hash`` of a str). Namespaces are compared on every hit as well: a digest
    that collides costs a hit, never another namespace's K/V."""
    if extra_key is None:
        return ROOT_HASH_SEED
    raw = f"{type(extra_key).__qualname__}:{extra_key!r}".encode()
    digest = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")
    return (ROOT_HASH_SEED ^ digest) & _MASK or 1


def _powers(base: int, n: int) -> np.ndarray:
    """``[base**0, base**1, ..., base**(n-1)]`` mod 2**64, as uint64."""
    out = np.full(n, base, dtype=np.uint64)
    out[0] = 1
    return np.cumprod(out, dtype=np.uint64)


class ChainHasher:
    """The chained hashes of a sequence's blocks.

    With the default hash, a handful of NumPy passes over every block together; with a caller's
    ``hash_fn``, one call per block, each result checked to be an int. Either way the manager
    hashes before it changes anything, so a ``hash_fn`` that raises leaves it as it was.
    """

    def __init__(self, page_size: int, hash_fn: HashFn | None) -> None:
        self.page_size = page_size
        self.hash_fn: HashFn = default_block_hash if hash_fn is None else hash_fn
        self.custom = self.hash_fn is not default_block_hash
        # ``P**1 .. P**page_size``, made at the first hash (a huge page_size costs nothing until
        # a block that long is hashed); ``M**i`` and ``K * M**-i``, grown to the longest chain.
        self._weights: np.ndarray | None = None
        self._weight_list: list[int] = []
        self._m_pow = _powers(_M, 64)
        self._k_m_inv_pow = _powers(_M_INV, 64) * np.uint64(_K)

    def one(self, parent_hash: int, tokens: tuple[int, ...]) -> int:
        """The hash of one block; ``TypeError`` when a custom ``hash_fn`` returns a non-int."""
        h = self.hash_fn(parent_hash, tokens)
        if isinstance(h, bool) or not isinstance(h, int):
            raise TypeError(f"hash_fn must return an int, got {type(h).__name__} ({h!r})")
        return h & _MASK

    def chain(self, rows: np.ndarray, seed: int) -> list[int]:
        """The hashes of the rows of ``rows`` (``(num_blocks, page_size)`` int64, C-contiguous),
        the first chained from ``seed``."""
        nb = len(rows)
        if self.custom or not nb:
            out = []
            for row in rows.tolist():
                seed = self.one(seed, tuple(row))
                out.append(seed)
            return out
        if self._weights is None:
            self._weights = _powers(_P, self.page_size + 1)[1:]
            self._weight_list = self._weights.tolist()
        if nb <= 2:  # a block or two: plain ints cost less than NumPy's fixed cost per call
            few = []
            for row in rows.tolist():
                c = sum(map(mul, row, self._weight_list)) & _MASK
                seed = (seed * _M + (((c ^ (c >> 32)) * _K) & _MASK)) & _MASK
                few.append(seed)
            return few
        if len(self._m_pow) < nb:
            size = max(nb, 2 * len(self._m_pow))
            self._m_pow = _powers(_M, size)
            self._k_m_inv_pow = _powers(_M_INV, size) * np.uint64(_K)
        # Integer array arithmetic wraps modulo 2**64 without a warning (only scalars warn).
        c = rows.view(np.uint64) @ self._weights
        c ^= c >> np.uint64(32)
        c *= self._k_m_inv_pow[:nb]  # c_i * M^-i, mix's factor K folded in
        c[0] = (int(c[0]) + seed * _M) & _MASK  # the seed's term joins every partial sum
        np.add.accumulate(c, out=c)
        c *= self._m_pow[:nb]
        hashes: list[int] = c.tolist()
        return hashes


# ------------------------------------------------------------------------------ the handle
@dataclass(frozen=True)
class BlockHashCacheHandle(BaseCacheHandle):
    """The matched prefix is the chain of blocks keyed ``block_hashes`` (``cached_len //
    page_size`` of them).

    A handle names the *content* it was made for: ``tokens`` (the chain's tokens as int64 bytes)
    are compared with what the keys hold whenever the handle is used. If its blocks are evicted the
    handle can no longer be locked (``RuntimeError``), even when other tokens have since been
    cached under the same keys (a hash collision); if the same tokens are cached again, the handle
    names the new blocks. Equality and hashing use ``cached_len`` and ``block_hashes`` only: equal
    handles are the same claim, and lock and unlock alike.
    """

    block_hashes: tuple[int, ...]
    tokens: bytes = field(default=b"", compare=False, repr=False)

    def __hash__(self) -> int:
        # Equal handles have equal lengths and last keys, so those two suffice (a chained key
        # names its whole prefix); ``==`` still compares every key. O(1): a handle is a dict key
        # on every lock and unlock.
        hashes = self.block_hashes
        return hash((self.cached_len, hashes[-1] if hashes else None))


class _Lock:
    """How often an equal handle is locked; ``handle`` is the first one that locked it (its
    tokens and keys), ``pages`` its chain's pages."""

    __slots__ = ("count", "handle", "pages")

    def __init__(self, handle: BlockHashCacheHandle, pages: np.ndarray) -> None:
        self.count = 1
        self.handle = handle
        self.pages = pages


_NO_PAGES = np.zeros(0, dtype=np.int64)


# ------------------------------------------------------------------------------ the memo
class RecentChains:
    """The chains of recent inserts (each one's tokens, block hashes, pages and their
    generations), so that a request that repeats or extends one of them (a conversation's next
    turn resends its whole history), or shares a long prefix with it (few-shot prompts of one
    task), is neither hashed nor looked up again for the blocks in common: it takes their hashes
    from the entry, and their pages as far as they still hold the very blocks remembered (their
    generations unchanged, `BlockTable.unchanged`: one comparison).

    An entry is filed under the bytes of one of its blocks: block ``j``, the largest power of two
    below its block count (block 0 for one block). A sequence of ``n`` blocks probes its blocks
    ``J, J/2, ..., 1, 0`` (``J`` the largest power of two below ``n``), so it finds every entry it
    repeats or extends, and one it shares a prefix with past the block probed. The ``capacity``
    entries filed last are kept: 256 hold the 110 interleaved conversations of the benchmark's
    chat trace (each entry holds its sequence's bytes, 8 a token).
    """

    def __init__(self, page_size: int, capacity: int = 256) -> None:
        self.page_size = page_size
        self.capacity = capacity
        self._index: dict[Hashable, tuple[bytes, tuple[int, ...], np.ndarray, bytes]] = {}

    def remember(
        self,
        raw: bytes,
        hashes: tuple[int, ...],
        pages: np.ndarray,
        gens: bytes,
        extra_key: Hashable,
    ) -> None:
        """File a chain: ``raw`` its rows' bytes, ``hashes``, ``pages`` and ``gens`` (the pages'
        generations, int64 bytes) those of every block."""
        if hashes:
            key = self._key(raw, (1 << (len(hashes) - 1).bit_length()) >> 1, extra_key)
            self._index.pop(key, None)  # filed again: the most recent
            self._index[key] = (raw, hashes, pages, gens)
            if len(self._index) > self.capacity:
                del self._index[next(iter(self._index))]

    def recall(self, raw: bytes, extra_key: Hashable) -> tuple[tuple[int, ...], np.ndarray, bytes]:
        """The hashes, pages and generations of the blocks that the rows ``raw`` share with the
        first entry found that shares any; all empty when none does."""
        n = len(raw) // (8 * self.page_size)
        j = (1 << (n - 1).bit_length()) >> 1 if n else -1
        while j >= 0:
            entry = self._index.get(self._key(raw, j, extra_key))
            if entry is not None:
                old, hashes, pages, gens = entry
                shared = min(len(old), len(raw)) // 8
                if not (raw.startswith(old) or old.startswith(raw)):  # a sibling: where they part
                    differ = np.frombuffer(raw, np.int64, shared) != np.frombuffer(
                        old, np.int64, shared
                    )
                    shared = int(differ.argmax())
                shared //= self.page_size
                if shared == len(hashes):
                    return hashes, pages, gens
                if shared:
                    return hashes[:shared], pages[:shared], gens[: 8 * shared]
            j = j >> 1 if j else -1
        return (), _NO_PAGES, b""

    def _key(self, raw: bytes, j: int, extra_key: Hashable) -> Hashable:
        width = 8 * self.page_size
        block = raw[j * width : (j + 1) * width]
        return block if extra_key is None else (extra_key, block)  # bytes never equal a tuple


# ------------------------------------------------------------------------------ the manager
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
            page id; default: 4 GiB of rows, `block_pool.max_pages_for`).

    Namespaces: a chain under ``extra_key`` starts from `key_seed` (not `ROOT_HASH_SEED`); each
    first block keeps the key, compared on every hit.

    Every public call checks everything (the ``hash_fn`` runs too) before it changes anything:
    one that raises, whatever raised, leaves the manager as it was.
    """

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
        self._on_cpu = self.device.type == "cpu"  # asked on every call: kept as a plain bool
        self.page_size = page_size
        self._hasher = ChainHasher(page_size, hash_fn)
        self.hash_fn: HashFn = self._hasher.hash_fn
        self.empty_tensor = torch.empty(0, dtype=torch.int32, device=self.device)
        self._events = EventLog() if events else None
        self._clock = 0
        self._table = BlockTable(page_size, self._max_pages)
        self._locks: dict[BlockHashCacheHandle, _Lock] = {}
        self._recent = RecentChains(page_size)

    # ------------------------------------------------------------ reading
    @property
    def size_info(self) -> SizeInfo:
        table, ps = self._table, self.page_size
        return SizeInfo(table.free.size * ps, table.num_locked * ps)

    @property
    def num_blocks(self) -> int:
        return len(self._table.page_of)

    @property
    def clock(self) -> int:
        """The logical clock: incremented by every match and insert."""
        return self._clock

    @property
    def max_probe(self) -> int:
        """The largest collision offset ever used (0 while no two blocks' hashes have collided)."""
        return self._table.max_probe

    def blocks(self) -> Iterator[CachedBlock]:
        """A copy of every cached block, in insertion order (a parent before its children)."""
        return iter(list(self._table.snapshots()))

    def get_block(self, block_hash: int) -> CachedBlock | None:
        """A copy of the block cached under key ``block_hash`` (an integer), or ``None``."""
        page = self._table.page_of.get(as_int(block_hash, "block_hash"))  # True, 1.0: not 1
        return None if page is None else self._table.snapshot(page, self._table.namespace(page))

    def free_queue(self) -> list[int]:
        """Keys of the evictable blocks in eviction order (head first)."""
        keys: list[int] = self._table.key[self._table.free.pages()].tolist()
        return keys

    def locked_handles(self) -> dict[BlockHashCacheHandle, int]:
        """Each locked handle and how many times it is locked (a copy)."""
        return {handle: lock.count for handle, lock in self._locks.items()}

    def cached_indices(self) -> torch.Tensor:
        pages = np.fromiter(self._table.page_of.values(), dtype=np.int64)
        return self._slots(pages)

    def handle_indices(self, handle: BaseCacheHandle) -> torch.Tensor:
        """The slots of the prefix behind ``handle`` (read-only: the LRU order does not change)."""
        return self._slots(self._pages(handle))

    def take_events(self) -> list[CacheEvent]:
        """What was stored, removed and cleared since the last call, oldest first; empties the
        log. ``RuntimeError`` unless the manager was built with ``events=True``."""
        if self._events is None:
            raise events_off(type(self).__name__)
        return self._events.take()

    def _slots(self, pages: np.ndarray) -> torch.Tensor:
        """The slots of ``pages``, page after page (1-D int32 on ``device``)."""
        if not len(pages):
            return self.empty_tensor
        slots = torch.from_numpy(self._table.slots_of(pages))
        return slots if self._on_cpu else slots.to(self.device)

    def _rows(self, ids: np.ndarray) -> np.ndarray:
        """The full blocks of ``ids`` (1-D int64, C-contiguous) as ``(n, page_size)`` rows (a view)."""
        nb = len(ids) // self.page_size
        return ids[: nb * self.page_size].reshape(nb, self.page_size)

    # ------------------------------------------------------------ match
    def match_prefix(
        self, input_ids: torch.Tensor, extra_key: Hashable = None
    ) -> tuple[BlockHashCacheHandle, torch.Tensor]:
        """Longest chain of full blocks of ``input_ids`` cached under ``extra_key``, and its slots.

        Not read-only: the matched blocks count as used (they move to the tail of the free queue).
        vLLM's lookup is read-only (its ``touch`` comes with the allocation); the flow locks at
        once (`match_and_lock`), which takes the blocks out of the queue, so only a match that is
        not locked decides differently.
        """
        handle, pages = self._match(input_ids, extra_key)
        return handle, self._slots(pages)

    def match_and_lock(
        self, input_ids: torch.Tensor, extra_key: Hashable = None
    ) -> tuple[BlockHashCacheHandle, torch.Tensor]:
        """`match_prefix`, then `lock_handle` of its handle, in one call (the flow's steps 1 and
        2): the same decisions, the chain found not looked up again. The lock takes the chain's
        blocks out of the free queue, so the match's move of them to its tail is left out (only
        their ``last_use`` shows it: the release that queues them again sets it)."""
        handle, pages = self._match(input_ids, extra_key, refresh=False)
        self._lock(handle, pages)
        return handle, self._slots(pages)

    def _match(
        self, input_ids: torch.Tensor, extra_key: Hashable, refresh: bool = True
    ) -> tuple[BlockHashCacheHandle, np.ndarray]:
        rows = self._rows(token_ids(input_ids))
        if extra_key is not None:
            check_extra_key(extra_key)
        raw = rows.tobytes()
        hashes, pages = self._find(rows, raw, extra_key, _NO_PAGES, (), False)  # may raise
        self._clock += 1
        if refresh:
            self._table.use(pages, self._clock)
        k, ps = len(pages), self.page_size
        handle = BlockHashCacheHandle(k * ps, self._keys(pages, hashes), raw[: k * 8 * ps])
        return handle, pages

    def _find(
        self,
        rows: np.ndarray,
        raw: bytes,
        extra_key: Hashable,
        known: np.ndarray,
        known_hashes: tuple[int, ...],
        every: bool,
    ) -> tuple[tuple[int, ...], np.ndarray]:
        """The chained hashes of the first rows of ``rows`` (``raw``: their bytes) and the pages
        of the longest cached chain that matches them, under ``extra_key`` (read-only).

        ``known``: pages known to hold the first rows, with ``known_hashes`` their hashes; when
        none are, the memo's pages for the first rows that still hold them.
        Rows past the known hashes are hashed only as far as a lookup can go, unless ``every``
        row's hash is asked for (an insert: the new blocks' keys): the lookup goes past the last
        block found only when that one has a cached child, so the next block is hashed first,
        and the rest only when that one is cached too."""
        if not len(known):
            known_hashes, candidates, gens = self._recent.recall(raw, extra_key)
            if len(candidates):
                known = self._table.unchanged(candidates, gens)
        table, hashes, n = self._table, known_hashes, len(rows)
        pages = self._walk(rows, hashes, known, extra_key)
        if len(pages) == len(hashes) < n and (not len(pages) or table.nchild[pages[-1]]):
            hashes = self._hash_to(rows, hashes, n if every else len(hashes) + 1, extra_key)
            if hashes[-1] in table.page_of or table.max_probe:  # it may be cached: the rest too
                hashes = self._hash_to(rows, hashes, n, extra_key)
            pages = self._walk(rows, hashes, pages, extra_key)
        if every:
            hashes = self._hash_to(rows, hashes, n, extra_key)
        return hashes, pages

    def _hash_to(
        self, rows: np.ndarray, hashes: tuple[int, ...], upto: int, extra_key: Hashable
    ) -> tuple[int, ...]:
        """``hashes`` (those of the first rows of ``rows``) extended to the first ``upto`` rows."""
        if len(hashes) >= upto:
            return hashes
        seed = hashes[-1] if hashes else key_seed(extra_key)
        return hashes + tuple(self._hasher.chain(rows[len(hashes) : upto], seed))

    def _walk(
        self, rows: np.ndarray, hashes: tuple[int, ...], known: np.ndarray, extra_key: Hashable
    ) -> np.ndarray:
        """``known`` (pages holding the first rows, maybe none) followed by the cached blocks of
        the next rows, looked up by their hashes (``hashes[i]`` is row ``i``'s), up to the first
        one missing. Without collisions (``max_probe == 0``) a block's key is its hash: one dict
        probe per block, then one content check of the chain found (`_holds`)."""
        table, i0 = self._table, len(known)
        if i0 == len(hashes):
            return known
        if table.max_probe:
            return self._walk_probing(rows, hashes, known, extra_key)
        get = table.page_of.get
        if get(hashes[i0]) is None:  # an insert's usual case
            return known
        found = list(map(get, hashes[i0:]))
        if None in found:
            del found[found.index(None) :]  # a miss ends the chain
        run = np.fromiter(found, dtype=np.int64, count=len(found))
        run = self._holds(run, rows[i0:], int(known[-1]) if i0 else -1, extra_key)
        return np.concatenate((known, run)) if i0 else run

    def _holds(self, run: np.ndarray, rows: np.ndarray, up: int, extra_key: Hashable) -> np.ndarray:
        """The longest prefix of the chain of pages ``run`` (int64, not empty, found by their
        keys) whose blocks hold the first rows of ``rows`` and chain each from the one before, the
        first from page ``up`` (``-1``: none; then it must be in namespace ``extra_key``). A key
        found is believed only after this check (a hash can collide): the parents and the tokens
        in one comparison each."""
        table = self._table
        rows = rows[: len(run)]
        parents, tokens = table.parent[run], table.tok.take(run, axis=0)
        if not (parents[0] == up and same(parents[1:], run[:-1]) and same(tokens, rows)):
            good = (tokens == rows).all(axis=1)
            good[0] &= parents[0] == up
            good[1:] &= parents[1:] == run[:-1]
            bad = np.flatnonzero(~good)
            run = run[: bad[0]] if len(bad) else run
        if up < 0 and len(run) and table.ns.get(int(run[0])) != extra_key:
            return _NO_PAGES  # the same tokens, cached in another namespace
        return run

    def _walk_probing(
        self, rows: np.ndarray, hashes: tuple[int, ...], known: np.ndarray, extra_key: Hashable
    ) -> np.ndarray:
        """`_walk` once a collision has happened: every block tries each probe offset."""
        table = self._table
        chain: list[int] = known.tolist()
        parent = chain[-1] if chain else -1
        # As far as the rows are hashed (a match hashes lazily).
        for h, row in zip(hashes[len(chain) :], rows[len(chain) :], strict=False):
            for probe in range(table.max_probe + 1):
                page = table.page_of.get((h + probe) & _MASK)
                if (
                    page is not None
                    and table.parent[page] == parent
                    and (table.tok[page] == row).all()
                    and (parent >= 0 or table.ns.get(page) == extra_key)
                ):
                    break
            else:
                break
            chain.append(page)
            parent = page
        return np.array(chain, dtype=np.int64)

    def _keys(self, pages: np.ndarray, hashes: tuple[int, ...]) -> tuple[int, ...]:
        """The keys of the chain ``pages`` whose blocks' hashes start ``hashes``: the hashes
        themselves while no collision has moved a key."""
        if self._table.max_probe:
            return tuple(self._table.key[pages].tolist())
        return hashes if len(hashes) == len(pages) else hashes[: len(pages)]

    # ------------------------------------------------------------ insert
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
        """
        return self._insert(input_ids, indices, extra_key, None)[0]

    def insert_and_match(
        self, input_ids: torch.Tensor, indices: torch.Tensor, extra_key: Hashable = None
    ) -> InsertResult:
        """`insert_prefix` and the (unlocked) handle on the whole inserted chain, in one walk."""
        cached, handle, _ = self._insert(input_ids, indices, extra_key, None)
        return InsertResult(cached, handle)

    def insert_and_unlock(
        self,
        handle: BaseCacheHandle,
        input_ids: torch.Tensor,
        indices: torch.Tensor,
        extra_key: Hashable = None,
        *,
        relock: bool = False,
    ) -> InsertResult:
        """`insert_and_match`, then one lock of ``handle`` released (with ``relock``, the returned
        handle locked first: the lock moves to the longer prefix). The flow's insert.

        ``handle`` must be locked (it, or an equal handle): ``RuntimeError`` otherwise. When
        ``input_ids`` extend its tokens, only the blocks past its chain (still cached: it is
        locked) are hashed and looked up. Everything that can raise runs before anything changes.
        """
        if not isinstance(relock, bool):
            raise TypeError(f"relock must be a bool, got {type(relock).__name__}")
        lock = self._held(handle)
        cached, made, pages = self._insert(input_ids, indices, extra_key, lock)
        if relock:
            self._lock(made, pages)
        self._release(handle, lock)
        return InsertResult(cached, made)

    def _insert(
        self,
        input_ids: torch.Tensor,
        indices: torch.Tensor,
        extra_key: Hashable,
        held: _Lock | None,
    ) -> tuple[int, BlockHashCacheHandle, np.ndarray]:
        """The insert: the length already cached, the handle on the whole chain and its pages.
        ``held``: the lock of a handle the caller holds, whose chain is taken as known when
        ``input_ids`` extend its tokens."""
        ids = token_ids(input_ids)
        rows = self._rows(ids)
        if extra_key is not None:
            check_extra_key(extra_key)
        slots = slot_array(indices, self.device)
        check_same_length(len(slots), len(ids))
        table, ps, nb = self._table, self.page_size, len(rows)
        raw = rows.tobytes()
        known: np.ndarray = _NO_PAGES
        known_hashes: tuple[int, ...] = ()
        if (
            held is not None
            and len(held.pages)
            and raw.startswith(held.handle.tokens)
            and table.ns.get(int(held.pages[0])) == extra_key
        ):  # the handle's chain is cached (locked): only what follows it is hashed
            known = held.pages
            # Its keys are the hashes while no collision has moved a key.
            known_hashes = table.hashes_of(known) if table.max_probe else held.handle.block_hashes
        hashes, found = self._find(rows, raw, extra_key, known, known_hashes, True)  # may raise
        m = len(found)
        new = slots[m * ps : nb * ps]
        fresh, top = table.new_pages(new)  # may raise
        # Everything is checked: from here on nothing raises.
        self._clock += 1
        pages = found
        if len(fresh):
            up = int(found[-1]) if m else -1
            table.add(fresh, top, rows[m:], hashes[m:], up, self._clock, extra_key)
            if self._events is not None:
                self._events.stored(extra_key, ids[: nb * ps].tolist(), new.tolist())
            pages = np.concatenate((found, fresh))
        if m:  # after the new blocks: a block is queued before its parent
            table.use(found, self._clock)
        self._recent.remember(raw, hashes, pages, table.gen[pages].tobytes(), extra_key)
        return m * ps, BlockHashCacheHandle(nb * ps, self._keys(pages, hashes), raw), pages

    # ------------------------------------------------------------ lock
    def lock_handle(self, handle: BaseCacheHandle, unlock: bool = False) -> None:
        """Lock (``ref_count += 1``) or unlock every block of ``handle``.

        Unlocking a handle that is not locked (never locked, or unlocked as often as locked)
        raises ``RuntimeError``, even while its blocks are locked through another handle. A block
        whose count drops to 0 joins the tail of the free queue; the chain is released deepest
        block first, so its tail is evicted before its head. A handle of length 0 protects no
        block, but its locks are counted as any handle's, so an unmatched unlock raises here as
        in every manager.
        """
        if not isinstance(unlock, bool):
            raise TypeError(f"unlock must be a bool, got {type(unlock).__name__}")
        if unlock:
            self._release(handle, self._held(handle))
            return
        pages = self._pages(handle)
        self._lock(handle, pages)  # type: ignore[arg-type]  # `_pages` checked its type

    def _lock(self, handle: BlockHashCacheHandle, pages: np.ndarray) -> None:
        lock = self._locks.get(handle)
        if lock is None:
            self._locks[handle] = _Lock(handle, pages)
        else:
            lock.count += 1
        if len(pages):  # a handle of length 0: counted, no block to protect
            self._table.lock(pages)

    def _release(self, handle: BaseCacheHandle, lock: _Lock) -> None:
        lock.count -= 1
        if not lock.count:
            del self._locks[handle]  # type: ignore[arg-type]
        if len(lock.pages):
            self._table.release(lock.pages, self._clock)

    def _lock_of(self, handle: BaseCacheHandle) -> _Lock | None:
        """The lock of ``handle``, when it is locked itself or through an equal handle made for
        the same tokens (locked blocks stay cached: no other check needed); else ``None``."""
        if not isinstance(handle, BlockHashCacheHandle):
            return None
        lock = self._locks.get(handle)
        return lock if lock is not None and handle.tokens == lock.handle.tokens else None

    def _held(self, handle: BaseCacheHandle) -> _Lock:
        """The lock of ``handle`` (`_lock_of`); ``TypeError`` or ``RuntimeError`` (not valid,
        or not locked) otherwise."""
        lock = self._lock_of(handle)
        if lock is None:
            self._chain(handle)  # an invalid handle says so first
            raise RuntimeError(
                f"cannot unlock a handle that is not locked ({handle.cached_len // self.page_size} "
                f"blocks, cached_len={handle.cached_len})"
            )
        return lock

    def _pages(self, handle: BaseCacheHandle) -> np.ndarray:
        """The pages of ``handle``'s chain, root first, checked (a locked chain's are known)."""
        lock = self._lock_of(handle)
        return lock.pages if lock is not None else self._chain(handle)

    def _chain(self, handle: BaseCacheHandle) -> np.ndarray:
        """The pages of the blocks ``handle`` names, root first, after checking that each one is
        still cached, chains from the one before and holds the tokens the handle was made for (a
        weak hash may have put other tokens under the same key). ``TypeError`` for another kind
        of handle, ``RuntimeError`` naming the first block at fault otherwise."""
        if not isinstance(handle, BlockHashCacheHandle):
            raise TypeError(f"handle must be a BlockHashCacheHandle, got {type(handle).__name__}")
        keys, table, width = handle.block_hashes, self._table, 8 * self.page_size
        if handle.cached_len != len(keys) * self.page_size:
            raise RuntimeError(
                f"handle says cached_len={handle.cached_len} but names {len(keys)} blocks of "
                f"{self.page_size} tokens"
            )
        found = list(map(table.page_of.get, keys))
        if None not in found:
            pages = np.fromiter(found, dtype=np.int64, count=len(found))
            if not len(pages) or (
                table.parent[pages[0]] == -1
                and same(table.parent[pages[1:]], pages[:-1])
                and table.tok.take(pages, axis=0).tobytes() == handle.tokens
            ):
                return pages
        parent = -1
        for i, (key, page) in enumerate(zip(keys, found, strict=True)):
            if page is None:
                raise RuntimeError(
                    f"handle's block {i} ({key:#018x}) was evicted; match the prefix again"
                )
            if table.parent[page] != parent:
                raise RuntimeError(
                    f"handle's block {i} ({key:#018x}) does not chain from block {i - 1}"
                )
            if len(handle.tokens) < (i + 1) * width:
                raise RuntimeError(
                    f"handle does not carry the tokens of block {i}; make handles with match_prefix"
                )
            if table.tok[page].tobytes() != handle.tokens[i * width : (i + 1) * width]:
                raise RuntimeError(
                    f"handle's block {i} ({key:#018x}) was evicted and its key now holds other "
                    "tokens; match the prefix again"
                )
            parent = page
        raise RuntimeError(
            f"handle carries {len(handle.tokens) // 8} tokens for {handle.cached_len}; make "
            "handles with match_prefix"
        )

    # ------------------------------------------------------------ evict, reset
    def evict(self, size: int) -> torch.Tensor:
        """Evict free blocks from the head of the free queue until at least ``size`` tokens are
        freed; return their slots, block after block.

        Only blocks no cached block chains from are evicted (the queue's order guarantees the head
        is one). Raises ``RuntimeError`` (evicting nothing) when fewer than ``size`` tokens are
        evictable.
        """
        size = check_count(size)
        if size == 0:
            return self.empty_tensor
        table, ps = self._table, self.page_size
        if size > table.free.size * ps:
            raise RuntimeError(
                f"cannot evict {size} tokens: only {table.free.size * ps} are evictable "
                f"({table.num_locked * ps} are locked)"
            )
        n = -(-size // ps)
        if self._events is not None:  # read before the blocks are gone (the log: after)
            removed = [
                (table.namespace(p), table.prefix_tokens(p), list(range(p * ps, (p + 1) * ps)))
                for p in table.free.head(n)[0].tolist()
            ]
        victims = table.evict(n)
        if self._events is not None:
            for extra_key, tokens, slots in removed:
                self._events.removed(extra_key, tokens, slots)
        return self._slots(victims)

    def reset(self) -> None:
        """Forget every block and every lock of a handle of length 0; ``RuntimeError``
        (changing nothing) while any block is locked."""
        if self._table.num_locked:
            raise RuntimeError(
                f"cannot reset while {self._table.num_locked * self.page_size} tokens are locked; "
                "unlock every handle first"
            )
        self._table = BlockTable(self.page_size, self._max_pages)
        self._recent = RecentChains(self.page_size)
        self._locks = {}  # only handles of length 0 were left: dropped, as the radix tree does
        if self._events is not None:
            self._events.cleared()

    # ------------------------------------------------------------ integrity
    def check_integrity(self) -> None:
        """Check every block, the free queue, the locked handles and the sizes; ``RuntimeError``
        on the first fault."""
        table = self._table
        table.check()
        expected: dict[int, int] = {}
        for handle, lock in self._locks.items():
            if lock.count <= 0:
                raise RuntimeError(f"handle {handle} recorded with lock count {lock.count}")
            for key in handle.block_hashes:
                expected[key] = expected.get(key, 0) + lock.count
        blocks = {b.block_hash: b for b in table.snapshots()}
        contents = set()
        for key, block in blocks.items():
            where = f"block {key:#018x}"
            parent = blocks[block.parent_hash] if block.parent_hash is not None else None
            seed = parent.base if parent is not None else key_seed(block.extra_key)
            if (
                block.base != self._hasher.one(seed, block.tokens)
                or key != (block.base + block.probe) & _MASK
            ):
                raise RuntimeError(f"{where}: hash does not match its parent and tokens")
            content = (block.parent_hash, block.extra_key, block.token_bytes)
            if content in contents:
                raise RuntimeError(
                    f"{where}: the same tokens after the same parent are cached twice"
                )
            contents.add(content)
            if block.ref_count != expected.get(key, 0):
                raise RuntimeError(
                    f"{where}: ref_count {block.ref_count} but the locked handles through it hold "
                    f"{expected.get(key, 0)}"
                )
        stray = [k for k in expected if k not in blocks]
        if stray:
            raise RuntimeError(
                f"locked handles name {len(stray)} blocks that are not cached: {stray[:4]}"
            )
        for handle, lock in self._locks.items():
            if [table.page_of[k] for k in handle.block_hashes] != lock.pages.tolist():
                raise RuntimeError(f"handle {handle} is recorded on pages that are not its blocks'")
