"""`PageAllocator.allocate_page_slots`: the flow's allocation of whole pages straight into a
request's host array. It must hand out exactly the pages `allocate` would, write every slot of
them page after page, leave the rest of ``out`` alone, and refuse bad input changing nothing."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import unchanged
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import PageAllocator


@settings(max_examples=120, deadline=None, derandomize=True)
@given(
    ps=st.sampled_from([1, 2, 3, 16]),
    big=st.booleans(),  # a pool past the allocator's table of page rows (computed slots)
    ops=st.lists(
        st.tuples(st.booleans(), st.integers(0, 30), st.integers(0, 5), st.integers(0, 3)),
        max_size=25,
    ),
)
def test_allocate_page_slots_matches_allocate(ps, big, ops):
    """Against a second allocator taking the same pages with `allocate`: same pages, their slots
    page after page at ``out[start : start + k * page_size]``, the rest of ``out`` untouched, same
    free list after every call (frees included, so the ring wraps)."""
    num_pages = (1 << 22) // ps + 1 if big and ps == 16 else 40
    a, ref = PageAllocator(num_pages, ps), PageAllocator(num_pages, ps)
    held: list[int] = []
    for take, k, spare, start in ops:
        if take and k <= a.num_free_pages:
            out = np.full(start + k * ps + spare, -7, dtype=np.int32)
            if start:
                a.allocate_page_slots(k, out, start)
            else:
                a.allocate_page_slots(k, out)
            pages = ref.allocate(k).tolist()
            want = [p * ps + o for p in pages for o in range(ps)]
            end = start + k * ps
            assert out[start:end].tolist() == want
            assert out[:start].tolist() == [-7] * start and out[end:].tolist() == [-7] * spare
            held += pages
        elif held:
            give = held[:k]
            del held[:k]
            a.free(np.array(give, dtype=np.int64))
            ref.free(np.array(give, dtype=np.int64))
        assert a.num_free_pages == ref.num_free_pages
        assert a.free_pages()[-50:].tolist() == ref.free_pages()[-50:].tolist()


def test_allocate_page_slots_refuses_bad_input_changing_nothing():
    a = PageAllocator(4, 16)
    a.allocate(1)
    room = np.empty(64, dtype=np.int32)
    bad_outs = [
        np.empty(47, dtype=np.int32),  # too short for 3 pages
        np.empty(48, dtype=np.int64),
        np.empty((3, 16), dtype=np.int32),
        np.empty(96, dtype=np.int32)[::2],  # not contiguous: a reshape would copy
        [0] * 48,
    ]
    for out in bad_outs:
        with unchanged(a), pytest.raises(ValueError, match="out must be"):
            a.allocate_page_slots(3, out)  # type: ignore[arg-type]
    with unchanged(a), pytest.raises(ValueError, match="at least 65 entries"):
        a.allocate_page_slots(3, room, 17)  # 48 slots from 17 on: one past the end
    with unchanged(a), pytest.raises(ValueError, match="start"):
        a.allocate_page_slots(1, room, -1)
    with unchanged(a), pytest.raises(TypeError, match="start"):
        a.allocate_page_slots(1, room, 1.0)  # type: ignore[arg-type]
    one = np.empty(2, dtype=np.int32)[::2]  # one entry, strided: contiguous all the same
    PageAllocator(2, 1).allocate_page_slots(1, one)
    with unchanged(a), pytest.raises(RuntimeError, match="only 3 are free"):
        a.allocate_page_slots(4, room)
    with unchanged(a), pytest.raises(ValueError, match="num_pages"):
        a.allocate_page_slots(-1, room)
    with unchanged(a), pytest.raises(TypeError, match="num_pages"):
        a.allocate_page_slots(1.5, room)  # type: ignore[arg-type]
    a.allocate_page_slots(0, room)
    assert a.num_free_pages == 3


def test_free_page_start_frees_one_page_or_refuses_changing_nothing():
    """The flow's free of a finished request's partial last page, named by its first slot."""
    a, ref = PageAllocator(6, 4), PageAllocator(6, 4)
    a.allocate(3)
    ref.allocate(3)
    a.free_page_start(4)
    ref.free(np.array([1]))
    assert a.free_pages().tolist() == ref.free_pages().tolist()
    for bad, exc in [(5, ValueError), (-4, ValueError), (24, ValueError), (4, RuntimeError)]:
        with unchanged(a), pytest.raises(exc, match=r"slot must start|double free"):
            a.free_page_start(bad)
    for bad_type in (4.0, True, np.int64(8)):
        with unchanged(a), pytest.raises(TypeError, match="slot must be an int"):
            a.free_page_start(bad_type)  # type: ignore[arg-type]
    a.free_page_start(8)
    assert a.num_free_pages == 5


@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("big", [False, True])
@pytest.mark.parametrize("k", [1, 3])
def test_a_read_only_out_is_refused_with_the_pages_still_free(ps, big, k):
    """A write into ``out`` that fails must not cost the pool its pages: both calls that write
    into a caller's array (`allocate_page_slots`, `allocate_host_slots(out=)`) refuse a read-only
    one, naming it, with the allocator unchanged (one page and several; table rows and computed
    slots; the ring wrapping)."""
    num_pages = (1 << 22) // ps + 1 if big and ps == 16 else 8
    a = PageAllocator(num_pages, ps)
    a.free(a.allocate(num_pages - 1)[:5])  # the free list now wraps around the ring's end
    n = k * ps - (ps > 1)  # host slots: the last page partial where it can be
    for call, out in (
        (lambda o: a.allocate_page_slots(k, o), np.zeros(k * ps + 3, dtype=np.int32)),
        (lambda o: a.allocate_host_slots(n, o), np.zeros(n, dtype=np.int32)),
    ):
        out.setflags(write=False)
        with unchanged(a), pytest.raises(ValueError, match="writeable"):
            call(out)
        assert not out.any()
