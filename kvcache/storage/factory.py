"""`create_kvcache`: the K/V pool for a model's shape, as mini-sglang's engine builds it."""

from __future__ import annotations

from typing import Protocol

import torch

from .base import KVCacheLayout
from .mha_pool import MHAKVCache

__all__ = ["ModelShape", "create_kvcache"]

_SHAPE = ("num_kv_heads", "num_layers", "head_dim")


class ModelShape(Protocol):
    """What `create_kvcache` reads of a model config."""

    num_kv_heads: int
    num_layers: int
    head_dim: int


def create_kvcache(
    model_config: ModelShape,
    num_pages: int,
    dtype: torch.dtype,
    device: torch.device | str,
    cache_layout: KVCacheLayout = KVCacheLayout.LayerFirst,
    *,
    page_size: int = 1,
) -> MHAKVCache:
    """An `MHAKVCache` of ``num_pages`` pages for a model whose config has ``num_kv_heads``,
    ``num_layers`` and ``head_dim`` (any object with those attributes, e.g. `TinyLlamaConfig`).

    mini-sglang's call, plus ``page_size``. ``TypeError`` naming the attributes a config lacks;
    the pool's own errors for the values.
    """
    missing = [name for name in _SHAPE if not hasattr(model_config, name)]
    if missing:
        raise TypeError(
            f"model_config must have {', '.join(_SHAPE)}; {type(model_config).__name__} "
            f"lacks {', '.join(missing)}"
        )
    return MHAKVCache(
        num_kv_heads=model_config.num_kv_heads,
        num_layers=model_config.num_layers,
        head_dim=model_config.head_dim,
        num_pages=num_pages,
        dtype=dtype,
        kv_layout=cache_layout,
        device=device,
        page_size=page_size,
    )
