"""Diagrams drawn by code for the book's storage chapters: memory layout, TP heads, request steps.

Three matplotlib figures in the book's style (its font `FONT`, ink and palette from
`kvcache.viz.style`), each built from the package itself rather than drawn by hand:

- `draw_pool_layout`: the pool's buffer in LayerFirst and PageFirst, one cell per page of one
  layer, in memory order read off real (``meta``-device) `MHAKVCache` views, with bars under the
  cells of one layer and of one page: a bar is a contiguous run of bytes.
- `draw_tp_heads`: query heads grouped on their KV head, the groups split over TP ranks as
  `MHAKVCache` splits them (`divide_even`: a TP size that does not divide the KV heads is refused).
- `draw_request_steps`: the seven steps of one request as a sequence diagram between the
  caller, `RequestFlow`, the manager, the `PageAllocator` and the pool; given a request's traced
  `FlowEvent` list it prints what each step found under its arrow.

Each returns a `DiagramFigure`: a matplotlib ``Figure`` (no pyplot state) shown as SVG, text as
paths; the smallest text stays about 8 px high when a figure is shown 420 px wide.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from matplotlib.patches import Circle

from .._validate import check_int_in
from ..serving.request_flow import FlowEvent
from ..storage.base import KVCacheLayout
from ..storage.distributed import divide_even
from ..storage.mha_pool import MHAKVCache
from .canvas import FS, DiagramFigure, arrow, box, canvas, put_text
from .style import EDGE, INK, META_INK, PALETTE

__all__ = [
    "DiagramFigure",
    "REQUEST_STEPS",
    "draw_pool_layout",
    "draw_request_steps",
    "draw_tp_heads",
    "pool_block_order",
]

#: Fill and border of the n-th layer / KV head: the tree figures' state colours, in turn.
SERIES = [
    (PALETTE[k]["fillcolor"], PALETTE[k]["color"])
    for k in ("protected", "inserted", "evict", "evictable")
]


def _runs(positions: Sequence[int]) -> list[tuple[int, int]]:
    """Maximal runs ``(first, last)`` of consecutive integers in sorted ``positions``."""
    runs: list[tuple[int, int]] = []
    for p in sorted(positions):
        if runs and p == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], p)
        else:
            runs.append((p, p))
    return runs


# ------------------------------------------------------------------------------ pool layout
def pool_block_order(
    layout: KVCacheLayout, num_layers: int, num_pages: int
) -> list[tuple[int, int, int]]:
    """``(kv, layer, page)`` (``kv``: 0 = K, 1 = V) of each block of a pool's buffer, in memory order.

    A block is one page of one layer, ``page_size * heads * head_dim`` contiguous elements; the
    order is read off the storage offsets of ``k_cache(l)[p]`` / ``v_cache(l)[p]`` of a real
    `MHAKVCache` on the ``meta`` device.
    """
    if not isinstance(layout, KVCacheLayout):
        raise TypeError(f"layout must be a KVCacheLayout, got {type(layout).__name__}")
    pool = MHAKVCache(1, num_layers, 1, num_pages, torch.float32, layout, "meta")
    where = {}
    for layer in range(num_layers):
        for kv, view in enumerate((pool.k_cache(layer), pool.v_cache(layer))):
            for page in range(num_pages):
                where[view[page].storage_offset()] = (kv, layer, page)
    return [where[o] for o in sorted(where)]


def draw_pool_layout(
    num_layers: int = 2, num_pages: int = 3, layer: int = 1, page: int = 1
) -> DiagramFigure:
    """The buffer of a pool in both layouts, one cell per page of one layer, in memory order.

    Under each layout two bars mark where ``k_cache(layer)`` and page ``page`` (K and V of
    every layer) lie: each bar is one contiguous run, and the label counts them. ``num_layers``
    in [1, 4], ``num_pages`` in [1, 4] (``2 * L * P`` cells must stay legible), ``layer`` and
    ``page`` valid indices.
    """
    L = check_int_in(num_layers, "num_layers", 1, 4)
    P = check_int_in(num_pages, "num_pages", 1, 4)
    layer = check_int_in(layer, "layer", 0, L - 1)
    page = check_int_in(page, "page", 0, P - 1)
    n = 2 * L * P
    cw = min(0.46, 5.4 / n)  # cell width, inches
    x0, width = 0.25, 0.5 + n * cw
    panel_h = 2.05
    fig, ax = canvas(
        width,
        2 * panel_h + 0.15,
        f"The pool's buffer in memory order, LayerFirst above PageFirst ({L} layers, {P} pages). "
        f"Look at the bars: layer {layer}'s K and page {page} are each one run in one layout "
        "and several in the other.",
    )
    shapes = {
        KVCacheLayout.LayerFirst: "(2, L, P, page_size, H, D)",
        KVCacheLayout.PageFirst: "(2, P, L, page_size, H, D)",
    }
    for row, (layout, shape) in enumerate(shapes.items()):
        y = 0.1 + row * panel_h
        order = pool_block_order(layout, L, P)
        put_text(
            ax,
            x0,
            y + 0.12,
            f"{layout.name}: buffer {shape}",
            size=FS + 1.5,
            ha="left",
            weight="bold",
        )
        for kv, name in enumerate("KV"):
            put_text(
                ax, x0 + (kv + 0.5) * n / 2 * cw, y + 0.42, name, size=FS + 0.5, color=META_INK
            )
        top = y + 0.55
        for i, (_, lay, pg) in enumerate(order):
            fill, border = SERIES[lay % len(SERIES)]
            box(ax, x0 + i * cw, top, cw, 0.5, fill, border)
            put_text(
                ax,
                x0 + (i + 0.5) * cw,
                top + 0.25,
                f"L{lay}\np{pg}",
                size=FS - 0.5,
                linespacing=1.1,
            )
        ax.plot([x0 + n / 2 * cw] * 2, [top - 0.08, top + 0.58], color=INK, lw=2.2)  # K | V
        marks = [
            (
                f"k_cache({layer})",
                [i for i, b in enumerate(order) if b[:2] == (0, layer)],
                "#1d4ed8",
            ),
            (
                f"page {page}, K and V of every layer",
                [i for i, b in enumerate(order) if b[2] == page],
                "#15803d",
            ),
        ]
        for j, (what, cells, colour) in enumerate(marks):
            yb = top + 0.78 + j * 0.42
            runs = _runs(cells)
            word = "contiguous run" if len(runs) == 1 else "contiguous runs"
            put_text(
                ax, x0, yb, f"{what}: {len(runs)} {word}", size=FS - 0.5, ha="left", color=colour
            )
            for a, b in runs:
                box(
                    ax,
                    x0 + a * cw + 0.03,
                    yb + 0.13,
                    (b - a + 1) * cw - 0.06,
                    0.09,
                    colour,
                    colour,
                    0,
                )
    return fig


# ------------------------------------------------------------------------------ TP heads
def draw_tp_heads(num_q_heads: int = 8, num_kv_heads: int = 4, tp_size: int = 2) -> DiagramFigure:
    """Query heads grouped on their KV head (GQA), the groups split over ``tp_size`` ranks.

    Rank ``r`` holds KV heads ``[r*Hkv/N, (r+1)*Hkv/N)`` and the query heads that use them, as
    `MHAKVCache` does under `set_tp_info`. ``ValueError`` when ``num_kv_heads`` does not divide
    ``num_q_heads`` or ``tp_size`` does not divide ``num_kv_heads`` (the package refuses to
    replicate KV heads); at most 64 query heads and 8 ranks.
    """
    hq = check_int_in(num_q_heads, "num_q_heads", 1, 64)
    hkv = check_int_in(num_kv_heads, "num_kv_heads", 1, hq)
    tp = check_int_in(tp_size, "tp_size", 1, 8)
    if hq % hkv:
        raise ValueError(f"num_q_heads={hq} must be a multiple of num_kv_heads={hkv} (GQA groups)")
    if hkv % tp:
        raise ValueError(
            f"num_kv_heads={hkv} is not divisible by tp_size={tp}: MHAKVCache refuses the split "
            "(divide_even); serving engines replicate KV heads instead"
        )
    group, kv_per_rank = hq // hkv, divide_even(hkv, tp)
    q_per_rank = group * kv_per_rank
    qw = 0.42  # one query head's width, inches
    panel_w, panel_h = max(q_per_rank * qw + 0.3, 2.5), 1.75
    per_row = max(1, min(tp, int(5.4 // (panel_w + 0.15))))
    rows = -(-tp // per_row)
    width = per_row * (panel_w + 0.15) + 0.25
    fig, ax = canvas(
        width,
        rows * (panel_h + 0.15) + 0.55,
        f"{hq} query heads on {hkv} KV heads (GQA groups of {group}) over {tp} TP ranks. "
        "Look at the rank frames: every query head reads a KV head on its own rank.",
    )
    for r in range(tp):
        px = 0.2 + (r % per_row) * (panel_w + 0.15)
        py = 0.1 + (r // per_row) * (panel_h + 0.15)
        box(ax, px, py, panel_w, panel_h, "#ffffff", EDGE, 1.2, rounded=0.08)
        kv0 = r * kv_per_rank
        q0 = kv0 * group
        put_text(ax, px + 0.12, py + 0.2, f"rank {r}", size=FS + 1, ha="left", weight="bold")
        put_text(
            ax,
            px + 0.12,
            py + 0.45,
            f"query heads {q0}–{q0 + q_per_rank - 1}, KV heads {kv0}–{kv0 + kv_per_rank - 1}",
            size=FS - 2,
            ha="left",
            color=META_INK,
        )
        for k in range(kv_per_rank):
            fill, border = SERIES[(kv0 + k) % len(SERIES)]
            gx = px + (panel_w - q_per_rank * qw) / 2 + k * group * qw
            for g in range(group):
                x = gx + g * qw
                box(ax, x + 0.03, py + 0.68, qw - 0.06, 0.34, "#ffffff", border)
                put_text(ax, x + qw / 2, py + 0.85, f"q{q0 + k * group + g}", size=FS - 1)
                ax.plot([x + qw / 2] * 2, [py + 1.02, py + 1.2], color=border, lw=1)
            box(ax, gx + 0.03, py + 1.2, group * qw - 0.06, 0.38, fill, border, 1.4)
            put_text(ax, gx + group * qw / 2, py + 1.39, f"KV {kv0 + k}", size=FS - 0.5)
    note = (
        f"group {group}: query head h reads KV head h // {group}.\n"
        f"Each rank's pool keeps {kv_per_rank} of the {hkv} KV heads, in every slot."
    )
    put_text(ax, 0.2, rows * (panel_h + 0.15) + 0.3, note, size=FS - 2, ha="left", color=META_INK)
    return fig


# ------------------------------------------------------------------------------ request steps
#: The seven steps as `RequestFlow` runs them: (step, caller, callee, call, what comes back).
REQUEST_STEPS: tuple[tuple[int, str, str, str, str], ...] = (
    (1, "flow", "manager", "match_prefix(input_ids)", "handle, indices"),
    (2, "flow", "manager", "lock_handle(handle)", ""),
    (3, "flow", "allocator", "allocate(pages)  (evict first if short)", "pages"),
    (6, "caller", "pool", "store_kv(k, v, out_loc, layer)", ""),
    (4, "flow", "manager", "insert_prefix(input_ids, indices)", "already_cached"),
    (5, "flow", "allocator", "free(indices[tree_len:already_cached])", ""),
    (7, "flow", "manager", "lock_handle(handle, unlock=True)", ""),
)
_LANES = {
    "caller": "caller\n(server, model)",
    "flow": "RequestFlow",
    "manager": "manager\n(radix tree)",
    "allocator": "PageAllocator",
    "pool": "pool\n(MHAKVCache)",
}
_PHASES = {1: "begin(input_ids)", 6: "", 4: "finish(req)"}  # the caller's call before a step


def _check_events(events: object) -> dict[int, str]:
    if isinstance(events, (str, bytes)) or not isinstance(events, Sequence):
        raise TypeError(f"events must be a sequence of FlowEvent, got {type(events).__name__}")
    for e in events:
        if not isinstance(e, FlowEvent):
            raise TypeError(f"events must hold FlowEvent objects, got {type(e).__name__}")
    rids = {e.rid for e in events}
    steps = sorted(e.step for e in events if e.step)
    if len(rids) != 1 or steps != list(range(1, 8)):
        raise ValueError(
            f"events must be one request's seven steps, each once; got request ids {sorted(rids)} "
            f"and steps {steps}"
        )
    return {e.step: e.detail for e in events if e.step}


def draw_request_steps(events: Sequence[FlowEvent] | None = None) -> DiagramFigure:
    """The life of one request as a sequence diagram: who calls what, in the order run.

    Lanes: the caller (the server and its model), `RequestFlow`, the manager, the
    `PageAllocator`, the pool. Steps carry the source's numbers (1, 2, 3, 6, 4, 5, 7 is the
    order `RequestFlow` runs them). ``events``: one request's `FlowEvent` list from a traced
    flow (``flow.events``, filtered by ``rid``); each step's detail is then printed under its
    arrow. ``TypeError``/``ValueError`` unless it holds steps 1-7 of one request, once each.
    """
    details = _check_events(events) if events is not None else {}
    lane_w, left = 1.15, 0.6
    xs = {k: left + 0.45 + i * lane_w for i, k in enumerate(_LANES)}
    rows: list[tuple[str, ...]] = []  # (kind, texts...)
    for step, src, dst, call, ret in REQUEST_STEPS:
        if _PHASES.get(step):
            rows.append(("phase", _PHASES[step]))
        rows.append(("call", str(step), src, dst, call))
        if step in details:
            rows.append(("detail", src, dst, details[step]))
        if ret:
            rows.append(("return", dst, src, ret))
        if step == 6:
            rows.append(("phase", "mark_computed(req)"))
    row_h = {"phase": 0.44, "call": 0.46, "detail": 0.28, "return": 0.4}
    head = 0.75
    height = head + sum(row_h[r[0]] for r in rows) + 0.55
    width = left + 0.45 + (len(_LANES) - 1) * lane_w + 0.65
    fig, ax = canvas(
        width,
        height,
        "One request's seven steps between the caller, RequestFlow, the manager, the allocator "
        "and the pool, time running down. Look at the numbers: the flow runs step 6 before 4.",
    )
    for key, label in _LANES.items():
        box(ax, xs[key] - 0.55, 0.08, 1.1, 0.52, PALETTE["root"]["fillcolor"], EDGE, rounded=0.06)
        put_text(ax, xs[key], 0.34, label, size=FS - 1.5, linespacing=1.15)
        ax.plot([xs[key]] * 2, [0.6, height - 0.45], color=EDGE, lw=1, ls=(0, (4, 3)), zorder=0)
    y = head
    for kind, *rest in rows:
        h = row_h[kind]
        mid = y + h / 2
        if kind == "phase":
            (label,) = rest
            arrow(ax, xs["caller"], xs["flow"], mid, INK, solid=True)
            put_text(
                ax, (xs["caller"] + xs["flow"]) / 2, mid - 0.1, label, size=FS - 0.5, bbox=_BOX
            )
        elif kind == "call":
            number, src, dst, call = rest
            colour = (
                PALETTE["protected"]["color"] if src == "flow" else PALETTE["inserted"]["color"]
            )
            arrow(ax, xs[src], xs[dst], mid + 0.06, colour, solid=True)
            put_text(ax, (xs[src] + xs[dst]) / 2, mid - 0.07, call, size=FS - 1, bbox=_BOX)
            ax.add_patch(Circle((0.28, mid), 0.15, facecolor=colour, edgecolor="none"))
            put_text(ax, 0.28, mid, number, size=FS - 0.5, color="#ffffff", weight="bold")
        else:  # a detail under a call, or a return arrow
            src, dst, text = rest
            if kind == "return":
                arrow(ax, xs[src], xs[dst], mid + 0.05, META_INK, solid=False)
            at = (xs[src] + xs[dst]) / 2, mid - (0.02 if kind == "detail" else 0.07)
            put_text(ax, *at, text, size=FS - 1.5, color=META_INK, bbox=_BOX)
        y += h
    blue, green = PALETTE["protected"]["color"], PALETTE["inserted"]["color"]
    legend = ((blue, True, "the flow calls"), (green, True, "the caller calls"))
    for n, (colour, solid, words) in enumerate((*legend, (META_INK, False, "returns"))):
        arrow(ax, left + n * 1.85, left + n * 1.85 + 0.35, height - 0.22, colour, solid)
        put_text(ax, left + n * 1.85 + 0.45, height - 0.22, words, size=FS - 1.5, ha="left")
    return fig


_BOX = {"facecolor": "#ffffff", "edgecolor": "none", "pad": 1.0}
