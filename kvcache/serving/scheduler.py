"""`Scheduler`: many requests at once on one `RequestFlow`: continuous batching over a paged pool.

Each :meth:`Scheduler.step` builds one batch, in this order:

1. **decode**: every running request whose prompt is computed runs its last sampled token
   (``flow.extend``). When the pool cannot give those tokens pages, a running request is
   **preempted**: its computed whole pages go to the cache (``flow.cache``), the rest is freed
   (``flow.abort``), and it goes back to the front of the queue, to be recomputed on
   readmission from whatever of it the cache still holds.
2. **chunked prefill**: running requests still prefilling get the next chunk of their prompt,
   within the step's token budget; the computed part is cached after every chunk, so another
   request can reuse a prefix that is still being computed. With ``chunked_prefill=False`` a
   prompt runs whole in one step or waits (vLLM's ``enable_chunked_prefill=False``).
3. **admission** (only in a step without preemption, as vLLM does): waiting requests, in policy
   order, start (``flow.begin``: match, lock, allocate) while the batch size, the token budget
   and the pool allow.

This is vLLM V1's order (``vllm/v1/core/sched/scheduler.py``, ``schedule``: its RUNNING
requests first, then its WAITING ones, in one batch; checked at commit ``00024d31``). SGLang
(``scheduler.py``, ``get_next_batch_to_run``: "Run prefill first if possible") and mini-sglang
(``scheduler/scheduler.py``, ``_schedule_next_batch``, at ``7d9dfc21`` and ``20fcd7f3``) run a
prefill batch whenever one can be formed and decode only otherwise; SGLang mixes decode into a
prefill batch only with ``--enable-mixed-chunk``.

When a request's prefill completes (its last prompt token runs and it samples its first token),
its whole computed prompt is cached at once (``flow.cache``), as mini-sglang's
``cache_req(req, finished=False)`` after a prefill batch (``scheduler.py``, at ``20fcd7f3``), so
a request arriving with the same prompt while the first decodes reuses all of it.

A request stops when one of its `StopConditions` holds (end-of-sequence, a stop token,
``min_tokens``, ``ignore_eos``, ``max_new_tokens``); a stopped request is finished and cached
exactly as one that reached its length.

Victim policy. ``"newest"`` (default) preempts the request admitted last, as vLLM's FCFS
(``self.running.pop()``): the oldest request is never the victim while others run.
``"priority"`` (the default under the ``"priority"`` policy) preempts the lowest priority,
latest arrival, as vLLM's ``policy="priority"``. ``"fewest_decoded"`` follows SGLang's
``retract_decode``: fewest output tokens first (ties: the longest prompt). All recompute on
readmission; nothing is swapped.

Admission policy: one of `ADMISSION_POLICIES` (``"fcfs"``, ``"lpm"`` with optional in-batch
prefix caching, ``"dfs_weight"``, ``"priority"``; `kvcache.serving.admission` says what each
does and where it comes from); ordering only looks at the cache, it never moves a page between
tiers. FCFS stops at the first request that does not fit. A request that has waited
``starvation_bound`` steps goes first whatever the policy, and while it does not fit nobody
overtakes it: the bound stops overtaking, it does not bound the wait (a request still waits
for pages to free up).

Admission reserves no pages for the output a request will decode (as vLLM): decode pages are
found later, by preemption if need be. mini-sglang reserves the whole remaining output at
admission (``PrefillAdder``) and never preempts; SGLang reserves an estimate
(``new_token_ratio``) and retracts, without inserting a retracted request's KV into its tree;
ours caches a victim's computed pages, for its readmission.

`reset_prefix_cache` forgets the cache; with ``reset_running_requests=True`` it first preempts
every running request (freeing its pages, caching nothing), as vLLM's
``Scheduler.reset_prefix_cache`` does.

A request's state is kept once: its `SchedRequest.status`. ::

    waiting --admitted--> running --stopped--> finished
       ^                     |
       +---preempted, or-----+          waiting or running --abort--> aborted
           its step failed               blamed for a second failed step --> failed
                                         waiting or running --withdraw--> withdrawn

The scheduler's queues are the lanes of one structure, kept by status (``waiting`` in queue
order, ``running`` in admission order, ``done`` in the order they ended); one method,
``_move``, changes a status, and `Scheduler.check_integrity` proves that every request sits in
the lane its status names, once, and that each running one runs in the flow holding exactly its
prompt and output.

When a step fails. Anything a step calls may raise: the flow (and through it the manager, the
allocator, a block hash), the runner, the model. The error always propagates, and the scheduler
is left so that the next step works; the flow's calls are all or nothing (a call that raises
leaves its request as it was), and the scheduler changes its own state only after a flow call
has succeeded.

* While the batch is built and run (preemption, ``extend``, admission, the runner and its
  answer), the step is undone: each request of the batch goes back to the front of the queue,
  in the order it had, its flow request aborted (its pages freed: the K/V this step stored may
  be wrong; what was cached before stays cached). The clock and the counters do not move.
  Preemptions made before the failure stand.
* Once the runner has answered (``mark_computed``, ``cache``, ``finish``), the step stands and
  is recorded: the requests before the failing call advanced; the rest stay running, their new
  tokens not marked computed, and run them again next step. A request whose ``finish`` failed
  has all its output: the next step finishes it (cached if ``finish`` then works, else only
  freed).
* Blame. A failure is laid on the request whose flow call raised, or on every request of the
  batch when the runner did, with the point it was computing up to. A blamed request is
  *suspect* (``SchedRequest.failures > 0``): steps run it alone until it has computed past that
  point, so a failure meanwhile is its own; then its count clears. A request blamed more than
  ``max_retries`` times before it gets past ends as ``"failed"``, its error in
  ``SchedRequest.error``, and the others go on. ``KeyboardInterrupt`` and other errors that are
  not an ``Exception`` undo the step the same way but blame nobody.

So every request ends finished, aborted, failed or withdrawn, none is stuck, no request emits
more than ``max_new_tokens`` tokens, and no page is lost. What a runner can check it checks at `submit`:
a runner that declares ``vocab_size`` (`model_runner` does) has every prompt and forced token
checked against it there, so a request the model could not run never reaches a batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from .._validate import as_int, check_positive_int, check_size, token_ids
from ..managers.cache_events import check_extra_key
from .admission import (
    ADMISSION_POLICIES,
    CACHE_AWARE,
    cached_prefix_len,
    dfs_weight_order,
    in_batch_deprioritized,
)
from .cost_model import LLAMA3_8B_H100, CostModel, ServeReport, percentile
from .request_flow import Request, RequestFlow
from .runner import Runner, check_runner, checked_logits, next_token
from .sched_records import LANES, SchedRequest, StepRecord
from .stop import StopConditions

__all__ = ["Scheduler", "VICTIM_POLICIES"]

#: Which running request a `Scheduler` preempts when decode runs out of pages (module docstring).
VICTIM_POLICIES = ("newest", "fewest_decoded", "priority")


@dataclass
class _Batch:
    """The step being built: its items in run order, and what it did so far.

    ``current``: the request whose flow call runs now, the one blamed if it raises."""

    budget: int
    items: list[tuple[SchedRequest, int]] = field(default_factory=list)
    decoders: list[SchedRequest] = field(default_factory=list)
    admitted: list[SchedRequest] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    current: SchedRequest | None = None


# ---------------------------------------------------------------------------- the scheduler
class Scheduler:
    """Continuous batching over ``flow`` (any manager); see the module docstring for the policies
    and for what a failed step leaves.

    Args:
        flow: the request flow; the scheduler must be the only one starting requests on it.
        token_budget: the most tokens one step runs (prefill chunks + decode tokens), >= 1.
        max_batch: the most requests running at once, >= 1.
        chunk_size: the most prompt tokens one request runs in a step (default: the budget),
            so that a long prompt leaves room for others (vLLM's ``long_prefill_token_threshold``).
        chunked_prefill: split prompts into chunks (default); ``False`` runs each prompt whole
            in one step, so every request's longest sequence must fit the token budget.
        policy: one of `ADMISSION_POLICIES` (``"fcfs"``, ``"lpm"``, ``"dfs_weight"``,
            ``"priority"``); victim: one of `VICTIM_POLICIES` (default ``"priority"`` under
            the ``"priority"`` policy, ``"newest"`` otherwise).
        in_batch_prefix: with ``"lpm"``, SGLang's in-batch prefix caching with this threshold
            in tokens (SGLang's default: 32); ``None`` (default) turns it off.
        starvation_bound: steps a request may wait before it goes first, >= 1.
        lpm_queue_limit: LPM orders the queue only while at most this many wait (SGLang: 128).
        eos_token_id: the model's end-of-sequence token, which stops a request (``None``: none).
        runner: runs each batch (e.g. `model_runner`); ``None`` simulates (forced tokens only).
        cost_model: simulated seconds per step.
        max_retries: failed steps a blamed request is run again (alone) before it is failed, >= 0.
    """

    def __init__(
        self,
        flow: RequestFlow,
        *,
        token_budget: int = 512,
        max_batch: int = 64,
        chunk_size: int | None = None,
        chunked_prefill: bool = True,
        policy: str = "fcfs",
        victim: str | None = None,
        in_batch_prefix: int | None = None,
        starvation_bound: int = 64,
        lpm_queue_limit: int = 128,
        eos_token_id: int | None = None,
        runner: Runner | None = None,
        cost_model: CostModel = LLAMA3_8B_H100,
        max_retries: int = 1,
    ) -> None:
        if not isinstance(flow, RequestFlow):
            raise TypeError(f"flow must be a RequestFlow, got {type(flow).__name__}")
        self.token_budget = check_positive_int(token_budget, "token_budget")
        self.max_batch = check_positive_int(max_batch, "max_batch")
        self.chunk_size = (
            self.token_budget
            if chunk_size is None
            else check_positive_int(chunk_size, "chunk_size")
        )
        if not isinstance(chunked_prefill, bool):
            raise TypeError(f"chunked_prefill must be a bool, got {type(chunked_prefill).__name__}")
        self.starvation_bound = check_positive_int(starvation_bound, "starvation_bound")
        self.lpm_queue_limit = check_positive_int(lpm_queue_limit, "lpm_queue_limit")
        self.max_retries = check_size(max_retries, "max_retries")
        if policy not in ADMISSION_POLICIES:
            raise ValueError(f"policy must be one of {ADMISSION_POLICIES}, got {policy!r}")
        if victim is None:
            victim = "priority" if policy == "priority" else "newest"
        if victim not in VICTIM_POLICIES:
            raise ValueError(f"victim must be one of {VICTIM_POLICIES}, got {victim!r}")
        if in_batch_prefix is not None:
            in_batch_prefix = check_positive_int(in_batch_prefix, "in_batch_prefix")
            if policy != "lpm":
                raise ValueError(
                    f"in_batch_prefix works with the 'lpm' policy (as SGLang's), got {policy!r}"
                )
        self.eos_token_id = None if eos_token_id is None else check_size(eos_token_id, "eos")
        if not isinstance(cost_model, CostModel):
            raise TypeError(f"cost_model must be a CostModel, got {type(cost_model).__name__}")
        self.flow, self.policy, self.victim = flow, policy, victim
        self.chunked_prefill, self.in_batch_prefix = chunked_prefill, in_batch_prefix
        self.runner, self.vocab_size = check_runner(runner)
        eos = self.eos_token_id
        if self.vocab_size is not None and eos is not None and eos >= self.vocab_size:
            raise ValueError(
                f"eos_token_id must lie in [0, {self.vocab_size}), got {self.eos_token_id}"
            )
        self.cost_model = cost_model
        self.requests: dict[int, SchedRequest] = {}  # every request ever submitted, by sid
        self._lanes: dict[str, dict[int, SchedRequest]] = {lane: {} for lane in LANES.values()}
        self.history: list[StepRecord] = []
        self.clock = 0.0
        self.steps = 0
        self.prompt_tokens = self.reused_tokens = self.computed_tokens = 0
        self.recomputed_tokens = self.preemptions = self.peak_pages = 0
        self._sids = itertools.count()
        self._admissions = itertools.count()

    # ------------------------------------------------------------------ lanes
    @property
    def waiting(self) -> list[SchedRequest]:
        """The waiting requests in queue order (a new list)."""
        return list(self._lanes["waiting"].values())

    @property
    def running(self) -> list[SchedRequest]:
        """The running requests in admission order (a new list)."""
        return list(self._lanes["running"].values())

    @property
    def done(self) -> list[SchedRequest]:
        """Finished, aborted and failed requests, in the order they ended (a new list)."""
        return list(self._lanes["done"].values())

    @property
    def idle(self) -> bool:
        return not self._lanes["waiting"] and not self._lanes["running"]

    def _move(self, s: SchedRequest, status: str) -> None:
        """The one place a status changes: ``s`` leaves its lane for the end of ``status``'s."""
        del self._lanes[LANES[s.status]][s.sid]
        s.status = status
        self._lanes[LANES[status]][s.sid] = s

    def _stood(self, s: SchedRequest) -> bool:
        """After a flow call on ``s`` raised: whether the call stood. A failing `finish`,
        `abort` or `cache` completes once the manager has changed and then raises (the flow's
        rule); a failure before that changes nothing and the request still runs. Read off the
        request itself (the flow marks it ``finished``), not asked of the flow: recovery makes
        no call that could fail in turn."""
        return s.flow_req is None or s.flow_req.finished

    def _requeue(self, reqs: list[SchedRequest]) -> None:
        """``reqs`` (no longer running in the flow) to the front of the queue, in their order
        (vLLM prepends preempted requests)."""
        for s in reqs:
            s.flow_req, s.enqueued_step = None, self.steps
            self._move(s, "waiting")
        front = {s.sid: s for s in reqs}
        rest = self._lanes["waiting"]
        self._lanes["waiting"] = front | {sid: s for sid, s in rest.items() if sid not in front}

    # ------------------------------------------------------------------ requests
    def _checked_ids(self, ids: object, name: str, limit: int | None = None) -> np.ndarray:
        """``ids`` as NumPy, checked to be token ids the runner could run: ``>= 0``, and below
        its ``vocab_size`` where it declares one (first ``limit`` only, if given)."""
        arr = token_ids(ids, name)
        part = arr if limit is None else arr[:limit]
        if part.shape[0]:
            lo, hi = int(part.min()), int(part.max())
            if lo < 0 or (self.vocab_size is not None and hi >= self.vocab_size):
                span = "[0, inf)" if self.vocab_size is None else f"[0, {self.vocab_size})"
                raise ValueError(
                    f"{name} must lie in {span} (the runner's vocabulary), got [{lo}, {hi}]"
                )
        return arr

    def submit(
        self,
        prompt: torch.Tensor,
        max_new_tokens: int,
        forced: torch.Tensor | None = None,
        *,
        extra_key: Hashable = None,
        priority: int = 0,
        min_tokens: int = 0,
        stop_token_ids: Iterable[int] = (),
        ignore_eos: bool = False,
    ) -> int:
        """Queue a request; returns its id. ``forced``: tokens to emit instead of sampling.

        ``extra_key``: its namespace (tenant, adapter; any hashable, ``TypeError`` otherwise):
        it matches, and is cached, only among requests submitted with the same key, at every
        (re)admission and in LPM's ordering. ``priority``: an integer, smaller first under the
        ``"priority"`` policy. ``min_tokens``, ``stop_token_ids``, ``ignore_eos`` and
        ``max_new_tokens``: when it stops, with the scheduler's ``eos_token_id`` (see
        `StopConditions`).

        Refused (``ValueError``) when its longest stored sequence, ``len(prompt) +
        max_new_tokens - 1`` tokens, needs more pages than the pool has, or (without chunked
        prefill) more tokens than the step budget: it could never run; and when a token id (of
        the prompt, of the forced tokens it emits, or a stop token) is negative or, for a
        runner that declares ``vocab_size``, not below it.
        """
        ids = self._checked_ids(prompt, "prompt")
        if len(ids) == 0:
            raise ValueError("prompt must hold at least one token")
        stop = StopConditions.make(
            max_new_tokens,
            min_tokens=min_tokens,
            stop_token_ids=stop_token_ids,
            eos_token_id=self.eos_token_id,
            ignore_eos=ignore_eos,
        )
        stops = sorted(stop.stop_token_ids)
        self._checked_ids(torch.tensor(stops, dtype=torch.int64), "stop_token_ids")
        check_extra_key(extra_key)
        rank = as_int(priority, "priority")
        n = stop.max_new_tokens
        if forced is not None:
            forced_ids = self._checked_ids(forced, "forced", limit=n)
            if len(forced_ids) < n:
                raise ValueError(f"forced holds {len(forced_ids)} tokens, fewer than {n=}")
        elif self.runner is None:
            raise ValueError("without a runner there are no logits to sample: pass forced tokens")
        ps, pages = self.flow.page_size, self.flow.allocator.num_pages
        need = -(-(len(ids) + n - 1) // ps)
        if need > pages:
            raise ValueError(
                f"request needs up to {need} pages ({len(ids)} prompt + {n} "
                f"new tokens, page size {ps}); the pool has {pages}: it can never fit"
            )
        if not self.chunked_prefill and len(ids) + n - 1 > self.token_budget:
            raise ValueError(
                f"without chunked prefill a request must fit one step: {len(ids)} prompt + {n} "
                f"new tokens - 1 > token_budget={self.token_budget}"
            )
        sreq = SchedRequest(
            next(self._sids),
            torch.from_numpy(ids.copy()),
            stop,
            None if forced is None else forced_ids.tolist(),
            self.steps,
            self.clock,
            enqueued_step=self.steps,
            extra_key=extra_key,
            priority=rank,
        )
        self.requests[sreq.sid] = sreq
        self._lanes["waiting"][sreq.sid] = sreq
        return sreq.sid

    def abort(self, sid: int) -> None:
        """Drop a waiting or running request (its pages are freed, nothing is cached)."""
        s = self.requests.get(as_int(sid, "sid"))
        if s is None or s.status not in ("waiting", "running"):
            raise RuntimeError(f"request {sid} is not waiting or running")
        if s.status == "running":
            try:
                self.flow.abort(s.req)
            except BaseException:
                if not s.req.finished:
                    raise  # nothing changed: the request still runs
                self._move(s, "aborted")  # the abort stood, then raised
                s.flow_req = None
                raise
            s.flow_req = None
        self._move(s, "aborted")

    def withdraw(self, sid: int) -> SchedRequest:
        """Take a waiting or running request out, to be served elsewhere: its pages are freed,
        nothing is cached, and it ends ``"withdrawn"`` with the output it has so far (a router
        resubmits the rest on another replica). A running request that has already stopped
        (its ``finish`` failed) ends ``"finished"`` instead, uncached. Returns its record.
        A failing flow call changes nothing (the request still runs), or stood and then
        raised (it is withdrawn, and the error propagates)."""
        s = self.requests.get(as_int(sid, "sid"))
        if s is None or s.status not in ("waiting", "running"):
            raise RuntimeError(f"request {sid} is not waiting or running")
        if s.status == "waiting":
            self._move(s, "withdrawn")
            return s
        try:
            self.flow.abort(s.req)
        except BaseException:
            if not self._stood(s):
                raise  # nothing changed: the request still runs
            self._end_taken(s, "withdrawn")
            raise
        self._end_taken(s, "withdrawn")
        return s

    def _end_taken(self, s: SchedRequest, status: str) -> None:
        """``s``, whose flow request was just aborted, ends as ``status`` (``"finished"`` if it
        had stopped already: its output is whole)."""
        s.flow_req = None
        if s.complete:
            s.finish_time = self.clock
            self._move(s, "finished")
        else:
            self._move(s, status)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> int:
        """Forget every cached prefix (`RequestFlow.reset_prefix_cache`); returns the number of
        cached tokens forgotten. Refused (``RuntimeError``) while requests run, unless
        ``reset_running_requests``: then every running request is preempted first, newest
        first, its pages freed and nothing cached, and goes back to the front of the queue in
        admission order (vLLM's ``reset_prefix_cache(reset_running_requests=True)``). A
        failure part way leaves the preemptions made so far standing and the cache as it
        was."""
        if not isinstance(reset_running_requests, bool):
            raise TypeError(
                f"reset_running_requests must be a bool, got {type(reset_running_requests).__name__}"
            )
        if reset_running_requests:
            running = self._lanes["running"].values()
            for s in sorted(running, key=lambda s: s.admitted_at, reverse=True):
                try:
                    self.flow.abort(s.req)
                except BaseException:
                    if self._stood(s):
                        self._preempted_by_reset(s)
                    raise
                self._preempted_by_reset(s)
        return self.flow.reset_prefix_cache()

    def _preempted_by_reset(self, s: SchedRequest) -> None:
        if s.complete:  # it had stopped: its output is whole, it ends (uncached)
            self._end_taken(s, "finished")
            return
        s.preemptions += 1
        self.preemptions += 1
        self._requeue([s])

    # ------------------------------------------------------------------ policies
    def _cached_len(self, s: SchedRequest) -> int:
        """How much of what ``s`` would run is cached now (its last token is always run),
        found by looking only (`cached_prefix_len`: no page moves between tiers)."""
        return cached_prefix_len(self.flow.manager, s.tokens()[:-1], s.extra_key)

    def _admission_order(self, batch: _Batch) -> list[SchedRequest]:
        """Waiting requests in the order admission tries them (starving ones first); see
        `kvcache.serving.admission` for the policies."""
        waiting = list(self._lanes["waiting"].values())
        bound, now = self.starvation_bound, self.steps
        starving = sorted(
            (s for s in waiting if now - s.enqueued_step >= bound), key=lambda s: s.enqueued_step
        )
        rest = [s for s in waiting if now - s.enqueued_step < bound]
        policy = self.policy
        if policy == "priority":
            rest.sort(key=lambda s: (s.priority, s.sid))  # sid: arrival order
        elif policy in CACHE_AWARE and (policy != "lpm" or len(waiting) <= self.lpm_queue_limit):
            matched = {}
            for s in rest:  # SGLang matches every waiting request too
                batch.current = s
                matched[s.sid] = self._cached_len(s)
            batch.current = None
            keys = [s.extra_key for s in rest]
            arrays = [s.tokens().numpy() for s in rest]
            if policy == "dfs_weight":
                prefixes = [a[: matched[s.sid]] for a, s in zip(arrays, rest, strict=True)]
                return starving + [rest[i] for i in dfs_weight_order(prefixes, keys)]
            held: set[int] = set()
            if self.in_batch_prefix is not None:
                cached = [matched[s.sid] for s in rest]
                found = in_batch_deprioritized(arrays, cached, keys, self.in_batch_prefix)
                held = {rest[i].sid for i in found}
            # stable: arrival order among ties; the held ones last, in queue order
            rest.sort(key=lambda s: (1, 0) if s.sid in held else (0, -matched[s.sid]))
        return starving + rest

    def _pick_victim(self) -> SchedRequest:
        running = self._lanes["running"].values()
        if self.victim == "newest":
            return max(running, key=lambda s: s.admitted_at)
        if self.victim == "priority":  # vLLM: the lowest priority, latest arrival
            return max(running, key=lambda s: (s.priority, s.sid))
        return min(running, key=lambda s: (len(s.output), -len(s.prompt), -s.admitted_at))

    def _suspect(self) -> SchedRequest | None:
        """The request the next step runs alone: the first blamed one, running or waiting."""
        for lane in ("running", "waiting"):
            for s in self._lanes[lane].values():
                if s.failures:
                    return s
        return None

    # ------------------------------------------------------------------ one step
    def step(self) -> StepRecord:
        """Build and run one batch (decode, chunked prefill, admission); see the module docstring.

        If anything it calls raises, the error propagates and the scheduler is left ready for
        the next step (see "When a step fails" in the module docstring): a failure while the
        batch is built or run returns every request of the batch to the front of the queue,
        in order, without caching what this step stored; no page leaks.
        """
        batch = _Batch(self.token_budget)
        self._retire(batch)
        try:
            self._build(batch)
            logits = self._execute(batch.items)
        except BaseException as e:
            self._undo(batch, e)
            raise
        return self._commit(batch, logits)

    def _retire(self, batch: _Batch) -> None:
        """End the requests left complete by a step whose ``finish`` failed: finish them again,
        or, if that fails too, free them uncached (their output is whole either way)."""
        for s in [s for s in self._lanes["running"].values() if s.complete]:
            try:
                self.flow.finish(s.req)
            except Exception as e:
                s.error = e
                if not self._stood(s):
                    try:
                        self.flow.abort(s.req)
                    except Exception:
                        if not self._stood(s):
                            continue  # still running as it was: the next step tries again
            self._end_finished(batch, s)

    def _build(self, batch: _Batch) -> None:
        """Preempt, extend the decoders, give the prefills their chunks and admit: the batch.

        A suspect runs alone: a waiting one is admitted into an empty batch if it fits (else
        the running requests run without it, and nobody is admitted past it); a running one
        is the whole batch."""
        suspect = self._suspect()
        running = self._lanes["running"]
        if suspect is not None and suspect.status == "waiting":
            if len(running) < self.max_batch and self._admit_one(batch, suspect):
                return
            active = list(running.values())
        else:
            active = list(running.values()) if suspect is None else [suspect]
        prefilling = self._make_room(batch, active)
        # One tensor for every decoder's token, each extend taking its row (a view).
        tokens = torch.tensor([s.output[-1] for s in batch.decoders], dtype=torch.int64)
        for s, token in zip(batch.decoders, tokens.view(-1, 1), strict=True):
            batch.current = s
            self.flow.extend(s.req, token)
            batch.items.append((s, 1))
        batch.current = None
        batch.budget -= len(batch.decoders)
        blocked = False  # a prompt that must run whole and does not fit now: nobody overtakes
        for s in prefilling:
            q = self._chunk(s.req, batch.budget)
            if q == 0:
                blocked = True
                break
            batch.items.append((s, q))
            batch.budget -= q
        if suspect is None and not batch.preempted and not blocked:
            self._admit(batch)

    def _chunk(self, req: Request, budget: int) -> int:
        """The prompt tokens ``req`` runs this step with ``budget`` tokens left: a chunk of at
        most ``chunk_size``, or, without chunked prefill, all the rest or nothing."""
        rest = len(req) - req.num_computed
        if self.chunked_prefill:
            return min(rest, budget, self.chunk_size)
        return rest if rest <= budget else 0

    def _make_room(self, batch: _Batch, active: list[SchedRequest]) -> list[SchedRequest]:
        """Choose the decoders of ``active`` and preempt until the pool has their pages;
        returns the requests of ``active`` still prefilling."""
        ps = self.flow.page_size
        decoders: list[SchedRequest] = []
        prefilling: list[SchedRequest] = []
        for s in active:
            req = s.req
            (decoders if req.num_computed == len(req) else prefilling).append(s)
        del decoders[batch.budget :]  # past the budget: they wait for the next step
        need = sum(len(s.req) % ps == 0 for s in decoders)  # a full last page: a new one
        while need > self.flow.available_pages():
            victim = self._pick_victim()
            full = len(victim.req) % ps == 0
            batch.current = victim
            self._preempt(victim)
            batch.current = None
            batch.preempted.append(victim.sid)
            if victim in decoders:
                decoders.remove(victim)
                need -= full
        batch.decoders = decoders
        return [s for s in prefilling if s.status == "running"]  # less any preempted

    def _preempt(self, s: SchedRequest) -> None:
        req = s.req
        if req.num_computed // self.flow.page_size * self.flow.page_size > req.tree_len:
            self.flow.cache(req)  # keep its computed pages in the cache for the readmission
        self.flow.abort(req)
        s.preemptions += 1
        self.preemptions += 1
        self._requeue([s])

    def _admit(self, batch: _Batch) -> None:
        running = self._lanes["running"]
        if batch.budget == 0 or len(running) >= self.max_batch or not self._lanes["waiting"]:
            return  # nothing can start: spare LPM its matches
        for s in self._admission_order(batch):
            if batch.budget == 0 or len(running) >= self.max_batch:
                break
            if not self._admit_one(batch, s):
                break  # out of pages: nobody overtakes (FCFS, and the starvation bound)

    def _admit_one(self, batch: _Batch, s: SchedRequest) -> bool:
        """Start ``s`` (``flow.begin``) and give it its first chunk; ``False`` if the pool
        cannot hold it now (nothing changed)."""
        ids = s.tokens()
        batch.current = s
        if not self.chunked_prefill and len(ids) - self._cached_len(s) > batch.budget:
            batch.current = None
            return False  # its prompt cannot run whole this step: it waits (and starts nothing)
        try:
            req = self.flow.begin(ids, compute_last=True, extra_key=s.extra_key)
        except RuntimeError:
            # Out of pages, unless the pool could hold every token: then it is a failure.
            if self.flow.available_pages() * self.flow.page_size >= len(ids):
                raise
            batch.current = None
            return False
        batch.current = None
        s.flow_req, s.admitted_at = req, next(self._admissions)
        self._move(s, "running")
        batch.admitted.append(s)
        q = self._chunk(req, batch.budget)  # 0: a look that promised more than begin found
        if q:
            batch.items.append((s, q))
            batch.budget -= q
        return True

    def _execute(self, items: list[tuple[SchedRequest, int]]) -> torch.Tensor | None:
        runner = self.runner
        if not items or runner is None:
            return None
        # Checked inside `step`'s recovery: a bad answer leaves the batch requeued.
        return checked_logits(runner([(s.req, q) for s, q in items]), items)

    # ------------------------------------------------------------------ after a failure
    def _undo(self, batch: _Batch, error: BaseException) -> None:
        """A build or run that raised: the batch back to the front of the queue, in its order,
        and the blame laid (``Exception`` only)."""
        if batch.current is not None:  # its own flow call raised, for all it holds
            blamed = [(batch.current, len(batch.current.tokens()))]
        else:
            blamed = [(s, s.req.num_computed + q) for s, q in batch.items]
        try:
            for s, _ in batch.items:
                if not self._stood(s):  # a preemption may have ended it already
                    try:
                        self.flow.abort(s.req)
                    except Exception:
                        if not self._stood(s):
                            continue  # it still runs in the flow as it was: so it does here
        finally:  # even if an abort is interrupted: those no longer in the flow are requeued
            # (a victim whose preemption was interrupted after its abort stood, too)
            order = [s for s, _ in batch.items] + list(self._lanes["running"].values())
            gone = {s.sid: s for s in order if s.status == "running" and self._stood(s)}
            self._requeue(list(gone.values()))
        for s in batch.admitted:
            if s.status == "running":  # admitted, and could not be taken back
                self._count_admission(s)
        if isinstance(error, Exception):
            for s, point in blamed:
                self._blame(s, error, point)

    def _blame(self, s: SchedRequest, error: Exception, point: int) -> None:
        """Lay a failed step on ``s``, which was computing up to ``point``: suspect, or failed
        past ``max_retries``. A complete request is only noted: the next step finishes it."""
        s.error = error
        if s.status not in ("waiting", "running") or s.complete:
            return
        s.failures += 1
        s.fail_point = max(s.fail_point, point) if s.failures > 1 else point
        if s.failures <= self.max_retries:
            return
        if s.status == "running":
            try:
                self.flow.abort(s.req)
            except Exception:
                if not self._stood(s):
                    return  # still running as it was: run alone again, blamed again if it fails
            s.flow_req = None
        self._move(s, "failed")

    # ------------------------------------------------------------------ after the runner
    def _count_admission(self, s: SchedRequest) -> None:
        self.prompt_tokens += len(s.req)
        self.reused_tokens += s.req.reused_len
        s.max_wait = max(s.max_wait, self.steps - s.enqueued_step)

    def _commit(self, batch: _Batch, logits: torch.Tensor | None) -> StepRecord:
        """The runner has answered: the step counts; advance every item, then record it."""
        self.clock += self.cost_model.step_seconds(sum(q for _, q in batch.items))
        for s in batch.admitted:
            self._count_admission(s)
        end = 0
        decoding = {s.sid for s in batch.decoders}
        try:
            for row, (s, q) in enumerate(batch.items):
                batch.current, end = s, s.req.num_computed + q
                self._advance(batch, s, q, logits, row, s.sid not in decoding)
                if end >= s.fail_point:
                    s.failures = 0  # past where it failed: no longer suspect
        except BaseException as e:
            if isinstance(e, Exception) and batch.current is not None:
                self._blame(batch.current, e, end)
            self._record(batch)  # it ran: recorded, then the error goes on
            raise
        return self._record(batch)

    def _advance(
        self,
        batch: _Batch,
        s: SchedRequest,
        q: int,
        logits: torch.Tensor | None,
        row: int,
        prefill: bool,
    ) -> None:
        """Mark ``s``'s ``q`` tokens computed; cache prefill progress, or emit and maybe finish.

        The token is chosen before anything changes, so that a request is never left computed
        without the token its computation yields. A prefill (a chunk, or the prompt's end)
        caches what it computed, so that others reuse it at once: after a chunk, and when the
        prompt completes and the request goes on decoding (mini-sglang's
        ``cache_req(req, finished=False)``); that cache comes after the token is emitted, so a
        cache that raises leaves the request decoding, consistent."""
        req = s.req
        start, end = req.num_computed, req.num_computed + q
        token = next_token(s, logits, row) if end == len(req) else None
        self.flow.mark_computed(req, end)
        self.computed_tokens += q
        self.recomputed_tokens += max(0, min(end, s.high_water) - start)
        s.high_water = max(s.high_water, end)
        ps = self.flow.page_size
        if token is None:
            if end // ps * ps > req.tree_len:
                self.flow.cache(req)  # others may reuse the prefix while it is computed
            return
        s.output.append(token)
        s.finish_reason = s.stop.reason_at(len(s.output), token)
        if s.first_token_time is None:
            s.first_token_time = self.clock
        if not s.complete:
            if prefill and end // ps * ps > req.tree_len:
                self.flow.cache(req)  # the whole computed prompt, while it decodes
            return
        try:
            self.flow.finish(req)
        except BaseException:
            if self._stood(s):
                self._end_finished(batch, s)  # it finished, then raised
            raise
        self._end_finished(batch, s)

    def _end_finished(self, batch: _Batch, s: SchedRequest) -> None:
        s.flow_req, s.finish_time = None, self.clock
        self._move(s, "finished")
        batch.finished.append(s.sid)

    def _record(self, batch: _Batch) -> StepRecord:
        flow = self.flow
        held = flow.allocator.num_pages - flow.available_pages()
        dec = {s.sid for s in batch.decoders}
        rec = StepRecord(
            self.steps,
            self.clock,
            tuple((s.sid, q) for s, q in batch.items if s.sid not in dec),
            tuple(s.sid for s in batch.decoders),
            tuple(s.sid for s in batch.admitted),
            tuple(batch.preempted),
            tuple(batch.finished),
            len(self._lanes["waiting"]),
            held,
        )
        self.peak_pages = max(self.peak_pages, held)
        self.history.append(rec)
        self.steps += 1
        return rec

    # ------------------------------------------------------------------ runs
    def run(self, max_steps: int = 1_000_000) -> ServeReport:
        """Step until every request has ended; ``RuntimeError`` after ``max_steps`` steps, or
        when a step changes nothing while requests wait. A step's error propagates (see the
        module docstring); calling `run` again goes on from there."""
        check_positive_int(max_steps, "max_steps")
        for _ in range(max_steps):
            if self.idle:
                return self.report()
            rec = self.step()
            stalled = not (rec.num_tokens or rec.preempted or rec.finished)
            if stalled and not self._lanes["running"] and self._lanes["waiting"]:
                raise RuntimeError(
                    f"no progress: {len(self._lanes['waiting'])} requests wait and none can start"
                )
        if not self.idle:
            raise RuntimeError(
                f"not done after {max_steps} steps: {len(self._lanes['waiting'])} waiting, "
                f"{len(self._lanes['running'])} running"
            )
        return self.report()

    def report(self) -> ServeReport:
        ended = self._lanes["done"].values()
        done = [s for s in ended if s.status == "finished"]
        ttft = [s.first_token_time - s.arrival_time for s in done if s.first_token_time is not None]
        waits = [s.max_wait for s in self.requests.values()]
        return ServeReport(
            requests=len(done),
            steps=self.steps,
            seconds=self.clock,
            output_tokens=sum(len(s.output) for s in done),
            prompt_tokens=self.prompt_tokens,
            reused_tokens=self.reused_tokens,
            computed_tokens=self.computed_tokens,
            recomputed_tokens=self.recomputed_tokens,
            preemptions=self.preemptions,
            peak_pages=self.peak_pages,
            ttft_p50_s=percentile(ttft, 50),
            ttft_p99_s=percentile(ttft, 99),
            max_wait_steps=max(waits, default=0),
            failed=sum(1 for s in ended if s.status == "failed"),
        )

    # ------------------------------------------------------------------ integrity
    def check_integrity(self) -> None:
        """The flow's page partition, and the scheduler's state kept once (``RuntimeError``):

        every request sits in the lane its status names, once; a waiting or ended request
        holds no flow request; each running one runs in the flow holding exactly its prompt
        and output (``prompt + output[:-1]`` computed, the last token next to run, or
        ``prompt + output`` with something still to compute); nothing runs in the flow that the
        scheduler did not start; no output goes on past the token that stops it, and a
        request has stopped exactly when its ``finish_reason`` says so (every finished one
        has); at most ``max_batch`` run."""
        self.flow.check_integrity()
        placed = 0
        for lane, reqs in self._lanes.items():
            for sid, s in reqs.items():
                if self.requests.get(sid) is not s or LANES.get(s.status) != lane:
                    raise RuntimeError(f"request {sid} ({s.status}) is in the {lane} lane")
            placed += len(reqs)
        if placed != len(self.requests):
            raise RuntimeError(f"{len(self.requests) - placed} requests are in no lane")
        rids = set()
        for s in self.requests.values():
            stops = s.stop.first_stop(s.output)
            if stops not in (None, len(s.output)):
                raise RuntimeError(f"request {s.sid} emitted {len(s.output)} tokens past its stop")
            if (stops is not None) != s.complete or s.finish_reason != s.stop.reason(s.output):
                raise RuntimeError(f"request {s.sid}: finish_reason {s.finish_reason!r} is wrong")
            if s.complete != (s.status == "finished") and s.status not in ("running", "aborted"):
                raise RuntimeError(f"request {s.sid} is {s.status} with {s.finish_reason=}")
            if s.status != "running":
                if s.flow_req is not None:
                    raise RuntimeError(f"{s.status} request {s.sid} still holds a flow request")
                continue
            req = s.flow_req
            if req is None or not self.flow.is_running(req):
                raise RuntimeError(f"request {s.sid} runs in the scheduler but not in the flow")
            tokens, n = s.tokens(), len(req)
            pending = bool(s.output) and n == len(tokens) - 1 and req.num_computed == n
            if not (pending or (n == len(tokens) and req.num_computed < n)):
                raise RuntimeError(
                    f"request {s.sid}: its flow request holds {n} tokens ({req.num_computed} "
                    f"computed) for {len(s.prompt)} prompt + {len(s.output)} output tokens"
                )
            if not torch.equal(req.input_ids, tokens[:n]):
                raise RuntimeError(f"request {s.sid}: its flow request holds other tokens")
            rids.add(req.rid)
        if set(self.flow.running) != rids:
            raise RuntimeError("the flow runs requests this scheduler did not start")
        if len(self._lanes["running"]) > self.max_batch:
            raise RuntimeError(f"{len(self._lanes['running'])} requests run, over max_batch")
