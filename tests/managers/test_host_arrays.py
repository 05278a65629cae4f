"""The fused calls (`match_and_lock`, `insert_and_unlock`) take and give tensors, as the public
calls do: radix's own and the base class's defaults refuse what the public calls refuse (a NumPy
array included) and change nothing then; the defaults decide as radix's own calls do; and the flow
hands every manager tensors. `drive_forms` also drives a manager's NumPy forms against its tensor
forms: `tests/managers/test_block_host.py` uses it for the block-hash manager, which still has them."""

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


class PlainCalls(RadixCacheManager):
    """Radix driven through the base class's fused calls (the separate public calls)."""

    match_and_lock = BaseCacheManager.match_and_lock
    insert_and_unlock = BaseCacheManager.insert_and_unlock


class BlockPlain(BlockHashCacheManager):
    """Block hash driven through the base class's fused calls."""

    match_and_lock = BaseCacheManager.match_and_lock
    insert_and_unlock = BaseCacheManager.insert_and_unlock


#: Radix's own fused calls.
MAKERS: dict[str, Callable[[], BaseCacheManager]] = {
    "radix1": RadixCacheManager,
    "radix4": lambda: RadixCacheManager(page_size=4),
    "radix4-fifo": lambda: RadixCacheManager(page_size=4, eviction_policy="fifo"),
}
#: The base class's fused calls, beside the manager class whose own they replace.
DEFAULTS: dict[str, tuple[Callable[[], BaseCacheManager], Callable[[], BaseCacheManager]]] = {
    "plain2": (lambda: PlainCalls(page_size=2), lambda: RadixCacheManager(page_size=2)),
    "blockhash2": (lambda: BlockPlain(page_size=2), lambda: BlockHashCacheManager(page_size=2)),
}
TENSOR_MAKERS = {**MAKERS, **{name: pair[0] for name, pair in DEFAULTS.items()}}


def state(m: BaseCacheManager) -> Any:
    """`observe` less the class name (the two managers compared are of one class anyway)."""
    out = observe(m)
    return out[:1] + out[2:]


OPS = st.lists(
    st.tuples(
        st.sampled_from(["match", "insert", "relock", "evict"]),
        st.lists(st.integers(0, 3), min_size=0, max_size=12),  # few tokens: prefixes are shared
        st.integers(0, 9),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=40, deadline=None)
@given(ops=OPS)
def test_default_fused_calls_decide_as_radix_own(ops: list) -> None:
    """The base class's fused calls (the public calls in turn) and radix's own, both with
    tensors: every answer equal and the whole state equal after every step. (Block hash's own
    against the defaults: `tests/managers/test_block_host.py`, which compares what is decided, not the
    LRU clock the defaults' lock check advances.)"""
    name = "plain2"
    plain, own = DEFAULTS[name]
    drive_forms(own(), plain(), ops, np.int64, state, same_length, host=False)


def as_host(x: Any) -> np.ndarray:
    return x if isinstance(x, np.ndarray) else x.cpu().numpy()


def same_length(a: Any, b: Any) -> bool:
    return a.cached_len == b.cached_len


def drive_forms(
    tm: BaseCacheManager,
    hm: BaseCacheManager,
    ops: list,
    id_dtype: type,
    state: Callable[[BaseCacheManager], Any],
    same_handles: Callable[[Any, Any], bool],
    host: bool = True,
) -> None:
    """Run ``ops`` (from ``OPS``) on ``tm`` with tensors and on ``hm`` with NumPy arrays of ids
    in ``id_dtype`` (``host=False``: tensors too, of that dtype); after every step the answers
    agree, ``same_handles`` holds for the handles, ``state`` is equal and both managers pass
    ``check_integrity``."""
    ps = tm.page_size
    form: Callable[..., Any] = np.array if host else (lambda v, dtype: torch.tensor(v, dtype=dtype))
    held: list[tuple[Any, Any, list[int]]] = []  # (tensor handle, NumPy handle, tokens)
    fresh = 0  # next free page: every insert brings new pages past it

    for kind, toks, k in ops:
        if kind == "match" or (not held and kind in ("insert", "relock")):
            th, tidx = tm.match_and_lock(torch.tensor(toks, dtype=torch.int64))
            hh, hidx = hm.match_and_lock(form(toks, dtype=id_dtype if host else torch.int64))
            assert isinstance(tidx, torch.Tensor)
            assert isinstance(hidx, np.ndarray if host else torch.Tensor)
            assert hidx.dtype == (np.int32 if host else torch.int32)
            assert hidx.tolist() == tidx.tolist()
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
                hh,
                form(seq, dtype=id_dtype if host else torch.int64),
                form(slots, dtype=np.int32 if host else torch.int32),
                relock=relock,
            )
            assert tres.cached_len == hres.cached_len
            assert same_handles(tres.handle, hres.handle)
            if relock:
                held.append((tres.handle, hres.handle, seq))
        else:  # evict what is evictable, up to k pages
            size = min(k * ps, tm.size_info.evictable_size)
            tout = tm.evict(size)
            hout = hm.evict(size, host=True) if host else hm.evict(size)
            assert isinstance(tout, torch.Tensor)
            assert not host or (isinstance(hout, np.ndarray) and hout.dtype == np.int32)
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
    m = TENSOR_MAKERS[name]()
    ps = m.page_size
    m.insert_prefix(torch.arange(2 * ps), torch.arange(2 * ps, dtype=torch.int32))
    handle, _ = m.match_and_lock(torch.arange(ps))
    return m, handle


