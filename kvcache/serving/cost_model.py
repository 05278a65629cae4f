"""Simulated time for a scheduler run: a deterministic cost per step, and the report of a run.

A step of continuous batching is one forward pass over every token the step runs (prefill
chunks and one decode token per decoding request). Its time is modelled as a roofline::

    step_s = step_overhead_s + max(decode_s_per_step, tokens * prefill_s_per_token)

* ``decode_s_per_step``: reading every weight once from memory. A forward pass cannot be
  faster than that, however few tokens it runs, so a decode step costs about the same for one
  request as for a hundred: the reason batching pays.
* ``prefill_s_per_token``: the matrix arithmetic of one token (2 FLOPs per parameter), which
  dominates once a step runs enough tokens (long prefill chunks).
* ``step_overhead_s``: the host's share (scheduling, input preparation, kernel launches).

Attention's own reads of K/V are left out: they grow with context length and would make the
model depend on more than token counts, which is all a scheduler decides.

The numbers are deterministic, so a run reports the same throughput and latencies on every
machine; the real wall time of the scheduler's bookkeeping is measured separately by
``benchmarks/scheduler_steps.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .._validate import check_size

__all__ = ["CostModel", "LLAMA3_8B_H100", "ServeReport"]


@dataclass(frozen=True)
class CostModel:
    """Seconds per step as a function of the tokens it runs (see the module docstring)."""

    prefill_s_per_token: float
    decode_s_per_step: float
    step_overhead_s: float

    def __post_init__(self) -> None:
        for name in ("prefill_s_per_token", "decode_s_per_step", "step_overhead_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")

    def step_seconds(self, num_tokens: int) -> float:
        """Simulated seconds of a step that runs ``num_tokens`` tokens (0 for an empty step);
        ``num_tokens`` is a count (``TypeError`` for a non-integer, ``ValueError`` below 0)."""
        num_tokens = check_size(num_tokens, "num_tokens")
        if num_tokens == 0:
            return 0.0
        return self.step_overhead_s + max(
            self.decode_s_per_step, num_tokens * self.prefill_s_per_token
        )


#: A Llama-3-8B-sized model (8.03e9 parameters, bf16) on one H100 SXM. Prefill: 2 * 8.03e9
#: FLOP per token / (989 TFLOP/s dense bf16 * 50 % utilisation) = 32 us. Decode: 16.06e9 bytes
#: of weights / 3.35 TB/s of HBM3 bandwidth = 4.8 ms. Overhead: about 1 ms of host work per
#: step, the order vLLM and SGLang report before overlapping the scheduler with the GPU.
LLAMA3_8B_H100 = CostModel(
    prefill_s_per_token=32e-6, decode_s_per_step=4.8e-3, step_overhead_s=1e-3
)


@dataclass(frozen=True)
class ServeReport:
    """What a run did, in simulated time (deterministic) and token counts."""

    requests: int
    steps: int
    seconds: float
    output_tokens: int
    prompt_tokens: int
    reused_tokens: int
    computed_tokens: int
    recomputed_tokens: int
    preemptions: int
    peak_pages: int
    ttft_p50_s: float
    ttft_p99_s: float
    max_wait_steps: int
    #: Requests that ended ``"failed"`` (see `Scheduler`'s "When a step fails").
    failed: int = 0

    @property
    def throughput(self) -> float:
        """Output tokens per simulated second."""
        return self.output_tokens / self.seconds if self.seconds else 0.0

    @property
    def hit_rate(self) -> float:
        """Prompt tokens read from the cache at (re)admission, over all prompt tokens admitted."""
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def summary(self) -> str:
        """One line per figure, for printing in a notebook (failed requests only if any)."""
        failed = [f"failed requests {self.failed}"] if self.failed else []
        return "\n".join(
            [
                f"requests {self.requests}, steps {self.steps}, simulated {self.seconds:.3f} s",
                f"throughput {self.throughput:,.0f} output tokens/s",
                f"TTFT p50 {self.ttft_p50_s * 1e3:.1f} ms, p99 {self.ttft_p99_s * 1e3:.1f} ms",
                f"hit rate {self.hit_rate:.1%}, computed {self.computed_tokens:,} tokens, "
                f"recomputed {self.recomputed_tokens:,}",
                f"preemptions {self.preemptions}, peak pages held {self.peak_pages}, "
                f"longest wait {self.max_wait_steps} steps",
                *failed,
            ]
        )


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (numpy's linear interpolation); 0.0 for no values."""
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else 0.0
