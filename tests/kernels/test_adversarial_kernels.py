"""Adversarial inputs to the kernels' host wrappers and the pools (`MHAKVCache`, `HostKVPool`),
by class of input: each is refused with ``TypeError``/``ValueError`` naming the argument (and
nothing is written), or taken as the integer it is; a store into a cache that requires grad
writes K and V both, as the Triton kernel does."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import param_id, unchanged

from kvcache import (
    HostKVPool,
    KVCacheLayout,
    MHAKVCache,
    gather_kv,
    paged_attention,
    paged_decode_attention,
    paged_decode_backend,
    store_cache,
    store_cache_backend,
    store_cache_torch,
)

H, D = 2, 8
STORES = [store_cache, store_cache_torch]


def layer(paged: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (8, 4, H, D) if paged else (32, H, D)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def batch() -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Two decode queries (4 query heads over 2 KV heads) and their slots."""
    q = torch.randn(2, 4, D, generator=torch.Generator().manual_seed(1))
    return q, [torch.tensor([0, 1, 2, 5], dtype=torch.int32), torch.tensor([9, 10])]


# ------------------------------------------------------------------ sparse tensors
SPARSE = {
    "store.k_cache": lambda kc, vc, q, s: store_cache(
        kc.to_sparse(), vc, s[0], torch.ones(4, H, D), torch.ones(4, H, D)
    ),
    "store.indices": lambda kc, vc, q, s: store_cache(
        kc, vc, s[0].to_sparse(), torch.ones(4, H, D), torch.ones(4, H, D)
    ),
    "store.k": lambda kc, vc, q, s: store_cache(
        kc, vc, s[0], torch.ones(4, H, D).to_sparse(), torch.ones(4, H, D)
    ),
    "attention.q": lambda kc, vc, q, s: paged_attention(q.to_sparse(), kc, vc, s),
    "attention.v_cache": lambda kc, vc, q, s: paged_attention(q, kc, vc.to_sparse(), s),
    "attention.slots": lambda kc, vc, q, s: paged_attention(q, kc, vc, [s[0].to_sparse(), s[1]]),
    "decode.q": lambda kc, vc, q, s: paged_decode_attention(q.to_sparse(), kc, vc, s),
    "gather_kv.slots": lambda kc, vc, q, s: gather_kv(kc, vc, s[0].to_sparse()),
}


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("call", list(SPARSE), ids=str)
def test_sparse_tensors_are_refused_by_name_before_anything_is_written(paged, call):
    """They passed the shape, dtype and device checks and failed inside torch
    (``NotImplementedError`` from ``aminmax``, ``index_put_`` or the storage access)."""
    kc, vc = layer(paged)
    q, s = batch()
    with unchanged(kc, vc), pytest.raises(TypeError, match="must be a dense"):
        SPARSE[call](kc, vc, q, s)


# ------------------------------------------------------------------ store into caches with grad
@pytest.mark.parametrize("store", STORES, ids=lambda f: f.__name__)
@pytest.mark.parametrize("which", ["k_cache", "v_cache", "k"])
def test_store_writes_k_and_v_whatever_requires_grad(store, which):
    """The torch path raised on a V cache that requires grad after it had written K (and put a
    graph on the cache when ``k`` required grad); the Triton kernel writes outside autograd."""
    kc, vc = layer(paged=True)
    k, v = torch.randn(3, H, D), torch.randn(3, H, D)
    idx = torch.tensor([1, 6, 30], dtype=torch.int32)
    want_k, want_v = kc.clone(), vc.clone()
    want_k.view(32, H, D)[idx.long()], want_v.view(32, H, D)[idx.long()] = k, v
    args = {"k_cache": kc, "v_cache": vc, "k": k}
    args[which] = args[which].requires_grad_()
    store(kc, vc, idx, k, v)
    assert torch.equal(kc.detach(), want_k) and torch.equal(vc.detach(), want_v)
    assert kc.grad_fn is None and vc.grad_fn is None


