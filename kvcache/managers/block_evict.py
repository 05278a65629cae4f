"""Eviction for `BlockHashCacheManager`, and the integrity check of its `BlockTable`.

Eviction rule. vLLM evicts any free block (an orphaned child just lingers, unmatchable). Here
the cache's content must stay exact (`cached_indices`, `check_integrity`, the page accounting of
`RequestFlow`), so a block is evicted only when no cached block chains from it. The free queue
keeps **every free block after all of its cached descendants**, so its head is always a leaf and
``evict`` pops from the head in ``O(1)`` per block, like vLLM. The order holds because a
descendant's ref count never exceeds its ancestor's (a handle locks a whole chain) and an unlock
releases a chain deepest block first; ``insert_prefix`` and ``match_prefix`` move a used chain's
free blocks to the tail deepest first (new blocks are appended deepest first too), which also
keeps the queue in least-recently-used order; locking and evicting only remove blocks. (A cached
block an insert repeats is where vLLM frees the request's own copy of it: vLLM caches duplicates.)
``check_integrity`` verifies the order; ``evict`` re-checks each victim has no children left.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

import numpy as np

from .block_hash_chain import ChainHasher, key_seed
from .block_pool import BlockHashCacheHandle, BlockTable, CachedBlock
from .cache_events import EventLog

__all__ = ["evict_blocks", "prefix_tokens", "check_table"]

_MASK = (1 << 64) - 1


def prefix_tokens(table: BlockTable, page: int) -> list[int]:
    """The tokens of the whole prefix ending with the block on ``page``, first block first."""
    chain = [page]
    while table.parent[chain[-1]] >= 0:
        chain.append(int(table.parent[chain[-1]]))
    tokens: list[int] = table.tok[chain[::-1]].reshape(-1).tolist()
    return tokens


_ONE = np.int64(1).tobytes()
_CHILDREN = bytes(8) + _ONE * 1023  # `chain_children` of up to 1024 victims, sliced


def chain_children(n: int) -> bytes:
    """``nchild`` of ``n`` victims forming one chain, deepest first, as int64 bytes."""
    return _CHILDREN[: 8 * n] if n <= 1024 else bytes(8) + _ONE * (n - 1)


#: What ``gen`` holds for a victim while `evict_blocks` checks its children (a page that holds no
#: block has -1).
_VICTIM = -3


def evict_blocks(table: BlockTable, size: int, events: EventLog | None) -> np.ndarray:
    """Take blocks from the head of the free queue until ``size`` tokens (``0 <`` ``size <=``
    the evictable ones) are freed, forget them, and return their pages (int64, in order;
    read-only, valid until the free queue next changes).

    ``RuntimeError``, changing nothing, if a victim still has a child that is not a victim.
    Array operations on the victims, whatever their number, but for the key index (``dict``
    deletions in C) and the parents that stay (usually one).
    """
    n = -(-size // table.page_size)
    pages, lo = table.free.head(n)
    gen, nchild = table.gen, table.nchild
    ups = table.parent[pages]
    # Every victim's children must be victims too (the queue's order promises it).
    if ups.tobytes()[:-8] == pages.tobytes()[8:] and nchild[pages].tobytes() == chain_children(n):
        # The usual case: one chain, deepest block first (each victim the parent of the one
        # before it), the first one a leaf and each other one the parent of that one only.
        gen[pages] = -1
        up = ups.item(n - 1)
        outer = [up] if up >= 0 else []  # the parent that stays
    else:
        before = gen[pages]
        gen[pages] = _VICTIM
        up_gen = gen[ups]  # a first block's parent is the spare row: -1
        # The victims chaining from a victim are among its children, so equal totals mean all
        # of them. (Lists: a few dozen victims are counted faster in Python than by a ufunc.)
        if up_gen.tolist().count(_VICTIM) != sum(nchild[pages].tolist()):
            gen[pages] = before
            _refuse(table, pages.tolist(), ups.tolist())
        gen[pages] = -1
        outer = ups[up_gen >= 0].tolist()  # parents that stay
    table.free.drop(pages, lo)
    if events is not None:
        ps = table.page_size
        for page in pages.tolist():
            first = page * ps
            events.removed(
                table.namespace(page), prefix_tokens(table, page), list(range(first, first + ps))
            )
    deque(map(table.page_of.pop, table.key[pages].tolist()), 0)
    ns = table.ns
    if ns:
        for page, up in zip(pages.tolist(), ups.tolist(), strict=True):
            if up < 0:
                ns.pop(page, None)
    # Victims' own counts are left as they are: `BlockTable.add` writes a page's afresh.
    if len(outer) > 8:
        np.subtract.at(nchild, outer, 1)
    else:
        for up in outer:
            nchild[up] = nchild.item(up) - 1  # plain ints: no NumPy scalars
    return pages


def _refuse(table: BlockTable, victims: list[int], ups: list[int]) -> None:
    """``RuntimeError`` naming a victim that has a child outside ``victims``."""
    chosen = set(victims)
    inner_of = dict.fromkeys(victims, 0)
    for up in ups:
        if up in chosen:
            inner_of[up] += 1
    page = next(v for v in victims if table.nchild[v] != inner_of[v])
    raise RuntimeError(
        f"internal error: free block {int(table.key[page]):#018x} would be evicted before "
        f"its {int(table.nchild[page])} children; nothing was evicted"
    )


def check_table(
    table: BlockTable,
    hasher: ChainHasher,
    locks: Mapping[BlockHashCacheHandle, int],
) -> None:
    """Every check of `BlockHashCacheManager.check_integrity`; ``RuntimeError`` on the first fault.

    ``locks`` maps each locked handle to its lock count: every block's ``ref_count`` must equal
    the locks of the handles through it.
    """
    page_size = table.page_size
    cached = {int(p) for p in np.flatnonzero(table.gen >= 0)}
    pages_listed = list(table.page_of.values())
    if set(pages_listed) != cached or len(pages_listed) != len(cached):
        raise RuntimeError(f"{len(pages_listed)} pages recorded for {len(cached)} blocks")
    blocks: dict[int, CachedBlock] = {}
    for key, page in table.page_of.items():
        up = int(table.parent[page])
        if up >= 0 and up not in cached:
            raise RuntimeError(f"block {key:#018x}: parent on page {up} is not cached")
        if int(table.key[page]) != key:
            raise RuntimeError(f"block {key:#018x}: filed under the wrong key")
        blocks[key] = table.snapshot(page, table.namespace(page))
    for page in table.ns:
        if page not in cached or table.parent[page] >= 0:
            raise RuntimeError(f"namespace recorded for page {page}, not a cached first block")
    children: dict[int, int] = {}
    expected_refs: dict[int, int] = {}
    for handle, n in locks.items():
        if n <= 0:
            raise RuntimeError(f"handle {handle} recorded with lock count {n}")
        for key in handle.block_hashes:
            expected_refs[key] = expected_refs.get(key, 0) + n
    free_list: list[int] = table.free.pages().tolist()
    queued = int(np.count_nonzero(table.free.where >= 0))
    if not len(free_list) == len(set(free_list)) == queued == len(table.free):
        raise RuntimeError(
            f"free queue: {len(free_list)} pages listed ({len(set(free_list))} distinct), "
            f"{queued} marked queued, {len(table.free)} counted"
        )
    extra = [p for p in free_list if p not in cached]
    if extra:
        raise RuntimeError(f"free queue holds {len(extra)} pages that are not cached: {extra[:4]}")
    free_set = set(free_list)
    contents = set()
    locked = 0
    for key, block in blocks.items():
        where = f"block {key:#018x}"
        if not 0 <= block.probe <= table.max_probe:
            raise RuntimeError(f"{where}: probe {block.probe} outside [0, {table.max_probe}]")
        parent = blocks[block.parent_hash] if block.parent_hash is not None else None
        parent_base = parent.base if parent is not None else key_seed(block.extra_key)
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
        in_queue = block.page in free_set
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
    last = None
    for page in free_list:
        use = int(table.last[page])
        if last is not None and use < last:
            raise RuntimeError(f"free queue out of LRU order at page {page}")
        last = use
    position = {p: i for i, p in enumerate(free_list)}
    for page in free_list:
        up = int(table.parent[page])
        if up in position and position[up] < position[page]:
            raise RuntimeError(
                f"block on page {page} is queued after its parent: the parent would be evicted first"
            )
    if locked != table.num_locked:
        raise RuntimeError(f"recorded {table.num_locked} locked blocks, counted {locked}")
    if page_size != table.tok.shape[1]:
        raise RuntimeError(f"tokens stored {table.tok.shape[1]} a block, not {page_size}")
