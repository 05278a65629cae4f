"""BlockHashCacheManager: every method and every misuse, collisions, LRU order, agreement with the
radix manager. Its stateful test under RequestFlow is the shared machine in
tests/test_flow_stateful.py."""

from __future__ import annotations

import copy
import random
from typing import Dict, List, Tuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.serving.allocator import PageAllocator
from kvcache import BaseCacheManager, SizeInfo
from kvcache.managers.block_hash import BlockHashCacheHandle, BlockHashCacheManager, CachedBlock
from kvcache.managers.radix import RadixCacheManager
from kvcache.serving.request_flow import RequestFlow
from conftest import ids, page_slots as slots_of, unchanged as watch

Prefix = Tuple[int, ...]


# ----------------------------------------------------------------- helpers
def dump(m: BlockHashCacheManager) -> tuple:
    """Everything the manager holds, as plain values: equal dumps mean equal states."""
    blocks = tuple(
        (k, b.block_hash, b.parent_hash, b.tokens, b.page, b.ref_count, b.num_children, b.last_use, b.probe)
        for k, b in m._blocks.items()
    )
    return (blocks, tuple(m._free), tuple(sorted(m._page_owner.items())), m._num_locked,
            m._max_probe, m.clock, m.size_info)


def prefixes_in(m: BlockHashCacheManager) -> Dict[Prefix, int]:
    """Every cached full-block prefix -> its page, rebuilt by following parent hashes."""
    out: Dict[Prefix, int] = {}
    for b in m.blocks():
        toks: List[Tuple[int, ...]] = []
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


@pytest.mark.parametrize("ps, exc", [(0, ValueError), (-3, ValueError), (True, TypeError), (2.0, TypeError), ("4", TypeError)])
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
    cases = [((*range(12), 99), 8, [3, 7]), (tuple(range(8)), 8, [3, 7]), (tuple(range(7)), 4, [3]),
             ((0, 1, 2, 3, 4, 5, 6, 99), 4, [3]), ((0, 1, 2, 99, 4, 5, 6, 7), 0, []), ((0, 1, 2), 0, [])]
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
    h, idx = m.match_prefix(ids(1, 2, 3, 4, 5, 6))
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


@pytest.mark.parametrize("bad, exc, match", [
    ([1, 2, 3, 4], TypeError, "input_ids must be a torch.Tensor"),
    (torch.zeros(2, 2, dtype=torch.int64), ValueError, "1-D"),
    (torch.zeros(4), TypeError, "integer dtype"),
])
def test_match_misuse_changes_nothing(bad, exc, match):
    m = BlockHashCacheManager(page_size=2)
    m.insert_prefix(ids(1, 2, 3, 4), slots_of([0, 1], 2))
    unchanged(m, exc, match, m.match_prefix, bad)


def _filled() -> BlockHashCacheManager:
    m = BlockHashCacheManager(page_size=4)
    m.insert_prefix(ids(*range(8)), slots_of([2, 3], 4))
    m.lock_handle(m.match_prefix(ids(*range(4)))[0])
    return m


@pytest.mark.parametrize("input_ids, indices, exc, match", [
    ([0, 1, 2, 3], slots_of([5], 4), TypeError, "input_ids"),
    (ids(*range(8)), [20, 21, 22, 23, 24, 25, 26, 27], TypeError, "indices must be a torch.Tensor"),
    (ids(*range(8)), slots_of([5, 6], 4).long(), TypeError, "torch.int32"),
    (ids(*range(8)), slots_of([5, 6], 4).view(2, 4), ValueError, "1-D"),
    (ids(*range(8)), torch.zeros(8, dtype=torch.int32, device="meta"), ValueError, "device"),
    (ids(*range(12)), slots_of([5, 6], 4), ValueError, r"len\(indices\) \(8\) must equal len\(input_ids\) \(12\)"),
    (ids(*range(12)), slots_of([5, 6, 7], 4) + 1, ValueError, "consecutive slots of one page"),
    (ids(*range(12)), torch.tensor([*range(20, 24), 24, 25, 27, 26, *range(28, 32)], dtype=torch.int32),
     ValueError, "consecutive slots"),
    (ids(*range(12)), slots_of([5, -1, 7], 4), ValueError, ">= 0"),
    (ids(*range(4), 9, 9, 9, 9), slots_of([5, 3], 4), ValueError, "page 3 .* already holds cached block"),
    (ids(*range(4), *[9] * 8), slots_of([5, 6, 6], 4), ValueError, "page 6 appears in more than one new block"),
])
def test_insert_misuse_changes_nothing(input_ids, indices, exc, match):
    m = _filled()
    unchanged(m, exc, match, m.insert_prefix, input_ids, indices)


