"""Pictures of a `RadixCacheManager`: one visual language for every chapter of the book.

Three layers, each usable alone:

* **Snapshots.** `snapshot(manager)` freezes the tree into a `TreeSnapshot`: plain immutable
  `NodeSnapshot` records (uuid, parent, tokens, indices, ref count, timestamps, eviction
  priority). `TreeRecorder` wraps a manager, forwards its calls and keeps a snapshot after each
  one, captioned with the call and diffed against the one before: which nodes are new, which
  were split (the new prefix node and the old node that kept the suffix), which were evicted.
* **Prediction.** `predict_evict(tree, size)` names the leaves ``evict(size)`` would take, in
  order, without touching the manager: it replays the policy on the snapshot's bookkeeping.
* **Drawing.** `draw_tree` and `draw_sequence` return `graphviz.Digraph` objects (SVG inline in
  Jupyter and on the website); `tree_text` is the same tree as deterministic plain text.

Visual language (`PALETTE`): each node shows its tokens (text when a ``decode`` callable or a
tokenizer with ``.decode`` is given, ids otherwise; long keys shortened to head … tail with the
count), its KV slots as ranges (``4–9, 12``), its ref count and its age (``t``: the clock at the
last match or insert; FIFO trees also show ``in``, the insert time). Fill says the state:
blue with a bold border = protected (``ref_count > 0``), light grey = evictable, green = just
inserted; an orange border = just split; red dashed = about to be evicted; grey dashed with
grey text = a ghost of a node the last call evicted. Fills are pastel with dark text and the
background is transparent, so the pictures read in light and dark themes.
"""

from __future__ import annotations

import heapq
import html
import textwrap
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple, Union

import graphviz
import torch

from ..managers.radix import RadixCacheHandle, RadixCacheManager

__all__ = [
    "NodeSnapshot", "TreeSnapshot", "TreeRecorder", "snapshot", "diff_snapshots", "predict_evict",
    "format_indices", "format_tokens", "tree_text", "draw_tree", "draw_sequence", "PALETTE",
]

Decode = Callable[[List[int]], str]
DecodeLike = Union[Decode, Any, None]  # a callable, or an object with ``.decode(ids)``


# ----------------------------------------------------------------------------- snapshots
@dataclass(frozen=True)
class NodeSnapshot:
    """One tree node, frozen. ``parent`` is ``None`` for the root; ``children`` in insertion order.

    ``priority`` is the eviction policy's key for the node (smaller goes first), ``None`` for
    the root.
    """

    uuid: int
    parent: Optional[int]
    tokens: Tuple[int, ...]
    indices: Tuple[int, ...]
    ref_count: int
    timestamp: int
    insert_time: int
    priority: Optional[Tuple[Any, ...]]
    children: Tuple[int, ...]

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def is_leaf(self) -> bool:
        return not self.children

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class TreeSnapshot:
    """A whole tree at one moment, plus what the call that produced it changed.

    ``nodes`` holds the root first, then depth first with children in insertion order (the
    order of `RadixCacheManager.nodes`). ``new`` are uuids of nodes inserted by the call,
    ``split`` the prefix nodes a split created, ``shrunk`` the old nodes that kept the suffix,
    ``evicted`` the nodes the call removed (as they were before it). ``evict_size`` is set when
    the call was ``evict(evict_size)``, so a sequence can preview it on the snapshot before.
    """

    nodes: Tuple[NodeSnapshot, ...]
    page_size: int = 1
    eviction_policy: str = "lru"
    clock: int = 0
    evictable_size: int = 0
    protected_size: int = 0
    caption: str = ""
    new: FrozenSet[int] = frozenset()
    split: FrozenSet[int] = frozenset()
    shrunk: FrozenSet[int] = frozenset()
    evicted: Tuple[NodeSnapshot, ...] = ()
    evict_size: Optional[int] = None

    @cached_property
    def by_uuid(self) -> Dict[int, NodeSnapshot]:
        return {n.uuid: n for n in self.nodes}

    @property
    def root(self) -> NodeSnapshot:
        return self.nodes[0]

    @property
    def num_nodes(self) -> int:
        """Nodes other than the root."""
        return len(self.nodes) - 1

    def depths(self) -> Dict[int, int]:
        """Depth of every node (root 0) and of every evicted ghost (under its old parent)."""
        depth: Dict[int, int] = {}
        for n in self.nodes:
            depth[n.uuid] = 0 if n.parent is None else depth[n.parent] + 1
        for g in self.evicted:  # parents before children: evicted in the order they were found
            depth[g.uuid] = depth.get(g.parent, 0) + 1 if g.parent is not None else 1
        return depth


