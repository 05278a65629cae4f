"""The host tier (`TieredCacheManager`): a state machine over both tiers, the engine's logits after a
round trip through host memory, and misuse that must change nothing.

The machine drives a `RequestFlow` on a tier over a tiny device pool (6 pages), so that most
steps evict to host and most matches load back, with write-back and write-through, a roomy host
(never full: nothing may be lost) and a cramped one (3 pages: its LRU runs all the time), page
sizes 1 and 2, both pool layouts, two namespaces. The K/V of a token is a code of its namespace
and every token up to it, so a page that comes back with another prefix's K/V is caught.

After every step:
- ``tier.check_integrity()`` (both tiers, host trie counts, host pages held = not free, every host
  page's prefix whole, write-back's one-tier rule) and ``flow.check_integrity()`` (device pages
  partitioned into free, cached and running);
- recomputed here from public APIs: write-back keeps the tiers disjoint; device + host pages are
  a subset of what was inserted (the reference) and, with the roomy host, equal to it (nothing
  lost); the host never holds more pages than its capacity;
- every page of either tier holds exactly the K/V written for its prefix.
A begin with nothing else running reuses exactly the longest inserted whole-page prefix when the
host is roomy: whatever the device evicted comes back.

The policies of issue 30 run the same machine: inclusive write-back (SGLang's ``load_back``
keeps the host copy), selective write-through (a page reaches the host after
``write_through_threshold`` hits; one evicted before is dropped), and the disk tier under a
cramped host (the host's LRU writes its pages to files that come back on a match). For all of
them, after every step: the tier's events replayed into a `TieredPrefixMirror` equal both tiers
page for page; a begin with nothing else running reuses exactly what `peek_prefix` promised
(unless a file was corrupted since: then no more); every page file holds the K/V of its prefix,
and a corrupted one is never served (the K/V check of every reused token would catch it).
"""

from __future__ import annotations

import functools
import shutil
import tempfile
from collections.abc import Hashable
from itertools import product
from pathlib import Path

import pytest
import torch
from conftest import ids, slots
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvcache import (
    DiskKVStore,
    Engine,
    KVCacheLayout,
    MHAKVCache,
    NaiveCacheManager,
    PageAllocator,
    RadixCacheManager,
    Request,
    RequestFlow,
    Scheduler,
    TieredPrefixMirror,
    TinyLlama,
    TinyLlamaConfig,
)
from kvcache.serving.workloads import multi_turn_chat
from kvcache.system.host_pool import PCIE5_X16, HostKVPool
from kvcache.system.host_tier import TieredCacheManager

pytestmark = pytest.mark.usefixtures("torch_store")

LAYERS, HEADS, DIM, DEVICE_PAGES = 2, 1, 2, 6
Prefix = tuple[Hashable, tuple[int, ...]]
DOCS = [[d, *range(10 + 12 * d, 21 + 12 * d)] for d in range(4)]  # 4 x 12 tokens, all distinct
KEYS = [None, "t"]
TAIL_TOKENS, MAX_TAIL = 3, 3  # a prompt's tail: up to MAX_TAIL tokens below TAIL_TOKENS


