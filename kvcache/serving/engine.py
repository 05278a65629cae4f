"""`Engine`: serve a :class:`~kvcache.serving.model.TinyLlama` from a paged KV pool with prefix reuse.

The request flow decides which tokens are new; the model runs only those::

    prefill   begin(ids, compute_last=True)   match + lock the cached prefix, allocate the rest
              model(ids[reused_len:], ...)    store K/V of the new tokens, attend over all slots
              mark_computed
    decode    extend(req, [token]) -> model(token) -> mark_computed
    finish    insert the request into the cache, free duplicates, unlock

``computed_tokens`` and ``reused_tokens`` count what the model actually ran and what it read
back from the cache instead.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple, Union

import torch

from .._validate import check_size
from .allocator import PageAllocator
from ..managers.base import BaseCacheManager
from ..storage.mha_pool import MHAKVCache
from .model import TinyLlama
from .request_flow import FlowStats, Request, RequestFlow

__all__ = ["Engine"]

Token = Union[int, torch.Tensor]


class Engine:
    """A tiny serving loop: `RequestFlow` (which tokens to run) + `TinyLlama` (running them).

    Args:
        model: the model; ``kv_cache`` must be shaped for it (see ``TinyLlama.new_kv_cache``).
        kv_cache: the only place K/V live.
        manager: any prefix-cache manager (``NaiveCacheManager`` caches nothing).
        allocator: the page free list; same ``page_size`` as ``kv_cache`` and at most its pages.
        decode_kernel: run decode steps with the Triton decode kernel (``paged_decode_attention``).
        trace: keep the flow's step events in ``engine.flow.events``.
    """

    def __init__(self, model: TinyLlama, kv_cache: MHAKVCache, manager: BaseCacheManager,
                 allocator: PageAllocator, *, decode_kernel: bool = False, trace: bool = False) -> None:
        model.check_kv_cache(kv_cache)
        if allocator.page_size != kv_cache.page_size or allocator.num_pages > kv_cache.num_pages:
            raise ValueError(
                f"allocator (num_pages={allocator.num_pages}, page_size={allocator.page_size}) does not fit "
                f"kv_cache (num_pages={kv_cache.num_pages}, page_size={kv_cache.page_size})"
            )
        self.model, self.kv_cache, self.decode_kernel = model, kv_cache, decode_kernel
        self.flow = RequestFlow(manager, allocator, trace=trace)
        self.computed_tokens = 0  # tokens the model ran (prefill and decode)
        self.reused_tokens = 0  # prompt tokens whose K/V were read from the cache instead

    @property
    def stats(self) -> FlowStats:
        return self.flow.stats

    def _run(self, reqs: List[Request], ids: torch.Tensor) -> torch.Tensor:
        """Run every request's not-yet-computed tokens (``ids``, packed); logits ``(B, vocab)`` of their last."""
        q_lens = [len(r) - r.num_computed for r in reqs]
        logits = self.model(ids, [r.indices for r in reqs], q_lens, self.kv_cache, last_only=True,
                            decode_kernel=self.decode_kernel)
        for r in reqs:
            self.flow.mark_computed(r)
        self.computed_tokens += sum(q_lens)
        return logits

    def prefill_batch(self, prompts: Sequence[torch.Tensor]) -> Tuple[List[Request], torch.Tensor]:
        """Start one request per prompt (1-D CPU int ids), running only the tokens not reused from the cache.

        Returns the requests and the logits ``(B, vocab)`` of each prompt's last token. Prompts of
        one batch do not reuse each other (none is cached yet). On error every request is aborted.
        """
        reqs: List[Request] = []
        try:
            for p in prompts:
                reqs.append(self.flow.begin(p, compute_last=True))
            logits = self._run(reqs, torch.cat([r.input_ids[r.num_computed:] for r in reqs]))
        except BaseException:
            for r in reqs:
                self.flow.abort(r)
            raise
        self.reused_tokens += sum(r.reused_len for r in reqs)
        return reqs, logits

    def prefill(self, prompt: torch.Tensor) -> Tuple[Request, torch.Tensor]:
        """:meth:`prefill_batch` of one prompt: ``(request, logits (vocab,))``."""
        reqs, logits = self.prefill_batch([prompt])
        return reqs[0], logits[0]

    def decode_batch(self, reqs: Sequence[Request], tokens: Sequence[Token]) -> torch.Tensor:
        """Append ``tokens[r]`` to request ``r`` and run it; logits ``(B, vocab)`` for the next tokens.

        Refused before any request changes: ``ValueError`` for a token outside the vocabulary,
        ``RuntimeError`` for a request not running here or when the pool cannot take the new pages.
        """
        reqs = list(reqs)
        ids = torch.tensor([int(t) for t in tokens], dtype=torch.int64)
        if len(ids) != len(reqs):
            raise ValueError(f"need one token per request: {len(ids)} tokens for {len(reqs)} requests")
        if len({id(r) for r in reqs}) != len(reqs) or any(self.flow.running.get(r.rid) is not r for r in reqs):
            raise RuntimeError("every request must be running in this engine, each listed once")
        vocab = self.model.config.vocab_size
        if len(ids) and not 0 <= int(ids.min()) <= int(ids.max()) < vocab:
            raise ValueError(f"tokens must lie in [0, vocab_size={vocab}), got {ids.tolist()}")
        need = sum(len(r) % self.flow.page_size == 0 for r in reqs)
        if need > self.flow.available_pages():
            raise RuntimeError(f"out of KV pages: decode needs {need}, {self.flow.available_pages()} available")
        for r, t in zip(reqs, ids):
            self.flow.extend(r, t.view(1))
        return self._run(reqs, ids)

    def decode(self, req: Request, token: Token) -> torch.Tensor:
        """:meth:`decode_batch` of one request: logits ``(vocab,)``."""
        return self.decode_batch([req], [token])[0]

    def finish(self, req: Request) -> int:
        """Cache the request (prompt and decoded tokens) and release it; returns the length already cached."""
        return self.flow.finish(req)

    def generate(self, prompt: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy decoding: ``max_new_tokens`` new token ids ``(max_new_tokens,)`` int64; the request is cached."""
        check_size(max_new_tokens, "max_new_tokens")
        req, logits = self.prefill(prompt)
        out: List[int] = []
        try:
            for i in range(max_new_tokens):
                out.append(int(logits.argmax()))
                if i + 1 < max_new_tokens:
                    logits = self.decode(req, out[-1])
        except BaseException:
            self.flow.abort(req)
            raise
        self.finish(req)
        return torch.tensor(out, dtype=torch.int64)
