"""Every tensor argument of every kernel, as any view, gives what the torch path gives on plain copies.

Issue 9 item 1: the Triton store kernel read ``indices`` as if contiguous, so
``store_cache(kc, vc, table[:, 0], k, v)`` wrote to the wrong slots and an expanded index tensor
could make the interpreter read past its storage. Here hypothesis builds each argument of
``store_cache``, ``paged_attention``, ``paged_decode_attention`` and ``gather_kv`` as an
arbitrary view of the same logical values: dimensions permuted, every dimension strided, a
non-zero storage offset, or expanded with stride 0 where the values allow it. The Triton
kernels run on the interpreter (``TRITON_INTERPRET=1``, skipped without it), or on CUDA when
one is visible; the torch path runs everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.kernels import (
    TRITON_INTERPRET,
    gather_kv,
    paged_attention,
    paged_decode_attention,
    store_cache_torch,
    store_cache_triton,
)

# CPU (the Triton kernels under the interpreter only), plus CUDA when a device is visible.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
TRITON_DEVICES = [d for d in DEVICES if d == "cuda" or TRITON_INTERPRET]
needs_triton = pytest.mark.skipif(
    not TRITON_DEVICES, reason="needs TRITON_INTERPRET=1 before import, or CUDA"
)
VIEWS = settings(max_examples=30, derandomize=True, deadline=None)


def as_view(draw, x: torch.Tensor, *, allow_expand: bool = True) -> torch.Tensor:
    """A tensor equal to ``x`` but laid out as hypothesis chooses.

    Dimensions permuted in memory, each dimension strided (step 1-3), the storage starting at a
    non-zero offset; or, where every slice along a dimension is equal, that dimension expanded
    from one slice with stride 0.
    """
    if x.dim() == 0:
        return x.clone()
    if allow_expand and draw(st.booleans()):
        same = [
            d for d in range(x.dim()) if x.shape[d] > 1 and bool((x == x.narrow(d, 0, 1)).all())
        ]
        if same:
            d = draw(st.sampled_from(same))
            one = as_view(draw, x.narrow(d, 0, 1).contiguous(), allow_expand=False)
            return one.expand(x.shape)
    perm = draw(st.permutations(range(x.dim())))
    steps = [draw(st.integers(1, 3)) for _ in perm]
    offset = draw(st.integers(0, 5))
    buf_shape = [x.shape[p] * s for p, s in zip(perm, steps, strict=True)]
    numel = 1
    for n in buf_shape:
        numel *= n
    flat = torch.full(
        (offset + numel,), -7, dtype=x.dtype, device=x.device
    )  # junk between elements
    strided = flat[offset:].view(buf_shape)[tuple(slice(None, None, s) for s in steps)]
    inverse = [perm.index(d) for d in range(x.dim())]
    y = strided.permute(inverse)
    y.copy_(x)
    assert torch.equal(y, x) and y.shape == x.shape
    return y


def maybe_same_rows(draw, x: torch.Tensor) -> torch.Tensor:
    """Sometimes make every row of ``x`` equal (so the row dimension can be expanded)."""
    if x.shape[0] > 1 and draw(st.booleans()):
        return x[:1].expand_as(x).clone()
    return x


def slots_of(cache: torch.Tensor) -> int:
    return cache.shape[0] * (cache.shape[1] if cache.dim() == 4 else 1)


def flat_rows(cache: torch.Tensor) -> torch.Tensor:
    """``(num_slots, heads, head_dim)``: a copy with slot ``s`` in row ``s``."""
    return cache.reshape(slots_of(cache), *cache.shape[-2:])


# ---------------------------------------------------------------------------------------------
# store_cache
# ---------------------------------------------------------------------------------------------


@st.composite
def store_case(draw, device: str):
    paged = draw(st.booleans())
    page_size = draw(st.sampled_from([1, 2, 4])) if paged else 1
    num_pages = draw(st.integers(1, 5))
    heads, dim = draw(st.integers(1, 3)), draw(st.sampled_from([1, 3, 4, 8]))
    num_slots = num_pages * page_size
    n = draw(st.integers(0, 6))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    shape = (num_pages, page_size, heads, dim) if paged else (num_slots, heads, dim)
    kc0 = torch.randn(shape, generator=g).to(device)
    vc0 = torch.randn(shape, generator=g).to(device)
    idx = torch.tensor(
        draw(st.lists(st.integers(0, num_slots - 1), min_size=n, max_size=n)), dtype=torch.int64
    )
    bad = draw(st.sampled_from([None, -1, num_slots, 2**32 + 1])) if n else None
    if bad is not None:  # one index out of range (2**32 + 1 would be 1 after an int32 cast)
        idx[draw(st.integers(0, n - 1))] = bad
    dtype = torch.int64 if bad == 2**32 + 1 else draw(st.sampled_from([torch.int32, torch.int64]))
    idx = maybe_same_rows(draw, idx.to(dtype)).to(device)
    k = maybe_same_rows(draw, torch.randn(n, heads, dim, generator=g)).to(device)
    v = maybe_same_rows(draw, torch.randn(n, heads, dim, generator=g)).to(device)
    views = dict(
        k_cache=as_view(draw, kc0, allow_expand=False),  # a cache must not overlap itself
        v_cache=as_view(draw, vc0, allow_expand=False),
        indices=as_view(draw, idx),
        k=as_view(draw, k),
        v=as_view(draw, v),
    )
    return views, dict(k_cache=kc0, v_cache=vc0, indices=idx, k=k, v=v)


def check_store(
    after: torch.Tensor, before: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor
) -> None:
    """Each slot named by ``idx`` holds one of the rows stored to it; every other slot is unchanged."""
    got, old = flat_rows(after).cpu(), flat_rows(before).cpu()
    written: dict = {}
    for i, s in enumerate(idx.tolist()):
        if 0 <= s < old.shape[0]:
            written.setdefault(s, []).append(rows[i].cpu())
    for s in range(old.shape[0]):
        if s in written:
            assert any(torch.equal(got[s], r) for r in written[s]), f"slot {s}"
        else:
            assert torch.equal(got[s], old[s]), f"slot {s} changed"


def run_store(fn, views, plain, check_bounds: bool) -> None:
    num_slots = slots_of(plain["k_cache"])
    idx = plain["indices"]
    in_range = bool(((idx >= 0) & (idx < num_slots)).all()) if idx.numel() else True
    kc_before, vc_before = views["k_cache"].clone(), views["v_cache"].clone()
    args = [views[a] for a in ("k_cache", "v_cache", "indices", "k", "v")]
    if check_bounds and not in_range:
        with pytest.raises(IndexError):
            fn(*args, check_bounds=True)
        assert torch.equal(views["k_cache"], kc_before) and torch.equal(views["v_cache"], vc_before)
        return
    fn(*args, check_bounds=check_bounds)
    check_store(views["k_cache"], plain["k_cache"], idx, plain["k"])
    check_store(views["v_cache"], plain["v_cache"], idx, plain["v"])


@needs_triton
@VIEWS
@given(data=st.data(), check_bounds=st.booleans())
def test_store_triton_any_view(data, check_bounds):
    device = data.draw(st.sampled_from(TRITON_DEVICES))
    views, plain = data.draw(store_case(device))
    run_store(store_cache_triton, views, plain, check_bounds)


@VIEWS
@given(data=st.data(), check_bounds=st.booleans())
def test_store_torch_any_view(data, check_bounds):
    device = data.draw(st.sampled_from(DEVICES))
    views, plain = data.draw(store_case(device))
    run_store(store_cache_torch, views, plain, check_bounds)


@pytest.mark.parametrize(
    "fn", [pytest.param(store_cache_triton, marks=needs_triton), store_cache_torch]
)
def test_store_column_of_a_table_and_expanded_indices(fn):
    """The cases the issue found: a column of a 2-D table, and one index expanded (stride 0)."""
    # The Triton kernel runs on the CPU under the interpreter only; on a GPU machine, on CUDA.
    dev = "cpu" if fn is store_cache_torch else TRITON_DEVICES[0]
    kc, vc = torch.zeros(2, 8, 4, 1, 4, device=dev).unbind(0)  # paged, page_size 4
    table = torch.tensor([[6, 0, 0], [1, 0, 0], [3, 0, 0]], dtype=torch.int32, device=dev)
    k = torch.arange(3 * 4, dtype=torch.float32, device=dev).view(3, 1, 4) + 1
    fn(kc, vc, table[:, 0], k, -k)
    assert torch.equal(flat_rows(kc)[[6, 1, 3]], k) and torch.equal(flat_rows(vc)[[6, 1, 3]], -k)
    assert int((flat_rows(kc) != 0).any(dim=(1, 2)).sum()) == 3
    one = torch.tensor([5], dtype=torch.int64, device=dev).expand(
        1000
    )  # 1000 reads of one stored element
    fn(kc, vc, one, k[:1].expand(1000, 1, 4), k[:1].expand(1000, 1, 4))
    assert torch.equal(flat_rows(kc)[5], k[0]) and torch.equal(flat_rows(vc)[5], k[0])


# ---------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------


@st.composite
def attention_case(draw, device: str, decode: bool):
    paged = draw(st.booleans())
    page_size = draw(st.sampled_from([1, 2, 4])) if paged else 1
    num_pages = draw(st.integers(1, 6))
    kv_heads, group, dim = (
        draw(st.integers(1, 2)),
        draw(st.integers(1, 3)),
        draw(st.sampled_from([2, 4, 8])),
    )
    num_slots = num_pages * page_size
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    shape = (num_pages, page_size, kv_heads, dim) if paged else (num_slots, kv_heads, dim)
    kc = maybe_same_rows(draw, torch.randn(shape, generator=g)).to(device)
    vc = torch.randn(shape, generator=g).to(device)
    batch = draw(st.integers(1, 3))
    slots: list[torch.Tensor] = []
    for _ in range(batch):
        t = draw(st.integers(1, 7))
        s = torch.tensor(draw(st.lists(st.integers(0, num_slots - 1), min_size=t, max_size=t)))
        slots.append(
            maybe_same_rows(draw, s.to(draw(st.sampled_from([torch.int32, torch.int64])))).to(
                device
            )
        )
    q_lens = [1 if decode else draw(st.integers(1, len(s))) for s in slots]
    q = maybe_same_rows(draw, torch.randn(sum(q_lens), kv_heads * group, dim, generator=g)).to(
        device
    )
    views = dict(
        q=as_view(draw, q),
        k_cache=as_view(draw, kc),
        v_cache=as_view(draw, vc),
        slots=[as_view(draw, s) for s in slots],
    )
    return views, dict(q=q, k_cache=kc, v_cache=vc, slots=slots), q_lens


def reference(plain, q_lens: Sequence[int]) -> torch.Tensor:
    """The torch path on contiguous copies of every argument."""
    return paged_attention(
        plain["q"].contiguous(),
        plain["k_cache"].contiguous(),
        plain["v_cache"].contiguous(),
        [s.contiguous() for s in plain["slots"]],
        list(q_lens),
    )


@VIEWS
@given(data=st.data())
def test_paged_attention_and_gather_any_view(data):
    device = data.draw(st.sampled_from(DEVICES))
    views, plain, q_lens = data.draw(attention_case(device, decode=False))
    out = paged_attention(views["q"], views["k_cache"], views["v_cache"], views["slots"], q_lens)
    torch.testing.assert_close(out, reference(plain, q_lens), rtol=1e-5, atol=1e-5)
    k, v = gather_kv(views["k_cache"], views["v_cache"], views["slots"][0])
    s = plain["slots"][0].long().cpu()
    assert torch.equal(k.cpu(), flat_rows(plain["k_cache"]).cpu()[s])
    assert torch.equal(v.cpu(), flat_rows(plain["v_cache"]).cpu()[s])


@needs_triton
@VIEWS
@given(
    data=st.data(),
    block_n=st.sampled_from([1, 2, 4, 32]),
    num_splits=st.one_of(st.none(), st.integers(1, 4)),
)
def test_paged_decode_triton_any_view(data, block_n, num_splits):
    device = data.draw(st.sampled_from(TRITON_DEVICES))
    views, plain, q_lens = data.draw(attention_case(device, decode=True))
    out = paged_decode_attention(
        views["q"],
        views["k_cache"],
        views["v_cache"],
        views["slots"],
        block_n=block_n,
        num_splits=num_splits,
    )
    torch.testing.assert_close(out, reference(plain, q_lens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fn", [paged_attention, paged_decode_attention])
def test_attention_slot_out_of_range_in_a_view(fn):
    """The bounds check reads the logical values a view holds, int64 beyond int32 included."""
    kc = vc = torch.zeros(4, 2, 1, 4)
    q = torch.zeros(1, 1, 4)
    table = torch.tensor([[0, 2**32 + 1], [1, 0]], dtype=torch.int64)
    with pytest.raises(IndexError, match=str(2**32 + 1)):
        fn(q, kc, vc, [table[:, 1]])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_views_on_cuda():
    """``make gpu-record`` runs ``-m gpu``: the view properties above, the kernels compiled for the device."""
    assert "cuda" in TRITON_DEVICES
    test_store_triton_any_view()
    test_store_torch_any_view()
    test_paged_attention_and_gather_any_view()
    test_paged_decode_triton_any_view()
