"""Adversarial inputs to the public API, by class of input (found by a sweep of every public
class with bools, NumPy and torch scalars, huge and non-finite numbers, non-iterables, sparse
and meta tensors, ...): each is refused with ``TypeError``/``ValueError`` naming the argument,
or taken as the integer it is, and a refused call changes nothing.

Here: the managers, the allocator and the flow. The kernels and pools are in
``test_adversarial_kernels.py``, the other serving classes in ``test_adversarial_serving.py``.
"""

from __future__ import annotations

import tracemalloc
from typing import Any

import numpy as np
import pytest
import torch
from conftest import ids, param_id, slots, unchanged

from kvcache import (
    BlockHashCacheManager,
    NaiveCacheManager,
    PageAllocator,
    RadixCacheManager,
    RadixTreeNode,
    RequestFlow,
)

MANAGERS = [RadixCacheManager, BlockHashCacheManager, NaiveCacheManager]

#: Integers of every library: taken as the Python int they hold.
INTEGER_KINDS = [
    np.int64(4),
    np.int32(4),
    np.uint8(4),
    torch.tensor(4),
    torch.tensor(4, dtype=torch.int32),
]
#: Counts past every limit a page size can have (a page's slots are int32).
HUGE = [2**31, 2**63, 2**64, np.uint64(2**64 - 1), 10**30]
#: Not iterable at all: a "sequence of ..." argument must name itself when given one of these.
NOT_ITERABLE = [None, 3, 2.5, True, np.int64(3), torch.tensor(3), np.array(3), object()]


def sparse_ids() -> torch.Tensor:
    return torch.tensor([1, 2, 3, 4]).to_sparse()


# ------------------------------------------------------------------ manager constructors
@pytest.mark.parametrize("make", MANAGERS)
@pytest.mark.parametrize("value", INTEGER_KINDS, ids=param_id)
def test_manager_page_size_is_kept_as_a_python_int(make, value):
    """A NumPy or torch page size was stored as given: products with it wrapped (NumPy) or
    stayed tensors, and the radix manager's page byte width overflowed."""
    m = make("cpu", page_size=value)
    assert type(m.page_size) is int and m.page_size == 4
    m.insert_prefix(ids(*range(8)), slots(*range(8)))
    assert m.match_prefix(ids(*range(8)))[0].cached_len == (0 if make is NaiveCacheManager else 8)


@pytest.mark.parametrize("make", MANAGERS)
@pytest.mark.parametrize("value", HUGE, ids=param_id)
def test_manager_page_size_past_int32_is_refused_by_name(make, value):
    """Was ``OverflowError`` (radix, 2**63), a 16 GiB allocation (block hash, 2**31), or
    accepted (naive)."""
    with pytest.raises(ValueError, match=r"page_size must be <= 2147483647"):
        make("cpu", page_size=value)


