"""Sphinx extension: the package's figures and the cells' tables, numbered by Sphinx.

kvcache.viz shows every picture (a tree, a sequence, a step player, a diagram, a captioned
matplotlib plot) as ``<figure class="kv-figure kv-{kind}">``: the picture in a
``<div class="kv-figure-body">`` and a ``<figcaption class="kv-caption">`` (see
`kvcache.viz.figure.figure_html`). A notebook stores that HTML in a cell's output, where Sphinx
sees only raw HTML. This extension makes each such figure a document node Sphinx numbers
like its own figures:

- `KvFigures`, a transform that runs before the i18n one, replaces every kv-figure output
  (a cell's ``text/html`` output, or a ``{raw} html`` block such as the landing page's tree)
  by a `kv_figure` node: the picture stays raw HTML, the caption becomes a `kv_caption`
  text node. The caption is therefore prose like any paragraph: the gettext builder extracts
  it into the page's catalog and the Chinese edition translates it in the doctree.
- `kv_figure` is an enumerable node of figtype ``figure`` (`Sphinx.add_enumerable_node`), so
  it is numbered with the toc's chapter numbers (``use_multitoc_numbering``: "Figure 17.2")
  in one sequence with Markdown ``{figure}`` directives, and ``{numref}`` refers to it. Its
  HTML is the package's figure again, with Sphinx's number (``numfig_format``, "Figure %s";
  "图 %s" in the Chinese edition) at the start of the one caption.
- A cell names its figures in its metadata, ``"figure": "fig-name"`` (or a list, one name per
  kv-figure output of the cell, in order); a figure without a name is numbered all the same
  but cannot be referred to. A cell whose output is a Markdown table names it and gives its
  caption with ``"table": {"name": "tab-name", "caption": "..."}`` (or a list of such, one per
  table in order): the table gets Sphinx's title, so it is numbered "Table 17.1" like a
  ``{table}`` directive in the prose.

After the page is written, each tree figure's SVG is also written to
``_images/kv-tree-<sha>.svg`` (named by its content, so a rebuild writes the same files) and
the caption gets a link to it, "full size", that works offline (a file next to the page, not a
``data:`` URL, which browsers refuse to open as a page). The file names the page's font,
served from ``_static/fonts``, so its text keeps the metrics graphviz laid it out with.
"""

from __future__ import annotations

import hashlib
import html
import re
from pathlib import Path

from docutils import nodes
from sphinx.transforms import SphinxTransform
from sphinx.util import logging

logger = logging.getLogger(__name__)


class kv_figure(nodes.General, nodes.Element):  # docutils names nodes in lower case
    """A kvcache.viz figure: the picture (a raw HTML child) and its `kv_caption`."""


class kv_table(nodes.General, nodes.Element):  # docutils names nodes in lower case
    """A table a cell prints as text: its `kv_caption`, then the cell's output as it is."""


class kv_caption(nodes.Part, nodes.FixedTextElement):
    """The caption of a `kv_figure`: translatable text, kept as the package wrote it (a
    FixedTextElement, so Sphinx's smart quotes leave ``'Hello'`` straight, as in the output)."""


#: One figure as kvcache.viz writes it (comments before it allowed: the landing page's file).
_KV_FIGURE = re.compile(
    r'\A(?P<head>\s*(?:<!--.*?-->\s*)*)<figure class="(?P<classes>kv-figure(?: [a-z][a-z0-9-]*)*)">'
    r'<div class="kv-figure-body">(?P<body>.*)</div>'
    r'(?:<figcaption class="kv-caption">(?P<caption>.*?)</figcaption>)?</figure>\s*\Z',
    re.S,
)


def _labels(metadata: dict, key: str) -> list:
    value = metadata.get(key)
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def _html_of(bundle: nodes.Element) -> nodes.raw | None:
    """The raw HTML node of a myst-nb mime bundle (a cell output), if it has one."""
    for child in bundle.children:
        if child.get("mime_type") == "text/html":
            raws = [
                n for n in child.findall(nodes.raw) if "html" in n.get("format", "")
            ]
            return raws[0] if len(raws) == 1 else None
    return None


def _figure_node(
    raw: nodes.raw, source: str, line: int | None
) -> list[nodes.Node] | None:
    """The nodes that replace ``raw`` when it holds one kv-figure, else None."""
    m = _KV_FIGURE.match(raw.astext())
    if m is None:
        return None
    figure = kv_figure(classes=m.group("classes").split())
    figure.source, figure.line = source, line
    figure += nodes.raw(
        "", f'<div class="kv-figure-body">{m.group("body")}</div>', format="html"
    )
    if m.group("caption") is not None:
        text = html.unescape(m.group("caption")).strip()
        caption = kv_caption(text, text)
        caption.source, caption.line = source, line
        figure += caption
    out: list[nodes.Node] = []
    if m.group("head").strip():
        out.append(nodes.raw("", m.group("head"), format="html"))
    out.append(figure)
    return out


