"""The static step player: recorded trees as one self-contained HTML block for the website.

`step_player` renders a recorded sequence of snapshots (a `TreeRecorder`, an `Explorer`'s
history, or a list of `TreeSnapshot`) to SVG with graphviz once, at execution time, and wraps
them in one HTML block with previous / next / play buttons driven by an inline script: no
server, no network, no external file at view time. The player's stylesheet and script are the
package data files ``static/player.css`` and ``static/player.js``; the script's two
placeholders, ``__PLAYER_ID__`` and ``__INTERVAL_MS__``, are filled with a JSON string literal
and an integer.

Everything a caller supplies is escaped for the context it lands in: captions and the title are
html-escaped (text and attribute values), the player id must match ``[A-Za-z][A-Za-z0-9_-]*``
and is also JSON-encoded (with ``<``, ``>`` and ``&`` as ``\\u`` escapes) inside the script,
and token text reaches the SVG only through graphviz, html-escaped in its labels.

The HTML is deterministic apart from the SVG documents themselves (whose coordinates follow the
machine's fonts), so a notebook that stores it compares equal on re-run once SVG documents are
masked.
"""

from __future__ import annotations

import hashlib
import html
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any, Protocol, runtime_checkable

from .._validate import check_size
from .drawing import draw_tree
from .figure import figure_html
from .recorder import TreeRecorder
from .snapshot import TreeSnapshot, snapshot_list
from .text import DecodeLike, as_decoder, tree_text

__all__ = ["StepPlayer", "step_player", "render_svg", "PLAYER_ID_PATTERN"]

#: What a ``player_id`` must match: it becomes an HTML id and a string in the player's script.
PLAYER_ID_PATTERN = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")

_JS_UNSAFE = {
    "<": "\\u003c",
    ">": "\\u003e",
    "&": "\\u0026",
    "\u2028": "\\u2028",
    "\u2029": "\\u2029",
}


def render_svg(graph: Any) -> str:
    """The SVG element of a `graphviz.Digraph`, without the XML prolog, doctype and comments.

    Only ``<svg ...>...</svg>`` is kept, so the text around it does not depend on the graphviz
    version, and the element can be inlined in HTML.
    """
    pipe = getattr(graph, "pipe", None)
    if not callable(pipe):
        raise TypeError(f"graph must be a graphviz graph, got {type(graph).__name__}")
    svg: str = pipe(format="svg").decode("utf-8")  # graphviz is untyped: pipe() gives bytes
    start = svg.find("<svg")
    if start < 0:
        raise ValueError("graphviz produced no <svg> element")
    return svg[start:].strip()


@cache
def _static(name: str) -> str:
    """A file of the package's ``static`` folder, as text."""
    return resources.files(__package__).joinpath("static", name).read_text(encoding="utf-8")


def js_string(text: str) -> str:
    """``text`` as a JavaScript string literal that is also safe inside an HTML ``<script>``."""
    return "".join(_JS_UNSAFE.get(ch, ch) for ch in json.dumps(text))


@dataclass(frozen=True)
class StepPlayer:
    """A self-contained HTML step player over pre-rendered trees (see `step_player`).

    ``captions[i]`` and ``svgs[i]`` describe step ``i``; ``html`` is the whole block (CSS,
    frames, controls, inline script). Jupyter and the website show it inside a captioned
    ``<figure>`` (``_repr_mimebundle_``); ``_repr_html_`` is the bare block.
    """

    player_id: str
    captions: tuple[str, ...]
    svgs: tuple[str, ...]
    html: str

    @property
    def num_steps(self) -> int:
        return len(self.captions)

    @property
    def caption(self) -> str:
        """The figure caption a page shows under the player: how to use it, what to watch."""
        return (
            f"A step player over {self.num_steps} recorded calls: step with the buttons, the "
            "slider or the arrow keys (once the player has focus). Each step's caption names "
            "the call; watch which nodes change colour from one step to the next (the key is "
            "drawn in every frame)."
        )

    def _repr_html_(self) -> str:
        return self.html

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        """What Jupyter and the website show: ``html`` in a numbered, captioned
        ``<figure class="kv-figure kv-player">`` (`kvcache.viz.figure.figure_html`)."""
        return {"text/html": figure_html(self.html, self.caption, "player")}

    def __repr__(self) -> str:
        return f"StepPlayer({self.num_steps} steps, id={self.player_id!r})"


@runtime_checkable
class Recorded(Protocol):
    """Something that keeps its own `TreeRecorder` as ``history`` (an `Explorer` does)."""

    history: TreeRecorder


def _snapshots_of(source: Any) -> tuple[list[TreeSnapshot], DecodeLike]:
    if not isinstance(source, TreeRecorder) and isinstance(source, Recorded):
        source = source.history
    if isinstance(source, TreeRecorder):
        return list(source.snapshots), source.decode
    return snapshot_list(source, "source"), None


