"""Paged attention against plain dense attention (scaled_dot_product_attention on dense tensors).

The dense side never touches the pool: it keeps each request's K/V as ordinary tensors, so a
slot, page, stride or GQA-grouping mistake on the paged side shows up as a mismatch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import KVCacheLayout
from kvcache.kernels import TRITON_INTERPRET
from kvcache.kernels.attention import (
    MIN_SPLIT_SLOTS,
    PROGRAMS_PER_SM,
    decode_launch_shape,
    gather_kv,
    paged_attention,
    paged_decode_attention,
    paged_decode_backend,
)
from kvcache.kernels.checks import MAX_SPLITS
from kvcache.storage.mha_pool import MHAKVCache

needs_interpreter = pytest.mark.skipif(
    not TRITON_INTERPRET, reason="needs TRITON_INTERPRET=1 before import"
)
LAYER = 1


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale=None) -> torch.Tensor:
    """q ``(ql, Hq, D)`` = the last ql of T positions; k, v ``(T, Hkv, D)``; causal; in fp32."""
    ql, t = q.shape[0], k.shape[0]
    mask = torch.ones(ql, t, dtype=torch.bool).tril(diagonal=t - ql)
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None],
        k.float().transpose(0, 1)[None],
        v.float().transpose(0, 1)[None],
        attn_mask=mask,
        enable_gqa=True,
        scale=scale,
    )
    return out[0].transpose(0, 1)


class Batch:
    """Requests whose K/V are both in a pool (at scattered slots) and kept densely."""

    def __init__(
        self, layout, page_size, kv_heads, group, head_dim, seq_lens, seed, dtype=torch.float32
    ):
        self.g = torch.Generator().manual_seed(seed)
        num_pages = -(-sum(seq_lens) // page_size) + 2
        self.pool = MHAKVCache(
            kv_heads, 2, head_dim, num_pages, dtype, layout, "cpu", page_size=page_size
        )
        self.q_heads = kv_heads * group
        self.dtype = dtype
        self.free = torch.randperm(self.pool.num_slots, generator=self.g).to(torch.int32).tolist()
        self.slots: list[torch.Tensor] = [torch.empty(0, dtype=torch.int32) for _ in seq_lens]
        self.k: list[torch.Tensor] = [
            torch.empty(0, kv_heads, head_dim, dtype=dtype) for _ in seq_lens
        ]
        self.v: list[torch.Tensor] = [
            torch.empty(0, kv_heads, head_dim, dtype=dtype) for _ in seq_lens
        ]
        self.extend(list(seq_lens))

    def extend(self, new_lens: list[int]) -> None:
        """Append new tokens to each request: fresh slots, K/V stored with one store_kv call."""
        slots, ks, vs = [], [], []
        for r, n in enumerate(new_lens):
            s = torch.tensor([self.free.pop() for _ in range(n)], dtype=torch.int32)
            k = torch.randn(n, *self.pool.k_cache(0).shape[2:], generator=self.g).to(self.dtype)
            v = torch.randn(n, *self.pool.k_cache(0).shape[2:], generator=self.g).to(self.dtype)
            self.slots[r] = torch.cat([self.slots[r], s])
            self.k[r], self.v[r] = torch.cat([self.k[r], k]), torch.cat([self.v[r], v])
            slots.append(s), ks.append(k), vs.append(v)
        self.pool.store_kv(torch.cat(ks), torch.cat(vs), torch.cat(slots), LAYER)

    def layer(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The (k_cache, v_cache) views of the layer the batch lives in: what attention takes."""
        return self.pool.k_cache(LAYER), self.pool.v_cache(LAYER)

    def queries(self, q_lens: list[int]) -> torch.Tensor:
        return torch.randn(sum(q_lens), self.q_heads, self.pool.head_dim, generator=self.g).to(
            self.dtype
        )

    def dense(self, q: torch.Tensor, q_lens: list[int], scale=None) -> torch.Tensor:
        outs, start = [], 0
        for r, ql in enumerate(q_lens):
            outs.append(dense_attention(q[start : start + ql], self.k[r], self.v[r], scale))
            start += ql
        return torch.cat(outs)


