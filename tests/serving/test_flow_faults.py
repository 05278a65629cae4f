"""`RequestFlow` is all or nothing when anything it calls raises (issue 27, item 1).

Every public method of the flow, on a flow holding cached prefixes and running requests in a
pool tight enough that new pages take an eviction, is run once per call it makes to its
dependencies (the manager's methods and properties, the allocator's, the ``on_event``
consumer), with that call raising `RuntimeError`, then `KeyboardInterrupt` (`faults_proxy.Faults`).
Over every manager (naive, radix, block hash), page sizes 1 and 16, a traced and an untraced
flow. After each failure:

- the error that propagates is the injected one;
- ``check_integrity`` of the flow and of the manager pass, and free + cached + held = the pool;
- the state is the state before the call (exactly: `conftest.observe`), or the state a
  successful call leaves (the call completed after an interrupted call it must make, or its
  events' consumer raised; if making the events raised, without them), or, for `begin`, `begin_batch`, `extend` and `extend_batch`, the
  documented partial result: the state before, but for an eviction made before the failure
  (the evicted prefixes gone, their pages at the end of the free list) and the match's LRU
  refresh;
- K/V read back: the slots of every running request's computed tokens and of every cached
  prefix hold the marker stored for exactly those tokens, after every free page is overwritten
  (a page that changed hands shows up); a fresh request reads back its prefix's markers, and
  every running request still finishes.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from conftest import observe
from faults_proxy import Faults

from kvcache import (
    BaseCacheManager,
    BlockHashCacheManager,
    FlowEvent,
    NaiveCacheManager,
    PageAllocator,
    RadixCacheManager,
    Request,
    RequestFlow,
)

#: The calls of a manager and of an allocator that a fault can hit (every public one).
MANAGER_CALLS = (
    "match_prefix",
    "match_and_lock",
    "lock_handle",
    "insert_prefix",
    "insert_and_match",
    "insert_and_unlock",
    "evict",
    "reset",
    "size_info",
    "check_integrity",
    "cached_indices",
    "handle_indices",
)
ALLOCATOR_CALLS = (
    "allocate",
    "allocate_slots",
    "allocate_host_slots",
    "allocate_page_slots",
    "free",
    "free_slots",
    "free_page_runs",
    "free_page_start",
    "free_pages",
    "num_free_pages",
    "pages_to_slots",
    "slots_to_pages",
    "reset",
)
ERRORS = (RuntimeError, KeyboardInterrupt)
SENTINEL = -1.0
_MASK = (1 << 52) - 1


def code(prefix: tuple[int, ...]) -> float:
    """The K/V marker of the last token of ``prefix`` (a function of every token up to it)."""
    return float(hash(prefix) & _MASK)


def t(seq: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(seq, dtype=torch.int64)


class World:
    """A flow over a ``kind`` manager at page size ``ps``: ``X`` finished (cached), ``Y`` running
    on ``X``'s first two pages, twins of ``W`` (``a`` finished, ``b`` running with duplicate
    pages), ``Z`` running with a partial last page; two free pages (six for the naive manager,
    which has nothing to evict). ``kv``: the marker stored at each slot (a slot table standing in
    for the pool). ``idle``: every request finished, for `reset_prefix_cache`."""

    def __init__(self, kind: str, ps: int, traced: bool, idle: bool = False) -> None:
        u = ps
        self.ps = ps
        self.X = tuple(range(100, 100 + 3 * u + 1))
        self.Y = self.X[: 2 * u] + tuple(range(200, 200 + u + 2))
        self.W = tuple(range(300, 300 + 2 * u + 1))
        self.Z = tuple(range(400, 400 + 2 * u + 1))
        self.V = tuple(range(500, 500 + 4 * u))
        self.V2 = tuple(range(600, 600 + u))
        self.XE = (*self.X, 700)
        self.ZE = tuple(range(800, 800 + 3 * u + 1))
        self.YE = (900,)
        self.faults: Faults | None = None
        self.manager = self._manager(kind, ps)
        num_pages = _pool_pages(kind, ps)
        self.allocator = PageAllocator(num_pages, ps)
        self.flow = RequestFlow(
            self.manager, self.allocator, trace=traced, on_event=self._consume if traced else None
        )
        self.kv = np.full(num_pages * ps, SENTINEL)
        self.req: dict[str, Request] = {}
        flow = self.flow
        x = flow.begin(t(self.X))
        self.store(x)
        flow.finish(x)
        self.req["y"] = flow.begin(t(self.Y))
        self.store(self.req["y"], 3 * u)
        a, self.req["b"] = flow.begin(t(self.W)), flow.begin(t(self.W))
        self.store(a)
        self.store(self.req["b"])
        flow.finish(a)
        self.req["z"] = flow.begin(t(self.Z))
        self.store(self.req["z"])
        if idle:
            for r in list(flow.running.values()):
                self.store(r)
                flow.finish(r)

    @staticmethod
    def _manager(kind: str, ps: int) -> BaseCacheManager:
        if kind == "naive":
            return NaiveCacheManager(page_size=ps)
        if kind == "radix":
            return RadixCacheManager(page_size=ps)
        return BlockHashCacheManager(page_size=ps)

    def _consume(self, event: FlowEvent) -> None:
        if self.faults is not None:
            self.faults.tick("on_event")

    def store(self, req: Request, n: int | None = None) -> None:
        """Step 6: the markers of ``req``'s tokens up to ``n`` (default: all), then mark_computed."""
        n = len(req) if n is None else n
        ids = tuple(req.input_ids.tolist())
        for i in range(req.num_computed, n):
            self.kv[int(req.indices[i])] = code(ids[: i + 1])
        self.flow.mark_computed(req, n)

    def prompts(self) -> list[tuple[int, ...]]:
        """Every prompt the scenarios use, and every running request's tokens."""
        fixed = [self.X, self.Y, self.W, self.Z, self.V, self.V2, self.XE]
        return fixed + [tuple(r.input_ids.tolist()) for r in self.flow.running.values()]

    def inject(self, faults: Faults) -> None:
        self.faults = faults
        self.flow.manager = faults.wrap(self.manager, MANAGER_CALLS, "manager")
        self.flow.allocator = faults.wrap(self.allocator, ALLOCATOR_CALLS, "allocator")

    def restore(self) -> None:
        self.faults = None
        self.flow.manager = self.manager
        self.flow.allocator = self.allocator


