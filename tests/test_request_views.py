"""`Request` shows the flow's host copy as tensors: the views behave as the old tensor fields did
(in-place writes reach the request, values handed out stay put), and appends of any size keep
ids and slots equal to a plain reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import PageAllocator, RadixCacheManager, RequestFlow
from kvcache.serving.request import HostCopy, Request


def t(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def test_a_write_through_indices_reaches_the_request():
    """Chapter 4 corrupts a request with ``r.indices[0] = 5``; check_integrity must see it."""
    flow = RequestFlow(RadixCacheManager(), PageAllocator(8))
    r = flow.begin(t(1, 2))
    flow.mark_computed(r)
    flow.finish(r)
    r = flow.begin(t(1, 2, 3))
    r.indices[0] = 5
    assert r.indices[0] == 5
    with pytest.raises(RuntimeError, match="not the tree's"):
        flow.check_integrity()


def test_tensors_handed_out_keep_their_values():
    flow = RequestFlow(RadixCacheManager(), PageAllocator(16))
    a, b = flow.begin(t(1, 2, 3)), flow.begin(t(1, 2, 3))
    for r in (a, b):
        flow.mark_computed(r)
    before_ids, before_idx = b.input_ids, b.indices
    flow.extend(b, t(4, 5))
    flow.cache(a)
    flow.cache(b)  # b's first three slots become a's
    assert before_ids.tolist() == [1, 2, 3] and before_idx.tolist() == [3, 4, 5]
    assert b.indices[:3].tolist() == a.indices[:3].tolist() == [0, 1, 2]
    flow.check_integrity()


def test_assigning_tensors_replaces_the_host_copy():
    r = Request(0, t(1, 2, 3), torch.tensor([7, 8, 9], dtype=torch.int32), None, 0, 0)  # type: ignore[arg-type]
    assert r.input_ids.tolist() == [1, 2, 3] and r.indices.tolist() == [7, 8, 9] and len(r) == 3
    r.indices = torch.tensor([4, 5, 6], dtype=torch.int32)
    assert r.indices.tolist() == [4, 5, 6] and r.input_ids.tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match="3 ids but 2 slots"):
        r.indices = torch.tensor([1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="differ in shape"):
        Request(0, t(1, 2), torch.tensor([1], dtype=torch.int32), None, 0, 0)  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(start=st.integers(0, 40), chunks=st.lists(st.integers(0, 70), max_size=8), prefix=st.integers(0, 20))
def test_host_copy_appends_match_a_list(start, chunks, prefix):
    rng = np.random.default_rng(start)
    ids = list(rng.integers(0, 1000, start))
    slots = list(rng.integers(0, 1000, start).astype(np.int32))
    m = min(prefix, start)
    h = HostCopy(np.array(ids, dtype=np.int64), np.array(slots[m:], dtype=np.int32), np.array(slots[:m], dtype=np.int32))
    for k in chunks:
        new_ids, new_slots = list(rng.integers(0, 1000, k)), list(rng.integers(0, 1000, k))
        h.append(np.array(new_ids, dtype=np.int64), np.array(new_slots, dtype=np.int32))
        ids += new_ids
        slots += new_slots
        assert h.length == len(ids)
        assert h.ids[:h.length].tolist() == ids and h.slots[:h.length].tolist() == slots
