"""The scheduler under fault injection (issue 27, items 4, 5, 7): whatever fails inside a step,
the next step works and every request ends.

Every dependency a step uses is wrapped (`faults.Faults`): the flow's public methods, the
manager's (and the block-hash manager's ``hash_fn``), the allocator's, the runner, the pool's
``store_kv`` and, with the tiny model, its ``forward``. A scenario (shared prefixes, chunked
prefill, preemption, LPM matching, an abort) is run once to count the calls, then once for every
call number N, that call raising ``RuntimeError`` or ``KeyboardInterrupt``. After every step,
failed or not: the flow's and the scheduler's integrity, slot accounting (free + cached + held
= the pool), every running request's K/V read back equal to what its own tokens stored, no
output past ``max_new_tokens`` and every output as forced. At the end every request has ended
(one fault never fails a request: a blamed request runs again alone, and succeeds), and with the
tiny model every output equals the greedy output of a cache-free recomputation.

Then what one fault cannot show: a request that fails every time (a poisoned prompt, a hash that
always raises, a ``finish`` that always raises) ends ``"failed"`` (or, its output complete,
finished uncached) while the others finish; a token the runner's vocabulary cannot hold is
refused at ``submit``; a failed step requeues its batch in first-come-first-served order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from conftest import greedy, ids
from faults import Faults, public_methods

from kvcache import (
    BlockHashCacheManager,
    Engine,
    KVCacheLayout,
    MHAKVCache,
    PageAllocator,
    RadixCacheManager,
    Request,
    RequestFlow,
    Scheduler,
    TinyLlama,
    TinyLlamaConfig,
    model_runner,
)

MOD = 1 << 20
EXCEPTIONS = [RuntimeError, KeyboardInterrupt]


def prefix_codes(tokens: torch.Tensor) -> torch.Tensor:
    """Code of every prefix ``tokens[:i + 1]`` (a rolling hash, exact in float32)."""
    out, h = [], 0
    for t in tokens.tolist():
        h = (h * 131 + t + 1) % MOD
        out.append(float(h))
    return torch.tensor(out, dtype=torch.float32)


class HashRunner:
    """Stores ``K = code of the prefix``, ``V = token`` at each run token's slot (no model)."""

    def __init__(self, pool: MHAKVCache) -> None:
        self.pool = pool

    def __call__(self, items: Sequence[tuple[Request, int]]) -> None:
        for req, q in items:
            lo, hi = req.num_computed, req.num_computed + q
            k = prefix_codes(req.input_ids[:hi])[lo:hi].view(-1, 1, 1)
            v = req.input_ids[lo:hi].float().view(-1, 1, 1)
            self.pool.store_kv(k, v, req.indices[lo:hi], 0)


def make_manager(kind: str, ps: int, faults: Faults, inner: bool) -> Any:
    """A manager whose ``match_prefix`` (which LPM calls) fails on cue, and with ``inner`` every
    public method and the block hash (what the flow calls inside its own calls)."""
    if kind == "radix":
        m = RadixCacheManager(page_size=ps)
    else:
        plain = BlockHashCacheManager(page_size=ps).hash_fn
        hash_fn = faults.wrap(plain, "hash_fn") if inner else plain
        m = BlockHashCacheManager(page_size=ps, hash_fn=hash_fn)
    # Every public method the flow calls while serving (not check_parts, asked once at build).
    calls = [n for n in public_methods(m) if n != "check_parts"] if inner else ["match_prefix"]
    return faults.patch(m, "manager", calls)


def make_allocator(num_pages: int, ps: int, faults: Faults, inner: bool) -> PageAllocator:
    alloc = PageAllocator(num_pages, ps)
    return faults.patch(alloc, "allocator") if inner else alloc


def scenario(ps: int, vocab: int = 50) -> tuple[list[tuple[torch.Tensor, int]], dict[str, int]]:
    """Five requests, three behind one shared system prompt (about two pages of ``ps``), and
    the pool and budget that make them chunk, share, evict, preempt and recompute."""
    system = [(7 * i + 3) % vocab for i in range(2 * ps - 2 if ps > 1 else 6)]
    tails = [[1, 2], [3], [4, 5, 6], [8, 9], [10]]
    reqs = [
        (ids(*(system + tails[0])), 4),
        (ids(*(system + tails[1])), 5),
        (ids(*tails[2], *system[:3]), 3),
        (ids(*(system + tails[3])), 4),
        (ids(*tails[4]), 5),
    ]
    if ps == 1:
        sizes = dict(num_pages=14, token_budget=6, chunk_size=4, max_batch=3)
    else:
        sizes = dict(num_pages=5, token_budget=24, chunk_size=16, max_batch=3)
    return reqs, sizes


