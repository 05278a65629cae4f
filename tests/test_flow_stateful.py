"""RequestFlow under any sequence of calls: a reference of what each slot holds, pages accounted
after every step (free + cached + held = all, none twice), for page sizes 1 and 4, LRU and FIFO."""

from __future__ import annotations

from typing import Dict, List

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

from kvcache import NaiveCacheManager, PageAllocator, RadixCacheManager, Request, RequestFlow

SETTINGS = settings(max_examples=50, stateful_step_count=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])
NUM_PAGES = 12


def make_machine(page_size: int, policy: str, naive: bool = False):
    seqs = st.lists(st.integers(0, 2), min_size=1, max_size=3 * page_size + 2)

    class FlowMachine(RuleBasedStateMachine):
        requests = Bundle("requests")

        @initialize()
        def setup(self) -> None:
            manager = NaiveCacheManager() if naive else RadixCacheManager(page_size=page_size, eviction_policy=policy)
            self.flow = RequestFlow(manager, PageAllocator(NUM_PAGES, page_size))
            # What the "model" wrote to each slot: (position, token) -- K/V depend on both.
            self.slot_holds: Dict[int, tuple] = {}

        def store(self, req: Request) -> None:
            for pos in range(req.num_computed, len(req)):
                self.slot_holds[int(req.indices[pos])] = (pos, int(req.input_ids[pos]), tuple(req.input_ids[:pos].tolist()))
            self.flow.mark_computed(req)

        def check_request(self, req: Request) -> None:
            """Every computed token's slot holds exactly that token's K/V (same prefix)."""
            for pos in range(req.num_computed):
                expected = (pos, int(req.input_ids[pos]), tuple(req.input_ids[:pos].tolist()))
                assert self.slot_holds.get(int(req.indices[pos])) == expected

        @rule(target=requests, seq=seqs, compute=st.booleans())
        def begin(self, seq: List[int], compute: bool):
            pages_needed = -(-len(seq) // page_size)
            if pages_needed > self.flow.available_pages():
                # It may still fit thanks to a cached prefix; if not, nothing may change.
                free = self.flow.allocator.num_free_pages
                try:
                    req = self.flow.begin(torch.tensor(seq))
                except RuntimeError:
                    assert self.flow.allocator.num_free_pages == free
                    return None
            else:
                req = self.flow.begin(torch.tensor(seq))
            self.check_request(req)
            if compute:
                self.store(req)
            return req

        @rule(req=requests)
        def compute(self, req) -> None:
            if req is not None and not req.finished:
                self.store(req)

        @rule(req=requests, seq=seqs)
        def extend(self, req, seq: List[int]) -> None:
            if req is None or req.finished or req.num_computed != len(req):
                return
            try:
                slots = self.flow.extend(req, torch.tensor(seq))
            except RuntimeError:
                return  # out of pages; the pool is untouched (checked by the invariant)
            assert len(slots) == len(seq)
            self.store(req)

        @rule(req=requests)
        def cache(self, req) -> None:
            if req is None or req.finished:
                return
            self.flow.cache(req)
            self.check_request(req)
            handle, idx = self.flow.manager.match_prefix(req.input_ids)
            if not naive:
                # Everything computed in whole pages is now in the tree, at the request's own indices.
                assert handle.cached_len >= req.num_computed // page_size * page_size
                assert torch.equal(idx[: req.tree_len], req.indices[: req.tree_len])

        @rule(req=consumes(requests))
        def finish(self, req) -> None:
            if req is None or req.finished:
                return
            if req.num_computed != len(req):
                with pytest.raises(RuntimeError, match="without stored K/V"):
                    self.flow.finish(req)
                self.store(req)
            self.flow.finish(req)
            with pytest.raises(RuntimeError, match="not running"):
                self.flow.finish(req)

        @rule(req=consumes(requests))
        def abort(self, req) -> None:
            if req is not None and not req.finished:
                self.flow.abort(req)

        @rule(seq=seqs)
        def match_returns_what_was_stored(self, seq: List[int]) -> None:
            handle, idx = self.flow.manager.match_prefix(torch.tensor(seq))
            for pos in range(handle.cached_len):
                assert self.slot_holds[int(idx[pos])] == (pos, seq[pos], tuple(seq[:pos]))

        @invariant()
        def pages_partitioned(self) -> None:
            if hasattr(self, "flow"):
                self.flow.check_integrity()
                for req in self.flow.running.values():
                    self.check_request(req)

    FlowMachine.TestCase.settings = SETTINGS
    return FlowMachine


TestFlowPS1LRU = make_machine(1, "lru").TestCase
TestFlowPS1FIFO = make_machine(1, "fifo").TestCase
TestFlowPS4LRU = make_machine(4, "lru").TestCase
TestFlowPS4FIFO = make_machine(4, "fifo").TestCase
TestFlowNaive = make_machine(1, "lru", naive=True).TestCase
