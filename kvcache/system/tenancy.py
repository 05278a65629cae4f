"""Several tenants on one cache: a seeded multi-tenant workload, and a cache that shares only
public prefixes.

Prefix caching across tenants is a timing side channel: a request that finds its prefix cached
runs fewer tokens and answers sooner, so whoever can time a request learns whether *someone*
sent that prefix before. Three ways to share a cache, from the fastest to the safest:

* ``"shared"``: one namespace for everyone (every request under ``extra_key=None``). Fastest,
  and it leaks.
* ``"public"``: `PublicPrefixCache`. The public prefixes the operator registers (a system
  prompt, a published few-shot template) are shared by all; a page after them is visible to a
  tenant only once that tenant has inserted it itself. A guess about another tenant's private
  text then runs at full cost, as if nothing were cached (what SafeKV-style selective sharing
  does, here with a registry of public prefixes instead of a detector).
* ``"tenant"``: a namespace per tenant (``extra_key=tenant``): nothing is shared, the public
  prefixes are computed and stored once per tenant.

`multi_tenant` makes a workload for comparing them and `replay_tenants` runs it under a policy.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Iterable
from typing import NamedTuple

import torch

from .._validate import (
    as_list,
    check_positive_int,
    check_size,
    check_token_ids,
    reject_one_tensor,
)
from ..managers.base import BaseCacheHandle, BaseCacheManager, InsertResult, SizeInfo
from ..managers.cache_events import check_extra_key
from ..serving.request_flow import RequestFlow, check_manager
from ..serving.workload_checks import check_span

__all__ = ["TenantJob", "multi_tenant", "PublicPrefixCache", "replay_tenants", "POLICIES"]

#: How `replay_tenants` shares one cache: one namespace for all, public prefixes only, or none.
POLICIES = ("shared", "public", "tenant")


class TenantJob(NamedTuple):
    """One request of ``tenant``: ``prompt[:public_len]`` is public (shared by every tenant)."""

    tenant: int
    public_len: int
    prompt: torch.Tensor
    output: torch.Tensor


def multi_tenant(
    num_requests: int = 300,
    num_tenants: int = 8,
    system_len: int = 256,
    context_len: tuple[int, int] = (64, 192),
    contexts_per_tenant: int = 2,
    question_len: tuple[int, int] = (16, 64),
    output_len: tuple[int, int] = (8, 32),
    vocab: int = 32000,
    seed: int = 0,
) -> list[TenantJob]:
    """Tenants of one product: every request is ``system + context + question``.

    ``system`` (``system_len`` tokens) is the product's public system prompt, the same for every
    tenant; each tenant has ``contexts_per_tenant`` private contexts (its documents, its
    instructions), reused by its own requests only; the question is new every time. Requests
    come from tenants chosen uniformly at random.

    Every argument is checked before anything is drawn (``TypeError``/``ValueError`` naming
    it): the counts and ``vocab`` are integers >= 1, ``system_len`` an integer >= 0, each
    length range a ``(lo, hi)`` pair of integers with ``0 <= lo <= hi``.
    """
    for name, value in (
        ("num_requests", num_requests),
        ("num_tenants", num_tenants),
        ("contexts_per_tenant", contexts_per_tenant),
        ("vocab", vocab),
    ):
        check_positive_int(value, name)
    system_len = check_size(system_len, "system_len")
    context_len = check_span(context_len, "context_len")
    question_len = check_span(question_len, "question_len")
    output_len = check_span(output_len, "output_len")
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    system = tokens(system_len)
    contexts = [
        [tokens(rng.randint(*context_len)) for _ in range(contexts_per_tenant)]
        for _ in range(num_tenants)
    ]
    jobs = []
    for _ in range(num_requests):
        t = rng.randrange(num_tenants)
        prompt = system + rng.choice(contexts[t]) + tokens(rng.randint(*question_len))
        output = tokens(rng.randint(*output_len))
        jobs.append(
            TenantJob(
                t,
                system_len,
                torch.tensor(prompt, dtype=torch.int64),
                torch.tensor(output, dtype=torch.int64),
            )
        )
    return jobs


class PublicPrefixCache(BaseCacheManager):
    """One cache for every tenant that shares only what is public; ``extra_key`` is the tenant.

    Wraps ``manager``, whose default namespace holds everything. A match, by tenant ``t``, of
    ids that start with a registered public prefix ``p``: the pages inside ``p`` are shared by
    all; the page after them, and each one beyond, counts only if ``t`` inserted it itself
    since it was last evicted (the K/V are then the ones ``t`` would compute; if another tenant
    inserted the same page first, ``t``'s insert reuses that copy, after ``t`` paid for
    computing it). Ids that start with no public prefix share nothing across tenants.

    Visibility is kept per page, keyed by ``(tenant, hash of the ids up to the page's end)``
    and the page's first slot, and dropped when the page is evicted; a 64-bit hash collision
    could show a page to a tenant that did not insert it (odds ~2**-64 per lookup). What stays
    shared: the pool and its eviction order (a match refreshes the recency of the pages it
    walks, visible or not), a coarser channel that per-tenant namespaces in one pool share too.

    Args:
        manager: any caching manager (its default ``None`` namespace is used).
        public: the public prefixes (1-D int token ids); only their whole pages are shared.
    """

    def __init__(self, manager: BaseCacheManager, public: Iterable[torch.Tensor] = ()) -> None:
        check_manager(manager)
        reject_one_tensor(public, "public")
        prefixes = as_list(public, "public", "1-D token-id tensors")
        for i, p in enumerate(prefixes):
            check_token_ids(p, f"public[{i}]")
        self.manager = manager
        self.page_size = manager.page_size
        self.device = manager.device
        ps = self.page_size
        self._public = [p.to(torch.int64)[: p.shape[0] // ps * ps] for p in prefixes]
        self._seen: dict[tuple[Hashable, int], int] = {}  # (tenant, page hash) -> first slot
        self._by_slot: dict[int, set[tuple[Hashable, int]]] = {}

    # ------------------------------------------------------------------ visibility
    def public_len(self, input_ids: torch.Tensor) -> int:
        """Tokens of ``input_ids`` inside the longest registered public prefix it starts with
        (whole pages)."""
        check_token_ids(input_ids)
        best = 0
        for p in self._public:
            n = p.shape[0]
            if best < n <= input_ids.shape[0] and torch.equal(input_ids[:n], p):
                best = n
        return best

    def _page_keys(
        self, tenant: Hashable, ids: torch.Tensor, lo: int, hi: int
    ) -> list[tuple[Hashable, int]]:
        """The visibility key of each page ending in ``(lo, hi]``: a running hash of the ids."""
        h = hash(tuple(ids[:lo].tolist()))
        keys = []
        for end in range(lo + self.page_size, hi + 1, self.page_size):
            h = hash((h, tuple(ids[end - self.page_size : end].tolist())))
            keys.append((tenant, h))
        return keys

    def visible_len(self, input_ids: torch.Tensor, slots: torch.Tensor, tenant: Hashable) -> int:
        """How much of a match (``slots`` of ``input_ids``' cached prefix) ``tenant`` may use."""
        ps, n = self.page_size, slots.shape[0]
        seen = self.public_len(input_ids)
        if n <= seen:
            return n
        for key in self._page_keys(tenant, input_ids, seen, n):
            if self._seen.get(key) != int(slots[seen]):
                break
            seen += ps
        return seen

    # ------------------------------------------------------------------ the manager API
    def match_prefix(
        self, input_ids: torch.Tensor, extra_key: Hashable = None
    ) -> tuple[BaseCacheHandle, torch.Tensor]:
        """The longest cached prefix of ``input_ids`` that tenant ``extra_key`` may see."""
        check_extra_key(extra_key)
        handle, got = self.manager.match_prefix(input_ids)
        n = self.visible_len(input_ids, got, extra_key)
        if n == handle.cached_len:
            return handle, got
        return self.manager.match_prefix(input_ids[:n])

    def insert_and_match(
        self, input_ids: torch.Tensor, indices: torch.Tensor, extra_key: Hashable = None
    ) -> InsertResult:
        """Insert into the shared tree; tenant ``extra_key`` may see every page of it from now."""
        check_extra_key(extra_key)
        res = self.manager.insert_and_match(input_ids, indices)
        lo, n = self.public_len(input_ids), res.handle.cached_len
        if n > lo:
            slots = self.manager.handle_indices(res.handle)
            for i, key in enumerate(self._page_keys(extra_key, input_ids, lo, n)):
                first = int(slots[lo + i * self.page_size])
                old = self._seen.get(key)
                if old is not None:
                    self._by_slot[old].discard(key)
                self._seen[key] = first
                self._by_slot.setdefault(first, set()).add(key)
        return res

    def insert_prefix(
        self, input_ids: torch.Tensor, indices: torch.Tensor, extra_key: Hashable = None
    ) -> int:
        return self.insert_and_match(input_ids, indices, extra_key).cached_len

    def evict(self, size: int) -> torch.Tensor:
        slots = self.manager.evict(size)
        for s in slots.tolist():
            for key in self._by_slot.pop(s, ()):
                del self._seen[key]
        return slots

    def reset(self) -> None:
        self.manager.reset()
        self._seen.clear()
        self._by_slot.clear()

    def lock_handle(self, handle: BaseCacheHandle, unlock: bool = False) -> None:
        self.manager.lock_handle(handle, unlock)

    def handle_indices(self, handle: BaseCacheHandle) -> torch.Tensor:
        return self.manager.handle_indices(handle)

    def cached_indices(self) -> torch.Tensor:
        return self.manager.cached_indices()

    @property
    def size_info(self) -> SizeInfo:
        return self.manager.size_info

    @property
    def visible_pages(self) -> int:
        """(tenant, page) grants held: how many private pages tenants may see, counted per tenant."""
        return len(self._seen)

    def check_integrity(self) -> None:
        """The wrapped manager's check, and: every grant names a cached page's first slot, once."""
        self.manager.check_integrity()
        cached = set(self.manager.cached_indices().tolist())
        by_slot = {k: s for s, keys in self._by_slot.items() for k in keys}
        if by_slot != self._seen:
            raise RuntimeError("visibility grants and their slot index disagree")
        stale = set(self._seen.values()) - cached
        if stale:
            raise RuntimeError(f"grants on slots no longer cached: {sorted(stale)[:5]}")


def replay_tenants(
    flow: RequestFlow, jobs: list[TenantJob], policy: str, *, decode: bool = True
) -> int:
    """Run ``jobs`` one after another under ``policy`` (see `POLICIES`); returns reused tokens.

    ``"shared"`` sends every request under ``extra_key=None``; ``"tenant"`` and ``"public"``
    under ``extra_key=job.tenant`` (for ``"public"`` the flow's manager must be a
    `PublicPrefixCache`). With ``decode`` the output is appended and cached too.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if (policy == "public") != isinstance(flow.manager, PublicPrefixCache):
        raise ValueError(f"policy {policy!r} needs a PublicPrefixCache exactly when 'public'")
    before = flow.stats.reused_tokens
    for job in jobs:
        req = flow.begin(job.prompt, extra_key=None if policy == "shared" else job.tenant)
        try:
            flow.mark_computed(req)
            if decode and job.output.shape[0]:
                flow.extend(req, job.output)
                flow.mark_computed(req)
            flow.finish(req)
        except BaseException:
            if flow.is_running(req):
                flow.abort(req)
            raise
    return flow.stats.reused_tokens - before
