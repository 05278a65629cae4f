"""The records of `BlockHashCacheManager`: a cached block, a handle on a chain of them, and the
integrity check over the whole pool of blocks."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat

import numpy as np
import torch

from .base import BaseCacheHandle
from .block_hash_chain import ChainHasher, key_seed

__all__ = [
    "CachedBlock",
    "BlockHashCacheHandle",
    "handle_chain",
    "check_pool",
    "new_pages",
    "new_blocks",
    "lock_blocks",
    "release_blocks",
    "chain_slots",
]

_MASK = (1 << 64) - 1


class CachedBlock:
    """One cached full block: ``page_size`` tokens whose K/V fill page ``page``.

    ``block_hash`` is its key in the manager's table: its chained hash ``base`` plus ``probe``
    (how far the key moved after a collision, usually 0). ``parent_hash`` is the key of the block
    before it (``None`` for the first block of a sequence). ``ref_count`` counts the locks through
    it (0: the block is in the free queue and may be evicted); ``num_children`` the cached blocks
    that chain from it. ``last_use`` is the manager's clock when it was last matched or inserted while
    free, or released.
    ``token_bytes`` holds the tokens as little-endian int64 (compared on every hit); ``tokens``
    gives them as a tuple of ints. ``extra_key`` is the namespace of the chain it belongs to.
    Read-only for callers.
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
    ) -> None:
        self.extra_key = extra_key
        self.block_hash = block_hash
        self.base = base
        self.parent_hash = parent_hash
        self.token_bytes = token_bytes
        self.page = page
        self.ref_count = 0
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

    A handle names the *content* it was made for: ``blocks`` are the blocks `match_prefix` (or
    `insert_and_match`) found, whose tokens every later use compares with what the keys hold now.
    If its blocks are evicted the handle can no longer be locked (``RuntimeError``), even when
    other tokens have since been cached under the same keys (a hash collision); if the same
    tokens are cached again, the handle names the new blocks. Equality and hashing use
    ``cached_len`` and ``block_hashes`` only: equal handles are the same claim.
    """

    block_hashes: tuple[int, ...]
    blocks: tuple[CachedBlock, ...] = field(default=(), compare=False, repr=False)
    #: (manager token, manager epoch, the ``block_hashes`` object) when made; lets the manager
    #: skip re-checking a handle made since its last eviction.
    stamp: tuple[object, int, object] | None = field(default=None, compare=False, repr=False)


def handle_chain(
    handle: BaseCacheHandle,
    blocks: Mapping[int, CachedBlock],
    page_size: int,
    stamp: tuple[object, int],
) -> tuple[CachedBlock, ...]:
    """The blocks ``handle`` names, root first, checked to be the content it was made for.

    ``stamp`` is the manager's (token, epoch): a handle made by that manager since its last
    eviction names blocks that are all still cached, and is returned as it is. Otherwise each
    block must still be cached, chain from the one before, and hold the tokens the handle was made
    for (a weak hash may have put other tokens under the same key). ``TypeError`` for another
    kind of handle, ``RuntimeError`` otherwise.
    """
    if not isinstance(handle, BlockHashCacheHandle):
        raise TypeError(f"handle must be a BlockHashCacheHandle, got {type(handle).__name__}")
    hashes = handle.block_hashes
    if handle.cached_len != len(hashes) * page_size:
        raise RuntimeError(
            f"handle says cached_len={handle.cached_len} but names {len(hashes)} blocks of "
            f"{page_size} tokens"
        )
    made = handle.blocks
    mine = handle.stamp
    if (
        mine is not None
        and mine[0] is stamp[0]
        and mine[1] == stamp[1]
        and mine[2] is hashes
        and len(made) == len(hashes)
    ):
        return made  # nothing has left the cache since the handle was made
    chain: list[CachedBlock] = []
    parent: int | None = None
    for i, h in enumerate(hashes):
        block = blocks.get(h)
        if block is None:
            raise RuntimeError(
                f"handle's block {i} ({h:#018x}) was evicted; match the prefix again"
            )
        if block.parent_hash != parent:
            raise RuntimeError(f"handle's block {i} ({h:#018x}) does not chain from block {i - 1}")
        if i >= len(made) or not isinstance(made[i], CachedBlock):
            raise RuntimeError(
                f"handle does not carry the tokens of block {i}; make handles with match_prefix"
            )
        if made[i] is not block and made[i].token_bytes != block.token_bytes:
            raise RuntimeError(
                f"handle's block {i} ({h:#018x}) was evicted and its key now holds other tokens; "
                "match the prefix again"
            )
        chain.append(block)
        parent = h
    return tuple(chain)


def new_pages(part: torch.Tensor, page_size: int, page_owner: Mapping[int, int]) -> list[int]:
    """The pages of the new blocks' slots ``part`` (validated int32, whole blocks), checked.

    Each block's slots must be the ``page_size`` consecutive slots of one page (``>= 0``, the
    first a multiple of ``page_size``); no page may already be cached (in ``page_owner``) or
    appear twice. ``ValueError`` naming the page or slots otherwise. NumPy, no per-block work.
    """
    ps = page_size
    new = (part.numpy() if part.device.type == "cpu" else part.cpu().numpy()).reshape(-1, ps)
    first = new[:, 0]
    if ps > 1 and (
        (first % ps).any() or (new != first[:, None] + np.arange(ps, dtype=np.int32)).any()
    ):
        if (new < 0).any():
            raise ValueError(f"indices must be >= 0, got {int(new.min())}")
        raise ValueError(
            f"with page_size={ps} every {ps} indices must be the consecutive slots of one page "
            f"(first slot a multiple of {ps}); got {part.tolist()}"
        )
    pages: list[int] = (first // ps).tolist()
    if pages and min(pages) < 0:
        raise ValueError(f"indices must be >= 0, got {min(pages) * ps}")
    for page in pages:
        if page in page_owner:
            raise ValueError(
                f"page {page} (slots {page * ps}..{(page + 1) * ps - 1}) already holds cached "
                f"block {page_owner[page]:#018x}; a page can be cached once"
            )
    if len(set(pages)) != len(pages):
        dup = next(p for p in pages if pages.count(p) > 1)
        raise ValueError(f"page {dup} appears in more than one new block of this insert")
    return pages


def new_blocks(
    new_hashes: list[int],
    parent: int | None,
    rows: np.ndarray,
    pages: list[int],
    taken: Mapping[int, CachedBlock],
    max_probe: int,
    tic: int,
    extra_key: Hashable = None,
) -> tuple[list[int], list[CachedBlock], int]:
    """The blocks an insert adds: one per row of ``rows`` (``(n, page_size)`` int64) with chained
    hash ``new_hashes[i]`` on page ``pages[i]``, the first chaining from key ``parent``.

    Each block's key is its hash, or the next key (``hash + 1``, ...) that neither ``taken`` nor
    an earlier new block holds. Returns the keys, the blocks (free, used at ``tic``, each but the
    last with one child) and the largest probe offset now in use (at least ``max_probe``).
    Changes nothing.
    """
    keys = new_hashes
    probes: list[int] | None = None
    if any(map(taken.__contains__, keys)) or len(set(keys)) != len(keys):
        keys, probes, mine = [], [], set()
        for h in new_hashes:
            key, probe = h, 0
            while key in taken or key in mine:
                probe += 1
                key = (h + probe) & _MASK
            max_probe = max(max_probe, probe)
            keys.append(key)
            probes.append(probe)
            mine.add(key)
    raw = rows.tobytes()
    width = rows.itemsize * rows.shape[1]
    tokens = [raw[j : j + width] for j in range(0, len(raw), width)]
    n = len(keys)
    parents: list[int | None] = [parent, *keys[:-1]]
    created = list(
        map(
            CachedBlock,
            keys,
            new_hashes,
            parents,
            tokens,
            pages,
            repeat(tic, n),
            repeat(0) if probes is None else probes,
            [1] * (n - 1) + [0],
            repeat(extra_key, n),
        )
    )
    return keys, created, max_probe


def lock_blocks(chain: Sequence[CachedBlock], free: MutableMapping[int, None]) -> int:
    """``ref_count += 1`` on every block of ``chain``; a block locked for the first time leaves
    the ``free`` queue. Returns how many did."""
    newly = 0
    for block in chain:
        if block.ref_count == 0:
            del free[block.block_hash]
            newly += 1
        block.ref_count += 1
    return newly


def release_blocks(
    chain: Sequence[CachedBlock], free: MutableMapping[int, None], clock: int
) -> int:
    """``ref_count -= 1`` on every block of ``chain``, deepest first; a block left unlocked joins
    the tail of the ``free`` queue, used at ``clock``. Returns how many did."""
    released = 0
    for block in reversed(chain):
        block.ref_count -= 1
        if block.ref_count == 0:
            block.last_use = clock
            free[block.block_hash] = None
            released += 1
    return released


def chain_slots(
    chain: Sequence[CachedBlock], offsets: np.ndarray, device: torch.device
) -> torch.Tensor:
    """The slots of ``chain``'s pages (``offsets`` is ``arange(page_size)``), block after block,
    as 1-D int32 on ``device``."""
    pages = np.fromiter((b.page for b in chain), dtype=np.int32, count=len(chain))
    if len(offsets) > 1:
        pages = (pages[:, None] * len(offsets) + offsets).reshape(-1)
    out = torch.from_numpy(pages)
    return out if device.type == "cpu" else out.to(device)


def check_pool(
    blocks: Mapping[int, CachedBlock],
    free: Iterable[int],
    page_owner: Mapping[int, int],
    num_locked: int,
    max_probe: int,
    hasher: ChainHasher,
    page_size: int,
    locks: Mapping[BlockHashCacheHandle, int],
) -> None:
    """Every check of `BlockHashCacheManager.check_integrity`; ``RuntimeError`` on the first fault.

    ``locks`` maps each locked handle to its lock count: every block's ``ref_count`` must equal
    the locks of the handles through it.
    """
    children: dict[int, int] = {}
    expected_refs: dict[int, int] = {}
    for handle, n in locks.items():
        if n <= 0:
            raise RuntimeError(f"handle {handle} recorded with lock count {n}")
        for key in handle.block_hashes:
            expected_refs[key] = expected_refs.get(key, 0) + n
    free_list = list(free)
    free_set = set(free_list)
    contents = set()
    locked = 0
    for key, block in blocks.items():
        where = f"block {key:#018x}"
        if block.block_hash != key:
            raise RuntimeError(
                f"{where}: filed under the wrong key (says {block.block_hash:#018x})"
            )
        if not isinstance(block.token_bytes, bytes) or len(block.token_bytes) != 8 * page_size:
            raise RuntimeError(f"{where}: tokens {block.token_bytes!r} are not {page_size} ints")
        if not 0 <= block.probe <= max_probe:
            raise RuntimeError(f"{where}: probe {block.probe} outside [0, {max_probe}]")
        parent = blocks.get(block.parent_hash) if block.parent_hash is not None else None
        if block.parent_hash is not None and parent is None:
            raise RuntimeError(f"{where}: parent {block.parent_hash:#018x} is not cached")
        parent_base = parent.base if parent is not None else key_seed(block.extra_key)
        if parent is not None and parent.extra_key != block.extra_key:
            raise RuntimeError(f"{where}: namespace {block.extra_key!r} under a block of another")
        if (
            block.base != hasher.one(parent_base, block.tokens)
            or key != (block.base + block.probe) & _MASK
        ):
            raise RuntimeError(f"{where}: hash does not match its parent and tokens")
        content = (block.parent_hash, block.extra_key, block.token_bytes)
        if content in contents:
            raise RuntimeError(f"{where}: the same tokens after the same parent are cached twice")
        contents.add(content)
        if block.ref_count < 0:
            raise RuntimeError(f"{where}: negative ref_count {block.ref_count}")
        if parent is not None:
            if parent.ref_count < block.ref_count:
                raise RuntimeError(
                    f"{where}: ref_count {block.ref_count} exceeds its parent's {parent.ref_count}"
                )
            children[parent.block_hash] = children.get(parent.block_hash, 0) + 1
        if page_owner.get(block.page) != key:
            raise RuntimeError(f"{where}: page {block.page} is not recorded as its page")
        if block.page < 0:
            raise RuntimeError(f"{where}: negative page {block.page}")
        in_queue = key in free_set
        if (block.ref_count == 0) != in_queue:
            raise RuntimeError(
                f"{where}: ref_count {block.ref_count} but {'in' if in_queue else 'not in'} the free queue"
            )
        if block.ref_count != expected_refs.get(key, 0):
            raise RuntimeError(
                f"{where}: ref_count {block.ref_count} but the locked handles through it hold "
                f"{expected_refs.get(key, 0)}"
            )
        locked += block.ref_count > 0
    for key, block in blocks.items():
        if block.num_children != children.get(key, 0):
            raise RuntimeError(
                f"block {key:#018x}: records {block.num_children} children, has {children.get(key, 0)}"
            )
    stray = [k for k in expected_refs if k not in blocks]
    if stray:
        raise RuntimeError(
            f"locked handles name {len(stray)} blocks that are not cached: {stray[:4]}"
        )
    if len(page_owner) != len(blocks):
        raise RuntimeError(f"{len(page_owner)} pages recorded for {len(blocks)} blocks")
    extra = [h for h in free_list if h not in blocks]
    if extra:
        raise RuntimeError(f"free queue holds {len(extra)} blocks that are not cached: {extra[:4]}")
    position = {h: i for i, h in enumerate(free_list)}
    last = None
    for h in free_list:
        block = blocks[h]
        if last is not None and block.last_use < last:
            raise RuntimeError(f"free queue out of LRU order at block {h:#018x}")
        last = block.last_use
        if block.parent_hash in position and position[block.parent_hash] < position[h]:
            raise RuntimeError(
                f"block {h:#018x} is queued after its parent: the parent would be evicted first"
            )
    if locked != num_locked:
        raise RuntimeError(f"recorded {num_locked} locked blocks, counted {locked}")