class KvFigures(SphinxTransform):
    """kv-figure outputs become numbered `kv_figure` nodes; labelled table outputs get a title.

    Runs before the i18n transform (Locale, priority 20), so the captions it makes are
    extracted by the gettext builder and translated in the Chinese edition."""

    default_priority = 8

    def apply(self, **kwargs) -> None:
        source = self.document.get("source", "")
        for cell in list(self.document.findall(nodes.container)):
            if cell.get("nb_element") == "cell_code":
                self._cell(cell, source)
        for raw in list(self.document.findall(nodes.raw)):
            if "kv-figure" not in raw.astext() or "html" not in raw.get("format", ""):
                continue
            if any(p.get("nb_element") == "cell_code" for p in _ancestors(raw)):
                continue  # a cell's output that is not a kv-figure (handled above)
            replacement = _figure_node(raw, source, raw.line)
            if replacement is not None:
                for node in replacement:
                    if isinstance(node, kv_figure):
                        self.document.set_id(node)
                raw.replace_self(replacement)

    def _cell(self, cell: nodes.container, source: str) -> None:
        metadata = cell.get("cell_metadata") or {}
        names = _labels(metadata, "figure")
        where = f"cell {cell.get('cell_index')}"
        found: list[kv_figure] = []
        for bundle in list(cell.findall(nodes.container)):
            if bundle.get("nb_element") != "mime_bundle":
                continue
            raw = _html_of(bundle)
            if raw is None or "kv-figure" not in raw.astext():
                continue
            replacement = _figure_node(raw, source, cell.line)
            if replacement is None:
                continue
            bundle.replace_self(replacement)
            found += [n for n in replacement if isinstance(n, kv_figure)]
        if names and len(names) != len(found):
            logger.warning(
                f"{where}: metadata names {len(names)} figure(s) {names}, "
                f"but the cell shows {len(found)} kv-figure(s)",
                location=cell,
            )
        for i, figure in enumerate(found):
            if i < len(names):
                figure["names"].append(str(names[i]))
                self.document.note_explicit_target(figure, figure)
            else:
                self.document.set_id(figure)
        tables = _labels(metadata, "table")
        if tables:
            self._tables(cell, tables, source, where)

    def _tables(
        self, cell: nodes.container, specs: list, source: str, where: str
    ) -> None:
        found = list(cell.findall(nodes.table))
        if not found and len(specs) == 1:
            self._text_table(cell, specs[0], source, where)
            return
        if len(found) != len(specs):
            logger.warning(
                f"{where}: metadata describes {len(specs)} table(s), "
                f"but the cell shows {len(found)}",
                location=cell,
            )
            return
        for table, spec in zip(found, specs, strict=True):
            if not _valid_spec(spec):
                logger.warning(
                    f'{where}: a table needs {{"name": ..., "caption": ...}}, got {spec!r}',
                    location=cell,
                )
                continue
            title = nodes.title(spec["caption"], spec["caption"])
            title.source, title.line = source, cell.line
            table.insert(0, title)
            table["names"].append(str(spec["name"]))
            self.document.note_explicit_target(table, table)

    def _text_table(
        self, cell: nodes.container, spec: object, source: str, where: str
    ) -> None:
        """A cell that prints its table as text: its output becomes a numbered `kv_table`."""
        outputs = [
            c for c in cell.children if c.get("nb_element") == "cell_code_output"
        ]
        if len(outputs) != 1 or not _valid_spec(spec):
            logger.warning(
                f'{where}: a printed table needs {{"name": ..., "caption": ...}} and an '
                f"output, got {spec!r}",
                location=cell,
            )
            return
        output = outputs[0]
        table = kv_table(classes=["kv-table"])
        table.source, table.line = source, cell.line
        caption = kv_caption(spec["caption"], spec["caption"])
        caption.source, caption.line = source, cell.line
        table += caption
        table.extend(output.children)
        output.children = []
        output += table
        table["names"].append(str(spec["name"]))
        self.document.note_explicit_target(table, table)


def _valid_spec(spec: object) -> bool:
    return (
        isinstance(spec, dict) and bool(spec.get("name")) and bool(spec.get("caption"))
    )


def _ancestors(node: nodes.Node):
    node = node.parent
    while node is not None:
        yield node
        node = node.parent


def _caption_text(node: nodes.Element) -> str:
    captions = [c for c in node.children if isinstance(c, kv_caption)]
    return captions[0].astext() if captions else ""


# --------------------------------------------------------------------------- HTML


def visit_kv_figure(self, node: nodes.Element) -> None:
    self.body.append(self.starttag(node, "figure"))


def depart_kv_figure(self, node: nodes.Element) -> None:
    self.body.append("</figure>\n")


def visit_kv_caption(self, node: kv_caption) -> None:
    self.body.append('<figcaption class="kv-caption">')
    self.add_fignumber(node.parent)


def depart_kv_caption(self, node: kv_caption) -> None:
    self.body.append("</figcaption>")


def _skip(self, node) -> None:
    raise nodes.SkipNode


# --------------------------------------------------------------------------- full-size links

_TREE = re.compile(r'(<figure class="kv-figure kv-tree"[^>]*>.*?)(</figure>)', re.S)
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
    if not body or "kv-tree" not in body:
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

    context["body"] = _TREE.sub(replace, body)


def setup(app):
    skip = (_skip, None)
    for node, figtype in ((kv_figure, "figure"), (kv_table, "table")):
        app.add_enumerable_node(
            node,
            figtype,
            _caption_text,
            html=(visit_kv_figure, depart_kv_figure),
            latex=skip,
            text=skip,
            man=skip,
            texinfo=skip,
        )
    app.add_node(
        kv_caption,
        html=(visit_kv_caption, depart_kv_caption),
        latex=skip,
        text=skip,
        man=skip,
        texinfo=skip,
    )
    app.add_transform(KvFigures)
    app.connect("html-page-context", _link_figures)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
