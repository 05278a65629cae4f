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

A request's state is kept once: its `SchedRequest.status`. ::

    waiting --admitted--> running --last token--> finished
       ^                     |
       +---preempted, or-----+          waiting or running --abort--> aborted
           its step failed               blamed for a second failed step --> failed

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

So every request ends finished, aborted or failed, none is stuck, no request emits more than
``max_new_tokens`` tokens, and no page is lost. What a runner can check it checks at `submit`:
a runner that declares ``vocab_size`` (`model_runner` does) has every prompt and forced token
checked against it there, so a request the model could not run never reaches a batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .._validate import as_int, check_positive_int, check_size, token_ids
from ..managers.cache_events import check_extra_key
from .cost_model import LLAMA3_8B_H100, CostModel, ServeReport, percentile
from .engine import Engine
from .request_flow import Request, RequestFlow

__all__ = [
    "Scheduler",
    "SchedRequest",
    "StepRecord",
    "Runner",
    "ModelRunner",
    "model_runner",
    "ADMISSION_POLICIES",
    "VICTIM_POLICIES",
    "LANES",
]

ADMISSION_POLICIES = ("fcfs", "lpm")
VICTIM_POLICIES = ("newest", "fewest_decoded")

#: Every status a request can have, and the scheduler's lane that holds a request in it.
LANES = {
    "waiting": "waiting",
    "running": "running",
    "finished": "done",
    "aborted": "done",
    "failed": "done",
}

#: Runs a batch: ``(request, q_len)`` items, each running ``input_ids[num_computed:+q_len]``;
#: returns logits ``(B, vocab)`` of each item's last token run, or ``None`` (no model). A runner
#: may declare ``vocab_size`` (an int): `Scheduler.submit` then refuses token ids outside it.
Runner = Callable[[Sequence[tuple[Request, int]]], torch.Tensor | None]


# ---------------------------------------------------------------------------- the records
@dataclass(eq=False)  # identity: a lane holds each request once
class SchedRequest:
    """A request as the scheduler sees it; ``status`` (see `LANES`) is where it is.

    ``output`` holds the tokens emitted so far; the flow's request (``flow_req``, while
    running) holds ``prompt + output[:-1]`` once decoding, the last emitted token being the
    next one to run. ``extra_key``: the namespace it matches and is cached in. ``failures``:
    failed steps it was blamed for since it last computed past ``fail_point`` (the length it
    was computing up to when last blamed); ``error``: the last error a step met on it (kept
    once it has ended, e.g. the one that made it ``"failed"``).
    """

    sid: int
    prompt: torch.Tensor
    max_new_tokens: int
    forced: list[int] | None
    arrival_step: int
    arrival_time: float
    status: str = "waiting"
    output: list[int] = field(default_factory=list)
    flow_req: Request | None = None
    enqueued_step: int = 0
    admitted_at: int = -1
    preemptions: int = 0
    high_water: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    max_wait: int = 0
    extra_key: Hashable = None
    failures: int = 0
    fail_point: int = 0
    error: BaseException | None = None

    @property
    def req(self) -> Request:
        """The flow's request while running; ``RuntimeError`` otherwise."""
        if self.flow_req is None:
            raise RuntimeError(f"request {self.sid} is {self.status}, not running")
        return self.flow_req

    @property
    def complete(self) -> bool:
        """Whether it has emitted all its ``max_new_tokens`` tokens."""
        return len(self.output) == self.max_new_tokens

    def tokens(self) -> torch.Tensor:
        """What (re)admission runs: the prompt and every token emitted so far."""
        if not self.output:
            return self.prompt
        return torch.cat([self.prompt, torch.tensor(self.output, dtype=torch.int64)])


@dataclass(frozen=True)
class StepRecord:
    """What one step did. ``prefill``: ``(sid, tokens)`` chunks; the rest are sids."""

    step: int
    time: float
    prefill: tuple[tuple[int, int], ...]
    decode: tuple[int, ...]
    admitted: tuple[int, ...]
    preempted: tuple[int, ...]
    finished: tuple[int, ...]
    waiting: int
    pages_held: int

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.prefill) + len(self.decode)


