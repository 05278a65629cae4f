"""The block table of `BlockHashCacheManager`: every cached block, one row per page, and the free
queue of the blocks nobody holds, in eviction order (vLLM's ``BlockPool`` and
``FreeKVCacheBlockQueue``).

A block is cached on exactly one page, so every per-block field is a NumPy array indexed by page id
(vLLM keeps one ``KVCacheBlock`` object per page; here it is one row of each array). Locking,
releasing and refreshing a chain are then a few array operations on the chain's page ids, whatever
its length; the only per-block Python work left is the key index (``dict`` operations driven by
``map``/``zip``, in C).

The free queue is a *log*: an array of pages to which each call appends its run with one slice
assignment, instead of one linked-list operation per page as in vLLM. Leaving the queue is lazy:
every page records the position of its live entry in the log (``where``, ``-1`` when it is not
queued), so locking a chain only writes ``-1`` for its pages, and a page moved to the tail simply
records its new position; an entry counts only while ``where`` still points at it. Reading the
head compares a window of the log with ``where`` in one pass. When the log is full its live entries
are copied to the front (the array grown when they fill half of it), so memory stays within a
constant factor of the most pages ever queued and each entry is copied ``O(1)`` times (amortised).
The order is exactly that of a queue in which a page is removed when locked and appended (in run
order) when queued or moved.

Eviction rule. vLLM evicts any free block (an orphaned child just lingers, unmatchable). Here the
cache's content must stay exact (`cached_indices`, `check_integrity`, the page accounting of
`RequestFlow`), so a block is evicted only when no cached block chains from it. The free queue keeps
**every free block after all of its cached descendants**, so its head is always a leaf and eviction
pops from the head, like vLLM. The order holds because a descendant's ref count never exceeds its
ancestor's (a handle locks a whole chain from its first block), an unlock releases a chain deepest
block first, and an insert or a match moves a chain's free blocks to the tail deepest first (new
blocks are appended deepest first too), which also keeps the queue in least-recently-used order;
locking and evicting only remove blocks. `BlockTable.check` verifies the order, and eviction
re-checks that every victim's children are victims too.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence

import numpy as np

from .._validate import check_int_in, check_page_aligned

__all__ = ["CachedBlock", "FreeQueue", "BlockTable", "same", "max_pages_for"]

_MASK = (1 << 64) - 1
#: A child count of 0 and of 1, as int64 bytes (what `BlockTable.evict` compares counts with).
_LEAF, _ONE = np.int64(0).tobytes(), np.int64(1).tobytes()


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays of one dtype hold the same values: compared as bytes, the cheapest test
    for a few hundred values (a ufunc and its reduction cost several times as much)."""
    return a.tobytes() == b.tobytes()


def row_bytes(page_size: int) -> int:
    """Bytes a `BlockTable` keeps per page id: its tokens (int64) and slots (int32), its key, six
    int64 fields and its free-queue position."""
    return 12 * page_size + 64


#: The block table a manager grows to by default, at most: 4 GiB, some 17 million pages of 16
#: tokens (268 million slots) or 57 million of one, past any pool a GPU holds.
DEFAULT_TABLE_BYTES = 4 << 30


