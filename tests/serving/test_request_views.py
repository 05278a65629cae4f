"""`Request` shows the flow's host arrays as tensors: the views behave as the old tensor fields
did (in-place writes reach the request, values handed out stay put), and appends of any size keep
ids and slots equal to a plain reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import NaiveCacheManager, PageAllocator, RadixCacheManager, Request, RequestFlow


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
@given(
    start=st.integers(1, 40),
    chunks=st.lists(st.integers(0, 70), max_size=8),
    ps=st.sampled_from([1, 3, 4, 16]),
    batch=st.booleans(),
)
def test_appends_match_a_list(start, chunks, ps, batch):
    """A request begun with ``start`` tokens and extended by chunks of any size (the request's
    arrays growing past their room, its last page filled before the next): ids are the tokens
    appended, slots the pages a fresh pool hands out in order, slot after slot."""
    rng = np.random.default_rng(start)
    flow = RequestFlow(NaiveCacheManager(page_size=ps), PageAllocator(-(-400 // ps), ps))
    ids = list(rng.integers(0, 1000, start))
    r = flow.begin(torch.tensor(ids))
    for k in chunks:
        new = list(rng.integers(0, 1000, k))
        out = (
            flow.extend_batch([r], [torch.tensor(new, dtype=torch.int64)])[0]
            if batch
            else flow.extend(r, torch.tensor(new, dtype=torch.int64))
        )
        assert out.tolist() == list(range(len(ids), len(ids) + k))
        ids += new
        assert len(r) == len(ids)
        assert r.input_ids.tolist() == ids and r.indices.tolist() == list(range(len(ids)))
    flow.check_integrity()
