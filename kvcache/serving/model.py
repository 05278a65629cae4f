"""A tiny Llama-style decoder whose keys and values live only in an :class:`MHAKVCache`.

RMSNorm, RoPE at absolute positions, grouped-query attention, SwiGLU MLP; seeded random weights
(a ``torch.Generator``, nothing downloaded, the global RNG untouched). Two ways to run it:

* :meth:`TinyLlama.forward` -- the served path. A batch of requests, each with its token slots
  in the pool; only the *new* tokens of each request are run. Every layer stores their K/V at
  their slots (``store_kv``) and attends over all of the request's slots (``paged_attention``),
  so a reused prefix is read back from the pool and never recomputed.
* :meth:`TinyLlama.reference_logits` -- the check: one sequence, dense causal attention on full
  tensors, no cache at all.

Both share every weight and every non-attention op, so they differ only in where K/V come from.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .._validate import (
    as_list,
    check_device,
    check_int_in,
    check_positive_int,
    check_slot_tensors,
    check_token_ids,
)
from ..kernels.attention import paged_attention, paged_decode_attention
from ..storage.base import KVCacheLayout
from ..storage.mha_pool import MHAKVCache

__all__ = ["TinyLlamaConfig", "TinyLlama"]


@dataclass(frozen=True)
class TinyLlamaConfig:
    """Shape of the model. ``vocab_size=256`` fits byte-level (UTF-8) token ids."""

    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    seed: int = 0

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_q_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
        ):  # kept as Python ints (frozen: set through object.__setattr__)
            object.__setattr__(self, name, check_positive_int(getattr(self, name), name))
        for name, floor in (("rope_theta", "> 0"), ("rms_norm_eps", ">= 0")):
            v = getattr(self, name)  # NaN or a negative value made every logit NaN
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
                raise TypeError(f"{name} must be a real number, got {type(v).__name__}")
            f = float(v)
            if not math.isfinite(f) or not (f > 0 if floor == "> 0" else f >= 0):
                raise ValueError(f"{name} must be finite and {floor}, got {f}")
        # torch.Generator.manual_seed takes [-2**63, 2**64): its own error names no argument.
        object.__setattr__(self, "seed", check_int_in(self.seed, "seed", -(2**63), 2**64 - 1))
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads={self.num_q_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs)")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x``: ``(n, hidden)``, normalised in float32, scaled by ``weight`` ``(hidden,)``."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate ``x`` ``(n, heads, head_dim)`` by its tokens' absolute ``positions`` ``(n,)`` (half-split pairs)."""
    d = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angles = positions.float()[:, None, None] * inv_freq  # (n, 1, d/2)
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def _causal_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Dense causal attention: ``q`` ``(L, Hq, D)``, ``k``/``v`` ``(L, Hkv, D)`` -> ``(L, Hq, D)``."""
    group = q.shape[1] // k.shape[1]
    q, k, v = (
        t.float().transpose(0, 1)
        for t in (q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))
    )
    scores = q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])  # (Hq, L, L)
    mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
    return (scores.masked_fill(mask, float("-inf")).softmax(-1) @ v).transpose(0, 1)


class _Layer(nn.Module):
    def __init__(self, c: TinyLlamaConfig, w: Callable[..., nn.Parameter]) -> None:
        super().__init__()
        h, qd, kvd = c.hidden_size, c.num_q_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.wq, self.wk, self.wv, self.wo = w(qd, h), w(kvd, h), w(kvd, h), w(h, qd)
        self.w_gate, self.w_up, self.w_down = (
            w(c.intermediate_size, h),
            w(c.intermediate_size, h),
            w(h, c.intermediate_size),
        )
        self.attn_norm, self.mlp_norm = w(h, ones=True), w(h, ones=True)


class TinyLlama(nn.Module):
    """A decoder-only transformer with seeded random weights, for inference only.

    Args:
        config: a :class:`TinyLlamaConfig`; ``config.seed`` fixes every weight.
        device, dtype: where the weights live and their dtype; the pool must match both.
    """

    def __init__(
        self,
        config: TinyLlamaConfig = TinyLlamaConfig(),
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if not isinstance(config, TinyLlamaConfig):
            raise TypeError(f"config must be a TinyLlamaConfig, got {type(config).__name__}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
        self.config, self.device, self.dtype = config, check_device(device), dtype
        g = torch.Generator().manual_seed(config.seed)

        def w(*shape: int, ones: bool = False, std: float | None = None) -> nn.Parameter:
            t = (
                torch.ones(shape)
                if ones
                else torch.randn(shape, generator=g) * (std or shape[-1] ** -0.5)
            )
            return nn.Parameter(t.to(device=self.device, dtype=dtype), requires_grad=False)

        self.embed = w(config.vocab_size, config.hidden_size, std=1.0)
        self.layers = nn.ModuleList(_Layer(config, w) for _ in range(config.num_layers))
        self.norm = w(config.hidden_size, ones=True)
        self.lm_head = w(config.vocab_size, config.hidden_size)

    # ------------------------------------------------------------------------------- shared body
    def _run(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """``ids``, ``positions``: ``(n,)``; ``attend(layer, q, k, v)`` -> ``(n, Hq, D)``. Returns ``(n, hidden)``."""
        c, n = self.config, len(ids)
        h = F.embedding(ids.to(self.device), self.embed)
        # nn.ModuleList is not generic: its items are typed Module, these are all _Layer.
        for i, layer in enumerate(cast("Iterable[_Layer]", self.layers)):
            x = rms_norm(h, layer.attn_norm, c.rms_norm_eps)
            q = apply_rope(
                F.linear(x, layer.wq).view(n, c.num_q_heads, c.head_dim), positions, c.rope_theta
            )
            k = apply_rope(
                F.linear(x, layer.wk).view(n, c.num_kv_heads, c.head_dim), positions, c.rope_theta
            )
            v = F.linear(x, layer.wv).view(n, c.num_kv_heads, c.head_dim)
            h = h + F.linear(attend(i, q, k, v).to(h.dtype).flatten(1), layer.wo)
            x = rms_norm(h, layer.mlp_norm, c.rms_norm_eps)
            h = h + F.linear(
                F.silu(F.linear(x, layer.w_gate)) * F.linear(x, layer.w_up), layer.w_down
            )
        return rms_norm(h, self.norm, c.rms_norm_eps)

    # ------------------------------------------------------------------------------- served path
    def check_ids(self, ids: object, name: str = "ids") -> torch.Tensor:
        """``ids`` must be a non-empty 1-D integer CPU tensor of token ids in ``[0, vocab_size)``."""
        t = check_token_ids(ids, name)
        if t.shape[0] == 0:
            raise ValueError(f"{name} must hold at least one token")
        lo, hi, vocab = int(t.min()), int(t.max()), self.config.vocab_size
        if lo < 0 or hi >= vocab:
            raise ValueError(f"{name} must lie in [0, vocab_size={vocab}), got [{lo}, {hi}]")
        return t

    def check_kv_cache(self, kv_cache: MHAKVCache) -> None:
        """``ValueError`` unless ``kv_cache`` has this model's layers, KV heads, head_dim, dtype and device."""
        if not isinstance(kv_cache, MHAKVCache):
            raise TypeError(f"kv_cache must be an MHAKVCache, got {type(kv_cache).__name__}")
        c = self.config
        want = (c.num_layers, c.num_kv_heads, c.head_dim, self.dtype, self.device)
        got = (
            kv_cache.num_layers,
            kv_cache.local_kv_heads,
            kv_cache.head_dim,
            kv_cache.dtype,
            kv_cache.device,
        )
        if got != want:
            raise ValueError(
                f"kv_cache (layers, local_kv_heads, head_dim, dtype, device) = {got}; the model needs {want}"
            )

    def new_kv_cache(
        self,
        num_pages: int,
        page_size: int = 1,
        kv_layout: KVCacheLayout = KVCacheLayout.LayerFirst,
    ) -> MHAKVCache:
        """An empty pool shaped for this model: ``num_pages * page_size`` token slots."""
        c = self.config
        return MHAKVCache(
            c.num_kv_heads,
            c.num_layers,
            c.head_dim,
            num_pages,
            self.dtype,
            kv_layout,
            self.device,
            page_size=page_size,
        )

    @torch.inference_mode()
    def forward(
        self,
        ids: torch.Tensor,
        slots: Sequence[torch.Tensor],
        q_lens: Sequence[int],
        kv_cache: MHAKVCache,
        *,
        last_only: bool = False,
        decode_kernel: bool = False,
    ) -> torch.Tensor:
        """Run the new tokens of a batch of requests, reading and writing K/V only through ``kv_cache``.

        ``slots[r]``: ``(T_r,)`` slots of *all* of request ``r``'s tokens, in order; its last
        ``q_lens[r]`` tokens are new, their ids packed in ``ids`` ``(sum(q_lens),)`` request after
        request. New token ``j`` of request ``r`` sits at position ``T_r - q_lens[r] + j`` (RoPE and
        the causal mask both use it); the first ``T_r - q_lens[r]`` slots must already hold K/V.
        Each layer stores the new tokens' K/V at their slots, then attends over ``slots[r]``.
        ``decode_kernel=True`` uses the Triton decode kernel when every ``q_lens[r] == 1``.

        Returns logits ``(sum(q_lens), vocab)``, or ``(B, vocab)`` for each request's last token
        with ``last_only=True``.
        """
        self.check_ids(ids)
        self.check_kv_cache(kv_cache)
        slots = as_list(slots, "slots", "1-D slot tensors")
        q_lens = as_list(q_lens, "q_lens", "ints")
        if len(q_lens) != len(slots) or not slots:
            raise ValueError(
                f"need one q_len per request and at least one request; got {len(q_lens)} and {len(slots)}"
            )
        num_slots = kv_cache.num_pages * kv_cache.page_size
        # Checked here once, with one read-back for the batch, so that attention in every layer
        # skips its own range check (a host sync on a GPU). The store keeps its check: it goes
        # through ``store_kv(k, v, out_loc, layer_id)``, the pool's contract, which a subclass
        # or a wrapper may override with exactly that signature.
        slots = check_slot_tensors(slots, "slots", num_slots, kv_cache.device)
        q_lens = [
            check_int_in(ql, f"q_lens[{r}]", 1, len(s))
            for r, (s, ql) in enumerate(zip(slots, q_lens, strict=True))
        ]
        if len(ids) != sum(q_lens):
            raise ValueError(f"len(ids)={len(ids)} != sum(q_lens)={sum(q_lens)}")
        positions = torch.cat(
            [torch.arange(len(s) - ql, len(s)) for s, ql in zip(slots, q_lens, strict=True)]
        ).to(self.device)
        out_loc = torch.cat([s[len(s) - ql :] for s, ql in zip(slots, q_lens, strict=True)])
        use_kernel = decode_kernel and all(ql == 1 for ql in q_lens)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kv_cache.store_kv(k, v, out_loc, layer)
            k_layer, v_layer = kv_cache.k_cache(layer), kv_cache.v_cache(layer)
            if use_kernel:
                return paged_decode_attention(q, k_layer, v_layer, slots, check_bounds=False)
            return paged_attention(q, k_layer, v_layer, slots, q_lens, check_bounds=False)

        h = self._run(ids, positions, attend)
        if last_only:
            h = h[torch.tensor(q_lens, device=self.device).cumsum(0) - 1]
        return F.linear(h, self.lm_head)

    # ---------------------------------------------------------------------------------- check
    @torch.inference_mode()
    def reference_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits ``(L, vocab)`` of every token of ``ids`` ``(L,)``: dense causal attention, no cache."""
        self.check_ids(ids)
        positions = torch.arange(len(ids), device=self.device)
        return F.linear(
            self._run(ids, positions, lambda _, q, k, v: _causal_gqa(q, k, v)), self.lm_head
        )
