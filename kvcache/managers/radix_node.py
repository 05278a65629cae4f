"""The radix tree's pieces: `RadixTreeNode`, `RadixCacheHandle`, and how keys are stored and filed.

A node's tokens are kept as the bytes of their int64 values (``key_bytes``): a whole-node match
is then one ``bytes.startswith`` (a memcmp, no Python work per token), and the child a walk
needs next is one dict probe away. Children are filed under their first token id (an ``int``)
with ``page_size == 1``, as API.md and the book show them, and under their first page's bytes
with ``page_size > 1``: a slice of the walked bytes is the key, no unpacking.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from .._validate import check_indices, check_token_ids
from .base import TOKEN_DTYPES, BaseCacheHandle, host_array

__all__ = [
    "RadixTreeNode",
    "RadixCacheHandle",
    "TreeInfo",
    "key_reader",
    "token_array",
    "slot_array",
    "common_tokens",
    "check_child",
    "TreeCensus",
    "census_tree",
    "lock_path",
    "unlock_path",
    "path_slots",
    "detach_leaf",
    "spells",
    "stamp_path",
    "ITEM",
]

ITEM = np.dtype(np.int64).itemsize  # bytes per token id in a key
# Compared by identity on the hot path (``is`` costs a pointer compare, ``==`` against a type
# builds a dtype each time); an equal dtype that is not this object takes the slow path.
_I64 = np.dtype(np.int64)
_I32 = np.dtype(np.int32)


def token_array(input_ids: torch.Tensor | np.ndarray, host: bool = False) -> np.ndarray:
    """``input_ids`` (``host``: a tensor or its NumPy form) as C-contiguous int64 NumPy (a view
    when it is that already), checked as `check_token_ids` checks, through the cheapest route
    for the common case."""
    ids: np.ndarray | None
    if host and isinstance(input_ids, np.ndarray):
        ids = input_ids
    else:
        try:
            ids = input_ids.numpy()  # type: ignore[union-attr]  # a CPU tensor passes
        except (AttributeError, TypeError, RuntimeError):
            ids = None
    if ids is not None and ids.dtype is _I64 and ids.ndim == 1 and ids.flags.c_contiguous:
        return ids
    if host and isinstance(input_ids, np.ndarray):
        ids = host_array(input_ids, "input_ids", TOKEN_DTYPES)
    elif ids is None or ids.ndim != 1 or ids.dtype not in TOKEN_DTYPES:
        check_token_ids(input_ids)  # raises with the standard message
        raise TypeError(f"input_ids must be a 1-D integer tensor on the CPU, got {input_ids!r}")
    return np.ascontiguousarray(ids, dtype=np.int64)


def slot_array(
    indices: torch.Tensor, device: torch.device, on_cpu: bool | None = None
) -> np.ndarray:
    """``indices`` as int32 NumPy on the host, checked as `check_indices` checks. ``on_cpu``:
    whether ``device`` is the CPU, when the caller knows (reading ``device.type`` costs more
    than the rest of the common case)."""
    if not (device.type == "cpu" if on_cpu is None else on_cpu):
        return check_indices(indices, device).cpu().numpy()
    slots: np.ndarray | None
    try:
        slots = indices.numpy()
    except (AttributeError, TypeError, RuntimeError):
        slots = None
    if slots is not None and slots.dtype is _I32 and slots.ndim == 1:
        return slots
    if slots is None or slots.ndim != 1 or slots.dtype != np.int32:
        check_indices(indices, device)
        raise TypeError(f"indices must be a 1-D torch.int32 tensor on {device}, got {indices!r}")
    return slots


def common_tokens(key_bytes: bytes, ids: np.ndarray, pos: int) -> int:
    """How many leading tokens of ``key_bytes`` equal ``ids[pos:]``."""
    key = np.frombuffer(key_bytes, dtype=np.int64)
    m = min(len(key), len(ids) - pos)
    differ = key[:m] != ids[pos : pos + m]
    return int(differ.argmax()) if differ.any() else m


def key_reader(page_size: int) -> Callable[[bytes, int], Hashable]:
    """``read(buf, offset)``: the filing key of the page that starts at byte ``offset`` of ``buf``.

    ``buf`` holds native-order int64 token ids; the key is the token id (an ``int``) for
    ``page_size == 1`` and the page's ``8 * page_size`` bytes otherwise (one slice: hashing it
    costs a third of building and hashing a tuple of ``page_size`` ints).
    """
    if page_size == 1:
        unpack1 = struct.Struct("=q").unpack_from
        return lambda buf, offset: unpack1(buf, offset)[0]
    width = page_size * ITEM
    return lambda buf, offset: buf[offset : offset + width]


class TreeInfo:
    """What every node of one tree shares: the device its indices are returned on.

    A new `TreeInfo` is made at every reset, so a node (and a handle) from before a reset or
    from another manager is recognised by ``node.tree is not manager's``.
    """

    __slots__ = ("device",)

    def __init__(self, device: torch.device) -> None:
        self.device = device


class RadixTreeNode:
    """One edge of the tree: a run of tokens and the KV slots holding them.

    ``children`` maps a child's first token (``page_size == 1``) or first page, as the bytes of
    its int64 token ids (``page_size > 1``; ``np.frombuffer(key, np.int64)`` reads them), to the
    child. ``ref_count`` counts the locked handles whose
    path runs through this node; a node with ``ref_count > 0`` is protected. ``timestamp`` is the
    manager's logical clock at the node's last match or insert; ``insert_time`` when its tokens
    were inserted.
    """

    __slots__ = (
        "_in_tree",
        "_kb",
        "_pages",
        "_parent",
        "_tree",
        "_value",
        "children",
        "insert_time",
        "ref_count",
        "timestamp",
        "uuid",
    )

    def __init__(
        self,
        uuid: int,
        key_bytes: bytes,
        value: np.ndarray,
        pages: np.ndarray,
        timestamp: int,
        insert_time: int,
        tree: TreeInfo,
    ) -> None:
        self.children: dict[Hashable, RadixTreeNode] = {}
        self._parent: RadixTreeNode | None = None
        self.ref_count = 0
        self.uuid = uuid
        self.timestamp = timestamp
        self.insert_time = insert_time
        self._kb = key_bytes  # int64 token ids, native byte order
        self._value = value  # int32 slots on the host, one per token
        self._pages = pages  # intp page numbers of those slots, one per page (for eviction)
        self._in_tree = True
        self._tree = tree

    @property
    def parent(self) -> RadixTreeNode | None:
        return self._parent

    @property
    def key_bytes(self) -> bytes:
        """The node's token ids as native-order int64 bytes (``8 * length`` of them)."""
        return self._kb

    @property
    def key(self) -> torch.Tensor:
        """The node's token ids, shape ``(length,)``, int64 on the CPU (a copy)."""
        return torch.from_numpy(np.frombuffer(self._kb, dtype=np.int64).copy())

    @property
    def value(self) -> torch.Tensor:
        """The KV slots of the node's tokens, shape ``(length,)``, int32 on the manager's device.

        On the CPU this shares memory with the node: read it, do not write to it.
        """
        out = torch.from_numpy(self._value)
        device = self._tree.device
        return out if device.type == "cpu" else out.to(device)

    @property
    def value_array(self) -> np.ndarray:
        """The KV slots as the host array the tree keeps (read-only use)."""
        return self._value

    @property
    def page_array(self) -> np.ndarray:
        """The page numbers of the slots (``intp``, one per page), as eviction frees them."""
        return self._pages

    @property
    def length(self) -> int:
        return len(self._value)

    @property
    def in_tree(self) -> bool:
        """False once the node was evicted (or the tree reset): its handle can no longer be locked."""
        return self._in_tree

    @property
    def tree(self) -> TreeInfo:
        """The tree this node was made for (a new one after every reset)."""
        return self._tree

    def is_root(self) -> bool:
        return self._parent is None

    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        keys = np.frombuffer(self._kb, dtype=np.int64).tolist()
        shown = keys if len(keys) <= 8 else [*keys[:4], "...", *keys[-2:]]
        return (
            f"RadixTreeNode(uuid={self.uuid}, key={shown}, ref_count={self.ref_count}, "
            f"timestamp={self.timestamp})"
        )