def test_unaligned_tail_is_not_checked_and_stays_the_callers():
    m = BlockHashCacheManager(page_size=4)
    idx = torch.tensor([8, 9, 10, 11, 30, 1], dtype=torch.int32)  # tail past the full block: anything
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
    assert m._max_probe > 0  # the weak hash did collide
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
    from kvcache.managers.block_hash import ROOT_HASH_SEED, default_block_hash as h
    assert h(h(ROOT_HASH_SEED, (1, 2, 3)), (4, 5, 6)) == 14104448956996097241
    assert 0 <= h(ROOT_HASH_SEED, (-5,)) < 2 ** 64


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
    unchanged(m, RuntimeError, "cached_len=6 but names 2 blocks", m.lock_handle,
              BlockHashCacheHandle(6, h.block_hashes))
    unchanged(m, RuntimeError, "does not chain", m.lock_handle,
              BlockHashCacheHandle(4, h.block_hashes[::-1]))
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
@pytest.mark.parametrize("size, exc, match", [(True, TypeError, "size"), (1.0, TypeError, "size"),
                                              (-1, ValueError, ">= 0"), (9, RuntimeError, "only 8 are evictable")])
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
    m.insert_prefix(ids(1, 3), torch.tensor([0, 12], dtype=torch.int32))  # child of A's head: uses it
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
    m._free.move_to_end(m.match_prefix(ids(1, 2))[0].block_hashes[1])  # corrupt: parent now first
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


@pytest.mark.parametrize("fn, match", [
    (lambda m, b: setattr(b[2], "ref_count", -1), "negative ref_count|free queue"),
    (lambda m, b: setattr(b[1], "ref_count", 2), "exceeds its parent"),
    (lambda m, b: setattr(b[2], "tokens", (5, 9)), "hash does not match"),
    (lambda m, b: setattr(b[2], "tokens", (5,)), "not 2 ints"),
    (lambda m, b: m._free.pop(b[3].block_hash), "not in the free queue"),
    (lambda m, b: m._free.__setitem__(b[0].block_hash, None), "in the free queue"),
    (lambda m, b: m._free.__setitem__(999, None), "not cached"),
    (lambda m, b: m._blocks.pop(b[1].block_hash), "parent .* is not cached"),
    (lambda m, b: setattr(b[3], "page", 1), "page 1 is not recorded"),
    (lambda m, b: m._page_owner.__setitem__(77, b[0].block_hash), "pages recorded"),
    (lambda m, b: setattr(b[0], "num_children", 1), "records 1 children, has 2"),
    (lambda m, b: setattr(m, "_num_locked", 3), "recorded 3 locked blocks, counted 2"),
    (lambda m, b: setattr(b[3], "last_use", 0), "LRU order"),
    (lambda m, b: setattr(b[2], "probe", 5), "probe 5 outside"),
    (lambda m, b: setattr(b[0], "block_hash", 1), "wrong key"),
])
def test_check_integrity_catches(fn, match):
    m = _corrupt(fn)
    with pytest.raises(RuntimeError, match=match):
        m.check_integrity()


def test_check_integrity_catches_duplicate_content():
    m = BlockHashCacheManager(page_size=1, hash_fn=lambda p, t: 0)
    m.insert_prefix(ids(4), torch.tensor([0], dtype=torch.int32))
    m._add_block(None, (4,), 1, m.clock)  # the same content under a second key
    m._free[m._page_owner[1]] = None
    with pytest.raises(RuntimeError, match="cached twice"):
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
    assert b.reused_len == 8 and b.indices[:8].tolist() == m.match_prefix(ids(*range(8)))[1].tolist()
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
        flows = [RequestFlow(cls(page_size=ps), PageAllocator(64, ps)) for cls in (BlockHashCacheManager, RadixCacheManager)]
        for prompt in [tuple(range(9)), tuple(range(5)) + (9, 9, 9), tuple(range(9)) + (1,)]:
            reqs = [f.begin(ids(*prompt)) for f in flows]
            assert reqs[0].reused_len == reqs[1].reused_len
            for f, r in zip(flows, reqs):
                f.mark_computed(r)
            assert flows[0].finish(reqs[0]) == flows[1].finish(reqs[1])


# --------------------------------------------------- agreement with radix
def _prompts(ps: int):
    bases = [tuple(random.Random(s).randrange(3) for _ in range(5 * ps)) for s in range(3)]
    return st.builds(lambda b, k, tail: bases[b][:k] + tuple(tail), st.integers(0, 2),
                     st.integers(0, 5 * ps), st.lists(st.integers(0, 2), max_size=2 * ps)
                     ).filter(lambda p: len(p) > 0)


@pytest.mark.parametrize("ps", [1, 4])
def test_agrees_with_radix_on_cached_len(ps):
    """With equal page sizes and a pool large enough that nothing is evicted, the two designs
    cache exactly the same prefixes: every match and insert reports the same length, and since
    both flows allocate the same pages, they hold the same slots."""

    @settings(max_examples=40, deadline=None, derandomize=True)
    @given(ops=st.lists(st.tuples(_prompts(ps), st.integers(0, 3), st.booleans()), min_size=1, max_size=12))
    def run(ops):
        flows = [RequestFlow(BlockHashCacheManager(page_size=ps), PageAllocator(512, ps)),
                 RequestFlow(RadixCacheManager(page_size=ps), PageAllocator(512, ps))]
        running: List[list] = []
        for prompt, finish_k, chunk in ops:
            pair = [f.begin(ids(*prompt)) for f in flows]
            assert pair[0].reused_len == pair[1].reused_len
            for f, r in zip(flows, pair):
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
            assert sorted(flows[0].manager.cached_indices().tolist()) == sorted(flows[1].manager.cached_indices().tolist())
        for prompt, _, _ in ops:
            (h0, i0), (h1, i1) = (f.manager.match_prefix(ids(*prompt)) for f in flows)
            assert h0.cached_len == h1.cached_len and i0.tolist() == i1.tolist()

    run()
