"""Sphinx extension: the Chinese edition (``language = zh_CN``, built into ``_build/html/zh``).

The English site is built as before; ``scripts/zh_book.py html`` builds the same sources again
with ``language = zh_CN``, and Sphinx's i18n transform replaces every paragraph, heading,
caption and list item by its translation from ``locale/zh_CN/LC_MESSAGES/<docname>.po``
(``scripts/zh_book.py catalogs`` extracts and updates them). This extension adds what Sphinx
and Jupyter Book 1 do not do by themselves:

- a language switch in every page's header, linking the page to its counterpart in the other
  edition (both sites have the same page names; zh lies in ``zh/`` under the English one);
- the toc's part captions, which sphinx-external-toc inserts *after* the i18n transform (so
  they are extracted but never applied): translated here on ``doctree-read``, before the toc
  collector reads them;
- the API reference's docstrings (autodoc) and entries that are only code are kept out of the
  catalogs: they stay English (the zh landing page says so);
- Chinese search: jieba splits the text into words (Sphinx's zh search), with the terminology
  table (``locale/terminology.tsv``) as its user dictionary, so 基数树 or 前缀匹配 is a word;
- the theme's own strings in mainland wording (``locale/theme``: sphinx-book-theme's zh_CN
  catalog says 列印 for "print");
- the numbers of figures and tables in Chinese (图 3.1, 表 14.2), in captions and in
  ``{numref}``. The captions of the figures the cells draw are text nodes of the doctree
  (``book/_ext/kv_figures.py``), so the catalogs hold them and Sphinx translates them like
  any paragraph;
- glued values (``{glue:text}``) in translated paragraphs: Sphinx parses a translation as a
  document of its own, where myst-nb finds no glue data; the lookup falls back to the page's
  notebook;
- the notebook behind a Chinese page's download button has Chinese markdown cells, made at
  build time from the English notebook and the page's catalog (the notebooks are not
  committed twice).
"""

from __future__ import annotations

import gettext
import json
import re
from pathlib import Path

from docutils import nodes
from sphinx import addnodes
from sphinx.ext.autosummary import autosummary_table
from sphinx.util import logging

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
LOCALE = REPO / "locale"
TERMINOLOGY = LOCALE / "terminology.tsv"
THEME_LOCALE = LOCALE / "theme"
TEMPLATES = Path(__file__).resolve().parent / "templates"
#: Where each edition lies relative to the other's root (zh under the English site).
ZH_DIR = "zh"


def is_zh(config) -> bool:
    return (config.language or "").startswith("zh")


# --------------------------------------------------------------------------- terminology


def terminology() -> list[dict[str, str]]:
    """The rows of locale/terminology.tsv (en, zh, pattern, guide), comments left out."""
    rows = []
    header: list[str] | None = None
    for line in TERMINOLOGY.read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        cells = line.split("\t")
        if header is None:
            header = cells
            continue
        rows.append(
            dict(zip(header, cells + [""] * (len(header) - len(cells)), strict=True))
        )
    return rows


