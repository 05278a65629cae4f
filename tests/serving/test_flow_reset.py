"""`RequestFlow.reset_prefix_cache`: every cached page back to the allocator, refused while running."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import (
    BlockHashCacheManager,
    NaiveCacheManager,
    PageAllocator,
    RadixCacheManager,
    RequestFlow,
)


def serve(flow: RequestFlow, ids: list) -> None:
    r = flow.begin(torch.tensor(ids))
    flow.mark_computed(r)
    flow.finish(r)


def make(kind: str, page_size: int) -> RequestFlow:
    manager = {
        "radix": lambda: RadixCacheManager(page_size=page_size),
        "block": lambda: BlockHashCacheManager(page_size=page_size),
        "naive": lambda: NaiveCacheManager(),
    }[kind]()
    return RequestFlow(manager, PageAllocator(16, manager.page_size))  # the naive manager's is 1


def test_reset_after_manager_reset_would_lose_pages():
    """The found case: ``flow.manager.reset()`` loses the cached pages; the flow's reset does not."""
    flow = make("radix", 1)
    serve(flow, [1, 2, 3])
    assert flow.reset_prefix_cache() == 3
    assert flow.manager.size_info.total_size == 0 and flow.allocator.num_free_pages == 16
    flow.check_integrity()
    serve(flow, [1, 2, 3])  # nothing reused, everything computed again
    assert flow.stats.reused_tokens == 0


@pytest.mark.parametrize("kind", ["radix", "block", "naive"])
def test_reset_refused_while_running_changes_nothing(kind):
    flow = make(kind, 2)
    serve(flow, [1, 2, 3, 4])
    r = flow.begin(torch.tensor([1, 2, 3, 4, 5]))
    before = (
        flow.manager.size_info,
        flow.allocator.free_pages().tolist(),
        r.indices.tolist(),
        r.tree_len,
    )
    with pytest.raises(RuntimeError, match="1 requests are running"):
        flow.reset_prefix_cache()
    assert (
        flow.manager.size_info,
        flow.allocator.free_pages().tolist(),
        r.indices.tolist(),
        r.tree_len,
    ) == before
    flow.check_integrity()
    flow.abort(r)
    flow.reset_prefix_cache()
    assert flow.allocator.num_free_pages == 16
    flow.check_integrity()


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    kind=st.sampled_from(["radix", "block", "naive"]),
    page_size=st.sampled_from([1, 2, 4]),
    prompts=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=8),
)
def test_reset_returns_every_cached_page(kind, page_size, prompts):
    flow = make(kind, page_size)
    for p in prompts:
        if -(-len(p) // page_size) <= flow.available_pages():
            serve(flow, p)
    cached = flow.manager.size_info.total_size
    assert flow.reset_prefix_cache() == cached
    assert flow.manager.size_info.total_size == 0
    assert flow.allocator.num_free_pages == flow.allocator.num_pages
    flow.check_integrity()