def _priority(manager: RadixCacheManager, node: Any) -> Tuple[Any, ...]:
    policy = getattr(manager, "_policy", None)
    if policy is not None:
        return tuple(policy.priority(node))
    return (node.timestamp, node.uuid)


def snapshot(manager: RadixCacheManager, caption: str = "", *,
             previous: Optional[TreeSnapshot] = None, evict_size: Optional[int] = None) -> TreeSnapshot:
    """Freeze ``manager``'s tree (any ``page_size``). Reads only: the manager is not changed.

    With ``previous``, the result also carries what changed since (see `diff_snapshots`).
    """
    nodes = []
    for node in manager.nodes():
        root = node.is_root()
        nodes.append(NodeSnapshot(
            uuid=node.uuid,
            parent=None if root else node.parent.uuid,
            tokens=tuple(node.key.tolist()),
            indices=tuple(node.value.tolist()),
            ref_count=node.ref_count,
            timestamp=node.timestamp,
            insert_time=node.insert_time,
            priority=None if root else _priority(manager, node),
            children=tuple(c.uuid for c in node.children.values()),
        ))
    info = manager.size_info
    snap = TreeSnapshot(
        nodes=tuple(nodes), page_size=manager.page_size, eviction_policy=manager.eviction_policy,
        clock=manager.clock, evictable_size=info.evictable_size, protected_size=info.protected_size,
        caption=caption, evict_size=evict_size,
    )
    return diff_snapshots(previous, snap) if previous is not None else snap


def diff_snapshots(before: TreeSnapshot, after: TreeSnapshot) -> TreeSnapshot:
    """``after`` with ``new``/``split``/``shrunk``/``evicted`` filled in by comparing with ``before``.

    A split keeps the old node as the suffix and creates a new prefix node, so: an old node
    whose key got shorter was split (``shrunk``); a new node with an old child is the split-off
    prefix (``split``); every other new node was inserted (``new``). Nodes of ``before`` missing
    from ``after`` were evicted (the roots are never counted).
    """
    old = before.by_uuid
    cur = after.by_uuid
    fresh = {u for u, n in cur.items() if u not in old and not n.is_root}
    split = frozenset(u for u in fresh if any(c in old for c in cur[u].children))
    shrunk = frozenset(u for u, n in cur.items() if u in old and n.length < old[u].length)
    evicted = tuple(n for n in before.nodes if n.uuid not in cur and not n.is_root)
    return replace(after, new=frozenset(fresh - split), split=split, shrunk=shrunk, evicted=evicted)


def _as_snapshot(tree: Union[RadixCacheManager, TreeSnapshot]) -> TreeSnapshot:
    if isinstance(tree, TreeSnapshot):
        return tree
    if isinstance(tree, TreeRecorder):
        return tree.snapshots[-1] if tree.snapshots else snapshot(tree.manager)
    if isinstance(tree, RadixCacheManager):
        return snapshot(tree)
    raise TypeError(f"expected a RadixCacheManager, TreeRecorder or TreeSnapshot, got {type(tree).__name__}")