def test_block_hash_manager_allocates_nothing_per_page_size_until_a_block_is_hashed():
    """The hash weights (one per token of a block) were made in the constructor: ``2**24`` took
    a gigabyte and many seconds before any block existed."""
    tracemalloc.start()
    try:
        m = BlockHashCacheManager("cpu", page_size=2**20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # The table's spare row (12 bytes a token) is all that is left: 12 MiB, not 50+.
    assert peak < 24 * 2**20, peak
    m.insert_prefix(ids(*range(2**20)), slots(*range(2**20)))  # weights made on first use
    assert m.match_prefix(ids(*range(2**20)))[0].cached_len == 2**20


@pytest.mark.parametrize("make", MANAGERS)
@pytest.mark.parametrize(
    "device", [None, 0, 1.5, "nope", b"cpu", ["cpu"], torch.tensor(0)], ids=param_id
)
def test_manager_device_is_checked_by_name(make, device):
    """Bad devices reached torch.device (or a tensor made on them): its own errors, naming no
    argument (``RuntimeError`` for an int index without an accelerator)."""
    with pytest.raises((TypeError, ValueError)) as info:
        make(device=device)
    assert str(info.value).startswith("device "), info.value


@pytest.mark.parametrize("policy", [["lru"], {"lru": 1}, 3, None, b"lru"], ids=param_id)
def test_radix_eviction_policy_must_be_a_name(policy):
    """A list or dict was looked up in the policy registry: ``unhashable type``."""
    with pytest.raises(TypeError, match="eviction_policy must be a str"):
        RadixCacheManager(eviction_policy=policy)


# ------------------------------------------------------------------ manager methods
@pytest.mark.parametrize(
    "node", [None, 3, "node", torch.tensor(1), np.int64(0), object()], ids=param_id
)
def test_radix_eviction_priority_refuses_what_is_not_a_node(node):
    m = RadixCacheManager()
    m.insert_prefix(ids(1, 2), slots(0, 1))
    with pytest.raises(TypeError, match="node must be a RadixTreeNode"):
        m.eviction_priority(node)  # was AttributeError: no attribute 'timestamp'
    leaf = next(n for n in m.nodes() if not n.is_root())
    assert isinstance(leaf, RadixTreeNode) and m.eviction_priority(leaf)


@pytest.mark.parametrize(
    "key", [True, 1.0, np.float64(1.0), "1", None, [1], torch.tensor(1.0)], ids=param_id
)
def test_get_block_takes_integer_hashes_only(key):
    """``True`` and ``1.0`` found the block keyed 1; a list raised ``unhashable type``."""
    m = BlockHashCacheManager(page_size=2)
    m.insert_prefix(ids(1, 2), slots(0, 1))
    with pytest.raises(TypeError, match="block_hash must be an integer"):
        m.get_block(key)
    (block,) = m.blocks()
    found = m.get_block(np.uint64(block.block_hash))
    assert found is not None and (found.block_hash, found.page) == (block.block_hash, block.page)


def test_block_hash_ids_that_have_no_numpy_view_are_refused_by_name():
    """A float tensor that requires grad, or a sparse one, failed in ``Tensor.numpy()``."""
    m = BlockHashCacheManager(page_size=2)
    with unchanged(m), pytest.raises(TypeError, match="input_ids must have an integer dtype"):
        m.match_prefix(torch.ones(4, requires_grad=True))
    with unchanged(m), pytest.raises(TypeError, match="input_ids must be a dense"):
        m.insert_prefix(sparse_ids(), slots(0, 1, 2, 3))


# ------------------------------------------------------------------ sparse tensors everywhere
def _flow(make: type) -> tuple[RequestFlow, Any]:
    flow = RequestFlow(make("cpu", page_size=2), PageAllocator(16, 2))
    r = flow.begin(ids(1, 2, 3))
    return flow, r


SPARSE_CALLS = {
    "match_prefix": lambda f, r: f.manager.match_prefix(sparse_ids()),
    "insert_prefix.ids": lambda f, r: f.manager.insert_prefix(sparse_ids(), slots(8, 9, 10, 11)),
    "insert_prefix.indices": lambda f, r: f.manager.insert_prefix(
        ids(7, 7, 7, 7), slots(8, 9, 10, 11).to_sparse()
    ),
    "begin": lambda f, r: f.begin(sparse_ids()),
    "extend": lambda f, r: f.extend(r, sparse_ids()),
    "begin_batch": lambda f, r: f.begin_batch([ids(5, 6), sparse_ids()]),
    "extend_batch": lambda f, r: f.extend_batch([r], [sparse_ids()]),
    "allocator.free": lambda f, r: f.allocator.free(torch.tensor([15]).to_sparse()),
    "allocator.free_slots": lambda f, r: f.allocator.free_slots(torch.tensor([30]).to_sparse()),
}


@pytest.mark.parametrize("make", MANAGERS)
@pytest.mark.parametrize("call", list(SPARSE_CALLS), ids=str)
def test_sparse_tensors_are_refused_by_name_and_change_nothing(make, call):
    """They passed every check (1-D, integer, CPU) and failed inside torch or NumPy: in
    ``extend_batch`` after the requests before them had been extended."""
    flow, r = _flow(make)
    with unchanged(flow), pytest.raises(TypeError, match="must be a dense"):
        SPARSE_CALLS[call](flow, r)


# ------------------------------------------------------------------ sequences that are not
@pytest.mark.parametrize("value", NOT_ITERABLE, ids=param_id)
def test_sequence_arguments_name_themselves(value):
    """Each was ``'int' object is not iterable`` (or the like), naming no argument."""
    flow, r = _flow(RadixCacheManager)
    with unchanged(flow), pytest.raises(TypeError, match="prompts must be a sequence"):
        flow.begin_batch(value)
    with unchanged(flow), pytest.raises(TypeError, match="reqs must be a sequence"):
        flow.extend_batch(value, [ids(1)])
    with unchanged(flow), pytest.raises(TypeError, match="new_ids must be a sequence"):
        flow.extend_batch([r], value)


# ------------------------------------------------------------------ NaN namespaces
@pytest.mark.parametrize("make", MANAGERS)
@pytest.mark.parametrize("key", [float("nan"), np.float64("nan"), np.float32("nan")], ids=param_id)
def test_a_nan_namespace_is_refused(make, key):
    """NaN equals no other NaN: a prefix cached under one ``float("nan")`` was never matched
    under the next (a namespace nobody can reach again, holding pages until evicted)."""
    m = make("cpu", page_size=2)
    with unchanged(m), pytest.raises(ValueError, match="extra_key must not be NaN"):
        m.insert_prefix(ids(1, 2), slots(0, 1), key)
    with unchanged(m), pytest.raises(ValueError, match="extra_key must not be NaN"):
        m.match_prefix(ids(1, 2), key)
    flow = RequestFlow(make("cpu", page_size=2), PageAllocator(8, 2))
    with unchanged(flow), pytest.raises(ValueError, match="extra_key must not be NaN"):
        flow.begin(ids(1, 2, 3), extra_key=key)
    m.insert_prefix(ids(1, 2), slots(0, 1), (float("nan"),))  # a tuple compares by identity


# ------------------------------------------------------------------ allocator: no host copy
@pytest.mark.parametrize(
    "method", ["free", "free_slots", "free_page_runs", "slots_to_pages", "pages_to_slots"]
)
@pytest.mark.parametrize(
    "ids_of",
    [lambda xs: torch.tensor(xs).to_sparse(), lambda xs: torch.tensor(xs, device="meta")],
    ids=["sparse", "meta"],
)
def test_allocator_ids_without_a_host_copy_are_refused_by_name(method, ids_of):
    """``free_page_runs`` read them with ``numpy()``/``cpu()`` before any check: torch's "can't
    convert Sparse layout tensor" and ``NotImplementedError`` ("Cannot copy out of meta")."""
    a = PageAllocator(8, 4)
    held = a.allocate(3)
    with unchanged(a), pytest.raises(TypeError, match="must be a dense"):
        getattr(a, method)(ids_of([int(held[0]) * 4]))


_HUGE_PAGE = """
import resource, sys
resource.setrlimit(resource.RLIMIT_DATA, (3 << 30, 3 << 30))  # a regression fails, not swaps
import torch
from kvcache import BlockHashCacheManager
ps = int(sys.argv[1])
m = BlockHashCacheManager("cpu", page_size=ps)
top = (2**31 - 1) // ps * ps  # the last page int32 slots have
try:
    m.insert_prefix(torch.arange(ps), torch.arange(top, top + ps, dtype=torch.int32))
except ValueError as e:
    print("refused:", e)
m.check_integrity()
print("cached", len(m.cached_indices()))
"""


@pytest.mark.parametrize("ps", [1, 16])
def test_a_page_past_max_pages_is_refused_before_the_table_grows(ps):
    """The block table keeps a row per page id up to the largest cached: one insert at the last
    int32 page made it allocate (and fill) 146 GiB at page size 1, 31 GiB at 16, and the kernel
    killed the process. Run in a child with a 3 GiB data limit, so that a regression fails."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _HUGE_PAGE, str(ps)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "refused: indices: page" in out.stdout and "max_pages=" in out.stdout, out.stdout
    assert out.stdout.rstrip().endswith("cached 0")


def test_max_pages_bounds_the_page_ids_exactly():
    m = BlockHashCacheManager("cpu", page_size=4, max_pages=10)
    m.insert_prefix(ids(*range(4)), slots(36, 37, 38, 39))  # page 9: the last one
    with unchanged(m), pytest.raises(ValueError, match=r"page 10 .* max_pages=10"):
        m.insert_prefix(ids(*range(8)), slots(36, 37, 38, 39, 40, 41, 42, 43))
    m.check_integrity()


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "8", 2**29 + 1])
def test_max_pages_is_checked_by_name(bad):
    with pytest.raises((TypeError, ValueError), match="max_pages"):
        BlockHashCacheManager("cpu", page_size=4, max_pages=bad)


def test_an_allocator_larger_than_the_machine_is_refused_by_name(monkeypatch):
    """``PageAllocator(2**31 - 1)`` set out to fill 26 GiB of bookkeeping (the free ring alone is
    16 GiB) on a 24 GiB machine; the size is legal (int32 slots), the machine is not big enough."""
    import os

    page = os.sysconf("SC_PAGE_SIZE")
    real = os.sysconf
    monkeypatch.setattr(
        os, "sysconf", lambda name: (1 << 30) // page if name == "SC_PHYS_PAGES" else real(name)
    )  # a machine of 1 GiB
    with pytest.raises(ValueError, match=r"num_pages=134217728 needs 1\.6 GiB .* has 1\.0 GiB"):
        PageAllocator(2**27)
    assert PageAllocator(2**20).num_free_pages == 2**20  # 13 MiB: fine