def _pool_pages(kind: str, ps: int) -> int:
    """Pages the world holds after its set-up (measured once on a roomy pool), plus the free
    ones: two, or six for the naive manager, which has nothing to evict."""
    key = (kind, ps)
    if key not in _POOLS:
        _POOLS[key] = 4096  # roomy, for the measuring run
        w = World(kind, ps, traced=False)
        used = w.allocator.num_pages - w.allocator.num_free_pages
        _POOLS[key] = used + (6 if kind == "naive" else 2)
    return _POOLS[key]


_POOLS: dict[tuple[str, int], int] = {}


def content(w: World) -> Any:
    """What the flow, the manager and the allocator hold, compared across two worlds: the
    cache's prefixes (matched on a copy: no LRU refresh), its eviction order (evicting all of a
    copy), its sizes and locks, the free list in order, the running requests, stats, events."""
    m = w.manager
    probe = copy.deepcopy(m)
    cached = {p: probe.match_prefix(t(p))[1].tolist() for p in w.prompts()}
    emptied = copy.deepcopy(m)
    order = (
        emptied.evict(emptied.size_info.evictable_size).tolist()
        if m.size_info.evictable_size
        else []
    )
    locks = (
        m.num_locked_handles
        if isinstance(m, RadixCacheManager)
        else len(m.locked_handles())
        if isinstance(m, BlockHashCacheManager)
        else None
    )
    running = {
        rid: (
            r.input_ids.tolist(),
            r.indices.tolist(),
            r.num_computed,
            r.tree_len,
            r.reused_len,
            r.finished,
        )
        for rid, r in w.flow.running.items()
    }
    return {
        "cached": cached,
        "order": order,
        "size": m.size_info,
        "slots": sorted(m.cached_indices().tolist()),
        "locks": locks,
        "free": w.allocator.free_pages().tolist(),
        "running": running,
        "stats": dataclasses.astuple(w.flow.stats),
        "events": list(w.flow.events),
    }