LAYOUTS = list(KVCacheLayout)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_reference_equals_dense_prefill_and_decode(layout, page_size, group):
    seq_lens = [1, 5, 19, 8]
    q_lens = [1, 5, 7, 1]  # decode, full prefill, prefill over a cached prefix of 12, decode
    b = Batch(
        layout,
        page_size,
        kv_heads=2,
        group=group,
        head_dim=16,
        seq_lens=seq_lens,
        seed=group + page_size,
    )
    q = b.queries(q_lens)
    out = paged_attention(q, *b.layer(), b.slots, q_lens)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, b.dense(q, q_lens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_prefill_after_cached_prefix_matches_full_prefill(layout):
    """A request that reuses a cached prefix must see exactly what a from-scratch prefill sees."""
    b = Batch(layout, 4, kv_heads=2, group=3, head_dim=8, seq_lens=[6, 9], seed=7)
    b.extend([5, 3])  # new tokens appended after the cached prefixes (new slots, scattered)
    q_full = b.queries([11, 12])
    full = paged_attention(q_full, *b.layer(), b.slots, [11, 12])
    # query only the new tokens: rows must equal the last rows of the full prefill
    q_new = torch.cat([q_full[6:11], q_full[11 + 9 :]])
    part = paged_attention(q_new, *b.layer(), b.slots, [5, 3])
    torch.testing.assert_close(part, torch.cat([full[6:11], full[11 + 9 :]]), rtol=0, atol=1e-6)
    torch.testing.assert_close(full, b.dense(q_full, [11, 12]), rtol=1e-5, atol=1e-5)


def test_decode_is_default_and_scale_is_respected():
    b = Batch(KVCacheLayout.PageFirst, 2, kv_heads=1, group=2, head_dim=8, seq_lens=[3, 4], seed=1)
    q = b.queries([1, 1])
    torch.testing.assert_close(paged_attention(q, *b.layer(), b.slots), b.dense(q, [1, 1]))
    torch.testing.assert_close(
        paged_attention(q, *b.layer(), b.slots, scale=0.3), b.dense(q, [1, 1], scale=0.3)
    )
    assert not torch.allclose(
        paged_attention(q, *b.layer(), b.slots, scale=0.3), b.dense(q, [1, 1])
    )


def test_gather_kv_returns_dense_tokens():
    b = Batch(KVCacheLayout.PageFirst, 16, kv_heads=2, group=1, head_dim=4, seq_lens=[20], seed=2)
    k, v = gather_kv(*b.layer(), b.slots[0])
    assert torch.equal(k, b.k[0]) and torch.equal(v, b.v[0])


def test_half_precision_reference():
    b = Batch(
        KVCacheLayout.LayerFirst,
        4,
        kv_heads=2,
        group=2,
        head_dim=16,
        seq_lens=[9, 3],
        seed=3,
        dtype=torch.bfloat16,
    )
    q = b.queries([4, 3])
    out = paged_attention(q, *b.layer(), b.slots, [4, 3])
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), b.dense(q, [4, 3]), rtol=2e-2, atol=2e-2)


