"""`TieredCacheManager`: a radix cache whose evicted prefixes move to host memory, and come back.

The device tier is a `RadixCacheManager` over the device pool's pages; the host tier is a larger
`HostKVPool` indexed by a `HostIndex` (below). The tier is itself a manager (it forwards the
whole `BaseCacheManager` API), so a `RequestFlow`, an `Engine` or a `Scheduler` runs on it
unchanged:

* ``evict`` (the flow asks when pages run short): the device manager evicts as before, and the
  K/V of every evicted page is copied to a host page before the slots are handed back. When the
  host is full, its least recently used *host leaf* goes (the host's own LRU).
* ``match_prefix``: the device match, then the host trie continues it; the pages found there are
  copied back into fresh device pages (evicting device leaves to host first if the free list is
  short), inserted into the device tree, and the longer match is returned. So a request runs
  only what neither tier holds.
* `peek_prefix`: how much of a prompt the tiers hold, found by looking only (device, host,
  disk): what a scheduler orders its queue by; no page moves.
* write policies (`TIER_POLICIES`):

  - ``"write_back"``: a page is copied to host when the device evicts it, and lives in exactly
    one tier: a load *moves* it back (its host copy is freed). An *exclusive* write-back: ours
    from the start, not SGLang's;
  - ``"write_back_inclusive"``: copied when evicted, but a load leaves the host copy (SGLang's
    ``HiRadixCache.load_back`` keeps ``node.host_value``; ``_evict_backuped`` then frees only
    the device slots), so a page evicted again is not copied again;
  - ``"write_through"``: every page is copied to host when it is inserted; an eviction copies
    nothing, a load leaves the host copy;
  - ``"write_through_selective"``: a page is copied to host once it has been *hit* (matched by
    a request that reuses it) ``write_through_threshold`` times, 2 by default as SGLang's
    ``write_through_threshold`` for ``--hicache-write-policy write_through_selective``; a page
    evicted before that is dropped, as SGLang evicts a node that has no host copy.
* a third tier on disk (``disk``, a `DiskKVStore`): a page the host's LRU gives up is written to
  a file named by the content hash of its prefix; a match continues device and host with the
  pages found on disk (each checked against its hash before it is used), and loads them too.

What the tier knows of the device. The device manager reports what it stores and evicts through
its event log (`take_events`); the tier reads the log at the start of each of its calls (and
right after an eviction) and keeps from it which device pages the tree holds and, replayed into
a `PrefixMirror` when it needs them, every page's prefix (the picture a router keeps of a
replica), so it never reads the manager's internals. The manager must be built with
``events=True``, empty, and be used only through the tier. Built with ``events=True`` itself,
the tier hands those events on (`take_events`), so that a `Router` can mirror a tiered replica,
and `take_tier_events` adds the host's, each a `TierEvent` with its medium (as SGLang's KV
events carry ``medium``), for a `TieredPrefixMirror` to follow both tiers.

All or nothing. A call orders its steps so that the one that cannot be taken back, the device
manager's insert, comes last (the flow must never see an insert fail after it happened), and
takes back what it did when a later step raises, whatever it raises (``KeyboardInterrupt``
too). What a failure leaves, besides the LRU refresh of a match:

* `evict`: the evicted pages are put back into the device tree, at their slots, as most
  recently used (when even the manager's event log cannot be read, the tier's picture of the
  device says what they held);
* a load (`match_prefix`): the room it made on the device stays made (those pages are on the
  host, as after any eviction) and the prefix it was moving goes back to the host; once the
  device tree holds the loaded pages the load stands (under write-through, a failed refresh of
  their host copies leaves them device-only, as a copy that found no room does);
* a write-through insert: the host copies made for it are dropped again;
* the host may have given up LRU leaves for a copy that was then taken back (its own eviction,
  which cuts no prefix), and a lock the tier could not release is released at the start of its
  next call.

`check_integrity` proves, besides both tiers' own rules, what such failures would break: every
device page the tree holds is one the tier knows, none is also free, none is left in the tier's
hands, and every host page the index names was written.

The module is long because the tier is one concept read call by call: each call (evict, load,
insert, a copy to host) keeps its undo beside the step it takes back, where a reader checks one
against the other, and the write policies are branches of those same calls.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch

from .._validate import check_positive_int, slot_array, token_ids
from ..managers.base import BaseCacheHandle, BaseCacheManager, InsertResult, SizeInfo
from ..managers.cache_events import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    CacheEvent,
    check_extra_key,
)
from ..managers.radix import RadixCacheHandle, RadixCacheManager
from ..serving.allocator import PageAllocator
from ..storage.mha_pool import MHAKVCache
from .disk_store import DiskKVStore
from .host_index import HostIndex, HostNode, PageKey, Prefix, page_keys
from .host_pool import HostKVPool
from .prefix_mirror import PrefixMirror, TierEvent

__all__ = ["TIER_POLICIES", "TierStats", "TieredCacheManager"]

#: The tier's write policies (see the module docstring): when a page is copied to host, and
#: whether a load moves it (exclusive) or copies it (inclusive).
TIER_POLICIES = ("write_back", "write_back_inclusive", "write_through", "write_through_selective")


@dataclass
class TierStats:
    """Copies between the tiers, in pages (``page_bytes`` each) and tokens."""

    page_bytes: int
    saved_pages: int = 0  # device -> host
    loaded_pages: int = 0  # host -> device
    host_hits: int = 0  # matches that loaded at least one page
    host_evicted_pages: int = 0  # host pages given up to the host's LRU
    lost_pages: int = 0  # host pages dropped because an ancestor found no host room
    dropped_pages: int = 0  # device pages evicted without a host copy (selective write-through)
    disk_saved_pages: int = 0  # host -> disk (pages the host's LRU gave up)
    disk_loaded_pages: int = 0  # disk -> device

    @property
    def saved_bytes(self) -> int:
        return self.saved_pages * self.page_bytes

    @property
    def loaded_bytes(self) -> int:
        return self.loaded_pages * self.page_bytes


@dataclass
class _HostUndo:
    """What one copy to host changed before its save, to take back if the save fails."""

    taken: list[int] = field(default_factory=list)  # host pages taken from the free list
    victims: list[tuple[Hashable, list[int], int, int]] = field(default_factory=list)
    # ^ host leaves given up: (namespace, prefix tokens, page, last_use)


# ---------------------------------------------------------------------------------- the tier
class TieredCacheManager(BaseCacheManager):
    """A device radix cache backed by a host tier; see the module docstring.

    Args:
        manager: an empty `RadixCacheManager` built with ``events=True`` (the device tier).
        kv_cache: the device pool holding the K/V of ``manager``'s slots.
        allocator: the device page free list the flow uses (loads take pages from it).
        host_pages: capacity of the host tier in pages, >= 1.
        policy: one of `TIER_POLICIES` (default ``"write_back"``).
        write_through_threshold: hits after which ``"write_through_selective"`` copies a page
            to host, >= 1 (SGLang's: 2).
        disk: a `DiskKVStore` for the pages the host gives up (``None``: they are dropped); its
            pages must be shaped like ``kv_cache``'s.
        pin_memory: page-lock the host buffer (default: when ``kv_cache`` is on CUDA).
        events: hand the device tier's cache events on through `take_events` (for a router),
            and every tier's through `take_tier_events`.

    A `RequestFlow` or an `Engine` built on the tier must use its ``allocator`` and
    ``kv_cache``; they ask `check_parts`.
    """

    def __init__(
        self,
        manager: RadixCacheManager,
        kv_cache: MHAKVCache,
        allocator: PageAllocator,
        host_pages: int,
        *,
        policy: str = "write_back",
        write_through_threshold: int = 2,
        disk: DiskKVStore | None = None,
        pin_memory: bool | None = None,
        events: bool = False,
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
        if not isinstance(events, bool):
            raise TypeError(f"events must be a bool, got {type(events).__name__}")
        threshold = check_positive_int(write_through_threshold, "write_through_threshold")
        if disk is not None:
            if not isinstance(disk, DiskKVStore):
                raise TypeError(f"disk must be a DiskKVStore or None, got {type(disk).__name__}")
            c = kv_cache
            shape = (2, c.num_layers, c.page_size, c.local_kv_heads, c.head_dim)
            if disk.page_shape != shape or disk.dtype != kv_cache.dtype:
                raise ValueError(
                    f"disk pages are {disk.page_shape} of {disk.dtype}, the pool's {shape} of "
                    f"{kv_cache.dtype}"
                )
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
        self.manager = manager
        self._kv_cache, self._allocator = kv_cache, allocator
        self.policy, self.write_through_threshold, self.disk = policy, threshold, disk
        self.page_size = ps
        self.device = manager.device
        self.host = HostKVPool(kv_cache, host_pages, pin_memory=pin_memory)
        self.host_allocator = PageAllocator(host_pages)
        self.index = HostIndex(ps)
        self.stats = TierStats(self.host.page_bytes)
        # The device as its events tell: every page's prefix, and which pages the tree holds.
        self._mirror = PrefixMirror(ps)
        self._unmirrored: list[CacheEvent] = []  # replayed into the mirror when it is read
        self._on_device = np.zeros(kv_cache.num_pages, dtype=np.bool_)
        self._written = np.zeros(host_pages, dtype=np.bool_)  # host pages whose save completed
        self._in_hand: set[int] = set()  # device pages taken from the tree or the free list
        self._owed_unlocks: list[BaseCacheHandle] = []  # own locks a failed unlock left
        self._published: list[CacheEvent] | None = [] if events else None
        self._tier_log: list[TierEvent] | None = [] if events else None
        self._hits = np.zeros(kv_cache.num_pages, dtype=np.int64)  # matches per device page

    # ------------------------------------------------------------ the parts
    @property
    def kv_cache(self) -> MHAKVCache:
        """The device pool the tier copies K/V out of and into (read-only)."""
        return self._kv_cache

    @property
    def allocator(self) -> PageAllocator:
        """The device page free list loads take pages from (read-only)."""
        return self._allocator

    def check_parts(
        self, *, allocator: PageAllocator | None = None, pool: MHAKVCache | None = None
    ) -> None:
        """``ValueError`` unless ``allocator`` and ``pool`` (where given) are the very objects the
        tier was built on: a flow on another allocator would hand out pages a load also takes,
        and an engine on another pool would attend over K/V the tier never copied."""
        if allocator is not None and allocator is not self._allocator:
            raise ValueError(
                "the tier was built on another PageAllocator: its loads would take pages this "
                "one hands out too; build both on the same allocator"
            )
        if pool is not None and pool is not self._kv_cache:
            raise ValueError(
                "the tier was built on another kv_cache: it would copy K/V to and from a pool "
                "this one never reads; build both on the same pool"
            )

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

    def take_events(self) -> list[CacheEvent]:
        """The device tier's events since the last call, oldest first (what the device manager
        logged: a router mirrors the device tier); ``RuntimeError`` unless built with
        ``events=True``."""
        if self._published is None:
            raise RuntimeError(
                "TieredCacheManager records no events; construct it with events=True"
            )
        self._settle()
        out, self._published = self._published, []
        return out

    def take_tier_events(self) -> list[TierEvent]:
        """The device's and the host's events since the last call, oldest first, each with its
        medium: ``"device"`` (the device tier's, as `take_events` gives them) and ``"host"``
        (a page copied to host or given up there, its slots the host page's). Disk pages are
        not announced: other processes write and read the same files, so no event stream could
        say what the directory holds. ``RuntimeError`` unless built with ``events=True``."""
        if self._tier_log is None:
            raise RuntimeError(
                "TieredCacheManager records no events; construct it with events=True"
            )
        self._settle()
        out, self._tier_log = self._tier_log, []
        return out

    def _note(self, medium: str, event: CacheEvent) -> None:
        if self._tier_log is not None:
            self._tier_log.append(TierEvent(medium, event))

    def _host_set(self, key: Hashable, node: HostNode, page: int) -> None:
        """The index records that ``node``'s page is host page ``page`` (and a mirror hears)."""
        self.index.set_page(node, page)
        if self._tier_log is not None:
            ps = self.page_size
            self._note(
                "host",
                BlockStored(key, tuple(node.tokens()), tuple(range(page * ps, (page + 1) * ps))),
            )

    def _host_drop(self, key: Hashable, node: HostNode) -> int:
        """The index forgets ``node``'s host page, which it returns (and a mirror hears)."""
        tokens = tuple(node.tokens()) if self._tier_log is not None else ()
        page = self.index.drop_page(node)
        if self._tier_log is not None:
            ps = self.page_size
            self._note("host", BlockRemoved(key, tokens, tuple(range(page * ps, (page + 1) * ps))))
        return page

    # ------------------------------------------------------------ what the last call left
    def _settle(self) -> None:
        """Release the locks a failed unlock left, then replay the device's new events into
        the tier's picture of it. A call that raises here has changed nothing."""
        while self._owed_unlocks:
            self.manager.lock_handle(self._owed_unlocks[-1], unlock=True)
            self._owed_unlocks.pop()
        self._record(self.manager.take_events())

    def _record(self, events: list[CacheEvent]) -> None:
        """The device stored, removed or cleared these pages: update the picture of it (the
        pages it holds now, their prefixes when `_device` is next read)."""
        if not events:
            return
        self._unmirrored.extend(events)
        ps = self.page_size
        for ev in events:
            if isinstance(ev, AllCleared):
                self._on_device[:] = False
                self._hits[:] = 0
            else:
                pages = np.asarray(ev.slots[::ps], dtype=np.int64) // ps
                self._on_device[pages] = isinstance(ev, BlockStored)
                self._hits[pages] = 0  # a page that enters or leaves the device starts afresh
            self._note("device", ev)
        if self._published is not None:
            self._published.extend(events)
        if len(self._unmirrored) > self.kv_cache.num_pages:  # keep the backlog bounded
            self._device()

    def _device(self) -> PrefixMirror:
        """The tier's picture of the device tree: every page's prefix and slots, as its events
        tell them (replayed on demand: most calls need only which pages it holds)."""
        if self._unmirrored:
            events, self._unmirrored = self._unmirrored, []
            self._mirror.apply(events)
        return self._mirror

    def _unlock(self, handle: BaseCacheHandle) -> None:
        """Release the tier's own lock on ``handle``; one that raises is owed (see `_settle`)."""
        try:
            self.manager.lock_handle(handle, unlock=True)
        except BaseException:
            self._owed_unlocks.append(handle)
            raise

    # ------------------------------------------------------------ the tiers
    def peek_prefix(self, input_ids: torch.Tensor, extra_key: Hashable = None) -> int:
        """Leading tokens of ``input_ids`` the tiers hold, device pages first, then host pages,
        then (with a disk) page files, found by looking only: no page moves, no LRU changes,
        no file is read (a file that fails its check when loaded makes the match shorter).
        What a scheduler orders its waiting queue by."""
        self._settle()
        ids = token_ids(input_ids)
        check_extra_key(extra_key)
        ps = self.page_size
        keys = page_keys(ids, ps)
        n = self._device().match(input_ids, extra_key) // ps
        path = self.index.path(extra_key, keys)
        while n < len(path) and path[n].page is not None:
            n += 1
        if self.disk is not None and n < len(keys):
            digests = self._digests(extra_key, ids[: len(keys) * ps])
            n += 0 if digests is None else self.disk.run_length(digests[n:])
        return n * ps

    def match_prefix(
        self, input_ids: torch.Tensor, extra_key: Hashable = None
    ) -> tuple[RadixCacheHandle, torch.Tensor]:
        """The longest whole-page prefix cached in any tier; host (and disk) pages are loaded.

        Loads only when the device pool can then hold all of ``input_ids`` (free pages plus what
        evicting unlocked device leaves frees): a request that cannot start anyway leaves the
        host's pages where they are. A load that raises keeps the room it made on the device
        and leaves the prefix on the host (see the module docstring). Under selective
        write-through the match is a hit on every device page it covers; a page that reaches
        ``write_through_threshold`` hits is copied to host first (with the pages before it).
        """
        self._settle()
        handle, idx = self.manager.match_prefix(input_ids, extra_key)
        ps, m = self.page_size, handle.cached_len // self.page_size
        if self.policy == "write_through_selective" and m:
            self._hit(extra_key, token_ids(input_ids)[: m * ps], idx)
        if not self.index.num_pages and self.disk is None:
            return handle, idx
        ids = token_ids(input_ids)
        keys = page_keys(ids, ps)
        path = self.index.path(extra_key, keys)
        tic = self.index.tick()
        for n in path:
            n.last_use = tic
        run: list[HostNode] = []
        for n in path[m:]:
            if n.page is None:
                break
            run.append(n)
        on_disk: list[bytes] = []
        if self.disk is not None and m + len(run) < len(keys):
            digests = self._digests(extra_key, ids[: len(keys) * ps]) or []
            start = m + len(run)
            on_disk = digests[start : start + self.disk.run_length(digests[start:])]
        if not run and not on_disk:
            return handle, idx
        # Load only if the whole request fits after it: a loaded page replaces a page the
        # request would compute, so a request that cannot start would only churn the tiers.
        room = self.allocator.num_free_pages + self.manager.size_info.evictable_size // ps
        if room < -(-len(ids) // ps) - m:
            return handle, idx
        self.manager.lock_handle(handle)  # the make-room eviction must not take the match
        try:
            staged = self._read_pages(run, on_disk)
        except BaseException:
            self._unlock(handle)
            raise
        if len(staged) == len(run):
            on_disk = []  # a file failed its check: the match stops before it
        if not len(staged):
            self._unlock(handle)
            return handle, idx
        end = (m + len(staged)) * ps
        return self._load(handle, ids[:end], idx, run, extra_key, staged)

    def _read_pages(self, run: list[HostNode], on_disk: list[bytes]) -> torch.Tensor:
        """The K/V of ``run`` (host pages) and of the pages named ``on_disk``, in order:
        ``(n, *page_shape)``; the disk pages stop at the first file that fails its check."""
        staged = self.host.read(torch.tensor([n.page for n in run], dtype=torch.int64))
        pages = []
        for digest in on_disk:
            page = self.disk.get(digest) if self.disk is not None else None
            if page is None:
                break
            pages.append(page)
        if pages:
            staged = torch.cat([staged, torch.stack(pages).to(staged.dtype)])
        return staged

    def _hit(self, key: Hashable, tokens: np.ndarray, idx: torch.Tensor) -> None:
        """Selective write-through: a match covered the device pages ``idx`` (of ``tokens``):
        the pages that reach the threshold, and all before them, are copied to host (those
        not there yet), then every covered page counts the hit."""
        ps = self.page_size
        pages = idx[::ps].cpu().numpy().astype(np.int64) // ps
        hot = np.flatnonzero(self._hits[pages] + 1 >= self.write_through_threshold)
        if len(hot):
            upto = (int(hot[-1]) + 1) * ps
            self._to_host(key, tokens[:upto], idx[:upto].cpu().numpy(), removed=False)
        self._hits[pages] += 1

    def _load(
        self,
        handle: RadixCacheHandle,
        ids: np.ndarray,
        idx: torch.Tensor,
        run: list[HostNode],
        key: Hashable,
        staged: torch.Tensor,
    ) -> tuple[RadixCacheHandle, torch.Tensor]:
        """Copy ``staged`` (the K/V of ``run``, the host pages continuing the device match
        ``idx``, then of pages read from disk) into fresh device pages and insert the prefix
        ``ids``; returns the new match. ``handle`` is locked by the tier; every way out
        releases it. Write-back moves the host pages (exclusive); the others keep them."""
        ps, moving, n = self.page_size, self.policy == "write_back", len(staged)
        keys, first = page_keys(ids, ps), len(ids) // ps - n
        if moving:  # the host copies go now, making room for what the device evicts for them
            self._free_host([self._host_drop(key, nd) for nd in reversed(run)])
        try:
            try:
                short = n - self.allocator.num_free_pages
                if short > 0:
                    self._make_room(short * ps)
            finally:
                self._unlock(handle)
            new = self.allocator.allocate_slots(n * ps)
            self._in_hand.update(self._pages_of(new))
            try:
                self.host.restore(self.kv_cache, self._page_tensor(new), staged)
                res = self.manager.insert_and_match(
                    torch.from_numpy(ids), torch.cat([idx, new]), key
                )
            except BaseException:
                self.allocator.free_slots(new)
                self._in_hand.difference_update(self._pages_of(new))
                raise
            self._in_hand.difference_update(self._pages_of(new))
        except BaseException:
            if moving and run:
                hosted = first + len(run)
                self._return_to_host(key, keys[:hosted], first, staged[: len(run)])
            raise
        self.stats.loaded_pages += len(run)
        self.stats.disk_loaded_pages += n - len(run)
        self.stats.host_hits += bool(run)
        if not moving and run:  # inserted: their host copies are refreshed (or remade)
            hosted = (first + len(run)) * ps
            self._to_host(key, ids[:hosted], new[: len(run) * ps].cpu().numpy(), removed=False)
        return cast(RadixCacheHandle, res.handle), torch.cat([idx, new])

    # ------------------------------------------------------------ the disk
    def _digests(self, key: Hashable, tokens: np.ndarray) -> list[bytes] | None:
        """The disk's names of the whole pages of ``tokens`` under ``key``; ``None`` for a
        namespace the disk cannot write down alike in every process (it stores none of it)."""
        if self.disk is None:
            return None
        try:
            return self.disk.prefix_digests(key, tokens)
        except ValueError:
            return None

    def _to_disk(
        self, key: Hashable, tokens: list[int], page: int | None, device_page: int = -1
    ) -> None:
        """Write host page ``page`` (or, when it is ``None``, device page ``device_page``), the
        last page of prefix ``tokens``, to disk, if its namespace can be named there and it is
        not there already."""
        digests = self._digests(key, np.asarray(tokens, dtype=np.int64))
        if not digests or self.disk is None or self.disk.contains(digests[-1]):
            return
        if page is not None:
            staged = self.host.read(torch.tensor([page], dtype=torch.int64))[0]
        else:
            pool, dp = self.kv_cache, device_page
            kv = [
                torch.stack([pool.k_cache(i)[dp], pool.v_cache(i)[dp]])
                for i in range(pool.num_layers)
            ]
            staged = torch.stack(kv, dim=1).to("cpu")
        if self.disk.put(digests[-1], staged):
            self.stats.disk_saved_pages += 1

    def _make_room(self, size: int) -> None:
        """Evict ``size`` tokens of device leaves to host and free their pages. All or nothing:
        if the allocator refuses them, they go back into the device tree."""
        slots, removed = self._evict(size)
        try:
            self.allocator.free_slots(slots)
        except BaseException:
            self._put_back(removed)
            self._in_hand.difference_update(self._pages_of(slots))
            raise
        self._in_hand.difference_update(self._pages_of(slots))

    def _return_to_host(
        self, key: Hashable, keys: list[PageKey], first: int, staged: torch.Tensor
    ) -> None:
        """A failed write-back load: its prefix's pages ``keys[first:]`` (their K/V ``staged``)
        go back to the host, taking host pages as a copy does (its LRU may give leaves up)."""
        nodes = self.index.ensure_path(key, keys)
        undo = _HostUndo()
        try:
            pages: list[int] = []
            for _ in range(len(keys) - first):
                hp = self._take_host_page(undo)
                if hp is None:  # every host page is an ancestor of this prefix: it cannot stay
                    break
                pages.append(hp)
            self.host.write(torch.tensor(pages, dtype=torch.int64), staged[: len(pages)])
        except BaseException:
            self._roll_back(undo)
            self.index.unpin(nodes)
            raise
        self.stats.host_evicted_pages += len(undo.victims)
        self.stats.lost_pages += len(keys) - first - len(pages)
        for node, hp in zip(nodes[first:], pages, strict=False):
            self._host_set(key, node, hp)
            self._written[hp] = True
        self.index.unpin(nodes)

    def insert_prefix(
        self, input_ids: torch.Tensor, indices: torch.Tensor, extra_key: Hashable = None
    ) -> int:
        """`RadixCacheManager.insert_prefix`; write-through copies the new pages to host."""
        return self.insert_and_match(input_ids, indices, extra_key).cached_len

    def insert_and_match(
        self, input_ids: torch.Tensor, indices: torch.Tensor, extra_key: Hashable = None
    ) -> InsertResult:
        """`RadixCacheManager.insert_and_match`, with the new pages' slots checked first: whole
        pages of the pool, none twice, none the device holds (the device manager does not know
        the pool). Write-back: the new pages' host copies (if any) go, a page lives in one tier
        (inclusive write-back and selective write-through keep them: same prefix, same K/V).
        Write-through: the new pages are copied to host *before* the device insert, the one step
        that cannot be taken back, so that it comes last."""
        self._settle()
        ids = token_ids(input_ids)
        check_extra_key(extra_key)
        slots = slot_array(indices, torch.device(self.device), "indices")
        if len(slots) != len(ids):
            raise ValueError(f"len(indices) ({len(slots)}) must equal len(input_ids) ({len(ids)})")
        ps = self.page_size
        n = len(ids) // ps * ps
        copied: list[HostNode] = []
        if self.policy != "write_through":  # the device manager checks which slots it may take
            self._check_new_slots(slots[:n], whole=False)
        elif n > (m := self._device().match(input_ids, extra_key)):
            self._check_new_slots(slots[m:n], whole=True)
            copied = self._to_host(extra_key, ids[:n], slots[m:n], removed=False)
        try:
            res = self.manager.insert_and_match(input_ids, indices, extra_key)
        except BaseException:  # the copies name pages the device does not hold: they go
            for node in copied:
                self._free_host([self._host_drop(extra_key, node)])
            raise
        if self.policy == "write_back" and self.index.num_pages:
            self._drop_host_copies(extra_key, ids[:n], (n - res.cached_len) // ps)
        return res

    def _check_new_slots(self, slots: np.ndarray, whole: bool) -> None:
        """Slots of pages about to be inserted: in the pool (which the device manager does not
        know); with ``whole``, also what the device manager would refuse (pages copied before
        the insert must be ones it takes): whole aligned pages, each once, none the tree holds.
        ``ValueError`` naming the slots otherwise."""
        ps, limit = self.page_size, self.kv_cache.num_pages
        s = slots.astype(np.int64)
        if len(s) and (s.min() < 0 or s.max() >= limit * ps):
            raise ValueError(f"indices must be slots in [0, {limit * ps}), got {s.tolist()[:16]}")
        if not whole:
            return
        pages = s[::ps] // ps
        if ps > 1 and not np.array_equal(s, (pages[:, None] * ps + np.arange(ps)).ravel()):
            raise ValueError(f"indices must be whole pages of {ps} slots, got {s.tolist()[:16]}")
        if len(np.unique(pages)) != len(pages):
            raise ValueError(f"indices list a page twice: {s.tolist()[:16]}")
        held = pages[self._on_device[pages]]
        if len(held):
            raise ValueError(f"indices name slots the tree holds already: {held.tolist()[:16]}")

    def evict(self, size: int) -> torch.Tensor:
        """Evict device leaves as the device manager would; their K/V are on the host after.

        A failure puts the pages back into the device tree (see the module docstring)."""
        self._settle()
        slots, _ = self._evict(size)
        self._in_hand.difference_update(self._pages_of(slots))  # handed to the caller
        return slots

    def _evict(self, size: int) -> tuple[torch.Tensor, list[BlockRemoved]]:
        """The device evicts ``size`` tokens; each evicted run is copied to host before the
        slots come back (in the tier's hands), with the runs. Selective write-through copies
        nothing here: a page without a host copy is dropped."""
        slots = self.manager.evict(size)
        self._in_hand.update(self._pages_of(slots))
        try:
            events = self.manager.take_events()
        except BaseException:  # the events stay in the log, for the next `_settle`
            self._put_back(self._runs_of(slots))
            self._in_hand.difference_update(self._pages_of(slots))
            raise
        removed = [ev for ev in events if isinstance(ev, BlockRemoved)]
        copy = self.policy != "write_through_selective"
        try:
            for ev in removed:
                toks, at = np.asarray(ev.tokens), np.asarray(ev.slots)
                self._to_host(ev.extra_key, toks, at, removed=True, copy=copy)
        except BaseException:
            self._record(events)
            self._put_back(removed)
            self._in_hand.difference_update(self._pages_of(slots))
            raise
        self._record(events)
        return slots, removed

    def _runs_of(self, slots: torch.Tensor) -> list[BlockRemoved]:
        """The runs the device evicted at ``slots`` (in eviction order), as its events would
        tell them, read from the tier's picture of the device as it was before the eviction."""
        ps = self.page_size
        where = {v[0] // ps: k for k, v in self._device().pages().items()}
        runs: list[BlockRemoved] = []
        for page in self._pages_of(slots):
            key, toks = where[page]
            page_slots = tuple(range(page * ps, (page + 1) * ps))
            if runs and runs[-1].extra_key == key and runs[-1].tokens == toks[:-ps]:
                runs[-1] = BlockRemoved(key, toks, runs[-1].slots + page_slots)  # one node
            else:
                runs.append(BlockRemoved(key, toks, page_slots))
        return runs

    def _put_back(self, removed: list[BlockRemoved]) -> None:
        """Insert evicted runs into the device tree again, parents first, at their old slots
        (their K/V are still there); under write-back their new host copies go."""
        for ev in reversed(removed):
            head = len(ev.tokens) - len(ev.slots)
            tokens = torch.tensor(ev.tokens, dtype=torch.int64)
            _, above = self.manager.match_prefix(tokens[:head], ev.extra_key)
            run = torch.tensor(ev.slots, dtype=torch.int32, device=self.device)
            self.manager.insert_prefix(tokens, torch.cat([above, run]), ev.extra_key)
            if self.policy == "write_back":
                self._drop_host_copies(
                    ev.extra_key, np.asarray(ev.tokens), len(ev.slots) // self.page_size
                )

    def reset(self) -> None:
        """Forget every prefix in both tiers (``RuntimeError``, nothing changed, while locked)."""
        self._settle()
        self.manager.reset()
        self.index.clear()
        self._note("host", AllCleared())
        self.host_allocator.reset()
        self._written[:] = False

    # ------------------------------------------------------------ copies to host
    def _pages_of(self, slots: torch.Tensor) -> list[int]:
        """The pages of ``slots`` (whole pages), as Python ints."""
        pages: list[int] = (slots.cpu().numpy()[:: self.page_size] // self.page_size).tolist()
        return pages

    def _page_tensor(self, slots: torch.Tensor) -> torch.Tensor:
        return torch.div(slots[:: self.page_size], self.page_size, rounding_mode="floor")

    def _free_host(self, pages: list[int]) -> None:
        if pages:
            self.host_allocator.free(torch.tensor(pages))
            self._written[pages] = False

    def _drop_host_copies(self, key: Hashable, tokens: np.ndarray, num_new: int) -> None:
        """Write-back: the last ``num_new`` pages of ``tokens`` are on the device now, so their
        host copies go (one tier per page)."""
        if num_new <= 0:
            return
        keys = page_keys(tokens, self.page_size)
        first = len(keys) - num_new
        nodes = [n for n in reversed(self.index.path(key, keys)[first:]) if n.page is not None]
        self._free_host([self._host_drop(key, n) for n in nodes])

    def _take_host_page(self, undo: _HostUndo) -> int | None:
        """A free host page, evicting the host's LRU leaf when none is free; None if impossible.
        What it takes is written down in ``undo``."""
        if self.host_allocator.num_free_pages:
            page = int(self.host_allocator.allocate(1)[0])
            undo.taken.append(page)
            return page
        leaf = self.index.lru_leaf()
        if leaf is None:
            return None
        key, victim = leaf
        victim_tokens = victim.tokens()  # before the drop cuts it off its path
        if self.disk is not None and victim.page is not None:
            self._to_disk(key, victim_tokens, victim.page)
        page = self._host_drop(key, victim)
        undo.victims.append((key, victim_tokens, page, victim.last_use))
        return page

    def _roll_back(self, undo: _HostUndo) -> None:
        """Give back what `_take_host_page` took: free pages to the free list, leaves (whose
        pages were not written over) to the index, newest first."""
        self._free_host(undo.taken)
        for key, tokens, page, last_use in reversed(undo.victims):
            nodes = self.index.ensure_path(key, page_keys(tokens, self.page_size))
            self._host_set(key, nodes[-1], page)
            nodes[-1].last_use = last_use
            self.index.unpin(nodes)

    def _to_host(
        self,
        key: Hashable,
        tokens: np.ndarray,
        slots: np.ndarray,
        removed: bool,
        copy: bool = True,
    ) -> list[HostNode]:
        """Copy the pages of the run ending ``tokens`` (device ``slots``) to host, parent first;
        returns the nodes that got a host page. Pages already on host are only refreshed;
        with ``copy=False`` no page is copied (selective write-through's eviction).

        A page that finds no host room (every host leaf is one of its ancestors), or is not to
        be copied, is not, nor the rest of the run; when the device just evicted it
        (``removed``), the host pages below it lost their prefix and are dropped too. The host pages are chosen first, then
        saved in one copy; only then does the index record them, so a failed save changes
        nothing on the host.
        """
        ps = self.page_size
        keys = page_keys(tokens, ps)
        first = len(keys) - len(slots) // ps
        nodes = self.index.ensure_path(key, keys)
        undo = _HostUndo()
        copies: list[tuple[HostNode, int, int]] = []  # node, device page, host page
        cut: HostNode | None = None
        j = len(keys)
        try:
            try:
                for j in range(first, len(keys)):
                    node = nodes[j]
                    if node.page is not None:
                        node.last_use = self.index.tick()
                        continue
                    hp = self._take_host_page(undo) if copy else None
                    if hp is None:
                        cut = node if removed else None
                        if not copy:
                            self.stats.dropped_pages += len(keys) - j
                        break
                    copies.append((node, int(slots[(j - first) * ps]) // ps, hp))
                else:
                    j = len(keys)
                if copies:
                    self.host.save(
                        self.kv_cache,
                        torch.tensor([c[1] for c in copies]),
                        torch.tensor([c[2] for c in copies]),
                    )
            except BaseException:
                self._roll_back(undo)
                raise
            # The save is done: the index records it.
            self.stats.host_evicted_pages += len(undo.victims)
            for node, _, hp in copies:
                self._host_set(key, node, hp)
                self._written[hp] = True
            self.stats.saved_pages += len(copies)
            if cut is not None:
                below = self.index.subtree_pages(cut)
                if self.disk is not None and copy:  # what the host cannot hold goes to disk
                    for n in below:
                        self._to_disk(key, n.tokens(), n.page)
                    for i in range(j, len(keys)):
                        dp = int(slots[(i - first) * ps]) // ps
                        self._to_disk(key, tokens[: (i + 1) * ps].tolist(), None, dp)
                lost = [self._host_drop(key, n) for n in below]
                self._free_host(lost)
                self.stats.lost_pages += len(lost)
        finally:
            self.index.unpin(nodes)
        return [c[0] for c in copies]

    # ------------------------------------------------------------ integrity
    def device_prefixes(self) -> dict[Prefix, int]:
        """``(extra_key, prefix tokens through the page) -> device page`` for every cached page."""
        self._settle()
        ps = self.page_size
        return {k: slots[0] // ps for k, slots in self._device().pages().items()}

    def host_prefixes(self) -> dict[Prefix, int]:
        """``(extra_key, prefix tokens through the page) -> host page`` for every host page."""
        return {k: int(p) for k, p in self.index.prefixes().items()}

    def check_integrity(self) -> None:
        """Both tiers, ``RuntimeError`` on the first breach.

        The device tree's own check; the device pages it holds (``cached_indices``) are exactly
        those its events told the tier of, none of them free in the allocator, and no device
        page is left in the tier's hands. The host trie's counts; host pages held = host pages
        not free, none twice, each written by a completed save. Every host page's prefix is
        whole (the page before it is in one tier or the other); with write-back no page is in
        both tiers.
        """
        self._settle()
        self.manager.check_integrity()
        ps = self.page_size
        cached = self.manager.cached_indices().cpu().numpy().astype(np.int64)
        held_dev = np.unique(cached // ps)
        known = np.flatnonzero(self._on_device)
        if not np.array_equal(held_dev, known) or len(cached) != len(held_dev) * ps:
            raise RuntimeError(
                f"the device tree holds pages {held_dev.tolist()[:8]}, its events told of "
                f"{known.tolist()[:8]}"
            )
        free_dev = self.allocator.free_pages().cpu().numpy()
        twice = free_dev[self._on_device[free_dev]]
        if len(twice):
            raise RuntimeError(f"device pages both cached and free: {twice.tolist()[:8]}")
        if self._in_hand:
            raise RuntimeError(f"device pages taken and never placed: {sorted(self._in_hand)[:8]}")
        held = self.index.check()
        if len(set(held)) != len(held):
            raise RuntimeError("a host page is held by two prefixes")
        free = set(self.host_allocator.free_pages().tolist())
        used = set(range(self.host_allocator.num_pages)) - free
        if used != set(held):
            raise RuntimeError(
                f"host pages held {sorted(set(held))[:8]} disagree with those not free {sorted(used)[:8]}"
            )
        blank = [p for p in held if not self._written[p]]
        if blank:
            raise RuntimeError(f"host pages {sorted(blank)[:8]} are named but were never written")
        dev = self.device_prefixes()
        host = self.host_prefixes()
        for key, toks in host:
            up = (key, toks[:-ps])
            if up[1] and up not in dev and up not in host:
                raise RuntimeError(f"host page of prefix {list(toks[:8])}... lost its parent page")
        if self.policy == "write_back":
            both = dev.keys() & host.keys()
            if both:
                raise RuntimeError(
                    f"write-back: a page of prefix {list(next(iter(both))[1][:8])}... is in both tiers"
                )