BAD_TENSOR_IDS = [
    (torch.tensor([1.0, 2.0]), TypeError, "input_ids must have an integer dtype"),
    (torch.tensor([True, False]), TypeError, "input_ids must have an integer dtype"),
    (torch.tensor([[1, 2]]), ValueError, r"input_ids must be 1-D, got shape \(1, 2\)"),
    (np.array([1, 2]), TypeError, r"input_ids must be a torch\.Tensor, got ndarray"),
]


@pytest.mark.parametrize("name", list(TENSOR_MAKERS))
@pytest.mark.parametrize(("bad", "exc", "match"), BAD_TENSOR_IDS)
def test_fused_calls_refuse_bad_ids_changing_nothing(name, bad, exc, match):
    """Radix's own fused calls and the base class's take tensors only (a NumPy array is refused
    as `match_prefix` refuses it) and refuse what the public calls refuse, nothing locked."""
    m, handle = populated(name)
    ps = m.page_size
    with watch(m), pytest.raises(exc, match=match):
        m.match_and_lock(bad)
    slots = torch.arange(8 * ps, 8 * ps + len(bad.reshape(-1)), dtype=torch.int32)
    # The default's lock check (unlock, lock again) re-stamps a block's LRU clock before
    # insert_prefix refuses: for block hash only the sizes stay as they were.
    with watch(m if name != "blockhash2" else lambda: m.size_info), pytest.raises(exc, match=match):
        m.insert_and_unlock(handle, bad, slots)
    m.lock_handle(handle, unlock=True)  # still locked after the refusals: one unlock works
    assert m.size_info.protected_size == 0


@pytest.mark.parametrize("name", list(TENSOR_MAKERS))
def test_fused_calls_refuse_bad_slots_changing_nothing(name):
    m, handle = populated(name)
    ps = m.page_size
    ids = torch.arange(4 * ps)  # two pages cached, two new
    new = torch.arange(8 * ps, 10 * ps)
    good = torch.cat([torch.arange(2 * ps), new]).to(torch.int32)
    for bad, exc, match in [
        (good.long(), TypeError, "indices"),
        (good.float(), TypeError, "indices"),
        (good[None, :], ValueError, "indices must be 1-D"),
        (good[:-1], ValueError, r"len\(indices\)"),
        (torch.where(good == 8 * ps, -8, good).to(torch.int32), ValueError, "-8"),
        (torch.where(good == 9 * ps, 1, good).to(torch.int32), ValueError, r"\b1\b"),  # held
        (good.numpy(), TypeError, r"indices must be a torch\.Tensor, got ndarray"),
    ]:
        late = name == "blockhash2"  # the lock check re-stamps the LRU clock: sizes only
        with watch(m if not late else lambda: m.size_info), pytest.raises(exc, match=match):
            m.insert_and_unlock(handle, ids, bad)
    res = m.insert_and_unlock(handle, ids, good)  # the handle stayed locked: it goes through
    assert res.cached_len == 2 * ps and m.size_info.protected_size == 0


@pytest.mark.parametrize("make", [RadixCacheManager, lambda: BlockHashCacheManager(page_size=1)])
def test_evict_takes_no_host_keyword(make: Callable[[], BaseCacheManager]) -> None:
    """One form of every call: evict returns a tensor, and has no NumPy form."""
    m = make()
    m.insert_prefix(torch.arange(3), torch.tensor([5, 6, 7], dtype=torch.int32))
    with watch(m), pytest.raises(TypeError, match="host"):
        m.evict(1, host=True)  # type: ignore[call-arg]
    assert sorted(m.evict(3).tolist()) == [5, 6, 7]


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
    """Overrides match_prefix (to count), so it takes the base class's fused calls back, as
    `BaseCacheManager` asks of a subclass that overrides a part: radix's own would bypass it."""

    match_and_lock = BaseCacheManager.match_and_lock
    insert_and_unlock = BaseCacheManager.insert_and_unlock

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
    """Records what the flow hands its fused calls and evict."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seen: set[Any] = set()

    def match_and_lock(self, input_ids: Any, extra_key: Any = None) -> Any:
        self.seen.add(type(input_ids))
        return super().match_and_lock(input_ids, extra_key)

    def insert_and_unlock(self, handle, input_ids, indices, extra_key=None, *, relock=False):
        self.seen |= {type(input_ids), type(indices)}
        return super().insert_and_unlock(handle, input_ids, indices, extra_key, relock=relock)

    def evict(self, size: int, **kwargs: Any) -> Any:
        self.seen.add(tuple(kwargs))
        return super().evict(size, **kwargs)


@pytest.mark.parametrize("make", [CountingMatch, OldFused, Spy, PlainCalls])
def test_the_flow_hands_every_manager_tensors(make):
    """The flow always makes the fused calls, with tensors (a tensor in, a tensor out), and
    evict without ``host``: a subclass overriding match_prefix that takes the default fused calls
    back is called for every match, fused calls written for tensors only get tensors. Every
    flow evicts and ends with the pool whole."""
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
        assert m.matches == 30
    if make is Spy:
        assert m.seen == {torch.Tensor, ()}  # tensor ids and slots in, evict(size) alone
    assert flow.allocator.num_free_pages + m.size_info.total_size // 2 == 8
