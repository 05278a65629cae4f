"""`draw_sequence`: snapshots of a tree as numbered, captioned panels in one figure.

The panels use `kvcache.viz.drawing`'s node drawing and key, laid out in an even grid
(`kvcache.viz.style.grid_rows`) with each caption wrapped to its panel's width.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import pairwise

import graphviz

from .._validate import check_positive_int
from .drawing import (
    TreeFigure,
    add_tree,
    auto_rankdir,
    check_style,
    check_width,
    dot_text,
    new_graph,
    wrap_lines,
)
from .figure import look_for
from .snapshot import TreeSnapshot, snapshot_list
from .style import INK, grid_rows, key_label, text_width, tree_extent
from .text import DecodeLike

__all__ = ["draw_sequence"]


def _panel_grid(
    n: int, per_row: int, sizes: list[tuple[float, float]], max_width: float, rankdir: str
) -> list[list[int]]:
    """Panels ``0..n-1`` in rows (TB) or stacks (LR), as even as `grid_rows` makes them, with
    as many a row as fit in ``max_width`` points (at least one)."""
    for k in range(per_row, 0, -1):
        counts = grid_rows(n, k)
        rows, i = [], 0
        for c in counts:
            rows.append(list(range(i, i + c)))
            i += c
        if rankdir == "TB":
            width = max(sum(sizes[j][0] for j in row) + _PANEL_GAP * (len(row) - 1) for row in rows)
        else:
            width = sum(max(sizes[j][0] for j in row) for row in rows) + _PANEL_GAP * (
                len(rows) - 1
            )
        if width <= max_width or k == 1:
            return rows
    return []  # unreachable: k == 1 returns


_PANEL_GAP = 14.0  # points between panels (nodesep plus the clusters' borders)
_PANEL_PAD = 16.0  # a panel's margin, both sides
_MIN_CAPTION = 130.0  # a panel's caption is wrapped to at least this many points


def draw_sequence(
    snapshots: Iterable[TreeSnapshot],
    decode: DecodeLike = None,
    *,
    per_row: int = 3,
    legend: bool = True,
    preview_evictions: bool = True,
    rankdir: str = "auto",
    max_chars: int = 20,
    font_size: float = 10,
    show_evicted: bool = True,
    caption_width: int = 34,
    max_width: float = 600,
    title: str | None = None,
) -> TreeFigure:
    """Draw snapshots as numbered, captioned panels in one `TreeFigure` (a `graphviz.Digraph`).

    Each snapshot is a cluster ``cluster_{i}`` labelled ``"{i+1}. {caption}"``, its nodes named
    ``s{i}n{uuid}``. The caption is wrapped to its panel's width (the tree's estimated width,
    at least 130 points, and at most ``caption_width`` characters of about an average width),
    so it never spills into the next panel. Panels sit in an even grid (`grid_rows`): top-down
    trees run left to right, at most ``per_row`` a row and no more than fit in ``max_width``
    points, with rows of equal size (or one less) and never a last panel alone; left-to-right
    trees (``rankdir="LR"``, or auto for panels of more than 15 nodes) stack top to bottom the
    same way. With ``legend``, a colour key of the states the panels show is drawn above them.
    With ``preview_evictions``, a panel followed by an ``evict(size)`` panel marks the leaves
    that evict is about to take. ``title`` is the figure's caption on a page (`TreeFigure`);
    without one, the caption says how to read the panels and what their colours mark.
    """
    snaps = snapshot_list(snapshots)
    check_style(decode, rankdir, max_chars, font_size)
    check_positive_int(per_row, "per_row")
    check_positive_int(caption_width, "caption_width")
    check_width(max_width, "max_width")
    if title is not None and not isinstance(title, str):
        raise TypeError(f"title must be a str or None, got {type(title).__name__}")
    biggest = max((s.num_nodes for s in snaps), default=0)
    direction = auto_rankdir(biggest, rankdir)
    g = new_graph("radix_sequence", direction, font_size)
    cap_size = font_size * 0.9
    cap_limit = caption_width * text_width("n", cap_size)  # no string of caption_width chars
    scratch = graphviz.Digraph()  # measure every panel first: the grid decides the emit order
    used_all: set[str] = set()
    sizes: list[tuple[float, float]] = []
    for i, snap in enumerate(snaps):
        upcoming = snaps[i + 1].evict_size if preview_evictions and i + 1 < len(snaps) else None
        _, used, widths = add_tree(
            scratch,
            snap,
            "",
            decode=decode,
            evict_size=upcoming,
            max_chars=max_chars,
            font_size=font_size,
            show_evicted=show_evicted,
        )
        used_all |= used
        w, h = tree_extent(snap, widths, font_size, direction, show_evicted)
        sizes.append((max(w, _MIN_CAPTION) + _PANEL_PAD, h))
    rows = _panel_grid(len(snaps), per_row, sizes, max_width, direction)
    captions: list[list[str]] = []
    for i, snap in enumerate(snaps):
        width = min(max(sizes[i][0] - _PANEL_PAD, _MIN_CAPTION), max(cap_limit, _MIN_CAPTION))
        captions.append(wrap_lines(f"{i + 1}. {snap.caption}", width, cap_size))
    for row in rows:  # captions of a row as tall as its tallest, so the panels' tops line up
        tallest = max(len(captions[i]) for i in row)
        for i in row:
            captions[i] += [""] * (tallest - len(captions[i]))
    roots: dict[int, str] = {}
    depths: dict[int, int] = {}
    panels = list(enumerate(snaps))
    # dot stacks clusters bottom-up in left-to-right layouts: emit them last first there.
    for i, snap in panels if direction == "TB" else panels[::-1]:
        upcoming = snaps[i + 1].evict_size if preview_evictions and i + 1 < len(snaps) else None
        caption = graphviz.nohtml(
            "".join(dot_text(line) + "\\l" for line in captions[i])
        )  # left-justified
        with g.subgraph(name=f"cluster_{i}") as c:
            c.attr(
                label=caption,
                labeljust="l",
                labelloc="t",
                fontsize=f"{cap_size:g}",
                fontcolor=INK,
                style="rounded,filled",
                fillcolor="#f8fafc",
                color="#d1d5db",
                margin="8",
            )
            roots[i], _, _ = add_tree(
                c,
                snap,
                f"s{i}",
                decode=decode,
                evict_size=upcoming,
                max_chars=max_chars,
                font_size=font_size,
                show_evicted=show_evicted,
                reverse=direction == "LR",
            )
        depths[i] = max(d for u, d in snap.depths().items() if show_evicted or u in snap.by_uuid)
    for row in rows:  # panels of a row side by side, in order
        with g.subgraph() as same:
            same.attr(rank="same")
            for i in row:
                same.node(roots[i])
        chain = row if direction == "TB" else row[::-1]  # LR stacks a same-rank chain upwards
        for a, b in pairwise(chain):
            g.edge(roots[a], roots[b], style="invis")
    for above, below in pairwise(rows):  # the next row starts below the deepest panel
        g.edge(
            roots[above[0]],
            roots[below[0]],
            style="invis",
            minlen=str(max(depths[i] for i in above) + 2),
        )
    label = key_label(used_all if legend else (), font_size)
    if label:
        g.attr(label=label, labelloc="t", labeljust="l")
    g.caption = title if title else _sequence_caption(len(snaps), direction, used_all)
    return g


def _sequence_caption(n: int, direction: str, used: set[str]) -> str:
    """How to read a sequence of ``n`` panels, and what their colours mark."""
    if n == 1:
        return " ".join(["One panel: the tree after the call its caption names.", *look_for(used)])
    order = "left to right, row by row" if direction == "TB" else "top to bottom, column by column"
    return " ".join(
        [
            f"{n} panels, numbered in order ({order}): each is the tree after the call its "
            "caption names; compare a panel with the one before it.",
            *look_for(used),
        ]
    )
