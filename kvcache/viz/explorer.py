"""Explore a radix prefix cache by hand: a live ipywidgets explorer and a static step player.

Two ways to watch `RadixCacheManager` work, in the same visual language as `kvcache.viz`:

* `Explorer` -- for a live Jupyter kernel. The reader types a request (byte-level text, see
  `ByteTokenizer`) or picks a preset, and presses buttons that run ``match_prefix``, a whole
  request (``insert``: begin + finish of a `RequestFlow`, so pages really come from the free
  list and duplicates go back to it), ``lock``, ``unlock`` and ``evict(N)``. Beside the tree it
  shows the sizes, the free list, the locks it holds and an event log. Every button calls a
  plain method (`Explorer.match`, `Explorer.insert`, ...), so the logic runs and is tested
  without a browser; ``ipywidgets`` is imported only when the widget is built.
* `step_player` -- for the static website, where no kernel runs. It renders a recorded
  sequence of snapshots (a `TreeRecorder`, an `Explorer`'s history, or a list of
  `TreeSnapshot`) to SVG with graphviz once, at execution time, and wraps them in one
  self-contained HTML block with previous / next / play buttons in inline JavaScript: no
  server, no network, no external script.

The player's HTML is deterministic apart from the SVG documents themselves (whose coordinates
follow the machine's fonts), so a notebook that stores it compares equal on re-run once SVG
documents are masked.
"""

from __future__ import annotations

import hashlib
import html
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import torch

from ..serving.allocator import PageAllocator
from ..managers.radix import RadixCacheHandle, RadixCacheManager
from ..serving.request_flow import RequestFlow
from ..serving.tokenizer import ByteTokenizer
from .drawing import TreeRecorder, TreeSnapshot, draw_tree, format_indices, predict_evict, tree_text

__all__ = ["Explorer", "StepPlayer", "step_player", "render_svg", "DEFAULT_PRESETS"]

