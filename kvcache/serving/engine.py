"""`Engine`: serve a :class:`~kvcache.serving.model.TinyLlama` from a paged KV pool with prefix reuse.

The request flow decides which tokens are new; the model runs only those::

    prefill   begin(ids, compute_last=True)   match + lock the cached prefix, allocate the rest
              model(ids[reused_len:], ...)    store K/V of the new tokens, attend over all slots
              mark_computed
    decode    extend(req, [token]) -> model(token) -> mark_computed
    finish    insert the request into the cache, free duplicates, unlock

``computed_tokens`` and ``reused_tokens`` (the flow's `FlowStats`) count what the model actually
ran and what it read back from the cache instead.

When the model fails. A bad argument is refused before anything changes. Once the flow has
taken the call's tokens (``begin``, ``extend``), a failure of the model, of the pool's
``store_kv`` or of ``mark_computed`` (any exception) ends the call's requests and propagates:
what each had computed is cached (whole pages), the rest of its pages are freed, and it is no
longer running (`RequestFlow.is_running` says so), so nothing is left half done: no token
without K/V, no page lost. To go on, prefill the tokens again: the cached part is reused.
(The flow has no call that takes tokens back, so a failed decode cannot leave its request as
it was before the call; ending it is the documented state.) The slots the failed call was
filling may hold anything: no request owns them any more.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from contextlib import suppress

import torch

from .._validate import as_int, as_list, check_size, reject_one_tensor
from ..managers.base import BaseCacheManager
from ..storage.mha_pool import MHAKVCache
from .allocator import PageAllocator
from .model import TinyLlama
from .request_flow import FlowStats, Request, RequestFlow, check_manager

__all__ = ["Engine"]

Token = int | torch.Tensor


class Engine:
    """A tiny serving loop: `RequestFlow` (which tokens to run) + `TinyLlama` (running them).

    The engine orchestrates only: the flow decides what is cached, what is allocated and what a
    request may do; the engine checks what only the model knows (the vocabulary) before calling
    the flow, and runs the model on the tokens the flow says are new. Every call is all or
    nothing: a refused call changes no request, page, cache entry or count.

    Args:
        model: the model; ``kv_cache`` must be shaped for it (see ``TinyLlama.new_kv_cache``).
        kv_cache: the only place K/V live.
        manager: any prefix-cache manager (``NaiveCacheManager`` caches nothing).
        allocator: the page free list; same ``page_size`` and device as ``kv_cache``, at most its pages.
        decode_kernel: run decode steps with the Triton decode kernel (``paged_decode_attention``).
        trace: keep the flow's step events in ``engine.flow.events``.
    """

    def __init__(
        self,
        model: TinyLlama,
        kv_cache: MHAKVCache,
        manager: BaseCacheManager,
        allocator: PageAllocator,
        *,
        decode_kernel: bool = False,
        trace: bool = False,
    ) -> None:
        if not isinstance(model, TinyLlama):
            raise TypeError(f"model must be a TinyLlama, got {type(model).__name__}")
        model.check_kv_cache(kv_cache)
        check_manager(manager)
        if not isinstance(allocator, PageAllocator):
            raise TypeError(f"allocator must be a PageAllocator, got {type(allocator).__name__}")
        for name, flag in (("decode_kernel", decode_kernel), ("trace", trace)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        if allocator.page_size != kv_cache.page_size or allocator.num_pages > kv_cache.num_pages:
            raise ValueError(
                f"allocator (num_pages={allocator.num_pages}, page_size={allocator.page_size}) does not fit "
                f"kv_cache (num_pages={kv_cache.num_pages}, page_size={kv_cache.page_size})"
            )
        if allocator.device != kv_cache.device:
            raise ValueError(
                f"allocator device {allocator.device} != kv_cache device {kv_cache.device}"
            )
        if isinstance(manager, BaseCacheManager):
            manager.check_parts(allocator=allocator, pool=kv_cache)  # a host tier: its own parts
        self.model, self.kv_cache, self.decode_kernel = model, kv_cache, decode_kernel
        self.flow = RequestFlow(manager, allocator, trace=trace)

    @property
    def stats(self) -> FlowStats:
        return self.flow.stats

    @property
    def computed_tokens(self) -> int:
        """Tokens the model ran (prefill and decode): the flow's ``stats.computed_tokens``."""
        return self.flow.stats.computed_tokens

    @property
    def reused_tokens(self) -> int:
        """Prompt tokens whose K/V were read from the cache instead: ``stats.reused_tokens``."""
        return self.flow.stats.reused_tokens

    def _run(self, reqs: list[Request]) -> torch.Tensor:
        """Run every request's not-yet-computed tokens; logits ``(B, vocab)`` of their last. If
        anything raises, `_end` ends every one of ``reqs``."""
        try:
            ids = torch.cat([r.input_ids[r.num_computed :] for r in reqs])
            q_lens = [len(r) - r.num_computed for r in reqs]
            logits: torch.Tensor = self.model(
                ids,
                [r.indices for r in reqs],
                q_lens,
                self.kv_cache,
                last_only=True,
                decode_kernel=self.decode_kernel,
            )
            for r in reqs:
                self.flow.mark_computed(r)
        except BaseException:
            self._end(reqs)
            raise
        return logits

    def _end(self, reqs: Sequence[Request]) -> None:
        """End the requests of a failed call that still run: cache what each computed (whole
        pages), free the rest. A cleanup call that fails is skipped (the request then stays as
        the flow left it): the error that ended the call is the one that propagates."""
        flow, ps = self.flow, self.flow.page_size
        for r in reqs:
            with suppress(Exception):  # if anything fails here, ``r`` stays as the flow left it
                if not flow.is_running(r):
                    continue
                with suppress(Exception):  # not cached: its pages are freed below all the same
                    if r.num_computed // ps * ps > r.tree_len:
                        flow.cache(r)
                flow.abort(r)

    def prefill_batch(
        self, prompts: Sequence[torch.Tensor], *, extra_key: Hashable = None
    ) -> tuple[list[Request], torch.Tensor]:
        """Start one request per prompt (1-D CPU int ids), running only the tokens not reused from the cache.

        ``extra_key``: the namespace (tenant, adapter) the batch matches in and is cached in.

        Returns the requests and the logits ``(B, vocab)`` of each prompt's last token. Prompts of
        one batch do not reuse each other (none is cached yet). The whole batch is checked (ids,
        vocabulary, room in the pool) before anything changes; if the model itself fails, every
        request of the batch is ended (see "When the model fails" in the module docstring).
        """
        reject_one_tensor(prompts, "prompts")
        prompts = as_list(prompts, "prompts", "1-D token-id tensors")
        if not prompts:
            raise ValueError("prompts must hold at least one prompt, got an empty batch")
        for i, p in enumerate(prompts):
            self.model.check_ids(p, f"prompts[{i}]")
        reqs = self.flow.begin_batch(prompts, compute_last=True, extra_key=extra_key)
        return reqs, self._run(reqs)

    def prefill(
        self, prompt: torch.Tensor, *, extra_key: Hashable = None
    ) -> tuple[Request, torch.Tensor]:
        """:meth:`prefill_batch` of one prompt: ``(request, logits (vocab,))``."""
        reqs, logits = self.prefill_batch([prompt], extra_key=extra_key)
        return reqs[0], logits[0]

    def decode_batch(self, reqs: Sequence[Request], tokens: Sequence[Token]) -> torch.Tensor:
        """Append ``tokens[r]`` to request ``r`` and run it; logits ``(B, vocab)`` for the next tokens.

        Each token: an integer (Python, NumPy or 0-d integer tensor; never bool or float) in
        ``[0, vocab_size)``. Refused before any request changes: ``TypeError``/``ValueError`` for
        a bad token, ``RuntimeError`` for a request not running here or listed twice, or when
        the pool cannot take the new pages. If the model fails once the tokens are appended,
        every request of the call is ended (see "When the model fails" in the module docstring).
        """
        reqs = as_list(reqs, "reqs", "Requests")
        tokens = as_list(tokens, "tokens", "token ids")
        if not reqs:
            raise ValueError("reqs must hold at least one request")
        if len(tokens) != len(reqs):
            raise ValueError(
                f"need one token per request: {len(tokens)} tokens for {len(reqs)} requests"
            )
        vocab = self.model.config.vocab_size
        values = [as_int(t, f"tokens[{i}]") for i, t in enumerate(tokens)]
        for i, v in enumerate(values):
            if not 0 <= v < vocab:
                raise ValueError(f"tokens[{i}] must lie in [0, vocab_size={vocab}), got {v}")
        ids = torch.tensor(values, dtype=torch.int64)
        self.flow.extend_batch(reqs, list(ids.view(-1, 1)))
        return self._run(reqs)

    def decode(self, req: Request, token: Token) -> torch.Tensor:
        """:meth:`decode_batch` of one request: logits ``(vocab,)``."""
        return self.decode_batch([req], [token])[0]

    def finish(self, req: Request) -> int:
        """Cache the request (prompt and decoded tokens) and release it; returns the length
        already cached. All or nothing, as `RequestFlow.finish` is."""
        return self.flow.finish(req)

    def generate(
        self, prompt: torch.Tensor, max_new_tokens: int, *, extra_key: Hashable = None
    ) -> torch.Tensor:
        """Greedy decoding: ``max_new_tokens`` new token ids ``(max_new_tokens,)`` int64; the
        request is cached (under ``extra_key``). If anything fails, the request is ended (what it
        computed cached, its pages freed) and the error propagates."""
        max_new_tokens = check_size(max_new_tokens, "max_new_tokens")
        n = len(self.model.check_ids(prompt, "prompt"))
        ps, pages = self.flow.page_size, self.flow.allocator.num_pages
        need = -(-(n + max(max_new_tokens, 1) - 1) // ps)  # the last token is never stored
        if need > pages:  # would decode until the pool ran out, then abort it all
            raise ValueError(
                f"prompt ({n} tokens) + max_new_tokens={max_new_tokens} need up to {need} pages "
                f"of {ps} tokens; the pool has {pages}: it can never fit"
            )
        req, logits = self.prefill(prompt, extra_key=extra_key)
        out: list[int] = []
        try:
            for i in range(max_new_tokens):
                out.append(int(logits.argmax()))
                if i + 1 < max_new_tokens:
                    logits = self.decode(req, out[-1])
            self.finish(req)
        except BaseException:
            self._end([req])  # a failed decode has ended it already
            raise
        return torch.tensor(out, dtype=torch.int64)
