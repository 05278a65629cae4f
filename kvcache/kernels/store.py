"""``store_cache``: scatter the K/V of ``n`` new tokens into their slots of a (paged) cache.

Shapes
    ``k_cache``, ``v_cache``: ``(num_slots, heads, head_dim)`` or paged
    ``(num_pages, page_size, heads, head_dim)``; slot ``s`` of a paged cache is
    ``[s // page_size, s % page_size]``. Any strides: a PageFirst layer view with
    ``page_size > 1`` cannot be flattened to slots without a copy, so the kernel takes the page
    stride and the in-page stride as they are.
    ``k``, ``v``: ``(n, heads, head_dim)``, same dtype and device as the caches.
    ``indices``: ``(n,)``, ``torch.int32`` or ``torch.int64``, same device.

Backends
    ``"triton"``: one Triton launch, one program per (token, block of heads). Used for CUDA tensors.
    ``"triton-interpreter"``: the same kernel run by Triton's CPU interpreter; used for CPU tensors
    when ``TRITON_INTERPRET=1`` was set before this module was imported.
    ``"torch"``: advanced-index assignment; used for CPU tensors otherwise.
"""

from __future__ import annotations

import os
from typing import Tuple

import torch

try:
    import triton
    import triton.language as tl

    _HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is a dependency, but keep the torch path usable
    _HAVE_TRITON = False

__all__ = [
    "store_cache",
    "store_cache_triton",
    "store_cache_torch",
    "store_cache_backend",
    "TRITON_INTERPRET",
]

#: Whether ``TRITON_INTERPRET=1`` was set when this module was imported (triton reads it then too).
TRITON_INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"

_INDEX_DTYPES = (torch.int32, torch.int64)
# Upper bound on the elements one program copies per tensor; keeps registers in check on GPU.
_MAX_TILE = 4096


def store_cache_backend(device: torch.device | str) -> str:
    """Which backend :func:`store_cache` uses for tensors on ``device``.

    Returns ``"triton"`` (CUDA), ``"triton-interpreter"`` (CPU with ``TRITON_INTERPRET=1`` set
    before import) or ``"torch"`` (anything else).
    """
    dev = torch.device(device)
    if _HAVE_TRITON and dev.type == "cuda":
        return "triton"
    if _HAVE_TRITON and dev.type == "cpu" and TRITON_INTERPRET:
        return "triton-interpreter"
    return "torch"


# ---------------------------------------------------------------------------------------------
# Checks (shared by every entry point; nothing is written unless all pass)
# ---------------------------------------------------------------------------------------------


