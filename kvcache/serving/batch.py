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

__all__ = ["SchedRequest", "StepRecord", "Runner", "model_runner"]

#: Runs a batch: ``(request, q_len)`` items, each running ``input_ids[num_computed:+q_len]``;
#: returns logits ``(B, vocab)`` of each item's last token run, or ``None`` (no model).
Runner = Callable[[Sequence[tuple[Request, int]]], torch.Tensor | None]


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
