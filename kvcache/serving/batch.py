"""What the scheduler hands around: a request's scheduling state, the record of a step, runners.

A `Runner` runs one batch built by `Scheduler.step`; `model_runner` is the one that runs an
`Engine`'s model on its pool, with real K/V.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch

from .engine import Engine
from .request_flow import Request

__all__ = [
    "SchedRequest",
    "StepRecord",
    "Runner",
    "model_runner",
    "check_runner",
    "checked_logits",
    "next_token",
]

#: Runs a batch: ``(request, q_len)`` items, each running ``input_ids[num_computed:+q_len]``;
#: returns logits ``(B, vocab)`` of each item's last token run, or ``None`` (no model).
Runner = Callable[[Sequence[tuple[Request, int]]], torch.Tensor | None]


def check_runner(runner: object) -> Runner | None:
    """``runner`` if it is callable or ``None``; ``TypeError`` naming it otherwise."""
    if runner is not None and not callable(runner):
        raise TypeError(f"runner must be callable or None, got {type(runner).__name__}")
    return runner


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


@dataclass(eq=False)  # identity: queues hold each request once
class SchedRequest:
    """A request as the scheduler sees it. ``status``: waiting, running, finished or aborted.

    ``output`` holds the tokens sampled so far; the flow's request (``flow_req``, while
    running) holds ``prompt + output[:-1]`` once decoding, the last sampled token being the
    next one to run. ``extra_key``: the namespace it matches and is cached in.
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

    @property
    def req(self) -> Request:
        """The flow's request while running; ``RuntimeError`` otherwise."""
        if self.flow_req is None:
            raise RuntimeError(f"request {self.sid} is {self.status}, not running")
        return self.flow_req

    def tokens(self) -> torch.Tensor:
        """What (re)admission runs: the prompt and every token sampled so far."""
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


def model_runner(engine: Engine) -> Runner:
    """A `Runner` for an `Engine`: its model runs each item's tokens on its pool (real K/V).

    Item ``(req, q)`` runs ``req.input_ids[num_computed:num_computed + q]`` at slots
    ``req.indices[num_computed:num_computed + q]``, attending over ``req.indices[:num_computed + q]``.
    """
    model, kv_cache = engine.model, engine.kv_cache

    def run(items: Sequence[tuple[Request, int]]) -> torch.Tensor:
        ids = torch.cat([r.input_ids[r.num_computed : r.num_computed + q] for r, q in items])
        slots = [r.indices[: r.num_computed + q] for r, q in items]
        logits: torch.Tensor = model(ids, slots, [q for _, q in items], kv_cache, last_only=True)
        return logits

    return run
