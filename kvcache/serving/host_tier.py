"""`TieredCacheManager`: a radix cache whose evicted prefixes move to host memory, and come back.

The device tier is a `RadixCacheManager` over the device pool's pages; the host tier is a larger
`HostKVPool` indexed by a `HostIndex`. The tier is itself a manager (it forwards the whole
`BaseCacheManager` API), so a `RequestFlow`, an `Engine` or a `Scheduler` runs on it unchanged:

* ``evict`` (the flow asks when pages run short): the device manager evicts as before, and the
  K/V of every evicted page is copied to a host page before the slots are handed back. When the
  host is full, its least recently used *host leaf* goes (the host's own LRU).
* ``match_prefix``: the device match, then the host trie continues it; the pages found there are
  copied back into fresh device pages (evicting device leaves to host first if the free list is
  short), inserted into the device tree, and the longer match is returned. So a request runs
  only what neither tier holds.
* policies, as SGLang's HiRadixCache names them: ``"write_back"`` copies a page to host only
  when the device evicts it, and a page lives in exactly one tier (a load moves it back);
  ``"write_through"`` copies every page to host when it is inserted, so an eviction copies
  nothing and a page may live in both tiers (a load leaves the host copy).

The device manager reports what it stores and evicts through its event log (`take_events`), so
the tier never reads its internals; it must be built with ``events=True``, empty, and be used
only through the tier.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._validate import check_positive_int
from ..managers.base import BaseCacheHandle, BaseCacheManager, InsertResult, SizeInfo
from ..managers.cache_events import BlockRemoved, BlockStored, CacheEvent
from ..managers.radix import RadixCacheHandle, RadixCacheManager
from ..managers.radix_node import token_array
from ..storage.mha_pool import MHAKVCache
from .allocator import PageAllocator
from .host_index import HostIndex, HostNode
from .host_pool import HostKVPool

__all__ = ["TIER_POLICIES", "TierStats", "TieredCacheManager"]

#: The tier's write policies: copy a page to host when the device evicts it, or when it is inserted.
TIER_POLICIES = ("write_back", "write_through")
Prefix = tuple[Hashable, tuple[int, ...]]


@dataclass
class TierStats:
    """Copies between the tiers, in pages (``page_bytes`` each) and tokens."""

    page_bytes: int
    saved_pages: int = 0  # device -> host
    loaded_pages: int = 0  # host -> device
    host_hits: int = 0  # matches that loaded at least one page
    host_evicted_pages: int = 0  # host pages given up to the host's LRU
    lost_pages: int = 0  # host pages dropped because an ancestor found no host room

    @property
    def saved_bytes(self) -> int:
        return self.saved_pages * self.page_bytes

    @property
    def loaded_bytes(self) -> int:
        return self.loaded_pages * self.page_bytes


def _page_keys(tokens: np.ndarray | list[int], page_size: int) -> list[tuple[int, ...]]:
    arr = np.asarray(tokens, dtype=np.int64)
    n = len(arr) // page_size * page_size
    return [tuple(r) for r in arr[:n].reshape(-1, page_size).tolist()]


class TieredCacheManager(BaseCacheManager):
    """A device radix cache backed by a host tier; see the module docstring.

    Args:
        manager: an empty `RadixCacheManager` built with ``events=True`` (the device tier).
        kv_cache: the device pool holding the K/V of ``manager``'s slots.
        allocator: the device page free list the flow uses (loads take pages from it).
        host_pages: capacity of the host tier in pages, >= 1.
        policy: ``"write_back"`` (default) or ``"write_through"``.
        pin_memory: page-lock the host buffer (default: when ``kv_cache`` is on CUDA).
    """

    def __init__(
        self,
        manager: RadixCacheManager,
        kv_cache: MHAKVCache,
        allocator: PageAllocator,
        host_pages: int,
        *,
        policy: str = "write_back",
        pin_memory: bool | None = None,
    ) -> None:
        if not isinstance(manager, RadixCacheManager):
            raise TypeError(f"manager must be a RadixCacheManager, got {type(manager).__name__}")
        if not isinstance(kv_cache, MHAKVCache):
            raise TypeError(f"kv_cache must be an MHAKVCache, got {type(kv_cache).__name__}")
        if not isinstance(allocator, PageAllocator):
            raise TypeError(f"allocator must be a PageAllocator, got {type(allocator).__name__}")
        check_positive_int(host_pages, "host_pages")
        if policy not in TIER_POLICIES:
            raise ValueError(f"policy must be one of {TIER_POLICIES}, got {policy!r}")
        ps = manager.page_size
        if not ps == allocator.page_size == kv_cache.page_size:
            raise ValueError(
                f"page sizes differ: manager {ps}, allocator {allocator.page_size}, "
                f"kv_cache {kv_cache.page_size}"
            )
        if not torch.device(manager.device) == allocator.device == kv_cache.device:
            raise ValueError(
                f"devices differ: manager {manager.device}, allocator {allocator.device}, "
                f"kv_cache {kv_cache.device}"
            )
        if allocator.num_pages > kv_cache.num_pages:
            raise ValueError(
                f"allocator has {allocator.num_pages} pages, kv_cache only {kv_cache.num_pages}"
            )
        if manager.size_info.total_size:
            raise ValueError("manager must be empty: the tier must see every page it stores")
        try:
            manager.take_events()
        except RuntimeError:
            raise ValueError("manager must be built with events=True") from None
        self.manager, self.kv_cache, self.allocator = manager, kv_cache, allocator
        self.policy = policy
        self.page_size = ps
        self.device = manager.device
        self.host = HostKVPool(kv_cache, host_pages, pin_memory=pin_memory)
        self.host_allocator = PageAllocator(host_pages)
        self.index = HostIndex(ps)
        self.stats = TierStats(self.host.page_bytes)

    # ------------------------------------------------------------ forwarded
    @property
    def size_info(self) -> SizeInfo:
        """The device tier's sizes (what the flow can evict or must keep)."""
        return self.manager.size_info

    def lock_handle(self, handle: BaseCacheHandle, unlock: bool = False) -> None:
        self.manager.lock_handle(handle, unlock)

    def handle_indices(self, handle: BaseCacheHandle) -> torch.Tensor:
        return self.manager.handle_indices(handle)

    def cached_indices(self) -> torch.Tensor:
        return self.manager.cached_indices()

    def eviction_priority(self, node: Any) -> tuple[int, ...]:
        return self.manager.eviction_priority(node)

    @property
    def host_size(self) -> int:
        """Tokens the host tier holds."""
        return self.index.num_pages * self.page_size

    # ------------------------------------------------------------ the tiers
    def match_prefix(
        self, input_ids: torch.Tensor, extra_key: Hashable = None
    ) -> tuple[RadixCacheHandle, torch.Tensor]:
        """The longest whole-page prefix cached in either tier; host pages are loaded first.

        Loads only when the device pool can then hold all of ``input_ids`` (free pages plus what
        evicting unlocked device leaves frees): a request that cannot start anyway leaves the
        host's pages where they are.
        """
        handle, idx = self.manager.match_prefix(input_ids, extra_key)
        ps, m = self.page_size, handle.cached_len // self.page_size
        if not self.index.num_pages:
            return handle, idx
        ids = token_array(input_ids)
        path = self.index.path(extra_key, _page_keys(ids, ps))
        tic = self.index.tick()
        for n in path:
            n.last_use = tic
        run: list[HostNode] = []
        for n in path[m:]:
            if n.page is None:
                break
            run.append(n)
        if not run:
            return handle, idx
        self.manager.lock_handle(handle)
        try:
            # Load only if the whole request fits after it: a loaded page replaces a page the
            # request would compute, so a request that cannot start would only churn the tiers.
            room = self.allocator.num_free_pages + self.manager.size_info.evictable_size // ps
            if room < -(-len(ids) // ps) - m:
                return handle, idx
            staged = self.host.read(torch.tensor([n.page for n in run]))
            if self.policy == "write_back":  # moving: the host copies go now, making room
                self.host_allocator.free(
                    torch.tensor([self.index.drop_page(n) for n in reversed(run)])
                )
            short = len(run) - self.allocator.num_free_pages
            if short > 0:
                self.allocator.free_slots(self._evict(short * ps))
            new = self.allocator.allocate_slots(len(run) * ps)
            self.host.restore(self.kv_cache, self.allocator.slots_to_pages(new), staged)
            end = (m + len(run)) * ps
            self.manager.insert_prefix(
                torch.from_numpy(ids[:end]), torch.cat([idx, new]), extra_key
            )
            self._apply(self.manager.take_events())
        finally:
            self.manager.lock_handle(handle, unlock=True)
        self.stats.loaded_pages += len(run)
        self.stats.host_hits += 1
        return self.manager.match_prefix(input_ids, extra_key)

    def insert_prefix(
        self, input_ids: torch.Tensor, indices: torch.Tensor, extra_key: Hashable = None
    ) -> int:
        """`RadixCacheManager.insert_prefix`; write-through copies the new pages to host."""
        return self.insert_and_match(input_ids, indices, extra_key).cached_len

    def insert_and_match(
        self, input_ids: torch.Tensor, indices: torch.Tensor, extra_key: Hashable = None
    ) -> InsertResult:
        res = self.manager.insert_and_match(input_ids, indices, extra_key)
        self._apply(self.manager.take_events())
        return res

    def evict(self, size: int) -> torch.Tensor:
        """Evict device leaves as the device manager would; their K/V are on the host after."""
        return self._evict(size)

    def _evict(self, size: int) -> torch.Tensor:
        slots = self.manager.evict(size)
        self._apply(self.manager.take_events())
        return slots

    def reset(self) -> None:
        """Forget every prefix in both tiers (``RuntimeError``, nothing changed, while locked)."""
        self.manager.reset()
        self.manager.take_events()
        self.index.clear()
        self.host_allocator.reset()

    # ------------------------------------------------------------ events -> host
    def _apply(self, events: list[CacheEvent]) -> None:
        for ev in events:
            if isinstance(ev, BlockRemoved):
                self._to_host(ev.extra_key, ev.tokens, ev.slots, removed=True)
            elif isinstance(ev, BlockStored):
                if self.policy == "write_through":
                    self._to_host(ev.extra_key, ev.tokens, ev.slots, removed=False)
                else:
                    self._drop_host_copies(ev.extra_key, ev.tokens, len(ev.slots))

    def _drop_host_copies(self, key: Hashable, tokens: tuple[int, ...], num_new: int) -> None:
        """Write-back: pages just stored on the device leave the host (one tier per page)."""
        keys = _page_keys(list(tokens), self.page_size)
        first = len(keys) - num_new // self.page_size
        nodes = [n for n in reversed(self.index.path(key, keys)[first:]) if n.page is not None]
        if nodes:
            self.host_allocator.free(torch.tensor([self.index.drop_page(n) for n in nodes]))

    def _host_page(self) -> int | None:
        """A free host page, evicting the host's LRU leaf when none is free; None if impossible."""
        if self.host_allocator.num_free_pages:
            return int(self.host_allocator.allocate(1)[0])
        victim = self.index.lru_leaf()
        if victim is None:
            return None
        self.stats.host_evicted_pages += 1
        return self.index.drop_page(victim)

    def _to_host(
        self, key: Hashable, tokens: tuple[int, ...], slots: tuple[int, ...], removed: bool
    ) -> None:
        """Copy the pages of the run ending ``tokens`` (device ``slots``) to host, parent first.

        A page that finds no host room (every host leaf is one of its ancestors) is not copied,
        nor the rest of the run; when the device just evicted it (``removed``), the host pages
        below it lost their prefix and are dropped too.
        """
        ps = self.page_size
        keys = _page_keys(list(tokens), ps)
        first = len(keys) - len(slots) // ps
        nodes = self.index.ensure_path(key, keys)
        dev: list[int] = []
        host: list[int] = []
        try:
            for j in range(first, len(keys)):
                node = nodes[j]
                if node.page is not None:
                    node.last_use = self.index.tick()
                    continue
                hp = self._host_page()
                if hp is None:
                    if removed:
                        lost = [self.index.drop_page(n) for n in self.index.subtree_pages(node)]
                        if lost:
                            self.host_allocator.free(torch.tensor(lost))
                        self.stats.lost_pages += len(lost)
                    break
                self.index.set_page(node, hp)
                dev.append(slots[(j - first) * ps] // ps)
                host.append(hp)
        finally:
            self.index.unpin(nodes)
        if dev:
            self.host.save(self.kv_cache, torch.tensor(dev), torch.tensor(host))
            self.stats.saved_pages += len(dev)

    # ------------------------------------------------------------ integrity
    def device_prefixes(self) -> dict[Prefix, int]:
        """``(extra_key, prefix tokens through the page) -> device page`` for every cached page."""
        out: dict[Prefix, int] = {}
        ps = self.page_size
        for key, root in self.manager.roots.items():
            stack: list[tuple[Any, list[int]]] = [(root, [])]
            while stack:
                node, prefix = stack.pop()
                for c in node.children.values():
                    toks = prefix + np.frombuffer(c.key_bytes, dtype=np.int64).tolist()
                    vals = c.value_array
                    base = len(prefix)
                    for j in range(0, len(vals), ps):
                        out[(key, tuple(toks[: base + j + ps]))] = int(vals[j]) // ps
                    stack.append((c, toks))
        return out

    def host_prefixes(self) -> dict[Prefix, int]:
        """``(extra_key, prefix tokens through the page) -> host page`` for every host page."""
        out: dict[Prefix, int] = {}
        for k, p in self.index.prefixes().items():
            out[k] = int(p)
        return out

    def check_integrity(self) -> None:
        """Both tiers, ``RuntimeError`` on the first breach: the device tree's own check; the
        host trie's counts; host pages held = host pages not free, none twice; every host page's
        prefix is whole (each ancestor page in one tier or the other); and with write-back no
        page in both tiers."""
        self.manager.check_integrity()
        held = self.index.check()
        if len(set(held)) != len(held):
            raise RuntimeError("a host page is held by two prefixes")
        free = set(self.host_allocator.free_pages().tolist())
        used = set(range(self.host_allocator.num_pages)) - free
        if used != set(held):
            raise RuntimeError(
                f"host pages held {sorted(set(held))[:8]} disagree with those not free {sorted(used)[:8]}"
            )
        on_device: set[int] = set()
        for key, root in self.manager.roots.items():
            hroot = self.index.root(key)
            if hroot is None:
                continue
            stack: list[tuple[Any, HostNode | None]] = [(root, hroot)]
            while stack:
                node, cur = stack.pop()
                for c in node.children.values():
                    h = cur
                    for page in _page_keys(
                        np.frombuffer(c.key_bytes, dtype=np.int64), self.page_size
                    ):
                        h = h.children.get(page) if h is not None else None
                        if h is None:
                            break
                        on_device.add(id(h))
                        if self.policy == "write_back" and h.page is not None:
                            raise RuntimeError(
                                f"write-back: a page of prefix {h.tokens()[:8]}... is in both tiers"
                            )
                    stack.append((c, h))
        for _, n in self.index.nodes():
            if n.page is None and id(n) not in on_device:
                raise RuntimeError(
                    f"host pages below prefix {n.tokens()[:8]}... lost a page of their prefix"
                )
