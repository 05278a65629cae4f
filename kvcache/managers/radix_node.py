"""The radix tree's pieces: `RadixTreeNode`, `RadixCacheHandle`, and how keys are stored and filed.

A node's tokens are kept as the bytes of their int64 values (``key_bytes``): a whole-node match
is then one ``bytes.startswith`` (a memcmp, no Python work per token), and the child a walk
needs next is found with one ``struct`` unpack and one dict probe per node. Children stay filed
under what a reader expects (API.md and the book): the first token id (an ``int``) with
``page_size == 1``, the first page as a tuple of token ids with ``page_size > 1``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Callable, Dict, Hashable, Optional

import numpy as np
import torch

from .base import BaseCacheHandle

__all__ = ["RadixTreeNode", "RadixCacheHandle", "TreeInfo", "key_reader", "ITEM"]

ITEM = np.dtype(np.int64).itemsize  # bytes per token id in a key


def key_reader(page_size: int) -> Callable[[bytes, int], Hashable]:
    """``read(buf, offset)``: the filing key of the page that starts at byte ``offset`` of ``buf``.

    ``buf`` holds native-order int64 token ids; the key is an ``int`` for ``page_size == 1`` and a
    tuple of ``page_size`` ints otherwise (one C call either way).
    """
    if page_size == 1:
        unpack1 = struct.Struct("=q").unpack_from
        return lambda buf, offset: unpack1(buf, offset)[0]
    return struct.Struct(f"={page_size}q").unpack_from


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

    ``children`` maps a child's first token (``page_size == 1``) or first page, as a tuple of
    token ids (``page_size > 1``), to the child. ``ref_count`` counts the locked handles whose
    path runs through this node; a node with ``ref_count > 0`` is protected. ``timestamp`` is the
    manager's logical clock at the node's last match or insert; ``insert_time`` when its tokens
    were inserted.
    """

    __slots__ = (
        "children", "_parent", "ref_count", "uuid", "timestamp", "insert_time",
        "_kb", "_value", "_in_tree", "_heap_priority", "_tree",
    )

    def __init__(self, uuid: int, key_bytes: bytes, value: np.ndarray, timestamp: int,
                 insert_time: int, tree: TreeInfo) -> None:
        self.children: Dict[Hashable, RadixTreeNode] = {}
        self._parent: Optional[RadixTreeNode] = None
        self.ref_count = 0
        self.uuid = uuid
        self.timestamp = timestamp
        self.insert_time = insert_time
        self._kb = key_bytes  # int64 token ids, native byte order
        self._value = value  # int32 slots on the host, one per token
        self._in_tree = True
        self._heap_priority: object = None  # the priority of the node's live heap entry
        self._tree = tree

    @property
    def parent(self) -> Optional["RadixTreeNode"]:
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
        shown = keys if len(keys) <= 8 else keys[:4] + ["..."] + keys[-2:]
        return (f"RadixTreeNode(uuid={self.uuid}, key={shown}, ref_count={self.ref_count}, "
                f"timestamp={self.timestamp})")


@dataclass(frozen=True)
class RadixCacheHandle(BaseCacheHandle):
    """The matched prefix ends at the end of ``node``; ``cached_len`` is the path's length."""

    node: RadixTreeNode