def _check_tensor(x: object, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _paged_geometry(cache: torch.Tensor, name: str) -> Tuple[int, int, int, int, int, int, int, int]:
    """``(num_pages, page_size, heads, head_dim)`` and the four strides of a 3-D or 4-D cache."""
    if cache.dim() == 3:
        num_slots, heads, head_dim = cache.shape
        s_slot, s_head, s_dim = cache.stride()
        return num_slots, 1, heads, head_dim, s_slot, 0, s_head, s_dim
    if cache.dim() == 4:
        return (*cache.shape, *cache.stride())  # type: ignore[return-value]
    raise ValueError(
        f"{name} must have shape (num_slots, heads, head_dim) or "
        f"(num_pages, page_size, heads, head_dim), got {tuple(cache.shape)}"
    )


def _validate(
    k_cache: object,
    v_cache: object,
    indices: object,
    k: object,
    v: object,
    check_bounds: bool,
) -> int:
    """Check every argument; return ``num_slots``. Raises before anything is written."""
    k_cache = _check_tensor(k_cache, "k_cache")
    v_cache = _check_tensor(v_cache, "v_cache")
    indices = _check_tensor(indices, "indices")
    k = _check_tensor(k, "k")
    v = _check_tensor(v, "v")
    if k_cache.dim() not in (3, 4):
        _paged_geometry(k_cache, "k_cache")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache dtype {v_cache.dtype} != k_cache dtype {k_cache.dtype}")
    device = k_cache.device
    for name, t in (("v_cache", v_cache), ("k", k), ("v", v), ("indices", indices)):
        if t.device != device:
            raise ValueError(f"{name} is on device {t.device}, but k_cache is on {device}")
    heads, head_dim = k_cache.shape[-2], k_cache.shape[-1]
    num_slots = k_cache.shape[0] * (k_cache.shape[1] if k_cache.dim() == 4 else 1)
    if indices.dim() != 1:
        raise ValueError(f"indices must be 1-D, got shape {tuple(indices.shape)}")
    if indices.dtype not in _INDEX_DTYPES:
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
        lo, hi = (int(x) for x in torch.aminmax(indices))
        if lo < 0 or hi >= num_slots:
            bad = lo if lo < 0 else hi
            raise IndexError(f"index {bad} is outside [0, num_slots={num_slots})")
    return num_slots


# ---------------------------------------------------------------------------------------------
# Torch backend
# ---------------------------------------------------------------------------------------------


def _store_torch(k_cache: torch.Tensor, v_cache: torch.Tensor, indices: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    idx = indices.long()
    if k_cache.dim() == 3:
        k_cache[idx] = k
        v_cache[idx] = v
    else:
        page_size = k_cache.shape[1]
        page, offset = idx // page_size, idx % page_size
        k_cache[page, offset] = k
        v_cache[page, offset] = v


def store_cache_torch(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    indices: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    check_bounds: bool = True,
) -> None:
    """:func:`store_cache` forced onto the torch backend (any device)."""
    _validate(k_cache, v_cache, indices, k, v, check_bounds)
    if indices.numel():
        _store_torch(k_cache, v_cache, indices, k, v)


# ---------------------------------------------------------------------------------------------
# Triton backend
# ---------------------------------------------------------------------------------------------

if _HAVE_TRITON:

    @triton.jit
    def _store_cache_kernel(
        k_cache_ptr, v_cache_ptr, indices_ptr, k_ptr, v_ptr,
        heads, head_dim, page_size,
        # cache strides: page, in-page slot, head, dim (K and V may differ)
        stride_kc_p, stride_kc_s, stride_kc_h, stride_kc_d,
        stride_vc_p, stride_vc_s, stride_vc_h, stride_vc_d,
        # source strides: token, head, dim
        stride_k_n, stride_k_h, stride_k_d,
        stride_v_n, stride_v_h, stride_v_d,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """Program (i, j) copies heads [j*BLOCK_H, (j+1)*BLOCK_H) of token i, for K and for V."""
        pid_n = tl.program_id(0)
        pid_h = tl.program_id(1)
        # int64 so slot * stride cannot overflow on large pools.
        slot = tl.load(indices_ptr + pid_n).to(tl.int64)
        page = slot // page_size
        offset = slot % page_size

        offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h[:, None] < heads) & (offs_d[None, :] < head_dim)
        row = pid_n.to(tl.int64)

        k_src = k_ptr + row * stride_k_n + offs_h[:, None] * stride_k_h + offs_d[None, :] * stride_k_d
        k_dst = (k_cache_ptr + page * stride_kc_p + offset * stride_kc_s
                 + offs_h[:, None] * stride_kc_h + offs_d[None, :] * stride_kc_d)
        tl.store(k_dst, tl.load(k_src, mask=mask), mask=mask)

        v_src = v_ptr + row * stride_v_n + offs_h[:, None] * stride_v_h + offs_d[None, :] * stride_v_d
        v_dst = (v_cache_ptr + page * stride_vc_p + offset * stride_vc_s
                 + offs_h[:, None] * stride_vc_h + offs_d[None, :] * stride_vc_d)
        tl.store(v_dst, tl.load(v_src, mask=mask), mask=mask)


def _store_triton(k_cache: torch.Tensor, v_cache: torch.Tensor, indices: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    _, page_size, heads, head_dim, *kc_strides = _paged_geometry(k_cache, "k_cache")
    vc_strides = _paged_geometry(v_cache, "v_cache")[4:]
    n = indices.shape[0]
    block_d = triton.next_power_of_2(head_dim)
    block_h = max(1, min(triton.next_power_of_2(heads), _MAX_TILE // block_d))
    grid = (n, triton.cdiv(heads, block_h))
    _store_cache_kernel[grid](
        k_cache, v_cache, indices, k, v,
        heads, head_dim, page_size,
        *kc_strides, *vc_strides,
        *k.stride(), *v.stride(),
        BLOCK_H=block_h, BLOCK_D=block_d,
    )


def store_cache_triton(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    indices: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    check_bounds: bool = True,
) -> None:
    """:func:`store_cache` forced onto the Triton kernel.

    CUDA tensors, or CPU tensors when ``TRITON_INTERPRET=1`` was set before import; otherwise
    ``RuntimeError``.
    """
    _validate(k_cache, v_cache, indices, k, v, check_bounds)
    if store_cache_backend(k_cache.device) not in ("triton", "triton-interpreter"):
        raise RuntimeError(
            f"the Triton store kernel cannot run on {k_cache.device}: it needs CUDA, or the CPU "
            "with TRITON_INTERPRET=1 set before kvcache is imported"
        )
    if indices.numel():
        _store_triton(k_cache, v_cache, indices, k, v)


def store_cache(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    indices: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    check_bounds: bool = True,
) -> None:
    """Write ``k[i]`` to slot ``indices[i]`` of ``k_cache`` and ``v[i]`` to the same slot of ``v_cache``.

    Shapes: caches ``(num_slots, heads, head_dim)`` or ``(num_pages, page_size, heads, head_dim)``
    (any strides); ``k``, ``v`` ``(n, heads, head_dim)``; ``indices`` ``(n,)`` int32/int64.
    The backend is :func:`store_cache_backend` of the caches' device.

    Raises, before writing anything: ``TypeError`` for a non-tensor argument; ``ValueError`` for
    mismatched shapes, dtypes or devices; ``IndexError`` for an index outside ``[0, num_slots)``
    (this check reads the indices back to the host; ``check_bounds=False`` skips it for callers
    that guarantee the range, e.g. an allocator's own output). With duplicate indices, which
    token's row ends up in the slot is unspecified.
    """
    _validate(k_cache, v_cache, indices, k, v, check_bounds)
    if indices.numel() == 0:
        return
    if store_cache_backend(k_cache.device) == "torch":
        _store_torch(k_cache, v_cache, indices, k, v)
    else:
        _store_triton(k_cache, v_cache, indices, k, v)
