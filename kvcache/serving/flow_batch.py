"""`FlowBatchCalls`: `RequestFlow`'s calls for several requests at once (`begin_batch`,
`extend_batch`), all or nothing, with one eviction for the batch."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence

import numpy as np
import torch

from .._validate import as_list, check_token_ids, reject_one_tensor
from ..managers.base import BaseCacheHandle, BaseCacheManager
from ..managers.cache_events import check_extra_key
from .flow_pages import FlowPages
from .request import Request

__all__ = ["FlowBatchCalls"]


class FlowBatchCalls:
    """The batch half of `RequestFlow` (not a flow on its own)."""

    # The flow's state these calls use (set by `RequestFlow`).
    manager: BaseCacheManager
    page_size: int
    _rids: Iterator[int]
    _pages: FlowPages
    _on_cpu: bool
    _device: torch.device
    _get: Callable[[Request], Request]
    _start: Callable[
        [int, np.ndarray, BaseCacheHandle, torch.Tensor | np.ndarray, Hashable], Request
    ]

    def begin_batch(
        self,
        prompts: Sequence[torch.Tensor],
        *,
        compute_last: bool = False,
        extra_key: Hashable = None,
    ) -> list[Request]:
        """`begin` for several prompts at once (all in namespace ``extra_key``), all or nothing.

        Every prompt is checked first; then all are matched and locked, and only if the pool
        can hold every one of them (after eviction) are pages taken, with one eviction for the
        batch. Otherwise every lock is released and ``RuntimeError`` raised: nothing evicted,
        no page taken. Prompts of one batch do not reuse each other (none is cached yet).
        """
        reject_one_tensor(prompts, "prompts")
        prompts = as_list(prompts, "prompts", "1-D token-id tensors")
        if not prompts:
            raise ValueError("prompts must hold at least one prompt, got an empty batch")
        for i, p in enumerate(prompts):
            check_token_ids(p, f"prompts[{i}]")
            if p.shape[0] == 0:
                raise ValueError(f"prompts[{i}] must hold at least one token")
        check_extra_key(extra_key)
        rids = [next(self._rids) for _ in prompts]
        matched: list[tuple[BaseCacheHandle, torch.Tensor | np.ndarray]] = []
        try:
            for rid, p in zip(rids, prompts, strict=True):
                matched.append(
                    self._pages.match_lock_any(rid, p.numpy(), p, compute_last, extra_key)
                )
            new = [p.shape[0] - h.cached_len for p, (h, _) in zip(prompts, matched, strict=True)]
            self._pages.make_room(rids[0], sum(-(-n // self.page_size) for n in new))
        except BaseException:
            for h, _ in matched:
                self.manager.lock_handle(h, unlock=True)
            raise
        return [
            self._start(rid, p.numpy(), h, prefix, extra_key)
            for rid, p, (h, prefix) in zip(rids, prompts, matched, strict=True)
        ]

    def extend_batch(
        self, reqs: Sequence[Request], new_ids: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """`extend` of ``reqs[i]`` by ``new_ids[i]`` for every ``i``, all or nothing.

        Refused before any request changes: ``ValueError`` for differing lengths or bad ids,
        ``RuntimeError`` for a request not running here or listed twice, or when the pool cannot
        take every new page (one eviction for the batch).
        """
        reqs = as_list(reqs, "reqs", "Requests")
        new_ids = as_list(new_ids, "new_ids", "1-D token-id tensors")
        if len(new_ids) != len(reqs):
            raise ValueError(
                f"need one new_ids per request: {len(new_ids)} for {len(reqs)} requests"
            )
        for i, (r, x) in enumerate(zip(reqs, new_ids, strict=True)):
            self._get(r)
            check_token_ids(x, f"new_ids[{i}]")
        if len({id(r) for r in reqs}) != len(reqs):
            raise RuntimeError("every request must be running in this flow, each listed once")
        if reqs:
            self._pages.make_room(
                reqs[0].rid,
                sum(
                    self._pages.pages_for(len(r), x.shape[0])
                    for r, x in zip(reqs, new_ids, strict=True)
                ),
            )
        return [self._extend(r, x) for r, x in zip(reqs, new_ids, strict=True)]

    def _extend(self, req: Request, new_ids: torch.Tensor) -> torch.Tensor:
        if new_ids.shape[0] == 0:
            return req.indices[:0]
        out = torch.from_numpy(self._pages.append(req, new_ids.numpy()))
        return out if self._on_cpu else out.to(self._device)
