"""What a `Scheduler` records: each request as it sees it (`SchedRequest`), with the statuses
it can have and the lane that holds it in each (`LANES`), and what each step did
(`StepRecord`)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from .request_flow import Request
from .stop import StopConditions

__all__ = ["SchedRequest", "StepRecord", "LANES"]

#: Every status a request can have, and the scheduler's lane that holds a request in it.
#: ``"withdrawn"``: taken out (`Scheduler.withdraw`) to be served elsewhere (a router moving the
#: requests of a replica it removes).
LANES = {
    "waiting": "waiting",
    "running": "running",
    "finished": "done",
    "aborted": "done",
    "failed": "done",
    "withdrawn": "done",
}


@dataclass(eq=False)  # identity: a lane holds each request once
class SchedRequest:
    """A request as the scheduler sees it; ``status`` (see `LANES`) is where it is.

    ``output`` holds the tokens emitted so far; the flow's request (``flow_req``, while
    running) holds ``prompt + output[:-1]`` once decoding, the last emitted token being the
    next one to run. ``stop``: when it stops (`StopConditions`); ``finish_reason``: why it
    stopped (``"eos"``, ``"stop"``, ``"length"``), set with the token that stops it.
    ``priority``: smaller runs first under the ``"priority"`` policy (vLLM's convention).
    ``extra_key``: the namespace it matches and is cached in. ``failures``: failed steps it was
    blamed for since it last computed past ``fail_point`` (the length it was computing up to
    when last blamed); ``error``: the last error a step met on it (kept once it has ended, e.g.
    the one that made it ``"failed"``).
    """

    sid: int
    prompt: torch.Tensor
    stop: StopConditions
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
    priority: int = 0
    finish_reason: str | None = None
    failures: int = 0
    fail_point: int = 0
    error: BaseException | None = None

    @property
    def max_new_tokens(self) -> int:
        return self.stop.max_new_tokens

    @property
    def req(self) -> Request:
        """The flow's request while running; ``RuntimeError`` otherwise."""
        if self.flow_req is None:
            raise RuntimeError(f"request {self.sid} is {self.status}, not running")
        return self.flow_req

    @property
    def complete(self) -> bool:
        """Whether it has emitted its last token (a stop condition held)."""
        return self.finish_reason is not None

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
