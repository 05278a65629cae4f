"""Graphviz drawings of a radix tree: `draw_tree`, `draw_sequence` and the `PALETTE` they share.

Both return `graphviz.Digraph` objects (SVG inline in Jupyter and on the website); nothing is
laid out until a caller renders one. One visual language for every chapter of the book:

Each node shows its tokens (text when a ``decode`` callable or a tokenizer with ``.decode`` is
given, ids otherwise; long keys shortened to head … tail with the count), its KV slots as ranges
(``4–9, 12``), its ref count and its age (``t``: the clock at the last match or insert; FIFO
trees also show ``in``, the insert time). Fill says the state: blue with a bold border =
protected (``ref_count > 0``), light grey = evictable, green = just inserted; an orange border =
just split; red dashed = about to be evicted; grey dashed with grey text = a ghost of a node the
last call evicted. Fills are pastel with dark text and the background is transparent, so the
pictures read in light and dark themes. Every string a caller supplies (token text, titles,
captions) reaches graphviz escaped for its place, so it is drawn as written: never read as DOT
syntax, an HTML label, an entity or an escape such as ``\\N``.
"""

from __future__ import annotations

import html
import numbers
import textwrap
from typing import Dict, Iterable, List, Optional, Sequence

import graphviz

from .._validate import check_positive_int, check_size
from .snapshot import NodeSnapshot, Tree, TreeSnapshot, as_snapshot, evict_order, snapshot_list
from .text import DecodeLike, age_text, as_decoder, format_indices, one_line, shorten_middle, shorten_tokens

__all__ = ["PALETTE", "draw_tree", "draw_sequence"]

FONT = "Helvetica,Arial,sans-serif"
INK = "#1f2937"  # dark text on every (pastel) fill
EDGE = "#8b95a5"  # mid grey: visible on light and dark pages

#: Node styles by state; `draw_tree` combines them (fill from the state, border from the flags).
PALETTE: Dict[str, Dict[str, str]] = {
    "evictable": {"fillcolor": "#f3f4f6", "color": "#6b7280", "penwidth": "1"},
    "protected": {"fillcolor": "#cfe0fc", "color": "#1d4ed8", "penwidth": "2.4"},
    "inserted": {"fillcolor": "#c7efcf", "color": "#15803d", "penwidth": "1.4"},
    "split": {"color": "#ea580c", "penwidth": "3"},
    "evict": {"fillcolor": "#fde0e0", "color": "#dc2626", "penwidth": "2.4", "style": "rounded,filled,dashed"},
    "evicted": {"fillcolor": "#f9fafb", "color": "#9ca3af", "fontcolor": "#9ca3af", "penwidth": "1.2",
                "style": "rounded,filled,dashed"},
    "root": {"fillcolor": "#e5e7eb", "color": "#6b7280", "penwidth": "1"},
}

_LEGEND = (
    ("protected", ("protected",), "protected\nref > 0"),
    ("evictable", ("evictable",), "evictable\nref = 0"),
    ("inserted", ("evictable", "inserted"), "just\ninserted"),
    ("split", ("evictable", "split"), "just\nsplit"),
    ("evict", ("evictable", "evict"), "evicted\nnext"),
    ("evicted", ("evicted",), "evicted\n(ghost)"),
)


def _style(states: Sequence[str]) -> Dict[str, str]:
    """Attributes for a node in ``states`` (later states override earlier ones)."""
    attrs = {"style": "rounded,filled", "fontcolor": INK}
    for s in states:
        attrs.update(PALETTE[s])
    if "protected" in states and "inserted" in states:  # keep the protected border on a green fill
        attrs.update(color=PALETTE["protected"]["color"], penwidth=PALETTE["protected"]["penwidth"])
    if "split" in states:
        attrs.update(PALETTE["split"])
    attrs["class"] = " ".join(f"kv-{s}" for s in states)
    return attrs


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
           rank: Optional[int], font_size: float, ghost: bool = False) -> str:
    """Three lines: the tokens, ``[n tokens · ]slots …``, ``ref R · t T[ · evict #k]``."""
    text, shortened = shorten_tokens(n.tokens, decode, max_chars)
    text = f"“{text}”" if decode is not None else f"[{text}]"
    small = font_size * 0.8
    meta_color = "#9ca3af" if ghost else "#4b5563"
    slots = (f"{n.length} tokens · " if shortened else "") + f"slots {format_indices(n.indices, 3)}"
    meta = "evicted" if ghost else f"ref {n.ref_count} · {age_text(n, policy, ' ')}"
    if rank is not None:
        meta += f" · evict #{rank}"
    rows = [
        f'<TR><TD><FONT POINT-SIZE="{font_size:g}">{_html_text(text)}</FONT></TD></TR>',
        f'<TR><TD><FONT POINT-SIZE="{small:g}" COLOR="{meta_color}">{_html_text(slots)}</FONT></TD></TR>',
        f'<TR><TD><FONT POINT-SIZE="{small:g}" COLOR="{meta_color}">{_html_text(meta)}</FONT></TD></TR>',
    ]
    return '<<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="0" CELLPADDING="0">' + "".join(rows) + "</TABLE>>"


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


