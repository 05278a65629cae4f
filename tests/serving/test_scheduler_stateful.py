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

Issue 30's scheduler features run in the same machine: every admission policy (FCFS, LPM with
and without in-batch prefix caching, DFS-weight, priority), chunked prefill on and off, request
priorities, stop conditions (the scheduler's eos, stop tokens, ``min_tokens``, ``ignore_eos``:
a finished request's output is exactly the forced stream cut where vLLM's ``check_stop`` cuts
it, and no output ever goes past that point), and ``reset_prefix_cache(reset_running_requests=
True)``, with or without a fault injected into it.

`ServingMachine`, below, is the whole serving system under the same kind of steps: a `Router`
over two replicas, each a `Scheduler` running the tiny model (`model_runner`) on a
`TieredCacheManager` whose host is small and whose disk tier (a `DiskKVStore`) both replicas
share; requests with priorities, namespaces and stop tokens; aborts, a runner that fails, page
files corrupted on disk, replicas removed with requests in flight and brought back. After
every step: every part's integrity (router, schedulers, flows, both tiers), and every finished
request's output, across the replicas it ran on, equal to a greedy decode of its prompt by the
model without any cache, cut by its stop conditions: so no page was ever served whose K/V were
not its prefix's (a corrupted file among them).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from faults import Faults
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvcache.kernels.store as store_module
from kvcache import (
    DiskKVStore,
    Engine,
    KVCacheLayout,
    MHAKVCache,
    PageAllocator,
    RadixCacheManager,
    Request,
    RequestFlow,
    Router,
    Scheduler,
    TieredCacheManager,
    TinyLlama,
    TinyLlamaConfig,
    model_runner,
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
EOS = 3  # the scheduler's end-of-sequence token, when the machine has one
POLICIES = {  # the admission policies, as Scheduler arguments
    "fcfs": {"policy": "fcfs"},
    "lpm": {"policy": "lpm"},
    "lpm_in_batch": {"policy": "lpm", "in_batch_prefix": 2},
    "dfs_weight": {"policy": "dfs_weight"},
    "priority": {"policy": "priority"},
}


def check_stop_cut(stream, max_new, min_tokens, eos, stops, ignore_eos):
    """The output vLLM's ``check_stop`` leaves a request that would emit ``stream``."""
    out = []
    for t in stream[:max_new]:
        out.append(t)
        if len(out) < min_tokens:
            continue
        if (not ignore_eos and t == eos) or t in stops or len(out) >= max_new:
            break
    return out


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        num_pages=st.sampled_from([6, 10, 16]),
        page_size=st.sampled_from([1, 2, 4]),
        budget=st.sampled_from([1, 3, 16]),
        max_batch=st.sampled_from([1, 3, 5]),
        policy=st.sampled_from(sorted(POLICIES)),
        victim=st.sampled_from(["newest", "fewest_decoded", "priority"]),
        bound=st.sampled_from([1, 4, 50]),
        chunked=st.booleans(),
        eos=st.sampled_from([None, EOS]),
    )
    def setup(self, num_pages, page_size, budget, max_batch, policy, victim, bound, chunked, eos):
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
            victim=victim,
            starvation_bound=bound,
            lpm_queue_limit=3,
            chunked_prefill=chunked,
            eos_token_id=eos,
            runner=self.faults.wrap(self.runner, "runner"),
            **POLICIES[policy],
        )
        self.capacity = num_pages * page_size
        self.budget = None if chunked else budget
        self.eos = eos
        self.cut: dict[int, list[int]] = {}  # what a finished request must have emitted
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
        priority=st.integers(0, 2),
        stops=st.sets(st.integers(0, 9), max_size=2),
        min_tokens=st.integers(0, 6),
        ignore_eos=st.booleans(),
    )
    def submit(self, system, tail, new, seed, priority, stops, min_tokens, ignore_eos):
        prompt = (SYSTEMS[system] if system < len(SYSTEMS) else []) + tail
        if not prompt:
            prompt = [seed % 10]
        forced = [(seed + i) % 10 for i in range(new)]
        min_tokens = min(min_tokens, new)
        longest = len(prompt) + new - 1
        fits = longest <= self.capacity and (self.budget is None or longest <= self.budget)
        waiting_before = len(self.sched.waiting)
        try:
            sid = self.sched.submit(
                torch.tensor(prompt),
                new,
                forced=torch.tensor(forced),
                priority=priority,
                min_tokens=min_tokens,
                stop_token_ids=stops,
                ignore_eos=ignore_eos,
            )
        except ValueError:
            assert not fits
            assert len(self.sched.waiting) == waiting_before
            return
        assert fits
        self.forced[sid] = (forced, new)
        self.cut[sid] = check_stop_cut(forced, new, min_tokens, self.eos, stops, ignore_eos)
        self.status[sid] = "waiting"

    @rule(system=st.integers(0, len(SYSTEMS)), at=st.integers(0, 6), new=st.integers(1, 4))
    def submit_poisoned(self, system, at, new):
        """A request whose prompt the runner can never run: it must end failed (or aborted)."""
        prompt = (SYSTEMS[system] if system < len(SYSTEMS) else []) + [1, 2, 3]
        prompt.insert(min(at, len(prompt)), POISON)
        longest = len(prompt) + new - 1
        if longest > self.capacity or (self.budget is not None and longest > self.budget):
            return
        sid = self.sched.submit(torch.tensor(prompt), new, forced=torch.tensor([4] * new))
        self.forced[sid] = ([4] * new, new)
        self.cut[sid] = check_stop_cut([4] * new, new, 0, self.eos, (), False)
        self.status[sid] = "waiting"
        self.poisoned.add(sid)

    @rule(system=st.integers(0, len(SYSTEMS) - 1), new=st.integers(2, 10))
    def burst(self, system, new):
        """Three requests behind one system prompt at once: they share it, and crowd the pool."""
        for i in range(3):
            self.submit(system, [i], new, i, i, set(), 0, False)

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

    @rule(fail=st.integers(0, 4))
    def reset_with_running_requests(self, fail):
        """vLLM's ``reset_prefix_cache(reset_running_requests=True)``; with ``fail``, the
        ``fail``-th flow call it makes raises: the preemptions made stand, nothing is lost."""
        if fail:
            self.arm(fail, RuntimeError)
        try:
            self.sched.reset_prefix_cache(reset_running_requests=True)
        except RuntimeError as e:
            assert self.faults.is_mine(e), repr(e)
        else:
            assert not self.sched.running and not self.flow.manager.size_info.total_size
        finally:
            self.disarm()

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
            assert out == forced[: len(out)] and len(out) <= len(self.cut[sid]) <= new
            if self.status[sid] == "finished":
                assert out == self.cut[sid]
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


