"""The engine under fault injection (issue 27, item 6): a call that fails leaves nothing half
done.

Found: when the model or the pool's ``store_kv`` raised inside `Engine.decode`, the token stayed
appended without K/V; the retry appended another and was refused, and ``finish`` was refused.

Every dependency an `Engine` call uses is wrapped (`faults.Faults`): the flow's public methods,
the model's ``forward``, the pool's ``store_kv`` (and, in the test marked for the flow's
promise, every call of the manager and the allocator). A scenario (a batch prefill sharing a
prefix, batch decodes, finishes, ``generate``, a prefill reusing the cache) runs once to count
the calls, then once for every call number N, that call raising ``RuntimeError`` or
``KeyboardInterrupt``. When a call fails: the error is the injected one; each request of the
call is either exactly as before and still running (the flow refused before taking anything) or
no longer running with its computed whole pages cached; every other request is as before; the
flow's integrity and slot accounting hold; and the engine still works: a ``generate``
afterwards equals the cache-free greedy output.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import greedy, ids
from faults import Faults, public_methods

from kvcache import (
    BlockHashCacheManager,
    Engine,
    PageAllocator,
    RadixCacheManager,
    Request,
    TinyLlama,
    TinyLlamaConfig,
)

CONFIG = TinyLlamaConfig(
    vocab_size=40,
    num_layers=2,
    hidden_size=16,
    num_q_heads=2,
    num_kv_heads=1,
    head_dim=8,
    intermediate_size=16,
    seed=2,
)
EXCEPTIONS = [RuntimeError, KeyboardInterrupt]


@pytest.fixture(scope="module")
def model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield TinyLlama(CONFIG)
    torch.set_num_threads(threads)


def make_engine(model: TinyLlama, kind: str, ps: int, faults: Faults, inner: bool) -> Engine:
    num_pages = 48 // ps if ps == 1 else 6
    manager: Any = (
        RadixCacheManager(page_size=ps) if kind == "radix" else BlockHashCacheManager(page_size=ps)
    )
    alloc = PageAllocator(num_pages, ps)
    if inner:
        # what the flow calls while serving (not check_parts, asked once when it is built)
        faults.patch(manager, "manager", [n for n in public_methods(manager) if n != "check_parts"])
        faults.patch(alloc, "allocator")
    pool = faults.patch(model.new_kv_cache(num_pages, ps), "pool", ["store_kv"])
    engine = Engine(model, pool, manager, alloc)
    faults.patch(engine.flow, "flow")
    return engine


def state(req: Request) -> tuple[list[int], int, int]:
    return req.input_ids.tolist(), req.num_computed, req.tree_len


def prompts(ps: int) -> list[torch.Tensor]:
    system = [(3 * i + 1) % CONFIG.vocab_size for i in range(ps + 3 if ps > 1 else 5)]
    return [ids(*system, 7, 8), ids(*system, 9), ids(11, 12, 13), ids(*system, 7, 8, 14)]


def scenario(engine: Engine, faults: Faults, want: dict[int, list[int]], ps: int) -> None:
    """The calls, each checked as it goes; a call that raises is checked by `failed_call`."""
    p = prompts(ps)

    def call(fn: Callable[[], Any], mine: list[Request]) -> Any:
        before = {r.rid: state(r) for r in engine.flow.running.values()}
        try:
            return fn()
        except (RuntimeError, KeyboardInterrupt) as e:
            with faults.paused():
                failed_call(engine, faults, e, before, mine)
            raise

    reqs, logits = call(lambda: engine.prefill_batch(p[:2]), [])
    tokens = [int(x) for x in logits.argmax(-1)]
    outs = [[t] for t in tokens]
    for _ in range(3):
        logits = call(lambda t=tokens: engine.decode_batch(reqs, t), reqs)
        tokens = [int(x) for x in logits.argmax(-1)]
        for o, t in zip(outs, tokens, strict=True):
            o.append(t)
    assert outs == [want[0][:4], want[1][:4]]
    for r in reqs:
        call(lambda r=r: engine.finish(r), [r])
    assert call(lambda: engine.generate(p[2], 4), []).tolist() == want[2]
    r, logits = call(lambda: engine.prefill(p[3]), [])
    assert r.reused_len > 0
    call(lambda: engine.decode(r, int(logits.argmax())), [r])
    call(lambda: engine.finish(r), [r])


def failed_call(
    engine: Engine,
    faults: Faults,
    error: BaseException,
    before: dict[int, tuple[list[int], int, int]],
    mine: list[Request],
) -> None:
    assert faults.is_mine(error), repr(error)
    flow, ps = engine.flow, engine.flow.page_size
    flow.check_integrity()
    held = sum(-(-(len(r) - r.tree_len) // ps) for r in flow.running.values())
    cached = flow.manager.size_info.total_size // ps
    assert flow.allocator.num_free_pages + cached + held == flow.allocator.num_pages
    own = {r.rid for r in mine}
    for rid, was in before.items():
        if rid not in own:
            assert state(flow.running[rid]) == was  # another request: untouched
    for r in mine:
        if flow.is_running(r):
            assert state(r) == before[r.rid]  # refused before the flow took anything
        else:  # ended: what it computed stays cached
            ids_, computed, _ = before[r.rid]
            whole = computed // ps * ps
            got = flow.manager.match_prefix(torch.tensor(ids_[:whole]))[0].cached_len
            assert got == whole
    assert set(flow.running) <= set(before)  # a failed call starts nothing


def run(model: TinyLlama, kind: str, ps: int, faults: Faults, inner: bool) -> Engine:
    p = prompts(ps)
    want = {i: greedy(model, p[i], 4) for i in range(3)}
    engine = make_engine(model, kind, ps, faults, inner)
    try:
        scenario(engine, faults, want, ps)
    except (RuntimeError, KeyboardInterrupt) as e:
        assert faults.is_mine(e), repr(e)
    with faults.paused():
        for r in list(engine.flow.running.values()):
            engine.flow.abort(r)
        assert engine.generate(p[0], 4).tolist() == want[0]  # the engine still works
        engine.flow.check_integrity()
    return engine


def every_fault(model: TinyLlama, kind: str, ps: int, exc: type, inner: bool) -> None:
    counted = Faults()
    model.forward = counted.wrap(type(model).forward.__get__(model), "model.forward")
    try:
        run(model, kind, ps, counted, inner)
        assert counted.raised is None and counted.calls > 20
        for n in range(1, counted.calls + 1):
            faults = Faults(n, exc)
            model.forward = faults.wrap(type(model).forward.__get__(model), "model.forward")
            run(model, kind, ps, faults, inner)
            assert faults.raised is not None, n
    finally:
        del model.forward


CONFIGS = [("radix", 1), ("radix", 16), ("block_hash", 1), ("block_hash", 16)]


@pytest.mark.parametrize("kind,ps", CONFIGS)
@pytest.mark.parametrize("exc", EXCEPTIONS, ids=lambda e: e.__name__)
def test_every_call_of_the_engine_may_fail(torch_store, model, kind, ps, exc):
    every_fault(model, kind, ps, exc, inner=False)


@pytest.mark.parametrize("kind,ps", CONFIGS)
@pytest.mark.parametrize("exc", EXCEPTIONS, ids=lambda e: e.__name__)
def test_every_call_inside_the_flow_may_fail(torch_store, model, kind, ps, exc):
    every_fault(model, kind, ps, exc, inner=True)


def test_a_failed_decode_ends_its_request_and_the_retry_says_so(torch_store, model):
    """The found case, by hand: the model fails in a decode."""
    engine = make_engine(model, "radix", 1, Faults(), inner=False)
    req, logits = engine.prefill(ids(1, 2, 3, 4, 5))
    engine.decode(req, int(logits.argmax()))
    calls = {"n": 0}
    store = engine.kv_cache.store_kv

    def failing(*args: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 2:  # the second layer: the first has stored its K/V
            raise RuntimeError("store failed")
        store(*args)

    engine.kv_cache.store_kv = failing
    with pytest.raises(RuntimeError, match="store failed"):
        engine.decode(req, 7)
    del engine.kv_cache.store_kv
    assert not engine.flow.is_running(req)
    with pytest.raises(RuntimeError, match="not running"):
        engine.decode(req, 7)
    with pytest.raises(RuntimeError, match="not running"):
        engine.finish(req)
    engine.flow.check_integrity()
    assert engine.flow.allocator.num_free_pages + engine.flow.manager.size_info.total_size == 48
    again, _ = engine.prefill(ids(1, 2, 3, 4, 5, int(logits.argmax()), 7))
    assert again.reused_len == 6  # the tokens it had computed were kept in the cache
    engine.finish(again)
