"""The source document's worked examples, reproduced exactly (with its errors corrected)."""

import pytest
import torch
from conftest import ids, slots

from kvcache import NaiveCacheManager, PageAllocator, RadixCacheManager, RequestFlow, SizeInfo

# Token ids standing for the words of the examples.
HELLO, WORLD, HOW, ARE, YOU, THERE, WHAT, IS, YOUR, NAME = range(10, 20)


def test_section7_hello_world_flow():
    """§7: "Hello world" cached; "Hello world how are you" reuses 2 tokens and computes 3."""
    manager, alloc = RadixCacheManager(), PageAllocator(32)
    flow = RequestFlow(manager, alloc)
    first = flow.begin(ids(HELLO, WORLD))
    flow.mark_computed(first)
    flow.finish(first)
    hello_world_slots = first.indices.clone()

    req = flow.begin(ids(HELLO, WORLD, HOW, ARE, YOU))  # steps 1-3
    assert req.reused_len == 2 and req.tree_len == 2
    assert torch.equal(req.indices[:2], hello_world_slots)
    assert len(req.out_loc) == 3  # only [how, are, you] need K/V
    assert manager.size_info == SizeInfo(0, 2)  # step 2 protected the matched path
    flow.mark_computed(req)  # step 6
    free_before = alloc.num_free_pages
    already = flow.finish(req)  # steps 4, 5, 7
    assert already == 2
    # Step 5 corrected: the two matched pages belong to the tree and are NOT freed.
    assert alloc.num_free_pages == free_before
    assert manager.size_info == SizeInfo(5, 0)
    handle, idx = manager.match_prefix(ids(HELLO, WORLD, HOW, ARE, YOU))
    assert handle.cached_len == 5 and torch.equal(idx, req.indices)
    flow.check_integrity()


def test_section7_freeing_matched_prefix_corrupts_the_cache():
    """What the source's step 5 (free indices[:already_cached]) would do: a page both free and cached."""
    manager, alloc = RadixCacheManager(), PageAllocator(8)
    flow = RequestFlow(manager, alloc)
    first = flow.begin(ids(HELLO, WORLD))
    flow.mark_computed(first)
    flow.finish(first)
    req = flow.begin(ids(HELLO, WORLD, HOW))
    flow.mark_computed(req)
    already = flow.finish(req)
    alloc.free(alloc.slots_to_pages(req.indices[:already]))  # the source's step 5
    with pytest.raises(RuntimeError, match="owned twice"):
        flow.check_integrity()


def test_section12_naive_lifecycle():
    """§12.2.3: allocate 5, insert returns 5, free all 5: no leak, no reuse."""
    manager, alloc = NaiveCacheManager(), PageAllocator(16)
    flow = RequestFlow(manager, alloc)
    req = flow.begin(ids(HELLO, WORLD, HOW, ARE, YOU))
    assert req.reused_len == 0 and len(req.out_loc) == 5
    assert alloc.num_free_pages == 11
    flow.mark_computed(req)
    assert flow.finish(req) == 5
    assert alloc.num_free_pages == 16
    assert manager.size_info == SizeInfo(0, 0)
    # §12.2.1: the second request sharing "Hello world" recomputes everything: 5 + 6 = 11.
    req2 = flow.begin(ids(HELLO, WORLD, WHAT, IS, YOUR, NAME))
    assert req2.reused_len == 0
    flow.mark_computed(req2)
    flow.finish(req2)
    assert flow.stats.computed_tokens == 11
    flow.check_integrity()


def test_section12_radix_reuses_hello_world():
    """Challenge 12: with the radix manager the same two requests compute 5 + 4 = 9 tokens."""
    flow = RequestFlow(RadixCacheManager(), PageAllocator(16))
    for prompt in (ids(HELLO, WORLD, HOW, ARE, YOU), ids(HELLO, WORLD, WHAT, IS, YOUR, NAME)):
        req = flow.begin(prompt)
        flow.mark_computed(req)
        flow.finish(req)
    assert flow.stats.computed_tokens == 9
    flow.check_integrity()


def test_section13_3_2_split():
    """§13.3.2: [Hello, world] split at 1 gives root -> [Hello] -> [world], ref count inherited."""
    m = RadixCacheManager()
    m.insert_prefix(ids(HELLO, WORLD), slots(1, 2))
    (node,) = m.root_node.children.values()
    handle, _ = m.match_prefix(ids(HELLO, WORLD))
    m.lock_handle(handle)
    h, idx = m.match_prefix(ids(HELLO, THERE))  # partial match splits the node
    assert h.cached_len == 1 and idx.tolist() == [1]
    (prefix,) = m.root_node.children.values()
    assert prefix is h.node and prefix is not node
    assert prefix.key.tolist() == [HELLO] and prefix.value.tolist() == [1]
    assert node.key.tolist() == [WORLD] and node.value.tolist() == [2]
    assert node.parent is prefix and prefix.parent is m.root_node
    assert prefix.children == {WORLD: node}
    assert prefix.ref_count == node.ref_count == 1  # the new node inherits the lock
    m.check_integrity()
    m.lock_handle(handle, unlock=True)
    assert prefix.ref_count == 0 and m.size_info == SizeInfo(2, 0)
    m.check_integrity()


