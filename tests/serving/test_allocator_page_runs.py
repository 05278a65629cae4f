"""`PageAllocator.free_page_runs`: the flow's free of page-aligned runs (what a manager evicts,
a request's own slots from a page boundary on). It reads one slot a page, so it must agree with
`free_slots` on every such run, and refuse everything else as `free` does, changing nothing.

Both of its paths are driven: a few dozen pages go through Python lists, more through NumPy.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import unchanged
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import PageAllocator


def runs(pages: list[int], ps: int, last: int | None = None) -> np.ndarray:
    """Slots of ``pages`` page after page, the last page cut to ``last`` slots."""
    out = [p * ps + o for p in pages for o in range(ps)]
    if last is not None and pages:
        out = out[: len(out) - ps + last]
    return np.array(out, dtype=np.int32)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    ps=st.sampled_from([1, 2, 3, 16]),
    ops=st.lists(
        st.tuples(
            st.integers(0, 80),  # pages to allocate, or how many held pages to free
            st.booleans(),  # free: as a torch tensor (True) or a NumPy array
            st.integers(1, 16),  # slots of the last page
            st.sampled_from(["ok", "twice", "free", "range", "offset", "int64"]),
        ),
        max_size=14,
    ),
    seed=st.integers(0, 2**16),
)
def test_free_page_runs_matches_free_slots(ps, ops, seed):
    """Against a second allocator freeing the same pages with `free_slots`: same free list after
    every call; a refused call (a page twice, a page already free, a slot out of range or not a
    page start) raises and changes nothing."""
    rng = np.random.default_rng(seed)
    a, ref = PageAllocator(120, ps), PageAllocator(120, ps)
    held: list[int] = []
    for k, as_tensor, last, how in ops:
        if k <= a.num_free_pages and rng.random() < 0.4:
            got = a.allocate(k).tolist()
            assert got == ref.allocate(k).tolist()
            held += got
            continue
        pick = [int(p) for p in rng.permutation(held)[: min(k, len(held))]]
        listed, bad = list(pick), None
        if how == "twice" and pick:
            listed, bad = pick + pick[:1], ValueError
        elif how == "free" and a.num_free_pages:
            listed, bad = [*pick, int(a.free_pages()[0])], RuntimeError
        arr = runs(listed, ps, min(last, ps))
        if how == "range":
            arr = np.concatenate(
                [runs(pick, ps), np.array([120 * ps, -ps][: 1 + seed % 2], np.int32)]
            )
            bad = ValueError
        elif how == "offset" and ps > 1 and pick:
            arr[0] += 1
            bad = ValueError
        elif how == "int64":
            arr = arr.astype(np.int64)
        given_ = torch.from_numpy(arr) if as_tensor else arr
        if bad is not None:
            with unchanged(a), pytest.raises(bad):
                a.free_page_runs(given_)
            continue
        a.free_page_runs(given_)
        ref.free_slots(arr)
        held = [p for p in held if p not in set(pick)]
        assert a.free_pages().tolist() == ref.free_pages().tolist()
        assert a.num_free_pages == ref.num_free_pages


@pytest.mark.parametrize("n", [1, 2, 32, 33, 200])
def test_free_page_runs_names_value_and_limit(n):
    """Messages name the slot and the limit, on both paths; nothing changes on a raise."""
    ps = 4
    a = PageAllocator(256, ps)
    pages = a.allocate(n).tolist()
    good = runs(pages, ps)
    for bad, exc, match in [
        (np.concatenate([good, [256 * ps]]), ValueError, r"slots: 1024 is outside \[0, 1024\)"),
        (np.concatenate([good, [-4]]), ValueError, r"slots: -4 is outside \[0, 1024\)"),
        (np.concatenate([good[:-ps], good[-ps:] + 1]), ValueError, "does not start a page of 4"),
        (np.concatenate([good, good[:ps]]), ValueError, "more than once"),
        (np.concatenate([good, runs([255], ps)]), RuntimeError, r"double free: pages \[255\]"),
    ]:
        if n == 1 and match == "more than once":
            continue
        with unchanged(a), pytest.raises(exc, match=match):
            a.free_page_runs(bad.astype(np.int32))
    with unchanged(a), pytest.raises(TypeError, match="integer dtype"):
        a.free_page_runs(good.astype(np.float32))
    with unchanged(a), pytest.raises(TypeError, match="integer dtype"):
        a.free_page_runs(torch.tensor([0.0, 1.0]))
    with unchanged(a), pytest.raises(TypeError):
        a.free_page_runs([0, 1, 2, 3])
    with unchanged(a), pytest.raises(ValueError, match="1-D"):
        a.free_page_runs(good.reshape(1, -1))
    a.free_page_runs(good[: len(good) - 1])  # the last page partial: still its page
    assert a.num_free_pages == 256
    a.free_page_runs(np.empty(0, dtype=np.int32))  # nothing to free
    assert a.num_free_pages == 256


def test_free_page_runs_reads_values_before_any_cast():
    """``2**32`` is not slot 0: the range is checked on the values given."""
    a = PageAllocator(4, 2)
    a.allocate(4)
    for bad in (
        np.array([2**32], np.int64),
        torch.tensor([2**32, 2**32 + 1]),
        np.array([2**63], np.uint64),
    ):
        with unchanged(a), pytest.raises(ValueError, match="outside"):
            a.free_page_runs(bad)
    a.free_page_runs(np.array([2, 3], np.uint64))
    assert a.free_pages().tolist() == [1]
