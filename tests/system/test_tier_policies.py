"""The host tier's write policies and what it shows a scheduler and a router (issue 30 items 2
and 8), each against the SGLang behaviour it follows:

* SGLang ``python/sglang/srt/mem_cache/hiradix_cache.py``: ``load_back`` copies a node's host
  value back and keeps ``node.host_value``; ``_evict_backuped`` then only frees the device
  slots (the "GPU -> CPU demotion" copies nothing), so our ``"write_back_inclusive"``;
  ``write_through_threshold = 1 if write_through else 2`` (``write_through_selective``: a
  node reaches the host on its second hit); a node evicted without a host copy is deleted
  (``_evict_regular``); KV events carry their medium (``_record_remove_event(node,
  medium=StorageMedium.GPU)``).
* SGLang's and mini-sglang's schedulers match the waiting queue to order it; SGLang's
  ``match_prefix`` only reports a host hit (``host_hit_length``) and the scheduler loads it back
  when it admits the request (``init_load_back``). Ours: `peek_prefix` looks, ``begin`` loads.
"""

from __future__ import annotations

import pytest
import torch
from conftest import ids

from kvcache import (
    KVCacheLayout,
    MHAKVCache,
    PageAllocator,
    RadixCacheManager,
    RequestFlow,
    Scheduler,
    TieredCacheManager,
    TieredPrefixMirror,
)

pytestmark = pytest.mark.usefixtures("torch_store")


def tier_flow(policy: str, device_pages: int = 4, host_pages: int = 16, ps: int = 2, **kw):
    pool = MHAKVCache(1, 1, 2, device_pages, torch.float32, KVCacheLayout.LayerFirst, "cpu", ps)
    alloc = PageAllocator(device_pages, ps)
    tier = TieredCacheManager(
        RadixCacheManager(page_size=ps, events=True), pool, alloc, host_pages, policy=policy, **kw
    )
    return tier, RequestFlow(tier, alloc)


def serve(flow: RequestFlow, *tokens: int) -> int:
    req = flow.begin(ids(*tokens))
    flow.mark_computed(req)
    flow.finish(req)
    flow.manager.check_integrity()
    return req.reused_len


def push_out(flow: RequestFlow) -> None:
    """Evict every evictable device page (to host, as the policy says)."""
    tier = flow.manager
    flow.allocator.free_slots(tier.evict(tier.size_info.evictable_size))


@pytest.mark.parametrize("policy", ["write_back", "write_back_inclusive"])
def test_inclusive_write_back_copies_a_page_once(policy: str) -> None:
    """Evicted, loaded back, evicted again: the exclusive write-back copies the pages twice
    (the load freed their host copies); the inclusive one, as SGLang's ``load_back``, once."""
    tier, flow = tier_flow(policy)
    serve(flow, 1, 2, 3, 4, 5, 6)
    push_out(flow)
    assert tier.stats.saved_pages == 3
    assert serve(flow, 1, 2, 3, 4, 5, 6, 7) == 6  # back from host
    if policy == "write_back_inclusive":
        assert len(tier.host_prefixes()) == 3  # the host copies stayed
    else:
        assert not tier.host_prefixes()  # moved, not copied
    push_out(flow)
    assert tier.stats.saved_pages == (3 if policy == "write_back_inclusive" else 6)
    assert serve(flow, 1, 2, 3, 4, 5, 6, 9) == 6
    tier.check_integrity()


def test_selective_write_through_writes_a_page_on_its_second_hit() -> None:
    """SGLang's ``write_through_selective`` with ``write_through_threshold`` 2: a page reaches
    the host when it is hit the second time; one evicted before that is dropped."""
    tier, flow = tier_flow("write_through_selective")
    serve(flow, 1, 2, 3, 4)  # inserted: no hit yet
    serve(flow, 9, 8)
    assert serve(flow, 1, 2, 3, 4, 5) == 4  # first hit
    assert not tier.host_prefixes()
    assert serve(flow, 1, 2, 3, 4, 6) == 4  # second hit: both pages copied to host
    assert {pre for _, pre in tier.host_prefixes()} == {(1, 2), (1, 2, 3, 4)}
    push_out(flow)
    assert tier.stats.dropped_pages >= 1  # (9, 8) was never hit: dropped, not copied
    assert {pre for _, pre in tier.host_prefixes()} == {(1, 2), (1, 2, 3, 4)}
    assert serve(flow, 1, 2, 3, 4, 7) == 4  # back from host
    assert serve(flow, 9, 8, 7) == 0
    tier.check_integrity()


