"""`LeafHeap` against a sorted reference: entries that arrive in increasing order go to a run
beside the heap, the rest to the heap; `pop` must still return the smallest current priority,
however filings, re-stamps and pops interleave. With a monotone key (LRU, FIFO) a re-stamp is
not told to the heap (lazy); with one that is not (MRU: ``-timestamp``), the leaf is filed again
at every re-stamp, as the manager does."""

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
    hit_count: int = 1

    @property
    def length(self) -> int:
        return 1


class MRU:
    """Most recently used first: its priority falls with every use."""

    def priority(self, node: Leaf) -> tuple[int, int]:
        return (-node.timestamp, node.uuid)


ops = st.lists(
    st.tuples(st.sampled_from(["file_new", "file_old", "touch", "pop"]), st.integers(0, 10**6)),
    max_size=80,
)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(ops=ops, policy=st.sampled_from(["lru", "fifo", "mru"]))
def test_pop_returns_the_smallest_current_priority(ops: list[tuple[str, int]], policy: str) -> None:
    pol = {"lru": LRUPolicy(), "fifo": FIFOPolicy(), "mru": MRU()}[policy]
    monotone = policy != "mru"
    heap: LeafHeap[Leaf] = LeafHeap(pol.priority, monotone)
    uuid = 0
    filed: dict[int, Leaf] = {}  # the reference: what is filed now
    unfiled: list[Leaf] = []  # popped leaves, filed again later under an old time
    for clock, (op, x) in enumerate(ops, start=1):
        if op == "file_new":  # a new leaf: the largest time so far (the run's case under LRU)
            leaf = Leaf(uuid, clock, clock)
            uuid += 1
            heap.file(leaf)
            filed[leaf.uuid] = leaf
        elif op == "file_old" and unfiled:  # an older leaf filed again (the heap's case)
            leaf = unfiled.pop(x % len(unfiled))
            heap.file(leaf)
            filed[leaf.uuid] = leaf
        elif op == "touch" and filed:  # a match stamps a filed leaf
            leaf = list(filed.values())[x % len(filed)]
            leaf.timestamp = clock
            if not monotone:
                heap.file(leaf)  # the manager files it again; a monotone key's heap is lazy
        elif op == "pop" and filed:
            want = min(filed.values(), key=pol.priority)
            got = heap.pop(lambda n: True)
            assert got is want
            del filed[got.uuid]
            unfiled.append(got)
        assert all(heap.is_filed(leaf) for leaf in filed.values())
    while filed:  # drain: every filed leaf comes out, smallest first
        want = min(filed.values(), key=pol.priority)
        assert heap.pop(lambda n: True) is want
        del filed[want.uuid]


def test_superseded_entries_are_compacted() -> None:
    """A leaf filed again at every use leaves one superseded entry a time: they are dropped
    once they outnumber the live ones, so the heap stays within a bound of the leaves."""
    heap: LeafHeap[Leaf] = LeafHeap(MRU().priority, False)
    leaves = [Leaf(u, 0, 0) for u in range(10)]
    for clock in range(1, 5000):
        leaf = leaves[clock % 10]
        leaf.timestamp = clock
        heap.file(leaf)
        assert len(heap) <= 2 * 10 + 2 * 1024 + 1
    assert heap.pop(lambda n: True) is max(leaves, key=lambda n: n.timestamp)
