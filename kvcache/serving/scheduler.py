"""`Scheduler`: many requests at once on one `RequestFlow`: continuous batching over a paged pool.

Each :meth:`Scheduler.step` builds one batch, in this order (as vLLM's and SGLang's do):

1. **decode**: every running request whose prompt is computed runs its last sampled token
   (``flow.extend``). When the pool cannot give those tokens pages, a running request is
   **preempted**: its computed whole pages go to the cache (``flow.cache``), the rest is freed
   (``flow.abort``), and it goes back to the front of the queue, to be recomputed on
   readmission from whatever of it the cache still holds.
2. **chunked prefill**: running requests still prefilling get the next chunk of their prompt,
   within the step's token budget; the computed part is cached after every chunk, so another
   request can reuse a prefix that is still being computed.
3. **admission** (only in a step without preemption, as vLLM does): waiting requests, in policy
   order, start (``flow.begin``: match, lock, allocate) while the batch size, the token budget
   and the pool allow.

Victim policy. ``"newest"`` (default) preempts the request admitted last, as vLLM's scheduler
does with FCFS (``self.running.pop()``; with priorities, the lowest priority, latest arrival):
the oldest request is never the victim while others run, so it always progresses.
``"fewest_decoded"`` follows SGLang's ``retract_decode``: fewest output tokens first (ties: the
longest prompt), losing the least decode work. Both recompute on readmission; nothing is swapped.

Admission policy. ``"fcfs"``: arrival order, stop at the first request that does not fit (no
overtaking). ``"lpm"``: longest cached prefix first (SGLang's LPM), so requests that share a
prefix run while it is cached; like SGLang it falls back to FCFS when more than
``lpm_queue_limit`` (128) requests wait, as matching every one each step would cost too much.
A request that has waited ``starvation_bound`` steps goes first whatever the policy, and while it
does not fit nobody overtakes it, so no request waits for ever.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable

import torch

from .._validate import as_int, check_positive_int, check_token_ids
from ..managers.cache_events import check_extra_key
from .batch import Runner, SchedRequest, StepRecord, check_runner, checked_logits, next_token
from .cost_model import LLAMA3_8B_H100, CostModel, ServeReport, percentile
from .request_flow import RequestFlow

__all__ = ["Scheduler", "ADMISSION_POLICIES", "VICTIM_POLICIES"]

ADMISSION_POLICIES = ("fcfs", "lpm")
VICTIM_POLICIES = ("newest", "fewest_decoded")


class Scheduler:
    """Continuous batching over ``flow`` (any manager); see the module docstring for the policies.

    Args:
        flow: the request flow; the scheduler must be the only one starting requests on it.
        token_budget: the most tokens one step runs (prefill chunks + decode tokens), >= 1.
        max_batch: the most requests running at once, >= 1.
        chunk_size: the most prompt tokens one request runs in a step (default: the budget),
            so that a long prompt leaves room for others (vLLM's ``long_prefill_token_threshold``).
        policy: ``"fcfs"`` or ``"lpm"``; victim: ``"newest"`` or ``"fewest_decoded"``.
        starvation_bound: steps a request may wait before it goes first, >= 1.
        lpm_queue_limit: LPM orders the queue only while at most this many wait (SGLang: 128).
        runner: runs each batch (e.g. `model_runner`); ``None`` simulates (forced tokens only).
        cost_model: simulated seconds per step.
    """

    def __init__(
        self,
        flow: RequestFlow,
        *,
        token_budget: int = 512,
        max_batch: int = 64,
        chunk_size: int | None = None,
        policy: str = "fcfs",
        victim: str = "newest",
        starvation_bound: int = 64,
        lpm_queue_limit: int = 128,
        runner: Runner | None = None,
        cost_model: CostModel = LLAMA3_8B_H100,
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
        self.starvation_bound = check_positive_int(starvation_bound, "starvation_bound")
        self.lpm_queue_limit = check_positive_int(lpm_queue_limit, "lpm_queue_limit")
        if policy not in ADMISSION_POLICIES:
            raise ValueError(f"policy must be one of {ADMISSION_POLICIES}, got {policy!r}")
        if victim not in VICTIM_POLICIES:
            raise ValueError(f"victim must be one of {VICTIM_POLICIES}, got {victim!r}")
        if not isinstance(cost_model, CostModel):
            raise TypeError(f"cost_model must be a CostModel, got {type(cost_model).__name__}")
        self.flow, self.policy, self.victim = flow, policy, victim
        self.runner = check_runner(runner)
        self.cost_model = cost_model
        self.waiting: list[SchedRequest] = []
        self.running: list[SchedRequest] = []  # in admission order
        self.done: list[SchedRequest] = []
        self.requests: dict[int, SchedRequest] = {}
        self.history: list[StepRecord] = []
        self.clock = 0.0
        self.steps = 0
        self.prompt_tokens = self.reused_tokens = self.computed_tokens = 0
        self.recomputed_tokens = self.preemptions = self.peak_pages = 0
        self._sids = itertools.count()
        self._admissions = itertools.count()

    # ------------------------------------------------------------------ requests
    def submit(
        self,
        prompt: torch.Tensor,
        max_new_tokens: int,
        forced: torch.Tensor | None = None,
        *,
        extra_key: Hashable = None,
    ) -> int:
        """Queue a request; returns its id. ``forced``: tokens to emit instead of sampling.

        ``extra_key``: its namespace (tenant, adapter; any hashable, ``TypeError`` otherwise):
        it matches, and is cached, only among requests submitted with the same key, at every
        (re)admission and in LPM's ordering.

        Refused (``ValueError``) when its longest stored sequence, ``len(prompt) +
        max_new_tokens - 1`` tokens, needs more pages than the pool has: it could never run.
        """
        check_token_ids(prompt, "prompt")
        if len(prompt) == 0:
            raise ValueError("prompt must hold at least one token")
        check_positive_int(max_new_tokens, "max_new_tokens")
        check_extra_key(extra_key)
        if forced is not None:
            check_token_ids(forced, "forced")
            if len(forced) < max_new_tokens:
                raise ValueError(
                    f"forced holds {len(forced)} tokens, fewer than max_new_tokens={max_new_tokens}"
                )
        elif self.runner is None:
            raise ValueError("without a runner there are no logits to sample: pass forced tokens")
        ps, pages = self.flow.page_size, self.flow.allocator.num_pages
        need = -(-(len(prompt) + max_new_tokens - 1) // ps)
        if need > pages:
            raise ValueError(
                f"request needs up to {need} pages ({len(prompt)} prompt + {max_new_tokens} "
                f"new tokens, page size {ps}); the pool has {pages}: it can never fit"
            )
        sreq = SchedRequest(
            next(self._sids),
            prompt.to(torch.int64, copy=True),
            max_new_tokens,
            None if forced is None else forced.tolist(),
            self.steps,
            self.clock,
            enqueued_step=self.steps,
            extra_key=extra_key,
        )
        self.requests[sreq.sid] = sreq
        self.waiting.append(sreq)
        return sreq.sid

    def abort(self, sid: int) -> None:
        """Drop a waiting or running request (its pages are freed, nothing is cached)."""
        sreq = self.requests.get(as_int(sid, "sid"))
        if sreq is None or sreq.status not in ("waiting", "running"):
            raise RuntimeError(f"request {sid} is not waiting or running")
        if sreq.status == "running":
            self.flow.abort(sreq.req)
            self.running.remove(sreq)
            sreq.flow_req = None
        else:
            self.waiting.remove(sreq)
        sreq.status = "aborted"
        self.done.append(sreq)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    # ------------------------------------------------------------------ policies
    def _admission_order(self) -> list[SchedRequest]:
        """Waiting requests in the order admission tries them (starving ones first)."""
        starving = [
            s for s in self.waiting if self.steps - s.enqueued_step >= self.starvation_bound
        ]
        starving.sort(key=lambda s: s.enqueued_step)
        rest = [s for s in self.waiting if self.steps - s.enqueued_step < self.starvation_bound]
        if self.policy == "lpm" and len(self.waiting) <= self.lpm_queue_limit:
            # SGLang matches every waiting request too; matching only refreshes LRU and splits.
            match = self.flow.manager.match_prefix
            matched = {
                s.sid: (
                    match(s.tokens()[:-1])  # a manager written before namespaces takes no key
                    if s.extra_key is None
                    else match(s.tokens()[:-1], s.extra_key)
                )[0].cached_len
                for s in rest
            }
            rest.sort(key=lambda s: -matched[s.sid])  # stable: arrival order among ties
        return starving + rest

    def _pick_victim(self) -> SchedRequest:
        if self.victim == "newest":
            return max(self.running, key=lambda s: s.admitted_at)
        return min(self.running, key=lambda s: (len(s.output), -len(s.prompt), -s.admitted_at))

    def _requeue(self, sreq: SchedRequest) -> None:
        """Back to the front of the queue (vLLM prepends preempted requests)."""
        self.running.remove(sreq)
        sreq.flow_req, sreq.status, sreq.enqueued_step = None, "waiting", self.steps
        self.waiting.insert(0, sreq)

    def _preempt(self, sreq: SchedRequest) -> None:
        req = sreq.req
        if req.num_computed // self.flow.page_size * self.flow.page_size > req.tree_len:
            self.flow.cache(req)  # keep its computed pages in the cache for the readmission
        self.flow.abort(req)
        sreq.preemptions += 1
        self.preemptions += 1
        self._requeue(sreq)

    # ------------------------------------------------------------------ one step
    def step(self) -> StepRecord:
        """Build and run one batch (decode, chunked prefill, admission); see the module docstring.

        If running the batch raises, every request of the batch is returned to the waiting
        queue without caching what this step stored, no page leaks, and the error propagates.
        """
        ps, budget = self.flow.page_size, self.token_budget
        preempted: list[int] = []
        decoders = [s for s in self.running if s.req.num_computed == len(s.req)][:budget]
        while sum(len(s.req) % ps == 0 for s in decoders) > self.flow.available_pages():
            victim = self._pick_victim()
            self._preempt(victim)
            preempted.append(victim.sid)
            if victim in decoders:
                decoders.remove(victim)
        prefilling = [s for s in self.running if s.req.num_computed < len(s.req)]
        items: list[tuple[SchedRequest, int]] = []
        admitted: list[int] = []
        try:
            for s in decoders:
                self.flow.extend(s.req, torch.tensor([s.output[-1]], dtype=torch.int64))
                items.append((s, 1))
            budget -= len(decoders)
            for s in prefilling:
                if budget:
                    left = len(s.req) - s.req.num_computed
                    items.append((s, min(left, budget, self.chunk_size)))
                    budget -= items[-1][1]
            if not preempted:
                admitted = self._admit(items, budget)
            logits = self._execute(items)
        except BaseException:
            for s, _ in items:
                self.flow.abort(s.req)
                self._requeue(s)
            raise
        finished = self._advance(items, logits)
        return self._record(items, decoders, admitted, preempted, finished)

    def _admit(self, items: list[tuple[SchedRequest, int]], budget: int) -> list[int]:
        admitted: list[int] = []
        if budget == 0 or len(self.running) >= self.max_batch or not self.waiting:
            return admitted  # nothing can start: spare LPM its matches
        for s in self._admission_order():
            if budget == 0 or len(self.running) >= self.max_batch:
                break
            ids = s.tokens()
            try:
                req = self.flow.begin(ids, compute_last=True, extra_key=s.extra_key)
            except RuntimeError:
                break  # out of pages: nobody overtakes (FCFS, and the starvation bound)
            self.waiting.remove(s)
            s.max_wait = max(s.max_wait, self.steps - s.enqueued_step)
            s.flow_req, s.status, s.admitted_at = req, "running", next(self._admissions)
            self.running.append(s)
            self.prompt_tokens += len(ids)
            self.reused_tokens += req.reused_len
            items.append((s, min(len(req) - req.num_computed, budget, self.chunk_size)))
            budget -= items[-1][1]
            admitted.append(s.sid)
        return admitted

    def _execute(self, items: list[tuple[SchedRequest, int]]) -> torch.Tensor | None:
        runner = self.runner
        if not items or runner is None:
            return None
        # Checked inside `step`'s recovery: a bad answer leaves the batch requeued.
        return checked_logits(runner([(s.req, q) for s, q in items]), items)

    def _advance(
        self, items: list[tuple[SchedRequest, int]], logits: torch.Tensor | None
    ) -> list[int]:
        """Mark the tokens computed, cache prefill progress, sample, finish; returns finished sids."""
        ps = self.flow.page_size
        self.clock += self.cost_model.step_seconds(sum(q for _, q in items))
        finished: list[int] = []
        for row, (s, q) in enumerate(items):
            req = s.req
            start, end = req.num_computed, req.num_computed + q
            self.computed_tokens += q
            self.recomputed_tokens += max(0, min(end, s.high_water) - start)
            s.high_water = max(s.high_water, end)
            self.flow.mark_computed(req, end)
            if end < len(req):
                if end // ps * ps > req.tree_len:
                    self.flow.cache(req)  # others may reuse the prefix while it is computed
                continue
            s.output.append(next_token(s, logits, row))
            if s.first_token_time is None:
                s.first_token_time = self.clock
            if len(s.output) == s.max_new_tokens:
                self.flow.finish(req)
                self.running.remove(s)
                s.flow_req, s.status, s.finish_time = None, "finished", self.clock
                self.done.append(s)
                finished.append(s.sid)
        return finished

    def _record(
        self,
        items: list[tuple[SchedRequest, int]],
        decoders: list[SchedRequest],
        admitted: list[int],
        preempted: list[int],
        finished: list[int],
    ) -> StepRecord:
        flow = self.flow
        held = flow.allocator.num_pages - flow.available_pages()
        self.peak_pages = max(self.peak_pages, held)
        dec = {s.sid for s in decoders}
        rec = StepRecord(
            self.steps,
            self.clock,
            tuple((s.sid, q) for s, q in items if s.sid not in dec),
            tuple(s.sid for s in decoders),
            tuple(admitted),
            tuple(preempted),
            tuple(finished),
            len(self.waiting),
            held,
        )
        self.history.append(rec)
        self.steps += 1
        return rec

    # ------------------------------------------------------------------ runs
    def run(self, max_steps: int = 1_000_000) -> ServeReport:
        """Step until every request finished; ``RuntimeError`` after ``max_steps`` steps."""
        check_positive_int(max_steps, "max_steps")
        for _ in range(max_steps):
            if self.idle:
                return self.report()
            if self.step().num_tokens == 0 and not self.running:
                raise RuntimeError(
                    f"no progress: {len(self.waiting)} requests wait and none can start"
                )
        if not self.idle:
            raise RuntimeError(
                f"not done after {max_steps} steps: {len(self.waiting)} waiting, "
                f"{len(self.running)} running"
            )
        return self.report()

    def report(self) -> ServeReport:
        done = [s for s in self.done if s.status == "finished"]
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
        )

    def check_integrity(self) -> None:
        """The flow's page partition, and: no request both waiting and running, each once."""
        self.flow.check_integrity()
        waiting = [s.sid for s in self.waiting]
        running = [s.sid for s in self.running]
        if len(set(waiting)) != len(waiting) or len(set(running)) != len(running):
            raise RuntimeError("a request is listed twice in a queue")
        if set(waiting) & set(running):
            raise RuntimeError(f"requests both waiting and running: {set(waiting) & set(running)}")
        for s in self.running:
            if s.status != "running" or self.flow.running.get(s.req.rid) is not s.flow_req:
                raise RuntimeError(f"request {s.sid} runs in the scheduler but not in the flow")
        for s in self.waiting:
            if s.status != "waiting" or s.flow_req is not None:
                raise RuntimeError(f"waiting request {s.sid} still holds a flow request")