def test_misuse():
    b = Batch(KVCacheLayout.LayerFirst, 2, kv_heads=2, group=2, head_dim=8, seq_lens=[3, 4], seed=4)
    q = b.queries([1, 1])
    with pytest.raises(ValueError, match=r"q_lens\[0\]=4.*T=3"):
        paged_attention(b.queries([4, 1]), *b.layer(), b.slots, [4, 1])
    with pytest.raises(ValueError, match=r"q_lens\[1\]=0"):
        paged_attention(q, *b.layer(), b.slots, [2, 0])
    with pytest.raises(ValueError, match="len\\(q_lens\\)=1"):
        paged_attention(q, *b.layer(), b.slots, [1])
    with pytest.raises(ValueError, match="num_q_heads=3"):
        paged_attention(torch.randn(2, 3, 8), *b.layer(), b.slots)
    with pytest.raises(ValueError, match="sum\\(q_lens\\)=2"):
        paged_attention(q[:1], *b.layer(), b.slots)
    # The batch is checked with one read-back; the error still names the request at fault.
    with pytest.raises(IndexError, match=rf"slots\[1\] holds {b.pool.num_slots}, .*num_slots"):
        paged_attention(q, *b.layer(), [b.slots[0], torch.tensor([0, b.pool.num_slots])])
    with pytest.raises(ValueError, match="non-empty"):
        paged_attention(q, *b.layer(), [b.slots[0], torch.empty(0, dtype=torch.int32)])
    with pytest.raises(TypeError):
        paged_attention(q, *b.layer(), torch.cat(b.slots))
    kc, vc = b.layer()
    with pytest.raises(ValueError, match="v_cache shape"):
        paged_attention(q, kc, vc[:, :1], b.slots)
    with pytest.raises(ValueError, match="dtype"):
        paged_attention(q, kc, vc.double(), b.slots)
    with pytest.raises(TypeError, match="k_cache"):
        paged_attention(q, b.pool, vc, b.slots)  # a pool is not a layer: pass its views
    with pytest.raises(ValueError, match="k_cache must have shape"):
        paged_attention(q, kc[0, 0], vc[0, 0], b.slots)
    for fn in (paged_decode_attention,):
        with pytest.raises(IndexError, match=r"slots\[1\] holds -1, .*num_slots"):
            fn(q, *b.layer(), [b.slots[0], torch.tensor([-1])])
        with pytest.raises(ValueError, match="block_n"):
            fn(q, *b.layer(), b.slots, block_n=3)


def test_decode_backend_choice():
    assert paged_decode_backend("cpu") == ("triton-interpreter" if TRITON_INTERPRET else "torch")
    assert paged_decode_backend("cuda") == ("triton-interpreter" if TRITON_INTERPRET else "triton")


@needs_interpreter
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_triton_decode_matches_reference(layout, page_size, group):
    # block_n=8 < longest request: several online-softmax steps, a ragged last block
    b = Batch(
        layout,
        page_size,
        kv_heads=2,
        group=group,
        head_dim=24,
        seq_lens=[1, 8, 21],
        seed=group * page_size,
    )
    q = b.queries([1, 1, 1])
    out = paged_decode_attention(q, *b.layer(), b.slots, block_n=8)
    ref = paged_attention(q, *b.layer(), b.slots, [1, 1, 1])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, b.dense(q, [1, 1, 1]), rtol=1e-5, atol=1e-5)


@needs_interpreter
def test_triton_decode_half_precision_and_scale():
    b = Batch(
        KVCacheLayout.PageFirst,
        4,
        kv_heads=2,
        group=2,
        head_dim=16,
        seq_lens=[5, 11],
        seed=9,
        dtype=torch.float16,
    )
    q = b.queries([1, 1])
    out = paged_decode_attention(q, *b.layer(), b.slots, scale=0.5)
    assert out.dtype == torch.float16
    torch.testing.assert_close(
        out, paged_attention(q, *b.layer(), b.slots, scale=0.5), rtol=2e-3, atol=2e-3
    )


