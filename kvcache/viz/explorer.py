"""`Explorer`: a radix prefix cache to poke at by hand, live in a Jupyter kernel.

The reader types a request (byte-level text, see `ByteTokenizer`) or picks a preset, and
presses buttons that run ``match_prefix``, a whole request (``insert``: begin + finish of a
`RequestFlow`, so pages really come from the free list and duplicates go back to it), ``lock``,
``unlock`` and ``evict(N)``. Beside the tree it shows the sizes, the free list, the locks it
holds and an event log. Every button calls a plain method (`Explorer.match`,
`Explorer.insert`, ...), so the logic runs and is tested without a browser; ``ipywidgets`` is
imported only when the widget is built. Its ``history`` (a `TreeRecorder`) replays on the
static website through `step_player` (`kvcache.viz.player`, re-exported here).
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .._validate import check_positive_int
from ..managers.radix import RadixCacheHandle, RadixCacheManager
from ..serving.allocator import PageAllocator
from ..serving.request_flow import RequestFlow
from ..serving.tokenizer import ByteTokenizer
from .drawing import draw_tree
from .player import StepPlayer, render_svg, step_player
from .recorder import TreeRecorder
from .snapshot import predict_evict
from .text import format_indices, tree_text
from .widget import ExplorerWidget

__all__ = ["Explorer", "DEFAULT_PRESETS", "StepPlayer", "step_player", "render_svg"]

#: Requests offered in the explorer's drop-down: a shared system prompt with different
#: questions, a chat that continues, and one request that shares nothing.
DEFAULT_PRESETS: tuple[tuple[str, str], ...] = (
    ("system + KV question", "You are terse. What is a KV cache?"),
    ("system + radix question", "You are terse. What is a radix tree?"),
    ("system + eviction question", "You are terse. Why evict leaves?"),
    ("chat, turn 1", "User: hi! Bot: hello."),
    ("chat, turn 2", "User: hi! Bot: hello. User: more?"),
    ("unrelated", "Translate: cat"),
)


def _quote(text: str, width: int = 28) -> str:
    text = text.replace("\n", "\\n")
    return '"' + (text if len(text) <= width else text[: width - 1] + "…") + '"'


class TextTokenizer(Protocol):
    """What the explorer needs of a tokenizer (`ByteTokenizer` is one)."""

    def encode(self, text: str) -> torch.Tensor:
        """``text`` as a 1-D integer tensor of token ids."""
        ...

    def decode(self, ids: list[int]) -> str:
        """The text of the token ids ``ids``."""
        ...


@dataclass
class HeldLock:
    """A handle the explorer locked, with the text it was matched from."""

    text: str
    handle: RadixCacheHandle


def _check_presets(presets: Any) -> list[tuple[str, str]]:
    if isinstance(presets, (str, bytes)) or not isinstance(presets, Sequence):
        raise TypeError(
            f"presets must be a sequence of (label, text) pairs, got {type(presets).__name__}"
        )
    out = []
    for p in presets:
        if not (
            isinstance(p, (tuple, list)) and len(p) == 2 and all(isinstance(x, str) for x in p)
        ):
            raise TypeError(f"presets must hold (label, text) pairs of str, got {p!r}")
        out.append((p[0], p[1]))
    return out


class Explorer:
    """A radix cache to poke at: text in, tree, sizes, free list and an event log out.

    Args:
        manager: the `RadixCacheManager` to explore; a fresh one (``page_size``,
            ``eviction_policy``) when ``None``. It must be empty when given, since the
            explorer's free list starts full.
        page_size: tokens per page (``manager.page_size`` wins when a manager is given).
        num_pages: pages in the pool's free list.
        tokenizer: turns text into token ids and back (default `ByteTokenizer`: one id a byte).
        presets: ``(label, text)`` pairs for the drop-down.
        eviction_policy: ``"lru"`` or ``"fifo"`` for a fresh manager.
        max_log: how many log lines to keep.

    Every action is a method that returns a result and never raises for a reader's mistake:
    a refused call (too much to evict, out of pages, unlock with nothing locked) is written to
    the log with ``✗`` and the state is left as it was. After each action the explorer records
    a snapshot (``history``: a `TreeRecorder`, whose snapshots `step_player` can replay) and
    checks the integrity of the tree and of the page partition.
    """

    def __init__(
        self,
        manager: RadixCacheManager | None = None,
        *,
        page_size: int = 1,
        num_pages: int = 64,
        tokenizer: Any = None,
        presets: Sequence[tuple[str, str]] = DEFAULT_PRESETS,
        eviction_policy: str = "lru",
        max_log: int = 200,
    ) -> None:
        if manager is None:
            manager = RadixCacheManager(page_size=page_size, eviction_policy=eviction_policy)
        if not isinstance(manager, RadixCacheManager):
            raise TypeError(f"manager must be a RadixCacheManager, got {type(manager).__name__}")
        if manager.size_info.total_size:
            raise ValueError(
                f"manager must be empty, it holds {manager.size_info.total_size} tokens"
            )
        tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        for method in ("encode", "decode"):
            if not callable(getattr(tokenizer, method, None)):
                raise TypeError(
                    f"tokenizer must have .encode and .decode methods, got {type(tokenizer).__name__}"
                )
        presets = _check_presets(presets)
        check_positive_int(max_log, "max_log")
        self.manager = manager
        self.page_size = manager.page_size
        self.tokenizer: TextTokenizer = tokenizer
        self.allocator = PageAllocator(num_pages, self.page_size, device=manager.device)
        self.flow = RequestFlow(manager, self.allocator)
        self.history = TreeRecorder(manager, decode=self.tokenizer)
        self.presets = presets
        self.locks: list[HeldLock] = []
        self.log: list[str] = []
        self.max_log = max_log
        self.last_ok = True
        self._widget: ExplorerWidget | None = None

    # ----------------------------------------------------------------------------- helpers
    def _ids(self, text: str) -> torch.Tensor:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return self.tokenizer.encode(text)

    def _note(self, line: str, ok: bool = True) -> None:
        self.last_ok = ok
        self.log.append(("" if ok else "✗ ") + line)
        del self.log[: max(0, len(self.log) - self.max_log)]

    def _after(self, caption: str, *, ok: bool = True, evict_size: int | None = None) -> None:
        self._note(caption, ok)
        self.history.record(caption if ok else "✗ " + caption, evict_size=evict_size)
        self.flow.check_integrity()
        self.refresh()

    def _text(self, text: str | None) -> str:
        if text is None:
            return self._widget.text.value if self._widget is not None else ""
        return text

    # ------------------------------------------------------------------------------ actions
    def match(self, text: str | None = None) -> int:
        """``match_prefix(text)``: returns the cached length (may split a node; refreshes LRU)."""
        text = self._text(text)
        handle, indices = self.manager.match_prefix(self._ids(text))
        self._after(
            f"match {_quote(text)} → cached_len={handle.cached_len}"
            + (f", slots [{format_indices(indices.tolist())}]" if handle.cached_len else "")
        )
        return handle.cached_len

    def insert(self, text: str | None = None) -> int | None:
        """Serve ``text`` as one request: begin (match, lock, allocate, evicting if short), pretend its
        K/V were computed, finish (insert, free duplicates, unlock).

        As on a server, the last token is always computed (``compute_last=True``: its logits give
        the first output token), so a text cached in full still computes one token.

        Returns the number of tokens the request reused from the cache, or ``None`` when it was
        refused (empty text, or the pool cannot hold it even after evicting).
        """
        text = self._text(text)
        ids = self._ids(text)
        evicted_before = self.flow.stats.evicted_tokens
        try:
            req = self.flow.begin(ids, compute_last=True)
        except (ValueError, RuntimeError) as e:
            self._after(f"insert {_quote(text)} refused: {e}", ok=False)
            return None
        self.flow.mark_computed(req)
        self.flow.finish(req)
        evicted = self.flow.stats.evicted_tokens - evicted_before
        new = len(ids) - req.reused_len
        cached = len(ids) // self.page_size * self.page_size
        msg = f"insert {_quote(text)}: {len(ids)} tokens, reused {req.reused_len}, computed {new}"
        if cached < len(ids):
            msg += f", cached {cached} (whole pages)"
        if evicted:
            msg += f", evicted {evicted} to make room"
        self._after(msg)
        return req.reused_len

    def lock(self, text: str | None = None) -> int:
        """Match ``text`` and lock its handle, as a running request would. Returns the locked length."""
        text = self._text(text)
        handle, _ = self.manager.match_prefix(self._ids(text))
        if handle.cached_len == 0:
            self._after(f"lock {_quote(text)}: nothing of it is cached, nothing to lock", ok=False)
            return 0
        self.manager.lock_handle(handle)
        self.locks.append(HeldLock(text, handle))
        self._after(f"lock {_quote(text)} → {handle.cached_len} tokens protected")
        return handle.cached_len

    def unlock(self, text: str | None = None) -> int:
        """Unlock the latest lock taken on ``text`` (or the latest of all when none was).

        Returns the unlocked length (0 when nothing is locked).
        """
        text = self._text(text)
        if not self.locks:
            self._after("unlock: no lock is held", ok=False)
            return 0
        pick = next(
            (i for i in range(len(self.locks) - 1, -1, -1) if self.locks[i].text == text),
            len(self.locks) - 1,
        )
        held = self.locks.pop(pick)
        self.manager.lock_handle(held.handle, unlock=True)
        self._after(
            f"unlock {_quote(held.text)} → {held.handle.cached_len} tokens no longer protected"
        )
        return held.handle.cached_len

    def evict(self, size: int | None = None) -> list[int]:
        """``evict(size)`` and give the freed pages back to the free list; returns the freed slots.

        Refused (``[]``, logged) when more than the evictable size is asked for.
        """
        if size is None:
            size = int(self._widget.evict_n.value) if self._widget is not None else 0
        try:
            slots = self.manager.evict(size)
        except (TypeError, ValueError, RuntimeError) as e:
            # Only a valid size too big for the cache is worth previewing in the history.
            self._after(
                f"evict({size!r}) refused: {e}",
                ok=False,
                evict_size=size if isinstance(e, RuntimeError) else None,
            )
            return []
        self.allocator.free(self.allocator.slots_to_pages(slots))
        self._after(
            f"evict({size}) → freed {len(slots)} slots [{format_indices(slots.tolist())}]",
            evict_size=size,
        )
        return slots.tolist()

    def reset(self) -> None:
        """Drop every lock, forget every prefix and refill the free list."""
        for held in reversed(self.locks):
            self.manager.lock_handle(held.handle, unlock=True)
        self.locks.clear()
        self.manager.reset()
        self.allocator.reset()
        self._after("reset → empty tree, every page free")

    # -------------------------------------------------------------------------------- facts
    def preview_evict(self, size: int) -> list[str]:
        """Texts of the nodes ``evict(size)`` would take, in order (nothing is changed; ``[]`` if it would fail)."""
        try:
            order = predict_evict(self.history.last, size)
        except (ValueError, RuntimeError):
            return []
        nodes = self.history.last.by_uuid  # the explorer's one namespace
        return [self.tokenizer.decode(list(nodes[u].tokens)) for u in order if u in nodes]

    def status(self) -> str:
        """Sizes, free list and held locks, as plain text (what the status pane shows)."""
        info = self.manager.size_info
        free = self.allocator.free_pages().tolist()
        shown = ", ".join(map(str, free[:8])) + (", …" if len(free) > 8 else "")
        lines = [
            f"page_size {self.page_size} · pool of {self.allocator.num_pages} pages "
            f"({self.allocator.num_slots} slots)",
            f"cached {info.total_size} tokens in {self.manager.num_nodes} nodes: "
            f"evictable {info.evictable_size}, protected {info.protected_size}",
            f"free list: {len(free)} pages [{shown}]",
            f"locks held: {len(self.locks)}"
            + (
                " (" + ", ".join(_quote(h.text, 16) for h in self.locks) + ")" if self.locks else ""
            ),
        ]
        return "\n".join(lines)

    def text(self) -> str:
        """The tree as deterministic text (`kvcache.viz.tree_text`)."""
        return tree_text(self.history.last, self.tokenizer)

    def graph(self, evict_preview: int | None = None) -> Any:
        """The last snapshot drawn with `draw_tree`; ``evict_preview`` marks what ``evict(n)`` would take."""
        return draw_tree(
            self.history.last,
            self.tokenizer,
            evict_size=evict_preview or None,
            title=self.history.last.caption,
            max_chars=28,
        )

    @property
    def dot(self) -> str:
        """DOT source of what the tree pane shows now."""
        source: str = self.graph(self._preview_size()).source  # a graphviz.Digraph (untyped)
        return source

    def _preview_size(self) -> int | None:
        w = self._widget
        if w is None or not w.preview.value:
            return None
        return int(w.evict_n.value)

    # ------------------------------------------------------------------------------- widget
    @property
    def widget(self) -> Any:
        """The ipywidgets view (built on first use)."""
        if self._widget is None:
            self._widget = ExplorerWidget(self)
            self.refresh()
        return self._widget.box

    def refresh(self) -> None:
        """Redraw the panes from the current state (no-op until the widget is built)."""
        w = self._widget
        if w is None:
            return
        try:
            tree = render_svg(self.graph(self._preview_size()))
        except Exception as e:  # no `dot` on this machine: fall back to the text tree
            tree = f"<pre>{html.escape(self.text())}</pre><p>(graphviz failed: {html.escape(str(e))})</p>"
        w.tree.value = f'<div class="kvx-tree" style="overflow:auto;max-width:100%">{tree}</div>'
        w.status.value = (
            '<pre style="margin:0;line-height:1.35;white-space:pre-wrap">'
            f"{html.escape(self.status())}</pre>"
        )
        lines = self.log[-12:]
        w.log.value = (
            '<pre style="margin:0;line-height:1.35;white-space:pre-wrap">'
            + html.escape("\n".join(lines) if lines else "(no events yet)")
            + "</pre>"
        )

    def _ipython_display_(self) -> None:
        from IPython.display import display

        # IPython's display() carries no annotations; the call is the documented one.
        display(self.widget)  # type: ignore[no-untyped-call]

    def __repr__(self) -> str:
        info = self.manager.size_info
        return (
            f"Explorer(page_size={self.page_size}, num_pages={self.allocator.num_pages}, "
            f"cached={info.total_size}, locks={len(self.locks)}, events={len(self.log)})"
        )
