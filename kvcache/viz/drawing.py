"""Graphviz drawings of a radix tree: `draw_tree`, `draw_sequence` and the `PALETTE` they share.

Both return a `TreeFigure`, a `graphviz.Digraph` shown as inline SVG in Jupyter and on the
website; nothing is laid out until a caller renders one. One visual language for every chapter
of the book (its font, colours and key live in `kvcache.viz.style`):

Each node shows its tokens (text when a ``decode`` callable or a tokenizer with ``.decode`` is
given, ids otherwise; long keys shortened to head … tail with the count), its KV slots as ranges
(``4–9, 12``), its ref count and its age (``t``: the clock at the last match or insert; FIFO
trees also show ``in``, the insert time). Fill says the state: blue with a bold border =
protected (``ref_count > 0``), light grey = evictable, green = just inserted; an orange border =
just split; red dashed = about to be evicted; grey dashed with grey text = a ghost of a node the
last call evicted. Every figure carries a compact colour key of the states it shows, and all its
text is set in one font, `FONT`, which the set-up installs and the website serves, so the text
fits the boxes graphviz sized for it. Fills are pastel with dark text and the background is transparent, so the
pictures read in light and dark themes. Every string a caller supplies (token text, titles,
captions) reaches graphviz escaped for its place, so it is drawn as written: never read as DOT
syntax, an HTML label, an entity or an escape such as ``\\N``.
"""

from __future__ import annotations

import html
import numbers
from typing import Dict, Iterable, List, Optional, Set, Tuple

import graphviz

from .._validate import check_positive_int, check_size
from .snapshot import NodeSnapshot, Tree, TreeSnapshot, as_snapshot, evict_order, snapshot_list
from .style import (EDGE, FONT, GHOST_INK, INK, META_INK, PALETTE, grid_rows, key_label, node_style, text_width,
                    tree_extent, wrap)
from .text import DecodeLike, age_text, as_decoder, format_indices, one_line, shorten_middle, shorten_tokens

__all__ = ["PALETTE", "FONT", "TreeFigure", "draw_tree", "draw_sequence"]

_MARGIN_PT = 5.0  # a node's inner margin each side (0.07 in), as `_new_graph` sets it


class TreeFigure(graphviz.Digraph):
    """A `graphviz.Digraph` that Jupyter (and the website) shows as inline SVG.

    Its rich display carries the SVG twice: as ``image/svg+xml`` (for tools that want an
    image) and as ``text/html``, the ``<svg>`` element inline in ``<div class="kv-figure">``,
    which the website prefers. Inline, the page's stylesheet reaches the SVG's text, so it is
    drawn with the font graphviz measured (`FONT`, served by the site); an ``<img>`` could not
    load it.
    """

    def _repr_mimebundle_(self, include: Optional[Iterable[str]] = None,
                          exclude: Optional[Iterable[str]] = None, **_: object) -> Dict[str, str]:
        svg = self.pipe(format="svg", encoding="utf-8")
        start = svg.find("<svg")
        inline = svg[start:].strip() if start >= 0 else svg
        bundle = {"image/svg+xml": svg, "text/html": f'<div class="kv-figure">{inline}</div>'}
        if include is not None:
            bundle = {k: v for k, v in bundle.items() if k in set(include)}
        if exclude is not None:
            bundle = {k: v for k, v in bundle.items() if k not in set(exclude)}
        return bundle


def _states(snap: TreeSnapshot, n: NodeSnapshot, order: Dict[int, int]) -> List[str]:
    states = ["protected" if n.ref_count > 0 else "evictable"]
    if n.uuid in snap.new:
        states.append("inserted")
    if n.uuid in snap.split or n.uuid in snap.shrunk:
        states.append("split")
    if n.uuid in order:
        states.append("evict")
    return states


