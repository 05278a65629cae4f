"""Argument checks of the attention functions (:mod:`kvcache.kernels.attention`).

Each raises before anything runs: ``TypeError`` for a wrong type, ``ValueError`` for a wrong
shape, dtype or device, ``IndexError`` for a slot outside the cache.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch

from .._validate import as_int, as_list, check_dense, min_max

__all__ = [
    "AttentionGeometry",
    "check_block_n",
    "check_caches",
    "check_q",
    "check_q_lens",
    "check_slots",
    "default_scale",
]

#: Triton's limit on the elements of one block (``triton.language.TRITON_MAX_TENSOR_NUMEL``).
MAX_TILE_NUMEL = 1 << 20


class AttentionGeometry(NamedTuple):
    """What the checks learn of one layer's cache: its slots, page size, KV heads, head size and
    device."""

    num_slots: int
    page_size: int
    kv_heads: int
    head_dim: int
    device: torch.device


def check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> AttentionGeometry:
    """Both tensors, 3-D or 4-D, the same shape, floating dtype and device."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"{name} must be a torch.Tensor (one layer's cache), got {type(t).__name__}"
            )
        check_dense(t, name)
    if k_cache.dim() not in (3, 4):
        raise ValueError(
            "k_cache must have shape (num_pages, page_size, kv_heads, head_dim) or "
            f"(num_slots, kv_heads, head_dim), got {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}"
        )
    if not k_cache.dtype.is_floating_point or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"k_cache and v_cache must share one floating dtype, got {k_cache.dtype} and {v_cache.dtype}"
        )
    if v_cache.device != k_cache.device:
        raise ValueError(f"v_cache is on {v_cache.device}, k_cache on {k_cache.device}")
    page_size = k_cache.shape[1] if k_cache.dim() == 4 else 1
    num_slots = k_cache.shape[0] * page_size
    return AttentionGeometry(
        num_slots, page_size, k_cache.shape[-2], k_cache.shape[-1], k_cache.device
    )


def check_slots(geo: AttentionGeometry, slots: object, check_bounds: bool = True) -> list[int]:
    """Each entry a non-empty 1-D int32/int64 tensor on the cache's device; with
    ``check_bounds``, values in range (read back to the host once for the whole batch)."""
    if isinstance(slots, torch.Tensor) or not isinstance(slots, (list, tuple)):
        raise TypeError(f"slots must be a list of 1-D tensors, got {type(slots).__name__}")
    lens: list[int] = []
    for r, s in enumerate(slots):
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"slots[{r}] must be a torch.Tensor, got {type(s).__name__}")
        check_dense(s, f"slots[{r}]")
        if s.dim() != 1 or s.numel() == 0:
            raise ValueError(f"slots[{r}] must be 1-D and non-empty, got shape {tuple(s.shape)}")
        if s.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"slots[{r}] must be int32 or int64, got {s.dtype}")
        if s.device != geo.device:
            raise ValueError(f"slots[{r}] is on {s.device}, the cache on {geo.device}")
        lens.append(s.numel())
    # One read-back for the whole batch (on a GPU one sync, not one per request); the request
    # at fault is looked for only when a value is out of range.
    if not lens or not check_bounds:
        return lens
    lo, hi = min_max(slots[0] if len(slots) == 1 else torch.cat(list(slots)))
    if lo < 0 or hi >= geo.num_slots:
        for r, s in enumerate(slots):
            lo, hi = min_max(s)
            if lo < 0 or hi >= geo.num_slots:
                bad = lo if lo < 0 else hi
                raise IndexError(f"slots[{r}] holds {bad}, outside [0, num_slots={geo.num_slots})")
    return lens


def check_q(q: object, geo: AttentionGeometry, total_q: int) -> int:
    """Return the GQA group size."""
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    check_dense(q, "q")
    if q.dim() != 3 or q.shape[0] != total_q or q.shape[2] != geo.head_dim:
        raise ValueError(
            f"q must have shape (sum(q_lens)={total_q}, num_q_heads, head_dim={geo.head_dim}), "
            f"got {tuple(q.shape)}"
        )
    if q.shape[1] == 0 or q.shape[1] % geo.kv_heads != 0:
        raise ValueError(
            f"num_q_heads={q.shape[1]} must be a positive multiple of kv_heads={geo.kv_heads}"
        )
    if not q.dtype.is_floating_point:
        raise ValueError(f"q must be floating point, got {q.dtype}")
    if q.device != geo.device:
        raise ValueError(f"q is on {q.device}, the cache on {geo.device}")
    return q.shape[1] // geo.kv_heads


def check_q_lens(q_lens: object, seq_lens: list[int]) -> list[int]:
    """``q_lens`` (any iterable of integers: Python, NumPy or 0-d torch) as Python ints, one per
    request, ``q_lens[r]`` in ``[1, seq_lens[r]]``: ``TypeError`` for a non-iterable or a
    non-integer entry (``bool``, float, ...), ``ValueError`` for a wrong length or a value out
    of range."""
    items = as_list(q_lens, "q_lens", "ints")
    if len(items) != len(seq_lens):
        raise ValueError(f"len(q_lens)={len(items)} != len(slots)={len(seq_lens)}")
    out: list[int] = []
    for r, (ql, t) in enumerate(zip(items, seq_lens, strict=True)):
        v = as_int(ql, f"q_lens[{r}]")
        if not 1 <= v <= t:
            raise ValueError(f"q_lens[{r}]={v} must be an int in [1, T={t}] (T = len(slots[{r}]))")
        out.append(v)
    return out


def check_block_n(block_n: object, group: int, head_dim: int) -> int:
    """The decode kernel's tile of slots: a power of two whose tiles, ``(block_n, head_dim)`` and
    ``(group, block_n)`` (each side rounded up to a power of two), fit Triton's block limit."""
    v = as_int(block_n, "block_n")
    widest = max(1 << max(0, group - 1).bit_length(), 1 << max(0, head_dim - 1).bit_length())
    limit = MAX_TILE_NUMEL // widest
    if v < 1 or v & (v - 1) or v > limit:
        raise ValueError(
            f"block_n must be a power of two in [1, {limit}] (a tile of block_n x {widest} "
            f"elements at most {MAX_TILE_NUMEL}), got {v}"
        )
    return v


def default_scale(scale: object, head_dim: int) -> float:
    """``1/sqrt(head_dim)`` unless ``scale`` is given: a finite real number (an int, a float, a
    NumPy scalar or a 0-d real tensor; never ``bool``, a string or ``complex``)."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    real = isinstance(scale, numbers.Real) or (
        isinstance(scale, torch.Tensor)
        and scale.dim() == 0
        and not scale.dtype.is_complex
        and scale.dtype != torch.bool
    )
    if not real or isinstance(scale, bool):
        what = (
            f"tensor of dtype {scale.dtype} and shape {tuple(scale.shape)}"
            if isinstance(scale, torch.Tensor)
            else f"{type(scale).__name__} {scale!r:.40}"
        )
        raise TypeError(f"scale must be a real number or None, got {what}")
    value = float(scale)  # type: ignore[arg-type]
    if not math.isfinite(value):
        raise ValueError(f"scale must be finite, got {value}")
    return value