def _check_player_id(player_id: Any) -> str:
    if not isinstance(player_id, str):
        raise TypeError(f"player_id must be a str, got {type(player_id).__name__}")
    if not PLAYER_ID_PATTERN.fullmatch(player_id):
        raise ValueError(
            f"player_id must match {PLAYER_ID_PATTERN.pattern} (an HTML id), got {player_id!r}"
        )
    return player_id


def step_player(
    source: Recorded | TreeRecorder | Sequence[TreeSnapshot],
    decode: DecodeLike = None,
    *,
    title: str = "",
    player_id: str | None = None,
    interval_ms: int = 1500,
    preview_evictions: bool = True,
    start: int = 0,
    render: Callable[[Any], str] = render_svg,
    **draw_kwargs: Any,
) -> StepPlayer:
    """Build a previous / next / play player over the snapshots of ``source``.

    Each snapshot is drawn with `draw_tree` (with ``preview_evictions``, a step followed by an
    ``evict(size)`` step marks the leaves that evict is about to take) and rendered to SVG by
    graphviz now, so the page needs nothing at view time. The page shows each step's caption
    above its tree and ``i / n`` beside the buttons; ``StepPlayer.captions`` reads
    ``"i / n · caption"``.
    ``start`` drops the first ``start`` snapshots (e.g. the initial empty tree).

    ``player_id`` (the HTML id) defaults to a hash of the captions and trees, so the same
    sequence gives the same HTML on every run; a given one must match `PLAYER_ID_PATTERN`
    (``ValueError`` otherwise). ``decode`` defaults to the recorder's or explorer's tokenizer.
    Extra keyword arguments go to `draw_tree`. Wrong types raise ``TypeError`` naming the
    argument, before anything is drawn.
    """
    snaps, default_decode = _snapshots_of(source)
    check_size(start, "start")
    snaps = snaps[start:]
    if not snaps:
        raise ValueError("nothing to play: no snapshots")
    if isinstance(interval_ms, bool) or not isinstance(interval_ms, int):
        raise TypeError(f"interval_ms must be an int, got {type(interval_ms).__name__}")
    if interval_ms < 50:
        raise ValueError(f"interval_ms must be an int >= 50, got {interval_ms!r}")
    if not isinstance(title, str):
        raise TypeError(f"title must be a str, got {type(title).__name__}")
    if player_id is not None:
        _check_player_id(player_id)
    if not callable(render):
        raise TypeError(f"render must be callable, got {type(render).__name__}")
    as_decoder(decode)
    decode = decode if decode is not None else default_decode
    n = len(snaps)
    draw_kwargs.setdefault("max_chars", 28)
    captions, svgs = [], []
    for i, snap in enumerate(snaps):
        upcoming = snaps[i + 1].evict_size if preview_evictions and i + 1 < n else None
        svg = render(draw_tree(snap, decode, evict_size=upcoming, title="", **draw_kwargs))
        if not isinstance(svg, str):
            raise TypeError(f"render must return a str, got {type(svg).__name__}")
        svgs.append(svg)
        captions.append(f"{i + 1} / {n} · {snap.caption}")
    if player_id is None:
        digest = hashlib.sha1()
        for snap, cap in zip(snaps, captions, strict=True):
            digest.update(cap.encode("utf-8", "surrogatepass"))
            digest.update(tree_text(snap, decode).encode("utf-8", "surrogatepass"))
            digest.update(b"\0")
        player_id = "kvp-" + digest.hexdigest()[:12]
    return StepPlayer(
        player_id,
        tuple(captions),
        tuple(svgs),
        _player_html(player_id, snaps, svgs, title, interval_ms),
    )


def _player_html(
    player_id: str, snaps: list[TreeSnapshot], svgs: list[str], title: str, interval_ms: int
) -> str:
    """The player's HTML block; every caller-supplied string is escaped for where it lands."""
    esc = html.escape  # quotes included: safe in text and in double-quoted attribute values
    n = len(snaps)
    frames = "".join(
        f'<div class="kvp-frame" data-step="{i}" data-caption="{esc(snap.caption)}"{"" if i == 0 else " hidden"}>'
        f"{svg}</div>\n"
        for i, (snap, svg) in enumerate(zip(snaps, svgs, strict=True))
    )
    heading = f'<div class="kvp-title"><b>{esc(title)}</b></div>\n' if title else ""
    values = {"PLAYER_ID": js_string(player_id), "INTERVAL_MS": str(int(interval_ms))}
    script = re.sub(
        r"__(PLAYER_ID|INTERVAL_MS)__", lambda m: values[m.group(1)], _static("player.js")
    )
    return (
        f'<div class="kvp" id="{esc(player_id)}" data-step="0" data-steps="{n}" tabindex="0">\n'
        f"<style>\n{_static('player.css')}</style>\n{heading}"
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
        f"<script>\n{script}</script>\n"
        "</div>\n"
    )