def _label(n: NodeSnapshot, policy: str, decode: DecodeLike, max_chars: int,
           rank: Optional[int], font_size: float, ghost: bool = False) -> Tuple[str, float]:
    """``(label, width)``: three lines (the tokens, ``[n tokens · ]slots …``,
    ``ref R · t T[ · evict #k]``) as an HTML-like label, and the box's width in points."""
    text, shortened = shorten_tokens(n.tokens, decode, max_chars)
    text = f"“{text}”" if decode is not None else f"[{text}]"
    small = font_size * 0.8
    meta_color = GHOST_INK if ghost else META_INK
    slots = (f"{n.length} tokens · " if shortened else "") + f"slots {format_indices(n.indices, 3)}"
    meta = "evicted" if ghost else f"ref {n.ref_count} · {age_text(n, policy, ' ')}"
    if rank is not None:
        meta += f" · evict #{rank}"
    rows = [
        f'<TR><TD><FONT POINT-SIZE="{font_size:g}">{_html_text(text)}</FONT></TD></TR>',
        f'<TR><TD><FONT POINT-SIZE="{small:g}" COLOR="{meta_color}">{_html_text(slots)}</FONT></TD></TR>',
        f'<TR><TD><FONT POINT-SIZE="{small:g}" COLOR="{meta_color}">{_html_text(meta)}</FONT></TD></TR>',
    ]
    width = max(text_width(one_line(text), font_size), text_width(slots, small), text_width(meta, small))
    label = '<<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="0" CELLPADDING="0">' + "".join(rows) + "</TABLE>>"
    return label, width + 2 * _MARGIN_PT + 3


def _dot_text(text: str) -> str:
    """``text`` as a plain (never HTML) DOT string that graphviz shows as written.

    Backslashes are doubled (graphviz expands ``\\N``, ``\\G``, ``\\l`` in labels and
    tooltips, and a final backslash would end the quoted string early), ``&`` becomes ``&amp;``
    (graphviz decodes entities in plain labels too), control characters are escaped
    (`one_line`); line breaks are kept.
    """
    lines = (one_line(line).replace("\\", "\\\\").replace("&", "&amp;") for line in text.split("\n"))
    return graphviz.nohtml("\n".join(lines))


def _html_text(text: str) -> str:
    """``text`` for a cell of an HTML-like label: entities escaped, and backslashes doubled
    (graphviz expands ``\\N`` and friends inside HTML labels as well)."""
    return html.escape(one_line(text)).replace("\\", "\\\\")


def _tooltip(n: NodeSnapshot, decode: DecodeLike) -> str:
    dec = as_decoder(decode)
    tokens = shorten_middle(one_line(dec(list(n.tokens))) if dec else ", ".join(map(str, n.tokens)), 400)
    return (f"node {n.uuid}: {n.length} tokens [{tokens}] slots [{format_indices(n.indices, 10**9)}] "
            f"ref_count={n.ref_count} timestamp={n.timestamp} insert_time={n.insert_time}")


def _auto_rankdir(num_nodes: int, rankdir: str) -> str:
    if not isinstance(rankdir, str):
        raise TypeError(f"rankdir must be a str, got {type(rankdir).__name__}")
    if rankdir == "auto":
        return "LR" if num_nodes > 15 else "TB"
    if rankdir not in ("TB", "LR"):
        raise ValueError(f"rankdir must be 'auto', 'TB' or 'LR', got {rankdir!r}")
    return rankdir


def _new_graph(name: str, rankdir: str, font_size: float) -> TreeFigure:
    g = TreeFigure(name)
    compact = rankdir == "LR"
    # outputorder: edges first, so a node is always drawn over any edge that passes under it.
    g.attr(rankdir=rankdir, bgcolor="transparent", fontname=FONT, fontsize=f"{font_size:g}",
           nodesep="0.08" if compact else "0.18", ranksep="0.22" if compact else "0.3",
           margin="0.05", newrank="true", ordering="out", outputorder="edgesfirst")
    g.attr("node", shape="box", fontname=FONT, fontsize=f"{font_size:g}", margin="0.07,0.03",
           height="0.2", width="0.3")
    g.attr("edge", color=EDGE, arrowsize="0.5", penwidth="1.2", fontname=FONT)
    return g


