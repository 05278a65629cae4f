"""One request-flow state machine, run against every manager, with a real K/V pool.

The machine drives a `RequestFlow` over the naive manager, the radix manager (page sizes 1, 3,
4, 16; LRU and FIFO) and the block-hash manager (page sizes 1, 4, 16, and 2 with a weak hash
that collides), interleaving begin / extend / mark_computed / cache / finish / abort / evict /
reset_prefix_cache / match, and refused calls. K/V are stored through `MHAKVCache.store_kv`
(either layout); the K/V of a token is a function of the tokens up to and including it, so a
slot that holds another prefix's K/V is caught when read back.

After every step:
- ``flow.check_integrity()``, and the page partition computed here from public APIs: free pages
  + cached pages + each running request's own pages = all pages, none twice;
- the reference model: the set of cached page-aligned prefixes (updated on insert, and on
  eviction by diffing: what disappeared must be unlocked, whole pages, no more than needed for
  the block-hash manager, and leave a prefix-closed set), sizes, the free-page count, the stats;
- the pool read back: every running request's computed tokens, and every cached prefix (matched
  on a copy of the manager, so the check does not refresh LRU order) hold exactly the K/V stored
  for those tokens; free pages are then overwritten with a sentinel, so a page that is reused
  while still referenced shows up.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import random
from collections.abc import Callable

import pytest
import torch
from conftest import ids, unchanged
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvcache import (
    BaseCacheManager,
    BlockHashCacheManager,
    KVCacheLayout,
    MHAKVCache,
    NaiveCacheManager,
    PageAllocator,
    RadixCacheManager,
    Request,
    RequestFlow,
    SizeInfo,
)

pytestmark = pytest.mark.usefixtures("torch_store")  # the Triton interpreter: ~40 ms a store

Prefix = tuple[int, ...]
LAYERS = 2
SENTINEL = -1.0  # written over free pages; every real K/V code is >= 0
_MASK = (1 << 52) - 1  # codes are exact in float64


@functools.lru_cache(maxsize=1 << 16)
def kv_code(prefix: Prefix) -> tuple[float, ...]:
    """K and V of the last token of ``prefix``, per layer: ``(k0, v0, k1, v1, ...)``.

    Hashes of int tuples do not depend on PYTHONHASHSEED, so the codes are the same in every run.
    """
    return tuple(float(hash((j, prefix)) & _MASK) for j in range(2 * LAYERS))


def weak_hash(parent: int, tokens: tuple[int, ...]) -> int:
    """A block hash that collides all the time (two values)."""
    return tokens[0] % 2


def prompts(ps: int) -> tuple[st.SearchStrategy[Prefix], st.SearchStrategy[Prefix]]:
    """Prompts up to ~3 pages long: any, and ones that share prefixes (two fixed bases, cut)."""
    longest = 3 * ps + 2 if ps < 16 else 2 * ps + 4
    rngs = [random.Random(seed) for seed in range(2)]
    bases = [tuple(rng.randrange(3) for _ in range(longest)) for rng in rngs]
    cut = st.builds(lambda b, k: b[:k], st.sampled_from(bases), st.integers(1, longest))
    grown = st.builds(
        lambda b, k, tail: (b[:k] + tuple(tail))[:longest] or (0,),
        st.sampled_from(bases),
        st.integers(0, longest),
        st.lists(st.integers(0, 2), max_size=ps + 1),
    )
    return st.one_of(
        cut, grown, st.lists(st.integers(0, 2), min_size=1, max_size=longest).map(tuple)
    ), cut


def make_machine(
    kind: str,
    ps: int,
    num_pages: int,
    *,
    policy: str = "lru",
    hash_fn: Callable[[int, tuple[int, ...]], int] | None = None,
) -> type:
    """The flow machine over a ``kind`` manager ("naive", "radix", "block") of page size ``ps``."""
    caching = kind != "naive"
    prompt, shared_prompt = prompts(ps)

    def new_manager() -> BaseCacheManager:
        if kind == "naive":
            return NaiveCacheManager()
        if kind == "radix":
            return RadixCacheManager(page_size=ps, eviction_policy=policy)
        return BlockHashCacheManager(page_size=ps, hash_fn=hash_fn)

    class FlowMachine(RuleBasedStateMachine):
        """Model: ``cached`` = the cached page-aligned prefixes; ``content[slot]`` = the prefix whose
        last token's K/V the test stored at ``slot``; ``counts`` = the flow stats expected."""

        @initialize(layout=st.sampled_from([KVCacheLayout.LayerFirst, KVCacheLayout.PageFirst]))
        def setup(self, layout: KVCacheLayout) -> None:
            self.manager = new_manager()
            self.flow = RequestFlow(self.manager, PageAllocator(num_pages, ps))
            self.pool = MHAKVCache(
                1, LAYERS, 1, num_pages, torch.float64, layout, "cpu", page_size=ps
            )
            self.content: dict[int, Prefix] = {}
            self.cached: set[Prefix] = set()
            self.counts = dict(
                requests=0,
                prompt_tokens=0,
                reused_tokens=0,
                decoded_tokens=0,
                evicted_tokens=0,
                evictions=0,
            )
            self.ended: list[Request] = []

        # ------------------------------------------------------------- model
        def longest(self, seq: Prefix) -> int:
            """Length of the longest cached prefix of ``seq`` (whole pages)."""
            k = 0
            while k + ps <= len(seq) and seq[: k + ps] in self.cached:
                k += ps
            return k

        @staticmethod
        def pages_of(seq: Prefix) -> set[Prefix]:
            return {seq[:k] for k in range(ps, len(seq) // ps * ps + 1, ps)}

        def locked(self) -> set[Prefix]:
            out: set[Prefix] = set()
            for r in self.flow.running.values():
                out |= self.pages_of(tuple(r.input_ids[: r.tree_len].tolist()))
            return out

        def held_pages(self) -> int:
            return sum(-(-(len(r) - r.tree_len) // ps) for r in self.flow.running.values())

        def evictable_pages(self, extra_locked: set[Prefix] = frozenset()) -> int:
            return len(self.cached - self.locked() - extra_locked)

        def actual_cached(self) -> set[Prefix]:
            """The prefixes the manager holds, named by what the test stored in each cached page."""
            cached = self.manager.cached_indices().tolist()
            assert len(cached) % ps == 0, f"cache holds {len(cached)} slots, not whole pages"
            out = set()
            for i in range(0, len(cached), ps):
                page = cached[i : i + ps]
                assert page == list(range(page[0], page[0] + ps)) and page[0] % ps == 0, (
                    f"not a page: {page}"
                )
                assert page[-1] in self.content, f"cached slot {page[-1]} never had K/V stored"
                out.add(self.content[page[-1]])
            return out

        def apply_evictions(self, min_pages: int, exact: int | None = None) -> int:
            """Account for what disappeared from the cache during the last call."""
            actual = self.actual_cached()
            assert actual <= self.cached, (
                f"cached without an insert: {sorted(actual - self.cached)}"
            )
            removed = self.cached - actual
            assert not removed & self.locked(), "evicted a locked prefix"
            assert all(len(p) == ps or p[:-ps] in actual for p in actual), "eviction left an orphan"
            assert len(removed) >= min_pages, f"evicted {len(removed)} pages, needed {min_pages}"
            if exact is not None:
                assert len(removed) == exact, f"evicted {len(removed)} pages, {exact} expected"
            self.cached = actual
            return len(removed)

        def store(self, req: Request, n: int) -> None:
            """Store K/V of tokens ``[num_computed, n)`` through the pool, then mark them computed."""
            a = req.num_computed
            if n > a:
                toks = tuple(req.input_ids.tolist())
                prefixes = [toks[: j + 1] for j in range(a, n)]
                codes = torch.tensor([kv_code(p) for p in prefixes], dtype=torch.float64)
                out_loc = req.out_loc[: n - a]
                for layer in range(LAYERS):
                    self.pool.store_kv(
                        codes[:, 2 * layer].reshape(-1, 1, 1),
                        codes[:, 2 * layer + 1].reshape(-1, 1, 1),
                        out_loc,
                        layer,
                    )
                for slot, p in zip(out_loc.tolist(), prefixes, strict=False):
                    self.content[slot] = p
            self.flow.mark_computed(req, n)

        def read(self, slot_list: list[int]) -> torch.Tensor:
            """The pool's K/V at ``slot_list``: shape ``(n, 2 * LAYERS)``, columns k0, v0, k1, ..."""
            s = torch.tensor(slot_list, dtype=torch.int64)
            page, off = s // ps, s % ps
            cols = []
            for layer in range(LAYERS):
                cols += [
                    self.pool.k_cache(layer)[page, off].reshape(-1),
                    self.pool.v_cache(layer)[page, off].reshape(-1),
                ]
            return torch.stack(cols, 1)

        def assert_holds(self, slot_list: list[int], toks: Prefix, what: str) -> None:
            """Slot ``i`` of ``slot_list`` holds the K/V of ``toks[:i + 1]``."""
            if not slot_list:
                return
            want = torch.tensor(
                [kv_code(toks[: i + 1]) for i in range(len(slot_list))], dtype=torch.float64
            )
            got = self.read(slot_list)
            bad = (got != want).any(1).nonzero().flatten().tolist()
            assert not bad, (
                f"{what}: slots {[slot_list[i] for i in bad]} (positions {bad}) hold other K/V"
            )

        def pick(self, i: int) -> Request:
            reqs = list(self.flow.running.values())
            return reqs[i % len(reqs)]

        def outer_state(self) -> tuple:
            """What a refused `begin` must leave as it was (its match may refresh LRU order)."""
            return (
                self.flow.allocator.free_pages().tolist(),
                self.manager.size_info,
                sorted(self.manager.cached_indices().tolist()),
                [
                    (r.rid, r.input_ids.tolist(), r.indices.tolist(), r.num_computed, r.tree_len)
                    for r in self.flow.running.values()
                ],
                dataclasses.astuple(self.flow.stats),
            )

        # ------------------------------------------------------------- rules
        # Hypothesis picks among enabled rules uniformly: the two begin rules and the two end rules
        # make requests start and finish often enough for prefixes to be shared and evicted.
        @rule(p=prompt, compute_last=st.booleans(), store=st.sampled_from([1.0, 0.5, 0.0, None]))
        def begin(self, p: Prefix, compute_last: bool, store: float | None) -> None:
            self.start(p, compute_last, store)

        @rule(p=shared_prompt)
        def begin_shared_and_compute(self, p: Prefix) -> None:
            self.start(p, False, 1.0)

        @precondition(lambda self: self.flow.running)
        @rule(i=st.integers(0, 99), cut=st.floats(0, 1), store=st.sampled_from([1.0, 0.5]))
        def begin_twin(self, i: int, cut: float, store: float) -> None:
            """Start a prompt that a running request starts with (parallel sampling, a retry):
            both compute the same pages, and whichever caches second must give its copies up."""
            toks = tuple(self.pick(i).input_ids.tolist())
            self.start(toks[: max(1, round(cut * len(toks)))], False, store)

        @rule(
            p=shared_prompt,
            k=st.integers(2, 3),
            order=st.permutations(range(3)),
            ends=st.lists(
                st.sampled_from(["finish", "finish", "cache", "abort"]), min_size=3, max_size=3
            ),
        )
        def parallel(self, p: Prefix, k: int, order: list[int], ends: list[str]) -> None:
            """``k`` requests for one prompt at once (parallel sampling): each computes every page,
            then they finish, cache or abort in some order; all but the first to insert must give
            their copies up. Every check runs between the calls too."""
            reqs = []
            for _ in range(k):
                req = self.start(p, False, 1.0)
                self.consistent()
                if req is not None:
                    reqs.append(req)
            for j in order:
                if j < len(reqs):
                    if ends[j] == "cache":
                        self.cache_one(reqs[j])
                    else:
                        self.stop(reqs[j], ends[j])
                    self.consistent()

        def start(self, p: Prefix, compute_last: bool, store: float | None) -> Request | None:
            """Begin ``p`` (checking the refusal when the pool cannot hold it), then store K/V."""
            q = p[:-1] if compute_last else p
            m = self.longest(q) if caching else 0
            need = -(-(len(p) - m) // ps)
            short = max(0, need - self.flow.allocator.num_free_pages)
            if short > self.evictable_pages(self.pages_of(q[:m])):
                with (
                    unchanged(self.outer_state, self.pool),
                    pytest.raises(RuntimeError, match="out of KV pages"),
                ):
                    self.flow.begin(ids(*p), compute_last=compute_last)
                event("begin: out of pages")
                return None
            req = self.flow.begin(ids(*p), compute_last=compute_last)
            evicted = self.apply_evictions(short, short if kind == "block" else None)
            event(
                f"begin: reused {'some' if m else 'none'}, {'evicted' if evicted else 'no eviction'}"
            )
            assert (req.reused_len, req.tree_len, req.num_computed, len(req)) == (m, m, m, len(p))
            assert req.input_ids.tolist() == list(p) and len(req.indices) == len(p)
            self.counts["requests"] += 1
            self.counts["prompt_tokens"] += len(p)
            self.counts["reused_tokens"] += m
            self.counts["evicted_tokens"] += evicted * ps
            self.counts["evictions"] += short > 0
            if store is not None:
                self.store(req, req.num_computed + int(store * (len(req) - req.num_computed)))
            return req

        @precondition(lambda self: self.flow.running)
        @rule(
            i=st.integers(0, 99),
            frac=st.sampled_from([1.0, 1.0, 0.5, 0.3, 0.0]),
            default=st.booleans(),
        )
        def mark_computed(self, i: int, frac: float, default: bool) -> None:
            req = self.pick(i)
            if default:  # mark_computed(req) with no count: everything
                self.store(req, len(req))
                return
            self.store(req, req.num_computed + int(frac * (len(req) - req.num_computed)))

        @precondition(lambda self: self.flow.running)
        @rule(
            i=st.integers(0, 99),
            new=st.lists(st.integers(0, 2), min_size=1, max_size=ps + 2),
            store=st.booleans(),
        )
        def extend(self, i: int, new: list[int], store: bool) -> None:
            req = self.pick(i)
            spare = (ps - len(req) % ps) % ps
            need = -(-max(0, len(new) - spare) // ps)
            short = max(0, need - self.flow.allocator.num_free_pages)
            if short > self.evictable_pages():
                with (
                    unchanged(self.flow, self.pool),
                    pytest.raises(RuntimeError, match="out of KV pages"),
                ):
                    self.flow.extend(req, ids(*new))
                event("extend: out of pages")
                return
            n0 = len(req)
            got = self.flow.extend(req, ids(*new))
            evicted = self.apply_evictions(short, short if kind == "block" else None)
            assert got.dtype == torch.int32 and got.tolist() == req.indices[n0:].tolist()
            assert req.input_ids[n0:].tolist() == new and len(req.indices) == n0 + len(new)
            self.counts["decoded_tokens"] += len(new)
            self.counts["evicted_tokens"] += evicted * ps
            self.counts["evictions"] += short > 0
            if store:
                self.store(req, len(req))

        @precondition(lambda self: self.flow.running)
        @rule(i=st.integers(0, 99))
        def cache(self, i: int) -> None:
            self.cache_one(self.pick(i))

        @precondition(lambda self: self.flow.running)
        @rule(store=st.booleans())
        def cache_all(self, store: bool) -> None:
            """A scheduler step: (store every request's K/V, then) cache every running request."""
            for req in list(self.flow.running.values()):
                if store:
                    self.store(req, len(req))
                self.cache_one(req)

        def cache_one(self, req: Request) -> None:
            n = req.num_computed // ps * ps
            seq = tuple(req.input_ids[:n].tolist())
            expected = self.longest(seq) if caching else n
            tree_len = req.tree_len
            assert self.flow.cache(req) == expected
            if caching:
                event(
                    f"cache: {'took the tree copy of some pages' if expected > tree_len else 'no duplicates'}"
                )
                self.cached |= self.pages_of(seq)
                assert req.tree_len == n
            else:
                assert req.tree_len == 0

        @precondition(lambda self: self.flow.running)
        @rule(i=st.integers(0, 99), how=st.sampled_from(["finish", "finish", "as is"]))
        def finish(self, i: int, how: str) -> None:
            self.stop(self.pick(i), how)

        @precondition(lambda self: self.flow.running)
        @rule(i=st.integers(0, 99))
        def abort(self, i: int) -> None:
            self.stop(self.pick(i), "abort")

        @precondition(lambda self: self.flow.running)
        @rule()
        def finish_oldest(self) -> None:
            self.stop(next(iter(self.flow.running.values())), "finish")

        def stop(self, req: Request, how: str) -> None:
            """Finish a request (storing what is left first, or as it is: refused unless all is
            stored), or abort it."""
            if how == "abort":
                self.flow.abort(req)
                self.ended.append(req)
                return
            if how == "finish":
                self.store(req, len(req))
            if req.num_computed != len(req):
                with (
                    unchanged(self.flow, self.pool),
                    pytest.raises(RuntimeError, match="without stored K/V"),
                ):
                    self.flow.finish(req)
                return
            seq = tuple(req.input_ids.tolist())
            n = len(seq) // ps * ps
            expected = self.longest(seq[:n]) if caching else n
            assert self.flow.finish(req) == expected
            if caching:
                dup = (
                    "reused and duplicated"
                    if expected > req.tree_len > 0
                    else "duplicated"
                    if expected > req.tree_len
                    else "no duplicates"
                )
                event(f"finish: {dup}")
            if caching:
                self.cached |= self.pages_of(seq)
            self.ended.append(req)

        @precondition(lambda self: self.ended or self.flow.running)
        @rule(
            i=st.integers(0, 99),
            call=st.sampled_from(
                [
                    "finish",
                    "abort",
                    "cache",
                    "mark_computed",
                    "extend",
                    "count below",
                    "count above",
                ]
            ),
        )
        def refused_call(self, i: int, call: str) -> None:
            """A call on an ended request, or a count outside [num_computed, len]: refused, no change."""
            if call.startswith("count"):
                if not self.flow.running:
                    return
                req = self.pick(i)
                n = (
                    req.num_computed - 1
                    if call == "count below" and req.num_computed > 0
                    else len(req) + 1
                )
                with (
                    unchanged(self.flow, self.pool),
                    pytest.raises(ValueError, match="num_tokens must be in"),
                ):
                    self.flow.mark_computed(req, n)
                return
            if not self.ended:
                return
            req = self.ended[i % len(self.ended)]
            args = (ids(1),) if call == "extend" else ()
            with unchanged(self.flow, self.pool), pytest.raises(RuntimeError, match="not running"):
                getattr(self.flow, call)(req, *args)

        @rule(size=st.integers(0, 2 * ps + 1))
        def evict(self, size: int) -> None:
            """The user evicts through the manager and returns the slots' pages to the allocator."""
            if size > self.evictable_pages() * ps:
                exc = NotImplementedError if kind == "naive" else RuntimeError
                with unchanged(self.flow, self.pool), pytest.raises(exc, match="evict"):
                    self.manager.evict(size)
                return
            out = self.manager.evict(size)
            event(f"evict: {'some' if len(out) else 'none'}")
            assert out.dtype == torch.int32 and len(out) >= size and len(out) % ps == 0
            pages = self.flow.allocator.slots_to_pages(out)
            assert len(pages) * ps == len(out)
            self.flow.allocator.free(pages)
            want = -(-size // ps)
            assert self.apply_evictions(want, want if kind == "block" else None) == len(pages)

        @rule()
        def reset_prefix_cache(self) -> None:
            if self.flow.running:
                with unchanged(self.flow, self.pool), pytest.raises(RuntimeError):
                    self.flow.reset_prefix_cache()
                return
            assert self.flow.reset_prefix_cache() == len(self.cached) * ps
            event(f"reset_prefix_cache: {'some' if self.cached else 'none'} cached")
            self.cached.clear()
            assert self.manager.size_info == SizeInfo(0, 0)
            assert self.flow.allocator.num_free_pages == num_pages

        @rule(p=prompt)
        def match(self, p: Prefix) -> None:
            """A plain match on the live manager (it refreshes LRU order, as a user's would)."""
            handle, idx = self.manager.match_prefix(ids(*p))
            assert handle.cached_len == (self.longest(p) if caching else 0)
            assert idx.dtype == torch.int32 and len(idx) == handle.cached_len
            self.assert_holds(idx.tolist(), p, f"match of {p}")
            event(f"match: {'hit' if handle.cached_len else 'miss'}")

        # -------------------------------------------------------- invariants
        @invariant()
        def consistent(self) -> None:
            if not hasattr(self, "flow"):
                return
            flow, alloc = self.flow, self.flow.allocator
            flow.check_integrity()

            # The page partition, from public APIs only.
            owners = [("free", p) for p in alloc.free_pages().tolist()]
            cached_slots = self.manager.cached_indices().tolist()
            owners += [("cached", s // ps) for s in cached_slots[::ps]]
            for r in flow.running.values():
                assert len(r.indices) == len(r.input_ids) and r.indices.dtype == torch.int32
                assert r.tree_len % ps == 0 and r.tree_len <= r.num_computed <= len(r)
                assert (
                    self.manager.handle_indices(r.handle).tolist()
                    == r.indices[: r.tree_len].tolist()
                )
                own = r.indices[r.tree_len :].tolist()
                assert all(own[j] == own[j - 1] + 1 for j in range(1, len(own)) if own[j] % ps), (
                    f"request {r.rid}: slots not laid out page by page"
                )
                owners += [(f"request {r.rid}", p) for p in sorted({s // ps for s in own})]
            by_page: dict[int, list[str]] = {}
            for who, page in owners:
                by_page.setdefault(page, []).append(who)
            assert sorted(by_page) == list(range(num_pages)), (
                f"lost pages {sorted(set(range(num_pages)) - set(by_page))}"
            )
            twice = {p: w for p, w in by_page.items() if len(w) > 1}
            assert not twice, f"pages owned twice: {twice}"

            # The reference model.
            actual = self.actual_cached()
            assert actual == self.cached, (
                f"cache holds {sorted(actual ^ self.cached)} unexpectedly (or lost them)"
            )
            locked = self.locked()
            assert locked <= self.cached
            assert self.manager.size_info == SizeInfo(
                len(self.cached - locked) * ps, len(locked) * ps
            )
            assert alloc.num_free_pages == num_pages - len(self.cached) - self.held_pages()
            s = flow.stats
            assert {k: getattr(s, k) for k in self.counts} == self.counts

            # The K/V: running requests' computed tokens and every cached prefix.
            for r in flow.running.values():
                self.assert_holds(
                    r.indices[: r.num_computed].tolist(),
                    tuple(r.input_ids.tolist()),
                    f"request {r.rid}",
                )
            if self.cached:
                probe = copy.deepcopy(
                    self.manager
                )  # matching refreshes LRU order: not on the real one
                for p in self.cached:
                    if any(len(q) == len(p) + ps and q[: len(p)] == p for q in self.cached):
                        continue  # a longer cached prefix covers it
                    handle, idx = probe.match_prefix(ids(*p))
                    assert handle.cached_len == len(p), (
                        f"cached {p} matches only {handle.cached_len}"
                    )
                    self.assert_holds(idx.tolist(), p, f"cached prefix {p}")

            # Scribble over free pages: a page reused while still referenced shows up next step.
            free_slots = alloc.pages_to_slots(alloc.free_pages())
            if len(free_slots):
                fill = torch.full((len(free_slots), 1, 1), SENTINEL, dtype=torch.float64)
                for layer in range(LAYERS):
                    self.pool.store_kv(fill, fill, free_slots, layer)
                for slot in free_slots.tolist():
                    self.content.pop(slot, None)

    return FlowMachine


# CI: 50 derandomized runs of up to 30 steps per variant (fewer under `python -O`, where the test's
# own asserts vanish and only the package's checks and the refusals are left to catch anything).
# A long randomized run: KVCACHE_FLOW_EXAMPLES=300 [KVCACHE_FLOW_STEPS=60] pytest tests/serving/test_flow_stateful.py
_LONG = int(os.environ.get("KVCACHE_FLOW_EXAMPLES", "0"))
_STEPS = int(os.environ.get("KVCACHE_FLOW_STEPS", "30"))
SETTINGS = settings(
    max_examples=_LONG or (50 if __debug__ else 8),
    stateful_step_count=_STEPS,
    deadline=None,
    derandomize=not _LONG,
    suppress_health_check=[HealthCheck.too_slow],
)

VARIANTS = {
    "Naive": ("naive", 1, 8, {}),
    **{
        f"RadixPS{ps}{pol.upper()}": ("radix", ps, n, {"policy": pol})
        for ps, n in [(1, 8), (3, 6), (4, 6), (16, 6)]
        for pol in ("lru", "fifo")
    },
    **{f"BlockPS{ps}": ("block", ps, n, {}) for ps, n in [(1, 8), (4, 6), (16, 5)]},
    "BlockPS2WeakHash": ("block", 2, 6, {"hash_fn": weak_hash}),
}

MACHINES = {name: make_machine(kind, ps, n, **kw) for name, (kind, ps, n, kw) in VARIANTS.items()}
for _name, _machine in MACHINES.items():
    _machine.TestCase.settings = SETTINGS
    globals()[f"TestFlow{_name}"] = _machine.TestCase


# ---------------------------------------------------------------- the misuse harness itself
def test_unchanged_catches_a_change_and_passes_a_refusal():
    flow = RequestFlow(RadixCacheManager(page_size=2), PageAllocator(4, 2))
    pool = MHAKVCache(1, 1, 1, 4, torch.float32, KVCacheLayout.PageFirst, "cpu", page_size=2)
    req = flow.begin(ids(1, 2, 3))
    with unchanged(flow, pool), pytest.raises(ValueError, match="num_tokens"):
        flow.mark_computed(req, 4)
    for change in (
        lambda: flow.mark_computed(req, 1),
        lambda: flow.extend(req, ids(4, 5)),
        lambda: pool.store_kv(torch.ones(1, 1, 1), torch.ones(1, 1, 1), req.indices[:1], 0),
    ):
        with (
            pytest.raises(AssertionError, match="changed by a refused call"),
            unchanged(flow, pool),
        ):
            change()
    with pytest.raises(AssertionError, match="RadixCacheManager changed"), unchanged(flow.manager):
        flow.manager.match_prefix(ids(1, 2))  # refreshes LRU clocks: a change too
