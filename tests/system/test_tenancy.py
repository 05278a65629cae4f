"""`PublicPrefixCache` shares public prefixes only, and the multi-tenant workload and replay.

The property test drives the cache with inserts, matches, evictions and lock pairs by two
tenants over a tiny alphabet (so tenants send the same private pages), half of the prompts
starting with the registered public prefix, and checks every match against a reference: the
public pages, then each page only while the tenant itself inserted it and it was not evicted
since. A match that showed a tenant a page only another tenant inserted fails it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import pytest
import torch
from conftest import ids, observe, slots, unchanged
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvcache import (
    BaseCacheManager,
    BlockHashCacheManager,
    PageAllocator,
    RadixCacheManager,
    RequestFlow,
)
from kvcache.system.tenancy import (
    POLICIES,
    PublicPrefixCache,
    multi_tenant,
    replay_tenants,
)

PUBLIC = [5, 5, 5, 5]
INNER: dict[str, Callable[[], BaseCacheManager]] = {
    "radix-1": lambda: RadixCacheManager(page_size=1),
    "radix-2": lambda: RadixCacheManager(page_size=2),
    "block-2": lambda: BlockHashCacheManager(page_size=2),
}
OPS = st.lists(
    st.tuples(
        st.sampled_from(["insert", "match", "evict", "lock"]),
        st.sampled_from([0, 1]),
        st.booleans(),
        st.lists(st.integers(0, 1), min_size=0, max_size=6),
    ),
    min_size=1,
    max_size=30,
)


def _expected(
    own: dict[tuple[Hashable, tuple[int, ...]], int],
    tenant: int,
    toks: list[int],
    pub: int,
    inner_len: int,
    ps: int,
) -> int:
    """The reference: public pages, then pages the tenant inserted (and that are still cached)."""
    n = min(pub, inner_len)
    while n + ps <= inner_len and (tenant, tuple(toks[: n + ps])) in own:
        n += ps
    return n


@pytest.mark.parametrize("make", list(INNER), ids=list(INNER))
@settings(max_examples=80, deadline=None, derandomize=True)
@given(ops=OPS)
@example(ops=[("insert", 0, False, [1, 0]), ("match", 1, False, [1, 0])])
@example(ops=[("insert", 0, True, [1, 0]), ("lock", 1, True, [1, 0, 1])])
def test_a_tenant_sees_public_pages_and_its_own_only(
    make: str, ops: list[tuple[str, int, bool, list[int]]]
) -> None:
    inner = INNER[make]()
    ps = inner.page_size
    m = PublicPrefixCache(inner, [ids(*PUBLIC)])
    own: dict[tuple[Hashable, tuple[int, ...]], int] = {}  # (tenant, page-end prefix) -> slot
    next_slot = 0
    for op, tenant, public, tail in ops:
        toks = (PUBLIC if public else []) + tail
        pub = len(PUBLIC) if public else 0
        n = len(toks) // ps * ps
        if op == "insert":
            fresh = list(range(next_slot, next_slot + len(toks)))
            next_slot += len(toks) + (-len(toks) % ps)
            m.insert_prefix(ids(*toks), slots(*fresh), extra_key=tenant)
            cached = inner.match_prefix(ids(*toks))[1].tolist()
            assert len(cached) == n
            for end in range(pub + ps, n + 1, ps):
                own[(tenant, tuple(toks[:end]))] = cached[end - ps]
        elif op in ("match", "lock"):
            inner_len = inner.match_prefix(ids(*toks))[0].cached_len
            handle, got = m.match_prefix(ids(*toks), extra_key=tenant)
            assert handle.cached_len == got.shape[0]
            assert got.shape[0] == _expected(own, tenant, toks, pub, inner_len, ps)
            assert m.handle_indices(handle).tolist() == got.tolist()
            if op == "lock":
                m.lock_handle(handle)
                m.lock_handle(handle, unlock=True)
        else:
            gone = set(m.evict(min(m.size_info.evictable_size, len(toks))).tolist())
            own = {k: s for k, s in own.items() if s not in gone}
        m.check_integrity()
        assert m.visible_pages == len(own)


def test_a_guess_at_another_tenants_text_finds_only_the_public_prefix() -> None:
    m = PublicPrefixCache(RadixCacheManager(page_size=2), [ids(*PUBLIC)])
    secret = ids(*PUBLIC, 7, 8, 9, 10)
    m.insert_prefix(secret, slots(*range(8)), extra_key="alice")
    assert m.match_prefix(secret, extra_key="alice")[0].cached_len == 8
    assert m.match_prefix(secret, extra_key="bob")[0].cached_len == 4  # the public part only
    assert m.match_prefix(ids(7, 8, 9, 10), extra_key="bob")[0].cached_len == 0
    # Bob computes the same text himself: his insert reuses alice's copy; now he sees it.
    assert m.insert_prefix(secret, slots(*range(8, 16)), extra_key="bob") == 8
    assert m.match_prefix(secret, extra_key="bob")[1].tolist() == list(range(8))
    assert m.visible_pages == 4  # two private pages, granted to two tenants
    m.reset()
    assert m.visible_pages == 0 and m.size_info.total_size == 0
    m.check_integrity()


def test_misuse_is_refused_and_changes_nothing() -> None:
    with pytest.raises(TypeError, match="public"):
        PublicPrefixCache(RadixCacheManager(page_size=2), [[5, 5]])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="manager"):
        PublicPrefixCache(object())  # type: ignore[arg-type]
    m = PublicPrefixCache(RadixCacheManager(page_size=2), [ids(*PUBLIC)])
    m.insert_prefix(ids(*PUBLIC, 1, 2), slots(*range(6)), extra_key="a")
    before = (observe(m.manager), m.visible_pages)
    for call in (
        lambda: m.match_prefix(ids(*PUBLIC, 1, 2), extra_key=["a"]),
        lambda: m.insert_prefix(ids(*PUBLIC, 1, 2), slots(*range(6, 12)), {"a": 1}),
    ):
        with pytest.raises(TypeError, match="extra_key"):
            call()
        assert (observe(m.manager), m.visible_pages) == before
    flow = RequestFlow(RadixCacheManager(page_size=2), PageAllocator(64, 2))
    jobs = multi_tenant(4, num_tenants=2, system_len=8, context_len=(4, 8), seed=1)
    with unchanged(flow), pytest.raises(ValueError, match="policy"):
        replay_tenants(flow, jobs, "per-user")
    with unchanged(flow), pytest.raises(ValueError, match="PublicPrefixCache"):
        replay_tenants(flow, jobs, "public")
    with pytest.raises(ValueError, match="num_tenants"):
        multi_tenant(num_tenants=0)


def test_workload_is_seeded_and_shares_what_it_claims() -> None:
    a, b = multi_tenant(40, seed=3), multi_tenant(40, seed=3)
    assert all(
        torch.equal(x.prompt, y.prompt) and x.tenant == y.tenant for x, y in zip(a, b, strict=True)
    )
    system = a[0].prompt[: a[0].public_len]
    assert all(torch.equal(j.prompt[: j.public_len], system) for j in a)
    assert len({j.tenant for j in a}) > 1


@pytest.mark.parametrize("pool_tokens", [100_000, 3_000])
def test_the_middle_ground_keeps_the_shared_hit_rate_when_tenants_share_no_private_text(
    pool_tokens: int,
) -> None:
    """The workload's tenants share only the system prompt, so sharing only public prefixes
    reuses exactly what sharing everything does; a namespace per tenant reuses less."""
    jobs = multi_tenant(120, num_tenants=6, seed=2)
    ps = 16
    reused = {}
    for policy in POLICIES:
        inner = RadixCacheManager(page_size=ps)
        m: BaseCacheManager = inner
        if policy == "public":
            m = PublicPrefixCache(inner, [jobs[0].prompt[: jobs[0].public_len]])
        flow = RequestFlow(m, PageAllocator(pool_tokens // ps, ps))
        reused[policy] = replay_tenants(flow, jobs, policy)
        flow.check_integrity()
    assert reused["public"] == reused["shared"] > reused["tenant"]