# ------------------------------------------------------------------ attention arguments
@pytest.mark.parametrize(
    "scale,exc",
    [
        ("0.5", TypeError),
        (b"1", TypeError),
        (True, TypeError),
        (1 + 0j, TypeError),
        ([1.0], TypeError),
        (np.array([[1.0]]), TypeError),
        (torch.tensor(True), TypeError),
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        (torch.tensor(float("inf")), ValueError),
    ],
    ids=param_id,
)
@pytest.mark.parametrize(
    "attend", [paged_attention, paged_decode_attention], ids=lambda f: f.__name__
)
def test_attention_scale_is_a_finite_real_number(scale, exc, attend):
    """``"0.5"`` and ``b"1"`` were taken by ``float()``; NaN and infinity gave NaN outputs."""
    kc, vc = layer(paged=True)
    q, s = batch()
    with pytest.raises(exc, match="scale must be"):
        attend(q, kc, vc, s, scale=scale)
    want = paged_attention(q, kc, vc, s, scale=0.5)
    for same in (np.float32(0.5), torch.tensor(0.5), 0.5):
        torch.testing.assert_close(attend(q, kc, vc, s, scale=same), want)


@pytest.mark.parametrize("q_len", [np.int64(1), torch.tensor(1), np.uint8(1)], ids=param_id)
def test_q_lens_take_integers_of_every_library(q_len):
    """A NumPy or torch integer was refused as if it were out of range (``ValueError``)."""
    kc, vc = layer(paged=False)
    q, s = batch()
    want = paged_attention(q, kc, vc, s, [1, 1])
    torch.testing.assert_close(paged_attention(q, kc, vc, s, [q_len, q_len]), want)
    for same in (np.array([1, 1]), torch.tensor([1, 1]), (n for n in (1, 1))):
        torch.testing.assert_close(paged_attention(q, kc, vc, s, same), want)


@pytest.mark.parametrize(
    "q_lens,exc,match",
    [
        ([1.0, 1], TypeError, r"q_lens\[0\] must be an integer"),
        ([1, True], TypeError, r"q_lens\[1\] must be an integer"),
        (3, TypeError, "q_lens must be a sequence"),
        (object(), TypeError, "q_lens must be a sequence"),
        ("11", TypeError, r"q_lens\[0\] must be an integer"),
    ],
    ids=param_id,
)
def test_q_lens_of_the_wrong_kind_are_refused_by_name(q_lens, exc, match):
    kc, vc = layer(paged=False)
    q, s = batch()
    with pytest.raises(exc, match=match):
        paged_attention(q, kc, vc, s, q_lens)


@pytest.mark.parametrize("block_n", [2**20, 2**31, 2**63, 2**64], ids=param_id)
def test_decode_block_n_past_tritons_block_limit_is_refused(block_n):
    """A power of two too large for a Triton block reached the compiler (``numel exceeds
    triton maximum tensor numel``, ``arange must fit in int32``); the torch path ignored it."""
    kc, vc = layer(paged=True)
    q, s = batch()
    with pytest.raises(ValueError, match=r"block_n must be a power of two in \[1, \d+\]"):
        paged_decode_attention(q, kc, vc, s, block_n=block_n)
    want = paged_attention(q, kc, vc, s)
    torch.testing.assert_close(paged_decode_attention(q, kc, vc, s, block_n=np.int64(16)), want)


@pytest.mark.parametrize(
    "backend", [store_cache_backend, paged_decode_backend], ids=lambda f: f.__name__
)
@pytest.mark.parametrize("device", [None, 0, 1.5, "nope", b"cpu", torch.tensor(0)], ids=param_id)
def test_backend_of_a_bad_device_is_refused_by_name(backend, device):
    """Each reached ``torch.device``: its own messages (``Invalid device string``, ``Cannot
    access accelerator``), naming no argument."""
    with pytest.raises((TypeError, ValueError)) as info:
        backend(device)
    assert str(info.value).startswith("device "), info.value


