"""Hypothesis drives the scheduler: random submissions, steps and aborts, several pools and policies,
and failures: a runner that fails, any call of a step failing (`faults.Faults`: the flow's
calls, LPM's matches, the runner, the pool's store) with ``RuntimeError`` or
``KeyboardInterrupt``, an abort that fails, and poisoned requests the runner can never run.

A runner stands in for the model and writes, for every token it runs, a K/V that encodes the
token's whole prefix (a rolling hash) into a real `MHAKVCache` through ``store_kv``. After every
step we check what a serving system must never get wrong: the scheduler's own state
(`Scheduler.check_integrity`: each request in the lane its status names, once, each running one
holding exactly its tokens in the flow) and the flow's page partition, slot accounting (free +
cached + held = the pool), every running request's K/V read back equal to what its own tokens
stored (so a slot shared through the cache holds the same prefix for everyone), outputs as
forced and never past ``max_new_tokens``, a poisoned request never finished, and that, when it
drains, every request ends (finished, aborted or failed) within a bound.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from faults import Faults
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvcache.kernels.store as store_module
from kvcache import (
    KVCacheLayout,
    MHAKVCache,
    PageAllocator,
    RadixCacheManager,
    Request,
    RequestFlow,
    Scheduler,
)

MOD = 1 << 20  # codes stay exact in float32


def prefix_codes(ids: torch.Tensor) -> torch.Tensor:
    """Code of every prefix ``ids[:i + 1]``: a rolling hash, float32 ``(len(ids),)``."""
    out, h = [], 0
    for t in ids.tolist():
        h = (h * 131 + t + 1) % MOD
        out.append(float(h))
    return torch.tensor(out, dtype=torch.float32)


POISON = 99  # a token the runner can never run


class HashRunner:
    """Stores ``K = code of the prefix`` and ``V = token`` at each run token's slot; refuses a
    batch that would run `POISON`."""

    def __init__(self, pool: MHAKVCache) -> None:
        self.pool = pool
        self.fail_next = False

    def __call__(self, items: Sequence[tuple[Request, int]]) -> None:
        for req, q in items:
            if POISON in req.input_ids[req.num_computed : req.num_computed + q].tolist():
                raise ValueError("poison: the runner cannot run this token")
        for req, q in items:
            lo, hi = req.num_computed, req.num_computed + q
            codes = prefix_codes(req.input_ids[:hi])[lo:hi]
            k = codes.view(-1, 1, 1)
            v = req.input_ids[lo:hi].float().view(-1, 1, 1)
            self.pool.store_kv(k, v, req.indices[lo:hi], 0)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("runner failed on purpose")
        return None


SYSTEMS = [[7] * 9, [3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]]


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        num_pages=st.sampled_from([6, 10, 16]),
        page_size=st.sampled_from([1, 2, 4]),
        budget=st.sampled_from([1, 3, 16]),
        max_batch=st.sampled_from([1, 3, 5]),
        policy=st.sampled_from(["fcfs", "lpm"]),
        victim=st.sampled_from(["newest", "fewest_decoded"]),
        bound=st.sampled_from([1, 4, 50]),
    )
    def setup(self, num_pages, page_size, budget, max_batch, policy, victim, bound):
        # The torch store (bit-identical to Triton's, checked in test_store_cache): under
        # TRITON_INTERPRET=1 each store takes ~40 ms of interpreter, most of this test's time.
        self.interpret, store_module.TRITON_INTERPRET = store_module.TRITON_INTERPRET, False
        self.pool = MHAKVCache(
            1, 1, 1, num_pages, torch.float32, KVCacheLayout.LayerFirst, "cpu", page_size=page_size
        )
        self.flow = RequestFlow(
            RadixCacheManager(page_size=page_size), PageAllocator(num_pages, page_size)
        )
        self.runner = HashRunner(self.pool)
        self.faults = Faults()  # counts calls; armed for one call by `faulty_step`, `abort`
        self.faults.patch(self.flow, "flow")
        self.faults.patch(self.flow.manager, "manager", ["match_prefix"])
        self.faults.patch(self.pool, "pool", ["store_kv"])
        self.sched = Scheduler(
            self.flow,
            token_budget=budget,
            max_batch=max_batch,
            policy=policy,
            victim=victim,
            starvation_bound=bound,
            lpm_queue_limit=3,
            runner=self.faults.wrap(self.runner, "runner"),
        )
        self.capacity = num_pages * page_size
        self.forced: dict[int, tuple[list[int], int]] = {}
        self.status: dict[int, str] = {}
        self.poisoned: set[int] = set()

    def arm(self, n: int, exc: type[BaseException]) -> None:
        """The ``n``-th wrapped call from now raises ``exc``."""
        self.faults.fail_at, self.faults.exc, self.faults.raised = self.faults.calls + n, exc, None

    def disarm(self) -> None:
        self.faults.fail_at = None

    @rule(
        system=st.integers(0, len(SYSTEMS)),
        tail=st.lists(st.integers(0, 9), max_size=6),
        new=st.integers(1, 6),
        seed=st.integers(0, 99),
    )
    def submit(self, system, tail, new, seed):
        prompt = (SYSTEMS[system] if system < len(SYSTEMS) else []) + tail
        if not prompt:
            prompt = [seed % 10]
        forced = [(seed + i) % 10 for i in range(new)]
        fits = len(prompt) + new - 1 <= self.capacity
        waiting_before = len(self.sched.waiting)
        try:
            sid = self.sched.submit(torch.tensor(prompt), new, forced=torch.tensor(forced))
        except ValueError:
            assert not fits
            assert len(self.sched.waiting) == waiting_before
            return
        assert fits
        self.forced[sid] = (forced, new)
        self.status[sid] = "waiting"

    @rule(system=st.integers(0, len(SYSTEMS)), at=st.integers(0, 6), new=st.integers(1, 4))
    def submit_poisoned(self, system, at, new):
        """A request whose prompt the runner can never run: it must end failed (or aborted)."""
        prompt = (SYSTEMS[system] if system < len(SYSTEMS) else []) + [1, 2, 3]
        prompt.insert(min(at, len(prompt)), POISON)
        if len(prompt) + new - 1 > self.capacity:
            return
        sid = self.sched.submit(torch.tensor(prompt), new, forced=torch.tensor([4] * new))
        self.forced[sid] = ([4] * new, new)
        self.status[sid] = "waiting"
        self.poisoned.add(sid)

    @rule(system=st.integers(0, len(SYSTEMS) - 1), new=st.integers(2, 10))
    def burst(self, system, new):
        """Three requests behind one system prompt at once: they share it, and crowd the pool."""
        for i in range(3):
            self.submit(system, [i], new, i)

    @rule()
    def step(self):
        self.step_expecting("poison")  # a poisoned request's batch fails: nothing else may

    def step_expecting(self, *expected: str) -> None:
        """One step whose error, if any, is the injected fault or one of ``expected``."""
        try:
            self.sched.step()
        except (RuntimeError, ValueError, KeyboardInterrupt) as e:
            assert self.faults.is_mine(e) or any(x in str(e) for x in expected), repr(e)

    @rule()
    def failing_step(self):
        self.runner.fail_next = True
        self.step_expecting("on purpose", "poison")
        self.runner.fail_next = False

    @rule(n=st.integers(1, 12), exc=st.sampled_from([RuntimeError, KeyboardInterrupt]))
    def faulty_step(self, n, exc):
        """The ``n``-th call the step makes (flow, LPM match, runner, store) raises ``exc``."""
        self.arm(n, exc)
        try:
            self.step_expecting("poison")
        finally:
            self.disarm()

    @precondition(
        lambda self: self.status and any(s in ("waiting", "running") for s in self.status.values())
    )
    @rule(pick=st.integers(0, 1000), fail=st.booleans())
    def abort(self, pick, fail):
        """Abort a live request; with ``fail``, its flow call raises: nothing changes."""
        live = sorted(sid for sid, s in self.status.items() if s in ("waiting", "running"))
        sid = live[pick % len(live)]
        before = self.sched.requests[sid].status
        if fail and before == "running":
            self.arm(1, RuntimeError)
            try:
                self.sched.abort(sid)
                raise AssertionError("the injected fault did not fire")
            except RuntimeError as e:
                assert self.faults.is_mine(e)
            finally:
                self.disarm()
            assert self.sched.requests[sid].status == "running"
            return
        self.sched.abort(sid)
        self.status[sid] = "aborted"

    @precondition(lambda self: self.status)
    @rule()
    def drain(self):
        todo = [
            self.sched.requests[sid]
            for sid in self.status
            if self.status[sid] in ("waiting", "running")
        ]
        bound = 4 * sum(len(s.prompt) + s.max_new_tokens for s in todo) + 10
        for _ in range(2 * len(todo) + 1):  # a poisoned request raises twice, then fails
            try:
                self.sched.run(max_steps=bound)  # raises when not done within the bound
                break
            except ValueError as e:
                assert "poison" in str(e)
        assert self.sched.idle
        for sid in self.status:
            assert self.sched.requests[sid].status in ("finished", "aborted", "failed")

    @invariant()
    def consistent(self):
        if not hasattr(self, "sched"):
            return
        self.sched.check_integrity()
        flow, ps = self.flow, self.flow.page_size
        held = sum(-(-(len(r) - r.tree_len) // ps) for r in flow.running.values())
        free_cached = flow.allocator.num_free_pages + flow.manager.size_info.total_size // ps
        assert free_cached + held == flow.allocator.num_pages
        for s in self.sched.waiting + self.sched.running + self.sched.done:
            if s.sid in self.status and self.status[s.sid] != "aborted":
                self.status[s.sid] = s.status
        for sid in self.poisoned:
            assert self.sched.requests[sid].status != "finished"
        for s in self.sched.done:
            assert s.status != "failed" or s.error is not None
        for sid, (forced, new) in self.forced.items():
            out = self.sched.requests[sid].output
            assert out == forced[: len(out)] and len(out) <= new
            if self.status[sid] == "finished":
                assert len(out) == new
        assert {s.sid for s in self.sched.waiting} == {
            i for i, s in self.status.items() if s == "waiting"
        }
        assert {s.sid for s in self.sched.running} == {
            i for i, s in self.status.items() if s == "running"
        }
        assert len(self.sched.running) <= self.sched.max_batch

    def teardown(self):
        if hasattr(self, "interpret"):
            store_module.TRITON_INTERPRET = self.interpret

    @invariant()
    def kv_read_back(self):
        if not hasattr(self, "sched"):
            return
        k, v = self.pool.k_cache(0).reshape(-1), self.pool.v_cache(0).reshape(-1)
        for s in self.sched.running:
            req = s.flow_req
            n = req.num_computed
            idx = req.indices[:n].long()
            assert torch.equal(k[idx], prefix_codes(req.input_ids)[:n])
            assert torch.equal(v[idx], req.input_ids[:n].float())


SchedulerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestSchedulerMachine = SchedulerMachine.TestCase