#: Requests offered in the explorer's drop-down: a shared system prompt with different
#: questions, a chat that continues, and one request that shares nothing.
DEFAULT_PRESETS: Tuple[Tuple[str, str], ...] = (
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


def render_svg(graph: Any) -> str:
    """The SVG element of a `graphviz.Digraph`, without the XML prolog, doctype and comments.

    Only ``<svg ...>...</svg>`` is kept, so the text around it does not depend on the graphviz
    version, and the element can be inlined in HTML.
    """
    svg = graph.pipe(format="svg").decode("utf-8")
    start = svg.find("<svg")
    if start < 0:
        raise ValueError("graphviz produced no <svg> element")
    return svg[start:].strip()


# =============================================================================== explorer
@dataclass
class HeldLock:
    """A handle the explorer locked, with the text it was matched from."""

    text: str
    handle: RadixCacheHandle


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

    def __init__(self, manager: Optional[RadixCacheManager] = None, *, page_size: int = 1,
                 num_pages: int = 64, tokenizer: Any = None,
                 presets: Sequence[Tuple[str, str]] = DEFAULT_PRESETS,
                 eviction_policy: str = "lru", max_log: int = 200) -> None:
        if manager is None:
            manager = RadixCacheManager(page_size=page_size, eviction_policy=eviction_policy)
        if not isinstance(manager, RadixCacheManager):
            raise TypeError(f"manager must be a RadixCacheManager, got {type(manager).__name__}")
        if manager.size_info.total_size:
            raise ValueError(f"manager must be empty, it holds {manager.size_info.total_size} tokens")
        self.manager = manager
        self.page_size = manager.page_size
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.allocator = PageAllocator(num_pages, self.page_size, device=manager.device)
        self.flow = RequestFlow(manager, self.allocator)
        self.history = TreeRecorder(manager, decode=self.tokenizer)
        self.presets = list(presets)
        self.locks: List[HeldLock] = []
        self.log: List[str] = []
        self.max_log = max_log
        self.last_ok = True
        self._widget: Any = None

    # ----------------------------------------------------------------------------- helpers
    def _ids(self, text: str) -> torch.Tensor:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return self.tokenizer.encode(text)

    def _note(self, line: str, ok: bool = True) -> None:
        self.last_ok = ok
        self.log.append(("" if ok else "✗ ") + line)
        del self.log[: max(0, len(self.log) - self.max_log)]

    def _after(self, caption: str, *, ok: bool = True, evict_size: Optional[int] = None) -> None:
        self._note(caption, ok)
        self.history.record(caption if ok else "✗ " + caption, evict_size=evict_size)
        self.flow.check_integrity()
        self.refresh()

    def _text(self, text: Optional[str]) -> str:
        if text is None:
            return self._widget.text.value if self._widget is not None else ""
        return text

    # ------------------------------------------------------------------------------ actions
    def match(self, text: Optional[str] = None) -> int:
        """``match_prefix(text)``: returns the cached length (may split a node; refreshes LRU)."""
        text = self._text(text)
        handle, indices = self.manager.match_prefix(self._ids(text))
        self._after(f"match {_quote(text)} → cached_len={handle.cached_len}"
                    + (f", slots [{format_indices(indices.tolist())}]" if handle.cached_len else ""))
        return handle.cached_len

    def insert(self, text: Optional[str] = None) -> Optional[int]:
        """Serve ``text`` as one request: begin (match, lock, allocate, evicting if short), pretend its
        K/V were computed, finish (insert, free duplicates, unlock).

        Returns the number of tokens the request reused from the cache, or ``None`` when it was
        refused (empty text, or the pool cannot hold it even after evicting).
        """
        text = self._text(text)
        ids = self._ids(text)
        evicted_before = self.flow.stats.evicted_tokens
        try:
            req = self.flow.begin(ids)
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

    def lock(self, text: Optional[str] = None) -> int:
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

    def unlock(self, text: Optional[str] = None) -> int:
        """Unlock the latest lock taken on ``text`` (or the latest of all when none was).

        Returns the unlocked length (0 when nothing is locked).
        """
        text = self._text(text)
        if not self.locks:
            self._after("unlock: no lock is held", ok=False)
            return 0
        pick = next((i for i in range(len(self.locks) - 1, -1, -1) if self.locks[i].text == text),
                    len(self.locks) - 1)
        held = self.locks.pop(pick)
        self.manager.lock_handle(held.handle, unlock=True)
        self._after(f"unlock {_quote(held.text)} → {held.handle.cached_len} tokens no longer protected")
        return held.handle.cached_len

    def evict(self, size: Optional[int] = None) -> List[int]:
        """``evict(size)`` and give the freed pages back to the free list; returns the freed slots.

        Refused (``[]``, logged) when more than the evictable size is asked for.
        """
        if size is None:
            size = int(self._widget.evict_n.value) if self._widget is not None else 0
        try:
            slots = self.manager.evict(size)
        except (ValueError, RuntimeError) as e:
            self._after(f"evict({size}) refused: {e}", ok=False, evict_size=size)
            return []
        self.allocator.free(self.allocator.slots_to_pages(slots))
        self._after(f"evict({size}) → freed {len(slots)} slots [{format_indices(slots.tolist())}]",
                    evict_size=size)
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
    def preview_evict(self, size: int) -> List[str]:
        """Texts of the nodes ``evict(size)`` would take, in order (nothing is changed; ``[]`` if it would fail)."""
        try:
            order = predict_evict(self.history.last, size)
        except (ValueError, RuntimeError):
            return []
        nodes = self.history.last.by_uuid
        return [self.tokenizer.decode(list(nodes[u].tokens)) for u in order]

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
            + (" (" + ", ".join(_quote(h.text, 16) for h in self.locks) + ")" if self.locks else ""),
        ]
        return "\n".join(lines)

    def text(self) -> str:
        """The tree as deterministic text (`kvcache.viz.tree_text`)."""
        return tree_text(self.history.last, self.tokenizer)

    def graph(self, evict_preview: Optional[int] = None) -> Any:
        """The last snapshot drawn with `draw_tree`; ``evict_preview`` marks what ``evict(n)`` would take."""
        return draw_tree(self.history.last, self.tokenizer, evict_size=evict_preview or None,
                         title=self.history.last.caption, max_chars=28)

    @property
    def dot(self) -> str:
        """DOT source of what the tree pane shows now."""
        return self.graph(self._preview_size()).source

    def _preview_size(self) -> Optional[int]:
        w = self._widget
        if w is None or not w.preview.value:
            return None
        return int(w.evict_n.value)

    # ------------------------------------------------------------------------------- widget
    @property
    def widget(self) -> Any:
        """The ipywidgets view (built on first use)."""
        if self._widget is None:
            self._widget = _ExplorerWidget(self)
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
        w.status.value = ('<pre style="margin:0;line-height:1.35;white-space:pre-wrap">'
                          f"{html.escape(self.status())}</pre>")
        lines = self.log[-12:]
        w.log.value = ('<pre style="margin:0;line-height:1.35;white-space:pre-wrap">'
                       + html.escape("\n".join(lines) if lines else "(no events yet)") + "</pre>")

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)

    def __repr__(self) -> str:
        info = self.manager.size_info
        return (f"Explorer(page_size={self.page_size}, num_pages={self.allocator.num_pages}, "
                f"cached={info.total_size}, locks={len(self.locks)}, events={len(self.log)})")


