"""`Router`: requests over N replicas (each its own flow, pool, manager and `Scheduler`).

Data parallelism: N copies of the model, each with its own KV cache. Which copy a request goes
to decides whether its prefix is found cached, so the router is part of the cache. Policies:

* ``"round_robin"``: replica 0, 1, ..., N-1, 0, ... whatever the prompt.
* ``"least_loaded"``: the replica with the fewest requests waiting or running (ties: lowest index).
* ``"cache_aware"``: the idea of SGLang's cache-aware router (sgl-router). Loads are *imbalanced*
  when ``max - min > balance_abs_threshold`` and ``max > balance_rel_threshold * min``; then the
  least-loaded replica gets the request, whatever it caches. Otherwise each replica's
  `PrefixMirror` says how many leading tokens of the prompt it holds; if the longest match covers
  at least ``cache_threshold`` of the prompt the request goes there (ties: lower load, then the
  smaller cache, then the lower index), else to the replica caching the fewest tokens (the most
  room for a new prefix; ties: lower load, then index).

sgl-router grows its approximate trees from the requests it routed (it cannot see evictions, so
it evicts its own trees by LRU); this router feeds each mirror only from its replica's cache
events (``manager.take_events()``), as routers do that subscribe to vLLM's or SGLang's KV events.
The events reach the router ``event_delay_s`` simulated seconds after the step that produced
them (the network, the publisher's batching): the mirror is then exact but late.

Namespaces. A request's ``extra_key`` (its tenant, its adapter) goes with it to `route` and
`submit`: the mirrors match it only among the prefixes cached under the same key, so a tenant's
request goes to the replica that holds *that tenant's* prefix.

Replicas come and go. `remove_replica` takes a replica out (it failed a health check, or is
drained for maintenance) with requests in flight: its waiting and running requests are
withdrawn (their pages freed) and routed again among the others, each with what it has not yet
emitted (its prompt and the tokens it has emitted so far become the new prompt, as a
recomputation after preemption), its mirror and its events in flight are dropped, and nothing is
lost: `output` gives every request's whole output across the replicas it ran on. `add_replica`
brings a removed one back (its cache forgotten, so its mirror starts equal to it) or adds a new
one. sgl-router's cache-aware policy likewise drops a removed worker from its tree
(``CacheAwarePolicy::remove_worker``: ``tree.remove_tenant(url)``, ``sgl-router/src/policies/
cache_aware.rs``); the requests already proxied to it are the HTTP client's to retry there,
which is what `remove_replica` does here for them.

Time. Every replica keeps its own simulated clock (`Scheduler.clock`, the cost model's). `run`
is a discrete-event simulation: requests arrive at given times; before an arrival, every busy
replica that is behind it steps; an idle replica's clock jumps to the arrival. Replicas run in
one process; nothing here assumes more than the events and the load counts a real router has.

All or nothing. `route` changes nothing; a `submit` the chosen replica refuses (or that raises
anything) takes back the events it delivered to reach its arrival time; `run` checks every job
against every replica before it submits the first. A replica's step and its event source are
two calls: when the source raises after the step, the step stands and its events are taken
with the replica's next step (or by `sync`); the mirror is only later, as a lagging one is.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._validate import as_int, as_list, check_token_ids
from ..managers.cache_events import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    CacheEvent,
    check_extra_key,
)
from ..serving.cost_model import percentile
from ..serving.sched_records import SchedRequest
from ..serving.scheduler import Scheduler
from ..serving.workload_checks import check_jobs
from ..serving.workloads import Job
from .prefix_mirror import PrefixMirror

__all__ = ["Router", "RouterReport", "ROUTING_POLICIES", "poisson_arrivals"]

#: The policies a `Router` takes (see the module docstring of `kvcache.system.router`).
ROUTING_POLICIES = ("cache_aware", "round_robin", "least_loaded")


@dataclass(frozen=True)
class RouterReport:
    """What a routed run did, over all replicas, in simulated time.

    ``predicted_tokens``: prefix tokens the router's mirror promised at routing (on the replica
    chosen); ``realized_tokens``: what those requests reused at their first admission. The gap
    is what the mirror's lag and the queueing in between cost.
    """

    policy: str
    requests: int
    seconds: float
    output_tokens: int
    prompt_tokens: int
    reused_tokens: int
    computed_tokens: int
    ttft_p50_s: float
    ttft_p99_s: float
    routed: tuple[int, ...]
    by_prefix: int
    by_load: int
    by_room: int
    predicted_tokens: int
    realized_tokens: int
    mean_events_in_flight: float
    busy_seconds: float

    @property
    def throughput(self) -> float:
        """Output tokens per simulated second, from the first arrival to the last step."""
        return self.output_tokens / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_busy_second(self) -> float:
        """Output tokens per replica-second spent stepping (the GPU time the run cost): unlike
        `throughput` it does not depend on how fast requests arrive."""
        return self.output_tokens / self.busy_seconds if self.busy_seconds else 0.0

    @property
    def hit_rate(self) -> float:
        """Prompt tokens read from the cache at (re)admission over all prompt tokens admitted."""
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """``n`` arrival times (seconds from 0) of a Poisson process of ``rate`` requests/s (seeded)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < math.inf:
        raise ValueError(f"rate must be a number > 0, got {rate!r}")
    gen = torch.Generator().manual_seed(seed)
    gaps = torch.empty(n, dtype=torch.float64).exponential_(float(rate), generator=gen)
    return torch.cumsum(gaps, 0).tolist()


