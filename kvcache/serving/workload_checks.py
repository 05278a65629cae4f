"""Argument checks of the workload generators and of the jobs a driver takes.

`checked_workload` wraps a generator of `kvcache.serving.workloads` so that every argument is
checked, by the name and annotation of its parameter, before any job is made: a negative
``turns`` looped for ever, ``vocab=-inf`` raised ``OverflowError`` and ``vocab=2.0`` was taken.
`check_jobs` checks a list of jobs whole, before a driver submits the first.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from collections.abc import Callable, Sized
from typing import Any, TypeVar

import numpy as np
import torch

from .._validate import as_int, as_list, check_positive_int, check_size, check_token_ids

__all__ = ["checked_workload", "check_span", "check_probability", "check_jobs"]

_F = TypeVar("_F", bound=Callable[..., Any])

#: Counts a generator draws from (``rng.choice``, ``randrange``, ``randint(1, n)``): at least 1.
AT_LEAST_ONE = frozenset(("num_prompts", "num_tasks", "num_agents", "depth", "fanout", "vocab"))


def check_span(value: object, name: str) -> tuple[int, int]:
    """A ``(lo, hi)`` pair of integers with ``0 <= lo <= hi``, as Python ints."""
    if isinstance(value, (str, bytes, torch.Tensor, np.ndarray)) or not isinstance(value, Sized):
        raise TypeError(f"{name} must be a (lo, hi) pair of integers, got {type(value).__name__}")
    items = as_list(value, name, "two integers")
    if len(items) != 2:
        raise ValueError(f"{name} must be a (lo, hi) pair, got {len(items)} values")
    lo, hi = as_int(items[0], f"{name}[0]"), as_int(items[1], f"{name}[1]")
    if not 0 <= lo <= hi:
        raise ValueError(f"{name} must satisfy 0 <= lo <= hi, got ({lo}, {hi})")
    return lo, hi


def check_probability(value: object, name: str) -> float:
    """A real number in ``[0, 1]`` (not ``bool``), as a float."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number in [0, 1], got {type(value).__name__}")
    p = float(value)
    if not (math.isfinite(p) and 0.0 <= p <= 1.0):
        raise ValueError(f"{name} must be in [0, 1], got {p}")
    return p


def checked_workload(fn: _F) -> _F:
    """``fn`` with its arguments checked and converted before it runs, by parameter: ``int``
    (but ``seed``) a count ``>= 0`` (``>= 1`` for those in `AT_LEAST_ONE`), ``tuple[int, int]``
    a `check_span` pair, ``float`` a `check_probability`. ``TypeError``/``ValueError`` name it."""
    sig = inspect.signature(fn)
    checks: dict[str, Callable[[object, str], object]] = {}
    for name, param in sig.parameters.items():
        kind = param.annotation
        if name == "seed":
            continue
        if kind == "int":
            checks[name] = check_positive_int if name in AT_LEAST_ONE else check_size
        elif kind == "tuple[int, int]":
            checks[name] = check_span
        elif kind == "float":
            checks[name] = check_probability

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        for name, check in checks.items():
            bound.arguments[name] = check(bound.arguments[name], name)
        return fn(*bound.args, **bound.kwargs)

    return wrapper  # type: ignore[return-value]


def check_jobs(jobs: object) -> list[Any]:
    """``jobs`` as a list, each a job (a ``prompt`` and an ``output``, 1-D CPU token-id tensors);
    the first one that is not is named by its index, before any job runs."""
    out = as_list(jobs, "jobs", "Jobs (prompt, output)")
    for i, job in enumerate(out):
        prompt, output = getattr(job, "prompt", None), getattr(job, "output", None)
        if not isinstance(prompt, torch.Tensor) or not isinstance(output, torch.Tensor):
            raise TypeError(
                f"jobs[{i}] must be a Job (prompt and output tensors), got {type(job).__name__}"
            )
        check_token_ids(prompt, f"jobs[{i}].prompt")
        check_token_ids(output, f"jobs[{i}].output")
    return out
