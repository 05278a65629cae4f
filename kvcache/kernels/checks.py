"""Argument checks and cache geometry shared by the store kernel's entry points.

Each check raises with the argument's name, its value and the limit; nothing here writes.
"""

from __future__ import annotations

import torch

from .._validate import check_dense, min_max

__all__ = [
    "check_no_self_overlap",
    "check_tensor",
    "paged_geometry",
    "row_views",
    "validate_store_args",
]

StoreViews = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]

INDEX_DTYPES = (torch.int32, torch.int64)


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
    for d, (size, stride) in enumerate(zip(t.shape, t.stride(), strict=True)):
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
