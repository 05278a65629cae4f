"""The visual language of the tree drawings: font, palette, colour key, text measure, panel grid.

Graphviz sizes every node from the metrics of the font it is given, looked up on the machine
that runs ``dot``; a browser then draws the SVG's text with whatever font *it* finds under that
name. The two agree only when both have the same font, so the drawings name exactly one,
`FONT` ("DejaVu Sans", Debian's ``fonts-dejavu-core``: ``make system-deps`` installs it and the
website serves it from ``book/_static/fonts``), never a fallback list.

`text_width` estimates a string's width in that font (its advance widths for ASCII, a typical
width otherwise), so captions can be wrapped to a panel's width (`wrap`) and panels laid in a
grid that fits the page (`grid_rows`, `tree_extent`) before graphviz lays anything out.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Iterable, Sequence

from .snapshot import TreeSnapshot

__all__ = [
    "FONT",
    "FONT_PACKAGE",
    "INK",
    "EDGE",
    "PALETTE",
    "LEGEND_TEXT",
    "node_style",
    "text_width",
    "wrap",
    "grid_rows",
    "key_label",
    "tree_extent",
]

FONT = "DejaVu Sans"
FONT_PACKAGE = "fonts-dejavu-core"  # Debian/Ubuntu package that installs FONT (`fc-list` shows it)
INK = "#1f2937"  # dark text on every (pastel) fill
META_INK = "#4b5563"
GHOST_INK = "#9ca3af"
EDGE = "#8b95a5"  # mid grey: visible on light and dark pages

#: Node styles by state; `node_style` combines them (fill from the state, border from the flags).
PALETTE: dict[str, dict[str, str]] = {
    "evictable": {"fillcolor": "#f3f4f6", "color": "#6b7280", "penwidth": "1"},
    "protected": {"fillcolor": "#cfe0fc", "color": "#1d4ed8", "penwidth": "2.4"},
    "inserted": {"fillcolor": "#c7efcf", "color": "#15803d", "penwidth": "1.4"},
    "split": {"color": "#ea580c", "penwidth": "3"},
    "evict": {
        "fillcolor": "#fde0e0",
        "color": "#dc2626",
        "penwidth": "2.4",
        "style": "rounded,filled,dashed",
    },
    "evicted": {
        "fillcolor": "#f9fafb",
        "color": "#9ca3af",
        "fontcolor": "#9ca3af",
        "penwidth": "1.2",
        "style": "rounded,filled,dashed",
    },
    "root": {"fillcolor": "#e5e7eb", "color": "#6b7280", "penwidth": "1"},
}

#: The colour key's entries, in the order it lists them: state -> words.
LEGEND_TEXT: dict[str, str] = {
    "protected": "protected (ref > 0)",
    "evictable": "evictable (ref 0)",
    "inserted": "just inserted",
    "split": "just split",
    "evict": "evicted next",
    "evicted": "evicted (ghost)",
}

# DejaVu Sans 2.37 advance widths of U+0020..U+007E, in units of 1/2048 em.
_ASCII_WIDTHS = (
    651,
    821,
    942,
    1716,
    1303,
    1946,
    1597,
    563,
    799,
    799,
    1024,
    1716,
    651,
    739,
    651,
    690,
    1303,
    1303,
    1303,
    1303,
    1303,
    1303,
    1303,
    1303,
    1303,
    1303,
    690,
    690,
    1716,
    1716,
    1716,
    1087,
    2048,
    1401,
    1405,
    1430,
    1577,
    1294,
    1178,
    1587,
    1540,
    604,
    604,
    1343,
    1141,
    1767,
    1532,
    1612,
    1235,
    1612,
    1423,
    1300,
    1251,
    1499,
    1401,
    2025,
    1403,
    1251,
    1403,
    799,
    690,
    799,
    1716,
    1024,
    1024,
    1255,
    1300,
    1126,
    1300,
    1260,
    721,
    1300,
    1298,
    569,
    569,
    1186,
    569,
    1995,
    1298,
    1253,
    1300,
    1300,
    842,
    1067,
    803,
    1298,
    1212,
    1675,
    1212,
    1212,
    1075,
    1303,
    690,
    1303,
    1716,
)
_OTHER_WIDTHS = {"…": 2048, "–": 1024, "—": 2048, "·": 651, "“": 1061, "”": 1061, "→": 1716}
_WIDE = 2048  # CJK and other wide characters: a full em
_TYPICAL = 1303  # anything else: a digit's width


def _char_units(ch: str) -> int:
    code = ord(ch)
    if 0x20 <= code < 0x7F:
        return _ASCII_WIDTHS[code - 0x20]
    if ch in _OTHER_WIDTHS:
        return _OTHER_WIDTHS[ch]
    return _WIDE if code >= 0x1100 and not 0x2000 <= code < 0x2E80 else _TYPICAL


def text_width(text: str, font_size: float) -> float:
    """Width in points of ``text`` set in `FONT` at ``font_size`` points (no kerning)."""
    return sum(_char_units(ch) for ch in text) * font_size / 2048


def wrap(text: str, width: float, font_size: float) -> list[str]:
    """One line of ``text`` broken at spaces into lines no wider than ``width`` points (in `FONT`).

    Spaces inside a line are kept as written (only those at a break go). A single word wider
    than ``width`` is cut into pieces that fit, so no line is wider unless one character is.
    Always at least one line (``[""]`` for an empty text).
    """
    lines: list[str] = []
    line = ""
    for piece in re.findall(r"\s*\S+|\s+$", text):
        word = piece.lstrip() if not line else piece
        if line and text_width(line + word, font_size) > width:
            lines.append(line)
            line, word = "", piece.lstrip()
        while text_width(line + word, font_size) > width and len(word) > 1:  # cut an overlong word
            k = len(word) - 1
            while k > 1 and text_width(line + word[:k], font_size) > width:
                k -= 1
            lines.append(line + word[:k])
            line, word = "", word[k:]
        line += word
    lines.append(line)
    return lines


def grid_rows(n: int, per_row: int) -> list[int]:
    """How many of ``n`` panels go in each row, at most ``per_row`` a row where possible.

    Rows are as even as can be (their sizes differ by at most one, the fuller rows first) and
    the last panel is never alone in its row while there are more than one: then a row takes
    one panel beyond ``per_row`` instead (3 panels, 2 a row: one row of 3).
    """
    if n <= 0:
        return []

    def even(rows: int) -> list[int]:
        base, extra = divmod(n, rows)
        return [base + 1] * extra + [base] * (rows - extra)

    sizes = even(math.ceil(n / per_row))
    if per_row > 1 and len(sizes) > 1 and min(sizes) == 1:
        sizes = even(len(sizes) - 1)
    return sizes


def node_style(states: Sequence[str]) -> dict[str, str]:
    """Graphviz attributes for a node in ``states`` (later states override earlier ones)."""
    attrs = {"style": "rounded,filled", "fontcolor": INK}
    for s in states:
        attrs.update(PALETTE[s])
    if "protected" in states and "inserted" in states:  # keep the protected border on a green fill
        attrs.update(color=PALETTE["protected"]["color"], penwidth=PALETTE["protected"]["penwidth"])
    if "split" in states:
        attrs.update(PALETTE["split"])
    attrs["class"] = " ".join(f"kv-{s}" for s in states)
    return attrs


_SAMPLE_STATES = {
    "protected": ("protected",),
    "evictable": ("evictable",),
    "inserted": ("evictable", "inserted"),
    "split": ("evictable", "split"),
    "evict": ("evictable", "evict"),
    "evicted": ("evicted",),
}


_SWATCH_W = 16  # points: a key entry's sample box
_SPACING = 3  # points between a key's cells


def _swatch(key: str) -> str:
    """One key entry: a small box drawn in the state's style, then its words."""
    st = node_style(_SAMPLE_STATES[key])
    dashed = "dashed" in st["style"]
    fill = st.get("fillcolor", PALETTE["evictable"]["fillcolor"])
    border = max(1, round(float(st["penwidth"])))
    box = (
        f'<TD FIXEDSIZE="TRUE" WIDTH="{_SWATCH_W}" HEIGHT="11" BGCOLOR="{fill}" COLOR="{st["color"]}" '
        f'BORDER="{border}" STYLE="{"dashed" if dashed else "rounded"}"></TD>'
    )
    return box + f'<TD ALIGN="LEFT">{html.escape(LEGEND_TEXT[key])}</TD>'


