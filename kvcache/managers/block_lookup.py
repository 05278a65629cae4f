"""Finding cached chains for `BlockHashCacheManager`: the walk over a sequence's block hashes, the
block hashes a request carries from `match_prefix` to `insert_prefix`, and the check of a
handle (an insert's new pages: `block_insert`).

Collisions. A 64-bit hash can collide (and a caller's ``hash_fn`` may be weak on purpose). Every
block keeps its tokens and its parent, and a lookup compares both, so a collision can cost a
cache hit but never returns another prefix's K/V. A block whose hash is taken by a different block
is stored under the next free key (``hash + 1``, ``hash + 2``, ... modulo 2**64, its ``probe``
offset), and lookups try every offset up to the largest ever used (``0`` unless a collision
happened). A child's hash chains from its parent's hash, not its key, so probing changes no other
block's name.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from .base import BaseCacheHandle
from .block_hash_chain import ChainHasher, key_seed
from .block_pool import BlockHashCacheHandle, BlockTable

__all__ = [
    "walk",
    "RequestHashes",
    "hash_rest",
    "handle_pages",
    "NO_PAGES",
]

_MASK = (1 << 64) - 1
#: The hashes of a sequence's first blocks: a list, or the tuple a handle carries (extended
#: without copying it into a list first).
Hashes = Sequence[int]
NO_PAGES = np.zeros(0, dtype=np.int64)
NO_PAGES.flags.writeable = False


def walk(
    table: BlockTable,
    rows: np.ndarray,
    hashes: Hashes,
    known: np.ndarray = NO_PAGES,
    extra_key: Hashable = None,
) -> np.ndarray:
    """The pages of the cached chain matching the longest prefix of ``rows`` (read-only).

    ``rows`` is ``(n, page_size)`` int64; ``hashes[i]`` is the chained hash of ``rows[:i + 1]``
    (only the first ``len(hashes)`` rows are looked at);
    ``known`` (int64 pages) is a chain already known to match ``rows[:len(known)]``, from which
    the walk goes on. The chain's first block must belong to namespace ``extra_key``. Without
    collisions (``max_probe == 0``) a block's key is its hash: one dict probe per block (run in
    C), then the parents and the tokens of the whole chain in one array comparison each.
    """
    i0 = len(known)
    if table.max_probe:
        return _walk_probing(table, rows, hashes, known, extra_key)
    get = table.page_of.get
    if i0 and (i0 == len(hashes) or get(hashes[i0]) is None):
        return known  # an insert's usual case: its match found all that is cached
    found = list(map(get, hashes[i0:] if i0 else hashes))
    if None in found:
        del found[found.index(None) :]  # a miss ends the chain
    k = len(found)
    if not k:
        return known
    pages = np.array(found, dtype=np.int64)
    if (
        table.parent[found[0]] != (known[-1] if i0 else -1)
        or np.count_nonzero(table.parent[pages[1:]] != pages[:-1])
        or table.tok.take(pages, axis=0).tobytes() != rows[i0 : i0 + k].tobytes()
    ):  # a collision: keep what really matches
        good = (table.tok[pages] == rows[i0 : i0 + k]).all(axis=1)
        par = table.parent[pages]
        good[0] &= par[0] == (known[-1] if i0 else -1)
        good[1:] &= par[1:] == pages[:-1]
        pages = pages[: int(good.argmin())] if not good.all() else pages
    if not i0:
        if len(pages) and table.ns.get(int(pages[0])) != extra_key:  # another namespace's hash
            return NO_PAGES
        return pages
    return np.concatenate((known, pages))


def _walk_probing(
    table: BlockTable,
    rows: np.ndarray,
    hashes: Hashes,
    known: np.ndarray,
    extra_key: Hashable,
) -> np.ndarray:
    """`walk` once a collision has happened: every block tries each probe offset."""
    chain: list[int] = known.tolist()
    parent = chain[-1] if chain else -1
    get, tok, up = table.page_of.get, table.tok, table.parent
    for h, row in zip(hashes[len(chain) :], rows[len(chain) : len(hashes)], strict=True):
        for k in range(table.max_probe + 1):
            page = get((h + k) & _MASK)
            if (
                page is not None
                and up[page] == parent
                and (tok[page] == row).all()
                and (parent >= 0 or table.ns.get(page) == extra_key)
            ):
                break
        else:
            break
        chain.append(page)
        parent = page
    return np.array(chain, dtype=np.int64)


class RequestHashes:
    """The block hashes and chains of recent sequences, so that a sequence that repeats or extends
    one seen before is not hashed and walked again: a request's insert after its match (vLLM's
    ``Request.block_hashes``), and a conversation's next turn, which resends its whole history.

    An entry (one sequence's bytes, block hashes, the chain of pages found for it and their
    serials) is filed under one of its blocks: block ``j``, the largest power of two below its
    block count (block 0 for one block). A sequence of ``n`` blocks probes its blocks
    ``J, J/2, ..., 1, 0`` (``J`` the largest power of two below ``n``), so it finds every entry
    it extends. An entry is used only for the tokens that are still equal (one ``bytes``
    comparison; else the longest common prefix, in NumPy), and its chain only for the pages that
    still hold the very blocks it found (their serials compared in one go). At most ``capacity``
    entries are kept, the least recently filed forgotten first: each holds its sequence's bytes
    (8 a token, shared with the handles made for it). 256 keep the 110 interleaved conversations
    of the benchmark's chat trace (0.3% of look-ups find nothing; 2% with 128, 12% with 64).
    """

    def __init__(self, page_size: int, capacity: int = 256) -> None:
        self.page_size = page_size
        self.width = 8 * page_size
        self.capacity = capacity
        # Insertion order is filing order (a plain dict: cheaper than an OrderedDict here).
        self._index: dict[Hashable, tuple[bytes, Hashes, np.ndarray, bytes]] = {}

    def remember(
        self,
        raw: bytes,
        hashes: Hashes,
        pages: np.ndarray,
        gens: bytes,
        extra_key: Hashable = None,
    ) -> None:
        """``raw``: the rows' bytes; ``hashes`` those of its first rows (a match hashes only up to
        the first block not cached); ``pages`` the chain found (and ``gens``, their serials as
        int64 bytes)."""
        w = self.width
        nb = len(raw) // w
        if nb:
            j = (1 << (nb - 1).bit_length()) >> 1
            key: Hashable = raw[j * w : (j + 1) * w]
            if extra_key is not None:
                key = (extra_key, key)  # bytes never equal a tuple
            index = self._index
            index.pop(key, None)
            index[key] = (raw, hashes, pages, gens)
            if len(index) > self.capacity:
                del index[next(iter(index))]

    def recall(
        self,
        rows: np.ndarray,
        raw: bytes,
        table: BlockTable,
        hasher: ChainHasher,
        extra_key: Hashable = None,
        lazy: bool = False,
    ) -> tuple[Hashes, np.ndarray, bytes, np.ndarray | None]:
        """The hashes of the rows of ``rows`` (only rows not remembered are hashed), the longest
        remembered chain that still matches them (possibly empty), its serials (as bytes), and
        the hashes past that chain as a ``uint64`` array when they were all computed here by
        `ChainHasher.chain_array` (else ``None``).

        Every row is hashed unless ``lazy``: then, when a remembered chain is found, only up to
        the first row past it (a walk stops at the first block not cached; `hash_rest` hashes the
        others when it does not)."""
        nb = len(rows)
        if nb:
            index, w = self._index, self.width
            j = (1 << (nb - 1).bit_length()) >> 1
            partial = None
            while True:
                block = raw[j * w : (j + 1) * w]
                entry = index.get(block if extra_key is None else (extra_key, block))
                if entry is not None:
                    old = entry[0]
                    if raw.startswith(old) or old.startswith(raw):  # no copies
                        k = min(len(old) // w, nb, len(entry[1]))  # rows with a known hash
                        return self._reuse(entry, k, rows, table, hasher, lazy)
                    if partial is None:
                        partial = entry
                if not j:
                    break
                j >>= 1
            if partial is not None:  # a sibling: share what is equal, in NumPy
                n = min(len(partial[0]), len(raw)) // 8
                differ = np.frombuffer(raw, np.int64, n) != np.frombuffer(partial[0], np.int64, n)
                first = int(differ.argmax())
                k = min((first if differ[first] else n) // self.page_size, len(partial[1]))
                if k:
                    return self._reuse(partial, k, rows, table, hasher, lazy)
        hashes, tail = hasher.chain_array(rows, key_seed(extra_key))
        return hashes, NO_PAGES, b"", tail

    def carried(
        self,
        held: BlockHashCacheHandle,
        rows: np.ndarray,
        raw: bytes,
        table: BlockTable,
        hasher: ChainHasher,
        extra_key: Hashable,
    ) -> tuple[Hashes, np.ndarray, bytes, np.ndarray | None] | None:
        """What `recall` returns, taken from ``held`` (a handle locked since its match, so its
        chain is still cached) instead of the memo, when ``raw`` starts with its tokens, its chain
        is in namespace ``extra_key`` and keys are hashes (no collision yet); else ``None``."""
        known = held.pages
        if known is None or not len(known) or table.max_probe or not raw.startswith(held.tokens):
            return None
        if (table.ns.get(known.item(0)) if table.ns else None) != extra_key:
            return None
        hashes = held.block_hashes
        tail = None
        if len(hashes) < len(rows):
            more, tail = hasher.chain_array(rows[len(hashes) :], hashes[-1])
            hashes += tuple(more)  # a new tuple: the handle that `_handle` makes takes it as is
        gens = held.serials  # locked since: still theirs
        return hashes, known, table.gen[known].tobytes() if gens is None else gens, tail

    @staticmethod
    def _reuse(
        entry: tuple[bytes, Hashes, np.ndarray, bytes],
        k: int,
        rows: np.ndarray,
        table: BlockTable,
        hasher: ChainHasher,
        lazy: bool,
    ) -> tuple[Hashes, np.ndarray, bytes, np.ndarray | None]:
        """What `recall` returns for ``rows`` from ``entry``, whose first ``k >= 1`` blocks hold
        the same tokens as ``rows``'s and have hashes there."""
        _, hashes, pages, gens = entry
        if len(pages) > k:
            pages, gens = pages[:k], gens[: 8 * k]
        if len(pages):
            now = table.gen[pages]
            if now.tobytes() != gens:
                moved = now != np.frombuffer(gens, np.int64)
                cut = int(moved.argmax())
                pages, gens = pages[:cut], gens[: 8 * cut]
        # Lazily, rows are hashed only up to the first one past the chain still cached, and not
        # even that one when the chain's last block has no cached child.
        if lazy:
            more = not len(pages) or table.nchild.item(pages.item(-1)) > 0
            upto = min(len(pages) + more, len(rows))
        else:
            upto = len(rows)
        tail = None
        if k < upto:
            rest, tail = hasher.chain_array(rows[k:upto], hashes[k - 1])
            hashes = [*hashes[:k], *rest]
            if len(pages) < k:
                tail = None  # not all the hashes past the chain
        elif k < len(hashes):
            hashes = hashes[:k]
        return hashes, pages, gens, tail


