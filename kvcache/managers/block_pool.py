"""The state of `BlockHashCacheManager`: a table of cached blocks indexed by page, its records for
callers (`CachedBlock`) and its handles (`BlockHashCacheHandle`).

A block is cached on exactly one page, so the table keeps every per-block field in a NumPy array
indexed by page id (vLLM keeps one ``KVCacheBlock`` object per page; here it is one row of each
array). Locking, releasing and refreshing a chain are then a few array operations on the
chain's page ids, whatever its length, and so is queueing it: the free queue (`block_queue`)
keeps a chain's run of pages as one entry. The only per-block Python work left is the key index
(``dict`` operations driven by ``map``/``zip``, in C).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import count

import numpy as np

from .base import BaseCacheHandle
from .block_queue import FreeQueue

__all__ = ["CachedBlock", "BlockHashCacheHandle", "BlockTable", "new_handle", "next_serial"]

_MASK = (1 << 64) - 1
#: Every insert call that adds blocks takes a number no other call (of any manager) has, and
#: writes it on their pages: equal numbers on a page prove it still holds the same block.
next_serial = count(1).__next__


class CachedBlock:
    """A copy of one cached full block's state, taken when `BlockHashCacheManager.blocks` or
    `get_block` was called: ``page_size`` tokens whose K/V fill page ``page``.

    ``block_hash`` is its key in the manager's table: its chained hash ``base`` plus ``probe``
    (how far the key moved after a collision, usually 0). ``parent_hash`` is the key of the block
    before it (``None`` for the first block of a sequence). ``ref_count`` counts the locks through
    it (0: the block is in the free queue and may be evicted); ``num_children`` the cached blocks
    that chain from it. ``last_use`` is the manager's clock when it was last matched or inserted
    while free, or released. ``token_bytes`` holds the tokens as little-endian int64; ``tokens``
    gives them as a tuple of ints. ``extra_key`` is the namespace of the chain it belongs to.
    """

    __slots__ = (
        "base",
        "block_hash",
        "extra_key",
        "last_use",
        "num_children",
        "page",
        "parent_hash",
        "probe",
        "ref_count",
        "token_bytes",
    )

    def __init__(
        self,
        block_hash: int,
        base: int,
        parent_hash: int | None,
        token_bytes: bytes,
        page: int,
        last_use: int,
        probe: int = 0,
        num_children: int = 0,
        extra_key: Hashable = None,
        ref_count: int = 0,
    ) -> None:
        self.extra_key = extra_key
        self.block_hash = block_hash
        self.base = base
        self.parent_hash = parent_hash
        self.token_bytes = token_bytes
        self.page = page
        self.ref_count = ref_count
        self.num_children = num_children
        self.last_use = last_use
        self.probe = probe

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(np.frombuffer(self.token_bytes, dtype=np.int64).tolist())

    def __repr__(self) -> str:
        toks = list(self.tokens)
        shown = toks if len(toks) <= 8 else [*toks[:4], "...", *toks[-2:]]
        return (
            f"CachedBlock(hash={self.block_hash:#018x}, page={self.page}, tokens={shown}, "
            f"ref_count={self.ref_count}, last_use={self.last_use})"
        )


@dataclass(frozen=True)
class BlockHashCacheHandle(BaseCacheHandle):
    """The matched prefix is the chain of blocks ``block_hashes`` (``cached_len // page_size`` of them).

    A handle names the *content* it was made for: ``tokens`` (int64 bytes of the ids it was made
    from, by `match_prefix` or `insert_and_match`; the chain's are the first ``cached_len``) are
    compared with what the keys hold whenever
    the handle is used after an eviction. If its blocks are evicted the handle can no longer be
    locked (``RuntimeError``), even when other tokens have since been cached under the same keys
    (a hash collision); if the same tokens are cached again, the handle names the new blocks.
    Equality and hashing use ``cached_len`` and ``block_hashes`` only: equal handles are the
    same claim.
    """

    block_hashes: tuple[int, ...]
    tokens: bytes = field(default=b"", compare=False, repr=False)
    #: The pages of the chain when the handle was made (int64), and the manager's (token, epoch,
    #: ``block_hashes`` object) then: a handle made since the last eviction needs no re-check.
    pages: np.ndarray | None = field(default=None, compare=False, repr=False)
    stamp: tuple[object, int, object] | None = field(default=None, compare=False, repr=False)
    #: The serials of ``pages`` then (int64 bytes; ``None``: not recorded), which the fused
    #: insert of a locked handle carries to its memo entry instead of reading them again.
    serials: bytes | None = field(default=None, compare=False, repr=False)

    def __hash__(self) -> int:
        # Equal handles have equal lengths and last keys, so those two suffice (a chained key
        # names its whole prefix: different chains rarely share one, and ``==`` still compares
        # every key). O(1): a handle is a dict key on every lock and unlock, and hashing a whole
        # chain's tuple costs a microsecond per 50 blocks.
        hashes = self.block_hashes
        return hash((self.cached_len, hashes[-1] if hashes else None))


def new_handle(
    cached_len: int,
    block_hashes: tuple[int, ...],
    tokens: bytes,
    pages: np.ndarray,
    stamp: tuple[object, int, object],
    serials: bytes | None = None,
) -> BlockHashCacheHandle:
    """``BlockHashCacheHandle(cached_len, block_hashes, tokens, pages, stamp, serials)``, made the way
    unpickling makes one (fields written straight into the new object): a frozen dataclass's
    ``__init__`` sets each field through ``object.__setattr__``, which costs a few microseconds
    on every match and insert. The manager passes values that are already checked."""
    handle: BlockHashCacheHandle = object.__new__(BlockHashCacheHandle)
    handle.__dict__.update(
        cached_len=cached_len,
        block_hashes=block_hashes,
        tokens=tokens,
        pages=pages,
        stamp=stamp,
        serials=serials,
    )
    return handle


#: The slots of the spare row: no page's, and no block of page -1 (which a negative index
#: reads there) has them, so that `block_insert.new_pages` compares slots without a range check.
_NO_SLOT = np.iinfo(np.int32).min

#: Columns of `BlockTable.meta`.
PARENT, REF, NCHILD, LAST, PROBE, GEN = range(6)


class BlockTable:
    """Every cached block, one row per page, plus the key index and the free queue.

    Arrays (indexed by page, grown on demand, with one spare row at index ``-1`` that stands for
    "no page" so that a parent of ``-1`` can be used as an index): ``tok`` (tokens,
    ``(capacity + 1, page_size)`` int64), ``key`` (the block's key, uint64), ``slots`` (each
    page's slots, int32) and ``meta`` (int64), whose columns are viewed as ``parent`` (the parent
    block's page, ``-1`` for a first block), ``ref`` (lock count), ``nchild`` (cached children),
    ``last`` (last use), ``probe`` (collision offset) and ``gen`` (the serial of the insert that
    cached it, ``-1`` when the page holds no block). ``page_of`` maps key -> page in insertion
    order (a parent before its children); ``free`` (a `FreeQueue`) holds the pages whose ``ref``
    is 0, head = next to evict; ``ns`` the namespace of each first block whose namespace is not ``None``.

    Memory: one row per page id up to the largest one ever cached (`block_insert.row_bytes` a
    page), like vLLM's block pool, which holds a block object for every page there is; page ids
    from ``max_pages`` on are refused (`block_insert.new_pages`), so that one stray slot cannot
    make the table grow past what the machine holds.
    """

    def __init__(self, page_size: int, max_pages: int) -> None:
        self.page_size = page_size
        self.max_pages = max_pages
        self.capacity = 0
        self.tok = np.zeros((1, page_size), dtype=np.int64)
        self._row = np.dtype((np.void, 8 * page_size))
        self._slot_row = np.dtype((np.void, 4 * page_size))
        self.key = np.zeros(1, dtype=np.uint64)
        self.slots: np.ndarray = np.full((1, page_size), _NO_SLOT, dtype=np.int32)  # spare row
        self.meta = np.array([[-1, 0, 0, 0, 0, -1]], dtype=np.int64)
        self._views()
        self.page_of: dict[int, int] = {}
        self.free = FreeQueue()
        self.ns: dict[int, Hashable] = {}
        self.num_locked = 0  # pages whose ref > 0
        self.max_probe = 0  # the largest probe ever used

    def _views(self) -> None:
        # Each page's tokens (slots) as one item: rows are written (read) through these as 1-D
        # fancy indexing, which costs less than that of 2-D rows.
        self._tok_rows = self.tok.view(self._row).reshape(-1)
        self.slot_rows = self.slots.view(self._slot_row).reshape(-1)
        meta = self.meta
        self.parent, self.ref, self.nchild = meta[:, PARENT], meta[:, REF], meta[:, NCHILD]
        self.last, self.probe, self.gen = meta[:, LAST], meta[:, PROBE], meta[:, GEN]

    def reserve(self, top: int) -> None:
        """Make room for page ids up to ``top`` (inclusive)."""
        if top < self.capacity:
            return
        # Never past max_pages (``top`` is below it), so that a page id at or past it is always
        # outside the table, where `block_insert.new_pages` checks it.
        old, size = self.capacity, max(top + 1, min(max(2 * self.capacity, 64), self.max_pages))
        ps = self.page_size

        def grown(a: np.ndarray) -> np.ndarray:
            out = np.empty((size + 1, *a.shape[1:]), dtype=a.dtype)
            out[:old] = a[:old]
            out[old:] = a[-1]  # the spare row's values: no block
            return out

        self.tok, self.key, self.meta = grown(self.tok), grown(self.key), grown(self.meta)
        slots = np.arange((size + 1) * ps, dtype=np.int32).reshape(size + 1, ps)
        slots[-1] = _NO_SLOT
        self.slots = slots
        self.capacity = size
        self.free.reserve(size)
        self._views()

    def holds(self, pages: np.ndarray) -> np.ndarray:
        """Which of ``pages`` (``>= 0``) hold a cached block (bool array)."""
        if len(pages) and pages.max() < self.capacity:
            held: np.ndarray = self.gen[pages] >= 0
            return held
        inside = pages < self.capacity
        out = np.zeros(len(pages), dtype=bool)
        out[inside] = self.gen[pages[inside]] >= 0
        return out

    # ------------------------------------------------------------ changes
    def add(
        self,
        pages: np.ndarray,
        listed: list[int],
        top: int,
        keys: Sequence[int] | np.ndarray,
        probes: list[int] | None,
        rows: np.ndarray,
        parent: int,
        tic: int,
        extra_key: Hashable,
        queue: bool = True,
    ) -> int:
        """Cache a chain: ``rows[i]`` (int64 tokens) under ``keys[i]`` (already filed in
        ``page_of``; a list or a ``uint64`` array) on ``pages[i]`` (int64, unused, none twice;
        ``listed`` the same as a list, ``top`` the largest), the first chaining from page
        ``parent`` (``-1``: none). The new blocks are free, used at ``tic``, and join the free
        queue deepest first (not ``queue``: the caller's `release` queues them and marks their
        use, at ``tic``). Returns their serial."""
        if top >= self.capacity:
            self.reserve(top)
        if rows.flags.c_contiguous:
            self._tok_rows[pages] = rows.view(self._row).reshape(-1)
        else:
            self.tok[pages] = rows
        self.key[pages] = keys
        serial = next_serial()
        # Column by column: a 1-D fancy write costs a third of a row write of the 2-D ``meta``.
        # A page that holds no block has ref 0 (only free blocks are evicted) and, until a
        # collision has happened, probe 0.
        self.gen[pages] = serial
        if queue:
            self.last[pages] = tic
        nchild, first = self.nchild, listed[0]
        if len(listed) > 1:
            above = pages[:-1]
            self.parent[pages[1:]] = above
            nchild[above] = 1
        self.parent[first] = parent
        nchild[listed[-1]] = 0
        if probes is not None:
            self.probe[pages] = probes
        elif self.max_probe:
            self.probe[pages] = 0
        if parent >= 0:
            nchild[parent] = nchild.item(parent) + 1
        elif extra_key is not None:
            self.ns[first] = extra_key
        if queue:
            self.free.push(pages[::-1], len(listed))
        return serial

    # Along a chain (root first) ref counts never grow (a lock covers a whole chain from its
    # first block), so a chain's free blocks are a suffix of it: its first block's count says
    # whether any is held, its last one's whether all are, else ``count_nonzero`` finds where.
    def held(self, pages: np.ndarray) -> int:
        """How many blocks of the chain ``pages`` (not empty) are locked: a prefix of it."""
        ref = self.ref
        if not ref.item(pages.item(0)):  # item(): plain ints, no NumPy scalars
            return 0
        if ref.item(pages.item(-1)):
            return len(pages)
        return int(np.count_nonzero(ref[pages]))

    def lock(self, pages: np.ndarray) -> None:
        """``ref += 1`` on every page of a chain (non-empty, root end first, so the first page's
        count is the largest); those locked for the first time leave the queue."""
        ref = self.ref
        if not ref.item(pages.item(0)):  # none is locked: every count goes from 0 to 1
            ref[pages] = 1  # (a plain write costs half of ``+= 1``)
            self.free.remove(pages)
            self.num_locked += len(pages)
            return
        held = self.held(pages)
        ref[pages] += 1
        if held < len(pages):
            self.free.remove(pages[held:])
            self.num_locked += len(pages) - held

    def release(
        self, pages: np.ndarray, clock: int, chain: np.ndarray | None = None, new: int = 0
    ) -> None:
        """``ref -= 1`` on every page of a chain (each locked); those left unlocked join the
        queue's tail, deepest first, used at ``clock``. ``chain``: ``pages`` followed by ``new``
        blocks that `add` left out of the queue: they join first, deepest first, in the same
        run, used at ``clock`` too."""
        ref = self.ref
        if ref.item(pages.item(0)) == 1:  # the first block's count is the largest: all are 1
            ref[pages] = 0
            n = len(pages)
        else:
            ref[pages] -= 1
            n = len(pages) - self.held(pages)
        self.num_locked -= n
        if chain is not None:
            n += new
            run = chain[::-1] if n == len(chain) else chain[::-1][:n]  # usually all of it
        elif n:
            run = pages[::-1][:n]
        if n:
            self.last[run] = clock
            self.free.push(run, n)

    def use(self, pages: np.ndarray, tic: int) -> None:
        """Mark a chain used at ``tic``: its free blocks move to the queue's tail, deepest first."""
        held = self.held(pages) if len(pages) else 0
        if held < len(pages):
            idle = pages[: held - 1 if held else None : -1]
            self.last[idle] = tic
            self.free.push(idle, 0)

    # ------------------------------------------------------------ reading
    def keys_of(self, pages: np.ndarray) -> list[int]:
        out: list[int] = self.key[pages].tolist()
        return out

    def namespace(self, page: int) -> Hashable:
        """The namespace of the chain through ``page`` (follows parents to its first block)."""
        parent = self.parent
        while parent[page] >= 0:
            page = int(parent[page])
        return self.ns.get(page)

    def snapshot(self, page: int, extra_key: Hashable = None) -> CachedBlock:
        key, probe, up = int(self.key[page]), int(self.probe[page]), int(self.parent[page])
        return CachedBlock(
            key,
            (key - probe) & _MASK,
            int(self.key[up]) if up >= 0 else None,
            self.tok[page].tobytes(),
            page,
            int(self.last[page]),
            probe,
            int(self.nchild[page]),
            extra_key,
            int(self.ref[page]),
        )

    def snapshots(self) -> Iterator[CachedBlock]:
        """A `CachedBlock` per cached block, in insertion order."""
        spaces: dict[int, Hashable] = {}
        for page in list(self.page_of.values()):
            up = int(self.parent[page])
            ns = self.ns.get(page) if up < 0 else spaces.get(up, self.namespace(page))
            spaces[page] = ns
            yield self.snapshot(page, ns)
