"""`match_and_lock(..., out=)` (`takes_out_array`): radix writes a match's slots into the
caller's array, the flow's request slot array, instead of an array of its own. Same decisions
and state as without ``out``, the slots at ``out[:cached_len]`` (the rest untouched), bad
``out`` refused changing nothing, and a flow that passes ``out`` only where a manager says so."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from conftest import observe
from conftest import unchanged as watch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import PageAllocator, RadixCacheManager, RequestFlow
from kvcache.managers.base import out_array_safe, takes_host_arrays


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    ps=st.sampled_from([1, 2, 4]),
    ops=st.lists(
        st.tuples(st.booleans(), st.lists(st.integers(0, 3), max_size=12), st.integers(0, 3)),
        min_size=1,
        max_size=20,
    ),
)
def test_out_gives_the_same_answers_and_state(ps, ops):
    """Two radix managers, one matching into ``out``: equal handles, slots and state after
    every step; the slots a view of ``out``'s start, the rest of ``out`` as it was."""
    a, b = RadixCacheManager(page_size=ps), RadixCacheManager(page_size=ps)
    fresh = 0
    held: list[tuple[Any, Any, list[int]]] = []
    for match, toks, spare in ops:
        ids = np.array(toks, dtype=np.int64)
        if match or not held:
            ha, sa = a.match_and_lock(ids)
            out = np.full(len(toks) + spare, -1, dtype=np.int32)
            hb, sb = b.match_and_lock(ids, out=out)
            m = hb.cached_len
            assert ha.cached_len == m and sa.tolist() == sb.tolist()
            assert sb.base is out or m == 0
            assert out[:m].tolist() == sa.tolist() and (out[m:] == -1).all()
            held.append((ha, hb, toks))
        else:  # insert a held prefix with new whole pages, unlocking it
            ha, hb, base = held.pop(spare % len(held))
            seq = base + toks
            old = a.handle_indices(ha).tolist() if ha.cached_len else []
            k = -(-(len(seq) - len(old)) // ps)
            slots = np.array(
                (old + list(range(fresh * ps, (fresh + k) * ps)))[: len(seq)], np.int32
            )
            fresh += k
            ra = a.insert_and_unlock(ha, np.array(seq, np.int64), slots)
            rb = b.insert_and_unlock(hb, np.array(seq, np.int64), slots)
            assert ra.cached_len == rb.cached_len
        assert observe(a) == observe(b)
        b.check_integrity()


def test_bad_out_is_refused_changing_nothing():
    m = RadixCacheManager(page_size=2)
    m.insert_prefix(torch.arange(4), torch.arange(4, dtype=torch.int32))
    ids = np.arange(4)
    for bad in [
        np.empty(4, dtype=np.int64),
        np.empty(3, dtype=np.int32),  # shorter than the ids
        np.empty((1, 4), dtype=np.int32),
        np.empty(8, dtype=np.int32)[::2],
        [0, 0, 0, 0],
    ]:
        with watch(m), pytest.raises(ValueError, match="out must be"):
            m.match_and_lock(ids, out=bad)  # type: ignore[arg-type]
    with watch(m), pytest.raises(ValueError, match="out must be"):
        m.match_and_lock(torch.arange(4), out=np.empty(4, dtype=np.int32))  # type: ignore[call-overload]
    with watch(m), pytest.raises(ValueError, match="input_ids must be 1-D"):
        m.match_and_lock(np.arange(4).reshape(2, 2), out=np.empty(4, dtype=np.int32))
    assert m.size_info.protected_size == 0


class NoOut(RadixCacheManager):
    """Takes the NumPy forms, but says nothing of ``out``: the flow must not pass it."""

    @takes_host_arrays
    def match_and_lock(self, input_ids: Any, extra_key: Any = None) -> Any:
        return super().match_and_lock(input_ids, extra_key)


@pytest.mark.parametrize("make", [RadixCacheManager, NoOut])
def test_the_flow_passes_out_only_where_a_manager_says_so(make):
    assert out_array_safe(make) == (make is RadixCacheManager)
    flow = RequestFlow(make(page_size=2), PageAllocator(10, 2))
    gen = torch.Generator().manual_seed(0)
    for i in range(40):
        ids = torch.randint(0, 3, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen)
        req = flow.begin(ids, compute_last=bool(i % 2))
        assert req.indices[: req.tree_len].tolist() == (
            flow.manager.handle_indices(req.handle).tolist()
        )
        flow.mark_computed(req)
        flow.extend(req, torch.tensor([i % 3]))
        flow.mark_computed(req)
        flow.finish(req)
        flow.check_integrity()
    assert flow.stats.evictions > 0 and flow.stats.reused_tokens > 0