@settings(max_examples=8, derandomize=True, deadline=None)
@given(
    layout=st.sampled_from(LAYOUTS),
    page_size=st.sampled_from([1, 2, 16]),
    group=st.integers(1, 4),
    reqs=st.lists(st.tuples(st.integers(1, 24), st.integers(0, 24)), min_size=1, max_size=4),
    seed=st.integers(0, 1000),
)
def test_reference_matches_dense_random_batches(layout, page_size, group, reqs, seed):
    seq_lens = [t for t, _ in reqs]
    q_lens = [1 + c % t for t, c in reqs]  # any q_len in [1, T]
    b = Batch(layout, page_size, kv_heads=2, group=group, head_dim=8, seq_lens=seq_lens, seed=seed)
    q = b.queries(q_lens)
    torch.testing.assert_close(
        paged_attention(q, *b.layer(), b.slots, q_lens), b.dense(q, q_lens), rtol=1e-5, atol=1e-5
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_triton_decode_matches_reference(layout):
    torch.manual_seed(0)
    pool = MHAKVCache(8, 2, 128, 64, torch.bfloat16, layout, "cuda", page_size=16)
    seq_lens = [1, 100, 300, 77]
    slots = torch.randperm(pool.num_slots, device="cuda")[: sum(seq_lens)].to(torch.int32)
    k = torch.randn(len(slots), 8, 128, device="cuda", dtype=torch.bfloat16)
    pool.store_kv(k, torch.randn_like(k), slots, LAYER)
    per_req = list(slots.split(seq_lens))
    q = torch.randn(len(seq_lens), 32, 128, device="cuda", dtype=torch.bfloat16)
    kc, vc = pool.k_cache(LAYER), pool.v_cache(LAYER)
    out = paged_decode_attention(q, kc, vc, per_req)
    torch.testing.assert_close(out, paged_attention(q, kc, vc, per_req), rtol=2e-2, atol=2e-2)


def test_slots_checked_with_one_read_back_or_none(read_backs):
    b = Batch(KVCacheLayout.PageFirst, 4, 2, 2, 8, [3, 5, 7, 2], seed=5)
    q = b.queries([1, 1, 1, 1])
    start = read_backs[0]  # after the batch's own stores
    checked = paged_attention(q, *b.layer(), b.slots)
    assert read_backs[0] - start == 1  # the whole batch at once, not one per request
    unchecked = paged_attention(q, *b.layer(), b.slots, check_bounds=False)
    torch.testing.assert_close(unchecked, checked)
    decoded = paged_decode_attention(q, *b.layer(), b.slots, check_bounds=False)
    torch.testing.assert_close(decoded, checked, rtol=1e-5, atol=1e-5)
    assert read_backs[0] - start == 1
    with pytest.raises(IndexError, match=r"slots\[2\] holds"):
        paged_decode_attention(q, *b.layer(), [*b.slots[:2], b.slots[2] + 10**6, b.slots[3]])


@needs_interpreter
def test_unchecked_decode_kernel_skips_out_of_range_slots():
    """``check_bounds=False``: the kernel's device-side guard reads nothing for a slot outside
    the cache, so the result is attention over the request's other slots."""
    b = Batch(KVCacheLayout.LayerFirst, 4, 2, 2, 8, [6, 9], seed=7)
    q = b.queries([1, 1])
    bad = [s.clone() for s in b.slots]
    bad[1][3] = b.pool.num_slots + 5  # one slot past the end
    bad[0][0] = -1
    keep = [torch.arange(6) != 0, torch.arange(9) != 3]
    out = paged_decode_attention(q, *b.layer(), bad, block_n=4, check_bounds=False)
    ref = paged_attention(q, *b.layer(), [s[m] for s, m in zip(b.slots, keep, strict=True)])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Flash decoding: the split-K kernel and its combine step
# ---------------------------------------------------------------------------------------------

# Length 1, lengths below, at and past a page of 16 and a tile of 16, and one that several splits
# share unevenly: with num_splits=3 request 4's 40 slots split as 16 + 16 + 8, request 0's one
# slot leaves two splits empty.
MIXED = [1, 15, 16, 17, 40]


@needs_interpreter
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_split_k_decode_matches_reference_every_layout_page_and_group(layout, page_size, group):
    b = Batch(layout, page_size, kv_heads=2, group=group, head_dim=24, seq_lens=MIXED, seed=group)
    q = b.queries([1] * len(MIXED))
    ref = paged_attention(q, *b.layer(), b.slots)
    torch.testing.assert_close(ref, b.dense(q, [1] * len(MIXED)), rtol=1e-5, atol=1e-5)
    for num_splits in (1, 3, 5):
        out = paged_decode_attention(q, *b.layer(), b.slots, block_n=16, num_splits=num_splits)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@needs_interpreter
@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.bfloat16, 2e-2), (torch.float16, 2e-3), (torch.float32, 1e-5)]
)
def test_split_k_decode_in_each_dtype(dtype, tol):
    b = Batch(KVCacheLayout.PageFirst, 16, 2, 4, 32, seq_lens=[3, 33, 50], seed=11, dtype=dtype)
    q = b.queries([1, 1, 1])
    out = paged_decode_attention(q, *b.layer(), b.slots, num_splits=2)
    assert out.dtype == dtype
    ref = paged_attention(q, *b.layer(), b.slots)
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    torch.testing.assert_close(out.float(), b.dense(q, [1, 1, 1]), rtol=2 * tol, atol=2 * tol)