class _ExplorerWidget:
    """The ipywidgets of an `Explorer`: inputs and buttons on top, state and tree below."""

    def __init__(self, ex: Explorer) -> None:
        import ipywidgets as W

        self.ex = ex
        self.text = W.Text(value=ex.presets[0][1] if ex.presets else "", description="request",
                           layout=W.Layout(width="100%"))
        self.preset = W.Dropdown(options=[("pick a preset request…", "")] + list(ex.presets),
                                 value="", description="preset", layout=W.Layout(width="100%"))
        self.preset.observe(self._on_preset, names="value")
        self.buttons = {}
        specs = [
            ("match", "match_prefix", "info", lambda: ex.match()),
            ("insert", "insert (serve)", "success", lambda: ex.insert()),
            ("lock", "lock", "primary", lambda: ex.lock()),
            ("unlock", "unlock", "", lambda: ex.unlock()),
            ("evict", "evict N", "danger", lambda: ex.evict()),
            ("reset", "reset", "warning", lambda: ex.reset()),
        ]
        for key, label, style, action in specs:
            b = W.Button(description=label, button_style=style, layout=W.Layout(width="auto"))
            b.on_click(lambda _b, act=action: act())
            self.buttons[key] = b
        self.evict_n = W.BoundedIntText(value=4, min=0, max=10**9, description="N",
                                        layout=W.Layout(width="9em"))
        self.preview = W.Checkbox(value=True, description="mark what evict N takes", indent=False)
        self.evict_n.observe(lambda _c: ex.refresh(), names="value")
        self.preview.observe(lambda _c: ex.refresh(), names="value")
        self.tree = W.HTML()
        self.status = W.HTML()
        self.log = W.HTML()
        row = W.HBox([*self.buttons.values(), self.evict_n, self.preview],
                     layout=W.Layout(flex_flow="row wrap", align_items="center"))
        info = W.HBox([W.VBox([W.HTML("<b>state</b>"), self.status], layout=W.Layout(width="50%")),
                       W.VBox([W.HTML("<b>event log</b>"), self.log], layout=W.Layout(width="50%"))])
        self.box = W.VBox([self.text, self.preset, row, info, self.tree])

    def _on_preset(self, change: Any) -> None:
        if change["new"]:
            self.text.value = change["new"]


