"""Argument checks of the kernels layer: what :mod:`~kvcache.kernels.store` and
:mod:`~kvcache.kernels.attention` verify before a kernel runs.

Each check raises before anything runs or is written, with the argument's name, its value and
the limit: ``TypeError`` for a wrong type, ``ValueError`` for a wrong shape, dtype or device,
``IndexError`` for a slot or index outside the cache. Nothing here writes. The kernels' modules
import these by name, so that each reads as a tutorial does: the kernel, its host wrapper, the
torch reference; the checks a learner can skip live here.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import NamedTuple

import torch

from .._validate import as_int, as_list, check_dense, min_max

__all__ = [
    "MAX_SPLITS",
    "MAX_TILE_NUMEL",
    "AttentionGeometry",
    "check_block_n",
    "check_caches",
    "check_no_self_overlap",
    "check_num_splits",
    "check_q",
    "check_q_lens",
    "check_slot_range",
    "check_slots",
    "check_tensor",
    "default_scale",
    "flatten_slots",
    "paged_geometry",
    "row_views",
    "validate_store_args",
]

StoreViews = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]

INDEX_DTYPES = (torch.int32, torch.int64)

#: Triton's limit on the elements of one block (``triton.language.TRITON_MAX_TENSOR_NUMEL``).
MAX_TILE_NUMEL = 1 << 20

#: The most programs the decode kernel splits one request's context over.
MAX_SPLITS = 64


# ---------------------------------------------------------------------------------------------
# store_cache
# ---------------------------------------------------------------------------------------------


def check_tensor(x: object, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    check_dense(x, name)
    return x


def paged_geometry(cache: torch.Tensor, name: str) -> tuple[int, int, int, int, int, int, int, int]:
    """``(num_pages, page_size, heads, head_dim)`` and the four strides of a 3-D or 4-D cache."""
    if cache.dim() == 3:
        num_slots, heads, head_dim = cache.shape
        s_slot, s_head, s_dim = cache.stride()
        return num_slots, 1, heads, head_dim, s_slot, 0, s_head, s_dim
    if cache.dim() == 4:
        return (*cache.shape, *cache.stride())
    raise ValueError(
        f"{name} must have shape (num_slots, heads, head_dim) or "
        f"(num_pages, page_size, heads, head_dim), got {tuple(cache.shape)}"
    )


def check_no_self_overlap(t: torch.Tensor, name: str) -> None:
    """``ValueError`` when two elements of ``t`` share memory (a stride-0 dimension of size > 1):
    a write through such a view would land in one place for several slots."""
    strides = t.stride()
    if 0 not in strides:  # the common case, without a Python loop over the dimensions
        return
    for d, (size, stride) in enumerate(zip(t.shape, strides, strict=True)):
        if size > 1 and stride == 0:
            raise ValueError(
                f"{name} overlaps itself: dimension {d} has size {size} and stride 0 (an expanded "
                "view); a cache written through it needs distinct memory per element"
            )


def row_views(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> StoreViews:
    """mini-sglang's form of the call as this module's: a cache of rows ``(num_slots, row)`` is
    seen as ``(num_slots, 1, row)``, and sources of rows ``(n, row)`` as ``(n, heads, head_dim)``
    of their cache (``row == heads * head_dim``). Views only (splitting a dimension never needs a
    copy); any other shape is passed on as it is, for `validate_store_args` to judge."""
    if k.dim() == 3 and v.dim() == 3 and k_cache.dim() != 2:  # the package's own form
        return k_cache, v_cache, k, v
    if k_cache.dim() == 2 and v_cache.dim() == 2:
        k_cache, v_cache = k_cache.unsqueeze(1), v_cache.unsqueeze(1)
    if k_cache.dim() in (3, 4):
        heads, head_dim = k_cache.shape[-2:]
        row = heads * head_dim
        if k.dim() == 2 and k.shape[1] == row:
            k = k.view(k.shape[0], heads, head_dim)
        if v.dim() == 2 and v.shape[1] == row:
            v = v.view(v.shape[0], heads, head_dim)
    return k_cache, v_cache, k, v


def validate_store_args(
    k_cache: object,
    v_cache: object,
    indices: object,
    k: object,
    v: object,
    check_bounds: bool,
) -> StoreViews:
    """Check every argument; return ``(k_cache, v_cache, k, v)`` as the kernel takes them
    (`row_views`). Raises before anything is written."""
    k_cache, v_cache, k, v = row_views(
        check_tensor(k_cache, "k_cache"),
        check_tensor(v_cache, "v_cache"),
        check_tensor(k, "k"),
        check_tensor(v, "v"),
    )
    indices = check_tensor(indices, "indices")
    if k_cache.dim() not in (3, 4):
        paged_geometry(k_cache, "k_cache")
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}"
        )
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache dtype {v_cache.dtype} != k_cache dtype {k_cache.dtype}")
    device = k_cache.device
    for name, t in (("v_cache", v_cache), ("k", k), ("v", v), ("indices", indices)):
        if t.device != device:
            raise ValueError(f"{name} is on device {t.device}, but k_cache is on {device}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_no_self_overlap(t, name)
    heads, head_dim = k_cache.shape[-2], k_cache.shape[-1]
    num_slots = k_cache.shape[0] * (k_cache.shape[1] if k_cache.dim() == 4 else 1)
    if indices.dim() != 1:
        raise ValueError(f"indices must be 1-D, got shape {tuple(indices.shape)}")
    if indices.dtype not in INDEX_DTYPES:
        raise ValueError(f"indices must have dtype torch.int32 or torch.int64, got {indices.dtype}")
    n = indices.shape[0]
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != (n, heads, head_dim):
            raise ValueError(
                f"{name} must have shape (n, heads, head_dim) = {(n, heads, head_dim)} "
                f"(n = len(indices)), got {tuple(t.shape)}"
            )
        if t.dtype != k_cache.dtype:
            raise ValueError(f"{name} dtype {t.dtype} != cache dtype {k_cache.dtype}")
    if check_bounds and n > 0:
        lo, hi = min_max(indices)
        if lo < 0 or hi >= num_slots:
            bad = lo if lo < 0 else hi
            raise IndexError(f"index {bad} is outside [0, num_slots={num_slots})")
    return k_cache, v_cache, k, v


# ---------------------------------------------------------------------------------------------
# paged_attention, paged_decode_attention, gather_kv
# ---------------------------------------------------------------------------------------------


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
    ``check_bounds``, values in range (read back to the host once for the whole batch).
    Returns the lengths."""
    if isinstance(slots, torch.Tensor) or not isinstance(slots, (list, tuple)):
        raise TypeError(f"slots must be a list of 1-D tensors, got {type(slots).__name__}")
    lens: list[int] = []
    for r, s in enumerate(slots):
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"slots[{r}] must be a torch.Tensor, got {type(s).__name__}")
        check_dense(s, f"slots[{r}]")
        if s.dim() != 1 or s.numel() == 0:
            raise ValueError(f"slots[{r}] must be 1-D and non-empty, got shape {tuple(s.shape)}")
        if s.dtype not in INDEX_DTYPES:
            raise ValueError(f"slots[{r}] must be int32 or int64, got {s.dtype}")
        if s.device != geo.device:
            raise ValueError(f"slots[{r}] is on {s.device}, the cache on {geo.device}")
        lens.append(s.numel())
    if lens and check_bounds:
        check_slot_range(geo, slots, slots[0] if len(slots) == 1 else torch.cat(list(slots)))
    return lens


