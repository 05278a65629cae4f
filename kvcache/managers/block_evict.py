"""Eviction for `BlockHashCacheManager`: which free blocks leave, and what the event log hears.

Eviction rule. vLLM evicts any free block (an orphaned child just lingers, unmatchable). Here
the cache's content must stay exact (`cached_indices`, `check_integrity`, the page accounting of
`RequestFlow`), so a block is evicted only when no cached block chains from it. The free queue
keeps **every free block after all of its cached descendants**, so its head is always a leaf and
``evict`` pops from the head in ``O(1)`` per block, like vLLM. The order holds because a
descendant's ref count never exceeds its ancestor's (a handle locks a whole chain) and an unlock
releases a chain deepest block first; ``insert_prefix`` and ``match_prefix`` move a used chain's
free blocks to the tail deepest first (new blocks are appended deepest first too), which also
keeps the queue in least-recently-used order; locking and evicting only remove blocks.
``check_integrity`` verifies the order; ``evict`` re-checks each victim has no children left.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Mapping, MutableMapping
from itertools import islice, repeat
from operator import attrgetter

import numpy as np

from .block_pool import CachedBlock
from .cache_events import EventLog

__all__ = ["evict_blocks", "prefix_tokens"]

_PARENT = attrgetter("parent_hash")
_CHILDREN = attrgetter("num_children")
_PAGE = attrgetter("page")


def prefix_tokens(blocks: Mapping[int, CachedBlock], block: CachedBlock) -> list[int]:
    """The tokens of ``block``'s whole prefix, from its chain's first block through its own."""
    parts = [block.token_bytes]
    while block.parent_hash is not None:
        block = blocks[block.parent_hash]
        parts.append(block.token_bytes)
    tokens: list[int] = np.frombuffer(b"".join(reversed(parts)), dtype=np.int64).tolist()
    return tokens


def evict_blocks(
    blocks: dict[int, CachedBlock],
    free: OrderedDict[int, None],
    page_owner: MutableMapping[int, int],
    size: int,
    page_size: int,
    events: EventLog | None,
) -> list[CachedBlock]:
    """Take blocks from the head of ``free`` until ``size`` tokens (``<=`` the evictable ones)
    are freed; drop them from ``blocks``, ``free`` and ``page_owner``; return them in order.

    ``RuntimeError``, changing nothing, if a victim still has a child that is not a victim.
    """
    keys = list(islice(free, -(-size // page_size)))
    victims = list(map(blocks.__getitem__, keys))
    parents = Counter(map(_PARENT, victims))
    # Every victim's children must be victims too (the queue's order promises it).
    if list(map(_CHILDREN, victims)) != list(map(parents.get, keys, repeat(0))):
        bad = next(b for b in victims if b.num_children != parents.get(b.block_hash, 0))
        raise RuntimeError(
            f"internal error: free block {bad.block_hash:#018x} would be evicted before its "
            f"{bad.num_children} children; nothing was evicted"
        )
    if events is not None:
        for block in victims:
            first = block.page * page_size
            events.removed(
                block.extra_key, prefix_tokens(blocks, block), list(range(first, first + page_size))
            )
    deque(map(free.pop, keys), 0)
    deque(map(blocks.pop, keys), 0)
    deque(map(page_owner.pop, map(_PAGE, victims)), 0)
    for parent, count in parents.items():
        if parent is not None and parent in blocks:
            blocks[parent].num_children -= count
    return victims