def _add_tree(g: graphviz.Digraph, snap: TreeSnapshot, prefix: str, *, decode: DecodeLike,
              evict_size: Optional[int], max_chars: int, font_size: float,
              show_evicted: bool, reverse: bool = False) -> Tuple[str, Set[str], Dict[int, float]]:
    """Add ``snap``'s nodes (names ``{prefix}n{uuid}``) and edges to ``g``.

    Returns the root's name, the states drawn (the colour key's entries) and each node's box
    width in points. Nodes and edges go in depth-first order, children in insertion order, or
    reversed with ``reverse`` (dot stacks the nodes of a cluster bottom-up in left-to-right
    layouts, so reversing keeps the first child on top).
    """
    order = evict_order(snap, evict_size)
    root_name = f"{prefix}n{snap.root.uuid}"
    g.node(root_name, "root", shape="circle", fixedsize="true", width="0.36",
           fontsize=f"{font_size * 0.8:g}", style="filled", fontcolor=INK, **{
               k: v for k, v in PALETTE["root"].items()}, **{"class": "kv-root"})
    used: Set[str] = set()
    widths: Dict[int, float] = {snap.root.uuid: 26.0}
    for n in snap.preorder(reverse)[1:]:
        name = f"{prefix}n{n.uuid}"
        states = _states(snap, n, order)
        used.update(states)
        label, widths[n.uuid] = _label(n, snap.eviction_policy, decode, max_chars, order.get(n.uuid), font_size)
        g.node(name, label, tooltip=_dot_text(_tooltip(n, decode)), **node_style(states))
        g.edge(f"{prefix}n{n.parent}", name)
    if show_evicted and snap.evicted:
        used.add("evicted")
        known = set(snap.by_uuid) | {e.uuid for e in snap.evicted}
        for n in snap.evicted:
            name = f"{prefix}n{n.uuid}"
            label, widths[n.uuid] = _label(n, snap.eviction_policy, decode, max_chars, None, font_size,
                                           ghost=True)
            g.node(name, label, tooltip=_dot_text("evicted " + _tooltip(n, decode)), **node_style(["evicted"]))
            parent = f"{prefix}n{n.parent}" if n.parent in known else root_name
            g.edge(parent, name, style="dashed", color=PALETTE["evicted"]["color"])
    return root_name, used, widths


def _check_style(decode: DecodeLike, rankdir: str, max_chars: int, font_size: float) -> None:
    as_decoder(decode)
    _auto_rankdir(0, rankdir)
    check_positive_int(max_chars, "max_chars")
    if isinstance(font_size, bool) or not isinstance(font_size, numbers.Real):
        raise TypeError(f"font_size must be a number, got {type(font_size).__name__}")
    if not 0 < font_size < 1000:
        raise ValueError(f"font_size must be in (0, 1000), got {font_size}")


