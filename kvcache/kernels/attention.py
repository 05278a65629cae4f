"""Attention that reads K/V from one layer of a paged cache through token slots.

The functions take tensors, never a pool: ``k_cache`` and ``v_cache`` are one layer's keys and
values, either paged ``(num_pages, page_size, kv_heads, head_dim)`` (what
``MHAKVCache.k_cache(layer)`` / ``v_cache(layer)`` return, any layout) or flat
``(num_slots, kv_heads, head_dim)``; slot ``s`` is ``[s // page_size, s % page_size]`` of a
paged cache (``page_size`` is ``k_cache.shape[1]``), row ``s`` of a flat one. Any strides, any
view (sliced, transposed, expanded, offset): the torch code indexes the views and the Triton
kernels are given every stride. Callers with a pool write
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

The module reads as a Triton tutorial does: the torch reference (:func:`paged_attention`, what
the kernels are checked against), the two decode kernels, then their host wrapper
(:func:`paged_decode_attention`). The argument checks are in :mod:`kvcache.kernels.checks`; the
benchmark is ``benchmarks/paged_decode.py``.

Flash decoding: the design of the decode kernels
    Decode reads every cached K and V once and does little arithmetic with them, so its speed
    is memory bandwidth, which a GPU reaches only with many loads in flight: many programs. One
    program per (request, KV head) is too few at small batches (32 requests x 8 KV heads = 256
    programs for an H200's 132 SMs, each walking 4096 slots one tile after the other), so each
    request's slots are split over ``num_splits`` programs (split-K):

    1. :func:`decode_partial_kernel`, grid ``(B, kv_heads, num_splits)``: program ``(b, h, s)``
       walks split ``s`` of request ``b``'s slots ``BLOCK_N`` at a time (whole pages when the
       page size divides ``BLOCK_N`` and the slots fill pages in order) for the ``group`` query
       heads of KV head ``h`` together, so K and V are read once per group, keeping the running
       maximum ``m`` and sum ``l`` of the online softmax. It writes its split's normalised output
       and log-sum-exp ``m + log2(l)``.
    2. :func:`decode_combine_kernel`, grid ``(B, num_q_heads)``: weighs each split's output by
       ``2 ** (lse_s - max_s lse_s)`` and divides by the sum of the weights, which is the
       softmax over all of the request's slots, as one program would have computed it.

    :func:`decode_launch_shape` chooses ``num_splits`` from ``B x kv_heads`` against the
    number of SMs. With one split, stage 1 writes the output itself and stage 2 is not
    launched. Nothing in the call reads a value back to the host but the optional range check.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import Any

import torch

from .checks import (
    MAX_SPLITS,
    check_block_n,
    check_caches,
    check_num_splits,
    check_q,
    check_q_lens,
    check_slots,
    default_scale,
    flatten_slots,
)
from .store import HAVE_TRITON, store_cache_backend

if HAVE_TRITON:
    import triton
    import triton.language as tl

__all__ = [
    "MIN_SPLIT_SLOTS",
    "PROGRAMS_PER_SM",
    "decode_launch_shape",
    "gather_kv",
    "paged_attention",
    "paged_decode_attention",
    "paged_decode_backend",
]
if HAVE_TRITON:
    __all__ += ["decode_combine_kernel", "decode_partial_kernel"]

#: Programs the decode kernel aims to give each SM: enough loads in flight to keep memory busy.
PROGRAMS_PER_SM = 4
#: The fewest slots worth a split of their own: below it, a program's fixed cost (loading q,
#: writing its partial output) weighs on its few loads.
MIN_SPLIT_SLOTS = 128


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
# Triton decode kernels (flash decoding: split-K, then combine)
# ---------------------------------------------------------------------------------------------

if HAVE_TRITON:

    @triton.jit  # type: ignore[untyped-decorator]  # triton ships no type information
    def decode_partial_kernel(  # type: ignore[no-untyped-def]  # Triton types the parameters
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        slots_ptr,
        starts_ptr,
        out_ptr,
        part_o_ptr,
        part_lse_ptr,
        qk_scale,
        num_slots,
        page_size,
        head_dim,
        stride_q_b,
        stride_q_h,
        stride_q_d,
        # cache strides: page, in-page slot, head, dim (K and V may differ)
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
        NUM_SPLITS: tl.constexpr,
        DOT_F32: tl.constexpr,
    ):
        """Program (b, h, s): split s of request b's slots, for the GROUP query heads of KV
        head h; the split's output and log-sum-exp (or, with one split, the output itself)."""
        pid_b = tl.program_id(0)
        pid_h = tl.program_id(1)
        pid_s = tl.program_id(2)
        # The split's slots are [lo, hi) of the flat list: a whole number of BLOCK_N tiles from
        # the request's first slot, so that tiles start on page boundaries.
        start = tl.load(starts_ptr + pid_b)
        end = tl.load(starts_ptr + pid_b + 1)
        split_len = tl.cdiv(tl.cdiv(end - start, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = start + pid_s * split_len
        hi = tl.minimum(lo + split_len, end)

        offs_g = tl.arange(0, BLOCK_G)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        q_heads = pid_h * GROUP + offs_g
        mask_g = offs_g < GROUP
        mask_d = offs_d < head_dim
        # The group's queries, (BLOCK_G, BLOCK_D), in the cache's dtype for tl.dot; padded rows
        # and columns are zeros.
        q = tl.load(
            q_ptr
            + pid_b * stride_q_b
            + q_heads[:, None] * stride_q_h
            + offs_d[None, :] * stride_q_d,
            mask=mask_g[:, None] & mask_d[None, :],
            other=0.0,
        ).to(k_cache_ptr.dtype.element_ty)
        if DOT_F32:  # Triton's CPU interpreter multiplies bfloat16 tiles as raw integer bits
            q = q.to(tl.float32)

        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)  # running max (log2 units)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)  # running sum of 2 ** (score - m_i)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)  # running sum of weights x V
        for n0 in range(lo, hi, BLOCK_N):
            offs = n0 + offs_n
            slot = tl.load(slots_ptr + offs, mask=offs < hi, other=0).to(tl.int64)
            # Device-side guard: a slot outside the cache is read as if absent.
            valid = (offs < hi) & (slot >= 0) & (slot < num_slots)
            slot = tl.where(valid, slot, 0)
            page = slot // page_size
            in_page = slot % page_size
            kv_mask = valid[:, None] & mask_d[None, :]
            k_rows = page * stride_kc_p + in_page * stride_kc_s + pid_h * stride_kc_h
            v_rows = page * stride_vc_p + in_page * stride_vc_s + pid_h * stride_vc_h
            k = tl.load(
                k_cache_ptr + k_rows[:, None] + offs_d[None, :] * stride_kc_d,
                mask=kv_mask,
                other=0.0,
            )  # (BLOCK_N, BLOCK_D)
            v = tl.load(
                v_cache_ptr + v_rows[:, None] + offs_d[None, :] * stride_vc_d,
                mask=kv_mask,
                other=0.0,
            )
            if DOT_F32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            # Scores in log2 units (qk_scale = scale * log2(e)), so that exp2 is the softmax's exp.
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # (BLOCK_G, BLOCK_N)
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # Until a valid slot is seen the max is -inf: measure from 0 then, which keeps the
            # weights 0 instead of NaN (and acc and l_i are still 0).
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_ref)  # rescales what was summed under the old max
            p = tl.exp2(s - m_ref[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            m_i = m_new

        has = l_i > 0  # False only where every slot of the split was out of range (or none)
        o = acc / tl.where(has, l_i, 1.0)[:, None]
        if NUM_SPLITS == 1:
            o_ptrs = (
                out_ptr
                + pid_b * stride_o_b
                + q_heads[:, None] * stride_o_h
                + offs_d[None, :] * stride_o_d
            )
            tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])
        else:
            # Partials are (B, num_q_heads, NUM_SPLITS, BLOCK_D) and (B, num_q_heads, NUM_SPLITS).
            row = (pid_b * tl.num_programs(1) * GROUP + q_heads) * NUM_SPLITS + pid_s
            tl.store(part_o_ptr + row[:, None] * BLOCK_D + offs_d[None, :], o, mask=mask_g[:, None])
            lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
            tl.store(part_lse_ptr + row, lse, mask=mask_g)

    @triton.jit  # type: ignore[untyped-decorator]
    def decode_combine_kernel(  # type: ignore[no-untyped-def]
        part_o_ptr,
        part_lse_ptr,
        out_ptr,
        head_dim,
        stride_o_b,
        stride_o_h,
        stride_o_d,
        NUM_SPLITS: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """Program (b, j): query head j of request b, its NUM_SPLITS partial outputs combined."""
        pid_b = tl.program_id(0)
        pid_q = tl.program_id(1)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        mask_s = offs_s < NUM_SPLITS
        rows = (pid_b * tl.num_programs(1) + pid_q) * NUM_SPLITS + offs_s
        lse = tl.load(part_lse_ptr + rows, mask=mask_s, other=float("-inf"))
        top = tl.max(lse, axis=0)
        # Split s saw sum 2 ** lse_s of the weights; relative to the largest, 2 ** (lse_s - top).
        w = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))  # 0 for an empty split
        o = tl.load(
            part_o_ptr + rows[:, None] * BLOCK_D + offs_d[None, :], mask=mask_s[:, None], other=0.0
        )
        total = tl.sum(w, axis=0)
        out = tl.sum(w[:, None] * o, axis=0) / tl.where(total > 0, total, 1.0)
        o_ptrs = out_ptr + pid_b * stride_o_b + pid_q * stride_o_h + offs_d * stride_o_d
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=offs_d < head_dim)


