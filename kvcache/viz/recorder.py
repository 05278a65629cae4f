"""`TreeRecorder`: a radix manager that keeps a captioned snapshot after every call.

It wraps a `RadixCacheManager` and forwards ``match_prefix``, ``insert_prefix``,
``lock_handle`` and ``evict`` unchanged (same results, same exceptions), recording the tree after
each with a caption that names the call; or it listens to a `RequestFlow` through ``on_event``.
Its snapshots feed `draw_sequence`, `tree_text` and the step player.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import graphviz
import torch

from ..managers.radix import RadixCacheHandle, RadixCacheManager
from .sequence import draw_sequence
from .snapshot import TreeSnapshot, snapshot
from .text import DecodeLike, as_decoder, format_indices, one_line, shorten_middle, tree_text

__all__ = ["TreeRecorder"]


def _fmt_ids(ids: Any, decode: DecodeLike, width: int = 32) -> str:
    values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    dec = as_decoder(decode)
    if dec is not None:
        return '"' + shorten_middle(one_line(dec(values)), width) + '"'
    return "[" + shorten_middle(", ".join(map(str, values)), width) + "]"


@dataclass
class TreeRecorder:
    """Wraps a `RadixCacheManager`: forwards calls and keeps a captioned snapshot after each.

    ``match_prefix``, ``insert_prefix``, ``lock_handle`` and ``evict`` behave exactly as the
    manager's (same results, same exceptions); every other public attribute is the manager's. A failed
    ``evict`` is recorded too (caption ``✗``) before the error propagates. ``on_event`` can be
    given to ``RequestFlow(on_event=...)`` to record the flow's steps instead; steps that leave
    the tree unchanged are skipped unless ``record_unchanged``.
    """

    manager: RadixCacheManager
    decode: DecodeLike = None
    record_initial: bool = True
    record_unchanged: bool = False
    snapshots: list[TreeSnapshot] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.manager, RadixCacheManager):
            raise TypeError(
                f"manager must be a RadixCacheManager, got {type(self.manager).__name__}"
            )
        as_decoder(self.decode)
        if not isinstance(self.snapshots, list) or not all(
            isinstance(s, TreeSnapshot) for s in self.snapshots
        ):
            raise TypeError("snapshots must be a list of TreeSnapshot")
        if self.record_initial and not self.snapshots:
            self.record("empty tree" if self.manager.num_nodes == 0 else "start")

    def __getattr__(self, name: str) -> Any:  # only called for names the recorder lacks
        # Forward the manager's public names only: its private state stays its own.
        if name == "manager" or name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self.manager, name)

    def record(self, caption: str, *, evict_size: int | None = None) -> TreeSnapshot:
        """Snapshot the tree now, diffed against the last snapshot, and keep it."""
        prev = self.snapshots[-1] if self.snapshots else None
        snap = snapshot(self.manager, caption, previous=prev, evict_size=evict_size)
        self.snapshots.append(snap)
        return snap

    @property
    def last(self) -> TreeSnapshot:
        return self.snapshots[-1]

    def to_snapshot(self) -> TreeSnapshot:
        """The latest snapshot, or a fresh one of the manager when nothing was recorded yet."""
        return self.snapshots[-1] if self.snapshots else snapshot(self.manager)

    def __iter__(self) -> Iterator[TreeSnapshot]:
        """The recorded snapshots, oldest first (so `draw_sequence(recorder)` draws them all)."""
        return iter(list(self.snapshots))

    def match_prefix(self, input_ids: torch.Tensor) -> tuple[RadixCacheHandle, torch.Tensor]:
        handle, indices = self.manager.match_prefix(input_ids)
        self.record(
            f"match_prefix({_fmt_ids(input_ids, self.decode)}) → cached_len={handle.cached_len}"
        )
        return handle, indices

    def insert_prefix(self, input_ids: torch.Tensor, indices: torch.Tensor) -> int:
        already = self.manager.insert_prefix(input_ids, indices)
        self.record(
            f"insert_prefix({_fmt_ids(input_ids, self.decode)}, "
            f"[{format_indices(indices.tolist())}]) → {already}"
        )
        return already

    def lock_handle(self, handle: RadixCacheHandle, unlock: bool = False) -> None:
        what = self._handle_text(handle)
        self.manager.lock_handle(handle, unlock=unlock)
        self.record(f"lock_handle({what}, unlock=True)" if unlock else f"lock_handle({what})")

    def _handle_text(self, handle: Any) -> str:
        """``h("Hello world")``: the handle's prefix, read from its path (ids without ``decode``)."""
        node = getattr(handle, "node", None)
        if node is None:
            return f"handle(cached_len={getattr(handle, 'cached_len', '?')})"
        keys = []
        while node is not None and not node.is_root():
            keys.append(node.key.tolist())
            node = node.parent
        ids = [t for key in reversed(keys) for t in key]
        return f"h({_fmt_ids(ids, self.decode, 24)})" if ids else "h(root)"

    def evict(self, size: int) -> torch.Tensor:
        try:
            out = self.manager.evict(size)
        except RuntimeError as e:
            self.record(f"evict({size}) ✗ {shorten_middle(str(e), 60)}", evict_size=size)
            raise
        self.record(f"evict({size}) → [{format_indices(out.tolist())}]", evict_size=size)
        return out

    def on_event(self, event: Any) -> None:
        """Record a `FlowEvent` (``rid``, ``step``, ``name``, ``detail``) from a `RequestFlow`."""
        caption = f"req {event.rid} · step {event.step} {event.name}: {event.detail}"
        if event.step == 0:
            caption = f"req {event.rid} · {event.name}: {event.detail}"
        prev = self.snapshots[-1] if self.snapshots else None
        snap = snapshot(self.manager, shorten_middle(caption, 90), previous=prev)
        if prev is None or self.record_unchanged or snap.nodes != prev.nodes:
            self.snapshots.append(snap)

    def draw(self, **kwargs: Any) -> graphviz.Digraph:
        """`draw_sequence` of everything recorded, decoded with this recorder's ``decode``."""
        kwargs.setdefault("decode", self.decode)
        return draw_sequence(self.snapshots, **kwargs)

    def text(self, **kwargs: Any) -> str:
        """`tree_text` of every snapshot, each under its caption."""
        kwargs.setdefault("decode", self.decode)
        return "\n\n".join(
            f"{i + 1}. {s.caption}\n{tree_text(s, **kwargs)}" for i, s in enumerate(self.snapshots)
        )