def _new_graph(name: str, rankdir: str, font_size: float) -> graphviz.Digraph:
    g = graphviz.Digraph(name)
    compact = rankdir == "LR"
    g.attr(rankdir=rankdir, bgcolor="transparent", fontname=FONT, fontsize=f"{font_size:g}",
           nodesep="0.08" if compact else "0.18", ranksep="0.22" if compact else "0.3",
           margin="0.05", newrank="true", ordering="out")
    g.attr("node", shape="box", fontname=FONT, fontsize=f"{font_size:g}", margin="0.07,0.03",
           height="0.2", width="0.3")
    g.attr("edge", color=EDGE, arrowsize="0.5", penwidth="1.2")
    return g


def _add_tree(g: graphviz.Digraph, snap: TreeSnapshot, prefix: str, *, decode: DecodeLike,
              evict_size: Optional[int], max_chars: int, font_size: float,
              show_evicted: bool, reverse: bool = False) -> str:
    """Add ``snap``'s nodes (names ``{prefix}n{uuid}``) and edges to ``g``; return the root's name.

    Nodes and edges go in depth-first order, children in insertion order, or reversed with
    ``reverse`` (dot stacks the nodes of a cluster bottom-up in left-to-right layouts, so
    reversing keeps the first child on top).
    """
    order = evict_order(snap, evict_size)
    root_name = f"{prefix}n{snap.root.uuid}"
    g.node(root_name, "root", shape="circle", fixedsize="true", width="0.36",
           fontsize=f"{font_size * 0.8:g}", style="filled", fontcolor=INK, **{
               k: v for k, v in PALETTE["root"].items()}, **{"class": "kv-root"})
    for n in snap.preorder(reverse)[1:]:
        name = f"{prefix}n{n.uuid}"
        g.node(name, _label(n, snap.eviction_policy, decode, max_chars, order.get(n.uuid), font_size),
               tooltip=_dot_text(_tooltip(n, decode)), **_style(_states(snap, n, order)))
        g.edge(f"{prefix}n{n.parent}", name)
    if show_evicted:
        known = set(snap.by_uuid) | {e.uuid for e in snap.evicted}
        for n in snap.evicted:
            name = f"{prefix}n{n.uuid}"
            g.node(name, _label(n, snap.eviction_policy, decode, max_chars, None, font_size, ghost=True),
                   tooltip=_dot_text("evicted " + _tooltip(n, decode)), **_style(["evicted"]))
            parent = f"{prefix}n{n.parent}" if n.parent in known else root_name
            g.edge(parent, name, style="dashed", color=PALETTE["evicted"]["color"])
    return root_name


def _add_legend(g: graphviz.Digraph, font_size: float, rankdir: str, prefix: str = "legend_") -> None:
    """A boxed row (TB) or column (LR) of sample nodes, one per state, in the real styles."""
    with g.subgraph(name="cluster_legend") as c:
        c.attr(label="legend", fontsize=f"{font_size * 0.8:g}", fontcolor=INK, style="rounded,filled",
               fillcolor="#ffffff", color="#d1d5db", margin="6")
        names = []
        for key, states, text in _LEGEND:
            name = f"{prefix}{key}"
            attrs = _style(states)
            c.node(name, text, fontsize=f"{font_size * 0.8:g}", **attrs)
            names.append(name)
        with c.subgraph() as row:
            row.attr(rank="same")
            for name in names:
                row.node(name)
        chain = names if rankdir == "TB" else names[::-1]  # LR stacks a same-rank chain upwards
        for a, b in zip(chain, chain[1:]):
            c.edge(a, b, style="invis")


def _check_style(decode: DecodeLike, rankdir: str, max_chars: int, font_size: float) -> None:
    as_decoder(decode)
    _auto_rankdir(0, rankdir)
    check_positive_int(max_chars, "max_chars")
    if isinstance(font_size, bool) or not isinstance(font_size, numbers.Real):
        raise TypeError(f"font_size must be a number, got {type(font_size).__name__}")
    if not 0 < font_size < 1000:
        raise ValueError(f"font_size must be in (0, 1000), got {font_size}")


