"""Managers and pools by name, as mini-sglang's engine and scheduler build them:
`create_cache_manager(device, type)`, `SUPPORTED_CACHE_MANAGER`, `create_kvcache` and the
`Registry` behind them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvcache import (
    SUPPORTED_CACHE_MANAGER,
    BlockHashCacheManager,
    KVCacheLayout,
    MHAKVCache,
    NaiveCacheManager,
    RadixCacheManager,
    Registry,
    RegistryError,
    TinyLlamaConfig,
    create_cache_manager,
    create_kvcache,
)


@pytest.mark.parametrize(
    "name, cls",
    [
        ("naive", NaiveCacheManager),
        ("radix", RadixCacheManager),
        ("block_hash", BlockHashCacheManager),
    ],
)
def test_each_name_builds_its_manager(name, cls):
    m = create_cache_manager(device=torch.device("cpu"), type=name)  # mini-sglang's call
    assert type(m) is cls and m.device == torch.device("cpu")
    assert name in SUPPORTED_CACHE_MANAGER and SUPPORTED_CACHE_MANAGER[name] is cls
    m.check_integrity()


def test_options_reach_the_manager():
    m = create_cache_manager("cpu", "radix", page_size=4, eviction_policy="fifo", events=True)
    assert m.page_size == 4 and m.eviction_policy == "fifo"
    m.insert_prefix(torch.arange(8), torch.arange(8, dtype=torch.int32))
    assert [e.tokens for e in m.take_events()] == [tuple(range(8))]  # events=True reached it
    assert create_cache_manager("cpu", "block_hash", page_size=8).page_size == 8
    with pytest.raises(TypeError, match="page_size"):
        create_cache_manager("cpu", "radix", page_size="4")
    with pytest.raises(TypeError, match="colour"):
        create_cache_manager("cpu", "naive", colour="red")


def test_supported_names_in_order():
    assert SUPPORTED_CACHE_MANAGER.supported_names()[:3] == ["naive", "radix", "block_hash"]
    assert len(SUPPORTED_CACHE_MANAGER) >= 3
    assert "lru" not in SUPPORTED_CACHE_MANAGER and 3 not in SUPPORTED_CACHE_MANAGER
    SUPPORTED_CACHE_MANAGER.assert_supported("radix")
    SUPPORTED_CACHE_MANAGER.assert_supported(["naive", "block_hash"])


@pytest.mark.parametrize("bad", ["lru", "Radix", "", "radix "])
def test_unknown_name_is_a_key_error_and_a_value_error(bad):
    for exc in (KeyError, ValueError):
        with pytest.raises(exc) as info:
            create_cache_manager("cpu", bad)
        assert isinstance(info.value, RegistryError)
        # the message reads as a sentence (a plain KeyError would print it quoted)
        assert str(info.value) == (
            f"unsupported cache manager: {bad!r}; supported: "
            f"{SUPPORTED_CACHE_MANAGER.supported_names()}"
        )
    with pytest.raises(RegistryError, match=repr(bad)):
        SUPPORTED_CACHE_MANAGER.assert_supported(["radix", bad])


@pytest.mark.parametrize("bad", [None, 1, b"radix", RadixCacheManager])
def test_a_name_must_be_a_str(bad):
    with pytest.raises(TypeError, match="must be a str"):
        create_cache_manager("cpu", bad)
    with pytest.raises(TypeError, match="must be a str"):
        Registry("thing").register(bad)
    with pytest.raises(TypeError, match="must be a str"):
        Registry(bad)
    with pytest.raises(TypeError, match=f"got {type(bad).__name__}"):
        SUPPORTED_CACHE_MANAGER.assert_supported(bad)  # not "'NoneType' object is not iterable"


def test_register_files_and_returns_the_item():
    reg: Registry[type] = Registry("widget")

    @reg.register("a")
    class A:
        pass

    assert A.__name__ == "A" and reg["a"] is A  # the decorator hands the class back
    assert reg.supported_names() == ["a"] and repr(reg) == "Registry('widget', ['a'])"


def test_a_taken_name_raises_and_changes_nothing():
    reg: Registry[int] = Registry("widget")
    reg.register("a")(1)
    with pytest.raises(RegistryError, match="widget 'a' is already registered"):
        reg.register("a")
    late = reg.register("b")
    reg.register("b")(2)
    with pytest.raises(KeyError, match="already registered"):
        late(3)  # taken between the call and the decoration
    assert reg["a"] == 1 and reg["b"] == 2 and len(reg) == 2
    with pytest.raises(ValueError, match="already registered"):
        SUPPORTED_CACHE_MANAGER.register("radix")
    assert SUPPORTED_CACHE_MANAGER["radix"] is RadixCacheManager


@pytest.mark.parametrize("layout", list(KVCacheLayout))
def test_create_kvcache_takes_the_models_shape(layout):
    cfg = TinyLlamaConfig(num_layers=3, num_kv_heads=2, head_dim=8)
    pool = create_kvcache(cfg, 5, torch.float16, "cpu", layout, page_size=4)
    want = MHAKVCache(2, 3, 8, 5, torch.float16, layout, "cpu", page_size=4)
    assert isinstance(pool, MHAKVCache)
    assert pool.buffer.shape == want.buffer.shape and pool.buffer.stride() == want.buffer.stride()
    assert pool.k_cache(2).shape == (5, 4, 2, 8) and pool.dtype == torch.float16
    # mini-sglang's engine passes everything by keyword, a config of its own shape included
    mini = create_kvcache(
        model_config=SimpleNamespace(num_kv_heads=4, num_layers=2, head_dim=16),
        num_pages=3,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
        cache_layout=layout,
    )
    assert mini.k_cache(0).shape == (3, 1, 4, 16) and mini.kv_layout is layout


def test_create_kvcache_names_what_a_config_lacks():
    with pytest.raises(TypeError, match="SimpleNamespace lacks num_layers, head_dim"):
        create_kvcache(SimpleNamespace(num_kv_heads=2), 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match="num_pages"):
        create_kvcache(TinyLlamaConfig(), 0, torch.float32, "cpu")
    with pytest.raises(TypeError, match="kv_layout"):
        create_kvcache(TinyLlamaConfig(), 4, torch.float32, "cpu", "LayerFirst")


@pytest.mark.parametrize("name", ["naive", "radix"])
def test_the_call_pattern_of_mini_sglangs_scheduler(name):
    """mini-sglang's scheduler at the guide's commit keeps a free list of slots beside a manager
    made by `create_cache_manager(device=..., type=...)`: match ``input_ids[:-1]``, lock, take
    slots (evicting when the free list is short), insert the finished request, free its slots
    in ``[cached_len, already cached)``, unlock. Its integrity rule: free slots plus the
    manager's ``total_size`` are the whole pool, after every request."""
    device, num_slots = torch.device("cpu"), 48
    m = create_cache_manager(device=device, type=name)
    free = torch.arange(num_slots, dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    systems = [torch.randint(0, 50, (10,), generator=g) for _ in range(3)]
    reused = 0
    for i in range(40):
        tail = torch.randint(0, 50, (int(torch.randint(1, 8, (1,), generator=g)),), generator=g)
        input_ids = torch.cat([systems[i % 3], tail])
        handle, prefix = m.match_prefix(input_ids[: len(input_ids) - 1])
        m.lock_handle(handle, unlock=False)
        need = len(input_ids) - handle.cached_len
        if need > len(free):
            free = torch.cat([free, m.evict(need - len(free))])
        new, free = free[:need], free[need:]
        indices = torch.cat([prefix, new])
        in_cache = m.insert_prefix(input_ids, indices)
        free = torch.cat([free, indices[handle.cached_len : in_cache]])
        m.lock_handle(handle, unlock=True)
        reused += handle.cached_len
        m.check_integrity()
        assert len(free) + m.size_info.total_size == num_slots
        assert m.size_info.protected_size == 0
        held = torch.cat([free, m.cached_indices()]).sort().values
        assert torch.equal(held, torch.arange(num_slots, dtype=torch.int32))  # none twice
    assert (reused > 0) == (name == "radix")