def check_slot_range(
    geo: AttentionGeometry, slots: Sequence[torch.Tensor], flat: torch.Tensor
) -> None:
    """``IndexError`` unless every value of ``flat`` (``slots`` end to end) is in
    ``[0, num_slots)``: one read-back for the whole batch (on a GPU one sync, not one per
    request); the request at fault is looked for only when a value is out of range."""
    lo, hi = min_max(flat)
    if lo < 0 or hi >= geo.num_slots:
        for r, s in enumerate(slots):
            lo, hi = min_max(s)
            if lo < 0 or hi >= geo.num_slots:
                bad = lo if lo < 0 else hi
                raise IndexError(f"slots[{r}] holds {bad}, outside [0, num_slots={geo.num_slots})")


def flatten_slots(
    geo: AttentionGeometry, slots: Sequence[torch.Tensor], check_bounds: bool = True
) -> tuple[torch.Tensor, list[int]]:
    """What :func:`check_slots` checks, and the batch's slots end to end as one contiguous 1-D
    tensor on the cache's device (int32 when every request's are, else int64), with the
    requests' lengths. One ``torch.cat`` serves the kernel and the range check alike.

    The common case costs a few attribute reads per request: the lengths and dtypes are read
    and the batch concatenated, and only the result's dtype, shape, layout and device are
    checked. Anything unusual (a non-tensor, an empty or 2-D entry, mixed devices, a sparse or
    non-integer tensor) goes through :func:`check_slots`, whose error names the request."""
    joined = _joined_if_plain(geo, slots)
    if joined is None:  # check_slots raises for everything the fast path refuses but []
        lens = check_slots(geo, slots, check_bounds=False)
        flat = torch.cat(list(slots)) if lens else torch.empty(0, dtype=torch.int32)
    else:
        flat, lens = joined
    if check_bounds and lens:
        check_slot_range(geo, slots, flat)
    return flat, lens


def _joined_if_plain(
    geo: AttentionGeometry, slots: object
) -> tuple[torch.Tensor, list[int]] | None:
    """``(torch.cat(slots), lengths)`` when ``slots`` is a non-empty list or tuple of non-empty
    1-D dense int32/int64 tensors on the cache's device; ``None`` otherwise."""
    if not isinstance(slots, (list, tuple)) or not slots:
        return None
    try:
        lens = [s.shape[0] for s in slots]
        kinds = {(type(s), s.dtype) for s in slots}
        flat = slots[0].contiguous() if len(slots) == 1 else torch.cat(slots)
    except (AttributeError, IndexError, TypeError, RuntimeError, NotImplementedError):
        return None
    plain = (
        min(lens) > 0
        and all(issubclass(t, torch.Tensor) and d in INDEX_DTYPES for t, d in kinds)
        and flat.layout is torch.strided
        and flat.dim() == 1
        and flat.device == geo.device
    )
    return (flat, lens) if plain else None


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
    ``(group, block_n)`` (each side rounded up to a power of two of at least 16, the smallest
    tile ``tl.dot`` takes), fit Triton's block limit."""
    v = as_int(block_n, "block_n")
    widest = max(16, 1 << max(0, group - 1).bit_length(), 1 << max(0, head_dim - 1).bit_length())
    limit = MAX_TILE_NUMEL // widest
    if v < 1 or v & (v - 1) or v > limit:
        raise ValueError(
            f"block_n must be a power of two in [1, {limit}] (a tile of block_n x {widest} "
            f"elements at most {MAX_TILE_NUMEL}), got {v}"
        )
    return v


def check_num_splits(num_splits: object) -> int | None:
    """``None`` (the kernel chooses) or an integer in ``[1, MAX_SPLITS]``."""
    if num_splits is None:
        return None
    v = as_int(num_splits, "num_splits")
    if not 1 <= v <= MAX_SPLITS:
        raise ValueError(f"num_splits must be None or an int in [1, {MAX_SPLITS}], got {v}")
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