# ---------------------------------------------------------------------------- prediction
def predict_evict(tree: Union[RadixCacheManager, TreeSnapshot], size: int) -> List[int]:
    """Uuids of the nodes ``evict(size)`` would remove, in the order it would remove them.

    Replays the manager's rule on a snapshot: pop the evictable leaf (``ref_count == 0``, no
    children, not the root) with the smallest policy priority until ``size`` tokens are freed; a
    parent left childless and unlocked becomes a candidate at once. The manager is not changed.
    Raises ``ValueError`` for a negative size and ``RuntimeError`` (like ``evict``) when more
    than the evictable size is asked for.
    """
    snap = _as_snapshot(tree)
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"size must be a non-negative int, got {size!r}")
    if size > snap.evictable_size:
        raise RuntimeError(f"cannot evict {size} tokens: only {snap.evictable_size} are evictable")
    nodes = snap.by_uuid
    live_children = {u: len(n.children) for u, n in nodes.items()}
    heap = [(n.priority, u) for u, n in nodes.items()
            if not n.is_root and n.ref_count == 0 and not n.children]
    heapq.heapify(heap)
    order: List[int] = []
    freed = 0
    while freed < size and heap:
        _, u = heapq.heappop(heap)
        order.append(u)
        freed += nodes[u].length
        parent = nodes[nodes[u].parent]  # type: ignore[index]
        live_children[parent.uuid] -= 1
        if not parent.is_root and parent.ref_count == 0 and live_children[parent.uuid] == 0:
            heapq.heappush(heap, (parent.priority, parent.uuid))
    return order


# ---------------------------------------------------------------------------- formatting
def _decoder(decode: DecodeLike) -> Optional[Decode]:
    if decode is None:
        return None
    method = getattr(decode, "decode", None)
    if callable(method):
        return lambda ids: method(list(ids))
    if callable(decode):
        return lambda ids: decode(list(ids))
    raise TypeError(f"decode must be a callable or have a .decode method, got {type(decode).__name__}")


def _one_line(text: str) -> str:
    return text.replace("\r", "\\r").replace("\n", "\\n").replace("\t", "\\t")


