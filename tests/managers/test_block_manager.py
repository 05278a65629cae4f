"""BlockHashCacheManager: every method and every misuse, collisions, LRU order, agreement with the
radix manager. Its stateful test under RequestFlow is the shared machine in
tests/serving/test_flow_stateful.py."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch
from conftest import ids
from conftest import page_slots as slots_of
from conftest import unchanged as watch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import BaseCacheManager, SizeInfo
from kvcache.managers.block_hash import (
    BlockHashCacheHandle,
    BlockHashCacheManager,
    default_block_hash,
)
from kvcache.managers.radix import RadixCacheManager
from kvcache.serving.allocator import PageAllocator
from kvcache.serving.request_flow import RequestFlow

Prefix = tuple[int, ...]


# ----------------------------------------------------------------- helpers
def dump(m: BlockHashCacheManager) -> tuple:
    """Everything the manager holds, as plain values: equal dumps mean equal states."""
    queue = tuple(m.free_queue())
    blocks = tuple(
        (
            b.block_hash,
            b.parent_hash,
            b.tokens,
            b.page,
            b.ref_count,
            b.num_children,
            b.last_use,
            b.probe,
        )
        for b in m.blocks()
    )
    return (
        blocks,
        queue,
        tuple(m._table.page_of.items()),
        m._table.num_locked,
        m.max_probe,
        m.clock,
        m.size_info,
        tuple(m.locked_handles().items()),
    )


def prefixes_in(m: BlockHashCacheManager) -> dict[Prefix, int]:
    """Every cached full-block prefix -> its page, rebuilt by following parent hashes."""
    out: dict[Prefix, int] = {}
    for b in m.blocks():
        toks: list[tuple[int, ...]] = []
        node = b
        while node is not None:
            toks.append(node.tokens)
            node = m.get_block(node.parent_hash) if node.parent_hash is not None else None
        out[tuple(t for blk in reversed(toks) for t in blk)] = b.page
    return out


def unchanged(m: BlockHashCacheManager, exc: type, match: str, fn, *args, **kwargs) -> None:
    """The shared misuse harness (public state), plus the private `dump` of this manager."""
    before = dump(m)
    with watch(m), pytest.raises(exc, match=match):
        fn(*args, **kwargs)
    assert dump(m) == before
    m.check_integrity()


# --------------------------------------------------------- construction
def test_is_a_cache_manager_with_attributes():
    m = BlockHashCacheManager()
    assert isinstance(m, BaseCacheManager)
    assert m.page_size == 16 and m.device == torch.device("cpu")
    assert BlockHashCacheManager("cpu", 4).page_size == 4


@pytest.mark.parametrize(
    "ps, exc",
    [(0, ValueError), (-3, ValueError), (True, TypeError), (2.0, TypeError), ("4", TypeError)],
)
def test_bad_page_size(ps, exc):
    with pytest.raises(exc, match="page_size"):
        BlockHashCacheManager(page_size=ps)


def test_bad_hash_fn():
    with pytest.raises(TypeError, match="hash_fn"):
        BlockHashCacheManager(page_size=2, hash_fn=42)


def test_empty_manager():
    m = BlockHashCacheManager(page_size=4)
    h, idx = m.match_prefix(ids(1, 2, 3, 4, 5))
    assert h == BlockHashCacheHandle(0, ()) and idx.dtype == torch.int32 and len(idx) == 0
    assert m.size_info == SizeInfo(0, 0) and m.num_blocks == 0
    assert m.evict(0).tolist() == [] and m.evict(0).dtype == torch.int32
    assert m.cached_indices().tolist() == [] and m.cached_indices().dtype == torch.int32
    m.lock_handle(h)
    m.lock_handle(h, unlock=True)  # an empty handle needs no protection
    m.check_integrity()


# --------------------------------------------------------- insert / match
def test_insert_then_match_whole_blocks_only():
    m = BlockHashCacheManager(page_size=4)
    assert m.insert_prefix(ids(*range(10)), slots_of([3, 7, 1], 4, 10)) == 0
    assert m.size_info == SizeInfo(8, 0) and m.num_blocks == 2  # the 2-token tail is the caller's
    assert sorted(m.cached_indices().tolist()) == sorted(slots_of([3, 7], 4).tolist())
    cases = [
        ((*range(12), 99), 8, [3, 7]),
        (tuple(range(8)), 8, [3, 7]),
        (tuple(range(7)), 4, [3]),
        ((0, 1, 2, 3, 4, 5, 6, 99), 4, [3]),
        ((0, 1, 2, 99, 4, 5, 6, 7), 0, []),
        ((0, 1, 2), 0, []),
    ]
    for prompt, n, pages in cases:
        h, idx = m.match_prefix(ids(*prompt))
        assert h.cached_len == n and len(h.block_hashes) == n // 4
        assert idx.tolist() == slots_of(pages, 4).tolist() and idx.dtype == torch.int32
        assert m.handle_indices(h).tolist() == idx.tolist()
    m.check_integrity()


def test_insert_returns_length_already_cached_and_keeps_the_tree_pages():
    m = BlockHashCacheManager(page_size=2)
    m.insert_prefix(ids(1, 2, 3, 4), slots_of([0, 1], 2))
    # Another request computed the same two blocks on pages 5, 6 and one more on page 7.
    assert m.insert_prefix(ids(1, 2, 3, 4, 5, 6, 7), slots_of([5, 6, 7, 8], 2, 7)) == 4
    _h, idx = m.match_prefix(ids(1, 2, 3, 4, 5, 6))
    assert idx.tolist() == slots_of([0, 1, 7], 2).tolist()  # cached pages, not the duplicates
    assert m.size_info == SizeInfo(6, 0)
    # Inserting what is cached changes nothing but the use times.
    assert m.insert_prefix(ids(1, 2, 3, 4), slots_of([9, 10], 2)) == 4
    assert m.num_blocks == 3
    m.check_integrity()


def test_integer_dtypes_hash_alike():
    m = BlockHashCacheManager(page_size=2)
    m.insert_prefix(torch.tensor([5, 6, 7, 8], dtype=torch.int32), slots_of([0, 1], 2))
    assert m.match_prefix(torch.tensor([5, 6, 7, 8], dtype=torch.int16))[0].cached_len == 4
    assert m.match_prefix(torch.tensor([5, 6, 7, 8], dtype=torch.uint8))[0].cached_len == 4


def test_page_size_one():
    m = BlockHashCacheManager(page_size=1)
    assert m.insert_prefix(ids(4, 5, 6), torch.tensor([9, 2, 5], dtype=torch.int32)) == 0
    h, idx = m.match_prefix(ids(4, 5, 7))
    assert h.cached_len == 2 and idx.tolist() == [9, 2]
    assert m.insert_prefix(ids(4, 5, 7), torch.tensor([0, 1, 3], dtype=torch.int32)) == 2
    assert sorted(m.cached_indices().tolist()) == [2, 3, 5, 9]
    m.check_integrity()


@pytest.mark.parametrize(
    "bad, exc, match",
    [
        ([1, 2, 3, 4], TypeError, "input_ids must be a torch.Tensor"),
        (torch.zeros(2, 2, dtype=torch.int64), ValueError, "1-D"),
        (torch.zeros(4), TypeError, "integer dtype"),
    ],
)
def test_match_misuse_changes_nothing(bad, exc, match):
    m = BlockHashCacheManager(page_size=2)
    m.insert_prefix(ids(1, 2, 3, 4), slots_of([0, 1], 2))
    unchanged(m, exc, match, m.match_prefix, bad)


def _filled() -> BlockHashCacheManager:
    m = BlockHashCacheManager(page_size=4)
    m.insert_prefix(ids(*range(8)), slots_of([2, 3], 4))
    m.lock_handle(m.match_prefix(ids(*range(4)))[0])
    return m


@pytest.mark.parametrize(
    "input_ids, indices, exc, match",
    [
        ([0, 1, 2, 3], slots_of([5], 4), TypeError, "input_ids"),
        (
            ids(*range(8)),
            [20, 21, 22, 23, 24, 25, 26, 27],
            TypeError,
            "indices must be a torch.Tensor",
        ),
        (ids(*range(8)), slots_of([5, 6], 4).long(), TypeError, "torch.int32"),
        (ids(*range(8)), slots_of([5, 6], 4).view(2, 4), ValueError, "1-D"),
        (ids(*range(8)), torch.zeros(8, dtype=torch.int32, device="meta"), ValueError, "device"),
        (
            ids(*range(12)),
            slots_of([5, 6], 4),
            ValueError,
            r"len\(indices\) \(8\) must equal len\(input_ids\) \(12\)",
        ),
        (ids(*range(12)), slots_of([5, 6, 7], 4) + 1, ValueError, "consecutive slots of one page"),
        (
            ids(*range(12)),
            torch.tensor([*range(20, 28), 28, 29, 31, 30], dtype=torch.int32),
            ValueError,
            "consecutive slots",
        ),
        (ids(*range(12)), slots_of([5, 6, -1], 4), ValueError, ">= 0"),
        (ids(99, 98, 97, 96), torch.full((4,), -1, dtype=torch.int32), ValueError, ">= 0"),
        (ids(*range(90, 98)), torch.zeros(8, dtype=torch.int32), ValueError, "consecutive slots"),
        (ids(99, 98, 97, 96), slots_of([10**6], 4) - 1, ValueError, "consecutive slots"),
        (
            ids(*range(4), 9, 9, 9, 9),
            slots_of([5, 3], 4),
            ValueError,
            "page 3 .* already holds cached block",
        ),
        (
            ids(*range(4), *[9] * 8),
            slots_of([5, 6, 6], 4),
            ValueError,
            "page 6 appears in more than one new block",
        ),
    ],
)
def test_insert_misuse_changes_nothing(input_ids, indices, exc, match):
    m = _filled()
    unchanged(m, exc, match, m.insert_prefix, input_ids, indices)


@pytest.mark.parametrize("slots", [[0, 0], [-1, -1], [-2, -1], [1, 2]])
def test_an_empty_table_checks_slots_too(slots):
    """The first insert (no page known yet, only the spare row) checks its slots all the same."""
    m = BlockHashCacheManager(page_size=2)
    unchanged(
        m,
        ValueError,
        "consecutive slots|>= 0",
        m.insert_prefix,
        ids(1, 2),
        torch.tensor(slots, dtype=torch.int32),
    )


@settings(max_examples=150, deadline=None)
@given(
    ps=st.sampled_from([1, 2, 4]),
    cached=st.lists(st.integers(0, 6), max_size=3, unique=True),
    new=st.lists(st.integers(-2, 9) | st.integers(62, 66), min_size=1, max_size=3),
    shift=st.lists(st.integers(-1, 1), min_size=12, max_size=12),
)
def test_new_block_slots_are_accepted_exactly_when_valid(ps, cached, new, shift):
    """An insert's new slots against a plain reference: accepted iff every block's slots are the
    consecutive slots of one page ``>= 0`` that is neither cached nor used twice (the pages
    straddle the table's edge, so the array fast path and the growing path both run)."""
    m = BlockHashCacheManager(page_size=ps)
    for i, page in enumerate(cached):  # one-block chains on these pages
        m.insert_prefix(ids(*[100 + i] * ps), slots_of([page], ps))
    got = [
        p * ps + j + shift[i] * (i % 3 == 1)
        for i, (p, j) in enumerate((p, j) for p in new for j in range(ps))
    ]
    blocks = [got[i : i + ps] for i in range(0, len(got), ps)]
    pages = [b[0] // ps for b in blocks]
    valid = all(b == list(range(b[0], b[0] + ps)) and b[0] >= 0 for b in blocks)
    valid = valid and all(b[0] % ps == 0 for b in blocks)
    valid = valid and len(set(pages)) == len(pages) and not set(pages) & set(cached)
    tokens = ids(*range(len(got)))
    if valid:
        assert m.insert_prefix(tokens, torch.tensor(got, dtype=torch.int32)) == 0
        assert sorted(m.cached_indices().tolist()) == sorted(
            [p * ps + j for p in [*cached, *pages] for j in range(ps)]
        )
        m.check_integrity()
    else:
        unchanged(
            m,
            ValueError,
            "indices|page",
            m.insert_prefix,
            tokens,
            torch.tensor(got, dtype=torch.int32),
        )


def test_unaligned_tail_is_not_checked_and_stays_the_callers():
    m = BlockHashCacheManager(page_size=4)
    idx = torch.tensor(
        [8, 9, 10, 11, 30, 1], dtype=torch.int32
    )  # tail past the full block: anything
    assert m.insert_prefix(ids(*range(6)), idx) == 0
    assert sorted(m.cached_indices().tolist()) == [8, 9, 10, 11]


# ------------------------------------------------------------ collisions
@pytest.mark.parametrize("hash_fn", [lambda p, t: 0, lambda p, t: t[0] % 2, lambda p, t: -1])
def test_hash_collisions_never_return_wrong_slots(hash_fn):
    ps = 2
    m = BlockHashCacheManager(page_size=ps, hash_fn=hash_fn)
    ref = BlockHashCacheManager(page_size=ps)
    rng = random.Random(7)
    seqs = [tuple(rng.randrange(3) for _ in range(rng.randrange(1, 9))) for _ in range(30)]
    next_page = 0
    for s in seqs:
        n_pages = -(-len(s) // ps)
        idx = slots_of(list(range(next_page, next_page + n_pages)), ps, len(s))
        next_page += n_pages
        assert m.insert_prefix(ids(*s), idx) == ref.insert_prefix(ids(*s), idx)
        m.check_integrity()
    assert m.max_probe > 0  # the weak hash did collide
    for s in seqs + [tuple(rng.randrange(3) for _ in range(8)) for _ in range(30)]:
        (h1, i1), (h2, i2) = m.match_prefix(ids(*s)), ref.match_prefix(ids(*s))
        assert h1.cached_len == h2.cached_len and i1.tolist() == i2.tolist()
    while m.size_info.evictable_size:
        assert sorted(m.evict(1).tolist()) == sorted(ref.evict(1).tolist())
        m.check_integrity()
        for s in seqs:
            assert m.match_prefix(ids(*s))[1].tolist() == ref.match_prefix(ids(*s))[1].tolist()


def test_default_hash_is_stable_across_processes():
    """Hashes of int tuples ignore PYTHONHASHSEED (pytest runs under a random one), so a block's
    hash is the same in every process on a 64-bit CPython: here, a value computed once."""
    from kvcache.managers.block_hash import ROOT_HASH_SEED
    from kvcache.managers.block_hash import default_block_hash as h

    assert h(h(ROOT_HASH_SEED, (1, 2, 3)), (4, 5, 6)) == 6344552939871388144
    assert 0 <= h(ROOT_HASH_SEED, (-5,)) < 2**64


@settings(max_examples=100, deadline=None)
@given(
    ps=st.sampled_from([1, 2, 16]),
    blocks=st.integers(0, 6),
    seed=st.integers(0, 2**64 - 1),
    data=st.data(),
)
def test_whole_chain_hash_equals_the_block_by_block_hash(ps, blocks, seed, data):
    """`ChainHasher.chain` (plain ints for one or two blocks, NumPy past that) gives exactly the
    hashes of `default_block_hash` applied block after block, for any int64 tokens."""
    from kvcache.managers.block_hash import ChainHasher

    tokens = data.draw(
        st.lists(st.integers(-(2**63), 2**63 - 1), min_size=blocks * ps, max_size=blocks * ps)
    )
    rows = np.array(tokens, dtype=np.int64).reshape(blocks, ps)
    expected, parent = [], seed
    for row in rows.tolist():
        parent = default_block_hash(parent, tuple(row))
        expected.append(parent)
    assert ChainHasher(ps, None).chain(rows, seed) == expected


# ------------------------------------------------------------ lock / unlock
def test_lock_unlock_moves_sizes_and_nests():
    m = BlockHashCacheManager(page_size=2)
    m.insert_prefix(ids(1, 2, 3, 4, 5, 6), slots_of([0, 1, 2], 2))
    short, _ = m.match_prefix(ids(1, 2))
    long_, _ = m.match_prefix(ids(1, 2, 3, 4, 5, 6))
    m.lock_handle(short)
    assert m.size_info == SizeInfo(4, 2)
    m.lock_handle(long_)
    assert m.size_info == SizeInfo(0, 6)
    assert [b.ref_count for b in m.blocks()] == [2, 1, 1]
    m.check_integrity()
    m.lock_handle(short, unlock=True)
    assert m.size_info == SizeInfo(0, 6)
    m.lock_handle(long_, unlock=True)
    assert m.size_info == SizeInfo(6, 0) and [b.ref_count for b in m.blocks()] == [0, 0, 0]
    m.check_integrity()


def test_lock_misuse_changes_nothing():
    m = BlockHashCacheManager(page_size=2)
    m.insert_prefix(ids(1, 2, 3, 4, 5, 6), slots_of([0, 1, 2], 2))
    h, _ = m.match_prefix(ids(1, 2, 3, 4))
    unchanged(m, RuntimeError, "not locked", m.lock_handle, h, unlock=True)
    m.lock_handle(h)
    m.lock_handle(h, unlock=True)
    unchanged(m, RuntimeError, "not locked", m.lock_handle, h, unlock=True)  # unlocked twice
    from kvcache.managers.radix import RadixCacheHandle

    unchanged(m, TypeError, "BlockHashCacheHandle", m.lock_handle, RadixCacheHandle(0, None))
    unchanged(m, TypeError, "BlockHashCacheHandle", m.lock_handle, "handle")
    unchanged(
        m,
        RuntimeError,
        "cached_len=6 but names 2 blocks",
        m.lock_handle,
        BlockHashCacheHandle(6, h.block_hashes),
    )
    unchanged(
        m,
        RuntimeError,
        "does not chain",
        m.lock_handle,
        BlockHashCacheHandle(4, h.block_hashes[::-1]),
    )
    unchanged(m, RuntimeError, "was evicted", m.lock_handle, BlockHashCacheHandle(2, (12345,)))
    unchanged(m, RuntimeError, "was evicted", m.handle_indices, BlockHashCacheHandle(2, (12345,)))
    # Queue: [5 6], [3 4], [1 2]; evicting two blocks takes h's last block.
    assert m.evict(4).tolist() == slots_of([2, 1], 2).tolist()
    unchanged(m, RuntimeError, "block 1 .* was evicted", m.lock_handle, h)


def test_handle_names_content_so_it_survives_reinsertion():
    m = BlockHashCacheManager(page_size=2)
    m.insert_prefix(ids(1, 2, 3, 4), slots_of([0, 1], 2))
    h, _ = m.match_prefix(ids(1, 2, 3, 4))
    m.evict(4)
    with pytest.raises(RuntimeError, match="evicted"):
        m.lock_handle(h)
    m.insert_prefix(ids(1, 2, 3, 4), slots_of([6, 7], 2))
    assert m.handle_indices(h).tolist() == slots_of([6, 7], 2).tolist()
    m.lock_handle(h)
    assert m.size_info == SizeInfo(0, 4)


def test_handle_indices_is_read_only():
    m = BlockHashCacheManager(page_size=2)
    m.insert_prefix(ids(1, 2, 3, 4), slots_of([0, 1], 2))
    m.insert_prefix(ids(9, 9), slots_of([5], 2))
    h, _ = m.match_prefix(ids(1, 2, 3, 4))
    before = dump(m)
    assert m.handle_indices(h).tolist() == [0, 1, 2, 3]
    assert m.handle_indices(BlockHashCacheHandle(0, ())).tolist() == []
    assert dump(m) == before


# -------------------------------------------------------------------- evict
@pytest.mark.parametrize(
    "size, exc, match",
    [
        (True, TypeError, "size"),
        (1.0, TypeError, "size"),
        (-1, ValueError, ">= 0"),
        (9, RuntimeError, "only 8 are evictable"),
    ],
)
def test_evict_misuse_changes_nothing(size, exc, match):
    m = BlockHashCacheManager(page_size=4)
    m.insert_prefix(ids(*range(12)), slots_of([0, 1, 2], 4))
    m.lock_handle(m.match_prefix(ids(*range(4)))[0])
    unchanged(m, exc, match, m.evict, size)


def test_evict_whole_blocks_deepest_first_never_locked():
    m = BlockHashCacheManager(page_size=4)
    m.insert_prefix(ids(*range(12)), slots_of([0, 1, 2], 4))
    m.lock_handle(m.match_prefix(ids(*range(4)))[0])
    assert m.evict(1).tolist() == slots_of([2], 4).tolist()  # one whole block for one token
    assert m.evict(4).tolist() == slots_of([1], 4).tolist()
    assert m.size_info == SizeInfo(0, 4)
    with pytest.raises(RuntimeError, match="only 0 are evictable"):
        m.evict(1)
    m.check_integrity()


def test_lru_order_and_chain_order():
    m = BlockHashCacheManager(page_size=1)
    m.insert_prefix(ids(1, 2), torch.tensor([10, 11], dtype=torch.int32))  # chain A
    m.insert_prefix(ids(7), torch.tensor([20], dtype=torch.int32))  # B
    m.insert_prefix(
        ids(1, 3), torch.tensor([0, 12], dtype=torch.int32)
    )  # child of A's head: uses it
    m.check_integrity()
    # A's tail [2] is oldest, then B, then the new child [3], then A's head [1] (just used).
    assert m.evict(4).tolist() == [11, 20, 12, 10]
    m.insert_prefix(ids(1, 2), torch.tensor([10, 11], dtype=torch.int32))
    m.insert_prefix(ids(7), torch.tensor([20], dtype=torch.int32))
    m.match_prefix(ids(1, 5))  # refreshes [1] only: queue [2], [7], [1]
    assert m.evict(3).tolist() == [11, 20, 10]
    m.check_integrity()


def test_match_refreshes_the_whole_matched_chain():
    m = BlockHashCacheManager(page_size=1)
    m.insert_prefix(ids(1, 2, 3), torch.tensor([0, 1, 2], dtype=torch.int32))
    m.insert_prefix(ids(7), torch.tensor([3], dtype=torch.int32))
    m.match_prefix(ids(1, 2, 3))
    assert m.evict(1).tolist() == [3]
    assert m.evict(3).tolist() == [2, 1, 0]


def test_unlock_releases_the_chain_deepest_first():
    m = BlockHashCacheManager(page_size=1)
    m.insert_prefix(ids(1, 2, 3), torch.tensor([0, 1, 2], dtype=torch.int32))
    h, _ = m.match_prefix(ids(1, 2, 3))
    m.lock_handle(h)
    m.insert_prefix(ids(9), torch.tensor([5], dtype=torch.int32))
    m.lock_handle(h, unlock=True)
    assert [m.get_block(x).tokens for x in m.free_queue()] == [(9,), (3,), (2,), (1,)]
    assert m.evict(4).tolist() == [5, 2, 1, 0]


def test_evict_refuses_if_the_queue_order_were_broken():
    m = BlockHashCacheManager(page_size=1)
    m.insert_prefix(ids(1, 2), torch.tensor([0, 1], dtype=torch.int32))
    key = m.match_prefix(ids(1, 2))[0].block_hashes[1]
    m.free_queue()
    page = m.get_block(key).page
    m._table.free.push(np.array([page]), 0)  # corrupt: moved to the tail, the parent now first
    with pytest.raises(RuntimeError, match="queued after its parent"):
        m.check_integrity()
    unchanged_dump = dump(m)
    with pytest.raises(RuntimeError, match="internal error"):
        m.evict(1)
    assert dump(m) == unchanged_dump


# -------------------------------------------------------------------- reset
def test_reset():
    m = BlockHashCacheManager(page_size=2)
    m.insert_prefix(ids(1, 2, 3, 4), slots_of([0, 1], 2))
    h, _ = m.match_prefix(ids(1, 2))
    m.lock_handle(h)
    unchanged(m, RuntimeError, "cannot reset while 2 tokens are locked", m.reset)
    m.lock_handle(h, unlock=True)
    m.reset()
    assert m.size_info == SizeInfo(0, 0) and m.num_blocks == 0 and m.free_queue() == []
    assert m.match_prefix(ids(1, 2, 3, 4))[0].cached_len == 0
    with pytest.raises(RuntimeError, match="evicted"):
        m.lock_handle(h)
    m.check_integrity()
    assert m.insert_prefix(ids(1, 2), slots_of([0], 2)) == 0  # pages are reusable after a reset


# --------------------------------------------------------- check_integrity
def _corrupt(fn):
    m = BlockHashCacheManager(page_size=2)
    m.insert_prefix(ids(1, 2, 3, 4, 5, 6), slots_of([0, 1, 2], 2))
    m.insert_prefix(ids(1, 2, 7, 7), slots_of([0, 3], 2))
    m.lock_handle(m.match_prefix(ids(1, 2, 3, 4))[0])
    m.check_integrity()
    bl = list(m.blocks())  # [1 2] locked, [3 4] locked, [5 6] free, [7 7] free
    fn(m, bl)
    return m


@pytest.mark.parametrize(
    "fn, match",
    [
        (lambda m, b: m._table.ref.__setitem__(b[2].page, -1), "negative ref_count|free queue"),
        (lambda m, b: m._table.ref.__setitem__(b[1].page, 2), "exceeds its parent"),
        (lambda m, b: m._table.tok.__setitem__(b[2].page, [5, 9]), "hash does not match"),
        (lambda m, b: m._table.free.remove(np.array([b[3].page])), "not in the free queue"),
        (lambda m, b: m._table.free.push(np.array([b[0].page]), 1), "in the free queue"),
        (
            lambda m, b: (m._table.reserve(999), m._table.free.push(np.array([999]), 1)),
            "not cached",
        ),
        (lambda m, b: m._table.free.where.__setitem__(b[3].page, -1), "free queue: 1 pages"),
        (lambda m, b: setattr(m._table.free, "size", 3), "3 counted"),
        (lambda m, b: m._table.page_of.pop(b[1].block_hash), "pages recorded"),
        (lambda m, b: m._table.gen.__setitem__(b[1].page, -1), "pages recorded"),
        (
            lambda m, b: (
                m._table.gen.__setitem__(b[1].page, -1),
                m._table.page_of.pop(b[1].block_hash),
            ),
            "parent on page 1 is not cached",
        ),
        (lambda m, b: m._table.page_of.__setitem__(77, b[0].page), "pages recorded"),
        (
            lambda m, b: m._table.page_of.__setitem__(b[0].block_hash, b[3].page),
            "pages recorded|wrong key",
        ),
        (lambda m, b: m._table.key.__setitem__(b[0].page, 1), "wrong key"),
        (lambda m, b: m._table.nchild.__setitem__(b[0].page, 1), "records 1 children, has 2"),
        (lambda m, b: setattr(m._table, "num_locked", 3), "recorded 3 locked blocks, counted 2"),
        (lambda m, b: m._table.last.__setitem__(b[3].page, 0), "LRU order"),
        (lambda m, b: m._table.probe.__setitem__(b[2].page, 5), "probe 5 outside"),
        (lambda m, b: m._table.ns.__setitem__(b[1].page, "x"), "namespace recorded"),
    ],
)
def test_check_integrity_catches(fn, match):
    m = _corrupt(fn)
    with pytest.raises(RuntimeError, match=match):
        m.check_integrity()


def test_check_integrity_catches_duplicate_content():
    m = BlockHashCacheManager(page_size=1, hash_fn=lambda p, t: 0)
    m.insert_prefix(ids(4), torch.tensor([0], dtype=torch.int32))
    # The same content again, on page 1: its hash 0 is taken, so it is filed under key 1.
    m._table.add(np.array([1]), 1, np.array([[4]]), [0], -1, m.clock, None)
    assert m.max_probe == 1
    with pytest.raises(RuntimeError, match="cached twice"):
        m.check_integrity()


def test_blocks_are_copies():
    """`blocks` and `get_block` give copies: changing one changes nothing in the manager."""
    m = _corrupt(lambda m, b: None)
    before = dump(m)
    for b in m.blocks():
        b.ref_count, b.page, b.token_bytes = 99, 99, b""
    assert dump(m) == before
    m.check_integrity()


# ---------------------------------------------------------- request flow
def test_request_flow_shares_prefixes_and_evicts():
    ps = 4
    m = BlockHashCacheManager(page_size=ps)
    flow = RequestFlow(m, PageAllocator(6, ps))
    a = flow.begin(ids(*range(10)))
    flow.mark_computed(a)
    assert flow.finish(a) == 0
    b = flow.begin(ids(*range(8), 50, 51, 52))
    assert (
        b.reused_len == 8 and b.indices[:8].tolist() == m.match_prefix(ids(*range(8)))[1].tolist()
    )
    flow.check_integrity()
    flow.mark_computed(b)
    assert flow.finish(b) == 8
    flow.check_integrity()
    c = flow.begin(ids(*range(100, 120)))  # 5 pages: evicts
    assert flow.stats.evicted_tokens > 0
    flow.check_integrity()
    flow.abort(c)
    flow.check_integrity()


def test_manager_agrees_with_radix_on_page_accounting_example():
    for ps in (1, 4):
        flows = [
            RequestFlow(cls(page_size=ps), PageAllocator(64, ps))
            for cls in (BlockHashCacheManager, RadixCacheManager)
        ]
        for prompt in [tuple(range(9)), (*tuple(range(5)), 9, 9, 9), (*tuple(range(9)), 1)]:
            reqs = [f.begin(ids(*prompt)) for f in flows]
            assert reqs[0].reused_len == reqs[1].reused_len
            for f, r in zip(flows, reqs, strict=False):
                f.mark_computed(r)
            assert flows[0].finish(reqs[0]) == flows[1].finish(reqs[1])


# --------------------------------------------------- agreement with radix
def _prompts(ps: int):
    bases = [tuple(random.Random(s).randrange(3) for _ in range(5 * ps)) for s in range(3)]
    return st.builds(
        lambda b, k, tail: bases[b][:k] + tuple(tail),
        st.integers(0, 2),
        st.integers(0, 5 * ps),
        st.lists(st.integers(0, 2), max_size=2 * ps),
    ).filter(lambda p: len(p) > 0)


@pytest.mark.parametrize("ps", [1, 4])
def test_agrees_with_radix_on_cached_len(ps):
    """With equal page sizes and a pool large enough that nothing is evicted, the two designs
    cache exactly the same prefixes: every match and insert reports the same length, and since
    both flows allocate the same pages, they hold the same slots."""

    @settings(max_examples=40, deadline=None, derandomize=True)
    @given(
        ops=st.lists(
            st.tuples(_prompts(ps), st.integers(0, 3), st.booleans()), min_size=1, max_size=12
        )
    )
    def run(ops):
        flows = [
            RequestFlow(BlockHashCacheManager(page_size=ps), PageAllocator(512, ps)),
            RequestFlow(RadixCacheManager(page_size=ps), PageAllocator(512, ps)),
        ]
        running: list[list] = []
        for prompt, finish_k, chunk in ops:
            pair = [f.begin(ids(*prompt)) for f in flows]
            assert pair[0].reused_len == pair[1].reused_len
            for f, r in zip(flows, pair, strict=False):
                f.mark_computed(r)
            if chunk:  # a chunked request: insert what is computed and keep running
                assert flows[0].cache(pair[0]) == flows[1].cache(pair[1])
                assert pair[0].tree_len == pair[1].tree_len
            running.append(pair)
            for _ in range(min(finish_k, len(running))):
                pair = running.pop(0)
                assert flows[0].finish(pair[0]) == flows[1].finish(pair[1])
            for f in flows:
                f.check_integrity()
            assert flows[0].manager.size_info == flows[1].manager.size_info
            assert sorted(flows[0].manager.cached_indices().tolist()) == sorted(
                flows[1].manager.cached_indices().tolist()
            )
        for prompt, _, _ in ops:
            (h0, i0), (h1, i1) = (f.manager.match_prefix(ids(*prompt)) for f in flows)
            assert h0.cached_len == h1.cached_len and i0.tolist() == i1.tolist()

    run()


# ------------------------------------------------ issue 9: reliability
@settings(max_examples=60, deadline=None, derandomize=True)
@given(ops=st.lists(st.tuples(st.integers(0, 3), st.booleans()), max_size=30))
def test_only_locked_handles_unlock(ops):
    """Issue 9 item 3: the manager tracks which handles are locked. Four handles on nested
    prefixes of one chain (and a copy of one); unlocking a handle locked fewer times than it was
    unlocked raises RuntimeError and changes nothing, even while the blocks are locked through a
    longer or shorter handle. Model: a lock count per handle value."""
    m = BlockHashCacheManager(page_size=2)
    m.insert_prefix(ids(*range(8)), slots_of([0, 1, 2, 3], 2))
    handles = [m.match_prefix(ids(*range(k)))[0] for k in (2, 4, 6, 8)]
    model = [0, 0, 0, 0]
    for i, unlock in ops:
        if unlock and model[i] == 0:
            unchanged(m, RuntimeError, "not locked", m.lock_handle, handles[i], unlock=True)
            continue
        m.lock_handle(copy.copy(handles[i]) if unlock else handles[i], unlock=unlock)
        model[i] += -1 if unlock else 1
        m.check_integrity()
        assert m.locked_handles() == {h: n for h, n in zip(handles, model, strict=False) if n}
        depth = max([k + 1 for k in range(4) if model[k]], default=0)
        assert m.size_info == SizeInfo(8 - 2 * depth, 2 * depth)


def test_unlock_of_a_never_locked_prefix_while_a_longer_one_is_locked():
    m = BlockHashCacheManager(page_size=2)
    m.insert_prefix(ids(1, 2, 3, 4), slots_of([0, 1], 2))
    short, _ = m.match_prefix(ids(1, 2))
    long_, _ = m.match_prefix(ids(1, 2, 3, 4))
    m.lock_handle(long_)
    unchanged(m, RuntimeError, "not locked", m.lock_handle, short, unlock=True)
    m.lock_handle(long_, unlock=True)
    assert m.size_info == SizeInfo(4, 0) and m.evict(4).numel() == 4


class RaisingHash:
    """The default hash, but the ``k``-th call (counting from 1 after ``arm``) raises."""

    def __init__(self) -> None:
        self.calls, self.fail_at = 0, None

    def arm(self, k: int) -> None:
        self.calls, self.fail_at = 0, k

    def __call__(self, parent: int, tokens: tuple) -> int:
        self.calls += 1
        if self.calls == self.fail_at:
            raise KeyError("hash_fn failed")
        return default_block_hash(parent, tokens)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(k=st.integers(1, 12), tail=st.lists(st.integers(0, 3), min_size=0, max_size=16))
def test_hash_fn_raising_on_any_block_changes_nothing(k, tail):
    """Issue 9 item 8: everything that can raise runs before anything changes, so a hash_fn that
    raises on the k-th block of an insert (or of a match) leaves the manager as it was."""
    fn = RaisingHash()
    m = BlockHashCacheManager(page_size=2, hash_fn=fn)
    m.insert_prefix(ids(1, 2, 3, 4, 5, 6), slots_of([0, 1, 2], 2))
    m.lock_handle(m.match_prefix(ids(1, 2))[0])
    seq = (1, 2, 3, 4, *tail)
    idx = slots_of(list(range(10, 10 + len(seq) // 2 + 1)), 2, len(seq))
    for call in (m.match_prefix, m.insert_prefix, m.insert_and_match):
        args = (ids(*seq),) if call == m.match_prefix else (ids(*seq), idx)
        before = dump(m)
        fn.arm(k)
        try:
            call(*args)
        except KeyError:
            assert dump(m) == before  # raised on some block: nothing changed
            m.check_integrity()
        else:
            assert fn.calls < k  # it never reached the k-th hash
            break
    fn.arm(None)
    m.insert_prefix(ids(*seq), idx)
    m.check_integrity()
    assert m.match_prefix(ids(*seq))[0].cached_len == len(seq) // 2 * 2


def test_hash_fn_raising_on_a_later_block_example():
    fn = RaisingHash()
    m = BlockHashCacheManager(page_size=2, hash_fn=fn)
    m.insert_prefix(ids(1, 2), slots_of([0], 2))
    m2 = BlockHashCacheManager(
        page_size=2, hash_fn=fn
    )  # no remembered hashes: every block is hashed
    for mgr in (m, m2):
        fn.arm(3)
        unchanged(
            mgr,
            KeyError,
            "hash_fn failed",
            mgr.insert_prefix,
            ids(5, 6, 7, 8, 9, 9),
            slots_of([4, 5, 6], 2),
        )


@pytest.mark.parametrize("bad", [1.5, True, None, "7"])
def test_hash_fn_must_return_an_int(bad):
    m = BlockHashCacheManager(page_size=2, hash_fn=lambda p, t: bad)
    unchanged(
        m, TypeError, "hash_fn must return an int", m.insert_prefix, ids(1, 2), slots_of([0], 2)
    )


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    old=st.lists(st.integers(0, 3), min_size=2, max_size=6),
    new=st.lists(st.integers(0, 3), min_size=2, max_size=6),
    weak=st.sampled_from(["zero", "first token", "length"]),
)
def test_stale_handle_never_names_another_prompts_blocks(old, new, weak):
    """Issue 9 item 14: with a weak hash, evict a handle's blocks and cache other tokens that take
    the same keys: the old handle must neither lock nor name the new blocks. Caching the *same*
    tokens again revives it (a handle names content)."""
    hash_fn = {
        "zero": lambda p, t: 0,
        "first token": lambda p, t: t[0],
        "length": lambda p, t: len(t),
    }[weak]
    n = min(len(old), len(new)) // 2 * 2
    old, new = tuple(old[:n]), tuple(new[:n])
    m = BlockHashCacheManager(page_size=2, hash_fn=hash_fn)
    m.insert_prefix(ids(*old), slots_of(list(range(n // 2)), 2))
    h, _ = m.match_prefix(ids(*old))
    assert h.cached_len == n
    m.evict(n)
    m.insert_prefix(ids(*new), slots_of(list(range(10, 10 + n // 2)), 2))
    if new != old:
        unchanged(m, RuntimeError, "evicted|other tokens|does not chain", m.lock_handle, h)
        unchanged(m, RuntimeError, "evicted|other tokens|does not chain", m.handle_indices, h)
    else:
        assert m.handle_indices(h).tolist() == slots_of(list(range(10, 10 + n // 2)), 2).tolist()


def test_stale_handle_after_collision_example():
    m = BlockHashCacheManager(page_size=2, hash_fn=lambda p, t: 0)
    m.insert_prefix(ids(1, 2), slots_of([0], 2))
    h, _ = m.match_prefix(ids(1, 2))
    m.evict(2)
    m.insert_prefix(ids(7, 7), slots_of([5], 2))  # takes h's key 0
    assert m.get_block(h.block_hashes[0]).tokens == (7, 7)
    unchanged(m, RuntimeError, "other tokens", m.lock_handle, h)
    unchanged(m, RuntimeError, "other tokens", m.handle_indices, h)
    unchanged(m, RuntimeError, "other tokens", m.lock_handle, h, unlock=True)


@pytest.mark.parametrize(
    "size",
    [
        True,
        np.bool_(True),
        torch.tensor(True),
        1.0,
        2j,
        np.float64(2.0),
        torch.tensor(2.0),
        torch.tensor([2]),
        "2",
        None,
    ],
)
def test_evict_counts_must_be_real_ints(size):
    """Issue 9 items 2/5: counts are real integers; bools, floats and complex numbers are refused."""
    m = BlockHashCacheManager(page_size=2)
    m.insert_prefix(ids(1, 2, 3, 4), slots_of([0, 1], 2))
    unchanged(m, TypeError, "size must be an int", m.evict, size)


@pytest.mark.parametrize(
    "size", [2, np.int64(2), torch.tensor(2), torch.tensor(2, dtype=torch.int32)]
)
def test_evict_accepts_integer_counts(size):
    m = BlockHashCacheManager(page_size=2)
    m.insert_prefix(ids(1, 2, 3, 4), slots_of([0, 1], 2))
    assert m.evict(size).tolist() == [2, 3]


@pytest.mark.parametrize(
    "dtype",
    [
        torch.bool,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.int64,
        torch.int16,
        torch.uint8,
    ],
)
def test_slots_must_be_int32_before_any_cast(dtype):
    """Issue 9 item 2: slots are dtype-checked before anything is cast: a slot of 2**32 + 1 can
    never wrap to 1, a float or bool is never truncated."""
    m = _filled()
    idx = (
        torch.tensor([2**32 + 4, 2**32 + 5, 2**32 + 6, 2**32 + 7])
        if dtype == torch.int64
        else torch.ones(4)
    )
    unchanged(m, TypeError, "torch.int32", m.insert_prefix, ids(9, 9, 9, 9), idx.to(dtype))


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32, torch.complex64])
def test_token_ids_must_be_integers(dtype):
    m = _filled()
    unchanged(m, TypeError, "integer dtype", m.match_prefix, torch.ones(4, dtype=dtype))
    unchanged(
        m, TypeError, "integer dtype", m.insert_prefix, torch.ones(4, dtype=dtype), slots_of([9], 4)
    )


def test_lock_flag_must_be_a_bool():
    m = _filled()
    h, _ = m.match_prefix(ids(*range(4)))
    unchanged(m, TypeError, "unlock must be a bool", m.lock_handle, h, unlock=1)


def test_insert_and_match_is_one_walk_with_the_same_result():
    """insert_and_match == insert_prefix then match_prefix (cached length, handle, its slots)."""
    a, b = BlockHashCacheManager(page_size=2), BlockHashCacheManager(page_size=2)
    for seq, pages in [
        ((1, 2, 3, 4, 5), [0, 1, 2]),
        ((1, 2, 3, 4, 6, 6, 7), [3, 4, 5, 6]),
        ((8, 8), [7]),
    ]:
        idx = slots_of(pages, 2, len(seq))
        res = a.insert_and_match(ids(*seq), idx)
        assert res.cached_len == b.insert_prefix(ids(*seq), idx)
        h, slots = b.match_prefix(ids(*seq))
        assert res.handle == h and a.handle_indices(res.handle).tolist() == slots.tolist()
        a.lock_handle(res.handle)
        b.lock_handle(h)
        assert a.size_info == b.size_info
        a.check_integrity()


def test_request_hashes_are_reused_but_never_trusted_blindly():
    """The block hashes remembered from match_prefix are used by the next insert only for the
    tokens that are still the same: an insert of other tokens with the same first block, or of
    a tensor changed in place since the match, caches exactly its own content."""
    m = BlockHashCacheManager(page_size=2)
    ref = BlockHashCacheManager(page_size=2)
    seq = torch.tensor([1, 2, 3, 4, 5, 6])
    m.match_prefix(seq)
    seq[3] = 9  # the caller changed the tensor after matching
    for mgr in (m, ref):
        assert mgr.insert_prefix(seq, slots_of([0, 1, 2], 2)) == 0
        assert mgr.insert_prefix(ids(1, 2, 7, 7), slots_of([3, 4], 2)) == 2
    assert prefixes_in(m) == prefixes_in(ref)
    m.check_integrity()


@pytest.mark.parametrize("ps", [1, 4])
def test_views_of_ids_and_slots_act_like_their_contents(ps):
    """Token ids and slots are read by value, whatever the view: strided, expanded (stride 0),
    sliced with an offset, or of a narrower integer dtype."""
    seq = list(range(3 * ps)) + [7] * ps
    pages = [5, 2, 9, 4]
    a, b = BlockHashCacheManager(page_size=ps), BlockHashCacheManager(page_size=ps)
    ids_view = torch.tensor([[t, -1] for t in seq])[:, 0]  # stride 2
    slot_view = torch.cat(
        [torch.zeros(3, dtype=torch.int32), slots_of(pages, ps).repeat_interleave(2)]
    )[3::2]
    assert a.insert_prefix(ids_view, slot_view) == b.insert_prefix(ids(*seq), slots_of(pages, ps))
    assert prefixes_in(a) == prefixes_in(b)
    same = torch.tensor([7], dtype=torch.int16).expand(2 * ps)  # stride 0
    for m in (a, b):
        assert m.insert_prefix(same, slots_of([11, 12], ps)) == 0
    assert prefixes_in(a) == prefixes_in(b)
    for q in (ids_view, ids(*seq), same):
        (ha, ia), (hb, ib) = a.match_prefix(q), b.match_prefix(q.contiguous())
        assert ha == hb and ia.tolist() == ib.tolist()
    a.check_integrity()


def test_agrees_with_a_vllm_style_stand_in_on_a_seeded_trace():
    """The benchmark's vLLM stand-in (SHA-256 block hashes, hash -> block dict, LRU free list)
    makes exactly our decisions on a seeded trace with eviction: tokens reused per request,
    tokens evicted, and the slots cached after every request."""
    from kvcache.examples.vllm_standin import VllmStandIn
    from kvcache.serving.workloads import multi_turn_chat

    jobs = multi_turn_chat(6, 4, system_len=40, message_len=(5, 30), output_len=(5, 30), seed=3)
    for ps in (1, 4):
        flows = [
            RequestFlow(make, PageAllocator(600 // ps, ps))
            for make in (
                BlockHashCacheManager("cpu", ps),
                VllmStandIn("cpu", ps),
                VllmStandIn("cpu", ps, hash_once=False),
            )
        ]
        for job in jobs:
            reqs = [f.begin(job.prompt) for f in flows]
            assert len({r.reused_len for r in reqs}) == 1
            for f, r in zip(flows, reqs, strict=False):
                f.mark_computed(r)
                f.extend(r, job.output)
                f.mark_computed(r)
                f.finish(r)
            assert len({f.stats.evicted_tokens for f in flows}) == 1
            cached = [sorted(f.manager.cached_indices().tolist()) for f in flows]
            assert cached[0] == cached[1] == cached[2]
        assert flows[0].stats.evicted_tokens > 0
        flows[0].check_integrity()


def test_nothing_handed_out_shares_the_managers_state():
    """A handle holds only immutable values (its length, keys and token bytes), and the slots
    that match_prefix and handle_indices return are the caller's: writing into them, or trying
    to change the handle, changes nothing in the manager."""
    import dataclasses

    m = BlockHashCacheManager(page_size=2)
    m.insert_prefix(ids(1, 2, 3, 4), slots_of([0, 1], 2))
    h, idx = m.match_prefix(ids(1, 2, 3, 4))
    m.lock_handle(h)
    before = dump(m)
    assert isinstance(h.block_hashes, tuple) and isinstance(h.tokens, bytes)
    with pytest.raises(dataclasses.FrozenInstanceError):
        h.cached_len = 2  # type: ignore[misc]
    idx[0] = 99
    m.handle_indices(h)[1] = 99
    assert dump(m) == before
    assert m.handle_indices(h).tolist() == [0, 1, 2, 3]
    m.lock_handle(h, unlock=True)
    m.check_integrity()
