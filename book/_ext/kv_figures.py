"""Sphinx extension: every tree figure of a page links to its own SVG file, opened full size.

kvcache.viz shows a tree as ``<figure class="kv-figure kv-tree">`` with the ``<svg>`` inline
(see `kvcache.viz.drawing.TreeFigure`); on a phone a big tree scrolls, on a laptop a wide one
is scaled down. Here each such SVG is also written to ``_images/kv-tree-<sha>.svg`` (named by
its content, so a rebuild writes the same files) and the figure's caption gets a link to it,
"full size", that works offline (a file next to the page, not a ``data:`` URL, which browsers
refuse to open as a page). The file names the page's font, served from ``_static/fonts``, so
its text keeps the metrics graphviz laid it out with.

The older output form, ``<div class="kv-figure">`` around the ``<svg>`` (notebooks executed
before figures had captions), gets the same link after the figure.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

_FIGURE = re.compile(
    r'(<figure class="kv-figure kv-tree">.*?)(</figure>)|(<div class="kv-figure">\s*<svg.*?</svg>\s*</div>)',
    re.S,
)
_SVG = re.compile(r"<svg\b.*?</svg>", re.S)
_FONT = (
    '<style>@font-face{font-family:"DejaVu Sans";'
    'src:url("../_static/fonts/DejaVuSans.woff") format("woff")}</style>'
)


def _standalone(svg: str) -> str:
    """``svg`` as a document of its own: the XML prolog and the web font added."""
    head = svg.find(">") + 1
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        + svg[:head]
        + _FONT
        + svg[head:]
        + "\n"
    )


def _link_figures(app, pagename, templatename, context, doctree) -> None:
    body = context.get("body")
    if not body or "kv-figure" not in body:
        return
    images = Path(app.outdir) / "_images"

    def link(svg: str) -> str:
        text = _standalone(svg)
        name = "kv-tree-" + hashlib.sha1(text.encode("utf-8")).hexdigest()[:16] + ".svg"
        images.mkdir(parents=True, exist_ok=True)
        target = images / name
        if not target.exists():
            target.write_text(text, encoding="utf-8")
        href = context["pathto"]("_images/" + name, 1)
        if (app.config.language or "").startswith("zh"):  # the Chinese edition
            title, text = "单独打开这幅图，原始尺寸", "原图"
        else:
            title, text = "this figure on its own, at full size", "full size"
        return (
            f'<a class="kv-full" href="{href}" target="_blank" '
            f'title="{title}">{text}&#x2009;&#x2197;</a>'
        )

    def replace(m: re.Match) -> str:
        if m.group(3):  # the older <div class="kv-figure"> form
            svg = _SVG.search(m.group(3))
            return m.group(3) + (
                f'<p class="kv-full-p">{link(svg.group(0))}</p>' if svg else ""
            )
        head, end = m.group(1), m.group(2)
        svg = _SVG.search(head)
        if not svg:
            return m.group(0)
        if "</figcaption>" in head:
            i = head.rindex("</figcaption>")
            return head[:i] + link(svg.group(0)) + head[i:] + end
        return (
            head
            + f'<figcaption class="kv-caption">{link(svg.group(0))}</figcaption>'
            + end
        )

    context["body"] = _FIGURE.sub(replace, body)


def setup(app):
    app.connect("html-page-context", _link_figures)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