# ============================================================================ step player
_PLAYER_CSS = """
.kvp{border:1px solid #9ca3af;border-radius:6px;padding:8px 10px;margin:0.5em 0;
  background:#ffffff;color:#1f2937;font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif}
.kvp-bar{display:flex;flex-wrap:wrap;gap:6px;align-items:center;margin-bottom:6px}
.kvp-bar button{font-size:14px;padding:2px 10px;border:1px solid #6b7280;border-radius:4px;
  background:#f3f4f6;color:#1f2937;cursor:pointer}
.kvp-bar button:disabled{opacity:0.4;cursor:default}
.kvp-bar input[type=range]{flex:1 1 160px}
.kvp-count{font-variant-numeric:tabular-nums;min-width:5em;text-align:right}
.kvp-caption{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:13px;
  margin:2px 0 6px 0;white-space:pre-wrap}
.kvp-frame[hidden]{display:none}
.kvp-frame svg{max-width:100%;height:auto}
"""

# One script per player; it finds its player by id, so several players can share a page.
_PLAYER_JS = """
(function () {
  var root = document.getElementById("%(id)s");
  if (!root || root.getAttribute("data-ready")) { return; }
  root.setAttribute("data-ready", "1");
  var frames = root.querySelectorAll(".kvp-frame");
  var n = frames.length, cur = 0, timer = null;
  var q = function (sel) { return root.querySelector(sel); };
  var prev = q(".kvp-prev"), next = q(".kvp-next"), play = q(".kvp-play"),
      first = q(".kvp-first"), last = q(".kvp-last"), range = q(".kvp-range"),
      count = q(".kvp-count"), caption = q(".kvp-caption");
  function show(i) {
    cur = Math.max(0, Math.min(n - 1, i));
    for (var j = 0; j < n; j++) { frames[j].hidden = (j !== cur); }
    caption.textContent = frames[cur].getAttribute("data-caption");
    count.textContent = (cur + 1) + " / " + n;
    range.value = String(cur);
    root.setAttribute("data-step", String(cur));
    prev.disabled = first.disabled = (cur === 0);
    next.disabled = last.disabled = (cur === n - 1);
  }
  function stop() {
    if (timer !== null) { clearInterval(timer); timer = null; }
    play.textContent = "\\u25B6 play";
    root.setAttribute("data-playing", "0");
  }
  function start() {
    if (cur === n - 1) { show(0); }
    play.textContent = "\\u275A\\u275A pause";
    root.setAttribute("data-playing", "1");
    timer = setInterval(function () {
      if (cur >= n - 1) { stop(); } else { show(cur + 1); }
    }, %(interval)d);
  }
  prev.addEventListener("click", function () { stop(); show(cur - 1); });
  next.addEventListener("click", function () { stop(); show(cur + 1); });
  first.addEventListener("click", function () { stop(); show(0); });
  last.addEventListener("click", function () { stop(); show(n - 1); });
  play.addEventListener("click", function () { if (timer === null) { start(); } else { stop(); } });
  range.addEventListener("input", function () { stop(); show(parseInt(range.value, 10)); });
  root.addEventListener("keydown", function (e) {
    if (e.key === "ArrowLeft") { stop(); show(cur - 1); e.preventDefault(); }
    if (e.key === "ArrowRight") { stop(); show(cur + 1); e.preventDefault(); }
  });
  show(0);
})();
"""


@dataclass(frozen=True)
class StepPlayer:
    """A self-contained HTML step player over pre-rendered trees (see `step_player`).

    ``captions[i]`` and ``svgs[i]`` describe step ``i``; ``html`` is the whole block (CSS,
    frames, controls, inline script). Jupyter shows it through ``_repr_html_``.
    """

    player_id: str
    captions: Tuple[str, ...]
    svgs: Tuple[str, ...]
    html: str

    @property
    def num_steps(self) -> int:
        return len(self.captions)

    def _repr_html_(self) -> str:
        return self.html

    def __repr__(self) -> str:
        return f"StepPlayer({self.num_steps} steps, id={self.player_id!r})"


def _snapshots_of(source: Any) -> Tuple[List[TreeSnapshot], Any]:
    if isinstance(source, Explorer):
        return list(source.history.snapshots), source.tokenizer
    if isinstance(source, TreeRecorder):
        return list(source.snapshots), source.decode
    snaps = list(source)
    if not all(isinstance(s, TreeSnapshot) for s in snaps):
        raise TypeError("expected an Explorer, a TreeRecorder or a sequence of TreeSnapshot")
    return snaps, None


