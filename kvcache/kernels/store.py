"""``store_cache``: scatter the K/V of ``n`` new tokens into their slots of a (paged) cache.

Shapes
    ``k_cache``, ``v_cache``: ``(num_slots, heads, head_dim)`` or paged
    ``(num_pages, page_size, heads, head_dim)``; slot ``s`` of a paged cache is
    ``[s // page_size, s % page_size]``. Any strides: a PageFirst layer view with
    ``page_size > 1`` cannot be flattened to slots without a copy, so the kernel takes the page
    stride and the in-page stride as they are.
    ``k``, ``v``: ``(n, heads, head_dim)``, same dtype and device as the caches.
    ``indices``: ``(n,)``, ``torch.int32`` or ``torch.int64``, same device.
    mini-sglang's form is taken too: caches of rows ``(num_slots, row)`` and sources of rows
    ``(n, row)``, with ``row = heads * head_dim`` of the cache (seen as ``heads = 1`` for a cache
    of rows; views, no copy).
    Every argument may be any view (strided, transposed, sliced, expanded with stride 0, with a
    storage offset): the Triton kernel is given every stride, ``indices``' included, so it reads
    exactly the logical values the bounds check read. A cache that overlaps itself (a stride-0
    dimension of size > 1) is refused: a slot must be one place in memory.

Backends
    ``"triton"``: one Triton launch, one program per (block of tokens, block of heads). Used for
    CUDA tensors.
    ``"triton-interpreter"``: the same kernel run by Triton's interpreter; used whenever
    ``TRITON_INTERPRET=1`` was set before this module was imported (for CPU tensors, and for CUDA
    tensors too, since Triton then interprets every launch).
    ``"torch"``: advanced-index assignment; used for CPU tensors otherwise.

Bounds check
    ``check_bounds=True`` (default) reads ``min``/``max`` of ``indices`` back to the host and
    raises ``IndexError`` before anything is written: a host sync, which a CUDA graph cannot
    capture. ``check_bounds=False`` skips it (for indices validated when they were built, e.g. an
    allocator's own output) and relies on the *device-side guard*: the kernel writes nothing for a
    row whose index is outside ``[0, num_slots)``, so a bad index can never write outside the
    cache; such rows are silently dropped (the torch backend drops them too, with a host sync: it is
    not the path a CUDA graph captures).

Reading order
    The torch backend first (the reference the kernel must equal bit for bit), then the Triton
    kernel :func:`store_cache_kernel`, its launcher :func:`launch_store_cache_kernel` (the tile
    and grid of :func:`store_launch_shape`, one launch), and the checked entry points. The
    argument checks are in :mod:`kvcache.kernels.checks`; the benchmark is
    ``benchmarks/store_kv.py``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .._validate import as_device
from .checks import check_no_self_overlap, paged_geometry, validate_store_args

#: Whether Triton is installed (Linux only): without it every call takes the torch backend.
HAVE_TRITON: bool
try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is a dependency, but keep the torch path usable
    HAVE_TRITON = False

__all__ = [
    "HAVE_TRITON",
    "TRITON_INTERPRET",
    "check_no_self_overlap",
    "launch_store_cache_kernel",
    "store_cache",
    "store_cache_backend",
    "store_cache_torch",
    "store_cache_triton",
    "store_launch_shape",
]
if HAVE_TRITON:
    __all__ += ["store_cache_kernel"]

#: Whether ``TRITON_INTERPRET=1`` was set when this module was imported (triton reads it then too).
TRITON_INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Upper bound on the (heads x head_dim) elements one program copies per token and tensor.
_MAX_TILE = 4096
# Upper bound on the elements one program copies per tensor over its whole block of tokens:
# enough work per program for small batches, few enough registers on a GPU.
_MAX_BLOCK_ELEMS = 8192
_MAX_BLOCK_N = 128


def store_cache_backend(device: torch.device | str) -> str:
    """Which backend :func:`store_cache` uses for tensors on ``device``.

    Returns ``"triton"`` (CUDA), ``"triton-interpreter"`` (CPU with ``TRITON_INTERPRET=1`` set
    before import) or ``"torch"`` (anything else).
    """
    dev = as_device(device)
    if HAVE_TRITON and dev.type in ("cuda", "cpu") and TRITON_INTERPRET:
        return "triton-interpreter"  # with the env var set, Triton interprets CUDA launches too
    if HAVE_TRITON and dev.type == "cuda":
        return "triton"
    return "torch"


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def store_launch_shape(n: int, heads: int, head_dim: int) -> dict[str, Any]:
    """The launch :func:`store_cache` makes for ``n`` tokens of ``heads x head_dim``.

    Returns ``{"grid": (token blocks, head blocks), "BLOCK_N": ..., "BLOCK_H": ..., "BLOCK_D": ...,
    "num_warps": 4}``: ``BLOCK_D`` is ``head_dim`` rounded up to a power of two, ``BLOCK_H`` as
    many heads as fit in ``_MAX_TILE`` elements, ``BLOCK_N`` as many tokens (at most
    ``_MAX_BLOCK_N``, at most ``n`` rounded up) as keep a program's tile within
    ``_MAX_BLOCK_ELEMS`` elements; four warps (128 threads) copy a program's tiles.
    """
    block_d = _next_pow2(head_dim)
    block_h = max(1, min(_next_pow2(heads), _MAX_TILE // block_d))
    block_n = max(1, min(_next_pow2(n), _MAX_BLOCK_N, _MAX_BLOCK_ELEMS // (block_h * block_d)))
    grid = (-(-n // block_n), -(-heads // block_h))
    return dict(grid=grid, BLOCK_N=block_n, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4)


# ---------------------------------------------------------------------------------------------
# Torch backend
# ---------------------------------------------------------------------------------------------


def _store_torch(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    indices: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    guard: bool = False,
) -> None:
    """``guard``: drop rows whose index is out of range (the kernel's device-side guard)."""
    if k_cache.requires_grad or v_cache.requires_grad or k.requires_grad or v.requires_grad:
        # Written outside autograd, as the Triton kernel writes: torch refuses an in-place write
        # to a leaf that requires grad (after K had been written, not V), and a graph would
        # otherwise grow on the cache with every store.
        with torch.no_grad():
            _store_torch(k_cache.detach(), v_cache.detach(), indices, k.detach(), v.detach(), guard)
        return
    idx = indices.long()
    if guard:
        num_slots = k_cache.shape[0] * (k_cache.shape[1] if k_cache.dim() == 4 else 1)
        keep = (idx >= 0) & (idx < num_slots)
        if not bool(keep.all()):
            idx, k, v = idx[keep], k[keep], v[keep]
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
    k_cache, v_cache, k, v = validate_store_args(k_cache, v_cache, indices, k, v, check_bounds)
    if indices.numel():
        _store_torch(k_cache, v_cache, indices, k, v, guard=not check_bounds)


# ---------------------------------------------------------------------------------------------
# Triton backend
# ---------------------------------------------------------------------------------------------

if HAVE_TRITON:

    @triton.jit  # type: ignore[untyped-decorator]  # triton ships no type information
    def store_cache_kernel(  # type: ignore[no-untyped-def]  # Triton types the parameters
        k_cache_ptr,
        v_cache_ptr,
        indices_ptr,
        k_ptr,
        v_ptr,
        n,
        num_slots,
        heads,
        head_dim,
        page_size,
        stride_i,
        # cache strides: page, in-page slot, head, dim (K and V may differ)
        stride_kc_p,
        stride_kc_s,
        stride_kc_h,
        stride_kc_d,
        stride_vc_p,
        stride_vc_s,
        stride_vc_h,
        stride_vc_d,
        # source strides: token, head, dim
        stride_k_n,
        stride_k_h,
        stride_k_d,
        stride_v_n,
        stride_v_h,
        stride_v_d,
        BLOCK_N: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """Program (i, j): tokens [i*BLOCK_N, (i+1)*BLOCK_N), heads [j*BLOCK_H, (j+1)*BLOCK_H), K and V."""
        pid_n = tl.program_id(0)
        pid_h = tl.program_id(1)
        # int64 so that token * stride and slot * stride cannot overflow on large tensors.
        rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        in_batch = rows < n
        slot = tl.load(indices_ptr + rows * stride_i, mask=in_batch, other=-1).to(tl.int64)
        # Device-side guard: a row whose slot is outside the cache writes nothing.
        ok = in_batch & (slot >= 0) & (slot < num_slots)
        slot = tl.where(ok, slot, 0)
        page = slot // page_size
        offset = slot % page_size

        offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        # (BLOCK_N, BLOCK_H, BLOCK_D) tiles: token, head, element.
        r3 = rows[:, None, None]
        h3 = offs_h[None, :, None]
        d3 = offs_d[None, None, :]
        mask = ok[:, None, None] & (h3 < heads) & (d3 < head_dim)

        # Both loads are issued before either store, so the reads of K and V are in flight
        # together (a store may alias a load's memory for all the compiler knows, so it would
        # not move a load above it).
        k_tile = tl.load(k_ptr + r3 * stride_k_n + h3 * stride_k_h + d3 * stride_k_d, mask=mask)
        v_tile = tl.load(v_ptr + r3 * stride_v_n + h3 * stride_v_h + d3 * stride_v_d, mask=mask)
        k_dst = (
            k_cache_ptr
            + (page * stride_kc_p + offset * stride_kc_s)[:, None, None]
            + h3 * stride_kc_h
            + d3 * stride_kc_d
        )
        v_dst = (
            v_cache_ptr
            + (page * stride_vc_p + offset * stride_vc_s)[:, None, None]
            + h3 * stride_vc_h
            + d3 * stride_vc_d
        )
        tl.store(k_dst, k_tile, mask=mask)
        tl.store(v_dst, v_tile, mask=mask)


def launch_store_cache_kernel(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    indices: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Launch :func:`store_cache_kernel` on arguments already checked (``validate_store_args``
    returns them so): the launcher's arithmetic, then one launch. It checks nothing itself; the
    kernel's device-side guard still keeps a slot outside the cache from being written."""
    num_pages, page_size, heads, head_dim, *kc_strides = paged_geometry(k_cache, "k_cache")
    vc_strides = paged_geometry(v_cache, "v_cache")[4:]
    n = indices.shape[0]
    shape = store_launch_shape(n, heads, head_dim)
    store_cache_kernel[shape["grid"]](
        k_cache,
        v_cache,
        indices,
        k,
        v,
        n,
        num_pages * page_size,
        heads,
        head_dim,
        page_size,
        indices.stride(0),
        *kc_strides,
        *vc_strides,
        *k.stride(),
        *v.stride(),
        BLOCK_N=shape["BLOCK_N"],
        BLOCK_H=shape["BLOCK_H"],
        BLOCK_D=shape["BLOCK_D"],
        num_warps=shape["num_warps"],
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
    k_cache, v_cache, k, v = validate_store_args(k_cache, v_cache, indices, k, v, check_bounds)
    if store_cache_backend(k_cache.device) not in ("triton", "triton-interpreter"):
        raise RuntimeError(
            f"the Triton store kernel cannot run on {k_cache.device}: it needs CUDA, or the CPU "
            "with TRITON_INTERPRET=1 set before kvcache is imported"
        )
    if indices.numel():
        launch_store_cache_kernel(k_cache, v_cache, indices, k, v)


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
    As in mini-sglang, ``k`` and ``v`` may also be rows ``(n, heads * head_dim)``, and the caches
    rows ``(num_slots, row)`` (with sources ``(n, row)``).
    The backend is :func:`store_cache_backend` of the caches' device.

    Raises, before writing anything: ``TypeError`` for a non-tensor argument; ``ValueError`` for
    mismatched shapes, dtypes or devices; ``IndexError`` for an index outside ``[0, num_slots)``
    (this check reads the indices back to the host). ``check_bounds=False`` skips it, so the call
    makes no host sync and a CUDA graph can capture it; a row whose index is out of range is then
    dropped (not written) by the device-side guard instead of raising. Any view of any argument
    is read through its strides; a cache that overlaps itself raises ``ValueError``. With
    duplicate indices, which token's row ends up in the slot is unspecified.
    """
    k_cache, v_cache, k, v = validate_store_args(k_cache, v_cache, indices, k, v, check_bounds)
    if indices.numel() == 0:
        return
    if store_cache_backend(k_cache.device) == "torch":
        _store_torch(k_cache, v_cache, indices, k, v, guard=not check_bounds)
    else:
        launch_store_cache_kernel(k_cache, v_cache, indices, k, v)