def evicted_only(before: Any, after: Any, ps: int) -> bool:
    """``after`` is ``before`` but for an eviction: cached slots gone, their pages appended to
    the free list, the eviction counted; the match's LRU refresh aside, nothing else."""
    lost = set(before["slots"]) - set(after["slots"])
    if not set(after["slots"]) <= set(before["slots"]):
        return False
    n = len(before["free"])
    stats_b, stats_a = list(before["stats"]), list(after["stats"])
    ev_b, ev_a = stats_b[4:], stats_a[4:]  # evicted_tokens, evictions
    return (
        after["free"][:n] == before["free"]
        and sorted(after["free"][n:]) == sorted({s // ps for s in lost})
        and stats_a[:4] == stats_b[:4]
        and ev_a == ([ev_b[0] + len(lost), ev_b[1] + 1] if lost else ev_b)
        and after["running"] == before["running"]
        and after["size"].protected_size == before["size"].protected_size
        and after["locks"] == before["locks"]
        and after["events"] == before["events"]
        and all(
            after["cached"][p] == before["cached"][p][: len(after["cached"][p])]
            for p in before["cached"]
            if p in after["cached"]
        )
    )


def check_whole(w: World) -> None:
    """Integrity, the page accounting and the K/V markers of everything held; then a fresh
    request reads its prefix back, and every running request still finishes."""
    flow, m, a, ps = w.flow, w.manager, w.allocator, w.ps
    flow.check_integrity()
    m.check_integrity()
    held = sum(-(-(len(r) - r.tree_len) // ps) for r in flow.running.values())
    assert a.num_free_pages + m.size_info.total_size // ps + held == a.num_pages
    check_kv(w)
    for p in (w.X, w.W, w.Y):
        try:
            r = flow.begin(t(p))
        except RuntimeError as e:  # a pool too full for it: nothing taken, fine
            assert "out of KV pages" in str(e)
            continue
        read_back(w, r, r.tree_len)
        flow.abort(r)
    for r in list(flow.running.values()):
        w.store(r)
        flow.finish(r)
    flow.check_integrity()
    assert a.num_free_pages + m.size_info.total_size // ps == a.num_pages
    check_kv(w)


def read_back(w: World, r: Request, n: int) -> None:
    ids = tuple(r.input_ids.tolist())
    got = [w.kv[int(s)] for s in r.indices[:n].tolist()]
    assert got == [code(ids[: i + 1]) for i in range(n)], f"request {r.rid} reads wrong K/V"


def check_kv(w: World) -> None:
    free = w.allocator.pages_to_slots(w.allocator.free_pages())
    w.kv[free.numpy()] = SENTINEL  # a free page may be overwritten by anyone at any time
    for r in w.flow.running.values():
        read_back(w, r, r.num_computed)
    probe = copy.deepcopy(w.manager)
    for p in w.prompts():
        _, slots = probe.match_prefix(t(p))
        got = [w.kv[s] for s in slots.tolist()]
        assert got == [code(p[: i + 1]) for i in range(len(got))], (
            f"cached {p[:4]}... reads wrong K/V"
        )


OPS: dict[str, tuple[Callable[[World], Any], bool]] = {
    # name -> (the call, whether it documents an eviction and LRU refresh as a partial result)
    "begin": (lambda w: w.flow.begin(t(w.V)), True),
    "begin_compute_last": (lambda w: w.flow.begin(t(w.XE), compute_last=True), True),
    "begin_batch": (lambda w: w.flow.begin_batch([t(w.V), t(w.V2)]), True),
    "extend": (lambda w: w.flow.extend(w.req["z"], t(w.ZE)), True),
    "extend_batch": (
        lambda w: w.flow.extend_batch([w.req["y"], w.req["z"]], [t(w.YE), t(w.ZE)]),
        True,
    ),
    "mark_computed": (lambda w: w.store(w.req["y"]), False),
    "cache": (lambda w: w.flow.cache(w.req["y"]), False),
    "cache_duplicates": (lambda w: w.flow.cache(w.req["b"]), False),
    "finish": (lambda w: w.flow.finish(w.req["z"]), False),
    "finish_duplicates": (lambda w: w.flow.finish(w.req["b"]), False),
    "abort": (lambda w: w.flow.abort(w.req["y"]), False),
    "reset_prefix_cache": (lambda w: w.flow.reset_prefix_cache(), False),
    "available_pages": (lambda w: w.flow.available_pages(), False),
    "pages_needed": (lambda w: w.flow.pages_needed(w.req["z"], 3 * w.ps), False),
    "check_integrity": (lambda w: w.flow.check_integrity(), False),
}


@pytest.mark.parametrize("traced", [False, True], ids=["untraced", "traced"])
@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("kind", ["naive", "radix", "block"])
@pytest.mark.parametrize("op", list(OPS))
def test_a_failing_dependency_leaves_the_flow_whole(op: str, kind: str, ps: int, traced: bool):
    call, partial = OPS[op]
    idle = op == "reset_prefix_cache"

    def world() -> World:
        return World(kind, ps, traced, idle=idle)

    ok = world()
    before = content(ok)
    dry = Faults()
    ok.inject(dry)
    call(ok)
    ok.restore()
    done = content(ok)
    if not dry.calls:  # pages_needed, an untraced mark_computed: nothing to fail
        assert op == "pages_needed" or (not traced and op == "mark_computed")
        return
    if op in ("begin", "begin_batch", "extend", "extend_batch") and kind != "naive":
        assert done["stats"][5] > before["stats"][5], f"{op} was meant to evict"
    if traced and op not in ("available_pages", "pages_needed", "check_integrity", "abort"):
        assert "on_event" in dry.calls or op == "reset_prefix_cache"
    for n, name in enumerate(dry.calls):
        for error in ERRORS:
            w = world()
            exact = observe(w.flow)
            faults = Faults(fail_at=n, error=error)
            w.inject(faults)
            try:
                call(w)
            except BaseException as e:  # KeyboardInterrupt too: it is one of the faults
                assert e is faults.raised, f"call {n} ({name}): {e!r} is not the injected fault"
            else:
                raise AssertionError(f"call {n} ({name}) raised {error.__name__}: swallowed")
            finally:
                w.restore()
            after = content(w)
            where = f"{op}: call {n} ({name}) raising {error.__name__}"
            if observe(w.flow) == exact:
                pass  # nothing changed
            elif after == done:
                pass  # the call completed
            elif {**after, "events": None} == {**done, "events": None}:
                # The call completed, but making its events raised (a read for their text):
                # none of them is reported.
                assert after["events"] == before["events"], where
            else:
                assert partial and evicted_only(before, after, ps), (
                    f"{where}: neither the state before, nor after, nor the documented partial "
                    f"result:\n before {before}\n after  {after}\n done   {done}"
                )
            check_whole(w)


def test_the_issue_cases():
    """The cases the issue names, on the radix manager: free_page_runs raising in an evicting
    begin lost every evicted page; raising in finish left pages owned twice (and a cached prefix
    then served another request's K/V)."""
    calls: dict[str, Callable[[World], Any]] = {
        "begin": lambda w: w.flow.begin(t(w.V)),
        "finish": lambda w: w.flow.finish(w.req["b"]),
    }
    for ps in (1, 4):
        for call in calls.values():
            w = World("radix", ps, traced=False)
            dry = Faults()
            w.inject(dry)
            call(w)
            w.restore()
            w = World("radix", ps, traced=False)
            w.inject(Faults(fail_at=dry.calls.index("allocator.free_page_runs")))
            with pytest.raises(RuntimeError, match="injected"):
                call(w)
            w.restore()
            check_whole(w)
