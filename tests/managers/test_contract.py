"""The contract every prefix-cache manager keeps, run over every manager through one fixture.

The managers are the ones the package registers (`SUPPORTED_CACHE_MANAGER`: a new registration
joins these tests by itself) at page sizes 1 and 16, and the host tier (`TieredCacheManager`,
a manager too) at both sizes. What `BaseCacheManager` and ``API.md`` promise, checked on each:

- a match on an empty cache (or of no ids) finds nothing: an empty int32 tensor on the device;
- after an insert, a match returns the inserted page-aligned prefix at the inserted slots, and
  the insert returns the length that was already cached;
- a locked prefix is never evicted; an unlock of a handle that is not locked is refused;
- ``evict(n)`` frees at least ``n`` and at most the evictable tokens, and returns their slots;
  ``evict(0)`` is empty; more than the evictable is refused;
- ``size_info`` adds up: ``total_size`` is the number of cached slots, ``protected_size`` the
  tokens of the locked prefixes;
- ``check_integrity`` passes after every step, and bad input is refused with the manager
  unchanged (conftest's `unchanged`).

`ManagerContract` checks all of these after every step of random interleavings against a plain
reference (a dict from each cached page's prefix to its slots), with the test as the caller that
owns every slot a manager does not: it allocates slots from a `PageAllocator`, frees the ones an
insert leaves it and the ones evict returns, so the free pages and the cached ones must always
be all the pages. The naive manager caches nothing; the tier keeps what it evicts on the host
and loads it back on a later match (at new slots), which the reference follows.
What is particular to one manager (the radix tree's splits and policies, block hashes and their
collisions, the tier's write policies) stays in that manager's own tests.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import pytest
import torch
from conftest import ids, param_id, slots
from conftest import unchanged as watch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcache import (
    SUPPORTED_CACHE_MANAGER,
    BaseCacheHandle,
    BaseCacheManager,
    KVCacheLayout,
    MHAKVCache,
    PageAllocator,
    RadixCacheManager,
    TieredCacheManager,
    create_cache_manager,
)

NUM_PAGES = 48

Page = tuple[Hashable, tuple[int, ...]]  # (namespace, tokens from the start through the page)


@dataclass(frozen=True)
class Case:
    """One manager to hold to the contract: its name, page size, and how it is built on the
    test's allocator."""

    name: str
    page_size: int
    build: Callable[[PageAllocator], BaseCacheManager]

    @property
    def caches(self) -> bool:
        return self.name != "naive"

    @property
    def tiered(self) -> bool:
        return self.name == "tiered"

    def __repr__(self) -> str:
        return f"{self.name}-{self.page_size}"


def _registered(name: str, ps: int) -> Callable[[PageAllocator], BaseCacheManager]:
    return lambda alloc: create_cache_manager("cpu", name, page_size=ps)


def _tiered(ps: int) -> Callable[[PageAllocator], BaseCacheManager]:
    def build(alloc: PageAllocator) -> BaseCacheManager:
        pool = MHAKVCache(1, 1, 2, NUM_PAGES, torch.float32, KVCacheLayout.LayerFirst, "cpu", ps)
        device = RadixCacheManager(page_size=ps, events=True)
        return TieredCacheManager(device, pool, alloc, host_pages=4 * NUM_PAGES)

    return build


CASES = [
    Case(name, ps, _registered(name, ps))
    for name in SUPPORTED_CACHE_MANAGER.supported_names()
    for ps in (1, 16)
] + [Case("tiered", ps, _tiered(ps)) for ps in (1, 16)]


