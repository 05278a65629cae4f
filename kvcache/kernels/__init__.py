"""The kernels layer: functions of tensors that move K/V into a cache and attend over it.

:mod:`kvcache.kernels.store` scatters new tokens' K/V into their slots (Triton, with a torch
fallback); :mod:`kvcache.kernels.attention` attends over a layer's K/V through token slots (torch
reference, Triton flash decoding); :mod:`kvcache.kernels.checks` holds the argument checks both
make before a kernel runs. They take tensors (one layer's ``k_cache``/``v_cache`` views), never a
pool object, and import nothing of the package above them.
"""

from .attention import (
    decode_launch_shape,
    gather_kv,
    paged_attention,
    paged_decode_attention,
    paged_decode_backend,
)
from .store import (
    TRITON_INTERPRET,
    store_cache,
    store_cache_backend,
    store_cache_torch,
    store_cache_triton,
    store_launch_shape,
)

__all__ = [
    "TRITON_INTERPRET",
    "decode_launch_shape",
    "gather_kv",
    "paged_attention",
    "paged_decode_attention",
    "paged_decode_backend",
    "store_cache",
    "store_cache_backend",
    "store_cache_torch",
    "store_cache_triton",
    "store_launch_shape",
]
