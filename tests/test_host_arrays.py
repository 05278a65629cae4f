"""The NumPy forms of the fused calls (`match_and_lock`, `insert_and_unlock`) and of radix's
`evict(host=True)`: the same answers and the same state as the tensor forms, the same refusals,
and a flow that uses them only where a manager says it takes them (`takes_host_arrays`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from conftest import observe
from conftest import unchanged as watch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import (
    BaseCacheManager,
    BlockHashCacheManager,
    PageAllocator,
    RadixCacheManager,
    RequestFlow,
)
from kvcache.managers.base import fused_calls_safe, host_arrays_safe, takes_host_arrays


class PlainCalls(RadixCacheManager):
    """Radix driven through the base class's fused calls (which convert the NumPy forms)."""

    match_and_lock = BaseCacheManager.match_and_lock
    insert_and_unlock = BaseCacheManager.insert_and_unlock


class BlockPlain(BlockHashCacheManager):
    """Block hash driven through the base class's fused calls."""

    match_and_lock = BaseCacheManager.match_and_lock
    insert_and_unlock = BaseCacheManager.insert_and_unlock


MAKERS: dict[str, Callable[[], BaseCacheManager]] = {
    "radix1": RadixCacheManager,
    "radix4": lambda: RadixCacheManager(page_size=4),
    "radix4-fifo": lambda: RadixCacheManager(page_size=4, eviction_policy="fifo"),
    "plain2": lambda: PlainCalls(page_size=2),
    "blockhash2": lambda: BlockPlain(page_size=2),
}


def state(m: BaseCacheManager) -> Any:
    """`observe` less the class name (the two managers compared are of one class anyway)."""
    out = observe(m)
    return out[:1] + out[2:]


def as_host(x: Any) -> np.ndarray:
    return x if isinstance(x, np.ndarray) else x.cpu().numpy()


OPS = st.lists(
    st.tuples(
        st.sampled_from(["match", "insert", "relock", "evict"]),
        st.lists(st.integers(0, 3), min_size=0, max_size=12),  # few tokens: prefixes are shared
        st.integers(0, 9),
    ),
    min_size=1,
    max_size=25,
)


@pytest.mark.parametrize("name", list(MAKERS))
@settings(max_examples=40, deadline=None)
@given(ops=OPS, id_dtype=st.sampled_from([np.int64, np.int32, np.uint8]))
def test_numpy_and_tensor_forms_agree(name: str, ops: list, id_dtype: type) -> None:
    """Two managers, one driven with tensors and one with NumPy arrays (ids of several integer
    dtypes), make identical decisions: every answer equal, the whole state equal after every
    step (invariants checked), the NumPy side getting NumPy back and the tensor side tensors."""
    drive_forms(MAKERS[name](), MAKERS[name](), ops, id_dtype, state, same_length)


def same_length(a: Any, b: Any) -> bool:
    return a.cached_len == b.cached_len


