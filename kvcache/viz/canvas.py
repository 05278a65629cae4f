"""The canvas the book's diagrams are drawn on (`kvcache.viz.diagrams`): a matplotlib figure in
inches shown as SVG inside a numbered, captioned ``<figure>``, and the few primitives (text, box,
arrow) every diagram uses, in the book's font and ink."""

from __future__ import annotations

import io
from typing import Any

import matplotlib
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch
from matplotlib.text import Text

from .figure import figure_html
from .style import FONT, INK

__all__ = ["DiagramFigure", "FS", "arrow", "box", "canvas", "put_text"]

FS = 11.0  # points: labels; titles are larger, notes smaller (never below 9)


class DiagramFigure(Figure):
    """A matplotlib figure shown as SVG (text as paths, no date: same bytes each run), in a
    numbered ``<figure>`` whose ``caption`` says what to look at (`figure_html`)."""

    caption: str = ""

    def _repr_svg_(self) -> str:
        buf = io.StringIO()
        with matplotlib.rc_context({"svg.fonttype": "path", "svg.hashsalt": "kvcache"}):
            self.savefig(buf, format="svg", metadata={"Date": None}, facecolor="white")
        return buf.getvalue()

    def _repr_mimebundle_(self, include: object = None, exclude: object = None) -> dict[str, str]:
        svg = self._repr_svg_()
        body = svg[svg.find("<svg") :]
        return {"image/svg+xml": svg, "text/html": figure_html(body, self.caption, "diagram")}

    def labels(self) -> list[str]:
        """Every text drawn in the figure, in drawing order (what the tests read)."""
        return [t.get_text() for t in self.findobj(Text) if t.get_text()]


def canvas(width: float, height: float, caption: str) -> tuple[DiagramFigure, Axes]:
    """A figure ``width`` x ``height`` inches whose one axes is in inches, y growing downwards."""
    fig = DiagramFigure(figsize=(width, height), dpi=100)
    fig.caption = caption
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)
    ax.set_axis_off()
    return fig, ax


def put_text(
    ax: Axes, x: float, y: float, s: str, size: float = FS, color: str = INK, **kw: Any
) -> Text:
    kw.setdefault("ha", "center")
    kw.setdefault("va", "center")
    kw.setdefault("parse_math", False)  # text is drawn as written: "$5" is not mathtext
    return ax.text(x, y, s, fontsize=size, color=color, family=FONT, **kw)


def box(
    ax: Axes,
    x: float,
    y: float,
    w: float,
    h: float,
    fill: str,
    edge: str,
    lw: float = 1.0,
    rounded: float = 0.0,
) -> None:
    """A rectangle (rounded corners of ``rounded`` inches) at ``(x, y)``, ``w`` x ``h`` inches."""
    style = f"round,pad=0,rounding_size={rounded}" if rounded else "square,pad=0"
    patch = FancyBboxPatch((x, y), w, h, boxstyle=style, facecolor=fill, edgecolor=edge, lw=lw)
    ax.add_patch(patch)


def arrow(ax: Axes, x_from: float, x_to: float, y: float, colour: str, solid: bool) -> None:
    ax.annotate(
        "",
        xy=(x_to, y),
        xytext=(x_from, y),
        arrowprops={
            "arrowstyle": "-|>",
            "color": colour,
            "lw": 1.3,
            "ls": "-" if solid else (0, (3, 2)),
            "shrinkA": 0,
            "shrinkB": 1,
        },
    )