def key_label(
    keys: Iterable[str], font_size: float, title_lines: Sequence[str] = (), per_row: int = 3
) -> str:
    """An HTML-like graphviz label: ``title_lines`` (left-aligned) above a colour key of ``keys``.

    The key lists the states in `LEGEND_TEXT` order, ``per_row`` entries a row, each a small box
    in the state's own fill and border. Returns ``""`` when there is neither title nor key.
    """
    wanted = [k for k in LEGEND_TEXT if k in set(keys)]
    rows = []
    small = font_size * 0.85
    if title_lines:
        text = '<BR ALIGN="LEFT"/>'.join(
            html.escape(line).replace("\\", "\\\\") for line in title_lines
        )
        # At least as wide as the text in the browser, which sets the font's exact (unhinted)
        # advances: graphviz measures hinted ones, up to a few percent narrower on a long line.
        title_w = math.ceil(max(text_width(line, font_size) for line in title_lines) * 1.03) + 6
        rows.append(
            f'<TR><TD ALIGN="LEFT" BALIGN="LEFT" WIDTH="{title_w}"><FONT COLOR="{INK}">{text}</FONT></TD></TR>'
        )
    if wanted:
        cells: list[str] = []
        width = 0.0
        for i in range(0, len(wanted), per_row):
            chunk = wanted[i : i + per_row]
            cells.append("<TR>" + "".join(_swatch(k) for k in chunk) + "</TR>")
            row = sum(_SWATCH_W + 2 + text_width(LEGEND_TEXT[k], small) * 1.04 + 4 for k in chunk)
            width = max(width, row + _SPACING * (2 * len(chunk) + 1))
        height = len(cells) * (small * 1.25 + 4) + _SPACING * (len(cells) + 1)
        # FIXEDSIZE: a wider title must not stretch the key's cells apart (graphviz widens a
        # nested table to its cell); the size is measured in FONT, with a margin.
        key = (
            f'<TABLE ALIGN="LEFT" FIXEDSIZE="TRUE" WIDTH="{math.ceil(width)}" HEIGHT="{math.ceil(height)}" '
            f'BORDER="0" CELLBORDER="0" CELLSPACING="{_SPACING}" CELLPADDING="1">'
            + "".join(cells)
            + "</TABLE>"
        )
        rows.append(
            f'<TR><TD ALIGN="LEFT"><FONT POINT-SIZE="{small:g}" COLOR="{META_INK}">{key}</FONT></TD></TR>'
        )
    if not rows:
        return ""
    return (
        '<<TABLE BORDER="1" COLOR="#d1d5db" STYLE="rounded" BGCOLOR="#ffffff" CELLBORDER="0" '
        'CELLSPACING="2" CELLPADDING="2">' + "".join(rows) + "</TABLE>>"
    )


