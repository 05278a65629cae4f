"""What the serving layer checks about the parts it is given: that a manager offers the calls the
flow makes (`check_manager`), and the proof of ownership: every page is free, cached or held by
one running request (`check_page_partition`)."""

from __future__ import annotations

from typing import Iterable

import numpy as np
import torch

from ..managers.base import BaseCacheManager
from .allocator import PageAllocator
from .request import Request

__all__ = ["check_manager", "check_page_partition"]

# What the flow calls on a manager: a BaseCacheManager has all of it; a wrapper that forwards to
# one (a timer, a recorder) may instead provide it by delegation.
_MANAGER_API = ("match_prefix", "lock_handle", "insert_prefix", "insert_and_match", "evict", "reset",
                "size_info", "check_integrity", "cached_indices", "handle_indices", "page_size", "device")


def check_manager(manager: object, name: str = "manager") -> None:
    """``TypeError`` unless ``manager`` is a `BaseCacheManager` or forwards its whole API."""
    if isinstance(manager, BaseCacheManager):
        return
    missing = [a for a in _MANAGER_API if not hasattr(manager, a)]
    if missing:
        raise TypeError(f"{name} must be a BaseCacheManager, got {type(manager).__name__} (lacking {', '.join(missing)})")


def check_page_partition(manager: BaseCacheManager, allocator: PageAllocator, running: Iterable[Request]) -> None:
    """Free + cached + held by ``running`` requests = every page of ``allocator``, none twice.

    Runs ``manager.check_integrity()`` first; checks each request's ``indices`` against its
    ``input_ids`` and, where the manager can tell (``handle_indices``), that its first
    ``tree_len`` indices are the tree's. ``RuntimeError`` naming the first breach found.
    """
    manager.check_integrity()
    ps, num_pages = allocator.page_size, allocator.num_pages
    cached = manager.cached_indices()
    total = manager.size_info.total_size
    if cached.shape[0] != total:
        raise RuntimeError(f"manager holds {cached.shape[0]} slots but reports total_size {total}")
    if cached.shape[0] % ps:
        raise RuntimeError(f"cache holds {cached.shape[0]} slots, not whole pages of {ps}")
    parts = [allocator.free_pages().cpu().numpy().astype(np.int64),
             cached.cpu().numpy()[::ps].astype(np.int64) // ps]
    for req in running:
        if req.indices.shape[0] != req.input_ids.shape[0]:
            raise RuntimeError(f"request {req.rid}: {len(req.input_ids)} tokens but {len(req.indices)} indices")
        try:
            ok = torch.equal(manager.handle_indices(req.handle), req.indices[:req.tree_len])
        except NotImplementedError:  # a manager that cannot say
            ok = True
        if not ok:
            raise RuntimeError(f"request {req.rid}: its prefix indices are not the tree's")
        own = req.indices[req.tree_len:].cpu().numpy().astype(np.int64)
        if own.shape[0]:
            pages = own // ps
            parts.append(pages[np.r_[True, pages[1:] != pages[:-1]]])
    pages = np.concatenate(parts)
    if pages.shape[0] and (pages.min() < 0 or pages.max() >= num_pages):
        raise RuntimeError(f"page outside [0, {num_pages}) in use")
    counts = np.bincount(pages, minlength=num_pages)
    lost = np.flatnonzero(counts == 0).tolist()
    twice = np.flatnonzero(counts > 1).tolist()
    if lost or twice:
        raise RuntimeError(f"page accounting broken: lost pages {lost[:16]}, pages owned twice {twice[:16]}")