def max_pages_for(max_pages: object, page_size: int) -> int:
    """``max_pages`` checked (an integer in ``[1, 2**31 // page_size]``: int32 slots), or for
    ``None`` as many pages as `DEFAULT_TABLE_BYTES` of block table holds."""
    top = (1 << 31) // page_size
    if max_pages is None:
        return min(DEFAULT_TABLE_BYTES // row_bytes(page_size), top)
    return check_int_in(max_pages, "max_pages", 1, top)


class CachedBlock:
    """A copy of one cached block's state, taken when `BlockHashCacheManager.blocks` or
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


class FreeQueue:
    """Pages in eviction order (head first), as a log with lazy removal (the module docstring).

    ``where`` (int64, one entry per page id plus a spare ``-1`` at the end, grown by `reserve`) is
    the position of each queued page's entry in ``log``, ``-1`` for a page not queued; the entries
    of ``log[lo:hi]`` whose position ``where`` names are the queue; ``size`` counts them.
    """

    def __init__(self) -> None:
        self.log = np.full(256, -1, dtype=np.int64)
        self.pos = np.arange(256, dtype=np.int64)  # ``pos[i] == i``: compared with ``where``
        self.where = np.full(1, -1, dtype=np.int64)
        self.lo = self.hi = 0
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def reserve(self, size: int) -> None:
        """Room for page ids below ``size``; the spare entry stays last."""
        old = len(self.where) - 1
        if size > old:
            where = np.full(size + 1, -1, dtype=np.int64)
            where[:old] = self.where[:old]
            self.where = where

    def push(self, pages: np.ndarray, new: int) -> None:
        """Append ``pages`` (int64, in queue order, none twice) at the tail; ``new`` of them were
        not queued (the others move from where they were)."""
        if self.hi + len(pages) > len(self.log):
            self._compact(len(pages))
        hi, end = self.hi, self.hi + len(pages)
        self.log[hi:end] = pages
        self.where[pages] = self.pos[hi:end]
        self.hi = end
        self.size += new

    def remove(self, pages: np.ndarray) -> None:
        """Take ``pages`` (int64, every one queued, none twice) out of the queue."""
        self.where[pages] = -1
        self.size -= len(pages)

    def head(self, n: int) -> tuple[np.ndarray, int]:
        """The first ``n`` queued pages (``0 < n <= size``), and where the head moves once they
        are gone (for `drop`). Nothing changes here.

        The window of the log looked at grows until it holds ``n`` live entries: usually the first
        ``n`` entries are all live, and one comparison says so."""
        lo, log, where, pos = self.lo, self.log, self.where, self.pos
        span = n
        while True:
            end = min(lo + span, self.hi)
            window = log[lo:end]
            if span == n and same(where[window], pos[lo:end]):
                return window, end
            found = (where[window] == pos[lo:end]).nonzero()[0]
            if len(found) >= n:
                return window[found[:n]], lo + int(found[n - 1]) + 1
            if end == self.hi:
                raise RuntimeError(
                    f"internal error: the free queue holds {len(found)} pages, not {n}"
                )
            span = 4 * span + 16

    def drop(self, pages: np.ndarray, lo: int) -> None:
        """Remove the head ``pages`` that `head` returned with ``lo``."""
        self.remove(pages)
        self.lo = lo

    def pages(self) -> np.ndarray:
        """Every queued page, head first (int64)."""
        window = self.log[self.lo : self.hi]
        out: np.ndarray = window[self.where[window] == self.pos[self.lo : self.hi]]
        return out

    def _compact(self, room: int) -> None:
        """Move the live entries to the front, with room for ``room`` more (the log grown when
        they would fill more than half of it)."""
        live = self.pages()
        size = len(live) + room
        if 2 * size > len(self.log):
            cap = max(2 * size, 2 * len(self.log))
            self.log = np.full(cap, -1, dtype=np.int64)
            self.pos = np.arange(cap, dtype=np.int64)
        self.log[: len(live)] = live
        self.where[live] = self.pos[: len(live)]
        self.lo, self.hi = 0, len(live)


class BlockTable:
    """Every cached block, one row per page, plus the key index and the free queue.

    Arrays, indexed by page and grown on demand, each with one spare row at index ``-1`` that
    stands for "no page" (so that the parent ``-1`` of a first block can be used as an index):

    - ``tok``: the block's tokens, ``(capacity + 1, page_size)`` int64;
    - ``slots``: the page's slots, int32, the same shape (a ``take`` of rows costs a quarter of
      computing them; the spare row holds those of page ``capacity``);
    - ``key``: the block's key, uint64 (its hash plus ``probe``, the collision offset);
    - ``parent``: the parent block's page, ``-1`` for a first block;
    - ``ref``: how many locks hold the block (0 on a page that holds no block);
    - ``nchild``: how many cached blocks chain from it; ``last``: when it was last used;
    - ``gen``: the block's generation, a number `add` gives each chain it caches and never gives
      again, ``-1`` for a page that holds no block: an unchanged generation proves that a page
      still holds the very block it held, whatever happened in between.

    ``page_of`` maps key -> page in insertion order (a parent before its children); ``free`` (a
    `FreeQueue`) holds the pages whose ``ref`` is 0, head = next to evict; ``ns`` the namespace of
    each first block whose namespace is not ``None``; ``num_locked`` counts the pages whose
    ``ref`` is not 0; ``max_probe`` is the largest probe ever used.

    Memory: one row per page id up to the largest one ever cached (`row_bytes` a page), like vLLM's
    block pool, which holds a block object for every page there is; page ids from ``max_pages`` on
    are refused (`new_pages`), so that one stray slot cannot make the table grow past what the
    machine holds.
    """

    def __init__(self, page_size: int, max_pages: int) -> None:
        self.page_size = page_size
        self.max_pages = max_pages
        self.capacity = 0
        self.tok = np.zeros((1, page_size), dtype=np.int64)
        self.slots = np.arange(page_size, dtype=np.int32).reshape(1, page_size)
        self.key = np.zeros(1, dtype=np.uint64)
        self.parent = np.full(1, -1, dtype=np.int64)
        self.ref = np.zeros(1, dtype=np.int64)
        self.nchild = np.zeros(1, dtype=np.int64)
        self.last = np.zeros(1, dtype=np.int64)
        self.probe = np.zeros(1, dtype=np.int64)
        self.gen = np.full(1, -1, dtype=np.int64)
        self.next_gen = 0
        self.page_of: dict[int, int] = {}
        self.free = FreeQueue()
        self.ns: dict[int, Hashable] = {}
        self.num_locked = 0
        self.max_probe = 0

    def reserve(self, top: int) -> None:
        """Rows for page ids up to ``top`` (inclusive; below ``max_pages``)."""
        if top < self.capacity:
            return
        old = self.capacity
        size = max(top + 1, min(max(2 * old, 64), self.max_pages))

        def grown(a: np.ndarray) -> np.ndarray:
            out = np.empty((size + 1, *a.shape[1:]), dtype=a.dtype)
            out[:old] = a[:old]
            out[old:] = a[-1]  # the spare row's values: no block
            return out

        self.tok, self.key, self.parent = grown(self.tok), grown(self.key), grown(self.parent)
        self.ref, self.nchild, self.last = grown(self.ref), grown(self.nchild), grown(self.last)
        self.probe, self.gen = grown(self.probe), grown(self.gen)
        self.slots = np.arange((size + 1) * self.page_size, dtype=np.int32).reshape(size + 1, -1)
        self.capacity = size
        self.free.reserve(size)

    # ------------------------------------------------------------ reading
    def slots_of(self, pages: np.ndarray) -> np.ndarray:
        """The slots of ``pages`` (int64, cached), page after page: 1-D int32."""
        return self.slots.take(pages, axis=0).reshape(-1)

    def new_pages(self, slots: np.ndarray) -> tuple[np.ndarray, int]:
        """The pages of new blocks whose slots are ``slots`` (int32, whole blocks), as int64, and
        the largest (``-1``: none).

        ``ValueError`` naming the slots or the page unless each block's slots are the
        ``page_size`` consecutive slots of one page ``>= 0`` (the first a multiple of
        ``page_size``), below ``max_pages``, that holds no cached block and no other new block."""
        ps = self.page_size
        pages = np.floor_divide(slots[::ps], ps, dtype=np.int64)
        if not len(pages):
            return pages, -1
        # Usually one comparison: the slot table's rows of these pages are the slots given. (A
        # negative page reads a row from the end, whose slots are not negative; a page past the
        # table raises.) Otherwise the checks that name the fault.
        try:
            fits = same(self.slots.take(pages, axis=0), slots)
        except IndexError:
            fits = False
        if not fits:
            if int(slots.min()) < 0:
                raise ValueError(f"indices must be >= 0, got {int(slots.min())}")
            check_page_aligned(slots, ps)
        top = pages.item(pages.argmax())  # as max(), without its Python wrapper (~5x cheaper)
        if top >= self.max_pages:
            raise ValueError(
                f"indices: page {top} (slots {top * ps}..{(top + 1) * ps - 1}) is past this "
                f"manager's max_pages={self.max_pages}: its block table keeps "
                f"{row_bytes(ps)} bytes for every page id up to the largest cached, so pass "
                "max_pages (the pool's page count) to cache pages past it"
            )
        inside = pages if top < self.capacity else pages[pages < self.capacity]
        gens = self.gen[inside]
        if len(gens) and gens.item(gens.argmax()) >= 0:  # one holds a block (-1: none)
            page = int(inside[(gens >= 0).argmax()])
            raise ValueError(
                f"page {page} (slots {page * ps}..{(page + 1) * ps - 1}) already holds cached "
                f"block {int(self.key[page]):#018x}; a page can be cached once"
            )
        listed = pages.tolist()
        if len(set(listed)) != len(listed):
            dup = next(p for p in listed if listed.count(p) > 1)
            raise ValueError(f"page {dup} appears in more than one new block of this insert")
        return pages, top

    # Along a chain (first block first) ref counts never grow, as a lock covers a whole chain from
    # its first block: a chain's free blocks are a suffix of it. Its first block's count says
    # whether any is held, its last one's whether all are, else ``count_nonzero`` finds where.
    def held(self, pages: np.ndarray) -> int:
        """How many blocks of the chain ``pages`` (not empty) are locked: a prefix of it."""
        ref = self.ref
        if not ref[pages[0]]:
            return 0
        if ref[pages[-1]]:
            return len(pages)
        return int(np.count_nonzero(ref[pages]))

    def unchanged(self, pages: np.ndarray, gens: bytes) -> np.ndarray:
        """The longest prefix of ``pages`` whose generations are still ``gens`` (their int64
        bytes, read when they were remembered): the pages that still hold those very blocks."""
        now, then = self.gen[pages], np.frombuffer(gens, dtype=np.int64)
        if same(now, then):
            return pages
        changed = np.flatnonzero(now != then)
        return pages[: changed[0]] if len(changed) else pages

    def hashes_of(self, pages: np.ndarray) -> tuple[int, ...]:
        """The chained hashes of the blocks on ``pages`` (each key less its probe offset)."""
        return tuple((self.key[pages] - self.probe[pages].astype(np.uint64)).tolist())

    def namespace(self, page: int) -> Hashable:
        """The namespace of the chain through ``page`` (follows parents to its first block)."""
        parent = self.parent
        while parent[page] >= 0:
            page = int(parent[page])
        return self.ns.get(page)

    def prefix_tokens(self, page: int) -> list[int]:
        """The tokens of the whole prefix ending with the block on ``page``, first block first."""
        chain = [page]
        while self.parent[chain[-1]] >= 0:
            chain.append(int(self.parent[chain[-1]]))
        tokens: list[int] = self.tok[chain[::-1]].reshape(-1).tolist()
        return tokens

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

    # ------------------------------------------------------------ changes
    def add(
        self,
        pages: np.ndarray,
        top: int,
        rows: np.ndarray,
        hashes: Sequence[int],
        parent: int,
        tic: int,
        extra_key: Hashable,
    ) -> None:
        """Cache a chain: ``rows[i]`` (int64 tokens) with hash ``hashes[i]`` on ``pages[i]``
        (checked by `new_pages`; ``top`` the largest), the first chaining from page ``parent``
        (``-1``: none, then the chain is in namespace ``extra_key``). The new blocks are free,
        used at ``tic``, and join the tail of the free queue deepest first. Nothing raises.

        Each block is filed under its hash, or, when a cached block or an earlier new one holds
        that key (a collision), under the next free key (``hash + 1``, ...; its ``probe``)."""
        self.reserve(top)
        listed: list[int] = pages.tolist()
        page_of = self.page_of
        before = len(page_of)
        filed = page_of.keys().isdisjoint(hashes)
        if filed:
            page_of.update(zip(hashes, listed))  # noqa: B905  (equal lengths)
            if len(page_of) != before + len(listed):  # two new blocks share a hash: undo
                for h in hashes:
                    page_of.pop(h, None)  # every one was a new key
                filed = False
        if filed:
            self.key[pages] = hashes
            if self.max_probe:  # else no page ever had a probe
                self.probe[pages] = 0
        else:
            self._file_probing(pages, listed, hashes)
        self.tok[pages] = rows
        self.parent[pages[1:]] = pages[:-1]
        self.parent[listed[0]] = parent
        self.nchild[pages] = 1
        self.nchild[listed[-1]] = 0
        self.last[pages] = tic
        self.gen[pages] = self.next_gen
        self.next_gen += 1
        if parent >= 0:
            self.nchild[parent] += 1
        elif extra_key is not None:
            self.ns[listed[0]] = extra_key
        self.free.push(pages[::-1], len(listed))

    def _file_probing(self, pages: np.ndarray, listed: list[int], hashes: Sequence[int]) -> None:
        page_of = self.page_of
        keys, probes = [], []
        for h, page in zip(hashes, listed, strict=True):
            key, probe = h, 0
            while key in page_of:
                probe += 1
                key = (h + probe) & _MASK
            page_of[key] = page
            keys.append(key)
            probes.append(probe)
        self.key[pages] = keys
        self.probe[pages] = probes
        self.max_probe = max(self.max_probe, *probes)

    def lock(self, pages: np.ndarray) -> None:
        """``ref += 1`` on every page of a chain (not empty, first block first); the blocks locked
        for the first time leave the free queue."""
        held = self.held(pages)
        if held:
            self.ref[pages] += 1
        else:  # none is locked (the usual case): every count goes from 0 to 1
            self.ref[pages] = 1
        if held < len(pages):
            self.free.remove(pages[held:])
            self.num_locked += len(pages) - held

    def release(self, pages: np.ndarray, tic: int) -> None:
        """``ref -= 1`` on every page of a chain (each locked); those left unlocked join the tail
        of the free queue, deepest first, used at ``tic``."""
        if self.ref[pages[0]] == 1:  # the first block's count is the largest: all go to 0
            self.ref[pages] = 0
            n = len(pages)
        else:
            self.ref[pages] -= 1
            n = len(pages) - self.held(pages)
        if n:
            run = pages[: -n - 1 : -1]
            self.last[run] = tic
            self.free.push(run, n)
            self.num_locked -= n

    def use(self, pages: np.ndarray, tic: int) -> None:
        """Mark a chain used at ``tic``: its free blocks move to the tail of the queue, deepest
        first (its locked ones are not queued)."""
        n = len(pages) - self.held(pages) if len(pages) else 0
        if n:
            run = pages[: -n - 1 : -1]
            self.last[run] = tic
            self.free.push(run, 0)

    def evict(self, n: int) -> np.ndarray:
        """Evict the ``n`` blocks at the head of the free queue (``0 < n <= free.size``) and
        return their pages, in queue order (read-only, valid until the queue changes): out of the
        queue, the key index and the table; their parents that stay lose a child.

        ``RuntimeError``, changing nothing, if a victim still has a child that is not a victim
        (the queue's order rules it out; this is the check that it held)."""
        pages, lo = self.free.head(n)
        parent, ref, nchild = self.parent, self.ref, self.nchild
        ups = parent[pages]
        # Usually the victims are one chain, deepest block first: each one's parent is the next
        # victim, and each has one child, the victim before it, but the first, a leaf.
        if same(ups[:-1], pages[1:]) and nchild[pages].tobytes() == _LEAF + _ONE * (n - 1):
            stay = ups[-1:]
        else:  # mark the victims (free: their counts are 0) to see whose parent is one
            ref[pages] = -1
            up_is_victim = ref[ups] == -1  # (a first block's parent -1 reads the spare row: 0)
            ref[pages] = 0
            # The victims chaining from a victim are among its children: equal totals mean all.
            if np.count_nonzero(up_is_victim) != int(nchild[pages].sum()):
                victims = pages.tolist()
                page = next(p for p in victims if nchild[p] != ups.tolist().count(p))
                raise RuntimeError(
                    f"internal error: free block {int(self.key[page]):#018x} would be evicted "
                    f"before its {int(nchild[page])} children; nothing was evicted"
                )
            stay = ups[~up_is_victim]
        self.gen[pages] = -1
        self.free.drop(pages, lo)
        page_of = self.page_of
        for key in self.key[pages].tolist():
            del page_of[key]
        if self.ns:
            for page in pages[ups == -1].tolist():
                self.ns.pop(page, None)
        for up in stay.tolist():  # parents that stay (-1: none)
            if up >= 0:
                nchild[up] -= 1
        return pages

    # ------------------------------------------------------------ integrity
    def check(self) -> None:
        """``RuntimeError`` on the first fault of the table's own bookkeeping: the key index
        against the rows, the parents, the child counts, the free queue (its pages, its order:
        least recently used first, a block before its parent), the lock counts along chains
        and ``num_locked``."""
        cached = set(np.flatnonzero(self.gen[: self.capacity] >= 0).tolist())
        listed = list(self.page_of.values())
        if set(listed) != cached or len(listed) != len(cached):
            raise RuntimeError(f"{len(listed)} pages recorded for {len(cached)} blocks")
        if self.tok.shape[1] != self.page_size:
            raise RuntimeError(f"tokens stored {self.tok.shape[1]} a block, not {self.page_size}")
        children = dict.fromkeys(cached, 0)
        for key, page in self.page_of.items():
            up = int(self.parent[page])
            if int(self.key[page]) != key:
                raise RuntimeError(f"block {key:#018x}: filed under the wrong key")
            if up >= 0 and up not in cached:
                raise RuntimeError(f"block {key:#018x}: parent on page {up} is not cached")
            if not 0 <= self.probe[page] <= self.max_probe:
                raise RuntimeError(
                    f"block {key:#018x}: probe {int(self.probe[page])} outside "
                    f"[0, {self.max_probe}]"
                )
            if up >= 0:
                children[up] += 1
                if self.ref[up] < self.ref[page]:
                    raise RuntimeError(
                        f"block {key:#018x}: ref_count {int(self.ref[page])} exceeds its "
                        f"parent's {int(self.ref[up])}"
                    )
        for page, n in children.items():
            if self.nchild[page] != n:
                raise RuntimeError(
                    f"block {int(self.key[page]):#018x}: records {int(self.nchild[page])} "
                    f"children, has {n}"
                )
        for page in self.ns:
            if page not in cached or self.parent[page] >= 0:
                raise RuntimeError(f"namespace recorded for page {page}, not a cached first block")
        self._check_queue(cached)

    def _check_queue(self, cached: set[int]) -> None:
        free = self.free
        queue: list[int] = free.pages().tolist()
        marked = int(np.count_nonzero(free.where >= 0))
        if not len(queue) == len(set(queue)) == marked == free.size:
            raise RuntimeError(
                f"free queue: {len(queue)} pages listed ({len(set(queue))} distinct), "
                f"{marked} marked queued, {free.size} counted"
            )
        extra = [p for p in queue if p not in cached]
        if extra:
            raise RuntimeError(
                f"free queue holds {len(extra)} pages that are not cached: {extra[:4]}"
            )
        queued = set(queue)
        locked = 0
        for page in cached:
            ref = int(self.ref[page])
            if ref < 0:
                raise RuntimeError(f"block {int(self.key[page]):#018x}: negative ref_count {ref}")
            if (ref == 0) != (page in queued):
                where = "in" if page in queued else "not in"
                raise RuntimeError(
                    f"block {int(self.key[page]):#018x}: ref_count {ref} but {where} the free queue"
                )
            locked += ref > 0
        if locked != self.num_locked:
            raise RuntimeError(f"recorded {self.num_locked} locked blocks, counted {locked}")
        uses = self.last[queue]
        if len(queue) > 1 and (uses[1:] < uses[:-1]).any():
            page = queue[int((uses[1:] < uses[:-1]).argmax()) + 1]
            raise RuntimeError(f"free queue out of LRU order at page {page}")
        position = {p: i for i, p in enumerate(queue)}
        for i, page in enumerate(queue):
            if position.get(int(self.parent[page]), i) < i:
                raise RuntimeError(
                    f"block on page {page} is queued after its parent: the parent would be "
                    "evicted first"
                )