# ---------------------------------------------------------------------------------------------
# Host side: the launch shape and the wrapper
# ---------------------------------------------------------------------------------------------


def _pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def decode_launch_shape(
    batch: int,
    kv_heads: int,
    group: int,
    head_dim: int,
    longest: int,
    *,
    block_n: int = 32,
    num_splits: int | None = None,
    num_sms: int = 1,
) -> dict[str, Any]:
    """The launches :func:`paged_decode_attention` makes for ``batch`` requests (the longest
    ``longest`` slots) of ``kv_heads x group`` query heads of ``head_dim``, on a device of
    ``num_sms`` SMs (1 for the CPU's interpreter).

    Returns ``{"grid": (batch, kv_heads, NUM_SPLITS), "combine_grid": (batch, q_heads) or None,
    "NUM_SPLITS", "BLOCK_N", "BLOCK_G", "BLOCK_D", "BLOCK_S", "num_warps", "num_stages"}``.
    ``BLOCK_G``, ``BLOCK_D`` and ``BLOCK_N`` are the group, ``head_dim`` and ``block_n`` rounded
    up to powers of two of at least 16 (the smallest tile ``tl.dot`` takes). Unless given,
    ``NUM_SPLITS`` is the number of splits that gives the SMs :data:`PROGRAMS_PER_SM` programs
    each, at most one per :data:`MIN_SPLIT_SLOTS` slots of the longest request and at most
    ``MAX_SPLITS``; with one split there is no combine launch.
    """
    block = max(16, _pow2(block_n))
    if num_splits is None:
        wanted = -(-PROGRAMS_PER_SM * num_sms // (batch * kv_heads))
        useful = -(-longest // max(MIN_SPLIT_SLOTS, block))
        num_splits = max(1, min(wanted, useful, MAX_SPLITS))
    return dict(
        grid=(batch, kv_heads, num_splits),
        combine_grid=(batch, kv_heads * group) if num_splits > 1 else None,
        NUM_SPLITS=num_splits,
        BLOCK_N=block,
        BLOCK_G=max(16, _pow2(group)),
        BLOCK_D=max(16, _pow2(head_dim)),
        BLOCK_S=_pow2(num_splits),
        num_warps=4,
        num_stages=2,
    )


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """SMs of a CUDA device (asked once per device); 1 elsewhere."""
    if device.type != "cuda":
        return 1
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def _request_starts(seq_lens: list[int], device: torch.device) -> torch.Tensor:
    """``(B + 1,)`` int64 on ``device``: where each request's slots start in the flat list, and
    where the last ends. On CUDA, copied from pinned memory without blocking: no sync."""
    starts = torch.tensor(
        [0, *itertools.accumulate(seq_lens)], dtype=torch.int64, pin_memory=device.type == "cuda"
    )
    return starts.to(device, non_blocking=True)


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
    num_splits: int | None = None,
    check_bounds: bool = True,
) -> torch.Tensor:
    """Decode attention (one query token per request) with the Triton kernels (flash decoding).

    ``q``: ``(B, num_q_heads, head_dim)``, row ``r`` is the last token of request ``r``;
    ``k_cache``, ``v_cache``: the layer, as for :func:`paged_attention`; ``slots[r]``:
    ``(T_r,)``, all of request ``r``'s tokens including that one. Returns
    ``(B, num_q_heads, head_dim)`` in ``q.dtype``; equals
    ``paged_attention(q, k_cache, v_cache, slots)`` up to float rounding (the kernels multiply
    in the cache's dtype and accumulate in float32). Runs the Triton kernels on CUDA or under
    ``TRITON_INTERPRET=1``, and falls back to :func:`paged_attention` elsewhere (see
    :func:`paged_decode_backend`).

    ``block_n``: slots per step (a power of two; tiles are at least 16). ``num_splits``: how
    many programs share each request's slots (``None``: :func:`decode_launch_shape` chooses from
    the batch and the device). ``check_bounds=False`` skips the range check of the slots (one
    read-back to the host for the batch), for slots already checked: the call then makes no
    host sync, and the kernel skips a slot outside the cache (reads nothing for it) instead of
    raising; a request none of whose slots is in range gets zeros.
    """
    geo = check_caches(k_cache, v_cache)
    flat_slots, seq_lens = flatten_slots(geo, slots, check_bounds)
    group = check_q(q, geo, len(seq_lens))
    block_n = check_block_n(block_n, group, geo.head_dim)
    num_splits = check_num_splits(num_splits)
    sm_scale = default_scale(scale, geo.head_dim)
    backend = paged_decode_backend(q.device)
    if backend == "torch":
        return paged_attention(q, k_cache, v_cache, slots, None, sm_scale, check_bounds=False)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if not seq_lens:
        return out

    shape = decode_launch_shape(
        len(seq_lens),
        geo.kv_heads,
        group,
        geo.head_dim,
        max(seq_lens),
        block_n=block_n,
        num_splits=num_splits,
        num_sms=_multiprocessors(q.device),
    )
    splits, block_d = shape["NUM_SPLITS"], shape["BLOCK_D"]
    # Stage 1's partial outputs and log-sum-exps, float32; with one split stage 1 writes `out`
    # itself and never touches them, so `out` stands in.
    part_o, part_lse = out, out
    if splits > 1:
        part_o = torch.empty((*q.shape[:2], splits, block_d), device=q.device)
        part_lse = torch.empty((*q.shape[:2], splits), device=q.device)
    kc = k_cache if k_cache.dim() == 4 else k_cache.unsqueeze(1)  # flat: pages of one slot
    vc = v_cache if v_cache.dim() == 4 else v_cache.unsqueeze(1)
    decode_partial_kernel[shape["grid"]](
        q,
        kc,
        vc,
        flat_slots,
        _request_starts(seq_lens, q.device),
        out,
        part_o,
        part_lse,
        sm_scale * 1.4426950408889634,  # log2(e): the kernel's exp2 is exp
        geo.num_slots,
        geo.page_size,
        geo.head_dim,
        *q.stride(),
        *kc.stride(),
        *vc.stride(),
        *out.stride(),
        GROUP=group,
        BLOCK_G=shape["BLOCK_G"],
        BLOCK_N=shape["BLOCK_N"],
        BLOCK_D=block_d,
        NUM_SPLITS=splits,
        DOT_F32=backend == "triton-interpreter" and kc.dtype == torch.bfloat16,
        num_warps=shape["num_warps"],
        num_stages=shape["num_stages"],
    )
    if shape["combine_grid"] is not None:
        decode_combine_kernel[shape["combine_grid"]](
            part_o,
            part_lse,
            out,
            geo.head_dim,
            *out.stride(),
            NUM_SPLITS=splits,
            BLOCK_S=shape["BLOCK_S"],
            BLOCK_D=block_d,
        )
    return out
