"""`LeafHeap` against a sorted reference: entries that arrive in increasing order go to a run
beside the heap, the rest to the heap; `pop` must still return the smallest current priority,
however filings, re-stamps (lazy: the heap is not told) and pops interleave."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.managers.eviction import FIFOPolicy, LeafHeap, LRUPolicy


@dataclass
class Leaf:
    uuid: int
    timestamp: int
    insert_time: int


ops = st.lists(
    st.tuples(st.sampled_from(["file_new", "file_old", "touch", "pop"]), st.integers(0, 10**6)),
    max_size=80,
)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(ops=ops, lru=st.booleans())
def test_pop_returns_the_smallest_current_priority(ops: list[tuple[str, int]], lru: bool) -> None:
    policy = LRUPolicy() if lru else FIFOPolicy()
    heap: LeafHeap[Leaf] = LeafHeap(policy.flat_priority)
    uuid = 0
    filed: dict[int, Leaf] = {}  # the reference: what is filed now
    unfiled: list[Leaf] = []  # popped leaves, filed again later under an old time
    for clock, (op, x) in enumerate(ops, start=1):
        if op == "file_new":  # a new leaf: the largest priority so far (the run's case)
            leaf = Leaf(uuid, clock, clock)
            uuid += 1
            heap.file(leaf)
            filed[leaf.uuid] = leaf
        elif op == "file_old" and unfiled:  # an older leaf filed again (the heap's case)
            leaf = unfiled.pop(x % len(unfiled))
            heap.file(leaf)
            filed[leaf.uuid] = leaf
        elif op == "touch" and filed:  # a match stamps a filed leaf; the heap is not told
            leaf = list(filed.values())[x % len(filed)]
            leaf.timestamp = clock
        elif op == "pop" and filed:
            want = min(filed.values(), key=policy.flat_priority)
            got = heap.pop(lambda n: True)
            assert got is want
            del filed[got.uuid]
            unfiled.append(got)
        assert len(heap) >= len(filed)
        assert all(heap.is_filed(leaf) for leaf in filed.values())
    while filed:  # drain: every filed leaf comes out, smallest first
        want = min(filed.values(), key=policy.flat_priority)
        assert heap.pop(lambda n: True) is want
        del filed[want.uuid]
