"""The scheduler: the tiny model's logits under it, its policies, misuse, and the cost model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kvcache import (
    LLAMA3_8B_H100,
    BlockHashCacheManager,
    CostModel,
    Engine,
    NaiveCacheManager,
    PageAllocator,
    RadixCacheManager,
    RequestFlow,
    Scheduler,
    TinyLlama,
    TinyLlamaConfig,
    model_runner,
)
from kvcache.serving.workloads import mixed

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import scheduler_steps

TOL = 1e-4


def make_flow(num_pages: int = 64, page_size: int = 1) -> RequestFlow:
    return RequestFlow(RadixCacheManager(page_size=page_size), PageAllocator(num_pages, page_size))


def ids(*tokens: int) -> torch.Tensor:
    return torch.tensor(tokens, dtype=torch.int64)


def forced(n: int, token: int = 5) -> torch.Tensor:
    return torch.full((n,), token, dtype=torch.int64)


# ------------------------------------------------------------------ the model under the scheduler
@pytest.fixture(scope="module")
def model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only add overhead on a busy machine
    yield TinyLlama(TinyLlamaConfig(hidden_size=32, intermediate_size=64, seed=3))
    torch.set_num_threads(threads)


def checked_runner(engine: Engine, seen: list):
    """`model_runner`, and every logit row compared with a cache-free recomputation."""
    inner = model_runner(engine)

    def run(items):
        logits = inner(items)
        for row, (req, q) in enumerate(items):
            upto = req.num_computed + q
            ref = engine.model.reference_logits(req.input_ids[:upto])[-1]
            seen.append((logits[row] - ref).abs().max().item())
        return logits

    return run


@pytest.mark.parametrize(
    "seed,page_size,victim", [(0, 1, "newest"), (1, 2, "fewest_decoded"), (2, 4, "newest")]
)
def test_logits_equal_recomputation_under_chunks_preemption_and_reuse(
    model, seed, page_size, victim
):
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(0, 256, (10,), generator=g)
    prompts = [
        torch.cat([system, torch.randint(0, 256, (int(n),), generator=g)])
        for n in torch.randint(1, 6, (5,), generator=g)
    ]
    num_pages = 36 // page_size
    engine = Engine(
        model,
        model.new_kv_cache(num_pages, page_size),
        RadixCacheManager(page_size=page_size),
        PageAllocator(num_pages, page_size),
    )
    seen: list = []
    sched = Scheduler(
        engine.flow, token_budget=7, max_batch=4, victim=victim, runner=checked_runner(engine, seen)
    )
    for p in prompts:
        sched.submit(p, 6)
    report = sched.run(max_steps=500)
    sched.check_integrity()
    assert report.requests == len(prompts) and max(seen) < TOL
    assert report.preemptions > 0  # preemption and readmission happened
    assert report.reused_tokens > 0  # concurrent requests reused the shared system prompt
    assert any(len(r.prefill) and any(n < 7 for _, n in r.prefill) for r in sched.history)
    # greedy outputs equal those of the model run alone, without any cache
    for sid, p in enumerate(prompts):
        seq = p.clone()
        for t in sched.requests[sid].output[:-1]:
            assert int(model.reference_logits(seq)[-1].argmax()) == t
            seq = torch.cat([seq, ids(t)])


# ------------------------------------------------------------------ chunked prefill and reuse
def test_a_prefix_still_being_prefilled_is_reused():
    flow = make_flow(64)
    sched = Scheduler(flow, token_budget=16, chunk_size=8, max_batch=4)
    long_a = torch.arange(30)
    a = sched.submit(long_a, 1, forced=forced(1))
    sched.step()  # A computes tokens 0-7 and caches them
    b = sched.submit(torch.cat([torch.arange(8), ids(99)]), 1, forced=forced(1))
    rec = sched.step()
    assert rec.prefill[0] == (a, 8) and b in rec.admitted
    b_req = sched.requests[b]
    assert b_req.status == "finished" or b_req.flow_req is not None
    assert sched.reused_tokens == 8  # B's first 8 tokens came from A's computed chunk
    assert sched.requests[a].status == "running"
    sched.run()
    sched.check_integrity()


def test_budget_splits_a_prompt_over_steps():
    sched = Scheduler(make_flow(64), token_budget=4, max_batch=1)
    sid = sched.submit(torch.arange(10), 2, forced=forced(2))
    sched.run()
    chunks = [n for r in sched.history for s, n in r.prefill if s == sid]
    assert chunks == [4, 4, 2]
    assert [r.decode for r in sched.history][-1] == (sid,)


# ------------------------------------------------------------------ preemption
@pytest.mark.parametrize("victim,expected", [("newest", 2), ("fewest_decoded", 1)])
def test_victim_policy(victim, expected):
    sched = Scheduler(make_flow(16), token_budget=64, max_batch=3, victim=victim)
    sched.submit(ids(1, 1, 1), 8, forced=forced(8))
    sched.step()
    sched.step()  # request 0 has decoded one token more than the others
    sched.submit(ids(2, 2, 2, 2, 2), 8, forced=forced(8))
    sched.submit(ids(3, 3, 3), 8, forced=forced(8))
    pre = []
    while not pre:
        pre = list(sched.step().preempted)
        sched.check_integrity()
    assert pre[0] == expected
    assert sched.waiting[0].sid == expected  # the victim waits at the front of the queue
    report = sched.run()
    assert report.requests == 3 and report.recomputed_tokens > 0


def test_preempted_request_keeps_its_cached_pages():
    flow = make_flow(12)
    sched = Scheduler(flow, token_budget=64, max_batch=2, victim="newest")
    sched.submit(ids(1, 1, 1, 1, 1), 7, forced=forced(7))
    sched.submit(ids(2, 2, 2, 2, 2), 7, forced=forced(7))
    while not sched.step().preempted:
        pass
    victim = sched.waiting[0]
    assert victim.sid == 1 and victim.preemptions == 1
    assert (
        flow.allocator.num_free_pages
        + flow.manager.size_info.total_size
        + sum(len(s.flow_req.indices) - s.flow_req.tree_len for s in sched.running)
        == 12
    )
    sched.run()


# ------------------------------------------------------------------ admission policies
def test_lpm_admits_the_longest_cached_prefix_first():
    orders = {}
    for policy in ("fcfs", "lpm"):
        sched = Scheduler(make_flow(64), token_budget=64, max_batch=1, policy=policy)
        sched.submit(ids(7, 7, 7, 7, 1), 1, forced=forced(1))
        sched.run()  # 7 7 7 7 is now cached
        sched.submit(ids(4, 4, 4, 4, 4), 1, forced=forced(1))
        sched.submit(ids(7, 7, 7, 7, 2), 1, forced=forced(1))
        sched.run()
        orders[policy] = [a for r in sched.history for a in r.admitted][1:]
    assert orders == {"fcfs": [1, 2], "lpm": [2, 1]}


def test_starvation_bound_stops_overtaking():
    for bound, overtaken in ((3, 3), (100, 6)):
        sched = Scheduler(
            make_flow(64), token_budget=64, max_batch=1, policy="lpm", starvation_bound=bound
        )
        sched.submit(ids(9, 9, 9, 9), 1, forced=forced(1))
        sched.run()
        lonely = sched.submit(ids(1, 2, 3, 4), 1, forced=forced(1))
        for i in range(6):
            sched.submit(ids(9, 9, 9, 9, i), 1, forced=forced(1))
        sched.run()
        admitted = [a for r in sched.history for a in r.admitted][1:]
        assert admitted.index(lonely) == overtaken


# ------------------------------------------------------------------ misuse
@pytest.mark.parametrize(
    "kwargs,error",
    [
        (dict(token_budget=0), ValueError),
        (dict(max_batch=0), ValueError),
        (dict(token_budget=1.5), TypeError),
        (dict(policy="sjf"), ValueError),
        (dict(victim="oldest"), ValueError),
        (dict(starvation_bound=0), ValueError),
        (dict(cost_model=1.0), TypeError),
    ],
)
def test_bad_settings_are_refused(kwargs, error):
    with pytest.raises(error):
        Scheduler(make_flow(), **kwargs)


def test_bad_requests_are_refused_and_change_nothing():
    flow = make_flow(8, page_size=2)
    sched = Scheduler(flow)
    with pytest.raises(ValueError, match="can never fit"):
        sched.submit(torch.arange(12), 6, forced=forced(6))  # 17 tokens > 16 slots
    sched.submit(torch.arange(12), 5, forced=forced(5))  # 16 tokens: fits exactly
    with pytest.raises(ValueError, match="forced"):
        sched.submit(ids(1), 3, forced=forced(2))
    with pytest.raises(ValueError, match="runner"):
        sched.submit(ids(1), 3)
    with pytest.raises(ValueError):
        sched.submit(ids(1), 0, forced=forced(1))
    with pytest.raises(ValueError):
        sched.submit(ids(), 1, forced=forced(1))
    with pytest.raises(TypeError):
        sched.submit([1, 2], 1, forced=forced(1))
    with pytest.raises(RuntimeError):
        sched.abort(99)
    assert [s.sid for s in sched.waiting] == [0] and len(sched.requests) == 1
    assert sched.run().requests == 1


def test_a_step_that_raises_leaks_nothing():
    flow = make_flow(32)
    calls = {"n": 0}

    def flaky(items):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device lost")
        return None

    sched = Scheduler(flow, token_budget=4, runner=flaky)
    for i in range(3):
        sched.submit(ids(i, i, i, i, i, i), 3, forced=forced(3))
    sched.step()
    sched.step()
    with pytest.raises(RuntimeError, match="device lost"):
        sched.step()
    sched.check_integrity()
    assert not sched.running and not flow.running
    assert flow.available_pages() == 32  # every page free or evictable: nothing leaked
    assert sched.run().requests == 3


def test_abort_frees_pages():
    flow = make_flow(32)
    sched = Scheduler(flow, token_budget=4)
    a = sched.submit(torch.arange(10), 3, forced=forced(3))
    b = sched.submit(torch.arange(10, 20), 3, forced=forced(3))
    sched.step()
    sched.abort(a)
    sched.abort(b)
    sched.check_integrity()
    assert flow.available_pages() == 32 and sched.idle
    with pytest.raises(RuntimeError):
        sched.abort(a)


# ------------------------------------------------------------------ cost model and reports
def test_cost_model():
    cm = LLAMA3_8B_H100
    assert cm.step_seconds(0) == 0.0
    assert cm.step_seconds(1) == pytest.approx(1e-3 + 4.8e-3)  # weight reads dominate
    assert cm.step_seconds(1000) == pytest.approx(1e-3 + 1000 * 32e-6)  # arithmetic dominates
    assert pytest.approx(cm.prefill_s_per_token, rel=0.02) == 2 * 8.03e9 / (989e12 * 0.5)
    assert pytest.approx(cm.decode_s_per_step, rel=0.01) == 16.06e9 / 3.35e12
    with pytest.raises(ValueError):
        CostModel(-1.0, 0.0, 0.0)


def test_reports_are_deterministic():
    def run(policy):
        sched = Scheduler(make_flow(600, 4), token_budget=256, max_batch=16, policy=policy)
        for job in mixed(60, vocab=500):
            out = job.output if len(job.output) else forced(1)
            sched.submit(job.prompt, len(out), forced=out)
        report = sched.run()
        sched.check_integrity()
        return report

    first = run("lpm")
    assert first == run("lpm") and first.requests == 60
    assert first.throughput > 0 and 0 < first.hit_rate < 1
    assert first.ttft_p50_s <= first.ttft_p99_s <= first.seconds


def test_benchmark_runs(tmp_path):
    threads = torch.get_num_threads()
    try:
        results = scheduler_steps.main(["--requests", "40", "--json", str(tmp_path / "r.json")])
    finally:
        torch.set_num_threads(threads)
    assert (tmp_path / "r.json").exists()
    for r in results.values():
        assert r["steps"] > 0 and 0 < r["manager_share"] < 1 and 0 < r["flow_only_share"] < 1
        shares = r["manager_share"] + r["flow_only_share"] + r["scheduler_share"]
        assert shares == pytest.approx(1) and r["scheduler_share"] > 0


@pytest.mark.parametrize("manager", ["naive", "block_hash", "radix"])
def test_any_manager_under_pressure(manager):
    page_size, pages = (1, 1000) if manager == "naive" else (4, 250)
    make = {
        "naive": NaiveCacheManager,
        "block_hash": BlockHashCacheManager,
        "radix": RadixCacheManager,
    }
    m = make[manager]() if manager == "naive" else make[manager](page_size=page_size)
    flow = RequestFlow(m, PageAllocator(pages, page_size))
    sched = Scheduler(flow, token_budget=128, chunk_size=48, max_batch=8, policy="lpm")
    jobs = mixed(40, vocab=300, seed=2)
    for job in jobs:
        out = job.output if len(job.output) else forced(1)
        sched.submit(job.prompt, len(out), forced=out)
    while not sched.idle:
        sched.step()
        sched.check_integrity()
    report = sched.report()
    assert report.requests == 40 and report.preemptions > 0
    assert (report.hit_rate == 0) == (manager == "naive")