def _all_page_prefixes(page_size: int) -> int:
    """How many (namespace, whole-page prefix) pairs the machine's prompts can ever insert."""
    tails = [list(t) for n in range(MAX_TAIL + 1) for t in product(range(TAIL_TOKENS), repeat=n)]
    seen = set()
    for doc in DOCS:
        for cut in range(1, len(doc) + 1):
            for tail in tails:
                p = (doc[:cut] + tail)[: DEVICE_PAGES * page_size]
                seen.update(
                    tuple(p[: j + page_size])
                    for j in range(0, len(p) // page_size * page_size, page_size)
                )
    return len(seen) * len(KEYS)


# A host that can never fill (its LRU never runs, so nothing may be lost): room for every page
# prefix the prompts can make. Found: 64 pages, once thought roomy, filled on a long run.
ROOMY = max(_all_page_prefixes(ps) for ps in (1, 2))


@functools.lru_cache(maxsize=1 << 16)
def code(key: Hashable, prefix: tuple[int, ...]) -> float:
    """The K/V code of the last token of ``prefix`` in namespace ``key``: exact in float32."""
    h = 7 if key is not None else 0
    for t in prefix:
        h = (h * 1_000_003 + t + 1) % (1 << 20)
    return float(h)


def write_kv(
    pool: MHAKVCache, key: Hashable, tokens: list[int], at: torch.Tensor, start: int
) -> None:
    """Store the codes of ``tokens[start:]`` at slots ``at[start:]`` (K = code + layer, V = -K)."""
    if start >= len(tokens):
        return
    c = torch.tensor([code(key, tuple(tokens[: i + 1])) for i in range(start, len(tokens))])
    for layer in range(LAYERS):
        k = (c + layer).view(-1, 1, 1).expand(-1, HEADS, DIM).contiguous()
        pool.store_kv(k, -k, at[start:], layer)


def expected_page(key: Hashable, prefix: tuple[int, ...], ps: int) -> torch.Tensor:
    """What a page holding the last ``ps`` tokens of ``prefix`` stores: ``(2, layers, ps)``."""
    c = torch.tensor([code(key, prefix[: len(prefix) - ps + j + 1]) for j in range(ps)])
    k = torch.stack([c + layer for layer in range(LAYERS)])
    return torch.stack([k, -k])


class TierMachine(RuleBasedStateMachine):
    policy = "write_back"
    host_pages = ROOMY
    page_size = 1
    layout = KVCacheLayout.LayerFirst
    disk = False

    @initialize()
    def setup(self) -> None:
        ps = self.page_size
        self.pool = MHAKVCache(
            HEADS, LAYERS, DIM, DEVICE_PAGES, torch.float32, self.layout, "cpu", ps
        )
        alloc = PageAllocator(DEVICE_PAGES, ps)
        manager = RadixCacheManager(page_size=ps, events=True)
        self.dir = Path(tempfile.mkdtemp(prefix="kvdisk")) if self.disk else None
        store = None if self.dir is None else DiskKVStore(self.dir, self.pool, "m", fsync=False)
        self.tier = TieredCacheManager(
            manager, self.pool, alloc, self.host_pages, policy=self.policy, disk=store, events=True
        )
        self.flow = RequestFlow(self.tier, alloc)
        self.ref: set[Prefix] = set()
        self.running: list[tuple[Request, Hashable]] = []
        self.mirror = TieredPrefixMirror(ps)
        self.corrupted = False

    @property
    def lossless(self) -> bool:
        """Nothing the tiers were given may be lost: a host that never fills, and a policy that
        never drops an evicted page."""
        return self.host_pages == ROOMY and self.policy != "write_through_selective"

    def _pages_of(self, key: Hashable, tokens: list[int]) -> list[Prefix]:
        ps = self.page_size
        return [(key, tuple(tokens[: j + ps])) for j in range(0, len(tokens) // ps * ps, ps)]

    def _longest_in_ref(self, key: Hashable, tokens: list[int]) -> int:
        n = 0
        for p in self._pages_of(key, tokens):
            if p not in self.ref:
                break
            n = len(p[1])
        return n

    @rule(
        prompts=st.lists(
            st.tuples(
                st.integers(0, len(DOCS) - 1),
                st.integers(1, 12),
                st.lists(st.integers(0, TAIL_TOKENS - 1), max_size=MAX_TAIL),
                st.sampled_from(KEYS),
            ),
            min_size=1,
            max_size=3,
        ),
        hold=st.booleans(),
    )
    def serve(self, prompts: list[tuple[int, int, list[int], Hashable]], hold: bool) -> None:
        """Requests one after another, each the first ``cut`` tokens of one of a few documents
        and a short tail (so prefixes recur, and the documents together overflow the device);
        the last one keeps running when ``hold``."""
        for i, (doc, cut, tail, key) in enumerate(prompts):
            prompt = (DOCS[doc][:cut] + tail)[: DEVICE_PAGES * self.page_size]
            self._begin(prompt, key, hold and i == len(prompts) - 1)

    def _begin(self, prompt: list[int], key: Hashable, hold: bool) -> None:
        alone = not self.running
        expect = self._longest_in_ref(key, prompt)
        promised = self.tier.peek_prefix(ids(*prompt), key)
        try:
            req = self.flow.begin(ids(*prompt), extra_key=key)
        except RuntimeError:  # out of pages while others hold theirs
            assert not alone
            return
        got = req.reused_len
        assert got <= expect and got <= promised
        if alone and self.lossless:
            assert got == expect, (got, expect)
        if alone and not self.corrupted:
            assert got == promised, (got, promised)  # every tier's pages came back
        # The reused K/V (some of it back from host) are those written for these tokens.
        for i in range(got):
            s = int(req.indices[i])
            want = code(key, tuple(prompt[: i + 1]))
            k = self.pool.k_cache(1)[s // self.page_size, s % self.page_size]
            assert torch.equal(k, torch.full_like(k, want + 1))
        write_kv(self.pool, key, prompt, req.indices, got)
        self.flow.mark_computed(req)
        if hold:
            self.running.append((req, key))
        else:
            self._finish(req, key)

    def _finish(self, req: Request, key: Hashable) -> None:
        tokens = req.input_ids.tolist()
        self.flow.finish(req)
        self.ref.update(self._pages_of(key, tokens))

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 3), abort=st.booleans())
    def end(self, i: int, abort: bool) -> None:
        req, key = self.running.pop(i % len(self.running))
        if abort:
            self.flow.abort(req)
        else:
            self._finish(req, key)

    @rule(pages=st.integers(1, DEVICE_PAGES))
    def evict(self, pages: int) -> None:
        size = min(pages * self.page_size, self.tier.size_info.evictable_size)
        self.flow.allocator.free_slots(self.tier.evict(size))

    @precondition(lambda self: not self.running)
    @rule()
    def reset(self) -> None:
        self.flow.reset_prefix_cache()
        assert not self.tier.host_prefixes() and self.tier.host_size == 0
        store = self.tier.disk  # a reset forgets both tiers; the files on disk stay
        self.ref = {
            (key, pre)
            for key, pre in self.ref
            if store is not None and store.contains(store.prefix_digests(key, list(pre))[-1])
        }

    @precondition(lambda self: self.dir is not None)
    @rule(pick=st.integers(0, 99), cut=st.booleans())
    def corrupt(self, pick: int, cut: bool) -> None:
        """A page file is torn (cut short) or flipped on disk: it must never be served."""
        files = sorted(self.dir.glob("*/*.page"))
        if not files:
            return
        path = files[pick % len(files)]
        data = bytearray(path.read_bytes())
        if cut:
            data = data[: len(data) // 2]
        else:
            data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
        self.corrupted = True

    @rule()
    def refused_evict(self) -> None:
        before = self._state()
        with pytest.raises(RuntimeError, match="cannot evict"):
            self.tier.evict(self.tier.size_info.evictable_size + 1)
        assert self._state() == before

    def teardown(self) -> None:
        if getattr(self, "dir", None) is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
        if hasattr(self, "tier"):  # what the run exercised (shown by --hypothesis-show-statistics)
            st_ = self.tier.stats
            event("loaded from host" if st_.loaded_pages else "no load")
            event("host LRU evicted" if st_.host_evicted_pages else "host LRU idle")
            if st_.lost_pages:
                event("pages lost for want of host room")
            if st_.disk_loaded_pages:
                event("loaded from disk")
            if self.tier.disk is not None and self.tier.disk.stats.rejected_pages:
                event("a corrupted page file refused")

    def _state(self) -> object:
        return (
            self.tier.device_prefixes(),
            self.tier.host_prefixes(),
            repr(self.tier.stats),
            self.flow.allocator.free_pages().tolist(),
            self.tier.host.buffer.numpy().tobytes(),  # every bit, and fast on a big host
        )

    @invariant()
    def tiers_are_sound(self) -> None:
        if not hasattr(self, "tier"):
            return
        self.tier.check_integrity()
        self.flow.check_integrity()
        dev, host = self.tier.device_prefixes(), self.tier.host_prefixes()
        if self.policy == "write_back":
            assert not dev.keys() & host.keys()
        assert len(host) <= self.host_pages
        assert dev.keys() | host.keys() <= self.ref
        if self.lossless:
            assert dev.keys() | host.keys() == self.ref  # nothing lost
        # The events, replayed outside, give both tiers page for page (host slots for host).
        self.mirror.apply(self.tier.take_tier_events())
        ps = self.page_size
        assert {k: s[0] // ps for k, s in self.mirror.pages("device").items()} == dev
        assert {k: s[0] // ps for k, s in self.mirror.pages("host").items()} == host
        if self.dir is not None:  # every file holds its prefix's K/V, or is refused
            store = self.tier.disk
            for key, pre in self.ref:
                digest = store.prefix_digests(key, list(pre))[-1]
                page = store.get(digest) if store.contains(digest) else None
                if page is not None:
                    assert torch.equal(page[:, :, :, 0, 0], expected_page(key, pre, ps))
        ps = self.page_size
        for (key, pre), page in dev.items():
            k = self.pool.k_cache(0)[page, :, 0, 0]
            v = self.pool.v_cache(1)[page, :, 0, 0]
            want = expected_page(key, pre, ps)
            assert torch.equal(k, want[0, 0]) and torch.equal(v, want[1, 1]), (pre, k, v)
        for (key, pre), page in host.items():
            got = self.tier.host.read(torch.tensor([page]))[0, :, :, :, 0, 0]
            assert torch.equal(got, expected_page(key, pre, ps)), (pre, got)


SETTINGS = settings(
    max_examples=40 if __debug__ else 8,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
# The policies of issue 30 and the disk tier: fewer examples each, the same rules.
NEW_SETTINGS = settings(SETTINGS, max_examples=15 if __debug__ else 4)
_VARIANTS = [
    (policy, host, ps, layout, False, SETTINGS)
    for policy in ("write_back", "write_through")
    for host in (ROOMY, 3)
    for ps, layout in ((1, KVCacheLayout.LayerFirst), (2, KVCacheLayout.PageFirst))
] + [
    ("write_back_inclusive", ROOMY, 1, KVCacheLayout.LayerFirst, False, NEW_SETTINGS),
    ("write_back_inclusive", 3, 2, KVCacheLayout.PageFirst, False, NEW_SETTINGS),
    ("write_through_selective", ROOMY, 2, KVCacheLayout.LayerFirst, False, NEW_SETTINGS),
    ("write_through_selective", 3, 1, KVCacheLayout.PageFirst, False, NEW_SETTINGS),
    ("write_back", 3, 1, KVCacheLayout.LayerFirst, True, NEW_SETTINGS),
    ("write_back_inclusive", 3, 2, KVCacheLayout.PageFirst, True, NEW_SETTINGS),
]
for _policy, _host, _ps, _layout, _disk, _settings in _VARIANTS:
    _name = f"{_policy}_host{_host}_ps{_ps}" + ("_disk" if _disk else "")
    _machine = type(
        f"Tier_{_name}",
        (TierMachine,),
        {
            "policy": _policy,
            "host_pages": _host,
            "page_size": _ps,
            "layout": _layout,
            "disk": _disk,
        },
    )
    _machine.TestCase.settings = _settings
    globals()[f"TestTier_{_name}"] = _machine.TestCase


# ------------------------------------------------------------------ the model
def _engine(manager_kind: str, host_pages: int = 64) -> tuple[Engine, TieredCacheManager | None]:
    model = TinyLlama(TinyLlamaConfig(num_layers=2, seed=0))
    if manager_kind == "naive":
        return Engine(
            model, model.new_kv_cache(48), NaiveCacheManager("cpu"), PageAllocator(48)
        ), None
    pool = model.new_kv_cache(12, 4)
    alloc = PageAllocator(12, 4)
    tier = TieredCacheManager(
        RadixCacheManager(page_size=4, events=True), pool, alloc, host_pages, policy=manager_kind
    )
    return Engine(model, pool, tier, alloc), tier


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_logits_after_host_round_trip_equal_recomputation(policy: str) -> None:
    """A prompt whose prefix was evicted to host and loaded back gives the logits of a run that
    recomputes everything (the naive manager caches nothing)."""
    g = torch.Generator().manual_seed(0)
    first = torch.randint(0, 256, (24,), generator=g)
    others = [torch.randint(0, 256, (24,), generator=g) for _ in range(3)]
    again = torch.cat([first, torch.randint(0, 256, (7,), generator=g)])
    engine, tier = _engine(policy)
    assert tier is not None
    for p in (first, *others):  # 4 x 24 tokens through 48 slots: `first` goes to host
        engine.generate(p, 2)
    assert tier.host_prefixes() and tier.stats.saved_pages
    reused_before = engine.reused_tokens
    req, logits = engine.prefill(again)
    assert tier.stats.loaded_pages >= 6  # the 24-token prefix came back from host
    assert engine.reused_tokens - reused_before == 24
    naive, _ = _engine("naive")
    _, want = naive.prefill(again)
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    engine.finish(req)
    tier.check_integrity()
    engine.flow.check_integrity()


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_scheduler_on_the_tier_computes_less(policy: str) -> None:
    """The scheduler runs unchanged on the tier; with a host that holds the whole working set it
    computes fewer tokens than on the device-only cache, and both tiers stay sound."""
    jobs = multi_turn_chat(
        num_conversations=6, turns=3, system_len=24, message_len=(4, 10), output_len=(4, 10)
    )

    def run(tiered: bool) -> tuple[int, TieredCacheManager | None]:
        pool = MHAKVCache(1, 1, 1, 24, torch.float32, KVCacheLayout.LayerFirst, "cpu", 4)
        alloc = PageAllocator(24, 4)
        manager = RadixCacheManager(page_size=4, events=tiered)
        tier = TieredCacheManager(manager, pool, alloc, 256, policy=policy) if tiered else None
        sched = Scheduler(RequestFlow(tier or manager, alloc), token_budget=64, max_batch=4)
        for job in jobs:
            sched.submit(job.prompt, len(job.output), forced=job.output)
        while not sched.idle:
            sched.step()
            sched.check_integrity()
            if tier is not None:
                tier.check_integrity()
        return sched.report().computed_tokens, tier

    device_only, _ = run(False)
    tiered, tier = run(True)
    assert tier is not None and tier.stats.loaded_pages > 0
    assert tiered < device_only


def test_host_lru_and_write_back_moves() -> None:
    """One-token prompts on a 2-page device over a 2-page host: the device's LRU leaf goes to the
    host, the host's LRU leaf goes when the host is full, and a load moves a page back."""
    pool = MHAKVCache(1, 1, 2, 2, torch.float32, KVCacheLayout.LayerFirst, "cpu")
    alloc = PageAllocator(2)
    tier = TieredCacheManager(RadixCacheManager(events=True), pool, alloc, 2)
    flow = RequestFlow(tier, alloc)

    def serve(t: int) -> int:
        req = flow.begin(ids(t))
        flow.mark_computed(req)
        flow.finish(req)
        tier.check_integrity()
        return req.reused_len

    def tiers() -> tuple[set[int], set[int]]:
        return (
            {pre[0] for _, pre in tier.device_prefixes()},
            {pre[0] for _, pre in tier.host_prefixes()},
        )

    for t in (1, 2, 3, 4):
        assert serve(t) == 0
    assert tiers() == ({3, 4}, {1, 2})
    serve(5)  # the device evicts 3; the full host gives up its LRU page, 1
    assert tiers() == ({4, 5}, {2, 3}) and tier.stats.host_evicted_pages == 1
    assert serve(2) == 1  # back from host: 4 goes to host, 2 leaves it (write-back moves)
    assert tiers() == ({5, 2}, {3, 4})
    assert tier.stats.loaded_pages == 1 and tier.stats.saved_pages == 4


# ------------------------------------------------------------------ misuse
def _tier(**kw: object) -> tuple[TieredCacheManager, RequestFlow, MHAKVCache]:
    pool = MHAKVCache(1, 1, 2, 4, torch.float32, KVCacheLayout.LayerFirst, "cpu", 2)
    alloc = PageAllocator(4, 2)
    args: dict[str, object] = {
        "manager": RadixCacheManager(page_size=2, events=True),
        "kv_cache": pool,
        "allocator": alloc,
        "host_pages": 8,
    }
    args.update(kw)
    tier = TieredCacheManager(**args)  # type: ignore[arg-type]
    return tier, RequestFlow(tier, alloc), pool


@pytest.mark.parametrize(
    ("kw", "exc", "match"),
    [
        ({"manager": NaiveCacheManager("cpu")}, TypeError, "manager"),
        ({"kv_cache": "pool"}, TypeError, "kv_cache"),
        ({"allocator": None}, TypeError, "allocator"),
        ({"host_pages": 0}, ValueError, "host_pages"),
        ({"host_pages": 2.5}, TypeError, "host_pages"),
        ({"policy": "write_around"}, ValueError, "policy"),
        ({"manager": RadixCacheManager(page_size=2)}, ValueError, "events=True"),
        ({"manager": RadixCacheManager(page_size=1, events=True)}, ValueError, "page sizes"),
        ({"allocator": PageAllocator(5, 2)}, ValueError, "5 pages"),
        ({"pin_memory": "yes"}, TypeError, "pin_memory"),
    ],
)
def test_constructor_refuses(kw: dict[str, object], exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        _tier(**kw)


def test_constructor_refuses_a_manager_that_holds_prefixes() -> None:
    m = RadixCacheManager(page_size=2, events=True)
    m.insert_prefix(ids(1, 2), slots(0, 1))
    with pytest.raises(ValueError, match="empty"):
        _tier(manager=m)


def _filled() -> tuple[TieredCacheManager, RequestFlow, MHAKVCache]:
    """A tier whose device holds one prefix and whose host holds another."""
    tier, flow, pool = _tier()
    for p in ([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]):
        r = flow.begin(ids(*p))
        flow.mark_computed(r)
        flow.finish(r)
    assert tier.host_prefixes() and tier.device_prefixes()
    return tier, flow, pool


def _snapshot(tier: TieredCacheManager, flow: RequestFlow) -> object:
    return (
        tier.device_prefixes(),
        tier.host_prefixes(),
        repr(tier.stats),
        flow.allocator.free_pages().tolist(),
        tier.host_allocator.free_pages().tolist(),
        tier.host.buffer.clone().tolist(),
        tier.size_info,
    )


@pytest.mark.parametrize(
    ("call", "exc"),
    [
        (lambda t: t.match_prefix(torch.tensor([1.0, 2.0])), TypeError),
        (lambda t: t.match_prefix(ids(1, 2), extra_key=[1]), TypeError),
        (lambda t: t.insert_prefix(ids(1, 2), slots(0)), ValueError),
        (lambda t: t.insert_prefix(ids(1, 2), slots(0, 1)), ValueError),  # slots the tree holds
        (lambda t: t.evict(10**6), RuntimeError),
        (lambda t: t.evict(-1), ValueError),
    ],
)
def test_refused_calls_change_nothing(call: object, exc: type[Exception]) -> None:
    tier, flow, _ = _filled()
    before = _snapshot(tier, flow)
    with pytest.raises(exc):
        call(tier)  # type: ignore[operator]
    assert _snapshot(tier, flow) == before
    tier.check_integrity()


def test_reset_while_locked_changes_nothing() -> None:
    tier, flow, _ = _filled()
    r = flow.begin(ids(1, 2, 3, 4, 9))
    before = _snapshot(tier, flow)
    with pytest.raises(RuntimeError, match="locked"):
        tier.reset()
    assert _snapshot(tier, flow) == before
    flow.abort(r)


def test_host_pool_refuses_bad_pages() -> None:
    pool = MHAKVCache(1, 1, 2, 4, torch.float32, KVCacheLayout.LayerFirst, "cpu", 2)
    host = HostKVPool(pool, 3)
    before = host.buffer.clone()
    with pytest.raises(ValueError, match="host_pages"):
        host.save(pool, torch.tensor([0]), torch.tensor([3]))
    with pytest.raises(ValueError, match="device_pages"):
        host.save(pool, torch.tensor([4]), torch.tensor([0]))
    with pytest.raises(TypeError, match="host_pages"):
        host.read(torch.tensor([0.5]))
    with pytest.raises(ValueError, match="staged"):
        host.restore(pool, torch.tensor([0]), torch.zeros(2, 3))
    assert torch.equal(host.buffer, before)
    assert not host.pinned and host.page_bytes == 2 * 1 * 2 * 1 * 2 * 4


def test_link_seconds() -> None:
    assert PCIE5_X16.seconds(int(PCIE5_X16.bytes_per_s)) == pytest.approx(1.0)
    assert 60e9 < PCIE5_X16.bytes_per_s < 64e9
