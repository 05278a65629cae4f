"""Finding cached chains for `BlockHashCacheManager`: the walk over a sequence's block hashes, and
the block hashes a request carries from `match_prefix` to `insert_prefix`.

Collisions. A 64-bit hash can collide (and a caller's ``hash_fn`` may be weak on purpose). Every
block keeps its tokens and its parent's key, and a lookup compares both, so a collision can cost a
cache hit but never returns another prefix's K/V. A block whose hash is taken by a different block
is stored under the next free key (``hash + 1``, ``hash + 2``, ... modulo 2**64, its ``probe``
offset), and lookups try every offset up to the largest ever used (``0`` unless a collision
happened). A child's hash chains from its parent's hash, not its key, so probing changes no other
block's name.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from contextlib import suppress
from operator import attrgetter
from typing import cast

import numpy as np

from .block_hash_chain import ChainHasher, key_seed
from .block_pool import CachedBlock

__all__ = ["walk", "RequestHashes"]

_MASK = (1 << 64) - 1
_PARENT = attrgetter("parent_hash")
_TOKENS = attrgetter("token_bytes")
_KEY = attrgetter("block_hash")


def walk(
    blocks: dict[int, CachedBlock],
    max_probe: int,
    rows: np.ndarray,
    hashes: list[int],
    known: Sequence[CachedBlock] = (),
    extra_key: Hashable = None,
) -> list[CachedBlock]:
    """The cached chain matching the longest prefix of ``rows`` (read-only).

    ``rows`` is ``(n, page_size)`` int64; ``hashes[i]`` is the chained hash of ``rows[:i + 1]``;
    ``known`` is a chain already known to match ``rows[:len(known)]``, from which the walk goes
    on. The chain's first block must belong to namespace ``extra_key``. Without collisions (``max_probe == 0``) a block's key is its hash: one dict probe per
    block (run in C), then the parents and the tokens of the whole chain in one comparison each.
    With collisions every block tries each probe offset and compares parent and tokens.
    """
    get = blocks.get
    i0 = len(known)
    parent: int | None = known[-1].block_hash if i0 else None
    if max_probe == 0:
        found = list(map(get, hashes[i0:] if i0 else hashes))
        with suppress(ValueError):
            del found[found.index(None) :]  # a miss ends the chain
        chain = cast("list[CachedBlock]", found)  # no None is left
        k = len(chain)
        if k and not i0 and chain[0].extra_key != extra_key:  # another namespace's hash
            k = 0
            chain.clear()
        if k:
            parents = list(map(_PARENT, chain))
            if parents[0] != parent or parents[1:] != hashes[i0 : i0 + k - 1]:  # a collision
                k = next(
                    i for i, p in enumerate(parents) if p != (hashes[i0 + i - 1] if i else parent)
                )
                del chain[k:]
        if k and b"".join(map(_TOKENS, chain)) != rows[i0 : i0 + k].tobytes():
            for i, b in enumerate(chain):  # a collision: keep what really matches
                if b.token_bytes != rows[i0 + i].tobytes():
                    del chain[i:]
                    break
        return [*known, *chain] if i0 else chain
    chain = list(known)
    for h, row in zip(hashes[i0:], rows[i0:], strict=True):
        block = _probe(blocks, h, max_probe, parent, row.tobytes(), extra_key)
        if block is None:
            return chain
        chain.append(block)
        parent = block.block_hash
    return chain


def _probe(
    blocks: dict[int, CachedBlock],
    h: int,
    max_probe: int,
    parent: int | None,
    tokens: bytes,
    extra_key: Hashable,
) -> CachedBlock | None:
    """The block under key ``h + k`` (``k <= max_probe``) with this parent, these tokens and
    (for a first block) this namespace."""
    for k in range(max_probe + 1):
        block = blocks.get((h + k) & _MASK)
        if (
            block is not None
            and block.parent_hash == parent
            and block.token_bytes == tokens
            and (parent is not None or block.extra_key == extra_key)
        ):
            return block
    return None


class RequestHashes:
    """The block hashes of recent requests, so that a request's insert does not hash again what
    its match hashed (vLLM's ``Request.block_hashes``), and the chain its match found.

    Keyed by a request's namespace and first block; an entry is used only for the tokens that are still equal
    (one ``bytes`` comparison), and its chain only for the blocks that are still the same objects
    under the same keys (a block never changes in place, so identity proves its content and
    parent). At most ``capacity`` requests are remembered, the least recent forgotten first.
    """

    def __init__(self, page_size: int, capacity: int = 64) -> None:
        self.width = 8 * page_size
        self.capacity = capacity
        self._entries: OrderedDict[
            Hashable, tuple[bytes, list[int], list[CachedBlock], tuple[int, ...]]
        ] = OrderedDict()

    def remember(
        self,
        rows: np.ndarray,
        hashes: list[int],
        chain: list[CachedBlock],
        extra_key: Hashable = None,
    ) -> None:
        if len(rows):
            entries = self._entries
            first = rows[0].tobytes()
            key = first if extra_key is None else (extra_key, first)  # bytes never equal a tuple
            entries.pop(key, None)
            entries[key] = (rows.tobytes(), hashes, chain, tuple(map(_KEY, chain)))
            if len(entries) > self.capacity:
                entries.popitem(last=False)

    def recall(
        self,
        rows: np.ndarray,
        blocks: dict[int, CachedBlock],
        hasher: ChainHasher,
        extra_key: Hashable = None,
    ) -> tuple[list[int], list[CachedBlock]]:
        """The hashes of every row of ``rows`` (only rows not remembered are hashed) and the longest
        remembered chain that still matches them (possibly empty)."""
        first = rows[0].tobytes() if len(rows) else None
        entry = (
            None
            if first is None
            else self._entries.get(first if extra_key is None else (extra_key, first))
        )
        if entry is not None:
            raw, hashes, chain, keys = entry
            n = min(len(hashes), len(rows))
            if rows[:n].tobytes() == (raw if n == len(hashes) else raw[: n * self.width]):
                if n < len(rows):
                    hashes = hashes[:n] + hasher.chain(rows[n:], hashes[n - 1])
                elif n < len(hashes):
                    hashes = hashes[:n]
                now = list(map(blocks.get, keys[:n]))
                if now != chain[:n]:
                    first = next(
                        i for i, (a, b) in enumerate(zip(now, chain, strict=False)) if a is not b
                    )
                    return hashes, chain[:first]
                return hashes, cast("list[CachedBlock]", now)  # equal to chain[:n]: no None
        return hasher.chain(rows, key_seed(extra_key)), []