@needs_interpreter
@settings(max_examples=12, derandomize=True, deadline=None)
@given(
    layout=st.sampled_from(LAYOUTS),
    page_size=st.sampled_from([1, 2, 16]),
    group=st.sampled_from([1, 2, 4, 8]),
    seq_lens=st.lists(st.integers(1, 48), min_size=1, max_size=4),
    num_splits=st.one_of(st.none(), st.integers(1, 7)),
    block_n=st.sampled_from([8, 16, 32]),
    seed=st.integers(0, 1000),
)
def test_split_k_decode_matches_reference_random_batches(
    layout, page_size, group, seq_lens, num_splits, block_n, seed
):
    """Any batch of mixed lengths, any split count (more splits than tiles included)."""
    b = Batch(layout, page_size, 1, group, head_dim=16, seq_lens=seq_lens, seed=seed)
    q = b.queries([1] * len(seq_lens))
    out = paged_decode_attention(q, *b.layer(), b.slots, block_n=block_n, num_splits=num_splits)
    ref = paged_attention(q, *b.layer(), b.slots)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@needs_interpreter
def test_split_k_guard_skips_out_of_range_slots_and_whole_splits():
    """``check_bounds=False``: the device-side guard reads nothing for a slot outside the cache,
    in any split; a split with no valid slot adds nothing; a request with none gets zeros."""
    b = Batch(KVCacheLayout.LayerFirst, 16, 2, 2, 8, [40, 20, 5], seed=3)
    q = b.queries([1, 1, 1])
    bad = [s.clone() for s in b.slots]
    bad[0][16:32] = b.pool.num_slots + 7  # the whole middle split of three
    bad[0][3] = -2
    bad[1][19] = 2**31 - 1
    bad[2][:] = -1  # nothing left to attend to
    out = paged_decode_attention(q, *b.layer(), bad, check_bounds=False, num_splits=3)
    keep0 = torch.ones(40, dtype=torch.bool)
    keep0[16:32], keep0[3] = False, False
    ref = paged_attention(q[:2], *b.layer(), [b.slots[0][keep0], b.slots[1][:19]])
    torch.testing.assert_close(out[:2], ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[2], torch.zeros_like(out[2]))


@needs_interpreter
def test_split_k_decode_takes_a_flat_cache_and_int64_slots():
    g = torch.Generator().manual_seed(4)
    kc, vc = torch.randn(50, 2, 16, generator=g), torch.randn(50, 2, 16, generator=g)
    slots = [torch.randperm(50, generator=g)[:n] for n in (30, 7)]  # int64
    q = torch.randn(2, 6, 16, generator=g)
    out = paged_decode_attention(q, kc, vc, slots, num_splits=4)
    torch.testing.assert_close(out, paged_attention(q, kc, vc, slots), rtol=1e-5, atol=1e-5)