def step_player(source: Union[Explorer, TreeRecorder, Sequence[TreeSnapshot]], decode: Any = None, *,
                title: str = "", player_id: Optional[str] = None, interval_ms: int = 1500,
                preview_evictions: bool = True, start: int = 0,
                render: Callable[[Any], str] = render_svg, **draw_kwargs: Any) -> StepPlayer:
    """Build a previous / next / play player over the snapshots of ``source``.

    Each snapshot is drawn with `draw_tree` (with ``preview_evictions``, a step followed by an
    ``evict(size)`` step marks the leaves that evict is about to take) and rendered to SVG by
    graphviz now, so the page needs nothing at view time. The page shows each step's caption
    above its tree and ``i / n`` beside the buttons; ``StepPlayer.captions`` reads
    ``"i / n · caption"``.
    ``start`` drops the first ``start`` snapshots (e.g. the initial empty tree).

    ``player_id`` (the HTML id) defaults to a hash of the captions and trees, so the same
    sequence gives the same HTML on every run. ``decode`` defaults to the recorder's or
    explorer's tokenizer. Extra keyword arguments go to `draw_tree`.
    """
    snaps, default_decode = _snapshots_of(source)
    snaps = snaps[start:]
    if not snaps:
        raise ValueError("nothing to play: no snapshots")
    if isinstance(interval_ms, bool) or not isinstance(interval_ms, int) or interval_ms < 50:
        raise ValueError(f"interval_ms must be an int >= 50, got {interval_ms!r}")
    decode = decode if decode is not None else default_decode
    n = len(snaps)
    draw_kwargs.setdefault("max_chars", 28)
    captions, svgs = [], []
    for i, snap in enumerate(snaps):
        upcoming = snaps[i + 1].evict_size if preview_evictions and i + 1 < n else None
        g = draw_tree(snap, decode, evict_size=upcoming, title="", **draw_kwargs)
        svgs.append(render(g))
        captions.append(f"{i + 1} / {n} · {snap.caption}")
    if player_id is None:
        digest = hashlib.sha1()
        for snap, cap in zip(snaps, captions):
            digest.update(cap.encode())
            digest.update(tree_text(snap, decode).encode())
            digest.update(b"\0")
        player_id = "kvp-" + digest.hexdigest()[:12]
    esc = html.escape
    frames = "".join(
        f'<div class="kvp-frame" data-step="{i}" data-caption="{esc(snap.caption)}"{"" if i == 0 else " hidden"}>'
        f"{svg}</div>\n"
        for i, (snap, svg) in enumerate(zip(snaps, svgs))
    )
    heading = f'<div class="kvp-title"><b>{esc(title)}</b></div>\n' if title else ""
    doc = (
        f'<div class="kvp" id="{player_id}" data-step="0" data-steps="{n}" tabindex="0">\n'
        f"<style>{_PLAYER_CSS}</style>\n{heading}"
        '<div class="kvp-bar">'
        '<button type="button" class="kvp-first" title="first step">&#x00AB; first</button>'
        '<button type="button" class="kvp-prev" title="previous step">&#x25C0; prev</button>'
        '<button type="button" class="kvp-play" title="play / pause">&#x25B6; play</button>'
        '<button type="button" class="kvp-next" title="next step">next &#x25B6;</button>'
        '<button type="button" class="kvp-last" title="last step">last &#x00BB;</button>'
        f'<input type="range" class="kvp-range" min="0" max="{n - 1}" value="0" aria-label="step">'
        f'<span class="kvp-count">1 / {n}</span></div>\n'
        f'<div class="kvp-caption">{esc(snaps[0].caption)}</div>\n'
        f"{frames}"
        f"<script>{_PLAYER_JS % {'id': player_id, 'interval': interval_ms}}</script>\n"
        "</div>\n"
    )
    return StepPlayer(player_id, tuple(captions), tuple(svgs), doc)
