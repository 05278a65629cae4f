"""store_cache on both backends against a plain torch model, for every cache geometry the pool makes.

The Triton cases run on Triton's CPU interpreter; they are skipped unless ``TRITON_INTERPRET=1`` was
set before kvcache was imported (the project's test command sets it). Sizes stay small: the
interpreter is slow.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcache.kernels.store as store_mod
from kvcache.kernels import (
    TRITON_INTERPRET,
    store_cache,
    store_cache_backend,
    store_cache_torch,
    store_cache_triton,
)

needs_interpreter = pytest.mark.skipif(
    not TRITON_INTERPRET, reason="needs TRITON_INTERPRET=1 before import"
)
BACKENDS = [
    pytest.param(store_cache_triton, id="triton", marks=needs_interpreter),
    pytest.param(store_cache_torch, id="torch"),
    pytest.param(store_cache, id="dispatch"),
]


def make_caches(
    kind: str, num_pages: int, page_size: int, heads: int, dim: int, dtype=torch.float32
):
    """A (k_cache, v_cache) pair with the strides that `kind` of storage gives."""
    layers, layer = 3, 1
    if kind == "flat":  # (num_slots, H, D), contiguous
        buf = torch.zeros(2, num_pages * page_size, heads, dim, dtype=dtype)
        return buf[0], buf[1]
    if kind == "flat_strided":  # slot stride larger than H*D (every other row of a bigger tensor)
        buf = torch.zeros(2, 2 * num_pages * page_size, heads, dim, dtype=dtype)
        return buf[0, ::2], buf[1, ::2]
    if kind == "dim_strided":  # head_dim not contiguous either
        buf = torch.zeros(2, num_pages, page_size, heads, 2 * dim, dtype=dtype)
        return buf[0, ..., 1::2], buf[1, ..., 1::2]
    if kind == "layer_first":
        buf = torch.zeros(2, layers, num_pages, page_size, heads, dim, dtype=dtype)
        return buf[0, layer], buf[1, layer]
    if kind == "page_first":  # the pool's PageFirst layer view: not flattenable when page_size > 1
        buf = torch.zeros(2, num_pages, layers, page_size, heads, dim, dtype=dtype).permute(
            0, 2, 1, 3, 4, 5
        )
        return buf[0, layer], buf[1, layer]
    raise AssertionError(kind)


def reference(cache: torch.Tensor, indices: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """What the cache must look like afterwards, built one token at a time on a dense copy."""
    out = cache.clone()
    flat = out.reshape(-1, *out.shape[-2:])
    for i, s in enumerate(indices.tolist()):
        flat[s] = x[i]
    return flat.reshape(out.shape)


def random_batch(n, num_slots, heads, dim, dtype, index_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(num_slots, generator=g)[:n].to(index_dtype)
    k = torch.randn(n, heads, dim, generator=g).to(dtype)
    v = torch.randn(n, heads, dim, generator=g).to(dtype)
    return idx, k, v


def test_backend_choice():
    assert store_cache_backend("cpu") == ("triton-interpreter" if TRITON_INTERPRET else "torch")
    assert (os.environ.get("TRITON_INTERPRET") == "1") == TRITON_INTERPRET
    # With TRITON_INTERPRET=1 Triton interprets every launch, CUDA tensors' included.
    assert store_cache_backend("cuda") == ("triton-interpreter" if TRITON_INTERPRET else "triton")
    assert store_cache_backend(torch.device("meta")) == "torch"


def test_dispatch_calls_the_chosen_backend(monkeypatch):
    called = []
    monkeypatch.setattr(
        store_mod, "launch_store_cache_kernel", lambda *a, **kw: called.append("triton")
    )
    monkeypatch.setattr(store_mod, "_store_torch", lambda *a, **kw: called.append("torch"))
    kc, vc = make_caches("flat", 4, 1, 1, 2)
    store_cache(
        kc, vc, torch.tensor([1], dtype=torch.int32), torch.ones(1, 1, 2), torch.ones(1, 1, 2)
    )
    assert called == ["triton" if TRITON_INTERPRET else "torch"]


@pytest.mark.parametrize("fn", BACKENDS)
@pytest.mark.parametrize(
    "kind", ["flat", "flat_strided", "dim_strided", "layer_first", "page_first"]
)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_matches_reference(fn, kind, page_size, index_dtype):
    if kind.startswith("flat") and page_size != 1:
        pytest.skip("flat caches have no page dimension")
    heads, dim = 3, 20  # head_dim not a power of two: masked lanes
    num_pages = 8 // page_size + 1
    kc, vc = make_caches(kind, num_pages, page_size, heads, dim)
    kc.normal_(generator=torch.Generator().manual_seed(1))  # old contents must survive elsewhere
    idx, k, v = random_batch(
        5, num_pages * page_size, heads, dim, torch.float32, index_dtype, seed=page_size
    )
    want_k, want_v = reference(kc, idx, k), reference(vc, idx, v)
    fn(kc, vc, idx, k, v)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


@pytest.mark.parametrize("fn", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_dtypes_bit_exact(fn, dtype):
    kc, vc = make_caches("page_first", 3, 4, 2, 8, dtype)
    idx, k, v = random_batch(6, 12, 2, 8, dtype, torch.int32, seed=3)
    fn(kc, vc, idx, k, v)
    assert torch.equal(kc, reference(torch.zeros_like(kc), idx, k))
    assert torch.equal(vc, reference(torch.zeros_like(vc), idx, v))


@pytest.mark.parametrize("fn", BACKENDS)
def test_non_contiguous_sources(fn):
    kc, vc = make_caches("layer_first", 4, 2, 3, 4)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(4, 3, 3, generator=g).permute(
        2, 1, 0
    )  # (3 tokens, 3 heads, 4 dims), all strides odd
    v = torch.randn(3, 3, 8, generator=g)[..., ::2]
    idx = torch.tensor([7, 0, 4], dtype=torch.int64)
    fn(kc, vc, idx, k, v)
    assert torch.equal(kc, reference(torch.zeros_like(kc), idx, k))
    assert torch.equal(vc, reference(torch.zeros_like(vc), idx, v))


@pytest.mark.parametrize("fn", BACKENDS)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_mini_sglang_row_form(fn, index_dtype):
    """mini-sglang's own store test, small: K and V caches as rows of one (slots, 2, row) buffer,
    K and V as column slices of a fused qkv tensor (strided rows)."""
    row, slots = 24, 64
    g = torch.Generator().manual_seed(7)
    kv_cache = torch.randn(slots, 2, row, generator=g)
    k_cache, v_cache = kv_cache[:, 0, :], kv_cache[:, 1, :]
    for bs in (1, 2, 8, 33):
        indices = torch.randperm(slots, generator=g)[:bs].to(index_dtype)
        qkv = torch.randn(bs, row * 4, generator=g)
        k, v = qkv[:, :row], qkv[:, row : 2 * row]
        before = kv_cache.clone()
        fn(k_cache, v_cache, indices, k, v)
        assert torch.equal(k_cache[indices], k) and torch.equal(v_cache[indices], v), bs
        untouched = torch.ones(slots, dtype=torch.bool)
        untouched[indices.long()] = False
        assert torch.equal(kv_cache[untouched], before[untouched])


@pytest.mark.parametrize("fn", BACKENDS)
@pytest.mark.parametrize("kind,page_size", [("flat_strided", 1), ("page_first", 4)])
def test_rows_of_heads_into_a_head_cache(fn, kind, page_size):
    """Sources as rows ``(n, heads * head_dim)`` (a model's projection output) into a cache of
    ``(heads, head_dim)``: the same cache as with the ``(n, heads, head_dim)`` form."""
    heads, dim = 3, 5
    kc, vc = make_caches(kind, 16 // page_size, page_size, heads, dim)
    idx, k, v = random_batch(6, 16, heads, dim, torch.float32, torch.int32, seed=2)
    fn(kc, vc, idx, k.flatten(1), v.flatten(1))
    assert torch.equal(kc, reference(torch.zeros_like(kc), idx, k))
    assert torch.equal(vc, reference(torch.zeros_like(vc), idx, v))


@needs_interpreter
def test_triton_tiles_many_heads():
    """heads * head_dim above one program's tile: the kernel splits heads over grid axis 1."""
    heads, dim = 40, 128
    kc, vc = make_caches("page_first", 2, 2, heads, dim)
    idx, k, v = random_batch(2, 4, heads, dim, torch.float32, torch.int32, seed=5)
    store_cache_triton(kc, vc, idx, k, v)
    assert torch.equal(kc, reference(torch.zeros_like(kc), idx, k))
    assert torch.equal(vc, reference(torch.zeros_like(vc), idx, v))


@pytest.mark.parametrize("fn", BACKENDS)
def test_empty_batch_is_a_no_op(fn):
    kc, vc = make_caches("flat", 4, 1, 2, 4)
    fn(kc, vc, torch.empty(0, dtype=torch.int32), torch.empty(0, 2, 4), torch.empty(0, 2, 4))
    assert not kc.any() and not vc.any()


@pytest.mark.parametrize("fn", BACKENDS)
@pytest.mark.parametrize("kind,page_size", [("flat", 1), ("page_first", 4)])
@pytest.mark.parametrize("bad", [-1, 16, 1000])
def test_out_of_range_raises_and_writes_nothing(fn, kind, page_size, bad):
    kc, vc = make_caches(kind, 16 // page_size, page_size, 2, 4)
    idx = torch.tensor([3, bad, 5], dtype=torch.int32)  # the good rows must not be written either
    with pytest.raises(IndexError, match=rf"{bad}.*num_slots=16"):
        fn(kc, vc, idx, torch.ones(3, 2, 4), torch.ones(3, 2, 4))
    assert not kc.any() and not vc.any()


def _misuse_cases():
    kc, vc = make_caches("layer_first", 4, 2, 2, 4)
    idx = torch.tensor([0, 1], dtype=torch.int32)
    x = torch.ones(2, 2, 4)
    base = dict(k_cache=kc, v_cache=vc, indices=idx, k=x, v=x)
    return base, [
        (TypeError, dict(k="not a tensor")),
        (TypeError, dict(indices=[0, 1])),
        (ValueError, dict(indices=idx.float())),
        (ValueError, dict(indices=idx.to(torch.int16))),
        (ValueError, dict(indices=idx.view(1, 2))),
        (ValueError, dict(indices=idx[:1])),
        (ValueError, dict(k=torch.ones(2, 3, 4))),
        (ValueError, dict(v=torch.ones(2, 2, 5))),
        (ValueError, dict(k=x.half())),
        (ValueError, dict(v=x.double())),
        (ValueError, dict(v_cache=torch.zeros(4, 2, 2, 5))),
        (ValueError, dict(v_cache=vc.half())),
        (ValueError, dict(k_cache=torch.zeros(8, 2))),
        # rows: only of the cache's heads * head_dim, and a cache of rows needs both of them so
        (ValueError, dict(k=torch.ones(2, 7))),
        (ValueError, dict(v=torch.ones(2, 4))),
        (ValueError, dict(k_cache=torch.zeros(8, 8), v_cache=torch.zeros(8, 8))),
        (ValueError, dict(k=torch.ones(2, 2, 4, device="meta"))),
        (ValueError, dict(indices=torch.zeros(2, dtype=torch.int32, device="meta"))),
        # a cache that overlaps itself: every slot of a page is the same memory
        (ValueError, dict(k_cache=torch.zeros(4, 1, 2, 4).expand(4, 2, 2, 4))),
        (ValueError, dict(v_cache=torch.zeros(1, 2, 2, 4).expand(4, 2, 2, 4))),
        # an int64 index that an int32 cast would bring into range
        (IndexError, dict(indices=torch.tensor([0, 2**32 + 1], dtype=torch.int64))),
    ]


@pytest.mark.parametrize("fn", BACKENDS)
def test_misuse_raises_before_writing(fn):
    base, cases = _misuse_cases()
    for exc, override in cases:
        args = dict(base, **override)
        with pytest.raises(exc):
            fn(args["k_cache"], args["v_cache"], args["indices"], args["k"], args["v"])
        assert not base["k_cache"].any() and not base["v_cache"].any(), override


@pytest.mark.parametrize("fn", BACKENDS)
@pytest.mark.parametrize("kind,page_size", [("flat", 1), ("page_first", 4)])
def test_unchecked_out_of_range_rows_are_dropped(fn, kind, page_size):
    """check_bounds=False (no host sync): the device-side guard writes the good rows only."""
    kc, vc = make_caches(kind, 16 // page_size, page_size, 2, 4)
    idx = torch.tensor([3, -1, 16, 2**40, 5], dtype=torch.int64)
    k = torch.arange(5 * 8, dtype=torch.float32).view(5, 2, 4) + 1
    fn(kc, vc, idx, k, -k, check_bounds=False)
    good = torch.tensor([3, 5])
    assert torch.equal(kc, reference(torch.zeros_like(kc), good, k[[0, 4]]))
    assert torch.equal(vc, reference(torch.zeros_like(vc), good, -k[[0, 4]]))


@pytest.mark.skipif(TRITON_INTERPRET, reason="only meaningful without the interpreter")
def test_triton_refuses_cpu_without_interpreter():
    kc, vc = make_caches("flat", 2, 1, 1, 2)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        store_cache_triton(kc, vc, torch.tensor([0]), torch.ones(1, 1, 2), torch.ones(1, 1, 2))


@settings(max_examples=12, derandomize=True, deadline=None)
@given(
    kind=st.sampled_from(["flat_strided", "layer_first", "page_first"]),
    page_size=st.sampled_from([1, 2, 16]),
    n=st.integers(0, 8),
    seed=st.integers(0, 2**16),
)
def test_dispatch_matches_torch_backend(kind, page_size, n, seed):
    """Whatever store_cache dispatches to agrees bit for bit with the torch backend."""
    num_pages = 8 // page_size + 1
    kc, vc = make_caches(kind, num_pages, page_size, 2, 8, torch.bfloat16)
    kc2, vc2 = kc.clone(), vc.clone()
    idx, k, v = random_batch(n, num_pages * page_size, 2, 8, torch.bfloat16, torch.int64, seed)
    store_cache(kc, vc, idx, k, v)
    store_cache_torch(kc2, vc2, idx, k, v)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["flat_strided", "layer_first", "page_first"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_triton_matches_torch(kind, dtype):
    assert store_cache_backend("cuda") == "triton"
    pages, page_size = (64, 16) if kind != "flat_strided" else (1024, 1)  # 1024 slots either way
    kc, vc = (t.cuda() for t in make_caches(kind, pages, page_size, 8, 128, dtype))
    kc2, vc2 = kc.clone(), vc.clone()
    idx, k, v = random_batch(
        500, kc.shape[0] * (kc.shape[1] if kc.dim() == 4 else 1), 8, 128, dtype, torch.int32, 0
    )
    idx, k, v = idx.cuda(), k.cuda(), v.cuda()
    store_cache(kc, vc, idx, k, v)
    store_cache_torch(kc2, vc2, idx, k, v)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    with pytest.raises(IndexError):
        store_cache(kc, vc, torch.full_like(idx, 10**6), k, v)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["layer_first", "page_first"])
def test_cuda_graph_captures_unchecked_store(kind):
    """``check_bounds=False`` is the variant a CUDA graph can capture: captured once, replayed on
    new data copied into the same tensors, it stores what the torch path stores, and the device
    guard drops an out-of-range row instead of writing outside the cache."""
    kc, vc = (t.cuda() for t in make_caches(kind, 64, 16, 8, 128, torch.bfloat16))
    num_slots = 64 * 16
    idx, k, v = (
        t.cuda() for t in random_batch(256, num_slots, 8, 128, torch.bfloat16, torch.int32, 0)
    )
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compiles the kernel) off the capture
        store_cache(kc, vc, idx, k, v, check_bounds=False)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        store_cache(kc, vc, idx, k, v, check_bounds=False)
    for seed in (1, 2):
        new_idx, new_k, new_v = random_batch(
            256, num_slots, 8, 128, torch.bfloat16, torch.int32, seed
        )
        idx.copy_(new_idx), k.copy_(new_k), v.copy_(new_v)
        kc2, vc2 = kc.clone(), vc.clone()
        store_cache_torch(kc2, vc2, idx, k, v)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    idx[0] = num_slots + 7  # out of range: the guard drops this row, the rest are stored
    kc2, vc2 = kc.clone(), vc.clone()
    store_cache_torch(kc2, vc2, idx[1:], k[1:], v[1:])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