def _middle(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    head = max(1, (max_chars - 1) * 2 // 3)
    tail = max(1, max_chars - 1 - head)
    return text[:head] + "…" + text[-tail:]


def _shorten_tokens(tokens: Sequence[int], decode: DecodeLike, max_chars: int,
                    max_tokens: int = 64) -> Tuple[str, bool]:
    """``(text, shortened)``: see `format_tokens`."""
    dec = _decoder(decode)
    tokens = list(tokens)
    show = (lambda ids: _one_line(dec(ids))) if dec else (lambda ids: ", ".join(map(str, ids)))
    gap = "…" if dec else ", …, "
    if len(tokens) <= max_tokens:
        full = show(tokens)
        if len(full) <= max_chars:
            return full, False
    budget = max(2, max_chars - len(gap))
    head_budget = max(1, budget * 2 // 3)
    tail_budget = max(1, budget - head_budget)
    limit = min(len(tokens) - 1, max_tokens)
    k = 0
    while k < limit and len(show(tokens[:k + 1])) <= head_budget:
        k += 1
    j = 0
    while j < min(limit, len(tokens) - k - 1) and len(show(tokens[-(j + 1):])) <= tail_budget:
        j += 1
    head = show(tokens[:k]) if k else show(tokens[:1])[:head_budget]
    tail = show(tokens[-j:]) if j else show(tokens[-1:])[-tail_budget:]
    return head + gap + tail, True


def format_tokens(tokens: Sequence[int], decode: DecodeLike = None, *, max_chars: int = 24) -> str:
    """A key on one line: its text if ``decode`` is given, ``1, 2, 3`` otherwise.

    A key whose rendering is longer than ``max_chars`` keeps whole tokens from its start (about
    two thirds of the width) and its end around ``…`` (a single token too long is cut), so the
    result stays about ``max_chars`` wide; callers show the token count next to it. Control
    characters are escaped, so the result is one line.
    """
    return _shorten_tokens(tokens, decode, max_chars)[0]


def format_indices(indices: Sequence[int], max_runs: int = 4) -> str:
    """Slots as runs of consecutive values: ``[4, 5, 6, 7, 8, 9, 12]`` → ``4–9, 12``.

    More than ``max_runs`` runs keep the first ``max_runs - 1`` and the last around ``…``.
    An empty list gives ``""``.
    """
    runs: List[Tuple[int, int]] = []
    for v in indices:
        v = int(v)
        if runs and v == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], v)
        else:
            runs.append((v, v))
    parts = [str(a) if a == b else f"{a}–{b}" for a, b in runs]
    if len(parts) > max_runs:
        parts = parts[:max(1, max_runs - 1)] + ["…", parts[-1]]
    return ", ".join(parts)


def _age(node: NodeSnapshot, policy: str, sep: str) -> str:
    age = f"t{sep}{node.timestamp}"
    if policy == "fifo":
        age += f" in{sep}{node.insert_time}"
    return age


# ----------------------------------------------------------------------------- text form
def tree_text(tree: Union[RadixCacheManager, TreeSnapshot], decode: DecodeLike = None, *,
              max_chars: int = 40, evict_size: Optional[int] = None) -> str:
    """The tree as box-drawing text, one node a line, children in insertion order.

    Each line reads ``[tokens] → [slots] ref=R t=T`` (FIFO adds ``in=I``; tokens as in
    `format_tokens`, slots as in `format_indices`), then in one parenthesis: ``n tokens`` when
    the key was shortened, and what the last call did: ``new``, ``split``, and ``evict #k`` for
    the leaves ``evict(evict_size)`` would take. Deterministic: the same tree gives the same
    string, so notebooks can compare it.
    """
    snap = _as_snapshot(tree)
    order = _evict_order(snap, evict_size)
    lines = ["root"]

    def walk(uuid: int, prefix: str) -> None:
        kids = snap.by_uuid[uuid].children
        for i, child in enumerate(kids):
            last = i == len(kids) - 1
            n = snap.by_uuid[child]
            tokens, shortened = _shorten_tokens(n.tokens, decode, max_chars)
            text = f"[{tokens}] → [{format_indices(n.indices)}] ref={n.ref_count} {_age(n, snap.eviction_policy, '=')}"
            marks = ([f"{n.length} tokens"] if shortened else []) + _marks(snap, child, order)
            if marks:
                text += " (" + ", ".join(marks) + ")"
            lines.append(prefix + ("└── " if last else "├── ") + text)
            walk(child, prefix + ("    " if last else "│   "))

    walk(snap.root.uuid, "")
    return "\n".join(lines)


def _marks(snap: TreeSnapshot, uuid: int, order: Dict[int, int]) -> List[str]:
    marks = []
    if uuid in snap.new:
        marks.append("new")
    if uuid in snap.split or uuid in snap.shrunk:
        marks.append("split")
    if uuid in order:
        marks.append(f"evict #{order[uuid]}")
    return marks


def _evict_order(snap: TreeSnapshot, evict_size: Optional[int]) -> Dict[int, int]:
    """``{uuid: rank}`` of the leaves ``evict(evict_size)`` would take; empty if it would fail."""
    if not evict_size:
        return {}
    try:
        return {u: i + 1 for i, u in enumerate(predict_evict(snap, evict_size))}
    except RuntimeError:
        return {}


# ------------------------------------------------------------------------------- drawing
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
    text, shortened = _shorten_tokens(n.tokens, decode, max_chars)
    text = f"“{text}”" if decode is not None else f"[{text}]"
    small = font_size * 0.8
    meta_color = "#9ca3af" if ghost else "#4b5563"
    slots = (f"{n.length} tokens · " if shortened else "") + f"slots {format_indices(n.indices, 3)}"
    meta = "evicted" if ghost else f"ref {n.ref_count} · {_age(n, policy, ' ')}"
    if rank is not None:
        meta += f" · evict #{rank}"
    rows = [
        f'<TR><TD><FONT POINT-SIZE="{font_size:g}">{html.escape(text)}</FONT></TD></TR>',
        f'<TR><TD><FONT POINT-SIZE="{small:g}" COLOR="{meta_color}">{html.escape(slots)}</FONT></TD></TR>',
        f'<TR><TD><FONT POINT-SIZE="{small:g}" COLOR="{meta_color}">{html.escape(meta)}</FONT></TD></TR>',
    ]
    return '<<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="0" CELLPADDING="0">' + "".join(rows) + "</TABLE>>"


def _tooltip(n: NodeSnapshot, decode: DecodeLike) -> str:
    dec = _decoder(decode)
    tokens = _middle(_one_line(dec(list(n.tokens))) if dec else ", ".join(map(str, n.tokens)), 400)
    return (f"node {n.uuid}: {n.length} tokens [{tokens}] slots [{format_indices(n.indices, 10**9)}] "
            f"ref_count={n.ref_count} timestamp={n.timestamp} insert_time={n.insert_time}")


def _auto_rankdir(num_nodes: int, rankdir: str) -> str:
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


def _dfs(snap: TreeSnapshot, reverse: bool) -> List[NodeSnapshot]:
    if not reverse:
        return list(snap.nodes)
    out, stack = [], [snap.root.uuid]
    while stack:
        node = snap.by_uuid[stack.pop()]
        out.append(node)
        stack.extend(node.children)  # popped last-first: children reversed
    return out


def _add_tree(g: graphviz.Digraph, snap: TreeSnapshot, prefix: str, *, decode: DecodeLike,
              evict_size: Optional[int], max_chars: int, font_size: float,
              show_evicted: bool, reverse: bool = False) -> str:
    """Add ``snap``'s nodes (names ``{prefix}n{uuid}``) and edges to ``g``; return the root's name.

    Nodes and edges go in depth-first order, children in insertion order, or reversed with
    ``reverse`` (dot stacks the nodes of a cluster bottom-up in left-to-right layouts, so
    reversing keeps the first child on top).
    """
    order = _evict_order(snap, evict_size)
    root_name = f"{prefix}n{snap.root.uuid}"
    g.node(root_name, "root", shape="circle", fixedsize="true", width="0.36",
           fontsize=f"{font_size * 0.8:g}", style="filled", fontcolor=INK, **{
               k: v for k, v in PALETTE["root"].items()}, **{"class": "kv-root"})
    for n in _dfs(snap, reverse)[1:]:
        name = f"{prefix}n{n.uuid}"
        g.node(name, _label(n, snap.eviction_policy, decode, max_chars, order.get(n.uuid), font_size),
               tooltip=_tooltip(n, decode), **_style(_states(snap, n, order)))
        g.edge(f"{prefix}n{n.parent}", name)
    if show_evicted:
        known = set(snap.by_uuid) | {e.uuid for e in snap.evicted}
        for n in snap.evicted:
            name = f"{prefix}n{n.uuid}"
            g.node(name, _label(n, snap.eviction_policy, decode, max_chars, None, font_size, ghost=True),
                   tooltip="evicted " + _tooltip(n, decode), **_style(["evicted"]))
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


def draw_tree(tree: Union[RadixCacheManager, TreeSnapshot, "TreeRecorder"], decode: DecodeLike = None, *,
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
    snap = _as_snapshot(tree)
    direction = _auto_rankdir(snap.num_nodes, rankdir)
    g = _new_graph("radix_tree", direction, font_size)
    caption = title if title is not None else snap.caption
    if caption:
        g.attr(label=caption, labelloc="t", labeljust="l", fontcolor=EDGE)
    # No cluster around a single tree: inside one, dot's crossing minimisation loses the child
    # order on big left-to-right trees and tangles the edges of the third rank and beyond.
    _add_tree(g, snap, "", decode=decode, evict_size=evict_size, max_chars=max_chars,
              font_size=font_size, show_evicted=show_evicted)
    if legend:
        _add_legend(g, font_size, direction)
    return g


def draw_sequence(snapshots: Union[Sequence[TreeSnapshot], "TreeRecorder"], decode: DecodeLike = None, *,
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
    snaps = list(snapshots.snapshots if isinstance(snapshots, TreeRecorder) else snapshots)
    if per_row < 1:
        raise ValueError(f"per_row must be >= 1, got {per_row}")
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
        caption = "".join(line.replace("\\", "\\\\") + "\\l" for line in lines)  # left-justified lines
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


# ------------------------------------------------------------------------------ recorder
def _fmt_ids(ids: Any, decode: DecodeLike, width: int = 32) -> str:
    values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    dec = _decoder(decode)
    if dec is not None:
        return '"' + _middle(_one_line(dec(values)), width) + '"'
    return "[" + _middle(", ".join(map(str, values)), width) + "]"


@dataclass
class TreeRecorder:
    """Wraps a `RadixCacheManager`: forwards calls and keeps a captioned snapshot after each.

    ``match_prefix``, ``insert_prefix``, ``lock_handle`` and ``evict`` behave exactly as the
    manager's (same results, same exceptions); every other attribute is the manager's. A failed
    ``evict`` is recorded too (caption ``✗``) before the error propagates. ``on_event`` can be
    given to ``RequestFlow(on_event=...)`` to record the flow's steps instead; steps that leave
    the tree unchanged are skipped unless ``record_unchanged``.
    """

    manager: RadixCacheManager
    decode: DecodeLike = None
    record_initial: bool = True
    record_unchanged: bool = False
    snapshots: List[TreeSnapshot] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.manager, RadixCacheManager):
            raise TypeError(f"manager must be a RadixCacheManager, got {type(self.manager).__name__}")
        if self.record_initial and not self.snapshots:
            self.record("empty tree" if self.manager.num_nodes == 0 else "start")

    def __getattr__(self, name: str) -> Any:  # only called for names the recorder lacks
        if name == "manager":
            raise AttributeError(name)
        return getattr(self.manager, name)

    def record(self, caption: str, *, evict_size: Optional[int] = None) -> TreeSnapshot:
        """Snapshot the tree now, diffed against the last snapshot, and keep it."""
        prev = self.snapshots[-1] if self.snapshots else None
        snap = snapshot(self.manager, caption, previous=prev, evict_size=evict_size)
        self.snapshots.append(snap)
        return snap

    @property
    def last(self) -> TreeSnapshot:
        return self.snapshots[-1]

    def match_prefix(self, input_ids: torch.Tensor) -> Tuple[RadixCacheHandle, torch.Tensor]:
        handle, indices = self.manager.match_prefix(input_ids)
        self.record(f"match_prefix({_fmt_ids(input_ids, self.decode)}) → cached_len={handle.cached_len}")
        return handle, indices

    def insert_prefix(self, input_ids: torch.Tensor, indices: torch.Tensor) -> int:
        already = self.manager.insert_prefix(input_ids, indices)
        self.record(f"insert_prefix({_fmt_ids(input_ids, self.decode)}, "
                    f"[{format_indices(indices.tolist())}]) → {already}")
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
            self.record(f"evict({size}) ✗ {_middle(str(e), 60)}", evict_size=size)
            raise
        self.record(f"evict({size}) → [{format_indices(out.tolist())}]", evict_size=size)
        return out

    def on_event(self, event: Any) -> None:
        """Record a `FlowEvent` (``rid``, ``step``, ``name``, ``detail``) from a `RequestFlow`."""
        caption = f"req {event.rid} · step {event.step} {event.name}: {event.detail}"
        if event.step == 0:
            caption = f"req {event.rid} · {event.name}: {event.detail}"
        prev = self.snapshots[-1] if self.snapshots else None
        snap = snapshot(self.manager, _middle(caption, 90), previous=prev)
        if prev is None or self.record_unchanged or snap.nodes != prev.nodes:
            self.snapshots.append(snap)

    def draw(self, **kwargs: Any) -> graphviz.Digraph:
        """`draw_sequence` of everything recorded, decoded with this recorder's ``decode``."""
        kwargs.setdefault("decode", self.decode)
        return draw_sequence(self.snapshots, **kwargs)

    def text(self, **kwargs: Any) -> str:
        """`tree_text` of every snapshot, each under its caption."""
        kwargs.setdefault("decode", self.decode)
        return "\n\n".join(f"{i + 1}. {s.caption}\n{tree_text(s, **kwargs)}" for i, s in enumerate(self.snapshots))
