"""Abstract base of the management layer: `BaseCacheManager`, its handles and `SizeInfo`.

A manager decides which token prefixes stay in the storage layer's pool, which may be evicted,
and which are in use. Indices that travel between the two layers are *token slots*: slot ``s``
lives at ``[s // page_size, s % page_size]`` of a per-layer cache view.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

__all__ = [
    "BaseCacheHandle",
    "SizeInfo",
    "InsertResult",
    "BaseCacheManager",
]


@dataclass(frozen=True)
class BaseCacheHandle:
    """A claim on a cached prefix: how long it is, and (in subclasses) where it lives.

    The handle is what a request locks and unlocks; the indices returned beside it are the slots
    that hold the prefix's K/V.
    """

    cached_len: int


class SizeInfo(NamedTuple):
    """Tokens held by a manager: ``evictable_size`` may be evicted, ``protected_size`` is locked."""

    evictable_size: int
    protected_size: int

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size


class InsertResult(NamedTuple):
    """What `BaseCacheManager.insert_and_match` returns.

    ``cached_len``: the length that was already cached (what `insert_prefix` returns);
    ``handle``: an unlocked handle on the longest cached prefix of the inserted ids after the
    insert (its ``cached_len`` is the page-aligned length of ``input_ids`` for a caching
    manager, 0 for one that caches nothing).
    """

    cached_len: int
    handle: BaseCacheHandle


class BaseCacheManager(ABC):
    """Decides which token prefixes keep their K/V slots.

    Promises of every implementation: ``match_prefix`` returns ``handle.cached_len`` indices;
    ``insert_prefix`` returns the length that was already cached (the caller keeps ownership of
    the indices that were not inserted); ``evict(0)`` returns an empty tensor; a call that raises
    leaves the manager unchanged.

    Attributes every manager sets: ``device`` (where its index tensors live) and ``page_size``
    (tokens per page; matches and inserts are whole pages).

    The request flow makes two calls per request, `match_and_lock` (steps 1 and 2) and
    `insert_and_unlock` (steps 4 and 7), always with tensors. Their defaults here make the
    separate public calls (`match_prefix`, `lock_handle`, `insert_and_match`, which by default is
    `insert_prefix` then `match_prefix`), so a manager that implements only the abstract methods
    is served as it is. A manager may override the two to walk its index once (radix and block
    hash do): such an override no longer goes through the parts. So a subclass of a manager with
    fused calls that overrides a part (`match_prefix`, `lock_handle`, `insert_prefix`,
    `insert_and_match`) to change or watch what it does must also override the fused call that
    makes that part: with its own, or by taking the default back
    (``match_and_lock = BaseCacheManager.match_and_lock``, the same for `insert_and_unlock`).
    Otherwise the flow's calls never reach its override. Nothing checks this for it.
    """

    device: torch.device = torch.device("cpu")
    page_size: int = 1

    @abstractmethod
    def match_prefix(
        self, input_ids: torch.Tensor, extra_key: Hashable = None
    ) -> tuple[BaseCacheHandle, torch.Tensor]:
        """Longest prefix of ``input_ids`` (1-D, CPU) cached under ``extra_key``, and its slots
        (1-D int32). Prefixes cached under another key never match; ``None`` is a key too."""

    @abstractmethod
    def lock_handle(self, handle: BaseCacheHandle, unlock: bool = False) -> None:
        """Protect (or release) the prefix behind ``handle`` from eviction.

        Locks are counted per handle object: unlocking a handle that is not locked (never
        locked, or unlocked as often as locked) raises ``RuntimeError`` and changes nothing,
        whatever else is locked.
        """

    @abstractmethod
    def insert_prefix(
        self, input_ids: torch.Tensor, indices: torch.Tensor, extra_key: Hashable = None
    ) -> int:
        """Cache ``input_ids`` whose K/V sit at ``indices`` under the namespace ``extra_key``
        (any hashable; ``TypeError`` otherwise); return the length already cached there."""

    @abstractmethod
    def evict(self, size: int) -> torch.Tensor:
        """Forget unlocked prefixes holding at least ``size`` tokens; return their slots (1-D int32
        on ``device``)."""

    @abstractmethod
    def reset(self) -> None:
        """Forget every prefix."""

    @property
    @abstractmethod
    def size_info(self) -> SizeInfo:
        """Evictable and protected token counts."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise ``RuntimeError`` if the manager's bookkeeping is inconsistent."""

    def insert_and_match(
        self, input_ids: torch.Tensor, indices: torch.Tensor, extra_key: Hashable = None
    ) -> InsertResult:
        """`insert_prefix`, then the handle of what is now cached, in one call.

        The default runs the two public calls; a manager may override it to walk its index once
        (the default `insert_and_unlock`, the flow's insert, makes it). Same validation and
        errors as `insert_prefix`; the returned handle is not locked.
        """
        if extra_key is None:  # a manager written before namespaces takes no key
            cached_len = self.insert_prefix(input_ids, indices)
            handle, _ = self.match_prefix(input_ids)
        else:
            cached_len = self.insert_prefix(input_ids, indices, extra_key)
            handle, _ = self.match_prefix(input_ids, extra_key)
        return InsertResult(cached_len, handle)

    def match_and_lock(
        self, input_ids: torch.Tensor, extra_key: Hashable = None
    ) -> tuple[BaseCacheHandle, torch.Tensor]:
        """`match_prefix`, then `lock_handle` of the handle it returns, in one call (the flow's
        steps 1 and 2): the handle and its ``handle.cached_len`` slots (1-D int32 on ``device``).

        The default makes the two public calls; a manager may override it to lock the path its
        walk just followed. Same validation and errors as `match_prefix`; nothing is locked when
        it raises.
        """
        handle, indices = (
            self.match_prefix(input_ids)  # a manager written before namespaces takes no key
            if extra_key is None
            else self.match_prefix(input_ids, extra_key)
        )
        self.lock_handle(handle)
        return handle, indices

    def insert_and_unlock(
        self,
        handle: BaseCacheHandle,
        input_ids: torch.Tensor,
        indices: torch.Tensor,
        extra_key: Hashable = None,
        *,
        relock: bool = False,
    ) -> InsertResult:
        """`insert_and_match`, then release one lock of ``handle``; with ``relock=True`` the
        returned handle is locked first (the lock moves to the longer prefix).

        The flow's insert: ``handle`` is the request's locked prefix, normally a prefix of
        ``input_ids``, which a manager may use to skip re-matching that prefix. ``RuntimeError``
        (nothing inserted) when ``handle`` is not locked, and the errors of `insert_prefix` with
        ``handle`` still locked.

        A failure (of anything it calls, ``KeyboardInterrupt`` too) before the insert changes
        nothing. The insert is the one change that cannot be undone: a failure after it is
        completed (the call made again), so that the lock has moved as asked, and the error
        then propagates carrying the call's `InsertResult` as its ``insert_result`` attribute,
        for the caller to complete its own step (as `RequestFlow` does). The default makes the
        public calls: one unlock of ``handle`` to prove it is locked (and a lock to restore it),
        the insert, the relock, the unlock.
        """
        self.lock_handle(handle, unlock=True)  # raises, changing nothing, when not locked
        _made_again(self.lock_handle, handle)  # locked again: the insert runs as on its own
        res = (
            self.insert_and_match(input_ids, indices)
            if extra_key is None
            else self.insert_and_match(input_ids, indices, extra_key)
        )
        # The insert is made: from here on the call only completes.
        late = _made_again(self.lock_handle, res.handle, quiet=True) if relock else None
        late = _made_again(self.lock_handle, handle, True, quiet=True) or late
        if late is not None:
            late.insert_result = res  # type: ignore[attr-defined]
            raise late
        return res

    @abstractmethod
    def cached_indices(self) -> torch.Tensor:
        """Every slot the cache holds (1-D int32 on ``device``, any order).

        `RequestFlow.check_integrity` uses it to prove that free + cached + held pages are all
        the pages, none twice.
        """

    def handle_indices(self, handle: BaseCacheHandle) -> torch.Tensor:
        """The slots of the prefix ``handle`` names (1-D int32, ``handle.cached_len`` entries).

        Equal to the indices `match_prefix` returned with ``handle``, as long as the handle is
        valid. Raises ``NotImplementedError`` for a manager that cannot say.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot give a handle's indices")

    def check_parts(self, *, allocator: Any = None, pool: Any = None) -> None:
        """``ValueError`` unless ``allocator`` (a `PageAllocator`) and ``pool`` (a K/V pool),
        where given, are the ones this manager works with. A `RequestFlow` and an `Engine` ask
        it when they are built. The default accepts anything: a manager sees only token ids and
        slots; one built on its own allocator and pool (the host tier) refuses others."""
        return None

    def eviction_priority(self, node: Any) -> tuple[int, ...]:
        """The sort key under which ``node`` would be evicted: smaller goes first.

        Public so that drawings can preview an eviction without reading a manager's private
        state. Raises ``NotImplementedError`` for a manager without per-node priorities.
        """
        raise NotImplementedError(f"{type(self).__name__} has no per-node eviction priority")


def _made_again(
    call: Callable[..., object], *args: object, quiet: bool = False
) -> BaseException | None:
    """``call(*args)``, made once more if it raises (a lock or unlock that raises has changed
    nothing, so making it again is safe). The error is re-raised once the call is made, or,
    with ``quiet``, returned for the caller to raise when its own step is whole."""
    try:
        call(*args)
    except BaseException as e:
        call(*args)
        if not quiet:
            raise
        return e
    return None