# ---------------------------------------------------------------------------- runners
class ModelRunner:
    """The `Runner` of an `Engine`: its model runs each item's tokens on its pool (real K/V).

    Item ``(req, q)`` runs ``req.input_ids[num_computed:num_computed + q]`` at slots
    ``req.indices[num_computed:num_computed + q]``, attending over
    ``req.indices[:num_computed + q]``; returns logits ``(len(items), vocab)`` of each item's
    last token. ``vocab_size`` is the model's, so that `Scheduler.submit` refuses a token the
    model could not run.
    """

    def __init__(self, engine: Engine) -> None:
        if not isinstance(engine, Engine):
            raise TypeError(f"engine must be an Engine, got {type(engine).__name__}")
        self.engine = engine
        self.vocab_size = engine.model.config.vocab_size

    def __call__(self, items: Sequence[tuple[Request, int]]) -> torch.Tensor:
        e = self.engine
        ids = torch.cat([r.input_ids[r.num_computed : r.num_computed + q] for r, q in items])
        slots = [r.indices[: r.num_computed + q] for r, q in items]
        logits: torch.Tensor = e.model(
            ids, slots, [q for _, q in items], e.kv_cache, last_only=True
        )
        return logits


def model_runner(engine: Engine) -> ModelRunner:
    """A `Runner` for an `Engine`: its model runs each item's tokens on its pool (real K/V)."""
    return ModelRunner(engine)


def check_runner(runner: object) -> tuple[Runner | None, int | None]:
    """``runner`` (callable or ``None``) and the vocabulary it declares (``vocab_size``, or
    ``None``); ``TypeError``/``ValueError`` naming what is wrong otherwise."""
    if runner is None:
        return None, None
    if not callable(runner):
        raise TypeError(f"runner must be callable or None, got {type(runner).__name__}")
    vocab = getattr(runner, "vocab_size", None)
    return runner, None if vocab is None else check_positive_int(vocab, "runner.vocab_size")


def checked_logits(
    logits: object, items: Sequence[tuple[SchedRequest, int]]
) -> torch.Tensor | None:
    """A runner's answer for ``items``: logits ``(len(items), vocab)``, or ``None`` when no item
    samples a token it was not given (``forced``); ``RuntimeError`` otherwise."""
    if logits is None:
        for s, q in items:
            if s.forced is None and s.req.num_computed + q == len(s.req):
                raise RuntimeError(f"the runner returned no logits to sample request {s.sid}")
        return None
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or len(logits) != len(items):
        got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise RuntimeError(
            f"the runner must return logits of shape ({len(items)}, vocab) or None, got {got}"
        )
    return logits