# ---------------------------------------------------------------------------- the whole system
MODEL = TinyLlama(TinyLlamaConfig(hidden_size=32, intermediate_size=64, seed=3))
SERVE_PS, SERVE_PAGES, SERVE_HOST = 2, 8, 3
PREFIXES = [[72, 105, 33, 9, 8, 7], [5, 5, 6, 6], [200, 100]]


_STREAMS: dict[tuple[tuple[int, ...], int], list[int]] = {}


def _greedy_stream(prompt: tuple[int, ...], n: int) -> list[int]:
    """The model's greedy tokens after ``prompt``, computed without any cache."""
    key, memo = (prompt, n), _STREAMS
    if key not in memo:
        seq, out = torch.tensor(prompt), []
        for _ in range(n):
            t = int(MODEL.reference_logits(seq)[-1].argmax())
            out.append(t)
            seq = torch.cat([seq, torch.tensor([t])])
        memo[key] = out
    return memo[key]


# Tokens the model emits often: stop tokens and the eos that actually fire.
_COMMON = sorted({t for p in PREFIXES for t in _greedy_stream(tuple(p), 6)})
SERVE_EOS = _COMMON[0]


class ServingMachine(RuleBasedStateMachine):
    @initialize(
        policy=st.sampled_from(sorted(POLICIES)),
        tier_policy=st.sampled_from(["write_back", "write_back_inclusive", "write_through"]),
        chunked=st.booleans(),
    )
    def setup(self, policy, tier_policy, chunked):
        self.interpret, store_module.TRITON_INTERPRET = store_module.TRITON_INTERPRET, False
        self.dir = Path(tempfile.mkdtemp(prefix="kvserve"))  # one disk tier, both replicas
        self.faults = Faults()
        self.tiers = []
        replicas = []
        for _ in range(2):
            pool = MODEL.new_kv_cache(SERVE_PAGES, SERVE_PS)
            alloc = PageAllocator(SERVE_PAGES, SERVE_PS)
            tier = TieredCacheManager(
                RadixCacheManager(page_size=SERVE_PS, events=True),
                pool,
                alloc,
                SERVE_HOST,
                policy=tier_policy,
                disk=DiskKVStore(self.dir, pool, "tiny-llama-3", fsync=False),
                events=True,
            )
            engine = Engine(MODEL, pool, tier, alloc)
            runner = self.faults.wrap(model_runner(engine), "runner")
            replicas.append(
                Scheduler(
                    engine.flow,
                    token_budget=16,
                    max_batch=3,
                    chunked_prefill=chunked,
                    eos_token_id=SERVE_EOS,
                    runner=runner,
                    **POLICIES[policy],
                )
            )
            self.tiers.append(tier)
        self.router = Router(replicas)
        self.want: dict[int, tuple[tuple[int, ...], object]] = {}  # rid -> (prompt, stop rule)
        self.aborted: set[int] = set()

    @rule(
        prefix=st.integers(0, len(PREFIXES) - 1),
        tail=st.lists(st.integers(0, 255), max_size=3),
        new=st.integers(1, 5),
        priority=st.integers(0, 2),
        stop=st.sampled_from([None, *_COMMON[1:4]]),
        min_tokens=st.integers(0, 2),
        ignore_eos=st.booleans(),
        key=st.sampled_from([None, "t"]),
    )
    def submit(self, prefix, tail, new, priority, stop, min_tokens, ignore_eos, key):
        prompt = tuple(PREFIXES[prefix] + tail)
        stops = () if stop is None else (stop,)
        rid = self.router.submit(
            torch.tensor(prompt),
            new,
            extra_key=key,
            priority=priority,
            min_tokens=min(min_tokens, new),
            stop_token_ids=stops,
            ignore_eos=ignore_eos,
        )
        rule = (new, min(min_tokens, new), SERVE_EOS, set(stops), ignore_eos)
        self.want[rid] = (prompt, rule)

    @precondition(lambda self: self.want)
    @rule(pick=st.integers(0, 99), new=st.integers(1, 5))
    def again(self, pick, new):
        """An earlier prompt comes back (a chat's next turn): its prefix may be on the device,
        the host, the disk, or on the other replica."""
        prompt, _ = self.want[sorted(self.want)[pick % len(self.want)]]
        rid = self.router.submit(torch.tensor(prompt), new)
        self.want[rid] = (prompt, (new, 0, SERVE_EOS, set(), False))

    def _busy(self):
        return any(not s.idle for s in self.router.replicas)

    @rule(n=st.integers(1, 8), fail=st.booleans())
    def step(self, n, fail):
        """``n`` steps; with ``fail`` the model raises in the first (that step is undone, its
        requests blamed and retried)."""
        for i in range(n):
            if not self._busy():
                return
            if fail and i == 0:
                self.faults.fail_at, self.faults.exc = self.faults.calls + 1, RuntimeError
            try:
                self.router.step()
            except RuntimeError as e:
                assert self.faults.is_mine(e), repr(e)
            finally:
                self.faults.fail_at = None

    @rule(pick=st.integers(0, 99))
    def abort(self, pick):
        live = [
            rid
            for rid, (r, sid) in enumerate(self.router.placement)
            if self.router.replicas[r].requests[sid].status in ("waiting", "running")
        ]
        if live:
            rid = live[pick % len(live)]
            r, sid = self.router.placement[rid]
            self.router.replicas[r].abort(sid)
            self.aborted.add(rid)

    @rule(r=st.integers(0, 1))
    def remove_or_restore(self, r):
        """A replica fails (its requests move to the other) or comes back."""
        if self.router.healthy[r]:
            if sum(self.router.healthy) > 1:
                self.router.remove_replica(r)
        else:
            self.router.add_replica(self.router.replicas[r])

    @rule(pick=st.integers(0, 99))
    def corrupt_a_page_file(self, pick):
        files = sorted(self.dir.glob("*/*.page"))
        if files:
            path = files[pick % len(files)]
            data = bytearray(path.read_bytes())
            data[-1 - pick % 8] ^= 0x40
            path.write_bytes(bytes(data))

    @invariant()
    def every_part_is_whole_and_every_answer_right(self):
        if not hasattr(self, "router"):
            return
        self.router.check_integrity()
        for tier in self.tiers:
            tier.check_integrity()
        for rid, (prompt, (new, lo, eos, stops, ignore)) in self.want.items():
            r, sid = self.router.placement[rid]
            s = self.router.replicas[r].requests[sid]
            out = self.router.output(rid)
            want = check_stop_cut(_greedy_stream(prompt, new), new, lo, eos, stops, ignore)
            assert out == want[: len(out)], (rid, out, want)
            if s.status == "finished":
                assert out == want
            if rid not in self.aborted:
                assert s.status in ("waiting", "running", "finished", "failed")

    @rule()
    def drain(self):
        """Every request ends: run to the end."""
        for _ in range(400):
            if not self._busy():
                break
            self.router.step()
        assert not self._busy()

    def teardown(self):
        if hasattr(self, "interpret"):
            store_module.TRITON_INTERPRET = self.interpret
            shutil.rmtree(self.dir, ignore_errors=True)
        if hasattr(self, "router"):  # what the run exercised (--hypothesis-show-statistics)
            stats = [t.stats for t in self.tiers]
            disks = [t.disk.stats for t in self.tiers]
            reasons = {s.finish_reason for sched in self.router.replicas for s in sched.done}
            event("loaded from disk" if any(x.disk_loaded_pages for x in stats) else "no disk load")
            event("loaded from host" if any(x.loaded_pages for x in stats) else "no host load")
            if any(d.rejected_pages for d in disks):
                event("a corrupted page file refused")
            if self.router._moved:
                event("requests moved off a removed replica")
            for reason in sorted(r for r in reasons if r):
                event(f"stopped by {reason}")


ServingMachine.TestCase.settings = settings(
    max_examples=20,
    stateful_step_count=45,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestServingMachine = ServingMachine.TestCase