# ------------------------------------------------------------------ MHAKVCache
def pool(**kw: object) -> MHAKVCache:
    args: dict[str, object] = dict(
        num_kv_heads=2,
        num_layers=2,
        head_dim=4,
        num_pages=8,
        dtype=torch.float32,
        kv_layout=KVCacheLayout.LayerFirst,
        device="cpu",
        page_size=2,
    )
    args.update(kw)
    return MHAKVCache(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "arg", ["num_kv_heads", "num_layers", "head_dim", "num_pages", "page_size"]
)
@pytest.mark.parametrize("value", [np.int64(2), torch.tensor(2), np.uint16(2)], ids=param_id)
def test_pool_sizes_of_every_library_are_kept_as_python_ints(arg, value):
    """They were stored as given (``num_slots`` a NumPy product, a 0-d tensor); a NumPy
    ``num_kv_heads`` failed in ``divide_even`` naming ``a``."""
    p = pool(**{arg: value})
    for name in (
        "num_kv_heads",
        "local_kv_heads",
        "head_dim",
        "num_pages",
        "page_size",
        "num_slots",
    ):
        assert type(getattr(p, name)) is int, name
    k = torch.ones(1, p.local_kv_heads, p.head_dim)
    p.store_kv(k, k, torch.tensor([3], dtype=torch.int32), np.int64(1))  # layer ids too
    assert torch.equal(p.k_cache(np.int64(1)).reshape(-1, p.local_kv_heads, p.head_dim)[3], k[0])


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"num_pages": 2**31, "page_size": 2**31}, "do not fit in int32"),
        ({"num_pages": 2**30, "page_size": 4}, "do not fit in int32"),
        ({"num_layers": 2**62}, "more than one tensor can hold"),
        ({"head_dim": 2**63}, "more than one tensor can hold"),
    ],
    ids=param_id,
)
def test_pool_too_large_for_its_slots_or_a_tensor_is_refused_before_allocating(kw, match):
    """Slots past int32 were allocated (16 GiB for the second case); a size past int64 failed in
    ``torch.zeros`` ("Overflow when unpacking long") naming no argument."""
    with pytest.raises(ValueError, match=match):
        pool(**kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_pool_on_a_missing_device_is_refused_by_name():
    """Was torch's ``AssertionError: Torch not compiled with CUDA enabled``."""
    with pytest.raises(ValueError, match="device 'cuda' is not available"):
        pool(device="cuda")


# ------------------------------------------------------------------ HostKVPool
@pytest.mark.parametrize(
    "pages,exc",
    [
        (torch.tensor([True, False]), TypeError),
        (torch.tensor([0.0, 1.0]), TypeError),
        (torch.tensor([0, 1]).to(torch.complex64), TypeError),
        (torch.tensor([0, 1]).to_sparse(), TypeError),
        (torch.empty(2, dtype=torch.int64, device="meta"), ValueError),
    ],
    ids=["bool", "float", "complex", "sparse", "meta"],
)
def test_host_pool_page_ids_must_be_integer_values(pages, exc):
    """``bool`` and complex pages were cast to page ids (complex with only a warning); meta and
    sparse ones failed inside torch (``NotImplementedError``)."""
    dev = pool()
    host = HostKVPool(dev, 4)
    staged = host.read(torch.tensor([0, 1]))
    with unchanged(dev, host.buffer), pytest.raises(exc, match="pages must"):
        host.read(pages)
    with unchanged(dev, host.buffer), pytest.raises(exc, match="pages must"):
        host.save(dev, torch.tensor([0, 1]), pages)
    with unchanged(dev, host.buffer), pytest.raises(exc, match="pages must"):
        host.restore(dev, pages, staged)


def test_host_pool_copies_only_to_and_from_a_pool_of_its_page_shape():
    """Another geometry or dtype failed inside torch's indexing ("shape mismatch", "Index put
    requires the source and destination dtypes match")."""
    dev = pool()
    host = HostKVPool(dev, 4)
    staged = host.read(torch.tensor([0, 1]))
    other = pool(head_dim=8)
    with unchanged(other, host.buffer), pytest.raises(ValueError, match="device's pages are"):
        host.save(other, torch.tensor([0, 1]), torch.tensor([0, 1]))
    with unchanged(other), pytest.raises(ValueError, match="device's pages are"):
        host.restore(other, torch.tensor([0, 1]), staged)
    with unchanged(dev), pytest.raises(ValueError, match="staged must have dtype"):
        host.restore(dev, torch.tensor([0, 1]), staged.double())
    with unchanged(dev), pytest.raises(TypeError, match="device must be an MHAKVCache"):
        host.restore(None, torch.tensor([0, 1]), staged)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="do not fit in one tensor"):
        HostKVPool(dev, 2**62)  # was "Overflow when unpacking long" from torch.zeros
