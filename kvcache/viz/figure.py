"""Numbered, captioned figures: the HTML a notebook output holds and the website shows.

Every picture of the book is a ``<figure class="kv-figure kv-{kind}">``: the picture in a
``<div class="kv-figure-body">`` and a ``<figcaption class="kv-caption">`` that says what it
shows and what to look at. The book's build (``book/_ext/kv_figures.py``) numbers them with
the chapter's figures ("Figure 17.2") and puts the number at the start of the caption; a cell
names a figure in its metadata so that the text can refer to it by number. `figure_html` builds that block (for the tree figures of
`kvcache.viz.drawing` and the step player), `captioned` wraps a matplotlib figure in it, and
`tree_caption` / `look_for` write the default caption of a tree from the states it draws.
"""

from __future__ import annotations

import base64
import html
import io
import re
from collections.abc import Iterable
from typing import Any

from .._validate import check_positive_int
from .snapshot import TreeSnapshot
from .style import LEGEND_TEXT
from .text import one_line

__all__ = ["figure_html", "captioned", "CaptionedPlot", "tree_caption", "look_for"]

_CSS_NAME = re.compile(r"[a-z][a-z0-9-]*")


def figure_html(body: str, caption: str, kind: str = "tree") -> str:
    """``<figure class="kv-figure kv-{kind}">``: ``body`` (HTML, inserted as is) in a
    ``<div class="kv-figure-body">``, then ``caption`` (plain text, escaped) as its
    ``<figcaption>``. The book's build numbers these figures per chapter ("Figure 17.2").

    ``kind`` names a CSS class: lower-case letters, digits and ``-``, starting with a letter
    (``ValueError`` naming it otherwise, so nothing unescaped reaches the attribute)."""
    if not isinstance(kind, str) or not _CSS_NAME.fullmatch(kind):
        raise ValueError(
            f"kind must be a CSS class name ([a-z][a-z0-9-]*, as 'tree' or 'plot'), got {kind!r}"
        )
    text = html.escape(one_line(caption)) if caption else ""
    cap = f'<figcaption class="kv-caption">{text}</figcaption>' if text else ""
    return (
        f'<figure class="kv-figure kv-{kind}"><div class="kv-figure-body">{body}</div>'
        f"{cap}</figure>"
    )


class CaptionedPlot:
    """A matplotlib figure as a numbered, captioned figure (see `captioned`)."""

    def __init__(self, png: bytes, caption: str):
        self.png, self.caption = png, caption

    def _repr_mimebundle_(
        self, include: object = None, exclude: object = None, **_: object
    ) -> dict[str, str]:
        data = base64.b64encode(self.png).decode("ascii")
        alt = html.escape(one_line(self.caption), quote=True)
        img = f'<img src="data:image/png;base64,{data}" alt="{alt}">'
        return {"image/png": data, "text/html": figure_html(img, self.caption, "plot")}

    def __repr__(self) -> str:
        return f"CaptionedPlot({self.caption!r})"


def captioned(fig: Any, caption: str, dpi: int = 100) -> CaptionedPlot:
    """A matplotlib figure ``fig`` as a PNG with a caption that says what to look at.

    Shown as the last value of a cell (instead of ``plt.show()``), it displays as a
    ``<figure>`` with a ``<figcaption>``, numbered in the book like the tree figures. The
    figure is closed, so Jupyter does not show it a second time. ``TypeError`` for a ``fig``
    without ``savefig`` or a ``caption`` that is not a ``str``; ``ValueError`` for an empty one.
    """
    savefig = getattr(fig, "savefig", None)
    if not callable(savefig):
        raise TypeError(f"fig must be a matplotlib Figure, got {type(fig).__name__}")
    if not isinstance(caption, str):
        raise TypeError(f"caption must be a str, got {type(caption).__name__}")
    if not caption.strip():
        raise ValueError("caption must say what the figure shows, got an empty string")
    check_positive_int(dpi, "dpi")
    buf = io.BytesIO()
    savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    import matplotlib.pyplot as plt  # only here: drawing trees needs no matplotlib

    plt.close(fig)
    return CaptionedPlot(buf.getvalue(), caption)


def tree_caption(snap: TreeSnapshot, used: set[str], evict_size: int | None) -> str:
    """What a tree figure shows and what to look at, from the states it draws."""
    tokens = sum(n.length for n in snap.nodes[1:])
    head = f"After {snap.caption}: the" if snap.caption else "The"
    plural = "" if snap.num_nodes == 1 else "s"
    text = f"{head} radix tree, {snap.num_nodes} node{plural} holding {tokens} cached tokens."
    return " ".join([text, *look_for(used, evict_size)])


def look_for(used: Iterable[str], evict_size: int | None = None) -> list[str]:
    """One sentence a state drawn (in `LEGEND_TEXT` order): what its colour tells the reader."""
    hints = {
        "protected": "Blue nodes are in use by a running request: evict cannot take them.",
        "evictable": "Grey nodes are held by no request (ref 0): evict may free them, leaves first.",
        "evict": f"Red dashed nodes are what evict({evict_size if evict_size is not None else 'size'}) takes next.",
        "inserted": "Green nodes were just inserted.",
        "split": "An orange border marks a node that was just split.",
        "evicted": "Grey dashed ghosts were just evicted.",
    }
    wanted = set(used)
    return [hints[k] for k in LEGEND_TEXT if k in wanted and k in hints]