def hash_rest(hasher: ChainHasher, rows: np.ndarray, hashes: Hashes, extra_key: Hashable) -> Hashes:
    """``hashes`` (those of the first rows of ``rows``) extended to every row."""
    if len(hashes) >= len(rows):
        return hashes
    seed = hashes[-1] if hashes else key_seed(extra_key)
    return [*hashes, *hasher.chain(rows[len(hashes) :], seed)]


def handle_pages(
    handle: BaseCacheHandle, table: BlockTable, page_size: int, stamp: tuple[object, int]
) -> np.ndarray:
    """The pages of the blocks ``handle`` names, root first, checked to be the content it was
    made for.

    ``stamp`` is the manager's (token, epoch): a handle made by that manager since its last
    eviction names blocks that are all still cached, and its pages are returned as they are.
    Otherwise each block must still be cached, chain from the one before, and hold the tokens the
    handle was made for (a weak hash may have put other tokens under the same key).
    ``TypeError`` for another kind of handle, ``RuntimeError`` otherwise.
    """
    if not isinstance(handle, BlockHashCacheHandle):
        raise TypeError(f"handle must be a BlockHashCacheHandle, got {type(handle).__name__}")
    hashes = handle.block_hashes
    if handle.cached_len != len(hashes) * page_size:
        raise RuntimeError(
            f"handle says cached_len={handle.cached_len} but names {len(hashes)} blocks of "
            f"{page_size} tokens"
        )
    made = handle.pages
    mine = handle.stamp
    if (
        made is not None
        and mine is not None
        and mine[0] is stamp[0]
        and mine[1] == stamp[1]
        and mine[2] is hashes
    ):
        return made  # nothing has left the cache since the handle was made
    width = 8 * page_size
    carried = handle.tokens if isinstance(handle.tokens, bytes) else b""
    chain: list[int] = []
    parent = -1
    for i, h in enumerate(hashes):
        page = table.page_of.get(h)
        if page is None:
            raise RuntimeError(
                f"handle's block {i} ({h:#018x}) was evicted; match the prefix again"
            )
        if table.parent[page] != parent:
            raise RuntimeError(f"handle's block {i} ({h:#018x}) does not chain from block {i - 1}")
        if len(carried) < (i + 1) * width:
            raise RuntimeError(
                f"handle does not carry the tokens of block {i}; make handles with match_prefix"
            )
        if table.tok[page].tobytes() != carried[i * width : (i + 1) * width]:
            raise RuntimeError(
                f"handle's block {i} ({h:#018x}) was evicted and its key now holds other tokens; "
                "match the prefix again"
            )
        chain.append(page)
        parent = page
    return np.array(chain, dtype=np.int64)