def tree_extent(
    snap: TreeSnapshot,
    label_widths: dict[int, float],
    font_size: float,
    rankdir: str,
    show_evicted: bool,
) -> tuple[float, float]:
    """An estimate, in points, of ``(width, height)`` of ``snap`` laid out by dot alone.

    ``label_widths`` maps a node's uuid to its box's width. Top-down: a subtree is as wide as
    its node or its children side by side, whichever is wider; left-to-right: as tall. Used to
    wrap a panel's caption and to choose how many panels a row can hold, before layout.
    """
    line_h = font_size * 1.25
    box_h = 3 * line_h + 6
    gap = 13.0 if rankdir == "TB" else 6.0
    rank_gap = 22.0 if rankdir == "TB" else 16.0
    children: dict[int, list[int]] = {u: list(n.children) for u, n in snap.by_uuid.items()}
    if show_evicted:
        for ghost in snap.evicted:
            parent = ghost.parent if ghost.parent in children else snap.root.uuid
            children.setdefault(parent, []).append(ghost.uuid)
            children.setdefault(ghost.uuid, [])
    own = {u: (label_widths.get(u, 26.0), box_h) for u in children}
    order: list[int] = []
    stack = [snap.root.uuid]
    while stack:  # preorder, then sizes in reverse (children before parents)
        u = stack.pop()
        order.append(u)
        stack.extend(children[u])
    across: dict[int, float] = {}  # extent across ranks (width for TB, height for LR)
    along: dict[int, float] = {}  # extent along ranks (height for TB, width for LR)
    for u in reversed(order):
        w, h = own[u] if rankdir == "TB" else (own[u][1], own[u][0])
        kids = children[u]
        span = sum(across[c] for c in kids) + gap * max(0, len(kids) - 1)
        across[u] = max(w, span)
        along[u] = h + (rank_gap + max(along[c] for c in kids) if kids else 0.0)
    root = snap.root.uuid
    return (across[root], along[root]) if rankdir == "TB" else (along[root], across[root])