def _section13_4_tree():
    """Run §13.4's three requests; return the flow and the running Request 3."""
    manager, alloc = RadixCacheManager(), PageAllocator(16)
    flow = RequestFlow(manager, alloc)
    r1 = flow.begin(ids(HELLO, WORLD))
    flow.mark_computed(r1)
    flow.finish(r1)
    r2 = flow.begin(ids(HELLO, THERE))
    flow.mark_computed(r2)
    flow.finish(r2)
    r3 = flow.begin(ids(HELLO, WORLD, HOW, ARE, YOU))
    flow.mark_computed(r3)
    flow.cache(r3)  # Request 3 is in the tree and still running (locked)
    return flow, r1, r2, r3


def test_section13_4_tree_shape_and_refcounts():
    flow, r1, r2, _r3 = _section13_4_tree()
    m = flow.manager
    (node1,) = m.root_node.children.values()
    assert node1.key.tolist() == [HELLO]
    node2, node3 = node1.children[WORLD], node1.children[THERE]
    node4 = node2.children[HOW]
    assert node2.key.tolist() == [WORLD] and node3.key.tolist() == [THERE]
    assert node4.key.tolist() == [HOW, ARE, YOU]
    assert (node1.ref_count, node2.ref_count, node3.ref_count, node4.ref_count) == (1, 1, 0, 1)
    assert node1.value.tolist() == r1.indices[:1].tolist()
    assert node3.value.tolist() == r2.indices[1:].tolist()
    assert m.size_info == SizeInfo(evictable_size=1, protected_size=5)
    flow.check_integrity()


def test_section13_4_eviction_fails_while_request3_runs_then_frees_4():
    flow, _, _, r3 = _section13_4_tree()
    m = flow.manager
    before = [(n.uuid, n.ref_count, n.length) for n in m.nodes()]
    # Step 5: only [there] (1 token) is evictable; asking for 2 must fail and change nothing
    # (the code the source describes pops an empty heap here).
    with pytest.raises(RuntimeError, match="only 1 are evictable"):
        m.evict(2)
    assert [(n.uuid, n.ref_count, n.length) for n in m.nodes()] == before
    m.check_integrity()
    # Once Request 3 ends, evict(2) takes [there] (1) then [how are you] (3): 4 tokens.
    flow.finish(r3)
    evicted = m.evict(2)
    assert len(evicted) == 4
    flow.allocator.free(flow.allocator.slots_to_pages(evicted))
    (node1,) = m.root_node.children.values()
    assert node1.key.tolist() == [HELLO] and list(node1.children) == [WORLD]
    assert node1.children[WORLD].is_leaf()
    assert m.size_info == SizeInfo(2, 0)
    flow.check_integrity()


def test_section13_6_identical_requests_refresh_timestamp():
    m = RadixCacheManager()
    m.insert_prefix(ids(HELLO, WORLD), slots(1, 2))
    (node,) = m.root_node.children.values()
    t0 = node.timestamp
    m.match_prefix(ids(HELLO, WORLD))
    t1 = node.timestamp
    m.match_prefix(ids(HELLO, WORLD))
    t2 = node.timestamp
    assert t0 < t1 < t2 and m.num_nodes == 1


def test_section8_4_evict_frees_whole_prefixes():
    """§8.4: asking for 5 tokens may free a whole 10-token prefix."""
    m = RadixCacheManager()
    m.insert_prefix(torch.arange(100, 110), torch.arange(0, 10, dtype=torch.int32))
    m.insert_prefix(ids(HOW, ARE, YOU), slots(10, 11, 12))
    evicted = m.evict(5)
    assert sorted(evicted.tolist()) == list(range(10))  # the older, 10-token prefix
    assert m.size_info == SizeInfo(3, 0)


def test_section11_4_memory_example_matches_allocator_geometry():
    """§11.4: 1000 pages of one token on TP 4: page p is slot p."""
    alloc = PageAllocator(1000, page_size=1)
    assert alloc.num_slots == 1000
    assert alloc.pages_to_slots(torch.tensor([5, 12], dtype=torch.int32)).tolist() == [5, 12]
