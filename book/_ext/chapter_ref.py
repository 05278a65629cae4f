"""Sphinx extension: the ``chapter`` role, a link to a chapter that shows its number and title.

The toc numbers the chapters (``numbered`` in _toc.yml), so prose never types a number:
``{chapter}`10_page_size``` renders as "chapter 8, *Page size beyond 1*", linked to the page;
``{chapter}`Chapter <10_page_size>``` starts a sentence. The target is a document name, relative
to the page (like ``{doc}``). The number is the one the toc gave the page, so inserting or
moving a chapter renumbers every reference. A target that is not a numbered page is a warning
(the book builds with warnings as errors). In the Chinese edition (``language`` zh_CN) the link
reads 第 8 章“标题”, whatever word the role gives.
"""

from __future__ import annotations

from docutils import nodes
from sphinx.util import docname_join, logging
from sphinx.util.docutils import SphinxRole
from sphinx.util.nodes import split_explicit_title

logger = logging.getLogger(__name__)


class chapter_ref(nodes.Inline, nodes.TextElement):
    """A placeholder for a chapter link; replaced once the toc's numbers are known."""


class ChapterRole(SphinxRole):
    def run(self):
        explicit, word, target = split_explicit_title(self.text)
        node = chapter_ref(
            self.rawtext,
            "",
            word=word if explicit else "chapter",
            reftarget=docname_join(self.env.docname, target.strip()),
        )
        self.set_source_info(node)
        return [node], []


def _resolve(app, doctree, fromdocname: str) -> None:
    env = app.env
    for node in list(doctree.findall(chapter_ref)):
        target = node["reftarget"]
        number = env.toc_secnumbers.get(target, {}).get("")
        if target not in env.all_docs or not number:
            logger.warning(
                "chapter reference to %r: not a numbered chapter of the toc",
                target,
                location=node,
            )
            node.replace_self(nodes.Text(node.rawsource))
            continue
        ref = nodes.reference(
            "",
            "",
            internal=True,
            refuri=app.builder.get_relative_uri(fromdocname, target),
        )
        label = ".".join(map(str, number))
        if (app.config.language or "").startswith(
            "zh"
        ):  # the Chinese edition: 第 8 章“标题”
            ref += nodes.Text(f"第 {label} 章“{env.titles[target].astext()}”")
        else:
            ref += nodes.Text(f"{node['word']} {label}, ")
            ref += nodes.emphasis(text=env.titles[target].astext())
        node.replace_self(ref)


def setup(app):
    app.add_node(chapter_ref)
    app.add_role("chapter", ChapterRole())
    app.connect("doctree-resolved", _resolve)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
