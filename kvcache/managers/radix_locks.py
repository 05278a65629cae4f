"""`RadixLocks`: how a `RadixCacheManager` locks, unlocks and reads back its handles.

A lock is counted per handle object in ``_locks`` (``id(handle) -> [handle, times locked]``,
plus, for a lock the manager took itself in `match_and_lock` or a relock, the handle's namespace
root: `insert_and_unlock` resumes its walk at such a handle's node once the keys on its path
compare equal to the start of the new ids, one memcmp a node, in place). A handle made by hand
and locked with `lock_handle` has no root recorded, and its insert walks from the root.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, overload

import numpy as np
import torch

from .base import BaseCacheHandle, InsertResult, takes_host_arrays
from .eviction import LeafHeap
from .radix_node import (
    RadixCacheHandle,
    RadixTreeNode,
    TreeInfo,
    lock_path,
    path_slots,
    unlock_path,
)
from .radix_roots import RadixRoots

__all__ = ["RadixLocks"]

_EMPTY = np.empty(0, dtype=np.int32)
_EMPTY.flags.writeable = False  # shared by every empty NumPy match


class RadixLocks(RadixRoots):
    """The lock half of `RadixCacheManager` (not a manager on its own)."""

    # The manager's state this half reads and writes (set in `RadixCacheManager.__init__`).
    _on_cpu: bool
    _tree: TreeInfo
    _locks: dict[int, list[Any]]
    _evictable_size: int
    _protected_size: int
    _leaves: LeafHeap[RadixTreeNode]
    # Defined by `RadixCacheManager` (radix.py).
    _out: Callable[[np.ndarray], torch.Tensor]
    _match: Callable[
        [torch.Tensor | np.ndarray, Hashable, bool],
        tuple[RadixCacheHandle, np.ndarray | None, RadixTreeNode | None, int],
    ]
    _insert: Callable[
        [torch.Tensor | np.ndarray, torch.Tensor | np.ndarray, Hashable, list[Any] | None, bool],
        tuple[InsertResult, RadixTreeNode, bool],
    ]

    @overload
    def match_and_lock(
        self, input_ids: torch.Tensor, extra_key: Hashable = None
    ) -> tuple[RadixCacheHandle, torch.Tensor]: ...

    @overload
    def match_and_lock(
        self, input_ids: np.ndarray, extra_key: Hashable = None
    ) -> tuple[RadixCacheHandle, np.ndarray]: ...

    @takes_host_arrays
    def match_and_lock(
        self, input_ids: torch.Tensor | np.ndarray, extra_key: Hashable = None
    ) -> tuple[RadixCacheHandle, torch.Tensor] | tuple[RadixCacheHandle, np.ndarray]:
        """`match_prefix`, then `lock_handle` of its handle. The lock remembers the matched token
        bytes, so that `insert_and_unlock` of this handle resumes at its node (one compare of
        the prefix instead of a walk from the root). NumPy ids in, NumPy slots out (host int32,
        the manager's own copy), as `BaseCacheManager.match_and_lock` documents."""
        handle, out, root, taken = self._match(input_ids, extra_key, True)
        self._locks[id(handle)] = [handle, 1, root]
        self._evictable_size -= taken
        self._protected_size += taken
        if isinstance(input_ids, np.ndarray):
            return handle, _EMPTY if out is None else out
        return handle, self.empty_tensor if out is None else self._out(out)

    @takes_host_arrays
    def insert_and_unlock(
        self,
        handle: BaseCacheHandle,
        input_ids: torch.Tensor | np.ndarray,
        indices: torch.Tensor | np.ndarray,
        extra_key: Hashable = None,
        *,
        relock: bool = False,
    ) -> InsertResult:
        """`insert_and_match`, then one unlock of ``handle`` (``relock=True``: the returned handle
        is locked first). All or nothing, as `BaseCacheManager.insert_and_unlock` promises.

        When ``handle`` was locked by `match_and_lock` (or by this call's ``relock``) in the same
        namespace and ``input_ids`` start with the tokens it matched, the walk resumes at
        ``handle.node``: the prefix costs one byte compare, not a walk from the root. Takes the
        NumPy forms of ``input_ids`` and ``indices`` (`BaseCacheManager.insert_and_unlock`).
        """
        entry = self._locks.get(id(handle))
        if entry is None:
            self._refuse_unlock(handle)
        if relock is not False and relock is not True:
            raise TypeError(f"relock must be a bool, got {type(relock).__name__}")
        res, root, moved = self._insert(input_ids, indices, extra_key, entry, relock)
        if moved:  # the tree's counts moved already: move the entry
            if entry[1] == 1:  # type: ignore[index]
                del self._locks[id(handle)]
            else:
                entry[1] -= 1  # type: ignore[index]
            self._locks[id(res.handle)] = [res.handle, 1, root]
            return res
        if relock:
            self._lock_new(res.handle, root)  # type: ignore[arg-type]
        self._unlock(handle, entry)  # type: ignore[arg-type]
        return res

    def _checked_path_end(self, handle: BaseCacheHandle) -> RadixTreeNode:
        """``handle.node`` after proving it is a live node of this tree (read-only, O(1)).

        The callers check ``handle.cached_len`` against the path in the walk they make anyway.
        """
        if not isinstance(handle, RadixCacheHandle):
            raise TypeError(f"handle must be a RadixCacheHandle, got {type(handle).__name__}")
        node = handle.node
        if not isinstance(node, RadixTreeNode):
            raise TypeError(f"handle.node must be a RadixTreeNode, got {type(node).__name__}")
        if not node.in_tree:
            raise RuntimeError(
                f"handle's node {node.uuid} was evicted (or the tree reset); match the prefix again"
            )
        if node.tree is not self._tree:
            raise RuntimeError("handle belongs to another manager")
        return node

    def handle_indices(self, handle: BaseCacheHandle) -> torch.Tensor:
        """The slots of the prefix behind ``handle`` (read-only: no split, no timestamp change)."""
        values = path_slots(self._checked_path_end(handle))
        out = np.concatenate(values) if values else np.empty(0, dtype=np.int32)
        if len(out) != handle.cached_len:
            raise RuntimeError(
                f"handle says cached_len={handle.cached_len} but its path holds {len(out)} tokens"
            )
        return self._out(out) if values else self.empty_tensor

    def lock_handle(self, handle: BaseCacheHandle, unlock: bool = False) -> None:
        """Lock (``ref_count += 1``) or unlock every node from ``handle.node`` up to the root.

        Locks are counted per handle object: unlocking a handle not locked now raises
        ``RuntimeError``, changing nothing, even when an equal handle or an ancestor is locked.
        An empty (root) handle protects nothing, but its locks are counted all the same.
        """
        entry = self._locks.get(id(handle))
        if unlock:
            if entry is None:
                self._refuse_unlock(handle)
            self._unlock(handle, entry)  # type: ignore[arg-type]
            return
        end = handle.node if entry is not None else self._checked_path_end(handle)  # type: ignore[attr-defined]
        length, taken = lock_path(end)
        if length != handle.cached_len:  # a handle made by hand: undo, then refuse
            unlock_path(end)
            raise RuntimeError(
                f"handle says cached_len={handle.cached_len} but its path holds {length} tokens"
            )
        if entry is None:
            self._locks[id(handle)] = [handle, 1]
        else:
            entry[1] += 1
        self._evictable_size -= taken
        self._protected_size += taken

    def _refuse_unlock(self, handle: object) -> None:
        """The error for unlocking ``handle``, which is not locked now."""
        if not isinstance(handle, RadixCacheHandle):
            raise TypeError(f"handle must be a RadixCacheHandle, got {type(handle).__name__}")
        raise RuntimeError(
            f"cannot unlock a handle that is not locked (cached_len={handle.cached_len})"
        )

    def _unlock(self, handle: BaseCacheHandle, entry: list[Any]) -> None:
        """One unlock of ``handle``, locked now with ``entry`` in `_locks`."""
        if entry[1] == 1:
            del self._locks[id(handle)]
        else:
            entry[1] -= 1
        leaf = handle.node  # type: ignore[attr-defined]
        freed = unlock_path(leaf)
        self._evictable_size += freed
        self._protected_size -= freed
        if leaf.ref_count == 0 and not leaf.children and leaf.parent is not None:
            self._leaves.file(leaf)

    def _lock_new(self, handle: RadixCacheHandle, root: RadixTreeNode | None) -> None:
        """Lock ``handle``, just made by this manager in the namespace of ``root``, and remember
        that root for `insert_and_unlock`."""
        _, taken = lock_path(handle.node)
        self._locks[id(handle)] = [handle, 1, root]
        self._evictable_size -= taken
        self._protected_size += taken