@dataclass
class Setup:
    case: Case
    m: BaseCacheManager
    alloc: PageAllocator

    def take(self, n: int) -> torch.Tensor:
        """Slots for ``n`` tokens on fresh pages (the caller owns them until a manager takes
        them)."""
        return self.alloc.allocate_slots(n)

    def give_back(self, s: torch.Tensor) -> None:
        """Return the pages of caller-owned slots ``s`` to the allocator."""
        if len(s):
            pages = sorted({int(x) // self.case.page_size for x in s.tolist()})
            self.alloc.free(torch.tensor(pages, dtype=torch.int32))

    def insert(self, toks: list[int], key: Hashable = None) -> tuple[int, torch.Tensor]:
        """Insert ``toks`` at fresh slots as a flow would, freeing what the manager leaves the
        caller; the length already cached and the slots given."""
        s = self.take(len(toks))
        cached = self.m.insert_prefix(ids(*toks), s, extra_key=key)
        if not self.case.caches:
            self.give_back(s)
        else:
            aligned = len(toks) // self.case.page_size * self.case.page_size
            self.give_back(s[:cached])
            self.give_back(s[aligned:])
        return cached, s


@pytest.fixture(params=CASES, ids=param_id)
def setup(request: pytest.FixtureRequest) -> Setup:
    """A fresh, empty manager of each case, on an allocator of `NUM_PAGES` pages."""
    case: Case = request.param
    alloc = PageAllocator(NUM_PAGES, case.page_size)
    return Setup(case, case.build(alloc), alloc)


def page_tokens(pages: list[int], ps: int, tail: int = 0) -> list[int]:
    """Token ids of whole pages (page ``i`` holds ``ps`` tokens derived from ``pages[i]``, so
    two pages differ by the symbol, and at page size 1 token by token) and a partial tail."""
    return [s * 10 + j % 3 for s in pages for j in range(ps)] + [7] * tail


# --------------------------------------------------------------------------- examples
def test_a_match_on_an_empty_cache_finds_nothing(setup: Setup) -> None:
    m = setup.m
    for toks in ([], page_tokens([1, 2], setup.case.page_size, 3)):
        handle, idx = m.match_prefix(ids(*toks))
        assert handle.cached_len == 0 and idx.dtype == torch.int32 and idx.shape == (0,)
        assert idx.device == torch.device(m.device)
    assert m.size_info == (0, 0) and m.size_info.total_size == 0
    assert len(m.cached_indices()) == 0
    m.check_integrity()


def test_an_insert_then_a_match_returns_the_prefix(setup: Setup) -> None:
    m, ps = setup.m, setup.case.page_size
    toks = page_tokens([1, 2], ps, tail=ps - 1)
    cached, s = setup.insert(toks)
    if not setup.case.caches:
        assert cached == len(toks) and m.match_prefix(ids(*toks))[0].cached_len == 0
        return
    assert cached == 0
    handle, idx = m.match_prefix(ids(*toks))
    assert handle.cached_len == 2 * ps and torch.equal(idx, s[: 2 * ps])
    assert m.size_info == (2 * ps, 0)
    # inserted again: all of it was cached, the manager takes nothing
    assert setup.insert(toks)[0] == 2 * ps
    assert sorted(m.cached_indices().tolist()) == sorted(s[: 2 * ps].tolist())
    # a longer prompt shares the first page; another namespace shares nothing
    assert m.match_prefix(ids(*page_tokens([1, 3], ps)))[0].cached_len == ps
    assert m.match_prefix(ids(*toks), extra_key="other")[0].cached_len == 0
    m.check_integrity()


def test_a_locked_prefix_is_not_evicted(setup: Setup, unchanged: type) -> None:
    m, ps = setup.m, setup.case.page_size
    setup.insert(page_tokens([1, 2], ps))
    setup.insert(page_tokens([5], ps))
    handle, idx = m.match_prefix(ids(*page_tokens([1, 2], ps)))
    m.lock_handle(handle)
    protected = 2 * ps if setup.case.caches else 0
    assert m.size_info.protected_size == protected
    out = m.evict(m.size_info.evictable_size)
    assert not set(out.tolist()) & set(idx.tolist())
    setup.give_back(out)
    assert m.size_info == (0, protected)
    with unchanged(m), pytest.raises((RuntimeError, NotImplementedError)):
        m.evict(1)
    again, idx2 = m.match_prefix(ids(*page_tokens([1, 2], ps)))
    assert again.cached_len == handle.cached_len and torch.equal(idx2, idx)
    m.lock_handle(handle, unlock=True)
    assert m.size_info == (protected, 0)
    with unchanged(m), pytest.raises(RuntimeError):
        m.lock_handle(handle, unlock=True)  # unlocked as often as locked
    m.check_integrity()


def test_evict_frees_what_it_is_asked_and_returns_the_slots(setup: Setup, unchanged: type) -> None:
    m, ps = setup.m, setup.case.page_size
    empty = m.evict(0)
    assert empty.shape == (0,) and empty.dtype == torch.int32
    for symbol in range(3):
        setup.insert(page_tokens([symbol, symbol], ps))
    evictable = m.size_info.evictable_size
    with unchanged(m), pytest.raises((RuntimeError, NotImplementedError)):
        m.evict(evictable + 1)
    if not setup.case.caches:
        return
    before = set(m.cached_indices().tolist())
    out = m.evict(1)
    assert 1 <= len(out) <= evictable and len(set(out.tolist())) == len(out)
    assert set(out.tolist()) <= before and not set(out.tolist()) & set(m.cached_indices().tolist())
    assert m.size_info.total_size == len(before) - len(out)
    setup.give_back(out)
    m.check_integrity()


BAD_CALLS: list[tuple[str, Callable[[BaseCacheManager, int], object], type[Exception]]] = [
    (
        "insert: lengths differ",
        lambda m, ps: m.insert_prefix(ids(*range(ps + 1)), slots(0)),
        ValueError,
    ),
    ("insert: 2-D ids", lambda m, ps: m.insert_prefix(ids(1).view(1, 1), slots(0)), ValueError),
    ("insert: float ids", lambda m, ps: m.insert_prefix(torch.ones(1), slots(0)), TypeError),
    ("insert: a list", lambda m, ps: m.insert_prefix([1], slots(0)), TypeError),
    ("insert: unhashable key", lambda m, ps: m.insert_prefix(ids(1), slots(0), []), TypeError),
    ("match: float ids", lambda m, ps: m.match_prefix(torch.ones(2)), TypeError),
    ("match: 2-D ids", lambda m, ps: m.match_prefix(ids(1, 2).view(1, 2)), ValueError),
    ("match: unhashable key", lambda m, ps: m.match_prefix(ids(1), []), TypeError),
    ("evict: negative", lambda m, ps: m.evict(-1), ValueError),
    ("evict: a float", lambda m, ps: m.evict(1.5), TypeError),
    ("lock: not a handle", lambda m, ps: m.lock_handle(None), TypeError),
]


@pytest.mark.parametrize(("what", "call", "error"), BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_is_refused_and_changes_nothing(
    setup: Setup,
    unchanged: type,
    what: str,
    call: Callable[[BaseCacheManager, int], object],
    error: type[Exception],
) -> None:
    m, ps = setup.m, setup.case.page_size
    setup.insert(page_tokens([1, 2], ps))
    m.lock_handle(m.match_prefix(ids(*page_tokens([1], ps)))[0])
    with unchanged(m), pytest.raises(error):
        call(m, ps)
    m.check_integrity()


# --------------------------------------------------------------------------- state machine
class ManagerContract(RuleBasedStateMachine):
    """Random inserts, matches, locks, unlocks, evictions and resets under two namespaces, each
    checked against a dict of cached pages, with every promise of the contract checked after
    every step."""

    case: Case = CASES[0]

    def __init__(self) -> None:
        super().__init__()
        alloc = PageAllocator(NUM_PAGES, self.case.page_size)
        self.s = Setup(self.case, self.case.build(alloc), alloc)
        self.m, self.ps = self.s.m, self.case.page_size
        self.ref: dict[Page, tuple[int, ...] | None] = {}  # None: on the tier's host
        self.locked: list[tuple[BaseCacheHandle, set[Page]]] = []
        self.released: list[BaseCacheHandle] = []

    # ------------------------------------------------------------ the reference
    def pages_of(self, key: Hashable, toks: list[int], n: int) -> list[Page]:
        return [(key, tuple(toks[: j + self.ps])) for j in range(0, n, self.ps)]

    def longest(self, key: Hashable, toks: list[int], device_only: bool) -> int:
        n = 0
        for page in self.pages_of(key, toks, len(toks) // self.ps * self.ps):
            if page not in self.ref or (device_only and self.ref[page] is None):
                break
            n += self.ps
        return n

    def check_match(self, key: Hashable, toks: list[int]) -> BaseCacheHandle:
        free_before = self.s.alloc.num_free_pages
        on_device = self.longest(key, toks, device_only=True)
        anywhere = self.longest(key, toks, device_only=False)
        handle, idx = self.m.match_prefix(ids(*toks), extra_key=key)
        n = handle.cached_len
        assert len(idx) == n and idx.dtype == torch.int32 and n % self.ps == 0
        if not self.case.caches:
            assert n == 0
            return handle
        if self.case.tiered and free_before >= -(-len(toks) // self.ps):
            assert n == anywhere  # room for all of it: the host's pages are loaded
        else:
            assert n in (on_device, anywhere) if self.case.tiered else n == on_device
        got = idx.tolist()
        for j, page in enumerate(self.pages_of(key, toks, n)):
            mine = tuple(got[j * self.ps : (j + 1) * self.ps])
            if self.ref[page] is None:  # loaded back from the host, at fresh slots
                self.ref[page] = mine
            assert self.ref[page] == mine, (page, self.ref[page], mine)
        if self.case.tiered:  # a load may have evicted device leaves to the host
            cached = set(self.m.cached_indices().tolist())
            for page, at in self.ref.items():
                if at is not None and at[0] not in cached:
                    self.ref[page] = None
        return handle

    # ------------------------------------------------------------ rules
    pages = st.lists(st.integers(0, 2), max_size=4)

    @rule(key=st.sampled_from([None, "a"]), pages=pages, tail=st.integers(0, 2))
    def insert(self, key: Hashable, pages: list[int], tail: int) -> None:
        toks = page_tokens(pages, self.ps, tail)
        if self.s.alloc.num_free_pages < -(-len(toks) // self.ps):
            return
        expected = self.longest(key, toks, device_only=True)
        cached, s = self.s.insert(toks, key)
        if not self.case.caches:
            assert cached == len(toks)
            return
        assert cached == expected
        got = s.tolist()
        for page in self.pages_of(key, toks, len(toks) // self.ps * self.ps)[cached // self.ps :]:
            j = len(page[1]) - self.ps
            self.ref[page] = tuple(got[j : j + self.ps])

    @rule(key=st.sampled_from([None, "a"]), pages=pages, tail=st.integers(0, 2))
    def match(self, key: Hashable, pages: list[int], tail: int) -> None:
        self.check_match(key, page_tokens(pages, self.ps, tail))

    @rule(key=st.sampled_from([None, "a"]), pages=pages)
    def lock(self, key: Hashable, pages: list[int]) -> None:
        toks = page_tokens(pages, self.ps)
        handle = self.check_match(key, toks)
        self.m.lock_handle(handle)
        self.locked.append((handle, set(self.pages_of(key, toks, handle.cached_len))))

    @precondition(lambda self: self.locked)
    @rule(i=st.integers(0, 99))
    def unlock(self, i: int) -> None:
        handle, _ = self.locked.pop(i % len(self.locked))
        self.m.lock_handle(handle, unlock=True)
        self.released.append(handle)

    @precondition(lambda self: self.released)
    @rule(i=st.integers(0, 99))
    def unlock_again(self, i: int) -> None:
        handle = self.released[i % len(self.released)]
        if any(h is handle or h == handle for h, _ in self.locked):
            return  # still locked, itself or (block hash) through an equal handle
        with watch(self.m), pytest.raises(RuntimeError):
            self.m.lock_handle(handle, unlock=True)

    @rule(frac=st.floats(0, 1))
    def evict(self, frac: float) -> None:
        info = self.m.size_info
        n = int(info.evictable_size * frac)
        before = set(self.m.cached_indices().tolist())
        out = self.m.evict(n)
        got = out.tolist()
        assert out.dtype == torch.int32 and len(set(got)) == len(got)
        assert n <= len(got) <= info.evictable_size or n == len(got) == 0
        assert set(got) <= before
        held = {s for h, _ in self.locked for s in self.m.handle_indices(h).tolist()}
        assert not held & set(got), "a locked slot was evicted"
        assert self.m.size_info == (info.evictable_size - len(got), info.protected_size)
        gone = {page for page, at in self.ref.items() if at is not None and at[0] in set(got)}
        assert sum(len(self.ref[p] or ()) for p in gone) == len(got)
        for page in gone:
            if self.case.tiered:
                self.ref[page] = None  # on the host now
            else:
                del self.ref[page]
        if not self.case.tiered:  # only leaves go: what stays never lost a page before it
            for key, toks in self.ref:
                assert all((key, toks[:j]) in self.ref for j in range(self.ps, len(toks), self.ps))
        self.s.give_back(out)

    @rule(more=st.integers(1, 3))
    def evict_too_much(self, more: int) -> None:
        with watch(self.m), pytest.raises((RuntimeError, NotImplementedError)):
            self.m.evict(self.m.size_info.evictable_size + more)

    @rule()
    def reset(self) -> None:
        if self.case.caches and any(pages for _, pages in self.locked):
            with watch(self.m), pytest.raises(RuntimeError):
                self.m.reset()
            return
        held = self.m.cached_indices()
        self.m.reset()
        self.s.give_back(held)
        self.ref.clear()
        if self.case.caches:  # a reset forgets the handles too (locks of nothing included)
            self.locked.clear()
            self.released.clear()

    # ------------------------------------------------------------ invariants
    @invariant()
    def sizes_add_up_and_nothing_is_lost(self) -> None:
        self.m.check_integrity()
        info, cached = self.m.size_info, self.m.cached_indices().tolist()
        assert info.evictable_size >= 0 and info.total_size == len(cached)
        on_device = sorted(s for at in self.ref.values() if at is not None for s in at)
        assert sorted(cached) == on_device
        locked_pages = set().union(*(pages for _, pages in self.locked))
        assert info.protected_size == (len(locked_pages) * self.ps if self.case.caches else 0)
        # the caller holds nothing between steps: every page is free or cached, none twice
        assert self.s.alloc.num_free_pages + len(cached) // self.ps == NUM_PAGES


@pytest.mark.parametrize("case", CASES, ids=param_id)
def test_every_manager_keeps_the_contract_at_every_step(case: Case) -> None:
    machine = type(f"ManagerContract_{case!r}", (ManagerContract,), {"case": case})
    machine.TestCase.settings = settings(
        max_examples=30, stateful_step_count=30, deadline=None, derandomize=True
    )
    machine.TestCase().runTest()