def next_token(s: SchedRequest, logits: torch.Tensor | None, row: int) -> int:
    """The token ``s`` emits now: its next forced one, else the argmax of ``logits[row]``."""
    if s.forced is not None:
        return s.forced[len(s.output)]
    if logits is None:  # `checked_logits` refuses this first
        raise RuntimeError(f"the runner returned no logits to sample request {s.sid}")
    return int(logits[row].argmax())


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
        policy: ``"fcfs"`` or ``"lpm"``; victim: ``"newest"`` or ``"fewest_decoded"``.
        starvation_bound: steps a request may wait before it goes first, >= 1.
        lpm_queue_limit: LPM orders the queue only while at most this many wait (SGLang: 128).
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
        policy: str = "fcfs",
        victim: str = "newest",
        starvation_bound: int = 64,
        lpm_queue_limit: int = 128,
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
        self.starvation_bound = check_positive_int(starvation_bound, "starvation_bound")
        self.lpm_queue_limit = check_positive_int(lpm_queue_limit, "lpm_queue_limit")
        self.max_retries = check_size(max_retries, "max_retries")
        if policy not in ADMISSION_POLICIES:
            raise ValueError(f"policy must be one of {ADMISSION_POLICIES}, got {policy!r}")
        if victim not in VICTIM_POLICIES:
            raise ValueError(f"victim must be one of {VICTIM_POLICIES}, got {victim!r}")
        if not isinstance(cost_model, CostModel):
            raise TypeError(f"cost_model must be a CostModel, got {type(cost_model).__name__}")
        self.flow, self.policy, self.victim = flow, policy, victim
        self.runner, self.vocab_size = check_runner(runner)
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
    ) -> int:
        """Queue a request; returns its id. ``forced``: tokens to emit instead of sampling.

        ``extra_key``: its namespace (tenant, adapter; any hashable, ``TypeError`` otherwise):
        it matches, and is cached, only among requests submitted with the same key, at every
        (re)admission and in LPM's ordering.

        Refused (``ValueError``) when its longest stored sequence, ``len(prompt) +
        max_new_tokens - 1`` tokens, needs more pages than the pool has: it could never run;
        and when a token id (of the prompt, or of the forced tokens it emits) is negative or,
        for a runner that declares ``vocab_size``, not below it.
        """
        ids = self._checked_ids(prompt, "prompt")
        if len(ids) == 0:
            raise ValueError("prompt must hold at least one token")
        check_positive_int(max_new_tokens, "max_new_tokens")
        check_extra_key(extra_key)
        if forced is not None:
            forced_ids = self._checked_ids(forced, "forced", limit=max_new_tokens)
            if len(forced_ids) < max_new_tokens:
                raise ValueError(
                    f"forced holds {len(forced_ids)} tokens, fewer than "
                    f"max_new_tokens={max_new_tokens}"
                )
        elif self.runner is None:
            raise ValueError("without a runner there are no logits to sample: pass forced tokens")
        ps, pages = self.flow.page_size, self.flow.allocator.num_pages
        need = -(-(len(ids) + max_new_tokens - 1) // ps)
        if need > pages:
            raise ValueError(
                f"request needs up to {need} pages ({len(ids)} prompt + {max_new_tokens} "
                f"new tokens, page size {ps}); the pool has {pages}: it can never fit"
            )
        sreq = SchedRequest(
            next(self._sids),
            torch.from_numpy(ids.copy()),
            int(max_new_tokens),
            None if forced is None else forced_ids.tolist(),
            self.steps,
            self.clock,
            enqueued_step=self.steps,
            extra_key=extra_key,
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

    # ------------------------------------------------------------------ policies
    def _cached_len(self, s: SchedRequest) -> int:
        """How much of what ``s`` would run is cached now (its last token is always run)."""
        match, ids = self.flow.manager.match_prefix, s.tokens()[:-1]
        handle, _ = match(ids) if s.extra_key is None else match(ids, s.extra_key)
        return handle.cached_len

    def _admission_order(self, batch: _Batch) -> list[SchedRequest]:
        """Waiting requests in the order admission tries them (starving ones first)."""
        waiting = list(self._lanes["waiting"].values())
        bound, now = self.starvation_bound, self.steps
        starving = sorted(
            (s for s in waiting if now - s.enqueued_step >= bound), key=lambda s: s.enqueued_step
        )
        rest = [s for s in waiting if now - s.enqueued_step < bound]
        if self.policy == "lpm" and len(waiting) <= self.lpm_queue_limit:
            # SGLang matches every waiting request too; matching only refreshes LRU and splits.
            matched = {}
            for s in rest:
                batch.current = s
                matched[s.sid] = self._cached_len(s)
            batch.current = None
            rest.sort(key=lambda s: -matched[s.sid])  # stable: arrival order among ties
        return starving + rest

    def _pick_victim(self) -> SchedRequest:
        running = self._lanes["running"].values()
        if self.victim == "newest":
            return max(running, key=lambda s: s.admitted_at)
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
        for s in prefilling:
            if batch.budget == 0:
                break
            q = min(len(s.req) - s.req.num_computed, batch.budget, self.chunk_size)
            batch.items.append((s, q))
            batch.budget -= q
        if suspect is None and not batch.preempted:
            self._admit(batch)

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
        batch.items.append((s, min(len(req) - req.num_computed, batch.budget, self.chunk_size)))
        batch.budget -= batch.items[-1][1]
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
        try:
            for row, (s, q) in enumerate(batch.items):
                batch.current, end = s, s.req.num_computed + q
                self._advance(batch, s, q, logits, row)
                if end >= s.fail_point:
                    s.failures = 0  # past where it failed: no longer suspect
        except BaseException as e:
            if isinstance(e, Exception) and batch.current is not None:
                self._blame(batch.current, e, end)
            self._record(batch)  # it ran: recorded, then the error goes on
            raise
        return self._record(batch)

    def _advance(
        self, batch: _Batch, s: SchedRequest, q: int, logits: torch.Tensor | None, row: int
    ) -> None:
        """Mark ``s``'s ``q`` tokens computed; cache prefill progress, or emit and maybe finish.

        The token is chosen before anything changes, so that a request is never left computed
        without the token its computation yields."""
        req = s.req
        start, end = req.num_computed, req.num_computed + q
        token = next_token(s, logits, row) if end == len(req) else None
        self.flow.mark_computed(req, end)
        self.computed_tokens += q
        self.recomputed_tokens += max(0, min(end, s.high_water) - start)
        s.high_water = max(s.high_water, end)
        if token is None:
            ps = self.flow.page_size
            if end // ps * ps > req.tree_len:
                self.flow.cache(req)  # others may reuse the prefix while it is computed
            return
        s.output.append(token)
        if s.first_token_time is None:
            s.first_token_time = self.clock
        if s.complete:
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
        scheduler did not start; no output is longer than ``max_new_tokens``; at most
        ``max_batch`` run."""
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
            if len(s.output) > s.max_new_tokens:
                raise RuntimeError(f"request {s.sid} emitted {len(s.output)} > max_new_tokens")
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
