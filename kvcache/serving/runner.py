"""Runners: what runs a scheduler's batch. A `Runner` takes ``(request, q_len)`` items and
returns the logits of each item's last token (or ``None`` when nothing samples); `ModelRunner`
runs an `Engine`'s model on its pool. `checked_logits` checks a runner's answer and
`next_token` picks the token a request emits from it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .._validate import check_positive_int
from .engine import Engine
from .request_flow import Request
from .sched_records import SchedRequest

__all__ = ["Runner", "ModelRunner", "model_runner", "check_runner", "checked_logits", "next_token"]

#: Runs a batch: ``(request, q_len)`` items, each running ``input_ids[num_computed:+q_len]``;
#: returns logits ``(B, vocab)`` of each item's last token run, or ``None`` (no model). A runner
#: may declare ``vocab_size`` (an int): `Scheduler.submit` then refuses token ids outside it.
Runner = Callable[[Sequence[tuple[Request, int]]], torch.Tensor | None]


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
