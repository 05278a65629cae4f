"""Stateful test of RadixCacheManager against the reference cache, invariants after every step."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from radix_reference import ReferenceCache

from kvcache import RadixCacheHandle, RadixCacheManager, SizeInfo

SETTINGS = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)


def make_machine(page_size: int, policy: str):
    seqs = st.lists(st.integers(0, 2), min_size=1, max_size=4 * page_size + 3).map(tuple)

    class RadixMachine(RuleBasedStateMachine):
        @initialize()
        def setup(self) -> None:
            self.m = RadixCacheManager(page_size=page_size, eviction_policy=policy)
            self.ref = ReferenceCache(page_size)
            self.next_slot = 0
            self.handles: list[tuple[RadixCacheHandle, tuple]] = []  # locked
            self.matched: list[tuple[RadixCacheHandle, tuple]] = []
            self.stale: set = set()  # ids of handles whose path lost a node to eviction

        def fresh_slots(self, n: int) -> list[int]:
            pages = -(-n // page_size)
            first = self.next_slot
            self.next_slot += pages * page_size
            return list(range(first, first + n))

        @rule(seq=seqs)
        def insert(self, seq: tuple) -> None:
            slots = self.fresh_slots(len(seq))
            got = self.m.insert_prefix(torch.tensor(seq), torch.tensor(slots, dtype=torch.int32))
            assert got == self.ref.insert(seq, slots)

        @rule(seq=seqs, via_result=st.booleans())
        def insert_and_match(self, seq: tuple, via_result: bool) -> None:
            """The fused call: the same length as `insert_prefix`, and the handle of the whole
            aligned prefix, equal to what a match right after would give."""
            slots = self.fresh_slots(len(seq))
            res = self.m.insert_and_match(torch.tensor(seq), torch.tensor(slots, dtype=torch.int32))
            assert res.cached_len == self.ref.insert(seq, slots)
            k = len(seq) // page_size * page_size
            assert res.handle.cached_len == k
            assert self.m.handle_indices(res.handle).tolist() == self.ref.slots(seq, k)
            self.matched.append((res.handle, seq[:k]))

        @precondition(lambda self: self.ref.entries)
        @rule(seq=seqs, pick=st.integers(0, 10**6), where=st.integers(0, 10**6))
        def insert_held_slot(self, seq: tuple, pick: int, where: int) -> None:
            """A slot the tree holds, placed in the new part of an insert: refused, nothing changes."""
            k = self.ref.longest(seq)
            aligned = len(seq) // page_size * page_size
            if k == aligned:
                return  # nothing new: the slots are not looked at
            slots = self.fresh_slots(len(seq))
            held = sorted(self.ref.owner_of_slots())
            page = held[pick % len(held)] // page_size
            at = k + (where % ((aligned - k) // page_size)) * page_size
            slots[at : at + page_size] = range(page * page_size, page * page_size + page_size)
            before = (self.m.size_info, self.m.clock, sorted(self.m.cached_indices().tolist()))
            with pytest.raises(ValueError, match="already holds"):
                self.m.insert_prefix(torch.tensor(seq), torch.tensor(slots, dtype=torch.int32))
            assert (
                self.m.size_info,
                self.m.clock,
                sorted(self.m.cached_indices().tolist()),
            ) == before

        @precondition(lambda self: self.matched)
        @rule(i=st.integers(0, 1000))
        def unlock_unlocked(self, i: int) -> None:
            """A handle not locked now (as an object) cannot be unlocked, whatever else is locked."""
            handle, _ = self.matched[i % len(self.matched)]
            if any(h is handle for h, _ in self.handles):
                return
            before = (self.m.size_info, [n.ref_count for n in self.m.nodes()])
            with pytest.raises(RuntimeError, match="not locked"):
                self.m.lock_handle(handle, unlock=True)
            with pytest.raises(RuntimeError, match="not locked"):
                self.m.insert_and_unlock(
                    handle, torch.tensor([1]), torch.tensor([0], dtype=torch.int32)
                )
            assert (self.m.size_info, [n.ref_count for n in self.m.nodes()]) == before

        @rule(seq=seqs)
        def match(self, seq: tuple) -> None:
            handle, idx = self.m.match_prefix(torch.tensor(seq))
            k, slots = self.ref.match(seq)
            assert handle.cached_len == k and idx.tolist() == slots and idx.dtype == torch.int32
            self.matched.append((handle, seq[:k]))

        @precondition(lambda self: self.matched)
        @rule(i=st.integers(0, 1000))
        def lock(self, i: int) -> None:
            handle, prefix = self.matched[i % len(self.matched)]
            # A handle names nodes, not tokens: once any node of its path was evicted it stays
            # invalid, even if the same tokens are cached again since.
            if id(handle) in self.stale:
                with pytest.raises(RuntimeError, match="evicted"):
                    self.m.lock_handle(handle)
                return
            self.m.lock_handle(handle)
            self.handles.append((handle, prefix))  # empty (root) handles too: their locks count
            if prefix:
                self.ref.locks[prefix] = self.ref.locks.get(prefix, 0) + 1

        @precondition(lambda self: self.handles)
        @rule(i=st.integers(0, 1000))
        def unlock(self, i: int) -> None:
            handle, prefix = self.handles.pop(i % len(self.handles))
            self.m.lock_handle(handle, unlock=True)
            if prefix:
                self.ref.locks[prefix] -= 1
                if not self.ref.locks[prefix]:
                    del self.ref.locks[prefix]

        @rule(seq=seqs)
        def match_and_lock(self, seq: tuple) -> None:
            """The flow's fused steps 1-2: what `match` then `lock` give, in one call."""
            handle, idx = self.m.match_and_lock(torch.tensor(seq))
            k, slots = self.ref.match(seq)
            assert handle.cached_len == k and idx.tolist() == slots and idx.dtype == torch.int32
            self.matched.append((handle, seq[:k]))
            self.handles.append((handle, seq[:k]))
            if k:
                self.ref.locks[seq[:k]] = self.ref.locks.get(seq[:k], 0) + 1

        @precondition(lambda self: self.handles)
        @rule(i=st.integers(0, 1000), tail=seqs, extend=st.booleans(), relock=st.booleans())
        def insert_and_unlock(self, i: int, tail: tuple, extend: bool, relock: bool) -> None:
            """The flow's fused insert: ``extend`` continues the locked prefix (the walk may resume
            at the handle's node), otherwise any other sequence (a walk from the root). The same
            as `insert_and_match` then an unlock (and a lock of the new handle with ``relock``)."""
            j = i % len(self.handles)
            handle, prefix = self.handles[j]
            seq = prefix + tail if extend else tail
            slots = self.fresh_slots(len(seq))
            res = self.m.insert_and_unlock(
                handle, torch.tensor(seq), torch.tensor(slots, dtype=torch.int32), relock=relock
            )
            assert res.cached_len == self.ref.insert(seq, slots)
            k = len(seq) // page_size * page_size
            assert res.handle.cached_len == k
            assert self.m.handle_indices(res.handle).tolist() == self.ref.slots(seq, k)
            self.matched.append((res.handle, seq[:k]))
            self.handles.pop(j)
            if relock:
                self.handles.append((res.handle, seq[:k]))
                if k:
                    self.ref.locks[seq[:k]] = self.ref.locks.get(seq[:k], 0) + 1
            if prefix:
                self.ref.locks[prefix] -= 1
                if not self.ref.locks[prefix]:
                    del self.ref.locks[prefix]

        @precondition(lambda self: self.handles and self.ref.entries)
        @rule(i=st.integers(0, 1000), pick=st.integers(0, 10**6), tail=seqs)
        def insert_and_unlock_refused(self, i: int, pick: int, tail: tuple) -> None:
            """A refused fused insert (a held slot in the new part) changes nothing: the handle
            stays locked."""
            handle, prefix = self.handles[i % len(self.handles)]
            seq = prefix + tail
            k = self.ref.longest(seq)
            if k == len(seq) // page_size * page_size:
                return
            slots = self.fresh_slots(len(seq))
            page = sorted(self.ref.owner_of_slots())[pick % len(self.ref.owner_of_slots())]
            page //= page_size
            slots[k : k + page_size] = range(page * page_size, page * page_size + page_size)
            before = (
                self.m.size_info,
                self.m.clock,
                self.m.num_locked_handles,
                sorted(self.m.cached_indices().tolist()),
            )
            with pytest.raises(ValueError, match="already holds"):
                self.m.insert_and_unlock(
                    handle, torch.tensor(seq), torch.tensor(slots, dtype=torch.int32)
                )
            assert (
                self.m.size_info,
                self.m.clock,
                self.m.num_locked_handles,
                sorted(self.m.cached_indices().tolist()),
            ) == before

        @rule(size=st.integers(0, 20))
        def evict(self, size: int) -> None:
            evictable = self.ref.sizes()[0]
            leaves_before = [p for p in self.ref.leaves() if not self.ref.locked(p)]
            if size > evictable:
                with pytest.raises(RuntimeError):
                    self.m.evict(size)
                return
            out = self.m.evict(size).tolist()
            assert len(out) >= size and len(set(out)) == len(out)
            owner = self.ref.owner_of_slots()
            gone = {owner[s] for s in out}
            assert all(not self.ref.locked(p) for p in gone)
            prio = (
                (lambda p: self.ref.entries[p].used)
                if policy == "lru"
                else (lambda p: self.ref.entries[p].inserted)
            )
            oldest_evicted = max(prio(p) for p in gone) if gone else None
            before = {p: prio(p) for p in leaves_before}
            for h, prefix in self.matched:
                if any(prefix[:i] in gone for i in range(page_size, len(prefix) + 1, page_size)):
                    self.stale.add(id(h))
            for p in gone:
                del self.ref.entries[p]
            # Still prefix-closed: nothing cached hangs below an evicted prefix.
            assert all(
                q[:i] in self.ref.entries
                for q in self.ref.entries
                for i in range(page_size, len(q), page_size)
            )
            if gone:
                # Among leaves that were candidates from the start, none kept is older than one taken.
                taken = [t for p, t in before.items() if p in gone]
                kept = [t for p, t in before.items() if p not in gone]
                assert not taken or not kept or max(taken) <= min(kept), (
                    "evicted a newer leaf before an older one"
                )
                if policy == "lru":
                    # LRU pops in non-decreasing time: a parent is never older than its children.
                    remaining = [prio(p) for p in self.ref.leaves() if not self.ref.locked(p)]
                    assert all(oldest_evicted <= r for r in remaining), (
                        "evicted a newer leaf before an older one"
                    )

        @precondition(lambda self: not any(prefix for _, prefix in self.handles))
        @rule()
        def reset(self) -> None:
            self.m.reset()  # forgets the locks of empty handles with everything else
            self.handles.clear()
            self.ref = ReferenceCache(page_size)
            self.matched.clear()
            self.stale.clear()

        @invariant()
        def consistent(self) -> None:
            if not hasattr(self, "m"):
                return
            self.m.check_integrity()
            assert self.m.size_info == SizeInfo(*self.ref.sizes())
            assert sorted(self.m.cached_indices().tolist()) == sorted(self.ref.owner_of_slots())

    RadixMachine.TestCase.settings = SETTINGS
    return RadixMachine


TestRadixPS1LRU = make_machine(1, "lru").TestCase
TestRadixPS1FIFO = make_machine(1, "fifo").TestCase
TestRadixPS4LRU = make_machine(4, "lru").TestCase
TestRadixPS4FIFO = make_machine(4, "fifo").TestCase
TestRadixPS2LRU = make_machine(2, "lru").TestCase
