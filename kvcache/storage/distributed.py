"""Tensor-parallel (TP) info for the current process.

A serving engine that splits a model over ``size`` devices runs one process per device; each
process calls :func:`set_tp_info` once with its ``rank`` and the TP ``size``, and storage code
such as :class:`kvcache.storage.mha_pool.MHAKVCache` asks :func:`try_get_tp_info` how many KV heads are
its own (``divide_even(num_kv_heads, size)``). The info is process-global on purpose: it is a
fact about the process, not about any one object.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "DistributedInfo",
    "set_tp_info",
    "get_tp_info",
    "try_get_tp_info",
    "reset_tp_info",
    "divide_even",
]


def _check_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class DistributedInfo:
    """This process's place in a TP group: ``0 <= rank < size``, ``size >= 1``."""

    rank: int
    size: int

    def __post_init__(self) -> None:
        _check_int(self.rank, "rank")
        _check_int(self.size, "size")
        if self.size < 1:
            raise ValueError(f"size must be >= 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank must satisfy 0 <= rank < size={self.size}, got {self.rank}")

    @property
    def is_primary(self) -> bool:
        """True on rank 0, the rank that usually logs and returns results."""
        return self.rank == 0


_TP_INFO: DistributedInfo | None = None


def set_tp_info(rank: int, size: int) -> DistributedInfo:
    """Record this process's TP rank and size (replacing any earlier value) and return it.

    Raises ``TypeError``/``ValueError`` (and keeps the old value) unless ``0 <= rank < size``.
    """
    global _TP_INFO
    info = DistributedInfo(rank, size)
    _TP_INFO = info
    return info


def get_tp_info() -> DistributedInfo:
    """The TP info set by :func:`set_tp_info`; ``RuntimeError`` when none is set."""
    if _TP_INFO is None:
        raise RuntimeError(
            "TP info is not set: call kvcache.storage.distributed.set_tp_info(rank, size) first"
        )
    return _TP_INFO


def try_get_tp_info() -> DistributedInfo | None:
    """The TP info set by :func:`set_tp_info`, or ``None`` when none is set."""
    return _TP_INFO


def reset_tp_info() -> None:
    """Forget the TP info (tests use this to leave the process as they found it)."""
    global _TP_INFO
    _TP_INFO = None


def divide_even(a: int, b: int) -> int:
    """``a // b``, refusing to round: ``ValueError`` naming both values unless ``b`` divides ``a``.

    ``a`` must be >= 0 and ``b`` >= 1 (both ints).
    """
    _check_int(a, "a")
    _check_int(b, "b")
    if b < 1:
        raise ValueError(f"divisor must be >= 1, got b={b}")
    if a < 0:
        raise ValueError(f"dividend must be >= 0, got a={a}")
    if a % b != 0:
        raise ValueError(f"{a} is not divisible by {b} (a={a}, b={b}, remainder {a % b})")
    return a // b