def draw_tree(tree: Tree, decode: DecodeLike = None, *,
              evict_size: Optional[int] = None, legend: bool = False, rankdir: str = "auto",
              max_chars: int = 24, font_size: float = 10,
              show_evicted: bool = True, title: Optional[str] = None) -> graphviz.Digraph:
    """Draw one tree; returns a `graphviz.Digraph` (renders as SVG in Jupyter).

    One graphviz node per tree node, named ``n{uuid}``, with an edge from each parent to each
    child. ``evict_size`` marks (red, dashed, ``evict #k``) the leaves ``evict(evict_size)``
    would take next, computed on a snapshot (the manager is not touched); when that evict would
    fail, nothing is marked. ``rankdir="auto"`` lays small trees top-down and trees of more
    than 15 nodes left-to-right, which keeps big trees legible at page width. ``title`` (or a
    snapshot's caption) is drawn above the tree.
    """
    snap = as_snapshot(tree)
    _check_style(decode, rankdir, max_chars, font_size)
    if evict_size is not None:
        check_size(evict_size, "evict_size")
    if title is not None and not isinstance(title, str):
        raise TypeError(f"title must be a str or None, got {type(title).__name__}")
    direction = _auto_rankdir(snap.num_nodes, rankdir)
    g = _new_graph("radix_tree", direction, font_size)
    caption = title if title is not None else snap.caption
    if caption:
        g.attr(label=_dot_text(caption), labelloc="t", labeljust="l", fontcolor=EDGE)
    # No cluster around a single tree: inside one, dot's crossing minimisation loses the child
    # order on big left-to-right trees and tangles the edges of the third rank and beyond.
    _add_tree(g, snap, "", decode=decode, evict_size=evict_size, max_chars=max_chars,
              font_size=font_size, show_evicted=show_evicted)
    if legend:
        _add_legend(g, font_size, direction)
    return g


def draw_sequence(snapshots: Iterable[TreeSnapshot], decode: DecodeLike = None, *,
                  per_row: int = 3, legend: bool = True, preview_evictions: bool = True,
                  rankdir: str = "auto", max_chars: int = 20,
                  font_size: float = 10, show_evicted: bool = True,
                  caption_width: int = 34) -> graphviz.Digraph:
    """Draw snapshots as numbered, captioned panels in one `graphviz.Digraph`.

    Each snapshot is a cluster ``cluster_{i}`` labelled ``"{i+1}. {caption}"`` (wrapped at
    ``caption_width`` characters), its nodes named ``s{i}n{uuid}``. Top-down trees run left to
    right, ``per_row`` panels a row, then wrap; left-to-right trees (``rankdir="LR"``, or auto
    for panels of more than 15 nodes) stack top to bottom, ``per_row`` panels a column. With
    ``preview_evictions``, a panel followed by an ``evict(size)`` panel marks the leaves that
    evict is about to take.
    """
    snaps = snapshot_list(snapshots)
    _check_style(decode, rankdir, max_chars, font_size)
    check_positive_int(per_row, "per_row")
    check_positive_int(caption_width, "caption_width")
    biggest = max((s.num_nodes for s in snaps), default=0)
    direction = _auto_rankdir(biggest, rankdir)
    g = _new_graph("radix_sequence", direction, font_size)
    roots: Dict[int, str] = {}
    depths: Dict[int, int] = {}
    panels = list(enumerate(snaps))
    # dot stacks clusters bottom-up in left-to-right layouts: emit them last first there.
    for i, snap in (panels if direction == "TB" else panels[::-1]):
        upcoming = snaps[i + 1].evict_size if preview_evictions and i + 1 < len(snaps) else None
        lines = textwrap.wrap(f"{i + 1}. {snap.caption}", caption_width) or [f"{i + 1}."]
        caption = graphviz.nohtml("".join(_dot_text(line) + "\\l" for line in lines))  # left-justified
        with g.subgraph(name=f"cluster_{i}") as c:
            c.attr(label=caption, labeljust="l", labelloc="t", fontsize=f"{font_size * 0.9:g}",
                   fontcolor=INK, style="rounded,filled", fillcolor="#f8fafc", color="#d1d5db", margin="8")
            roots[i] = _add_tree(c, snap, f"s{i}", decode=decode, evict_size=upcoming,
                                 max_chars=max_chars, font_size=font_size,
                                 show_evicted=show_evicted, reverse=direction == "LR")
        depths[i] = max(d for u, d in snap.depths().items() if show_evicted or u in snap.by_uuid)
    rows = [list(range(i, min(i + per_row, len(snaps)))) for i in range(0, len(snaps), per_row)]
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
    if legend:
        _add_legend(g, font_size, direction)
    return g