#: Events on their way to a mirror: (due time, sequence number, replica, events).
Flight = tuple[float, int, int, list[CacheEvent]]


def _inverse(
    events: list[CacheEvent], before: dict[tuple[object, tuple[int, ...]], tuple[int, ...]] | None
) -> list[CacheEvent]:
    """The events that take ``events`` back on a mirror: each store removed and each removal
    stored again, newest first; a batch that clears the mirror is taken back by clearing it and
    storing ``before`` (its pages before the batch) again, parents first."""
    if before is not None:
        pages = sorted(before.items(), key=lambda item: len(item[0][1]))
        return [AllCleared(), *(BlockStored(k, toks, slots) for (k, toks), slots in pages)]
    return [
        BlockRemoved(*ev) if isinstance(ev, BlockStored) else BlockStored(*ev)
        for ev in reversed(events)
    ]


def _number(value: object, name: str, lo: float, hi: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise ValueError(f"{name} must be a number in [{lo}, {hi}], got {value!r}")
    return float(value)


def _fresh(name: str, s: object) -> tuple[PrefixMirror, Callable[[], list[CacheEvent]]]:
    """A replica a router may take: a `Scheduler` that has served nothing, on a manager that
    caches nothing yet and records events; its (empty) mirror and its event source."""
    if not isinstance(s, Scheduler):
        raise TypeError(f"{name} must be a Scheduler, got {type(s).__name__}")
    take = getattr(s.flow.manager, "take_events", None)  # radix and block-hash have it
    if not s.idle or s.steps or s.requests:
        raise ValueError(f"{name} has served requests already; give a fresh one")
    if s.flow.manager.size_info.total_size or not callable(take):
        raise ValueError(
            f"{name}'s manager must be a radix or block-hash manager with an empty cache, got "
            f"{type(s.flow.manager).__name__} holding {s.flow.manager.size_info.total_size} tokens"
        )
    mirror = PrefixMirror(s.flow.page_size)
    try:  # the cache is empty: whatever the log held nets to nothing
        mirror.apply(take())
    except RuntimeError:
        raise ValueError(
            f"{name}'s manager records no events; construct it with events=True"
        ) from None
    return mirror, take


class Router:
    """Sends each request to one of ``replicas`` (see the module docstring for the policies).

    Args:
        replicas: one `Scheduler` per replica, >= 1, each on its own flow and manager; every
            manager must record events (``events=True``) and cache nothing yet, so that its
            mirror, built from its events alone, starts equal to it.
        policy: one of `ROUTING_POLICIES`.
        cache_threshold: the share of the prompt the longest match must cover, in [0, 1].
        balance_abs_threshold: load gap (requests) above which loads may be imbalanced, >= 0.
        balance_rel_threshold: ratio of loads above which they may be imbalanced, >= 1.
        event_delay_s: simulated seconds between a step and its events reaching the mirror.
    """

    def __init__(
        self,
        replicas: Sequence[Scheduler],
        *,
        policy: str = "cache_aware",
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 8,
        balance_rel_threshold: float = 1.5,
        event_delay_s: float = 0.0,
    ) -> None:
        if not isinstance(replicas, (list, tuple)):
            raise TypeError(f"replicas must be a list of Scheduler, got {type(replicas).__name__}")
        if len(replicas) < 1:
            raise ValueError("replicas must hold at least 1 Scheduler, got 0")
        for i, s in enumerate(replicas):
            if not isinstance(s, Scheduler):
                raise TypeError(f"replicas[{i}] must be a Scheduler, got {type(s).__name__}")
        parts = {
            "scheduler": [id(s) for s in replicas],
            "flow": [id(s.flow) for s in replicas],
            "manager": [id(s.flow.manager) for s in replicas],
            "allocator": [id(s.flow.allocator) for s in replicas],
        }
        for what, ids in parts.items():
            if len(set(ids)) != len(ids):
                raise ValueError(f"replicas must each have their own {what}; two share one")
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"policy must be one of {ROUTING_POLICIES}, got {policy!r}")
        self.cache_threshold = _number(cache_threshold, "cache_threshold", 0.0, 1.0)
        if isinstance(balance_abs_threshold, bool) or not isinstance(balance_abs_threshold, int):
            raise TypeError(f"balance_abs_threshold must be an int, got {balance_abs_threshold!r}")
        if balance_abs_threshold < 0:
            raise ValueError(f"balance_abs_threshold must be >= 0, got {balance_abs_threshold}")
        self.balance_rel_threshold = _number(balance_rel_threshold, "balance_rel_threshold", 1.0)
        self.event_delay_s = _number(event_delay_s, "event_delay_s", 0.0)
        fresh = [_fresh(f"replicas[{i}]", s) for i, s in enumerate(replicas)]
        self.replicas: tuple[Scheduler, ...] = tuple(replicas)
        self.mirrors: tuple[PrefixMirror, ...] = tuple(m for m, _ in fresh)
        self._take_events = tuple(take for _, take in fresh)
        self.healthy: list[bool] = [True] * len(replicas)
        self.policy = policy
        self.balance_abs_threshold = balance_abs_threshold
        self.now = 0.0
        self.placement: list[tuple[int, int]] = []  # router id -> (replica, scheduler id)
        self._rid_of: dict[tuple[int, int], int] = {}
        self._next_rr = 0
        self._in_flight: list[Flight] = []
        self._seq = itertools.count()
        self._predicted: dict[int, int] = {}
        self._realized: dict[int, int] = {}
        self._reasons = {"prefix": 0, "load": 0, "room": 0}
        self._flight_sum = 0
        self._moved: set[tuple[int, int]] = set()  # (replica, sid) withdrawn and routed again
        #: Requests a removal withdrew and has not routed again yet (it was interrupted).
        self.orphans: dict[int, SchedRequest] = {}
        self._carried: dict[int, list[int]] = {}  # router id -> tokens emitted before a move

    # ------------------------------------------------------------------ state
    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    def loads(self) -> list[int]:
        """Requests waiting or running on each replica (what sgl-router counts per worker)."""
        return [len(s.waiting) + len(s.running) for s in self.replicas]

    def events_in_flight(self) -> int:
        """Events published by the replicas that have not reached the mirrors yet."""
        return sum(len(evs) for _, _, _, evs in self._in_flight)

    # ------------------------------------------------------------------ deciding
    def route(self, prompt: torch.Tensor, extra_key: Hashable = None) -> tuple[int, str, int]:
        """Where ``prompt`` would go now: ``(replica, reason, predicted prefix tokens)``; reason is
        ``"prefix"``, ``"load"`` or ``"room"`` (round robin: ``"load"``). Changes nothing. Only
        healthy replicas are considered (``RuntimeError`` when none is).

        ``prompt``: 1-D integer token ids on the CPU, at least one (``TypeError``/``ValueError``);
        ``extra_key``: its namespace, matched only among the prefixes cached under it.
        """
        check_token_ids(prompt, "prompt")
        if len(prompt) == 0:
            raise ValueError("prompt must hold at least one token")
        check_extra_key(extra_key)
        live = [i for i, ok in enumerate(self.healthy) if ok]
        if not live:
            raise RuntimeError("no healthy replica to route to")
        toks = prompt[:-1]  # the last prompt token is always computed (it yields the logits)
        matches = {i: self.mirrors[i].match(toks, extra_key) for i in live}
        all_loads = self.loads()
        loads = {i: all_loads[i] for i in live}
        if self.policy == "round_robin":
            r = live[self._next_rr % len(live)]
            return r, "load", matches[r]
        least = min(live, key=lambda i: (loads[i], i))
        if self.policy == "least_loaded":
            return least, "load", matches[least]
        hi, lo = max(loads.values()), min(loads.values())
        if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
            return least, "load", matches[least]
        best = max(matches.values())
        size = {i: self.mirrors[i].cached_tokens for i in live}
        if best > 0 and best >= self.cache_threshold * len(prompt):
            r = min((i for i in live if matches[i] == best), key=lambda i: (loads[i], size[i], i))
            return r, "prefix", best
        r = min(live, key=lambda i: (size[i], loads[i], i))
        return r, "room", matches[r]

    # ------------------------------------------------------------------ acting
    def submit(
        self,
        prompt: torch.Tensor,
        max_new_tokens: int,
        forced: torch.Tensor | None = None,
        *,
        at: float | None = None,
        extra_key: Hashable = None,
        priority: int = 0,
        min_tokens: int = 0,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
    ) -> int:
        """Route a request arriving at simulated time ``at`` (default: now, never earlier) and
        queue it there; returns its router id (`placement` maps it to ``(replica, sid)``).
        ``extra_key``: its namespace, for the routing and on the replica; ``priority``,
        ``min_tokens``, ``stop_token_ids``, ``ignore_eos``: as `Scheduler.submit` takes them.

        The events due by ``at`` reach the mirrors first. A request the chosen replica refuses
        (`Scheduler.submit`'s errors, or anything it raises) changes nothing here: those events
        are taken back and wait in flight again. An idle replica's clock jumps to ``at``; a busy
        one's is left alone (`run` steps every busy replica up to an arrival before it submits,
        so that a request never starts before it arrived)."""
        t = self.now if at is None else _number(at, "at", self.now)
        delivered = self._deliver(t)
        try:
            r, reason, predicted = self.route(prompt, extra_key)
            sched = self.replicas[r]
            was_idle = sched.idle
            sid = sched.submit(  # validates; raises before queueing
                prompt,
                max_new_tokens,
                forced,
                extra_key=extra_key,
                priority=priority,
                min_tokens=min_tokens,
                stop_token_ids=stop_token_ids,
                ignore_eos=ignore_eos,
            )
        except BaseException:
            self._undeliver(delivered)
            raise
        self.now = t
        if was_idle and sched.clock < t:
            sched.clock = t  # its time jumps to the arrival
        sched.requests[sid].arrival_time = t
        rid = len(self.placement)
        self.placement.append((r, sid))
        self._rid_of[(r, sid)] = rid
        self._predicted[rid] = predicted
        self._reasons[reason] += 1
        self._flight_sum += self.events_in_flight()
        if self.policy == "round_robin":
            self._next_rr += 1
        return rid

    def output(self, rid: int) -> list[int]:
        """Every token request ``rid`` has emitted, across the replicas it ran on."""
        rid = as_int(rid, "rid")
        if not 0 <= rid < len(self.placement):
            raise ValueError(f"rid must be in [0, {len(self.placement)}), got {rid}")
        r, sid = self.placement[rid]
        return self._carried.get(rid, []) + self.replicas[r].requests[sid].output

    # ------------------------------------------------------------------ membership
    def remove_replica(self, r: int) -> list[int]:
        """Take replica ``r`` out (unhealthy, or drained): its waiting and running requests are
        withdrawn and routed again among the healthy replicas, each resuming from what it has
        emitted (see the module docstring); its mirror and its events in flight are dropped.
        Returns the router ids moved, oldest first.

        Refused, changing nothing: ``ValueError`` for a replica that is neither a healthy one
        nor one whose removal was interrupted, or when a request to move would not fit some
        other healthy replica's pool; ``RuntimeError`` when it has requests and no other
        healthy replica is left. A failure part way (a withdrawal or a submit raising) leaves
        the requests moved so far moved and the rest where they were, on the replica, which is
        out of routing and stepping, or withdrawn and not yet routed again (`orphans`):
        calling `remove_replica` again moves them all."""
        r = as_int(r, "r")
        if not 0 <= r < self.num_replicas:
            raise ValueError(f"replica {r} is not a replica of this router")
        if not self.healthy[r] and self.replicas[r].idle and not self.orphans:
            raise ValueError(f"replica {r} is not a healthy replica of this router")
        self._rehome()
        sched = self.replicas[r]
        live = sorted((self._rid_of[(r, s.sid)], s.sid) for s in sched.running + sched.waiting)
        others = [i for i, ok in enumerate(self.healthy) if ok and i != r]
        if live and not others:
            raise RuntimeError(f"replica {r} has {len(live)} requests and no other is healthy")
        for _, sid in live:
            s = sched.requests[sid]
            rest = s.max_new_tokens - len(s.output)
            for i in others:
                if rest and not s.complete:
                    self._check_fits_replica(i, f"request {sid}", len(s.tokens()), rest)
        self.healthy[r] = False
        self._drop_mirror(r)
        moved = []
        for rid, sid in live:
            s = sched.withdraw(sid)
            if s.status == "withdrawn":  # else it had stopped already: it ends here, finished
                self.orphans[rid] = s
                self._resubmit(rid, s)
            moved.append(rid)
        return moved

    def _rehome(self) -> None:
        """Route again the requests an interrupted removal withdrew and could not place."""
        for rid, s in sorted(self.orphans.items()):
            self._resubmit(rid, s)

    def _resubmit(self, rid: int, s: SchedRequest) -> None:
        """Route what ``s`` (withdrawn) has not emitted as a new request of router id ``rid``."""
        done = len(s.output)
        prompt = s.tokens()
        dest, reason, predicted = self.route(prompt, s.extra_key)
        forced = None if s.forced is None else torch.tensor(s.forced[done:], dtype=torch.int64)
        sched = self.replicas[dest]
        was_idle = sched.idle
        sid = sched.submit(
            prompt,
            s.max_new_tokens - done,
            forced,
            extra_key=s.extra_key,
            priority=s.priority,
            min_tokens=max(0, s.stop.min_tokens - done),
            stop_token_ids=sorted(s.stop.stop_token_ids),
            ignore_eos=s.stop.ignore_eos,
        )
        if was_idle and sched.clock < self.now:
            sched.clock = self.now
        sched.requests[sid].arrival_time = s.arrival_time
        self._moved.add(self.placement[rid])
        self._carried[rid] = self._carried.get(rid, []) + s.output
        del self.orphans[rid]
        self.placement[rid] = (dest, sid)
        self._rid_of[(dest, sid)] = rid
        self._reasons[reason] += 1
        self._predicted[rid] = predicted
        self._realized.pop(rid, None)

    def _drop_mirror(self, r: int) -> None:
        """Forget what the router knows of replica ``r``'s cache: its mirror, its events in
        flight, and those its source still holds."""
        self.mirrors = tuple(
            PrefixMirror(m.page_size) if i == r else m for i, m in enumerate(self.mirrors)
        )
        self._in_flight = [f for f in self._in_flight if f[2] != r]
        heapq.heapify(self._in_flight)

    def add_replica(self, scheduler: Scheduler) -> int:
        """Bring a removed replica back, or add a new one; returns its index. A removed one
        (which holds no request: they were moved) has its prefix cache forgotten first, so
        that its new mirror, built from its events alone, starts equal to it; a new one must be
        fresh, as the constructor's replicas (``ValueError`` otherwise, nothing changed)."""
        for r, s in enumerate(self.replicas):
            if s is scheduler:
                if self.healthy[r]:
                    raise ValueError(f"replica {r} is in this router already, and healthy")
                scheduler.reset_prefix_cache()
                mirror = PrefixMirror(scheduler.flow.page_size)
                mirror.apply(self._take_events[r]())  # ends with its reset: the mirror is empty
                self.mirrors = tuple(mirror if i == r else m for i, m in enumerate(self.mirrors))
                self.healthy[r] = True
                return r
        mirror, take = _fresh("the new replica", scheduler)
        for s in self.replicas:
            for what, mine, theirs in (
                ("flow", s.flow, scheduler.flow),
                ("manager", s.flow.manager, scheduler.flow.manager),
                ("allocator", s.flow.allocator, scheduler.flow.allocator),
            ):
                if mine is theirs:
                    raise ValueError(f"the new replica must have its own {what}; it shares one")
        self.replicas += (scheduler,)
        self.mirrors += (mirror,)
        self._take_events += (take,)
        self.healthy.append(True)
        return len(self.replicas) - 1

    def step(self) -> int:
        """One scheduler step of the busy replica furthest behind in time; its events are
        published (due ``event_delay_s`` after the step's end). Returns the replica stepped;
        ``RuntimeError`` when no replica has work, or the one stepped could make no progress.

        A step that raises changes nothing here (the scheduler's own promise); when the replica's
        event source raises after its step, the step stands and those events are taken with
        its next step (or by `sync`)."""
        busy = [i for i, s in enumerate(self.replicas) if not s.idle and self.healthy[i]]
        if not busy:
            raise RuntimeError("no replica has a request waiting or running")
        r = min(busy, key=lambda i: (self.replicas[i].clock, i))
        sched = self.replicas[r]
        rec = sched.step()
        for sid in rec.admitted:
            rid = self._rid_of[(r, sid)]
            flow_req = sched.requests[sid].flow_req
            if rid not in self._realized and flow_req is not None:
                self._realized[rid] = flow_req.reused_len
        events = self._take_events[r]()
        if events:
            due = sched.clock + self.event_delay_s
            heapq.heappush(self._in_flight, (due, next(self._seq), r, events))
        if rec.num_tokens == 0 and not sched.running:
            raise RuntimeError(f"replica {r}: {len(sched.waiting)} requests wait, none can start")
        return r

    def _deliver(self, until: float) -> list[tuple[Flight, Any, int]]:
        """Apply every batch of events due by ``until`` to its mirror; returns each batch with
        what `_undeliver` needs to take it back (the mirror's pages when it clears, its count)."""
        done: list[tuple[Flight, Any, int]] = []
        while self._in_flight and self._in_flight[0][0] <= until:
            flight = heapq.heappop(self._in_flight)
            mirror = self.mirrors[flight[2]]
            clears = any(isinstance(ev, AllCleared) for ev in flight[3])
            done.append((flight, mirror.pages() if clears else None, mirror.events_applied))
            mirror.apply(flight[3])
        return done

    def _undeliver(self, done: list[tuple[Flight, Any, int]]) -> None:
        """Take back what `_deliver` applied, newest first: the mirrors, their counts and the
        events in flight are as they were."""
        for flight, before, count in reversed(done):
            mirror = self.mirrors[flight[2]]
            mirror.apply(_inverse(flight[3], before))
            mirror.events_applied = count
            heapq.heappush(self._in_flight, flight)

    def sync(self) -> None:
        """Deliver every event published or not yet taken, whatever its delay (the mirrors then
        equal the replicas' caches). An event source that raises leaves the events taken so far
        delivered, and its own for the next `sync`."""
        self._deliver(math.inf)
        for r, take in enumerate(self._take_events):
            events = take()
            if self.healthy[r]:  # a removed replica's cache is forgotten when it comes back
                self.mirrors[r].apply(events)

    def run(self, jobs: Sequence[Job], arrivals: Sequence[float] | None = None) -> RouterReport:
        """Serve ``jobs`` (their outputs forced) arriving at ``arrivals`` (non-decreasing, from
        `now`; default: all now) until every replica is idle; returns the report.

        Every job is checked before the first is submitted, against every replica (any may be
        chosen): a prompt of at least one token whose longest sequence fits each replica's pool
        (what `Scheduler.submit` requires). A step or a submit that raises later stops the run
        where it is (what was submitted stays queued; `run` or `step` can go on)."""
        jobs = check_jobs(jobs)
        times = (
            [self.now] * len(jobs) if arrivals is None else as_list(arrivals, "arrivals", "times")
        )
        if len(times) != len(jobs):
            raise ValueError(f"arrivals holds {len(times)} times for {len(jobs)} jobs")
        last = self.now
        for i, t in enumerate(times):
            _number(t, f"arrivals[{i}]", last)
            last = t
        for i, job in enumerate(jobs):
            self._check_fits(i, len(job.prompt), max(1, len(job.output)))
        i = 0
        while True:
            busy = [s.clock for i, s in enumerate(self.replicas) if self.healthy[i] and not s.idle]
            if i < len(jobs) and (not busy or times[i] <= min(busy)):
                job = jobs[i]
                out = job.output if len(job.output) else torch.zeros(1, dtype=torch.int64)
                self.submit(job.prompt, len(out), out, at=times[i])
                i += 1
            elif busy:
                self.step()
            else:
                return self.report()

    def _check_fits(self, i: int, prompt_len: int, max_new_tokens: int) -> None:
        """``ValueError`` unless job ``i`` is one every healthy replica's `Scheduler.submit`
        takes: at least one prompt token, and ``prompt_len + max_new_tokens - 1`` tokens in its
        pool."""
        if prompt_len == 0:
            raise ValueError(f"jobs[{i}].prompt must hold at least one token")
        for r, ok in enumerate(self.healthy):
            if ok:
                self._check_fits_replica(r, f"jobs[{i}]", prompt_len, max_new_tokens)

    def _check_fits_replica(self, r: int, what: str, prompt_len: int, max_new: int) -> None:
        """``ValueError`` unless ``what`` (``prompt_len`` tokens, ``max_new`` to emit) fits
        replica ``r``'s pool (and, without chunked prefill, its step budget)."""
        s = self.replicas[r]
        ps, pages = s.flow.page_size, s.flow.allocator.num_pages
        need = -(-(prompt_len + max_new - 1) // ps)
        if need > pages:
            raise ValueError(
                f"{what} needs up to {need} pages ({prompt_len} prompt + {max_new} "
                f"new tokens, page size {ps}); replica {r}'s pool has {pages}: it can never fit"
            )
        if not s.chunked_prefill and prompt_len + max_new - 1 > s.token_budget:
            raise ValueError(f"{what} does not fit replica {r}'s step without chunked prefill")

    # ------------------------------------------------------------------ results
    def report(self) -> RouterReport:
        """The figures so far, over every replica (see `RouterReport`)."""
        reps = [s.report() for s in self.replicas]
        ttft = [
            s.first_token_time - s.arrival_time
            for sched in self.replicas
            for s in sched.done
            if s.status == "finished" and s.first_token_time is not None
        ]
        arrivals = [self.replicas[r].requests[sid].arrival_time for r, sid in self.placement]
        start = min(arrivals, default=0.0)
        return RouterReport(
            policy=self.policy,
            requests=sum(x.requests for x in reps),
            seconds=max((s.clock for s in self.replicas), default=0.0) - start,
            output_tokens=sum(x.output_tokens for x in reps),
            prompt_tokens=sum(x.prompt_tokens for x in reps),
            reused_tokens=sum(x.reused_tokens for x in reps),
            computed_tokens=sum(x.computed_tokens for x in reps),
            ttft_p50_s=percentile(ttft, 50),
            ttft_p99_s=percentile(ttft, 99),
            routed=tuple(sum(1 for r, _ in self.placement if r == i) for i in range(len(reps))),
            by_prefix=self._reasons["prefix"],
            by_load=self._reasons["load"],
            by_room=self._reasons["room"],
            predicted_tokens=sum(self._predicted[i] for i in self._realized),
            realized_tokens=sum(self._realized.values()),
            mean_events_in_flight=self._flight_sum / len(self.placement) if self.placement else 0.0,
            busy_seconds=sum(
                s.cost_model.step_seconds(rec.num_tokens)
                for s in self.replicas
                for rec in s.history
            ),
        )

    def check_integrity(self) -> None:
        """Every replica's own checks, and: each routed request is on exactly the replica the
        router sent it to, once, and no replica holds a request the router did not send (but
        those moved off it, withdrawn); a removed replica holds no live request and its mirror
        nothing."""
        for r, s in enumerate(self.replicas):
            s.check_integrity()
            mine = {sid for rr, sid in self.placement if rr == r}
            moved = {sid for rr, sid in self._moved if rr == r}
            if mine & moved or any(s.requests[sid].status != "withdrawn" for sid in moved):
                raise RuntimeError(f"replica {r}: a moved request is still placed there")
            for sid in mine:
                rid = self._rid_of[(r, sid)]
                if (s.requests[sid].status == "withdrawn") != (rid in self.orphans):
                    raise RuntimeError(f"request {rid} is withdrawn and no orphan, or the reverse")
            if not self.healthy[r] and self.mirrors[r].cached_tokens:
                raise RuntimeError(f"removed replica {r} still has a mirror")
            if set(s.requests) != mine | moved:
                raise RuntimeError(
                    f"replica {r} holds requests {sorted(set(s.requests) ^ mine)} the router "
                    "did not send there, or lost some it did"
                )
        if len(set(self.placement)) != len(self.placement):
            raise RuntimeError("a request was routed twice")
        for r, m in enumerate(self.mirrors):
            pool = self.replicas[r].flow.allocator.num_pages * m.page_size
            if m.cached_tokens > pool:
                raise RuntimeError(f"mirror {r} holds {m.cached_tokens} tokens, the pool {pool}")