@dataclass(frozen=True)
class RadixCacheHandle(BaseCacheHandle):
    """The matched prefix ends at the end of ``node``; ``cached_len`` is the path's length."""

    node: RadixTreeNode


def check_child(
    node: RadixTreeNode,
    key: Hashable,
    child: RadixTreeNode,
    page_size: int,
    key_of: Callable[[bytes, int], Hashable],
) -> None:
    """Raise ``RuntimeError`` if ``child``, filed under ``key`` in ``node.children``, is malformed."""
    where = f"node {child.uuid}"
    if child._parent is not node:
        raise RuntimeError(f"{where}: parent link does not point to the node that files it")
    if child.length == 0 or not child._kb:
        raise RuntimeError(f"{where}: empty node")
    if len(child._kb) != child.length * ITEM:
        raise RuntimeError(f"{where}: {len(child._kb) // ITEM} tokens but {child.length} indices")
    if child.length % page_size:
        raise RuntimeError(f"{where}: length {child.length} is not whole pages of {page_size}")
    if key_of(child._kb, 0) != key:
        raise RuntimeError(f"{where}: filed under {key!r} but starts with {key_of(child._kb, 0)!r}")
    if child.ref_count < 0:
        raise RuntimeError(f"{where}: negative ref_count {child.ref_count}")
    if not node.is_root() and node.ref_count < child.ref_count:
        raise RuntimeError(
            f"{where}: ref_count {child.ref_count} exceeds its parent's {node.ref_count}"
        )
    if not node.is_root() and node.timestamp < child.timestamp:
        raise RuntimeError(
            f"{where}: used at {child.timestamp}, after its parent ({node.timestamp})"
        )
    if not child._in_tree:
        raise RuntimeError(f"{where}: marked evicted but still in the tree")