def _write_jieba_dictionary(path: Path) -> None:
    """jieba's user dictionary ("word frequency" per line): every Chinese term of the table."""
    words = sorted(
        {r["zh"] for r in terminology() if re.search(r"[\u4e00-\u9fff]", r["zh"])}
    )
    # Terms with a space (KV 缓存) are two words to jieba; their Chinese part is a word too.
    parts = {p for w in words for p in w.split() if re.search(r"[\u4e00-\u9fff]", p)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{w} 2000\n" for w in sorted(parts)), encoding="utf-8")


# --------------------------------------------------------------------------- configuration


def _configure(app, config) -> None:
    config.templates_path = [*config.templates_path, str(TEMPLATES)]
    options = dict(config.html_theme_options or {})
    options["article_header_end"] = ["lang-switch.html", "article-header-buttons.html"]
    config.html_theme_options = options
    if not is_zh(config):
        return
    userdict = Path(app.doctreedir) / "jieba-terms.txt"
    _write_jieba_dictionary(userdict)
    config.html_search_language = "zh"
    config.html_search_options = {
        **(config.html_search_options or {}),
        "dict": str(userdict),
    }
    _mainland_theme_strings(config.language)
    # _config.yml's "Figure %s" replaces Sphinx's own (translated) default: say it in Chinese.
    config.numfig_format = {
        **config.numfig_format,
        "figure": "图 %s",
        "table": "表 %s",
    }
    config.html_title = _site_title(config)
    _glue_in_translations()


def _glue_in_translations() -> None:
    """Let a translated paragraph paste glued values ({glue:text}`key`) like the English one.

    Sphinx parses each translation as a document of its own, which lacks the notebook renderer
    where myst-nb looks glue data up, so the role would warn "No key ... found". Here the
    lookup falls back to the page's notebook: its outputs hold the glued values (the same ones
    the English page pastes)."""
    import nbformat
    from myst_nb.core.variables import VariableOutput
    from myst_nb.ext.glue import directives, extract_glue_data_cell, roles, utils

    original = getattr(
        utils.retrieve_glue_data, "__wrapped__", utils.retrieve_glue_data
    )
    glued: dict[tuple[Path, float], dict] = {}

    def retrieve(document, key):
        env = getattr(document.settings, "env", None)
        if "nb_renderer" in document or env is None or not env.docname:
            return original(document, key)
        path = Path(env.doc2path(env.docname))
        if path.suffix != ".ipynb":
            return original(document, key)
        stamp = (path, path.stat().st_mtime)
        if stamp not in glued:
            notebook = nbformat.read(path, as_version=4)
            glued[stamp] = {
                name: output
                for cell in notebook.cells
                if cell.cell_type == "code"
                for name, output in extract_glue_data_cell(cell)
            }
        found = glued[stamp].get(key)
        if found is None:
            return original(document, key)
        return VariableOutput(
            data=found["data"],
            metadata=found.get("metadata", {}),
            nb_renderer=None,
            vtype="glue",
        )

    retrieve.__wrapped__ = original
    for module in (utils, roles, directives):
        module.retrieve_glue_data = retrieve


def _site_title(config) -> str:
    """The site's title (the sidebar's heading, every tab's title) as the landing page's
    catalog translates it: it is the landing page's title too."""
    from babel.messages.pofile import read_po

    po = LOCALE / config.language / "LC_MESSAGES" / (config.root_doc + ".po")
    if not po.exists():
        return config.html_title
    with po.open("rb") as f:
        message = read_po(f).get(config.html_title)
    return (
        message.string if message is not None and message.string else config.html_title
    )


def _mainland_theme_strings(language: str) -> None:
    """Put locale/theme's catalogs in front of the themes' own (which stay as fallbacks)."""
    from babel.messages.mofile import write_mo
    from babel.messages.pofile import read_po
    from sphinx import locale

    for po in sorted(THEME_LOCALE.glob(f"{language}/LC_MESSAGES/*.po")):
        with po.open("rb") as f:
            catalog = read_po(f, locale=language)
        mo = po.with_suffix(".mo")
        with mo.open("wb") as f:
            write_mo(f, catalog)
        with mo.open("rb") as f:
            ours = gettext.GNUTranslations(f)
        key = ("general", po.stem)
        theirs = locale.translators.get(key)
        if theirs is not None and theirs.__class__ is not gettext.NullTranslations:
            ours.add_fallback(theirs)
        locale.translators[key] = ours


# --------------------------------------------------------------------------- reading


def _page_catalog(app, docname: str) -> gettext.NullTranslations:
    return gettext.translation(
        docname, localedir=str(LOCALE), languages=[app.config.language], fallback=True
    )


def _only_code(node: nodes.Element) -> bool:
    """A paragraph (or title, cell...) that holds only code, math and whitespace."""
    kids = [
        k for k in node.children if not (isinstance(k, nodes.Text) and not k.strip())
    ]
    return bool(kids) and all(
        isinstance(k, nodes.literal | nodes.math)
        or (isinstance(k, addnodes.pending_xref) and _only_code(k))
        for k in kids
    )


def _keep_out_of_catalogs(app, doctree) -> None:
    """Docstrings (autodoc), API entries and code-only text are not translated: mark them so the
    gettext builder does not extract them (the html build would leave them English anyway)."""
    for node in doctree.findall(nodes.TextElement):
        source = node.source or ""
        if (
            ":docstring of " in source
            or _only_code(node)
            or any(isinstance(a, addnodes.desc) for a in _ancestors(node))
            or any(isinstance(a, autosummary_table) for a in _ancestors(node))
        ):
            node["translatable"] = False


def _ancestors(node):
    node = node.parent
    while node is not None:
        yield node
        node = node.parent


def _translate_toc_captions(app, doctree) -> None:
    """sphinx-external-toc adds the root page's toctrees (with the parts' captions) after the
    i18n transform: translate the captions here, before the toc collector reads them."""
    if not is_zh(app.config):
        return
    trees = list(doctree.findall(addnodes.toctree))
    captions = [t for t in trees if t.get("caption")]
    if not captions:
        return
    catalog = _page_catalog(app, app.env.docname)
    for tree in captions:
        text = catalog.gettext(tree["caption"])
        tree["caption"] = text
        for caption in tree.findall(
            nodes.caption
        ):  # present when rawcaption was parsed
            caption.children = [nodes.Text(text)]


#: Said once, on the Chinese edition's landing page, under its title.
LANDING_NOTE = (
    "这是本书的中文版，与英文版由同一批笔记本构建，并由测试保持同步。正文、标题、图注、"
    "练习与答案都已译成中文，术语与学习指南一致（见术语表）；代码、代码的输出、标识符"
    "（类名、函数名、参数名）以及 API 参考中由文档字符串生成的内容保持英文。"
    "页眉右上角的 English 按钮切换到同一页的英文版。"
)


def _landing_note(app, doctree) -> None:
    """The zh landing page says what is translated and what stays English."""
    if not is_zh(app.config) or app.env.docname != app.config.root_doc:
        return
    section = next(iter(doctree.findall(nodes.section)), None)
    if section is None:
        return
    note = nodes.note(
        "", nodes.paragraph(text=LANDING_NOTE), classes=["kv-edition-note"]
    )
    title = next(iter(section.findall(nodes.title)))
    section.insert(section.index(title) + 1, note)


# --------------------------------------------------------------------------- the header switch


def _language_switch(app, pagename, templatename, context, doctree) -> None:
    """The counterpart of this page in the other edition, relative to this page."""
    up = "../" * pagename.count("/")
    if is_zh(app.config):
        href, label, lang, title = (
            f"{up}../{pagename}.html",
            "English",
            "en",
            "English edition",
        )
    else:
        href, label, lang, title = (
            f"{up}{ZH_DIR}/{pagename}.html",
            "中文",
            "zh-CN",
            "中文版",
        )
    context["kv_language_switch"] = {
        "href": href,
        "label": label,
        "lang": lang,
        "title": title,
    }


# --------------------------------------------------------------------------- notebooks

_PREFIX = re.compile(r"^(\s*(?:(?:#{1,6}|[-*+]|\d+[.)]|>)\s+)*)")
_FENCE_TITLE = re.compile(r"^(\s*(?::{3,}|`{3,})\{[\w:-]+\}\s+)(.+)$")
_FENCE = re.compile(r"^\s*(`{3,}|:{3,})")
_HEADING = re.compile(r"^(\s*#{1,6}\s+)")
#: A line that ends the paragraph above it (CommonMark: only a list starting at 1 interrupts).
_INTERRUPTS = re.compile(r"^\s*(?:#{1,6}|[-*+]|1[.)]|>)\s")


def _messages(catalog: gettext.NullTranslations) -> dict[str, str]:
    messages = getattr(catalog, "_catalog", {}) or {}
    return {k: v for k, v in messages.items() if isinstance(k, str) and k and v}


def translate_markdown(source: str, messages: dict[str, str]) -> str:
    """A markdown cell with every block whose English is a catalog entry replaced by its
    translation: paragraphs (their lines joined as Sphinx joins them), headings, list items,
    admonition titles and bodies, table cells and display math; code blocks left as they are."""
    lines = source.split("\n")
    out: list[str] = []
    i = 0
    in_code: str | None = None
    directives: list[str] = []  # the fences of the directives (admonitions) now open
    while i < len(lines):
        line = lines[i]
        fence = _FENCE.match(line)
        if in_code is not None:
            out.append(line)
            if (
                fence
                and fence.group(1)[0] == in_code[0]
                and line.strip() == fence.group(1)
            ):
                in_code = None
            i += 1
            continue
        if fence and fence.group(1)[0] == "`" and "`" in line[fence.end() :]:
            fence = None  # a backtick in the info string: not a fence (CommonMark), a paragraph
        if fence and "{" in line:  # a directive opens: its body is Markdown
            directives.append(fence.group(1))
            titled = _FENCE_TITLE.match(line)
            if titled:
                title = titled.group(2).strip()
                line = titled.group(1) + messages.get(title, title)
            out.append(line)
            i += 1
            continue
        if fence:
            if directives and line.strip() == directives[-1]:  # ... and closes
                directives.pop()
            else:  # a plain code block: nothing to translate inside
                in_code = fence.group(1)
            out.append(line)
            i += 1
            continue
        if line.strip() == "$$":
            end = next(
                (j for j in range(i + 1, len(lines)) if lines[j].strip() == "$$"), None
            )
            if end is not None:
                key = "\n" + "\n".join(lines[i + 1 : end]) + "\n"
                body = messages.get(key, key).strip("\n").split("\n")
                out += [line, *body, lines[end]]
                i = end + 1
                continue
        if line.lstrip().startswith("|") and line.rstrip().endswith("|"):
            cells = line.strip()[1:-1].split("|")
            out.append(
                "| "
                + " | ".join(messages.get(c.strip(), c.strip()) for c in cells)
                + " |"
            )
            i += 1
            continue
        heading = _HEADING.match(line)
        prefixes = [heading.group(1)] if heading else []
        prefixes += [
            m.group(0) for m in [_PREFIX.match(line)] if m.group(0) not in prefixes
        ]
        done = False
        for (
            prefix
        ) in prefixes:  # "### 1. Title": the heading's marker only, then every marker
            text = line[len(prefix) :].strip()
            best: tuple[int, str] | None = None
            for j in range(i, min(len(lines), i + 80)):
                if j > i:
                    nxt = lines[j]
                    if not nxt.strip() or _INTERRUPTS.match(nxt) or _FENCE.match(nxt):
                        break
                    text += " " + nxt.strip()
                if text in messages:
                    best = (j, text)
            if best is not None:
                j, text = best
                out.append(prefix + messages[text])
                i = j + 1
                done = True
                break
        if not done:
            out.append(line)
            i += 1
    return "\n".join(out)


def _write_zh_notebooks(app, exception) -> None:
    """_sources/<page>.ipynb (what the download button gives) with Chinese markdown cells."""
    if exception is not None or app.builder.format != "html" or not is_zh(app.config):
        return
    for docname in sorted(app.env.found_docs):
        source = Path(app.env.doc2path(docname))
        if source.suffix != ".ipynb":
            continue
        target = Path(app.outdir) / "_sources" / (docname + ".ipynb")
        if not target.parent.exists():
            continue
        notebook = json.loads(source.read_text(encoding="utf-8"))
        messages = _messages(_page_catalog(app, docname))
        for cell in notebook["cells"]:
            if cell["cell_type"] == "markdown":
                text = "".join(cell["source"])
                cell["source"] = translate_markdown(text, messages).splitlines(
                    keepends=True
                )
        notebook.setdefault("metadata", {})["language_info"] = notebook.get(
            "metadata", {}
        ).get("language_info", {})
        notebook["metadata"]["kvcache_edition"] = "zh_CN"
        target.write_text(
            json.dumps(notebook, indent=1, ensure_ascii=False) + "\n", encoding="utf-8"
        )


def setup(app):
    # after sphinx-external-toc (priority 900) has set root_doc from the toc
    app.connect("config-inited", _configure, priority=950)
    app.connect("doctree-read", _keep_out_of_catalogs)
    # before the toc collector (priority 500) reads the captions for the sidebar
    app.connect("doctree-read", _translate_toc_captions, priority=400)
    app.connect("doctree-read", _landing_note)
    app.connect("html-page-context", _language_switch)
    app.connect("build-finished", _write_zh_notebooks)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