def test_write_through_threshold_is_checked() -> None:
    with pytest.raises(ValueError, match="write_through_threshold"):
        tier_flow("write_through_selective", write_through_threshold=0)
    with pytest.raises(ValueError, match="policy"):
        tier_flow("write_around")


def test_peek_only_looks() -> None:
    """`peek_prefix` counts device, then host pages, and moves nothing: no load, no LRU."""
    tier, flow = tier_flow("write_back")
    serve(flow, 1, 2, 3, 4, 5, 6)
    push_out(flow)
    serve(flow, 1, 2, 7, 7)  # (1, 2) back on the device, (3, 4), (5, 6) on the host
    before = (tier.device_prefixes(), tier.host_prefixes(), repr(tier.stats))
    assert tier.peek_prefix(ids(1, 2, 3, 4, 5, 6, 0)) == 6
    assert tier.peek_prefix(ids(1, 2, 3, 9)) == 2
    assert tier.peek_prefix(ids(1, 2, 3, 4), extra_key="other") == 0
    assert (tier.device_prefixes(), tier.host_prefixes(), repr(tier.stats)) == before


def test_lpm_on_a_tier_loads_only_what_it_admits() -> None:
    """LPM orders the queue by device + host matches (SGLang counts host hits in a request's
    match) without loading anything; a request's prefix comes back from host when, and only
    when, the request is admitted."""
    tier, flow = tier_flow("write_back", device_pages=8, host_pages=32)
    sched = Scheduler(flow, token_budget=64, max_batch=1, policy="lpm")
    for p in ([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]):
        sched.submit(torch.tensor(p), 1, forced=ids(0))
        sched.run()
    push_out(flow)
    assert len(tier.host_prefixes()) == 6
    hog = sched.submit(ids(20, 21), 6, forced=ids(0, 0, 0, 0, 0, 0))
    sched.step()  # the hog runs; max_batch=1 keeps the rest waiting
    cold = sched.submit(ids(30, 31, 32), 1, forced=ids(0))
    warm = sched.submit(ids(7, 8, 9, 10, 11, 12, 13), 1, forced=ids(0))
    while sched.requests[hog].status == "running":
        before = (tier.host_prefixes(), tier.stats.loaded_pages)
        rec = sched.step()
        if not rec.admitted:
            assert (tier.host_prefixes(), tier.stats.loaded_pages) == before  # looked only
    rec = sched.step()
    assert rec.admitted == (warm,)  # LPM: its host-held prefix counted
    assert tier.stats.loaded_pages == 3  # its three pages, and nothing of the other prompt
    sched.run()
    assert sched.requests[cold].status == "finished"
    sched.check_integrity()
    tier.check_integrity()


def test_tier_events_follow_both_tiers() -> None:
    """Replaying ``take_tier_events()`` into a `TieredPrefixMirror` gives both tiers, and its
    match counts a prefix held partly on the device and partly on the host."""
    tier, flow = tier_flow("write_back", events=True)
    mirror = TieredPrefixMirror(2)
    serve(flow, 1, 2, 3, 4, 5, 6)
    push_out(flow)
    serve(flow, 1, 2, 9, 9)
    mirror.apply(tier.take_tier_events())
    assert {k for k in mirror.pages("device")} == set(tier.device_prefixes())
    assert {k for k in mirror.pages("host")} == set(tier.host_prefixes())
    assert mirror.match(ids(1, 2, 3, 4, 5, 6, 7)) == 6
    assert mirror.mirrors["device"].match(ids(1, 2, 3, 4, 5, 6, 7)) == 2
    flow.reset_prefix_cache()
    mirror.apply(tier.take_tier_events())
    assert not mirror.pages("device") and not mirror.pages("host")
    with pytest.raises(TypeError, match="TierEvent"):
        mirror.apply([None])