def _check_width(value: float, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of points, got {type(value).__name__}")
    if not 50 <= value <= 100_000:
        raise ValueError(f"{name} must be in [50, 100000] points, got {value}")


def draw_tree(tree: Tree, decode: DecodeLike = None, *,
              evict_size: Optional[int] = None, legend: bool = True, rankdir: str = "auto",
              max_chars: int = 24, font_size: float = 10,
              show_evicted: bool = True, title: Optional[str] = None,
              title_width: float = 420) -> TreeFigure:
    """Draw one tree; returns a `TreeFigure` (a `graphviz.Digraph`; inline SVG in Jupyter).

    One graphviz node per tree node, named ``n{uuid}``, with an edge from each parent to each
    child. ``evict_size`` marks (red, dashed, ``evict #k``) the leaves ``evict(evict_size)``
    would take next, computed on a snapshot (the manager is not touched); when that evict would
    fail, nothing is marked. ``rankdir="auto"`` lays small trees top-down and trees of more
    than 15 nodes left-to-right, which keeps big trees legible at page width. ``title`` (or a
    snapshot's caption), wrapped to ``title_width`` points, and with ``legend`` a colour key of
    the states that appear in this tree, are drawn in a box above it. All text is in `FONT`.
    """
    snap = as_snapshot(tree)
    _check_style(decode, rankdir, max_chars, font_size)
    if evict_size is not None:
        check_size(evict_size, "evict_size")
    if title is not None and not isinstance(title, str):
        raise TypeError(f"title must be a str or None, got {type(title).__name__}")
    _check_width(title_width, "title_width")
    direction = _auto_rankdir(snap.num_nodes, rankdir)
    g = _new_graph("radix_tree", direction, font_size)
    caption = title if title is not None else snap.caption
    # No cluster around a single tree: inside one, dot's crossing minimisation loses the child
    # order on big left-to-right trees and tangles the edges of the third rank and beyond.
    _, used, _ = _add_tree(g, snap, "", decode=decode, evict_size=evict_size, max_chars=max_chars,
                           font_size=font_size, show_evicted=show_evicted)
    lines = _wrapped(caption, title_width, font_size) if caption else []
    label = key_label(used if legend else (), font_size, lines)
    if label:
        g.attr(label=label, labelloc="t", labeljust="l")
    return g


def _wrapped(text: str, width: float, font_size: float) -> List[str]:
    """``text``'s lines (its own line breaks kept), each wrapped to ``width`` points (`wrap`)."""
    return [piece for line in text.split("\n") for piece in wrap(one_line(line), width, font_size)]


def _panel_grid(n: int, per_row: int, sizes: List[Tuple[float, float]], max_width: float,
                rankdir: str) -> List[List[int]]:
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
            width = sum(max(sizes[j][0] for j in row) for row in rows) + _PANEL_GAP * (len(rows) - 1)
        if width <= max_width or k == 1:
            return rows
    return []  # unreachable: k == 1 returns


_PANEL_GAP = 14.0  # points between panels (nodesep plus the clusters' borders)
_PANEL_PAD = 16.0  # a panel's margin, both sides
_MIN_CAPTION = 130.0  # a panel's caption is wrapped to at least this many points


def draw_sequence(snapshots: Iterable[TreeSnapshot], decode: DecodeLike = None, *,
                  per_row: int = 3, legend: bool = True, preview_evictions: bool = True,
                  rankdir: str = "auto", max_chars: int = 20,
                  font_size: float = 10, show_evicted: bool = True,
                  caption_width: int = 34, max_width: float = 600) -> TreeFigure:
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
    that evict is about to take.
    """
    snaps = snapshot_list(snapshots)
    _check_style(decode, rankdir, max_chars, font_size)
    check_positive_int(per_row, "per_row")
    check_positive_int(caption_width, "caption_width")
    _check_width(max_width, "max_width")
    biggest = max((s.num_nodes for s in snaps), default=0)
    direction = _auto_rankdir(biggest, rankdir)
    g = _new_graph("radix_sequence", direction, font_size)
    cap_size = font_size * 0.9
    cap_limit = text_width("n" * caption_width, cap_size)
    scratch = graphviz.Digraph()  # measure every panel first: the grid decides the emit order
    used_all: Set[str] = set()
    sizes: List[Tuple[float, float]] = []
    for i, snap in enumerate(snaps):
        upcoming = snaps[i + 1].evict_size if preview_evictions and i + 1 < len(snaps) else None
        _, used, widths = _add_tree(scratch, snap, "", decode=decode, evict_size=upcoming, max_chars=max_chars,
                                    font_size=font_size, show_evicted=show_evicted)
        used_all |= used
        w, h = tree_extent(snap, widths, font_size, direction, show_evicted)
        sizes.append((max(w, _MIN_CAPTION) + _PANEL_PAD, h))
    rows = _panel_grid(len(snaps), per_row, sizes, max_width, direction)
    captions: List[List[str]] = []
    for i, snap in enumerate(snaps):
        width = min(max(sizes[i][0] - _PANEL_PAD, _MIN_CAPTION), max(cap_limit, _MIN_CAPTION))
        captions.append(_wrapped(f"{i + 1}. {snap.caption}", width, cap_size))
    for row in rows:  # captions of a row as tall as its tallest, so the panels' tops line up
        tallest = max(len(captions[i]) for i in row)
        for i in row:
            captions[i] += [""] * (tallest - len(captions[i]))
    roots: Dict[int, str] = {}
    depths: Dict[int, int] = {}
    panels = list(enumerate(snaps))
    # dot stacks clusters bottom-up in left-to-right layouts: emit them last first there.
    for i, snap in (panels if direction == "TB" else panels[::-1]):
        upcoming = snaps[i + 1].evict_size if preview_evictions and i + 1 < len(snaps) else None
        caption = graphviz.nohtml("".join(_dot_text(line) + "\\l" for line in captions[i]))  # left-justified
        with g.subgraph(name=f"cluster_{i}") as c:
            c.attr(label=caption, labeljust="l", labelloc="t", fontsize=f"{cap_size:g}",
                   fontcolor=INK, style="rounded,filled", fillcolor="#f8fafc", color="#d1d5db", margin="8")
            roots[i], _, _ = _add_tree(c, snap, f"s{i}", decode=decode, evict_size=upcoming,
                                       max_chars=max_chars, font_size=font_size,
                                       show_evicted=show_evicted, reverse=direction == "LR")
        depths[i] = max(d for u, d in snap.depths().items() if show_evicted or u in snap.by_uuid)
    for row in rows:  # panels of a row side by side, in order
        with g.subgraph() as same:
            same.attr(rank="same")
            for i in row:
                same.node(roots[i])
        chain = row if direction == "TB" else row[::-1]  # LR stacks a same-rank chain upwards
        for a, b in zip(chain, chain[1:]):
            g.edge(roots[a], roots[b], style="invis")
    for above, below in zip(rows, rows[1:]):  # the next row starts below the deepest panel
        g.edge(roots[above[0]], roots[below[0]], style="invis",
               minlen=str(max(depths[i] for i in above) + 2))
    label = key_label(used_all if legend else (), font_size)
    if label:
        g.attr(label=label, labelloc="t", labeljust="l")
    return g
