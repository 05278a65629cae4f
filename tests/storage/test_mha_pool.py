"""MHAKVCache: storage order, views that write through, store_kv placement, TP split, misuse."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import BaseKVCache, KVCacheLayout
from kvcache.storage.distributed import reset_tp_info, set_tp_info
from kvcache.storage.mha_pool import MHAKVCache

LF, PF = KVCacheLayout.LayerFirst, KVCacheLayout.PageFirst


def make(layout=LF, *, heads=2, layers=3, head_dim=4, pages=5, page_size=1, dtype=torch.float32):
    return MHAKVCache(heads, layers, head_dim, pages, dtype, layout, "cpu", page_size=page_size)


def test_is_a_base_kv_cache_with_its_facts():
    c = make(PF, heads=4, layers=3, head_dim=8, pages=6, page_size=2, dtype=torch.float16)
    assert isinstance(c, BaseKVCache)
    assert (c.num_pages, c.page_size, c.local_kv_heads, c.head_dim, c.num_layers) == (6, 2, 4, 8, 3)
    assert c.num_slots == 12 and c.kv_layout is PF
    assert c.dtype == torch.float16 and c.device == torch.device("cpu")
    assert "PageFirst" in repr(c)


def test_nbytes_worked_example():
    # Source §11.4: 32 KV heads on TP 4, 32 layers, head_dim 128, 1000 pages, bf16.
    set_tp_info(0, 4)
    for layout in KVCacheLayout:
        c = MHAKVCache(32, 32, 128, 1000, torch.bfloat16, layout, "cpu")
        assert c.local_kv_heads == 8
        assert c.nbytes == 131_072_000 == c.buffer.numel() * 2


def test_buffer_is_zeroed():
    c = make(PF, page_size=3)
    assert not c.buffer.any()


@pytest.mark.parametrize("page_size", [1, 4])
def test_layer_first_storage_order(page_size):
    c = make(LF, heads=2, layers=3, head_dim=4, pages=5, page_size=page_size)
    b = c.buffer
    assert b.shape == (2, 3, 5, page_size, 2, 4) and b.is_contiguous()
    es = b.element_size()
    layer_elems = 5 * page_size * 2 * 4
    for layer in range(3):
        k, v = c.k_cache(layer), c.v_cache(layer)
        assert k.shape == v.shape == (5, page_size, 2, 4)
        assert k.is_contiguous()  # one layer's pages are contiguous
        assert k.data_ptr() == b.data_ptr() + layer * layer_elems * es
        assert v.data_ptr() == b.data_ptr() + (3 + layer) * layer_elems * es


@pytest.mark.parametrize("page_size", [1, 4])
def test_page_first_is_really_page_major(page_size):
    c = make(PF, heads=2, layers=3, head_dim=4, pages=5, page_size=page_size)
    b = c.buffer
    assert b.shape == (2, 5, 3, page_size, 2, 4) and b.is_contiguous()
    es = b.element_size()
    token = 2 * 4  # heads * head_dim elements
    for layer in range(3):
        k, v = c.k_cache(layer), c.v_cache(layer)
        assert k.shape == v.shape == (5, page_size, 2, 4)
        # one page of one layer, then the same page of the next layer: pages are num_layers apart
        assert k.stride() == (3 * page_size * token, token, 4, 1)
        assert not k.is_contiguous()
        assert k.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        assert k.data_ptr() == b.data_ptr() + layer * page_size * token * es
        assert v.data_ptr() == b.data_ptr() + (5 * 3 + layer) * page_size * token * es
    # all layers of page p are one contiguous block of memory
    assert b[0, 1].is_contiguous()


@pytest.mark.parametrize("layout", list(KVCacheLayout))
def test_views_write_through(layout):
    c = make(layout, page_size=2)
    c.k_cache(2)[3, 1, 0, 2] = 7.0
    c.v_cache(0)[4, 0, 1, 3] = -1.0
    if layout is LF:
        assert c.buffer[0, 2, 3, 1, 0, 2] == 7.0 and c.buffer[1, 0, 4, 0, 1, 3] == -1.0
    else:
        assert c.buffer[0, 3, 2, 1, 0, 2] == 7.0 and c.buffer[1, 4, 0, 0, 1, 3] == -1.0
    assert c.buffer.count_nonzero() == 2


@pytest.mark.parametrize("layout", list(KVCacheLayout))
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_store_kv_lands_at_page_and_offset(layout, page_size, index_dtype):
    pages, layers, heads, dim = 8, 2, 2, 8
    c = make(layout, heads=heads, layers=layers, head_dim=dim, pages=pages, page_size=page_size)
    g = torch.Generator().manual_seed(page_size)
    slots = torch.randperm(pages * page_size, generator=g)[:7]
    k, v = torch.randn(7, heads, dim, generator=g), torch.randn(7, heads, dim, generator=g)
    c.store_kv(k, v, slots.to(index_dtype), 1)
    for i, s in enumerate(slots.tolist()):
        p, o = divmod(s, page_size)
        at = (p, 1, o) if layout is PF else (1, p, o)
        assert torch.equal(c.buffer[0][at], k[i]) and torch.equal(c.buffer[1][at], v[i])
        assert torch.equal(c.k_cache(1)[p, o], k[i]) and torch.equal(c.v_cache(1)[p, o], v[i])
    assert (
        c.buffer.count_nonzero() == 2 * k.count_nonzero()
    )  # nothing else touched (layer 0 included)


@pytest.mark.parametrize("layout", list(KVCacheLayout))
def test_store_kv_takes_rows_as_mini_sglang_passes_them(layout):
    """K and V as rows ``(n, heads * head_dim)`` (mini-sglang's attention passes them so) land
    where their ``(n, heads, head_dim)`` form lands."""
    rows, heads = (
        make(layout, heads=2, head_dim=4, pages=4, page_size=4),
        make(layout, heads=2, head_dim=4, pages=4, page_size=4),
    )
    k = torch.arange(3 * 8, dtype=torch.float32).view(3, 2, 4) + 1
    slots = torch.tensor([5, 15, 2], dtype=torch.int32)
    rows.store_kv(k.flatten(1), -k.flatten(1), slots, 0)
    heads.store_kv(k, -k, slots, 0)
    assert torch.equal(rows.buffer, heads.buffer) and rows.buffer.count_nonzero() == 2 * 24


@pytest.mark.parametrize("layout", list(KVCacheLayout))
def test_store_kv_unchecked_drops_out_of_range_slots(layout):
    """check_bounds=False (no host sync): good slots land, a bad one writes nothing anywhere."""
    c = make(layout, heads=2, layers=2, head_dim=4, pages=4, page_size=4)
    k = torch.arange(3 * 8, dtype=torch.float32).view(3, 2, 4) + 1
    c.store_kv(k, -k, torch.tensor([5, 16, 2], dtype=torch.int32), 1, check_bounds=False)
    assert torch.equal(c.k_cache(1)[1, 1], k[0]) and torch.equal(c.k_cache(1)[0, 2], k[2])
    assert torch.equal(c.v_cache(1)[1, 1], -k[0]) and torch.equal(c.v_cache(1)[0, 2], -k[2])
    assert c.buffer.count_nonzero() == 2 * k[[0, 2]].count_nonzero()


@pytest.mark.parametrize("size,rank", [(1, 0), (2, 1), (4, 3), (8, 0)])
def test_tp_splits_kv_heads(size, rank):
    set_tp_info(rank, size)
    c = make(heads=8, layers=2, head_dim=4, pages=3)
    assert c.local_kv_heads == 8 // size
    assert c.k_cache(0).shape == (3, 1, 8 // size, 4)
    reset_tp_info()
    assert c.nbytes * size == make(heads=8, layers=2, head_dim=4, pages=3).nbytes


def test_tp_indivisible_heads():
    set_tp_info(0, 3)
    with pytest.raises(ValueError, match=r"num_kv_heads=8.*3"):
        make(heads=8)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(num_kv_heads=0), ValueError, "num_kv_heads"),
        (dict(num_layers=-1), ValueError, "num_layers"),
        (dict(head_dim=2.0), TypeError, "head_dim"),
        (dict(num_pages=True), TypeError, "num_pages"),
        (dict(page_size=0), ValueError, "page_size"),
        (dict(dtype=torch.int32), ValueError, "int32"),
        (dict(dtype="float16"), TypeError, "dtype"),
        (dict(kv_layout="LayerFirst"), TypeError, "kv_layout"),
        (dict(device="nonsense"), ValueError, "nonsense"),
        (dict(device=0.5), TypeError, "device"),
    ],
)
def test_constructor_misuse(kwargs, exc, match):
    args = dict(
        num_kv_heads=2,
        num_layers=1,
        head_dim=4,
        num_pages=2,
        dtype=torch.float32,
        kv_layout=LF,
        device="cpu",
        page_size=1,
    )
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        MHAKVCache(**args)


@pytest.mark.parametrize("bad", [-1, 3, 100])
def test_layer_out_of_range_is_index_error(bad):
    c = make(layers=3)
    for call in (c.k_cache, c.v_cache):
        with pytest.raises(IndexError, match=rf"{bad}.*num_layers=3"):
            call(bad)
    with pytest.raises(TypeError):
        c.k_cache(1.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", list(KVCacheLayout))
def test_store_kv_misuse_leaves_buffer_unchanged(layout):
    c = make(layout, heads=2, layers=2, head_dim=4, pages=3, page_size=2)  # 6 slots
    c.k_cache(0).fill_(1.0)
    before = c.buffer.clone()
    k = torch.ones(2, 2, 4)
    idx = torch.tensor([0, 5], dtype=torch.int32)
    cases = [
        (IndexError, dict(layer_id=2)),
        (TypeError, dict(layer_id="0")),
        (IndexError, dict(out_loc=torch.tensor([0, 6], dtype=torch.int32))),
        (IndexError, dict(out_loc=torch.tensor([-1, 0], dtype=torch.int32))),
        (ValueError, dict(out_loc=torch.tensor([0.0, 1.0]))),
        (ValueError, dict(out_loc=idx[:1])),
        (ValueError, dict(out_loc=idx.view(2, 1))),
        (ValueError, dict(k=torch.ones(2, 1, 4))),
        (ValueError, dict(v=torch.ones(2, 2, 5))),
        (ValueError, dict(k=torch.ones(2, 2, 4, dtype=torch.float64))),
        (TypeError, dict(k=[[0.0]])),
    ]
    for exc, override in cases:
        args = dict(k=k, v=k, out_loc=idx, layer_id=1)
        args.update(override)
        with pytest.raises(exc):
            c.store_kv(**args)
        assert torch.equal(c.buffer, before), override


@settings(max_examples=15, derandomize=True, deadline=None)
@given(
    layout=st.sampled_from(list(KVCacheLayout)),
    page_size=st.sampled_from([1, 2, 16]),
    layer=st.integers(0, 2),
    data=st.data(),
)
def test_store_kv_matches_a_dense_model(layout, page_size, layer, data):
    """Any batch of distinct slots: the layer view equals a dense (num_slots, H, D) array."""
    pages = 3
    c = make(layout, heads=2, layers=3, head_dim=4, pages=pages, page_size=page_size)
    n_slots = pages * page_size
    slots = data.draw(
        st.lists(st.integers(0, n_slots - 1), min_size=0, max_size=n_slots, unique=True)
    )
    g = torch.Generator().manual_seed(len(slots))
    k, v = torch.randn(len(slots), 2, 4, generator=g), torch.randn(len(slots), 2, 4, generator=g)
    c.store_kv(k, v, torch.tensor(slots, dtype=torch.int32), layer)
    dense_k, dense_v = torch.zeros(n_slots, 2, 4), torch.zeros(n_slots, 2, 4)
    dense_k[slots], dense_v[slots] = k, v
    assert torch.equal(c.k_cache(layer).reshape(n_slots, 2, 4), dense_k)
    assert torch.equal(c.v_cache(layer).reshape(n_slots, 2, 4), dense_v)
