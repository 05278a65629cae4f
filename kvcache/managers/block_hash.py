"""`BlockHashCacheManager`: prefix caching by chained block hashes, as in vLLM and nano-vllm.

A *block* is one page of ``page_size`` tokens. Only full blocks are cached. Block ``i`` of a
sequence is named by a chained hash, ``hash(block i) = H(hash(block i-1), tokens of block i)``
(block 0 chains from a fixed seed), so one hash names a block *and its whole prefix*: looking up
the blocks of a prompt one after another and stopping at the first miss finds the longest cached
prefix without any tree. The manager keeps:

- ``hash -> CachedBlock``: the page, the tokens, the parent's hash, a ref count, a child count and
  the logical time of last use;
- a *free queue* (an ``OrderedDict``) of the blocks whose ref count is 0. It is also the eviction
  order: ``evict`` takes blocks from its head.

Collisions. A 64-bit hash can collide. Every block keeps its tokens and its parent's hash, and a
lookup compares both, so a collision can cost a cache hit but never returns another prefix's
K/V. A block whose hash is taken by a different block is stored under the next free key
(``hash + 1``, ``hash + 2``, ... modulo 2**64, its ``probe`` offset), and lookups try every
offset up to the largest ever used (``0`` unless a collision happened).

Eviction rule. vLLM evicts any free block: a child whose parent is gone can never be matched
again (its hash chains through the parent), so it just lingers until evicted in turn. Here the
cache's content must stay exact (`cached_indices`, `check_integrity`, the page accounting of
`RequestFlow`), so a block is evicted only when no cached block chains from it. The free queue
is kept in an order that makes this free of charge: **every free block comes after all of its
cached descendants**. Then the head of the queue is always a leaf of the hash forest, and
``evict`` pops from the head in ``O(1)`` per block, like vLLM. The order holds because

- a descendant's ref count never exceeds its ancestor's (a handle locks a whole chain), so when a
  block becomes free, all its descendants are free already and sit in the queue; it is appended
  at the tail, after them; an unlock releases a chain deepest block first;
- ``insert_prefix`` and ``match_prefix`` *use* a chain: its free blocks move to the tail, deepest
  first (new blocks are appended deepest first too), so each ends after its descendants, and
  the queue stays in least-recently-used order (a prefix counts as used whenever a longer prefix
  is);
- locking removes blocks and eviction removes leaves, neither of which can break the order.

``check_integrity`` verifies the order; ``evict`` also verifies, before changing anything, that
each block it is about to remove has no children left.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from itertools import islice
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from .._validate import check_indices, check_positive_int, check_size, check_token_ids
from .base import BaseCacheHandle, BaseCacheManager, SizeInfo

__all__ = ["CachedBlock", "BlockHashCacheHandle", "BlockHashCacheManager"]

_MASK = (1 << 64) - 1
#: What block 0 of every sequence chains from.
ROOT_HASH_SEED = 0x6B7663616368655F  # "kvcache_"

HashFn = Callable[[int, Tuple[int, ...]], int]


def default_block_hash(parent_hash: int, tokens: Tuple[int, ...]) -> int:
    """Python's hash of ``(parent_hash, tokens)`` as an unsigned 64-bit int.

    Stable across processes and runs: hashes of ints and tuples of ints do not depend on
    ``PYTHONHASHSEED`` (only str/bytes hashes are salted).
    """
    return hash((parent_hash, tokens)) & _MASK


class CachedBlock:
    """One cached full block: ``page_size`` tokens whose K/V fill page ``page``.

    ``block_hash`` is its key in the manager's table; ``parent_hash`` the key of the block before
    it (``None`` for the first block of a sequence). ``ref_count`` counts the locked handles
    through it (0: the block is in the free queue and may be evicted); ``num_children`` the cached
    blocks that chain from it. ``last_use`` is the manager's clock at its last match, insert or
    release. ``probe`` is how far past its hash the key had to move after a collision (usually 0).
    Read-only for callers.
    """

    __slots__ = ("block_hash", "parent_hash", "tokens", "page", "ref_count", "num_children",
                 "last_use", "probe")

    def __init__(self, block_hash: int, parent_hash: Optional[int], tokens: Tuple[int, ...],
                 page: int, last_use: int, probe: int) -> None:
        self.block_hash = block_hash
        self.parent_hash = parent_hash
        self.tokens = tokens
        self.page = page
        self.ref_count = 0
        self.num_children = 0
        self.last_use = last_use
        self.probe = probe

    def __repr__(self) -> str:
        toks = list(self.tokens)
        shown = toks if len(toks) <= 8 else toks[:4] + ["..."] + toks[-2:]
        return (f"CachedBlock(hash={self.block_hash:#018x}, page={self.page}, tokens={shown}, "
                f"ref_count={self.ref_count}, last_use={self.last_use})")


@dataclass(frozen=True)
class BlockHashCacheHandle(BaseCacheHandle):
    """The matched prefix is the chain of blocks ``block_hashes`` (``cached_len // page_size`` of them).

    Blocks are named by content: if they are evicted the handle can no longer be locked
    (``RuntimeError``); if the same tokens are cached again, the handle names the new blocks.
    """

    block_hashes: Tuple[int, ...]


class BlockHashCacheManager(BaseCacheManager):
    """Prefix cache over full blocks named by chained hashes, with ref counts and an LRU free queue.

    Args:
        device: where the KV-slot indices live (values returned by ``match_prefix``/``evict``).
        page_size: tokens per block (= per page); only whole blocks are matched and cached.
        hash_fn: ``hash_fn(parent_hash, tokens) -> int``, the chained block hash (keyword only;
            default `default_block_hash`). A deliberately weak one (say ``lambda p, t: 0``)
            exercises the collision handling; results stay correct, lookups get slower.
    """

    def __init__(self, device: torch.device | str = "cpu", page_size: int = 16, *,
                 hash_fn: Optional[HashFn] = None) -> None:
        check_positive_int(page_size, "page_size")
        if hash_fn is not None and not callable(hash_fn):
            raise TypeError(f"hash_fn must be callable, got {type(hash_fn).__name__}")
        self.device = torch.device(device)
        self.page_size = page_size
        self.hash_fn: HashFn = hash_fn if hash_fn is not None else default_block_hash
        self.empty_tensor = torch.empty(0, dtype=torch.int32, device=self.device)
        self._offsets = torch.arange(page_size, dtype=torch.int64)
        self._clock = 0
        self._init_state()

    # ------------------------------------------------------------------ state
    def _init_state(self) -> None:
        self._blocks: Dict[int, CachedBlock] = {}
        self._free: "OrderedDict[int, None]" = OrderedDict()  # head = next to evict
        self._page_owner: Dict[int, int] = {}  # page -> block hash
        self._num_locked = 0  # blocks with ref_count > 0
        self._max_probe = 0

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

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

    def blocks(self) -> Iterator[CachedBlock]:
        """Every cached block, in insertion order (a parent before its children)."""
        return iter(list(self._blocks.values()))

    def get_block(self, block_hash: int) -> Optional[CachedBlock]:
        return self._blocks.get(block_hash)

    def free_queue(self) -> List[int]:
        """Hashes of the evictable blocks in eviction order (head first)."""
        return list(self._free)

    def _slots(self, pages: List[int]) -> torch.Tensor:
        if not pages:
            return self.empty_tensor
        p = torch.tensor(pages, dtype=torch.int64)
        slots = (p[:, None] * self.page_size + self._offsets).reshape(-1)
        return slots.to(device=self.device, dtype=torch.int32)

    def cached_indices(self) -> torch.Tensor:
        return self._slots([b.page for b in self._blocks.values()])

    def reset(self) -> None:
        if self._num_locked:
            raise RuntimeError(
                f"cannot reset while {self._num_locked * self.page_size} tokens are locked; "
                "unlock every handle first"
            )
        self._init_state()

    # ----------------------------------------------------------- hashing
    def _token_blocks(self, input_ids: torch.Tensor) -> List[Tuple[int, ...]]:
        """The full blocks of ``input_ids`` as tuples of Python ints (validated)."""
        check_token_ids(input_ids)
        ids = input_ids.tolist()
        ps = self.page_size
        return [tuple(ids[i:i + ps]) for i in range(0, len(ids) // ps * ps, ps)]

    def _base_hash(self, parent: Optional[int], tokens: Tuple[int, ...]) -> int:
        return int(self.hash_fn(ROOT_HASH_SEED if parent is None else parent, tokens)) & _MASK

    def _find(self, parent: Optional[int], tokens: Tuple[int, ...]) -> Optional[CachedBlock]:
        """The cached block holding ``tokens`` after ``parent``, comparing content, not just hashes."""
        h = self._base_hash(parent, tokens)
        for k in range(self._max_probe + 1):
            block = self._blocks.get((h + k) & _MASK)
            if block is not None and block.parent_hash == parent and block.tokens == tokens:
                return block
        return None

    def _walk(self, blocks: List[Tuple[int, ...]]) -> List[CachedBlock]:
        """The cached chain matching the longest prefix of ``blocks`` (read-only)."""
        chain: List[CachedBlock] = []
        parent: Optional[int] = None
        for tokens in blocks:
            block = self._find(parent, tokens)
            if block is None:
                break
            chain.append(block)
            parent = block.block_hash
        return chain

    def _use(self, chain: List[CachedBlock], tic: int) -> None:
        """Mark ``chain`` used at ``tic``: its free blocks move to the queue's tail, deepest first."""
        for block in reversed(chain):
            block.last_use = tic
            if block.ref_count == 0:
                self._free.move_to_end(block.block_hash)

    # ------------------------------------------------------------- public
    def match_prefix(self, input_ids: torch.Tensor) -> Tuple[BlockHashCacheHandle, torch.Tensor]:
        """Longest cached chain of full blocks of ``input_ids`` and its slots, in order.

        Not read-only: the matched blocks count as used (they move to the tail of the free queue).
        """
        chain = self._walk(self._token_blocks(input_ids))
        self._use(chain, self._tick())
        handle = BlockHashCacheHandle(len(chain) * self.page_size,
                                      tuple(b.block_hash for b in chain))
        return handle, self._slots([b.page for b in chain])

    def insert_prefix(self, input_ids: torch.Tensor, indices: torch.Tensor) -> int:
        """Cache the full blocks of ``input_ids`` whose K/V sit at ``indices``; return the length already cached.

        Only the blocks past the cached prefix are added (each takes the page of its indices);
        ``indices[:returned]`` (duplicates of cached blocks) and the tail past the last full block
        stay the caller's, to free or keep. New blocks are evictable until a handle covering them
        is locked. Each block's indices must be the ``page_size`` consecutive slots of one page,
        and a new block's page must not already belong to the cache.
        """
        blocks = self._token_blocks(input_ids)
        check_indices(indices, self.device)
        if len(indices) != len(input_ids):
            raise ValueError(f"len(indices) ({len(indices)}) must equal len(input_ids) ({len(input_ids)})")
        ps = self.page_size
        n = len(blocks) * ps
        self._check_page_aligned(indices, n)
        chain = self._walk(blocks)
        m = len(chain)
        new_pages = (indices[m * ps:n:ps].to(torch.int64) // ps).tolist()
        self._check_new_pages(new_pages)
        # Validation done; from here on nothing raises.
        tic = self._tick()
        parent = chain[-1].block_hash if chain else None
        created: List[CachedBlock] = []
        for tokens, page in zip(blocks[m:], new_pages):
            block = self._add_block(parent, tokens, page, tic)
            created.append(block)
            parent = block.block_hash
        for block in reversed(created):
            self._free[block.block_hash] = None
        self._use(chain, tic)
        return m * ps

    def _check_page_aligned(self, indices: torch.Tensor, n: int) -> None:
        """Each block of ``indices[:n]`` must be ``page_size`` consecutive slots of one page."""
        if n == 0:
            return
        head = indices[:n]
        if bool((head < 0).any()):
            raise ValueError(f"indices must be >= 0, got {int(head.min())}")
        ps = self.page_size
        if ps == 1:
            return
        pages = head.view(-1, ps)
        offsets = pages - pages[:, :1]
        expected = torch.arange(ps, dtype=torch.int32, device=indices.device)
        if bool(((pages[:, 0] % ps) != 0).any()) or not bool((offsets == expected).all()):
            raise ValueError(
                f"with page_size={ps} every {ps} indices must be the consecutive slots of one page "
                f"(first slot a multiple of {ps}); got {head.tolist()}"
            )

    def _check_new_pages(self, pages: List[int]) -> None:
        seen = set()
        for page in pages:
            if page in self._page_owner:
                raise ValueError(
                    f"page {page} (slots {page * self.page_size}..{(page + 1) * self.page_size - 1}) "
                    f"already holds cached block {self._page_owner[page]:#018x}; a page can be cached once"
                )
            if page in seen:
                raise ValueError(f"page {page} appears in more than one new block of this insert")
            seen.add(page)

    def _add_block(self, parent: Optional[int], tokens: Tuple[int, ...], page: int, tic: int) -> CachedBlock:
        h = self._base_hash(parent, tokens)
        probe = 0
        while ((h + probe) & _MASK) in self._blocks:
            probe += 1
        key = (h + probe) & _MASK
        self._max_probe = max(self._max_probe, probe)
        block = CachedBlock(key, parent, tokens, page, tic, probe)
        self._blocks[key] = block
        self._page_owner[page] = key
        if parent is not None:
            self._blocks[parent].num_children += 1
        return block

    def _chain(self, handle: BaseCacheHandle) -> List[CachedBlock]:
        """The blocks behind ``handle``, root first, after checking the handle."""
        if not isinstance(handle, BlockHashCacheHandle):
            raise TypeError(f"handle must be a BlockHashCacheHandle, got {type(handle).__name__}")
        hashes = handle.block_hashes
        if handle.cached_len != len(hashes) * self.page_size:
            raise RuntimeError(
                f"handle says cached_len={handle.cached_len} but names {len(hashes)} blocks of "
                f"{self.page_size} tokens"
            )
        chain: List[CachedBlock] = []
        parent: Optional[int] = None
        for i, h in enumerate(hashes):
            block = self._blocks.get(h)
            if block is None:
                raise RuntimeError(f"handle's block {i} ({h:#018x}) was evicted; match the prefix again")
            if block.parent_hash != parent:
                raise RuntimeError(f"handle's block {i} ({h:#018x}) does not chain from block {i - 1}")
            chain.append(block)
            parent = h
        return chain

    def handle_indices(self, handle: BaseCacheHandle) -> torch.Tensor:
        """The slots of the prefix behind ``handle`` (read-only: the LRU order does not change)."""
        return self._slots([b.page for b in self._chain(handle)])

    def lock_handle(self, handle: BaseCacheHandle, unlock: bool = False) -> None:
        """Lock (``ref_count += 1``) or unlock every block of ``handle``.

        Unlocking a handle that is not locked raises ``RuntimeError``. A block whose count drops
        to 0 joins the tail of the free queue; the chain is released deepest block first, so its
        tail is evicted before its head. A handle of length 0 needs no protection: nothing happens.
        """
        chain = self._chain(handle)
        if not chain:
            return
        if unlock:
            if chain[-1].ref_count <= 0:
                raise RuntimeError(
                    f"cannot unlock a handle that is not locked (block {chain[-1].block_hash:#018x})"
                )
            for block in reversed(chain):
                block.ref_count -= 1
                if block.ref_count == 0:
                    block.last_use = self._clock
                    self._free[block.block_hash] = None
                    self._num_locked -= 1
        else:
            for block in chain:
                if block.ref_count == 0:
                    del self._free[block.block_hash]
                    self._num_locked += 1
                block.ref_count += 1

    def evict(self, size: int) -> torch.Tensor:
        """Evict free blocks from the head of the free queue until at least ``size`` tokens are freed.

        Returns their slots, block after block. Only blocks no cached block chains from are
        evicted (the queue's order guarantees the head is one). Raises ``RuntimeError``
        (evicting nothing) when fewer than ``size`` tokens are evictable.
        """
        check_size(size)
        if size == 0:
            return self.empty_tensor
        evictable = self.size_info.evictable_size
        if size > evictable:
            raise RuntimeError(
                f"cannot evict {size} tokens: only {evictable} are evictable "
                f"({self._num_locked * self.page_size} are locked)"
            )
        victims = [self._blocks[h] for h in islice(self._free, -(-size // self.page_size))]
        gone: Dict[int, int] = {}  # parent hash -> children among earlier victims
        for block in victims:
            if block.num_children != gone.get(block.block_hash, 0):
                raise RuntimeError(
                    f"internal error: free block {block.block_hash:#018x} would be evicted before its "
                    f"{block.num_children} children; nothing was evicted"
                )
            if block.parent_hash is not None:
                gone[block.parent_hash] = gone.get(block.parent_hash, 0) + 1
        for block in victims:
            del self._free[block.block_hash]
            del self._blocks[block.block_hash]
            del self._page_owner[block.page]
            if block.parent_hash is not None:
                self._blocks[block.parent_hash].num_children -= 1
        return self._slots([b.page for b in victims])

    # ---------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """Check every block, the free queue and the sizes; raise ``RuntimeError`` on the first fault."""
        ps = self.page_size
        children: Dict[int, int] = {}
        contents = set()
        locked = 0
        for key, block in self._blocks.items():
            where = f"block {key:#018x}"
            if block.block_hash != key:
                raise RuntimeError(f"{where}: filed under the wrong key (says {block.block_hash:#018x})")
            if len(block.tokens) != ps or not all(isinstance(t, int) for t in block.tokens):
                raise RuntimeError(f"{where}: tokens {block.tokens!r} are not {ps} ints")
            if not 0 <= block.probe <= self._max_probe:
                raise RuntimeError(f"{where}: probe {block.probe} outside [0, {self._max_probe}]")
            if key != (self._base_hash(block.parent_hash, block.tokens) + block.probe) & _MASK:
                raise RuntimeError(f"{where}: hash does not match its parent and tokens")
            content = (block.parent_hash, block.tokens)
            if content in contents:
                raise RuntimeError(f"{where}: the same tokens after the same parent are cached twice")
            contents.add(content)
            if block.ref_count < 0:
                raise RuntimeError(f"{where}: negative ref_count {block.ref_count}")
            if block.parent_hash is not None:
                parent = self._blocks.get(block.parent_hash)
                if parent is None:
                    raise RuntimeError(f"{where}: parent {block.parent_hash:#018x} is not cached")
                if parent.ref_count < block.ref_count:
                    raise RuntimeError(
                        f"{where}: ref_count {block.ref_count} exceeds its parent's {parent.ref_count}"
                    )
                children[block.parent_hash] = children.get(block.parent_hash, 0) + 1
            if self._page_owner.get(block.page) != key:
                raise RuntimeError(f"{where}: page {block.page} is not recorded as its page")
            if block.page < 0:
                raise RuntimeError(f"{where}: negative page {block.page}")
            in_queue = key in self._free
            if (block.ref_count == 0) != in_queue:
                raise RuntimeError(
                    f"{where}: ref_count {block.ref_count} but {'in' if in_queue else 'not in'} the free queue"
                )
            locked += block.ref_count > 0
        for key, block in self._blocks.items():
            if block.num_children != children.get(key, 0):
                raise RuntimeError(
                    f"block {key:#018x}: records {block.num_children} children, has {children.get(key, 0)}"
                )
        if len(self._page_owner) != len(self._blocks):
            raise RuntimeError(f"{len(self._page_owner)} pages recorded for {len(self._blocks)} blocks")
        extra = [h for h in self._free if h not in self._blocks]
        if extra:
            raise RuntimeError(f"free queue holds {len(extra)} blocks that are not cached: {extra[:4]}")
        position = {h: i for i, h in enumerate(self._free)}
        last = None
        for h in self._free:
            block = self._blocks[h]
            if last is not None and block.last_use < last:
                raise RuntimeError(f"free queue out of LRU order at block {h:#018x}")
            last = block.last_use
            if block.parent_hash in position and position[block.parent_hash] < position[h]:
                raise RuntimeError(f"block {h:#018x} is queued after its parent: the parent would be evicted first")
        if locked != self._num_locked:
            raise RuntimeError(f"recorded {self._num_locked} locked blocks, counted {locked}")