class TreeCensus(NamedTuple):
    """What `census_tree` counted: tokens in unlocked and in locked nodes, nodes (the root
    excluded), and every node's slots."""

    evictable: int
    protected: int
    num_nodes: int
    slots: np.ndarray


def census_tree(
    root: RadixTreeNode,
    tree: TreeInfo,
    page_size: int,
    key_of: Callable[[bytes, int], Hashable],
    unfiled_leaf: Callable[[RadixTreeNode], bool],
) -> TreeCensus:
    """Walk the tree under ``root`` (no recursion), check every node (`check_child`, of ``tree``,
    no evictable leaf for which ``unfiled_leaf`` is true) and count it; no slot may appear twice.

    ``RuntimeError`` on the first inconsistency.
    """
    if root.ref_count != 1 or root.length != 0 or root._parent is not None:
        raise RuntimeError("root must be empty, parentless and hold ref_count 1")
    evictable = protected = count = 0
    values: list[np.ndarray] = []
    stack = [root]
    while stack:
        node = stack.pop()
        for key, child in node.children.items():
            check_child(node, key, child, page_size, key_of)
            if child._tree is not tree:
                raise RuntimeError(f"node {child.uuid}: from another tree, or from before a reset")
            if unfiled_leaf(child):
                raise RuntimeError(
                    f"node {child.uuid}: evictable leaf missing from the eviction heap"
                )
            if child.ref_count == 0:
                evictable += child.length
            else:
                protected += child.length
            count += 1
            values.append(child._value)
            stack.append(child)
    slots = np.concatenate(values) if values else np.empty(0, dtype=np.int32)
    uniq, counts = np.unique(slots, return_counts=True)
    if len(uniq) != len(slots):
        raise RuntimeError(
            f"indices appear more than once in the tree: {uniq[counts > 1][:8].tolist()}"
        )
    return TreeCensus(evictable, protected, count, slots)


def lock_path(node: RadixTreeNode) -> tuple[int, int]:
    """``ref_count += 1`` on ``node`` and each ancestor below the root. Returns the path's length
    in tokens and the tokens of the nodes that were unlocked before."""
    taken = length = 0
    while node._parent is not None:
        n = len(node._value)
        length += n
        if node.ref_count == 0:
            taken += n
        node.ref_count += 1
        node = node._parent
    return length, taken


def unlock_path(node: RadixTreeNode) -> int:
    """``ref_count -= 1`` on ``node`` and each ancestor below the root. Returns the tokens of
    the nodes left unlocked."""
    freed = 0
    while node._parent is not None:
        node.ref_count -= 1
        if node.ref_count == 0:
            freed += len(node._value)
        node = node._parent
    return freed


def path_slots(node: RadixTreeNode) -> list[np.ndarray]:
    """The slots of each node from the root's child down to ``node`` (views, not copies)."""
    values = []
    while node._parent is not None:
        values.append(node._value)
        node = node._parent
    values.reverse()
    return values


_FIRST_TOKEN = struct.Struct("=q").unpack_from


def detach_leaf(node: RadixTreeNode, page_bytes: int) -> RadixTreeNode:
    """Take the leaf ``node`` out of its parent's children (it is filed under its first page of
    ``page_bytes`` key bytes) and mark it evicted; return the parent. Its ``value_array`` and
    ``page_array`` stay readable."""
    parent, kb = node._parent, node._kb
    del parent.children[_FIRST_TOKEN(kb)[0] if page_bytes == ITEM else kb[:page_bytes]]  # type: ignore[union-attr]
    node._in_tree = False
    return parent  # type: ignore[return-value]


def spells(node: RadixTreeNode, mv: memoryview, held: int) -> bool:
    """Whether the keys from the root down to ``node``, ``held`` bytes in all, equal
    ``mv[:held]`` (a byte view of int64 token ids): one memcmp a node, from ``node`` up."""
    hi = held
    while node._parent is not None:
        kb = node._kb
        lo = hi - len(kb)
        if lo < 0 or not kb.startswith(mv[lo:hi]):
            return False
        hi, node = lo, node._parent
    return hi == 0


def stamp_path(node: RadixTreeNode, tic: int) -> None:
    """``timestamp = tic`` on ``node`` and each ancestor below the root."""
    while node._parent is not None:
        node.timestamp = tic
        node = node._parent