def test_launch_shape_splits_small_batches_over_the_sms():
    """The split count gives the SMs PROGRAMS_PER_SM programs each, never more splits than
    MIN_SPLIT_SLOTS-slot pieces of the longest request or MAX_SPLITS, and none when the batch
    alone fills the device (then no combine launch)."""
    h200 = dict(kv_heads=8, group=4, head_dim=128, num_sms=132)
    s32 = decode_launch_shape(32, longest=4096, **h200)
    assert s32["NUM_SPLITS"] == -(-PROGRAMS_PER_SM * 132 // (32 * 8)) == 3
    assert s32["grid"] == (32, 8, 3) and s32["combine_grid"] == (32, 32)
    assert s32["BLOCK_G"] == 16 and s32["BLOCK_D"] == 128 and s32["BLOCK_N"] == 32
    s128 = decode_launch_shape(128, longest=4096, **h200)
    assert s128["NUM_SPLITS"] == 1 and s128["combine_grid"] is None
    one = decode_launch_shape(1, longest=512, **h200)
    assert one["NUM_SPLITS"] == 512 // MIN_SPLIT_SLOTS
    long_one = decode_launch_shape(1, longest=10**6, **h200)
    assert long_one["NUM_SPLITS"] == MAX_SPLITS and long_one["BLOCK_S"] == MAX_SPLITS
    assert decode_launch_shape(1, longest=1, **h200)["NUM_SPLITS"] == 1
    # Given, the split count is kept (empty splits included); small tiles round up to 16.
    given_ = decode_launch_shape(2, 1, 1, 8, 5, block_n=4, num_splits=6)
    assert given_["NUM_SPLITS"] == 6 and given_["BLOCK_S"] == 8 and given_["BLOCK_N"] == 16
    assert given_["BLOCK_D"] == 16 and given_["grid"] == (2, 1, 6)
    # The CPU's interpreter counts as one SM: a batch of 4 (request, KV head) pairs, no split.
    assert decode_launch_shape(2, 2, 1, 8, 1000)["NUM_SPLITS"] == 1


@pytest.mark.parametrize(
    ("num_splits", "exc"),
    [(0, ValueError), (MAX_SPLITS + 1, ValueError), (1.5, TypeError), (True, TypeError)],
    ids=str,
)
def test_num_splits_is_checked_before_anything_runs(num_splits, exc):
    b = Batch(KVCacheLayout.LayerFirst, 2, 2, 2, 8, [3, 4], seed=4)
    with pytest.raises(exc, match="num_splits"):
        paged_decode_attention(b.queries([1, 1]), *b.layer(), b.slots, num_splits=num_splits)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_cuda_split_k_decode_matches_reference(layout, page_size, group):
    """On the GPU, compiled: every layout, page size and group, mixed lengths, each split count
    the kernel may choose, the unchecked call's guard included."""
    torch.manual_seed(group)
    seq_lens = [1, 15, 100, 300, 777]
    num_pages = -(-2 * sum(seq_lens) // page_size)  # room for every slot of the batch, twice
    pool = MHAKVCache(
        8 // group, 2, 128, num_pages, torch.bfloat16, layout, "cuda", page_size=page_size
    )
    flat = torch.randperm(pool.num_slots, device="cuda")[: sum(seq_lens)].to(torch.int32)
    assert len(flat) == sum(seq_lens)
    k = torch.randn(len(flat), 8 // group, 128, device="cuda", dtype=torch.bfloat16)
    pool.store_kv(k, torch.randn_like(k), flat, LAYER)
    slots = list(flat.split(seq_lens))
    q = torch.randn(len(seq_lens), 8, 128, device="cuda", dtype=torch.bfloat16)
    kc, vc = pool.k_cache(LAYER), pool.v_cache(LAYER)
    ref = paged_attention(q, kc, vc, slots)
    for num_splits in (None, 1, 2, 7, MAX_SPLITS):
        out = paged_decode_attention(q, kc, vc, slots, num_splits=num_splits, check_bounds=False)
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    # The guard, compiled: a slot past the end is skipped, in any split.
    bad = [s.clone() for s in slots]
    bad[4][400] = pool.num_slots
    keep = [s for s in slots[:4]] + [torch.cat([slots[4][:400], slots[4][401:]])]
    out = paged_decode_attention(q, kc, vc, bad, num_splits=3, check_bounds=False)
    torch.testing.assert_close(out, paged_attention(q, kc, vc, keep), rtol=2e-2, atol=2e-2)
