"""Locking for `BlockHashCacheManager` (functions its class body names as methods): ``lock_handle`` and the fused calls the request flow makes
(``match_and_lock``, ``insert_and_unlock``), which skip what the separate calls re-check.

The flow matches and locks at once, and inserts then releases the very handle it locked: the
fused calls lock the chain the match just found (the match's deferred LRU refresh is moot: the
lock takes the blocks out of the free queue) and release the lock record of that handle object
without looking its blocks up again. Any other handle (an equal copy, an empty one, another
manager's) goes through the separate calls, with their checks and errors.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Protocol

import numpy as np
import torch

from .base import (
    SLOT_DTYPES,
    TOKEN_DTYPES,
    BaseCacheHandle,
    BaseCacheManager,
    InsertResult,
    host_array,
    takes_host_arrays,
)
from .block_pool import BlockHashCacheHandle, BlockTable


class _Manager(Protocol):
    """What these functions use of `BlockHashCacheManager` (not imported: it imports them)."""

    _locks: dict[BlockHashCacheHandle, tuple[int, np.ndarray]]
    _table: BlockTable
    _touch: tuple[np.ndarray, int] | None
    _plain_match: bool  # match_prefix is the class's own (no subclass overrides it)
    _clock: int
    device: torch.device

    @property
    def clock(self) -> int: ...
    def _flush(self) -> None: ...
    def _chain(self, handle: BaseCacheHandle) -> np.ndarray: ...
    def _match(
        self, input_ids: torch.Tensor, extra_key: Hashable, keep: bool, host: bool = False
    ) -> tuple[BlockHashCacheHandle, torch.Tensor]: ...
    def match_prefix(
        self, input_ids: torch.Tensor, extra_key: Hashable = None
    ) -> tuple[BlockHashCacheHandle, torch.Tensor]: ...
    def _insert(
        self,
        input_ids: torch.Tensor,
        indices: torch.Tensor,
        extra_key: Hashable,
        held: BlockHashCacheHandle | None = None,
        host: bool = False,
        defer: list[int] | None = None,
    ) -> tuple[int, BlockHashCacheHandle]: ...


__all__ = ["lock_handle", "match_and_lock", "insert_and_unlock"]

_new_tuple = tuple.__new__


def _tensor_form(values: Any, name: str, dtypes: frozenset[np.dtype[Any]]) -> Any:
    """A NumPy form (checked as `host_array` checks) as a CPU tensor, for the base class's
    separate calls, which take tensors only; anything else as given."""
    if not isinstance(values, np.ndarray):
        return values
    return torch.from_numpy(np.ascontiguousarray(host_array(values, name, dtypes)))


def lock_handle(self: _Manager, handle: BaseCacheHandle, unlock: bool = False) -> None:
    """Lock (``ref_count += 1``) or unlock every block of ``handle``.

    Unlocking a handle that is not locked (never locked, or unlocked as often as locked)
    raises ``RuntimeError``, even while its blocks are locked through another handle. A block
    whose count drops to 0 joins the tail of the free queue; the chain is released deepest
    block first, so its tail is evicted before its head. A handle of length 0 needs no
    protection: nothing happens.
    """
    if not isinstance(unlock, bool):
        raise TypeError(f"unlock must be a bool, got {type(unlock).__name__}")
    if unlock:
        _unlock(self, handle)
        return
    pages = self._chain(handle)
    if not len(pages):
        return
    if self._touch is not None:
        if self._touch[0] is pages:
            self._touch = None  # the lock takes the matched blocks out of the queue: moot
        else:
            self._flush()
    _lock(self, handle, pages)


def _lock(self: _Manager, handle: BaseCacheHandle, pages: np.ndarray) -> None:
    first = (1, pages)
    record = self._locks.setdefault(handle, first)  # type: ignore[arg-type]
    if record is not first:  # locked already (through an equal handle, maybe)
        self._locks[handle] = (record[0] + 1, record[1])  # type: ignore[index]
    self._table.lock(pages)


def _unlock(self: _Manager, handle: BaseCacheHandle) -> None:
    if not isinstance(handle, BlockHashCacheHandle) or not handle.cached_len:
        self._chain(handle)  # a wrong type or length raises; an empty handle needs nothing
        return
    record = self._locks.get(handle)
    if record is None:
        self._chain(handle)  # a handle that is not even valid says so first
        raise RuntimeError(
            f"cannot unlock a handle that is not locked ({len(handle.block_hashes)} blocks, "
            f"cached_len={handle.cached_len})"
        )
    # Locked blocks cannot leave the cache: the handle that locked them needs no re-check.
    if handle.pages is not record[1]:
        self._chain(handle)
    _release(self, handle, record)


def _release(
    self: _Manager,
    handle: BlockHashCacheHandle,
    record: tuple[int, np.ndarray],
    chain: np.ndarray | None = None,
    new: int = 0,
) -> None:
    """One lock of ``handle`` (its lock record ``record``) released; ``chain``, ``new``: see
    `BlockTable.release`."""
    times, locked = record
    if self._touch is not None:
        self._flush()
    if times == 1:
        del self._locks[handle]
    else:
        self._locks[handle] = (times - 1, locked)
    self._table.release(locked, self._clock, chain, new)


@takes_host_arrays
def match_and_lock(
    self: _Manager, input_ids: torch.Tensor, extra_key: Hashable = None
) -> tuple[BlockHashCacheHandle, torch.Tensor]:
    """`match_prefix`, then `lock_handle` of its handle (the same decisions, one call); the
    NumPy form as `BaseCacheManager.match_and_lock` describes it."""
    given: Any = input_ids  # the NumPy form too (the annotations name the tensor form only)
    if self._plain_match:  # the insert reads the handle: no memo entry
        handle, slots = self._match(input_ids, extra_key, False, isinstance(given, np.ndarray))
    elif isinstance(given, np.ndarray):  # a subclass's own match_prefix takes tensors
        ids = _tensor_form(given, "input_ids", TOKEN_DTYPES)
        found, found_slots = BaseCacheManager.match_and_lock(self, ids, extra_key)  # type: ignore[arg-type]
        return found, found_slots.cpu().numpy()  # type: ignore[return-value]
    else:
        handle, slots = self.match_prefix(input_ids, extra_key)
    pages = handle.pages
    if pages is not None and len(pages):
        self._touch = None  # this very chain: the lock makes the refresh moot
        _lock(self, handle, pages)
    return handle, slots


@takes_host_arrays
def insert_and_unlock(
    self: _Manager,
    handle: BaseCacheHandle,
    input_ids: torch.Tensor,
    indices: torch.Tensor,
    extra_key: Hashable = None,
    *,
    relock: bool = False,
) -> InsertResult:
    """`insert_and_match`, then one lock of ``handle`` released (with ``relock``, the returned
    handle locked first); all or nothing, as `BaseCacheManager.insert_and_unlock` promises."""
    if type(relock) is not bool:
        raise TypeError(f"relock must be a bool, got {type(relock).__name__}")
    record = None
    if type(handle) is not BlockHashCacheHandle or handle.cached_len:
        if type(handle) is BlockHashCacheHandle:
            record = self._locks.get(handle)
        if record is None or handle.pages is not record[1]:  # type: ignore[attr-defined]
            # Not locked, or locked through an equal handle: the separate calls, checked.
            given: Any = indices
            slots = _tensor_form(given, "indices", SLOT_DTYPES)
            return BaseCacheManager.insert_and_unlock(
                self,  # type: ignore[arg-type]  # the manager, seen through `_Manager`
                handle,
                _tensor_form(input_ids, "input_ids", TOKEN_DTYPES),
                slots.to(self.device) if isinstance(given, np.ndarray) else slots,
                extra_key,
                relock=relock,
            )
    # May raise: nothing changed. A locked handle's chain is known to be cached.
    # Without relock, new blocks that extend the handle's chain join the free queue with its
    # released blocks, in one run (the order of an insert followed by the unlock).
    defer: list[int] | None = [] if record is not None and not relock else None
    cached, made = self._insert(
        input_ids,
        indices,
        extra_key,
        handle if record is not None else None,  # type: ignore[arg-type]
        True,
        defer,
    )
    if relock and made.cached_len:
        _lock(self, made, made.pages)  # type: ignore[arg-type]
        if record is not None:
            record = self._locks[handle]  # type: ignore[index]  # one more lock when made == handle
    if record is not None:
        if defer:
            _release(self, handle, record, made.pages, defer[0])  # type: ignore[arg-type]
        else:
            _release(self, handle, record)  # type: ignore[arg-type]
    return _new_tuple(InsertResult, (cached, made))  # NamedTuple's own __new__, minus its frame
