"""The serving layer refuses bad input and misuse before it changes anything (issue 9, items 2, 5,
6, 7, 11, 12): each found case, then a property over its class of inputs. Every refusal compares
the observable state before and after: cache sizes and contents, the allocator's free list, each
running request, the flow's stats, the pool's buffer; and `check_integrity` after."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import pytest
import torch
from conftest import unchanged
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvcache.kernels.store as store_module
from kvcache import (
    ByteTokenizer,
    NaiveCacheManager,
    PageAllocator,
    RadixCacheManager,
    RequestFlow,
)
from kvcache.serving.engine import Engine
from kvcache.serving.model import TinyLlama, TinyLlamaConfig
from kvcache.serving.workloads import Job, TimedManager, replay

SETTINGS = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def t(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def p32(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int32)


def flow_state(flow: RequestFlow, pool: Any = None) -> Any:
    """Everything a caller can observe about a flow (and its pool)."""
    cached = flow.manager.cached_indices()
    return (
        flow.manager.size_info,
        sorted(cached.tolist()),
        flow.allocator.free_pages().tolist(),
        dataclasses.astuple(flow.stats),
        {
            rid: (r.input_ids.tolist(), r.indices.tolist(), r.num_computed, r.tree_len)
            for rid, r in flow.running.items()
        },
        None if pool is None else pool.buffer.clone(),
    )


def same(a: Any, b: Any) -> bool:
    *rest_a, buf_a = a
    *rest_b, buf_b = b
    return rest_a == rest_b and (buf_a is None or torch.equal(buf_a, buf_b))


def refused(
    flow: RequestFlow,
    call: Callable[[], Any],
    exc: type,
    match: str | None = None,
    pool: Any = None,
) -> None:
    """``call`` raises ``exc`` and leaves the flow (and pool) exactly as it was."""
    before = flow_state(flow, pool)
    with pytest.raises(exc, match=match):
        call()
    assert same(flow_state(flow, pool), before)
    flow.check_integrity()


def served(flow: RequestFlow, ids: torch.Tensor) -> None:
    r = flow.begin(ids)
    flow.mark_computed(r)
    flow.finish(r)


# ----------------------------------------------------------------------------- real integers
NOT_INTEGERS = [
    True,
    False,
    np.bool_(True),
    1.5,
    2.0,
    float("nan"),
    2 + 0j,
    "2",
    torch.tensor(2.0),
    torch.tensor(True),
    torch.tensor([2]),
    np.float64(2.0),
]
INTEGERS = [
    2,
    np.int64(2),
    np.int32(2),
    np.uint8(2),
    torch.tensor(2),
    torch.tensor(2, dtype=torch.int32),
]


def any_value() -> st.SearchStrategy:
    """Counts as a careless caller passes them: ints of every kind, and things that are not."""
    small = st.integers(-3, 12)
    return st.one_of(
        small,
        small.map(np.int64),
        small.map(lambda v: torch.tensor(v)),
        st.booleans(),
        st.floats(allow_nan=True),
        small.map(float),
        small.map(complex),
        small.map(lambda v: torch.tensor(float(v))),
    )


def is_real_int(v: Any) -> bool:
    if isinstance(v, (bool, np.bool_)):
        return False
    if isinstance(v, torch.Tensor):
        return (
            v.dim() == 0
            and not v.dtype.is_floating_point
            and not v.dtype.is_complex
            and v.dtype != torch.bool
        )
    return isinstance(v, (int, np.integer))


@pytest.mark.parametrize("bad", NOT_INTEGERS, ids=repr)
def test_mark_computed_refuses_non_integers(bad):
    """Found: ``mark_computed(r, 1.5)`` and ``(r, True)`` were accepted; the next call failed far away."""
    flow = RequestFlow(RadixCacheManager(), PageAllocator(8))
    r = flow.begin(t(1, 2, 3))
    refused(flow, lambda: flow.mark_computed(r, bad), TypeError, "num_tokens")


@pytest.mark.parametrize("good", INTEGERS, ids=repr)
def test_mark_computed_takes_integers_of_every_library(good):
    flow = RequestFlow(RadixCacheManager(), PageAllocator(8))
    r = flow.begin(t(1, 2, 3))
    flow.mark_computed(r, good)
    assert r.num_computed == 2 and type(r.num_computed) is int


@SETTINGS
@given(value=any_value())
def test_counts_are_real_integers_everywhere(value):
    """Every count of the flow and the allocator: accepted iff a real integer in range; a refusal
    changes nothing."""
    calls = [
        (lambda f, r: f.mark_computed(r, value), 0, 5),
        (lambda f, r: f.pages_needed(r, value), 0, 2**62),
        (lambda f, r: f.allocator.allocate(value), 0, 5),
        (lambda f, r: f.allocator.allocate_slots(value), 0, 10),
        (lambda f, r: f.allocator.pages_to_slots(p32(6, 7), value), 0, 4),
    ]
    for call, lo, hi in calls:
        flow = RequestFlow(RadixCacheManager(page_size=2), PageAllocator(8, 2))
        r = flow.begin(t(1, 2, 3, 4, 5))
        if is_real_int(value) and lo <= int(value) <= hi:
            call(flow, r)  # (allocate hands pages to the caller: no integrity check after it)
        elif is_real_int(value):  # out of range, or more pages than are free
            refused(flow, partial(call, flow, r), (ValueError, RuntimeError))
        else:  # the wrong kind of value: TypeError, whatever its magnitude
            refused(flow, partial(call, flow, r), TypeError)


def test_engine_and_tokenizer_refuse_truncated_tokens(torch_store):
    """Found: ``engine.decode(req, 2.7)`` appended 2; ``ByteTokenizer().decode([65.9])`` gave 'A'."""
    e = tiny_engine()
    req, _ = e.prefill(t(1, 2, 3))
    for bad in (2.7, 2.0, True, torch.tensor(2.0), 2 + 0j):
        refused(e.flow, partial(e.decode, req, bad), TypeError, "tokens", pool=e.kv_cache)
    tok = ByteTokenizer()
    for bad in (
        [65.9],
        [65.0],
        [True],
        torch.tensor([65.0]),
        torch.tensor([True]),
        "A",
        [np.float32(65)],
    ):
        with pytest.raises(TypeError):
            tok.decode(bad)
    assert tok.decode([65, np.int64(66), torch.tensor(67)]) == "ABC"
    with pytest.raises(ValueError, match="1-D"):
        tok.decode(torch.tensor(65))  # a 0-d tensor is not a list of ids


@SETTINGS
@given(
    values=st.lists(
        st.one_of(
            st.integers(-2, 300),
            st.floats(0, 255),
            st.booleans(),
            st.integers(0, 255).map(np.int16),
        ),
        max_size=6,
    )
)
def test_tokenizer_decode_property(values):
    ok = all(is_real_int(v) and 0 <= int(v) <= 255 for v in values)
    if ok:
        assert ByteTokenizer().decode(values) == ByteTokenizer().decode(
            torch.tensor([int(v) for v in values], dtype=torch.int64)
        )
    else:
        with pytest.raises((TypeError, ValueError)):
            ByteTokenizer().decode(values)


# ----------------------------------------------------------------------------- page ids and slots
def test_free_checks_the_range_before_any_cast():
    """Found: ids were cast to int32 before the range check, so ``2**32 + 1`` freed page 1."""
    a = PageAllocator(4)
    a.allocate(4)
    for bad in (t(2**32 + 1), t(2**31), t(-(2**32) + 1), t(-1)):
        before = a.free_pages().tolist()
        with pytest.raises(ValueError, match=r"outside \[0, 4\)"):
            a.free(bad)
        assert a.free_pages().tolist() == before == []
    for bad in (
        torch.tensor([True]),
        torch.tensor([1.0]),
        torch.tensor([1 + 0j]),
        t(1).view(1, 1),
        [1],
        np.array([1.0]),
        np.array([True]),
    ):
        with pytest.raises((TypeError, ValueError)):
            a.free(bad)
        assert a.num_free_pages == 0
    a.free(t(1))
    a.free(np.array([2], dtype=np.uint64))  # NumPy ids are taken too, range-checked the same way
    with pytest.raises(ValueError, match="outside"):
        a.free(np.array([2**32 + 3], dtype=np.uint64))
    assert a.free_pages().tolist() == [1, 2]


@pytest.mark.parametrize("dtype", [">i2", ">i4", ">i8", ">u4", "<i8"])
def test_page_ids_in_either_byte_order_are_read_as_their_values(dtype):
    """Found: a big-endian array was range-checked through a native view (other values), so
    ``[2**24, 2**25]`` as ``>i4`` passed as ``[1, 2]`` and then failed deep inside with an
    IndexError instead of naming the value. Every call that takes page ids or slots as NumPy
    reads the values as given: right ones are taken, wrong ones refused naming them."""
    small = [1, 2, 3]
    big = [300, 301] if np.dtype(dtype).itemsize == 2 else [2**24, 2**25]
    for call, scale in (("free", 1), ("free_slots", 4), ("free_page_runs", 4)):
        a = PageAllocator(8, 4)
        a.allocate(8)
        with unchanged(a), pytest.raises(ValueError, match="is outside"):
            getattr(a, call)(np.array([b * scale for b in big], dtype=dtype))
        ids = np.array([p * scale for p in small], dtype=dtype)
        getattr(a, call)(ids if call != "free_page_runs" else np.arange(4, 16, dtype=dtype))
        assert a.free_pages().tolist() == small


@SETTINGS
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["allocate", "free", "free_slots", "to_slots", "to_pages"]),
            st.lists(
                st.one_of(st.integers(-3, 12), st.sampled_from([2**32 + 1, 2**31, -(2**33)])),
                max_size=4,
            ),
            st.sampled_from(
                [
                    torch.int64,
                    torch.int32,
                    torch.int16,
                    torch.uint8,
                    torch.bool,
                    torch.float32,
                    torch.complex64,
                ]
            ),
        ),
        max_size=25,
    )
)
def test_allocator_against_a_reference_free_list(ops):
    """Any mix of valid and invalid ids: the allocator matches a FIFO reference list; a refused
    call changes nothing; page ids are compared on their values, never on a cast."""
    ps, num_pages = 2, 6
    a = PageAllocator(num_pages, ps)
    ref = list(range(num_pages))  # the free list, in hand-out order
    for op, values, dtype in ops:
        if op == "allocate":
            n = len(values)
            if n <= len(ref):
                assert a.allocate(n).tolist() == ref[:n]
                ref = ref[n:]
            else:
                with pytest.raises(RuntimeError):
                    a.allocate(n)
            continue
        try:
            ids = torch.tensor(values, dtype=torch.int64).to(dtype)
        except RuntimeError:  # a value torch cannot hold in that dtype
            continue
        raw = [int(v) for v in values]  # what the caller meant, before torch's cast
        exact = (
            ids.tolist() if dtype in (torch.int64, torch.int32, torch.int16, torch.uint8) else None
        )
        limit = num_pages if op in ("free", "to_slots") else num_pages * ps
        ok = exact is not None and all(0 <= v < limit for v in exact)
        if ok and op == "free_slots":  # slots name their pages: a run on one page names it once
            pages = [
                v // ps for k, v in enumerate(exact) if k == 0 or exact[k - 1] // ps != v // ps
            ]
        else:
            pages = exact
        if ok and op in ("free", "free_slots"):
            held = set(range(num_pages)) - set(ref)
            ok = len(set(pages)) == len(pages) and set(pages) <= held
        call = {
            "free": partial(a.free, ids),
            "free_slots": partial(a.free_slots, ids),
            "to_slots": partial(a.pages_to_slots, ids),
            "to_pages": partial(a.slots_to_pages, ids),
        }[op]
        before = a.free_pages().tolist()
        if ok:
            out = call()
            if op in ("free", "free_slots"):
                ref += pages
            elif op == "to_slots":
                assert out.tolist() == [p * ps + o for p in exact for o in range(ps)]
            else:
                assert out.tolist() == [
                    v // ps for k, v in enumerate(exact) if k == 0 or exact[k - 1] // ps != v // ps
                ]
        else:
            with pytest.raises((TypeError, ValueError, RuntimeError)):
                call()
            assert a.free_pages().tolist() == before
        if exact is not None and raw != exact:
            assert not ok or all(0 <= v < limit for v in exact)  # torch's own cast, not ours
        assert a.free_pages().tolist() == ref


# ----------------------------------------------------------------------------- constructors
def test_constructors_refuse_wrong_types():
    """Found: ``RequestFlow(None, alloc)`` and ``Engine(..., manager=None)`` failed later with
    AttributeError; ``PageAllocator(device="cuda")`` failed only at ``allocate``."""
    alloc = PageAllocator(8)
    with pytest.raises(TypeError, match="manager must be a BaseCacheManager, got NoneType"):
        RequestFlow(None, alloc)
    with pytest.raises(TypeError, match="allocator must be a PageAllocator, got int"):
        RequestFlow(RadixCacheManager(), 8)
    with pytest.raises(TypeError, match="on_event must be callable"):
        RequestFlow(RadixCacheManager(), alloc, on_event="print")
    with pytest.raises(ValueError, match="page_size"):
        RequestFlow(RadixCacheManager(page_size=4), PageAllocator(8, page_size=2))
    with pytest.raises(TypeError, match="manager must be a BaseCacheManager"):
        TimedManager(None)
    model = TinyLlama(TinyLlamaConfig(num_layers=1))
    pool = model.new_kv_cache(8)
    with pytest.raises(TypeError, match="manager must be a BaseCacheManager, got NoneType"):
        Engine(model, pool, manager=None, allocator=alloc)
    with pytest.raises(TypeError, match="allocator must be a PageAllocator"):
        Engine(model, pool, RadixCacheManager(), None)
    with pytest.raises(TypeError, match="model must be a TinyLlama"):
        Engine(None, pool, RadixCacheManager(), alloc)
    with pytest.raises(TypeError, match="kv_cache must be an MHAKVCache"):
        Engine(model, None, RadixCacheManager(), alloc)
    with pytest.raises(TypeError, match="decode_kernel must be a bool"):
        Engine(model, pool, RadixCacheManager(), alloc, decode_kernel="yes")
    for kwargs, exc, match in [
        ({"num_pages": 4, "device": 0}, TypeError, "device must be a torch.device or str"),
        ({"num_pages": 4, "device": "nonsense"}, ValueError, "device 'nonsense'"),
        ({"num_pages": 2**31}, ValueError, "do not fit in int32"),
        ({"num_pages": 2**20, "page_size": 2**12}, ValueError, "do not fit in int32"),
        ({"num_pages": True}, TypeError, "num_pages"),
        ({"num_pages": 4.0}, TypeError, "num_pages"),
        ({"num_pages": 4, "page_size": np.int64(0)}, ValueError, "page_size must be >= 1"),
    ]:
        with pytest.raises(exc, match=match):
            PageAllocator(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_allocator_on_a_missing_device_fails_in_the_constructor():
    with pytest.raises(ValueError, match="'cuda' is not available"):
        PageAllocator(4, device="cuda")


# ----------------------------------------------------------------------------- replay
def test_replay_aborts_the_request_when_the_pool_runs_out():
    """Found: the request stayed in ``flow.running`` holding its pages."""
    flow = RequestFlow(RadixCacheManager(), PageAllocator(8))
    jobs = [
        Job(t(1, 2, 3), t(4, 5)),
        Job(t(7, 8, 9), t(*range(10, 20))),
    ]  # the second outgrows the pool
    with pytest.raises(RuntimeError, match="out of KV pages"):
        replay(flow, jobs)
    assert not flow.running
    assert flow.allocator.num_free_pages + flow.manager.size_info.total_size == 8
    flow.check_integrity()


@SETTINGS
@given(
    jobs=st.lists(
        st.tuples(
            st.lists(st.integers(0, 3), min_size=1, max_size=10),
            st.lists(st.integers(0, 3), max_size=10),
        ),
        min_size=1,
        max_size=6,
    ),
    num_pages=st.integers(1, 8),
    page_size=st.sampled_from([1, 2, 4]),
    token_by_token=st.booleans(),
)
def test_replay_never_leaks_a_request(jobs, num_pages, page_size, token_by_token):
    flow = RequestFlow(RadixCacheManager(page_size=page_size), PageAllocator(num_pages, page_size))
    try:
        replay(flow, [Job(t(*p), t(*o)) for p, o in jobs], token_by_token=token_by_token)
    except RuntimeError as e:
        assert "out of KV pages" in str(e)
    assert not flow.running
    flow.check_integrity()
    assert (
        flow.allocator.num_free_pages * page_size + flow.manager.size_info.total_size
        == num_pages * page_size
    )


# ----------------------------------------------------------------------------- Engine: all or nothing
@pytest.fixture
def torch_store(monkeypatch):
    monkeypatch.setattr(store_module, "TRITON_INTERPRET", False)


MODEL = TinyLlama(
    TinyLlamaConfig(
        num_layers=1,
        hidden_size=32,
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=16,
        intermediate_size=32,
    )
)


def tiny_engine(num_pages: int = 16, page_size: int = 1, manager: Any = None) -> Engine:
    return Engine(
        MODEL,
        MODEL.new_kv_cache(num_pages, page_size),
        manager or RadixCacheManager(page_size=page_size),
        PageAllocator(num_pages, page_size),
    )


def test_prefill_batch_refused_evicts_nothing(torch_store):
    """Found: the first prompt evicted the cache, then the second was refused: the cached prefix
    was lost for nothing."""
    e = tiny_engine(16)
    e.finish(e.prefill(t(*range(10)))[0])  # 10 cached, evictable
    fits, too_big = t(50, 51, 52, 53, 54, 55, 56, 57), t(*range(60, 75))
    refused(
        e.flow,
        lambda: e.prefill_batch([fits, too_big]),
        RuntimeError,
        "out of KV pages",
        pool=e.kv_cache,
    )
    assert e.flow.manager.size_info.total_size == 10


def test_prefill_refusals_change_nothing(torch_store):
    """Found: ``prefill`` with a bad token raised after ``stats`` and the free list moved;
    ``prefill_batch([])`` failed inside ``torch.cat``."""
    e = tiny_engine(16)
    e.finish(e.prefill(t(1, 2, 3))[0])
    cases = [
        (lambda: e.prefill(t(1, 2, 256)), ValueError, "vocab_size"),
        (lambda: e.prefill(t(-1)), ValueError, "vocab_size"),
        (lambda: e.prefill(t()), ValueError, "at least one token"),
        (lambda: e.prefill(torch.tensor([1.0, 2.0])), TypeError, "integer dtype"),
        (lambda: e.prefill_batch([]), ValueError, "empty batch"),
        (lambda: e.prefill_batch(t(1, 2)), TypeError, "sequence"),
        (lambda: e.prefill_batch([t(1, 2), t(3, 999)]), ValueError, r"prompts\[1\]"),
    ]
    for call, exc, match in cases:
        refused(e.flow, call, exc, match, pool=e.kv_cache)


def test_decode_refusals_change_nothing(torch_store):
    e = tiny_engine(8)
    r, _ = e.prefill(t(1, 2, 3, 4))
    other = tiny_engine(8).prefill(t(1))[0]
    cases = [
        (lambda: e.decode(r, 256), ValueError, "vocab_size"),
        (lambda: e.decode_batch([r], [1, 2]), ValueError, "one token per request"),
        (lambda: e.decode_batch([], []), ValueError, "at least one request"),
        (lambda: e.decode_batch([r, r], [1, 2]), RuntimeError, "each listed once"),
        (lambda: e.decode(other, 1), RuntimeError, "not running"),
        (lambda: e.decode_batch([r, other], [1, 2]), RuntimeError, "not running"),
    ]
    for call, exc, match in cases:
        refused(e.flow, call, exc, match, pool=e.kv_cache)
    for _ in range(4):
        e.decode(r, 5)
    refused(e.flow, lambda: e.decode(r, 5), RuntimeError, "out of KV pages", pool=e.kv_cache)
    with pytest.raises(TypeError, match="max_new_tokens"):
        e.generate(t(1), 2.0)


@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    cached=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=8), max_size=3),
    batch=st.lists(
        st.one_of(
            st.lists(st.integers(0, 3), min_size=1, max_size=12),
            st.lists(st.integers(250, 260), min_size=1, max_size=3),
            st.just([]),
        ),
        max_size=3,
    ),
    page_size=st.sampled_from([1, 4]),
)
def test_prefill_batch_is_all_or_nothing(torch_store, cached, batch, page_size):
    """Any batch over any cache: either every prompt starts, or the call raises and nothing changed."""
    e = tiny_engine(16 // page_size, page_size)
    for p in cached:
        if -(-len(p) // page_size) <= e.flow.available_pages():
            e.finish(e.prefill(t(*p))[0])
    before = flow_state(e.flow, e.kv_cache)
    try:
        reqs, logits = e.prefill_batch([t(*p) for p in batch])
    except (ValueError, TypeError, RuntimeError):
        assert same(flow_state(e.flow, e.kv_cache), before)
        e.flow.check_integrity()
        return
    assert [r.input_ids.tolist() for r in reqs] == batch and logits.shape == (len(batch), 256)
    e.flow.check_integrity()
    for r in reqs:
        e.finish(r)
    e.flow.check_integrity()


@SETTINGS
@given(
    lens=st.lists(st.integers(1, 9), min_size=1, max_size=3),
    grow=st.lists(st.integers(0, 9), min_size=3, max_size=3),
    page_size=st.sampled_from([1, 2, 4]),
    num_pages=st.integers(3, 10),
)
def test_extend_batch_is_all_or_nothing_and_pages_needed_is_extends_rule(
    lens, grow, page_size, num_pages
):
    flow = RequestFlow(RadixCacheManager(page_size=page_size), PageAllocator(num_pages, page_size))
    served(flow, t(*range(2 * page_size)))  # something evictable
    reqs = []
    for n in lens:
        try:
            reqs.append(flow.begin(t(*range(100, 100 + n))))
        except RuntimeError:
            break
    if not reqs:
        return
    new = [t(*range(k)) for k in grow[: len(reqs)]]
    need = sum(flow.pages_needed(r, len(x)) for r, x in zip(reqs, new, strict=True))
    if need > flow.available_pages():
        refused(flow, lambda: flow.extend_batch(reqs, new), RuntimeError, "out of KV pages")
        return
    free_before = flow.allocator.num_free_pages + flow.manager.size_info.evictable_size // page_size
    lengths = [len(r) for r in reqs]
    out = flow.extend_batch(reqs, new)
    assert free_before - flow.available_pages() == need
    for r, x, slots, n in zip(reqs, new, out, lengths, strict=True):
        assert len(r) == n + len(x) and torch.equal(r.indices[n:], slots)
    flow.check_integrity()


def test_naive_manager_flow_still_frees_everything():
    flow = RequestFlow(NaiveCacheManager(), PageAllocator(4))
    served(flow, t(1, 2, 3))
    assert flow.allocator.num_free_pages == 4
    flow.check_integrity()


@pytest.mark.parametrize("n", [2, 64, 65, 200])
def test_free_refuses_a_page_listed_twice_at_any_length(n):
    """Short and long lists take different duplicate checks; both refuse, changing nothing."""
    a = PageAllocator(256)
    pages = a.allocate(n)
    before = a.free_pages().tolist()
    twice = np.concatenate([pages.numpy()[:-1], pages.numpy()[:1]])
    with pytest.raises(ValueError, match="more than once"):
        a.free(twice)
    assert a.free_pages().tolist() == before
    a.free(pages)
    assert a.num_free_pages == 256