def slot_accounting(flow: RequestFlow) -> None:
    """Free + cached + held by running requests = every page of the pool."""
    ps = flow.page_size
    held = sum(-(-(len(r) - r.tree_len) // ps) for r in flow.running.values())
    cached = flow.manager.size_info.total_size // ps
    total = flow.allocator.num_free_pages + cached + held
    assert total == flow.allocator.num_pages, (flow.allocator.num_free_pages, cached, held)


def kv_read_back(sched: Scheduler, pool: MHAKVCache) -> None:
    """Every running request's computed K/V are those its own tokens stored."""
    k, v = pool.k_cache(0).reshape(-1), pool.v_cache(0).reshape(-1)
    for s in sched.running:
        req = s.req
        n = req.num_computed
        idx = req.indices[:n].long()
        assert torch.equal(k[idx], prefix_codes(req.input_ids)[:n]), s.sid
        assert torch.equal(v[idx], req.input_ids[:n].float()), s.sid


def check_step(sched: Scheduler, forced: dict[int, list[int]]) -> None:
    sched.check_integrity()
    slot_accounting(sched.flow)
    for sid, s in sched.requests.items():
        assert len(s.output) <= s.max_new_tokens
        if sid in forced:
            assert s.output == forced[sid][: len(s.output)]
        if s.status == "finished":
            assert len(s.output) == s.max_new_tokens


def drive(
    sched: Scheduler,
    faults: Faults,
    check: Callable[[], None],
    abort_at: int | None = 3,
    abort_sid: int = 2,
    limit: int = 300,
) -> None:
    """Step to the end, every step's error checked to be the injected one, ``check`` after
    each; abort ``abort_sid`` before step ``abort_at`` (the abort may be the call that fails)."""
    for n in range(limit):
        if sched.idle:
            return
        if n == abort_at and sched.requests[abort_sid].status in ("waiting", "running"):
            try:
                sched.abort(abort_sid)
            except (RuntimeError, KeyboardInterrupt) as e:
                assert faults.is_mine(e), e
        try:
            sched.step()
        except (RuntimeError, KeyboardInterrupt) as e:
            assert faults.is_mine(e), e
        with faults.paused():
            check()
    raise AssertionError(f"not idle after {limit} steps: the scheduler is wedged")


def forced_tokens(sid: int, n: int) -> list[int]:
    return [(5 * sid + i) % 40 + 1 for i in range(n)]


def run_forced(
    kind: str, ps: int, policy: str, faults: Faults, inner: bool = False
) -> tuple[Scheduler, dict[str, Any]]:
    reqs, sizes = scenario(ps)
    pool = MHAKVCache(
        1, 1, 1, sizes["num_pages"], torch.float32, KVCacheLayout.LayerFirst, "cpu", page_size=ps
    )
    faults.patch(pool, "pool", ["store_kv"])
    alloc = make_allocator(sizes["num_pages"], ps, faults, inner)
    flow = faults.patch(RequestFlow(make_manager(kind, ps, faults, inner), alloc), "flow")
    sched = Scheduler(
        flow,
        token_budget=sizes["token_budget"],
        chunk_size=sizes["chunk_size"],
        max_batch=sizes["max_batch"],
        policy=policy,
        runner=faults.wrap(HashRunner(pool), "runner"),
    )
    forced = {}
    for prompt, n in reqs:
        out = forced_tokens(len(forced), n)
        forced[sched.submit(prompt, n, forced=torch.tensor(out))] = out

    def check() -> None:
        check_step(sched, forced)
        kv_read_back(sched, pool)

    drive(sched, faults, check)
    return sched, {"forced": forced}


def ended_well(sched: Scheduler, aborted: int = 2) -> None:
    for sid, s in sched.requests.items():
        assert s.status in ("finished", "aborted"), (sid, s.status, s.error)
        assert s.status == "finished" or sid == aborted
        assert s.flow_req is None
    assert not sched.flow.running


CONFIGS = [
    ("radix", 1, "lpm"),
    ("radix", 16, "fcfs"),
    ("block_hash", 1, "fcfs"),
    ("block_hash", 16, "lpm"),
]


def every_fault(
    run: Callable[[Faults], Scheduler], exc: type[BaseException], stride: int = 1
) -> Faults:
    """``run`` once counting its calls, then once failing at every ``stride``-th call number
    (each run's end checked by `ended_well`); returns the counting run's `Faults`."""
    counted = Faults()
    ended_well(run(counted))
    for n in range(1, counted.calls + 1, stride):
        faults = Faults(n, exc)
        sched = run(faults)
        assert faults.raised is not None, n
        with faults.paused():
            ended_well(sched)
    return counted


@pytest.mark.parametrize("kind,ps,policy", CONFIGS)
@pytest.mark.parametrize("exc", EXCEPTIONS, ids=lambda e: e.__name__)
def test_every_call_of_a_step_may_fail(torch_store, kind, ps, policy, exc):
    """The flow's calls, LPM's matches, the runner and the pool's store, each failing in turn."""
    counted = every_fault(lambda f: run_forced(kind, ps, policy, f)[0], exc)
    assert counted.calls > 100
    sched, _ = run_forced(kind, ps, policy, Faults())
    assert sched.report().preemptions > 0 and sched.report().reused_tokens > 0


@pytest.mark.parametrize("kind,ps,policy", CONFIGS)
@pytest.mark.parametrize("exc", EXCEPTIONS, ids=lambda e: e.__name__)
def test_every_call_inside_the_flow_may_fail(torch_store, kind, ps, policy, exc):
    """The manager's, the allocator's and the block hash's calls made inside the flow's calls,
    each failing in turn: the scheduler relies on the flow leaving its request as it was."""
    every_fault(lambda f: run_forced(kind, ps, policy, f, inner=True)[0], exc)


# ------------------------------------------------------------------ the tiny model
MODEL_CONFIG = TinyLlamaConfig(
    vocab_size=50,
    num_layers=1,
    hidden_size=16,
    num_q_heads=2,
    num_kv_heads=1,
    head_dim=8,
    intermediate_size=16,
    seed=1,
)


@pytest.fixture(scope="module")
def model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield TinyLlama(MODEL_CONFIG)
    torch.set_num_threads(threads)


def run_model(
    model: TinyLlama, kind: str, ps: int, policy: str, faults: Faults, inner: bool = False
) -> tuple[Scheduler, list[tuple[torch.Tensor, int]]]:
    reqs, sizes = scenario(ps)
    pool = faults.patch(model.new_kv_cache(sizes["num_pages"], ps), "pool", ["store_kv"])
    alloc = make_allocator(sizes["num_pages"], ps, faults, inner)
    engine = Engine(model, pool, make_manager(kind, ps, faults, inner), alloc)
    faults.patch(engine.flow, "flow")
    model.forward = faults.wrap(type(model).forward.__get__(model), "model.forward")
    try:
        sched = Scheduler(
            engine.flow,
            token_budget=sizes["token_budget"],
            chunk_size=sizes["chunk_size"],
            max_batch=sizes["max_batch"],
            policy=policy,
            runner=faults.wrap(model_runner(engine), "runner"),
        )
        for prompt, n in reqs:
            sched.submit(prompt, n)
        drive(sched, faults, lambda: check_step(sched, {}))
    finally:
        del model.forward
    return sched, reqs


@pytest.mark.parametrize("kind,ps,policy", CONFIGS)
@pytest.mark.parametrize("exc", EXCEPTIONS, ids=lambda e: e.__name__)
def test_with_the_model_every_output_is_a_recomputations(torch_store, model, kind, ps, policy, exc):
    """`model_runner` over the tiny model, its ``forward`` and the pool's ``store_kv`` failing
    too: whatever failed, every finished request's output is the cache-free greedy one."""
    reqs, _ = scenario(ps)
    want = {sid: greedy(model, p, n) for sid, (p, n) in enumerate(reqs)}

    def run(faults: Faults) -> Scheduler:
        sched, _ = run_model(model, kind, ps, policy, faults)
        for sid, s in sched.requests.items():
            if s.status == "finished":
                assert s.output == want[sid], (faults.where, sid)
        return sched

    every_fault(run, exc, stride=3 if ps == 1 else 2)


# ------------------------------------------------------------------ what one fault cannot show
def simple(num_pages: int = 32, ps: int = 1, **kw: Any) -> Scheduler:
    flow = RequestFlow(RadixCacheManager(page_size=ps), PageAllocator(num_pages, ps))
    return Scheduler(flow, **kw)


def forced(n: int, token: int = 5) -> torch.Tensor:
    return torch.full((n,), token, dtype=torch.int64)


def test_a_poisoned_request_fails_alone_and_the_others_finish():
    """A runner that cannot run one request's token (it declares no vocabulary): its batches
    fail, the request is run alone, fails again and ends "failed"; the others finish."""

    def runner(items):
        if any(
            bool((r.input_ids[r.num_computed : r.num_computed + q] == 99).any()) for r, q in items
        ):
            raise ValueError("token 99 is outside the model's vocabulary")
        return None

    sched = simple(token_budget=64, max_batch=4, runner=runner)
    good = [sched.submit(ids(1, 2, 3, i), 3, forced=forced(3)) for i in range(3)]
    bad = sched.submit(ids(1, 2, 99), 3, forced=forced(3))
    errors = 0
    for _ in range(20):
        if sched.idle:
            break
        try:
            sched.step()
        except ValueError:
            errors += 1
        sched.check_integrity()
    assert sched.idle and errors == 2  # in the batch of four, then alone
    assert sched.requests[bad].status == "failed"
    assert "vocabulary" in str(sched.requests[bad].error)
    assert all(sched.requests[s].status == "finished" for s in good)
    assert sched.report().requests == 3 and sched.report().failed == 1
    assert "failed requests 1" in sched.report().summary()
    assert sched.flow.available_pages() == 32


def test_max_retries_sets_how_often_a_blamed_request_runs_again():
    calls = {"n": 0}

    def runner(items):
        calls["n"] += 1
        raise RuntimeError("always")

    for retries in (0, 1, 3):
        sched = simple(runner=runner, max_retries=retries)
        sid = sched.submit(ids(1, 2, 3), 2, forced=forced(2))
        for _ in range(retries + 1):
            assert sched.requests[sid].status == "waiting"
            with pytest.raises(RuntimeError, match="always"):
                sched.step()
        assert sched.requests[sid].status == "failed" and sched.idle
        sched.check_integrity()
    with pytest.raises(ValueError, match="max_retries"):
        simple(max_retries=-1)


def test_a_hash_that_always_fails_on_one_request_fails_it_only():
    """Block-hash ``hash_fn`` raising for one request's blocks, at every call."""
    plain = BlockHashCacheManager(page_size=2).hash_fn

    def hash_fn(parent, tokens):
        if 77 in tokens:
            raise ValueError("cannot hash 77")
        return plain(parent, tokens)

    flow = RequestFlow(BlockHashCacheManager(page_size=2, hash_fn=hash_fn), PageAllocator(16, 2))
    sched = Scheduler(flow, token_budget=32, max_batch=4, policy="lpm")
    good = [sched.submit(ids(1, 2, 3, 4, i), 2, forced=forced(2)) for i in range(2)]
    bad = sched.submit(ids(77, 77, 77, 77, 5), 2, forced=forced(2))
    raised = 0
    for _ in range(20):
        if sched.idle:
            break
        try:
            sched.step()
        except ValueError as e:
            assert "77" in str(e)
            raised += 1
        sched.check_integrity()
    assert sched.idle and raised == 2
    assert sched.requests[bad].status == "failed"
    assert all(sched.requests[s].status == "finished" for s in good)
    assert flow.available_pages() == 16


def test_a_finish_that_always_fails_still_finishes_the_request_uncached():
    """Found: one ``flow.finish`` failure left the request running with all its tokens; every
    later step raised ``IndexError`` (and with a model it decoded past ``max_new_tokens``)."""
    flow = RequestFlow(RadixCacheManager(), PageAllocator(32))
    real = flow.finish
    failing = {"on": True}

    def finish(req):
        if failing["on"] and 42 in req.input_ids.tolist():
            raise RuntimeError("finish failed")
        return real(req)

    flow.finish = finish
    sched = Scheduler(flow, token_budget=16, max_batch=4)
    bad = sched.submit(ids(42, 1, 2), 2, forced=forced(2))
    good = sched.submit(ids(3, 4, 5), 4, forced=forced(4))
    with pytest.raises(RuntimeError, match="finish failed"):
        while True:
            sched.step()
    s = sched.requests[bad]
    assert s.status == "running" and s.complete
    sched.check_integrity()
    sched.run()
    assert s.status == "finished" and s.output == [5, 5] and "finish failed" in str(s.error)
    assert sched.requests[good].status == "finished"
    # The prompt was cached when its prefill completed (mini-sglang's cache_req(finished=False));
    # the decoded token was freed, not cached: the failing finish never inserted it.
    assert flow.manager.match_prefix(ids(42, 1, 2, 5))[0].cached_len == 3
    assert flow.available_pages() == 32
    sched.check_integrity()


def test_a_cache_that_always_fails_on_one_request_fails_it_only():
    flow = RequestFlow(RadixCacheManager(), PageAllocator(64))
    real = flow.cache

    def cache(req):
        if 66 in req.input_ids.tolist():
            raise ValueError("cache failed")
        return real(req)

    flow.cache = cache
    sched = Scheduler(flow, token_budget=4, chunk_size=4, max_batch=4)
    bad = sched.submit(ids(66, *range(1, 10)), 2, forced=forced(2))
    good = sched.submit(ids(*range(20, 30)), 2, forced=forced(2))
    raised = 0
    for _ in range(40):
        if sched.idle:
            break
        try:
            sched.step()
        except ValueError:
            raised += 1
        sched.check_integrity()
    assert sched.idle and raised == 2
    assert sched.requests[bad].status == "failed" and sched.requests[good].status == "finished"
    assert flow.available_pages() == 64


def test_a_failed_step_requeues_its_batch_first_come_first_served():
    """Found: the batch went back to the queue in reverse order."""
    fail = {"on": False}

    def runner(items):
        if fail["on"]:
            fail["on"] = False
            raise RuntimeError("device lost")
        return None

    sched = simple(64, token_budget=64, max_batch=3, runner=runner)
    sids = [sched.submit(ids(i, i, i), 3, forced=forced(3)) for i in range(5)]
    sched.step()  # 0, 1, 2 run; 3, 4 wait
    assert [s.sid for s in sched.running] == sids[:3]
    fail["on"] = True
    with pytest.raises(RuntimeError, match="device lost"):
        sched.step()
    assert [s.sid for s in sched.waiting] == sids  # the batch in its order, then the rest
    assert all(sched.requests[s].failures == 1 for s in sids[:3])
    sched.check_integrity()
    report = sched.run()
    assert report.requests == 5 and report.failed == 0
    assert all(s.failures == 0 for s in sched.requests.values())
    alone = [r for r in sched.history[1:] if len(r.admitted) == 1 and len(r.prefill) == 1]
    assert len(alone) >= 3  # each blamed request ran once alone, and was cleared


def test_a_keyboard_interrupt_undoes_the_step_and_blames_nobody():
    fail = {"on": True}

    def runner(items):
        if fail["on"]:
            fail["on"] = False
            raise KeyboardInterrupt
        return None

    sched = simple(runner=runner)
    sid = sched.submit(ids(1, 2, 3), 2, forced=forced(2))
    with pytest.raises(KeyboardInterrupt):
        sched.step()
    assert sched.requests[sid].status == "waiting" and sched.requests[sid].failures == 0
    assert sched.clock == 0.0 and sched.steps == 0
    assert sched.run().requests == 1


# ------------------------------------------------------------------ checked at submit
@pytest.fixture(scope="module")
def engine_model():
    return TinyLlama(MODEL_CONFIG)


def model_sched(model: TinyLlama) -> Scheduler:
    engine = Engine(model, model.new_kv_cache(32), RadixCacheManager(), PageAllocator(32))
    return Scheduler(engine.flow, runner=model_runner(engine))


@pytest.mark.parametrize(
    "prompt,new,forced_ids,match",
    [
        ([1, 2, 50], 2, None, r"prompt must lie in \[0, 50\).*got \[1, 50\]"),
        ([1, -1], 2, None, r"prompt must lie in \[0, 50\).*got \[-1, 1\]"),
        ([1, 2], 2, [3, 50], r"forced must lie in \[0, 50\)"),
        ([1, 2], 2, [-3, 5], r"forced must lie in \[0, 50\)"),
    ],
)
def test_tokens_the_model_cannot_run_are_refused_at_submit(
    engine_model, prompt, new, forced_ids, match
):
    """Found: they were queued, and then every batch holding them failed, for ever."""
    sched = model_sched(engine_model)
    f = None if forced_ids is None else torch.tensor(forced_ids)
    with pytest.raises(ValueError, match=match):
        sched.submit(torch.tensor(prompt), new, f)
    assert not sched.requests and sched.idle
    sched.submit(torch.tensor([1, 2]), 2, torch.tensor([3, 49, 99]))  # past max_new_tokens: unused
    assert sched.run().requests == 1


def test_negative_ids_are_refused_without_a_runner_too():
    sched = simple()
    with pytest.raises(ValueError, match=r"prompt must lie in \[0, inf\)"):
        sched.submit(ids(1, -2), 1, forced=forced(1))
    with pytest.raises(ValueError, match=r"forced must lie in \[0, inf\)"):
        sched.submit(ids(1, 2), 1, forced=ids(-1))
    assert not sched.requests


@pytest.mark.parametrize("vocab,exc", [(0, ValueError), (1.5, TypeError), ("50", TypeError)])
def test_a_runner_declaring_a_bad_vocabulary_is_refused(vocab, exc):
    def runner(items):
        return None

    runner.vocab_size = vocab
    with pytest.raises(exc, match="vocab_size"):
        simple(runner=runner)


def test_model_runner_takes_an_engine():
    with pytest.raises(TypeError, match="engine must be an Engine"):
        model_runner(None)
