"""`StopConditions`: when a request stops emitting tokens.

A request stops at the first token after which one of these holds, checked in this order, as
vLLM's ``check_stop`` (``vllm/v1/core/sched/utils.py``, checked at commit ``018d5dc7``) does:

1. fewer than ``min_tokens`` tokens emitted: it never stops (not even on an end-of-sequence);
2. the token is the model's end-of-sequence id (``eos_token_id``), unless ``ignore_eos``:
   reason ``"eos"``;
3. the token is one of ``stop_token_ids``: reason ``"stop"`` (these apply with ``ignore_eos``
   too, as in vLLM);
4. ``max_new_tokens`` tokens emitted: reason ``"length"``.

The token that stops a request is part of its output (vLLM keeps it in ``output_token_ids``
too), and a stopped request ends exactly as one that reached its length: its whole computed
sequence is cached when it finishes. Only a request's own emitted tokens are checked, never its
prompt.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .._validate import as_int, check_positive_int, check_size

__all__ = ["StopConditions", "STOP_REASONS"]

#: Why a request stopped: its end-of-sequence, a stop token, or its length.
STOP_REASONS = ("eos", "stop", "length")


@dataclass(frozen=True)
class StopConditions:
    """When a request stops (see the module docstring); build it with `StopConditions.make`.

    The fields (plain prose, not an ``Attributes:`` section: autodoc documents a dataclass's
    fields already, and napoleon's would describe them twice): ``max_new_tokens``, the most
    tokens it emits, >= 1; ``min_tokens``, it emits at least this many, in
    ``[0, max_new_tokens]``; ``stop_token_ids``, tokens that stop it once ``min_tokens`` are
    out; ``eos_token_id``, the model's end-of-sequence token (``None``: the model has none);
    ``ignore_eos``, do not stop on ``eos_token_id``.
    """

    max_new_tokens: int
    min_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    eos_token_id: int | None = None
    ignore_eos: bool = False

    @classmethod
    def make(
        cls,
        max_new_tokens: object,
        *,
        min_tokens: object = 0,
        stop_token_ids: Iterable[object] = (),
        eos_token_id: object = None,
        ignore_eos: object = False,
    ) -> StopConditions:
        """The conditions, every argument checked (``TypeError``/``ValueError`` naming it)."""
        n = check_positive_int(max_new_tokens, "max_new_tokens")
        lo = check_size(min_tokens, "min_tokens")
        if lo > n:
            raise ValueError(f"min_tokens must be <= max_new_tokens={n}, got {lo}")
        if isinstance(stop_token_ids, (str, bytes)) or not isinstance(stop_token_ids, Iterable):
            raise TypeError(
                f"stop_token_ids must be an iterable of token ids, got {type(stop_token_ids).__name__}"
            )
        stops = frozenset(
            check_size(t, f"stop_token_ids[{i}]") for i, t in enumerate(stop_token_ids)
        )
        eos = None if eos_token_id is None else check_size(eos_token_id, "eos_token_id")
        if not isinstance(ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {type(ignore_eos).__name__}")
        return cls(n, lo, stops, eos, ignore_eos)

    def reason(self, output: Sequence[int]) -> str | None:
        """Why a request that has emitted ``output`` stops after its last token (one of
        `STOP_REASONS`), or ``None`` while it goes on."""
        if not output:
            return None
        return self.reason_at(len(output), as_int(output[-1], "output[-1]"))

    def reason_at(self, n: int, last: int) -> str | None:
        """`reason` for an output of ``n`` tokens whose last is ``last``."""
        if n < self.min_tokens:
            return None
        if not self.ignore_eos and self.eos_token_id is not None and last == self.eos_token_id:
            return "eos"
        if last in self.stop_token_ids:
            return "stop"
        if n >= self.max_new_tokens:
            return "length"
        return None

    def first_stop(self, output: Sequence[int]) -> int | None:
        """How many tokens of ``output`` a request emits before it stops (the index of the
        stopping token plus one), or ``None`` if none of them stops it."""
        for i, token in enumerate(output):
            if self.reason_at(i + 1, int(token)) is not None:
                return i + 1
        return None

    def cut(self, stream: Sequence[int]) -> list[int]:
        """The output of a request whose model would emit ``stream`` (at least
        ``max_new_tokens`` tokens): ``stream`` up to and with the token that stops it."""
        if len(stream) < self.max_new_tokens:
            raise ValueError(
                f"stream holds {len(stream)} tokens, fewer than max_new_tokens={self.max_new_tokens}"
            )
        ids = [as_int(t, "stream token") for t in stream]
        return ids[: self.first_stop(ids)]  # the length rule stops it by max_new_tokens
