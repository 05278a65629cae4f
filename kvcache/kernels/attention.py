"""Attention that reads K/V from one layer of a paged cache through token slots.

The functions take tensors, never a pool: ``k_cache`` and ``v_cache`` are one layer's keys and
values, either paged ``(num_pages, page_size, kv_heads, head_dim)`` (what
``MHAKVCache.k_cache(layer)`` / ``v_cache(layer)`` return, any layout) or flat
``(num_slots, kv_heads, head_dim)``; slot ``s`` is ``[s // page_size, s % page_size]`` of a
paged cache (``page_size`` is ``k_cache.shape[1]``), row ``s`` of a flat one. Any strides, any
view (sliced, transposed, expanded, offset): the torch code indexes the views and the Triton
kernel is given every stride. Callers with a pool write
``paged_attention(q, pool.k_cache(layer), pool.v_cache(layer), slots, q_lens)``.

Batch format (both functions)
    A batch of ``B`` requests. Request ``r`` has ``T_r = len(slots[r])`` tokens whose K/V are
    already in the cache (store the new tokens' K/V *before* attending), and ``q_lens[r]`` query
    tokens: its *last* ``q_lens[r]`` tokens, so query ``j`` sits at position
    ``T_r - q_lens[r] + j`` and, causally, sees keys ``0 .. T_r - q_lens[r] + j``.
    Decode is ``q_lens[r] == 1``; a prefill that reuses a cached prefix of length ``c`` is
    ``q_lens[r] == T_r - c``.

    ``q``: ``(sum(q_lens), num_q_heads, head_dim)``, requests packed one after another.
    GQA: ``num_q_heads = group * kv_heads``; query head ``h`` uses KV head ``h // group``
    (the convention of ``repeat_interleave`` / ``scaled_dot_product_attention(enable_gqa=True)``).
    Output has the shape and dtype of ``q`` (contiguous); scores are computed in float32.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .attention_checks import (
    check_block_n,
    check_caches,
    check_q,
    check_q_lens,
    check_slots,
    default_scale,
)
from .store import _HAVE_TRITON, store_cache_backend

if _HAVE_TRITON:
    import triton
    import triton.language as tl

__all__ = [
    "gather_kv",
    "paged_attention",
    "paged_decode_attention",
    "paged_decode_backend",
]


# ---------------------------------------------------------------------------------------------
# Torch reference
# ---------------------------------------------------------------------------------------------


def _rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``(T, kv_heads, head_dim)``: the cache rows of ``slots`` (a copy)."""
    s = slots.long()
    if cache.dim() == 3:
        return cache[s]
    page_size = cache.shape[1]
    return cache[s // page_size, s % page_size]


def gather_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the tokens at ``slots`` (``(T,)``): each ``(T, kv_heads, head_dim)``.

    ``k_cache``, ``v_cache``: one layer, paged or flat (see the module docstring).
    """
    geo = check_caches(k_cache, v_cache)
    check_slots(geo, [slots])
    return _rows(k_cache, slots), _rows(v_cache, slots)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: Sequence[torch.Tensor],
    q_lens: Sequence[int] | None = None,
    scale: float | None = None,
    *,
    check_bounds: bool = True,
) -> torch.Tensor:
    """Causal (GQA) attention for a batch of requests whose K/V sit in one layer's cache. Torch reference.

    ``q``: ``(sum(q_lens), num_q_heads, head_dim)``; ``k_cache``, ``v_cache``: the layer,
    ``(num_pages, page_size, kv_heads, head_dim)`` or ``(num_slots, kv_heads, head_dim)``;
    ``slots[r]``: ``(T_r,)`` token slots of request ``r`` in order; ``q_lens[r]`` in ``[1, T_r]``
    (default: all 1, i.e. decode); ``scale`` defaults to ``1/sqrt(head_dim)``. Returns
    ``(sum(q_lens), num_q_heads, head_dim)`` in ``q.dtype``. See the module docstring for
    positions and the causal mask. Raises ``TypeError``/``ValueError`` for bad arguments and
    ``IndexError`` for a slot outside the cache. ``check_bounds=False`` skips that range check
    (one read-back of the slots to the host, a sync on a GPU), for slots the caller has already
    checked, e.g. once per forward pass rather than once per layer; a slot out of range then
    fails inside torch's indexing.
    """
    geo = check_caches(k_cache, v_cache)
    seq_lens = check_slots(geo, slots, check_bounds)
    q_lens = [1] * len(seq_lens) if q_lens is None else check_q_lens(q_lens, seq_lens)
    group = check_q(q, geo, sum(q_lens))
    sm_scale = default_scale(scale, geo.head_dim)

    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    start = 0
    for s, ql, t in zip(slots, q_lens, seq_lens, strict=True):
        # (T, kv_heads, D) -> (q_heads, T, D): query head h reads KV head h // group.
        k = _rows(k_cache, s).float().repeat_interleave(group, dim=1).transpose(0, 1)
        v = _rows(v_cache, s).float().repeat_interleave(group, dim=1).transpose(0, 1)
        qr = q[start : start + ql].float().transpose(0, 1)  # (q_heads, ql, D)
        scores = (qr @ k.transpose(1, 2)) * sm_scale  # (q_heads, ql, T)
        q_pos = torch.arange(t - ql, t, device=q.device)[:, None]
        k_pos = torch.arange(t, device=q.device)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        out[start : start + ql] = (scores.softmax(dim=-1) @ v).transpose(0, 1).to(q.dtype)
        start += ql
    return out


# ---------------------------------------------------------------------------------------------
# Triton decode kernel
# ---------------------------------------------------------------------------------------------

if _HAVE_TRITON:

    @triton.jit  # type: ignore[untyped-decorator]  # triton ships no type information
    def _decode_kernel(  # type: ignore[no-untyped-def]  # Triton types the parameters
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        slots_ptr,
        starts_ptr,
        out_ptr,
        sm_scale,
        head_dim,
        page_size,
        num_slots,
        stride_q_b,
        stride_q_h,
        stride_q_d,
        stride_kc_p,
        stride_kc_s,
        stride_kc_h,
        stride_kc_d,
        stride_vc_p,
        stride_vc_s,
        stride_vc_h,
        stride_vc_d,
        stride_o_b,
        stride_o_h,
        stride_o_d,
        GROUP: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """Program (b, h): request b's one query token, the GROUP query heads sharing KV head h.

        Walks the request's slots BLOCK_N at a time with an online softmax, so K/V of a KV head
        are read once for all the query heads of its group.
        """
        pid_b = tl.program_id(0)
        pid_h = tl.program_id(1)
        start = tl.load(starts_ptr + pid_b)
        end = tl.load(starts_ptr + pid_b + 1)

        offs_g = tl.arange(0, BLOCK_G)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        mask_g = offs_g < GROUP
        mask_d = offs_d < head_dim
        q_heads = pid_h * GROUP + offs_g

        q_ptrs = (
            q_ptr
            + pid_b * stride_q_b
            + q_heads[:, None] * stride_q_h
            + offs_d[None, :] * stride_q_d
        )
        q = tl.load(q_ptrs, mask=mask_g[:, None] & mask_d[None, :], other=0.0).to(tl.float32)

        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        for n0 in range(start, end, BLOCK_N):
            offs = n0 + offs_n
            slot = tl.load(slots_ptr + offs, mask=offs < end, other=0).to(tl.int64)
            # Device-side guard: a slot outside the cache is read as if absent.
            mask_n = (offs < end) & (slot >= 0) & (slot < num_slots)
            slot = tl.where(mask_n, slot, 0)
            page = slot // page_size
            in_page = slot % page_size
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k_ptrs = (
                k_cache_ptr
                + (page * stride_kc_p + in_page * stride_kc_s + pid_h * stride_kc_h)[:, None]
                + offs_d[None, :] * stride_kc_d
            )
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(tl.float32)  # (BLOCK_N, BLOCK_D)
            # (G, 1, D) * (1, N, D) summed over D: tl.dot needs every dim >= 16, G is often 1..8.
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * sm_scale  # (BLOCK_G, BLOCK_N)
            s = tl.where(mask_n[None, :], s, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)

            v_ptrs = (
                v_cache_ptr
                + (page * stride_vc_p + in_page * stride_vc_s + pid_h * stride_vc_h)[:, None]
                + offs_d[None, :] * stride_vc_d
            )
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0).to(tl.float32)  # (BLOCK_N, BLOCK_D)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m_i = m_new

        out = acc / l_i[:, None]
        o_ptrs = (
            out_ptr
            + pid_b * stride_o_b
            + q_heads[:, None] * stride_o_h
            + offs_d[None, :] * stride_o_d
        )
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])


def paged_decode_backend(device: torch.device | str) -> str:
    """``"triton"``, ``"triton-interpreter"`` or ``"torch"``: what :func:`paged_decode_attention` uses.

    The same rule as the store kernel's, so a pool's writes and reads always take the same path.
    """
    return store_cache_backend(device)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: Sequence[torch.Tensor],
    scale: float | None = None,
    *,
    block_n: int = 32,
    check_bounds: bool = True,
) -> torch.Tensor:
    """Decode attention (one query token per request) with the Triton kernel.

    ``q``: ``(B, num_q_heads, head_dim)``, row ``r`` is the last token of request ``r``;
    ``k_cache``, ``v_cache``: the layer, as for :func:`paged_attention`; ``slots[r]``:
    ``(T_r,)``, all of request ``r``'s tokens including that one. Returns
    ``(B, num_q_heads, head_dim)`` in ``q.dtype``; equals
    ``paged_attention(q, k_cache, v_cache, slots)`` up to float rounding. Runs the Triton kernel on
    CUDA or under ``TRITON_INTERPRET=1``, and falls back to :func:`paged_attention` elsewhere
    (see :func:`paged_decode_backend`). ``check_bounds=False`` skips the range check of the slots
    (one read-back to the host for the batch), for slots already checked; the kernel then skips
    a slot outside the cache (reads nothing for it) instead of raising.
    """
    geo = check_caches(k_cache, v_cache)
    seq_lens = check_slots(geo, slots, check_bounds)
    group = check_q(q, geo, len(seq_lens))
    block_n = check_block_n(block_n, group, geo.head_dim)
    sm_scale = default_scale(scale, geo.head_dim)
    if paged_decode_backend(q.device) == "torch":
        return paged_attention(
            q, k_cache, v_cache, slots, [1] * len(seq_lens), sm_scale, check_bounds=check_bounds
        )
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if len(seq_lens) == 0:
        return out

    # One contiguous int64 copy of the logical slot values: what the bounds check read.
    flat_slots = torch.cat([s.to(torch.int64) for s in slots])
    starts = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)  # offsets into flat_slots
    starts[1:] = torch.tensor(seq_lens).cumsum(0)
    starts = starts.to(q.device)
    kc = k_cache if k_cache.dim() == 4 else k_cache.unsqueeze(1)  # flat: pages of one slot
    vc = v_cache if v_cache.dim() == 4 else v_cache.unsqueeze(1)
    grid = (len(seq_lens), geo.kv_heads)
    _decode_kernel[grid](
        q,
        kc,
        vc,
        flat_slots,
        starts,
        out,
        sm_scale,
        geo.head_dim,
        geo.page_size,
        geo.num_slots,
        *q.stride(),
        *kc.stride(),
        *vc.stride(),
        *out.stride(),
        GROUP=group,
        BLOCK_G=triton.next_power_of_2(group),
        BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(geo.head_dim),
    )
    return out
