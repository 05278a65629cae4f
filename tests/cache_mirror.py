"""The cache-event mirror shared by the event and router tests: a manager's cached set read
through its public API, the replay of its events onto a mirror, and a hypothesis state machine
that checks, after every step, that the replayed events equal the cached set.

``tests/managers/test_events.py`` runs the machine over every manager in `MAKERS`;
``tests/system/test_router.py`` extends it with the router's `PrefixMirror`, and
``tests/system/test_router_faults.py`` reads `cached_pages`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from conftest import ids, slots
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcache import (
    AllCleared,
    BaseCacheHandle,
    BaseCacheManager,
    BlockHashCacheManager,
    BlockRemoved,
    BlockStored,
    CacheEvent,
    RadixCacheManager,
)

Pages = dict[tuple[Hashable, tuple[int, ...]], tuple[int, ...]]
KEYS: list[Hashable] = [None, "a", 3]


def cached_pages(m: BaseCacheManager) -> Pages:
    """The manager's cached set, page by page, from its public API."""
    ps, out = m.page_size, {}
    if isinstance(m, RadixCacheManager):
        for key in m.roots:
            path: dict[int, list[int]] = {}
            for node in m.nodes(key):
                if node.parent is None:
                    path[node.uuid] = []
                    continue
                toks = path[node.parent.uuid] + node.key.tolist()
                path[node.uuid] = toks
                vals, start = node.value.tolist(), len(toks) - node.length
                for j in range(0, node.length, ps):
                    out[(key, tuple(toks[: start + j + ps]))] = tuple(vals[j : j + ps])
        return out
    assert isinstance(m, BlockHashCacheManager)
    for b in m.blocks():
        toks, up = list(b.tokens), b
        while up.parent_hash is not None:
            up = m.get_block(up.parent_hash)  # type: ignore[assignment]
            toks = list(up.tokens) + toks
        out[(b.extra_key, tuple(toks))] = tuple(range(b.page * ps, (b.page + 1) * ps))
    return out


def replay(mirror: Pages, events: list[CacheEvent], ps: int) -> None:
    """Apply ``events`` to ``mirror``; a store of a page already there, or a removal of one that
    is not (or with other slots), fails."""
    for ev in events:
        if isinstance(ev, AllCleared):
            mirror.clear()
            continue
        assert isinstance(ev, BlockStored | BlockRemoved)
        assert len(ev.slots) % ps == 0 and len(ev.tokens) % ps == 0 and ev.slots
        start = len(ev.tokens) - len(ev.slots)
        for j in range(0, len(ev.slots), ps):
            k = (ev.extra_key, ev.tokens[: start + j + ps])
            page = ev.slots[j : j + ps]
            if isinstance(ev, BlockStored):
                assert k not in mirror, f"stored twice: {k}"
                mirror[k] = page
            else:
                assert mirror.pop(k) == page, f"removed with other slots: {k}"


Logging = RadixCacheManager | BlockHashCacheManager
MAKERS: dict[str, Callable[[], Logging]] = {
    "radix-1": lambda: RadixCacheManager(page_size=1, events=True),
    "radix-2": lambda: RadixCacheManager(page_size=2, events=True),
    "block-2": lambda: BlockHashCacheManager(page_size=2, events=True),
    "block-1-weak-hash": lambda: BlockHashCacheManager(
        page_size=1, hash_fn=lambda p, t: t[0] % 2, events=True
    ),
}


class EventMirror(RuleBasedStateMachine):
    make = "radix-1"

    def __init__(self) -> None:
        super().__init__()
        self.m = MAKERS[self.make]()
        self.ps = self.m.page_size
        self.mirror: Pages = {}
        self.locked: list[BaseCacheHandle] = []
        self.next_page = 0

    @rule(key=st.sampled_from(KEYS), toks=st.lists(st.integers(0, 2), max_size=10))
    def insert(self, key: Hashable, toks: list[int]) -> None:
        n = len(toks)
        pages = -(-n // self.ps)
        base = self.next_page * self.ps
        self.next_page += pages
        self.m.insert_prefix(ids(*toks), slots(*range(base, base + n)), extra_key=key)

    @rule(key=st.sampled_from(KEYS), toks=st.lists(st.integers(0, 2), max_size=10))
    def match_and_lock(self, key: Hashable, toks: list[int]) -> None:
        handle, _ = self.m.match_prefix(ids(*toks), extra_key=key)  # may split a radix node
        self.m.lock_handle(handle)
        self.locked.append(handle)

    @precondition(lambda self: self.locked)
    @rule(i=st.integers(0, 99))
    def unlock(self, i: int) -> None:
        self.m.lock_handle(self.locked.pop(i % len(self.locked)), unlock=True)

    @rule(frac=st.floats(0, 1))
    def evict(self, frac: float) -> None:
        self.m.evict(int(self.m.size_info.evictable_size * frac))

    @rule()
    def reset(self) -> None:
        for h in self.locked:
            self.m.lock_handle(h, unlock=True)
        self.locked.clear()
        self.m.reset()

    @invariant()
    def mirror_equals_cache(self) -> None:
        replay(self.mirror, self.m.take_events(), self.ps)
        assert self.mirror == cached_pages(self.m)
        assert self.m.take_events() == []  # the log was emptied
        self.m.check_integrity()