def drive_forms(
    tm: BaseCacheManager,
    hm: BaseCacheManager,
    ops: list,
    id_dtype: type,
    state: Callable[[BaseCacheManager], Any],
    same_handles: Callable[[Any, Any], bool],
) -> None:
    """Run ``ops`` (from ``OPS``) on ``tm`` with tensors and on ``hm`` with NumPy arrays of ids
    in ``id_dtype``; after every step the answers agree, ``same_handles`` holds for the handles,
    ``state`` is equal and both managers pass ``check_integrity``."""
    ps = tm.page_size
    evict_host = host_arrays_safe(type(hm), "evict")
    held: list[tuple[Any, Any, list[int]]] = []  # (tensor handle, NumPy handle, tokens)
    fresh = 0  # next free page: every insert brings new pages past it

    for kind, toks, k in ops:
        if kind == "match" or (not held and kind in ("insert", "relock")):
            th, tidx = tm.match_and_lock(torch.tensor(toks, dtype=torch.int64))
            hh, hidx = hm.match_and_lock(np.array(toks, dtype=id_dtype))
            assert isinstance(tidx, torch.Tensor) and isinstance(hidx, np.ndarray)
            assert hidx.dtype == np.int32 and hidx.tolist() == tidx.tolist()
            assert same_handles(th, hh)
            held.append((th, hh, toks))
        elif kind in ("insert", "relock"):
            th, hh, base = held.pop(k % len(held))
            seq = base + toks
            n = len(seq)
            prefix = tm.handle_indices(th).tolist() if th.cached_len else []
            new = [fresh * ps + j for j in range(-(-(n - len(prefix)) // ps) * ps)]
            fresh += -(-(n - len(prefix)) // ps)
            slots = (prefix + new)[:n]
            relock = kind == "relock"
            tres = tm.insert_and_unlock(
                th,
                torch.tensor(seq, dtype=torch.int64),
                torch.tensor(slots, dtype=torch.int32),
                relock=relock,
            )
            hres = hm.insert_and_unlock(
                hh, np.array(seq, dtype=id_dtype), np.array(slots, dtype=np.int32), relock=relock
            )
            assert tres.cached_len == hres.cached_len
            assert same_handles(tres.handle, hres.handle)
            if relock:
                held.append((tres.handle, hres.handle, seq))
        else:  # evict what is evictable, up to k pages
            size = min(k * ps, tm.size_info.evictable_size)
            tout = tm.evict(size)
            hout = hm.evict(size, host=True) if evict_host else hm.evict(size)
            assert isinstance(tout, torch.Tensor)
            assert not evict_host or (isinstance(hout, np.ndarray) and hout.dtype == np.int32)
            assert as_host(hout).tolist() == tout.tolist()
        assert state(tm) == state(hm)
        tm.check_integrity()
        hm.check_integrity()
    for th, hh, _ in held:
        tm.lock_handle(th, unlock=True)
        hm.lock_handle(hh, unlock=True)
    assert state(tm) == state(hm) and tm.size_info.protected_size == 0


def populated(name: str) -> tuple[BaseCacheManager, Any]:
    """A manager holding two pages of ids 0.., and a locked handle on the first page."""
    m = MAKERS[name]()
    ps = m.page_size
    m.insert_prefix(torch.arange(2 * ps), torch.arange(2 * ps, dtype=torch.int32))
    handle, _ = m.match_and_lock(np.arange(ps))
    return m, handle


BAD_IDS = [
    (np.array([1.0, 2.0]), TypeError, "input_ids must have an integer dtype, got float64"),
    (np.array([True, False]), TypeError, "input_ids must have an integer dtype, got bool"),
    (
        np.array([1, 2], dtype=np.uint32),
        TypeError,
        "input_ids must have an integer dtype, got uint32",
    ),
    (np.array([[1, 2]]), ValueError, r"input_ids must be 1-D, got shape \(1, 2\)"),
    (np.array(["a", "b"]), TypeError, "input_ids must have an integer dtype, got <U1"),
    (  # the values are fine, but a byte view of them (the managers' keys) would not be
        np.array([1, 2], dtype=">i8"),
        TypeError,
        "input_ids must have an integer dtype in this machine's byte order, got >i8",
    ),
]


@pytest.mark.parametrize("name", list(MAKERS))
@pytest.mark.parametrize(("bad", "exc", "match"), BAD_IDS)
def test_bad_numpy_ids_are_refused_changing_nothing(name, bad, exc, match):
    m, handle = populated(name)
    ps = m.page_size
    with watch(m), pytest.raises(exc, match=match):
        m.match_and_lock(bad)
    slots = np.arange(8 * ps, 8 * ps + len(bad.reshape(-1)), dtype=np.int32)
    with watch(m), pytest.raises(exc, match=match):
        m.insert_and_unlock(handle, bad, slots)
    m.lock_handle(handle, unlock=True)  # still locked after the refusals: one unlock works
    assert m.size_info.protected_size == 0


@pytest.mark.parametrize("name", list(MAKERS))
def test_bad_numpy_slots_are_refused_changing_nothing(name):
    m, handle = populated(name)
    ps = m.page_size
    ids = np.arange(4 * ps)  # two pages cached, two new
    new = np.arange(8 * ps, 10 * ps)
    good = np.concatenate([np.arange(2 * ps), new]).astype(np.int32)
    for bad, exc, match in [
        (good.astype(np.int64), TypeError, "indices must have dtype int32, got int64"),
        (good.astype(np.float32), TypeError, "indices must have dtype int32, got float32"),
        (good[None, :], ValueError, r"indices must be 1-D, got shape \(1, "),
        (good[:-1], ValueError, r"len\(indices\)"),
        (np.where(good == 8 * ps, -8, good).astype(np.int32), ValueError, "-8"),
        (np.where(good == 9 * ps, 1, good).astype(np.int32), ValueError, r"\b1\b"),  # held
    ]:
        # Block hash takes the base default, whose lock check (unlock, lock again) re-stamps the
        # block's LRU clock before insert_prefix refuses (the tensor form alike): there only the
        # refusals made before that check (dtype, shape) leave everything as it was.
        late = name == "blockhash2" and bad.dtype == np.int32 and bad.ndim == 1
        with watch(m if not late else lambda: m.size_info), pytest.raises(exc, match=match):
            m.insert_and_unlock(handle, ids, bad)
    res = m.insert_and_unlock(handle, ids, good)  # the handle stayed locked: it goes through
    assert res.cached_len == 2 * ps and m.size_info.protected_size == 0


@pytest.mark.parametrize(
    ("make", "order"),
    [
        (RadixCacheManager, sorted),  # leaves in LRU order: all of one stamp here
        (lambda: BlockHashCacheManager(page_size=1), list),  # the free queue: last block first
    ],
)
def test_evict_host_keyword(make: Callable[[], BaseCacheManager], order: Callable) -> None:
    m = make()
    m.insert_prefix(torch.arange(3), torch.tensor([5, 6, 7], dtype=torch.int32))
    empty = m.evict(0, host=True)
    assert isinstance(empty, np.ndarray) and empty.dtype == np.int32 and empty.shape == (0,)
    with watch(m), pytest.raises(TypeError, match="host must be a bool, got int"):
        m.evict(1, host=1)
    with watch(m), pytest.raises(RuntimeError, match="cannot evict 4 tokens"):
        m.evict(4, host=True)
    out = m.evict(3, host=True)
    assert isinstance(out, np.ndarray)
    assert order(out.tolist()) == ([5, 6, 7] if order is sorted else [7, 6, 5])
    m.check_integrity()


def test_plain_calls_still_refuse_numpy():
    """Only the fused calls take the NumPy forms: match_prefix and insert_prefix refuse them as
    API.md says (a NumPy array is not a tensor)."""
    m = RadixCacheManager()
    with pytest.raises(TypeError, match=r"input_ids must be a torch\.Tensor, got ndarray"):
        m.match_prefix(np.arange(3))
    with pytest.raises(TypeError, match=r"input_ids must be a torch\.Tensor, got ndarray"):
        m.insert_and_match(np.arange(3), torch.arange(3, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"indices must be a torch\.Tensor, got ndarray"):
        m.insert_prefix(torch.arange(3), np.arange(3, dtype=np.int32))


class CountingMatch(RadixCacheManager):
    """Overrides match_prefix (to count): radix's fused calls would bypass it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.matches = 0

    def match_prefix(self, input_ids: torch.Tensor, extra_key: Any = None) -> Any:
        assert isinstance(input_ids, torch.Tensor)  # the flow never hands it NumPy
        self.matches += 1
        return super().match_prefix(input_ids, extra_key)


class OldFused(RadixCacheManager):
    """Overrides the fused calls and evict as written before the NumPy forms (tensors only)."""

    def match_and_lock(self, input_ids: torch.Tensor, extra_key: Any = None) -> Any:
        if not isinstance(input_ids, torch.Tensor):
            raise AssertionError("handed NumPy")
        return super().match_and_lock(input_ids, extra_key)

    def insert_and_unlock(self, handle, input_ids, indices, extra_key=None, *, relock=False):
        if not isinstance(input_ids, torch.Tensor) or not isinstance(indices, torch.Tensor):
            raise AssertionError("handed NumPy")
        return super().insert_and_unlock(handle, input_ids, indices, extra_key, relock=relock)

    def evict(self, size: int) -> torch.Tensor:  # type: ignore[override]
        return super().evict(size)


class Spy(RadixCacheManager):
    """Says it takes the NumPy forms, and records what the flow hands it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seen: set[Any] = set()

    @takes_host_arrays
    def match_and_lock(self, input_ids: Any, extra_key: Any = None) -> Any:
        self.seen.add(type(input_ids))
        return super().match_and_lock(input_ids, extra_key)

    @takes_host_arrays
    def insert_and_unlock(self, handle, input_ids, indices, extra_key=None, *, relock=False):
        self.seen |= {type(input_ids), type(indices)}
        return super().insert_and_unlock(handle, input_ids, indices, extra_key, relock=relock)

    @takes_host_arrays
    def evict(self, size: int, *, host: bool = False) -> Any:
        self.seen.add(host)
        return super().evict(size, host=host)


@pytest.mark.parametrize("make", [CountingMatch, OldFused, Spy, PlainCalls])
def test_the_flow_uses_numpy_forms_only_where_a_manager_says_so(make):
    """A subclass overriding match_prefix is still called (the fused calls are not used); one
    whose fused calls or evict predate the NumPy forms gets tensors; radix and the base
    defaults take NumPy. Every flow evicts and ends with the pool whole."""
    m = make(page_size=2)
    flow = RequestFlow(m, PageAllocator(8, 2))
    gen = torch.Generator().manual_seed(0)
    for i in range(30):
        ids = torch.randint(0, 3, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen)
        req = flow.begin(ids, compute_last=bool(i % 2))
        flow.mark_computed(req)
        if i % 3 == 0:
            flow.cache(req)
        flow.extend(req, torch.tensor([i % 3]))
        flow.mark_computed(req)
        flow.finish(req)
        flow.check_integrity()
    assert flow.stats.evictions > 0
    if make is CountingMatch:
        assert not fused_calls_safe(make) and m.matches == 30
    if make is Spy:
        assert m.seen == {np.ndarray, True}  # NumPy ids and slots in, evict(host=True)
    assert host_arrays_safe(make, "evict") == (make is not OldFused)
    assert flow.allocator.num_free_pages + m.size_info.total_size // 2 == 8
