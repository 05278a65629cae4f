"""The Chinese edition stays in step with the English one (issue 29).

The catalogs (``locale/zh_CN/LC_MESSAGES/<page>.po``) are checked without a build:

- they are what extracting the English today gives (``scripts/zh_book.py check``: the gettext
  builder into a temporary folder, ``sphinx-intl update`` on a copy, compared byte for byte),
  so an English edit that was not followed by ``make catalogs`` fails here;
- no entry is untranslated or fuzzy, so an English edit that was followed by ``make catalogs``
  fails until its translation is done: a prose change carries its translation;
- every translation keeps its English's code spans, roles (name and target), math and link
  targets, starts no list or heading by accident (Sphinx would keep the English), and renders
  its emphasis (``**粗体。**后`` would show the asterisks);
- every term of ``locale/terminology.tsv`` is translated as the table says, and the
  glossary's terms too; no Taiwan wording.

With ``_build/html/zh`` built (``make book``; skipped otherwise), the Chinese site is checked:
every toc page exists, every page links to its counterpart and back, the toc captions and the
landing note are Chinese, the download button gives a notebook with Chinese markdown, and
searching 驱逐, 基数树 or 前缀 in Chromium finds the chapters that teach them. The browser checks
of tests/book/test_site.py (offline, figures, nothing wider than a phone, the menu on a phone) run on
the Chinese pages as well: its page lists include ``zh/``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MESSAGES = REPO / "locale" / "zh_CN" / "LC_MESSAGES"
TERMINOLOGY = REPO / "locale" / "terminology.tsv"
ZH = REPO / "_build" / "html" / "zh"
EN = REPO / "_build" / "html"

sys.path.insert(0, str(REPO / "book" / "_ext"))
sys.path.insert(0, str(REPO / "tests" / "book"))


@cache
def catalogs() -> dict[str, list]:
    from babel.messages.pofile import read_po

    out = {}
    for po in sorted(MESSAGES.rglob("*.po")):
        with po.open("rb") as f:
            catalog = read_po(f)
        out[str(po.relative_to(MESSAGES).with_suffix(""))] = [m for m in catalog if m.id]
    return out


def entries():
    return [(page, m) for page, ms in catalogs().items() for m in ms]


def test_there_is_a_catalog_per_page():
    from test_site import toc_files

    pages = {f for f in toc_files(REPO / "_toc.yml")}
    assert pages == set(catalogs()), f"toc pages and catalogs differ: {pages ^ set(catalogs())}"


# --------------------------------------------------------------------------- in step


def test_catalogs_match_the_english():
    """Extracting the English now and updating a copy of locale/ changes nothing (the check
    `make catalogs` would do; about a minute: the gettext builder reads every page)."""
    run = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "zh_book.py"), "check"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=900,
    )
    assert run.returncode == 0, (
        f"the catalogs are not what the English gives:\n{run.stderr[-4000:]}"
    )


def test_every_entry_is_translated_and_none_is_fuzzy():
    untranslated = [f"{page}: {m.id[:70]!r}" for page, m in entries() if not m.string]
    fuzzy = [f"{page}: {m.id[:70]!r}" for page, m in entries() if m.fuzzy]
    n = len(entries())
    assert not untranslated, f"{len(untranslated)} of {n} entries untranslated: {untranslated[:20]}"
    assert not fuzzy, f"{len(fuzzy)} fuzzy entries (the English changed): {fuzzy[:20]}"


# --------------------------------------------------------------------------- what must not change

_CODE = re.compile(r"(`+)(.+?)\1", re.S)
_ROLE = re.compile(r"\{([\w:.-]+)\}`([^`]*)`")
_MATH = re.compile(r"(?<![\\$])\$(?!\$)([^$\n]+?)(?<!\\)\$")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_HTML = re.compile(r"<[a-z][^>]*>")


def _role_target(role: str, body: str) -> str:
    explicit = re.match(r"^(.*?)\s*<([^<>]+)>$", body, re.S)
    if role in {"math"}:
        return body
    return explicit.group(2) if explicit else body


def placeholders(text: str) -> dict[str, list[str]]:
    """What a translation must keep: roles (name and target), code spans, math, links, tags."""
    roles = [f"{{{r}}}{_role_target(r, b)}" for r, b in _ROLE.findall(text)]
    rest = _ROLE.sub(" ", text)
    return {
        "roles": sorted(roles),
        "code": sorted(c for _, c in _CODE.findall(rest)),
        "math": sorted(_MATH.findall(_CODE.sub(" ", rest))),
        "links": sorted(_LINK.findall(rest)),
        "html": sorted(_HTML.findall(_CODE.sub(" ", rest))),
    }


def test_translations_keep_code_roles_math_and_links():
    bad = []
    for page, m in entries():
        if not m.string or m.id.startswith("\n"):  # display math: checked below
            continue
        want, got = placeholders(m.id), placeholders(m.string)
        for kind in want:
            # the same set: a translation may name a code span twice, never lose or invent one
            if set(want[kind]) != set(got[kind]):
                missing = sorted(set(want[kind]) - set(got[kind]))
                extra = sorted(set(got[kind]) - set(want[kind]))
                bad.append(f"{page}: {kind} missing {missing} extra {extra} in {m.id[:60]!r}")
    assert not bad, f"{len(bad)} translations that lost or added a placeholder:\n" + "\n".join(
        bad[:30]
    )


def test_display_math_is_kept():
    bad = [
        f"{page}: {m.id[:60]!r}"
        for page, m in entries()
        if m.id.startswith("\n") and m.string and m.string != m.id
    ]
    assert not bad, f"display math changed in translation: {bad}"


def test_no_translation_starts_a_list_or_a_heading():
    """Sphinx parses a msgstr as Markdown: one that starts with "1. " becomes a list, and the
    i18n transform then keeps the English without a word (scripts/zh_translate.py escapes)."""
    starts = re.compile(r"^(\d+[.)]\s|[-+*]\s|#+\s|>\s)")
    bad = [
        f"{page}: {m.string[:40]!r}"
        for page, m in entries()
        if m.string and starts.match(m.string) and not starts.match(m.id)
    ]
    assert not bad, f"translations Sphinx would read as a list or heading: {bad}"


@cache
def _markdown():
    from markdown_it import MarkdownIt
    from mdit_py_plugins.dollarmath import dollarmath_plugin

    return MarkdownIt("commonmark").use(dollarmath_plugin)


def _literal_asterisks(text: str) -> int:
    tokens = _markdown().parseInline(text)
    count = 0
    for token in tokens:
        for child in token.children or []:
            if child.type == "text":
                count += child.content.count("*")
    return count


def test_emphasis_renders_next_to_chinese_punctuation():
    """CommonMark does not close `**粗体。**` when a CJK letter follows (the closing run is not
    right-flanking), and shows the asterisks: no translation may have more literal asterisks
    than its English."""
    bad = [
        f"{page}: {m.string[:80]!r}"
        for page, m in entries()
        if m.string and _literal_asterisks(m.string) > _literal_asterisks(m.id)
    ]
    assert not bad, f"emphasis that would render as literal asterisks: {bad}"


# --------------------------------------------------------------------------- terminology


@cache
def terminology() -> list[dict[str, str]]:
    from zh_edition import terminology as rows

    return rows()


def prose(text: str) -> str:
    """The English that a reader reads as words: roles keep their shown title, code spans,
    math and link targets go. A `{term}` shows its body; a `{ref}`, `{doc}` or `{numref}`
    without an explicit title shows the target's title or number, never its label
    (``fig-request-steps`` is no use of the word "request")."""

    def shown(m: re.Match) -> str:
        explicit = re.match(r"^(.*?)\s*<[^<>]+>$", m.group(2), re.S)
        if explicit and m.group(1) in {"term", "doc", "ref", "numref"}:
            return explicit.group(1)
        return m.group(2) if m.group(1) == "term" else " "

    text = _ROLE.sub(shown, text)
    text = _CODE.sub(" ", text)
    text = _MATH.sub(" ", text)
    text = _LINK.sub("]", text)
    return text


def test_terminology_table_is_well_formed():
    rows = terminology()
    seen: dict[str, str] = {}
    for row in rows:
        assert row["en"] and row["zh"], row
        assert row["en"] not in seen, f"{row['en']} twice in the table"
        seen[row["en"]] = row["zh"]
        if row["pattern"]:
            re.compile(row["pattern"], re.I)


def test_terms_are_translated_as_the_table_says():
    """One English term, one Chinese term: an entry whose English uses a term of the table
    has the table's Chinese in its translation."""
    rows = [(r, re.compile(r["pattern"], re.I)) for r in terminology() if r["pattern"]]
    bad = []
    for page, m in entries():
        if not m.string or m.string == m.id:  # names and formulas stay as they are
            continue
        english = prose(m.id)
        for row, pattern in rows:
            if pattern.search(english) and row["zh"] not in m.string:
                bad.append(f"{page}: {row['en']!r} -> {row['zh']!r} missing in {m.string[:60]!r}")
    assert not bad, f"{len(bad)} entries that translate a term otherwise:\n" + "\n".join(bad[:40])


def test_glossary_terms_follow_the_table():
    """A glossary headword of the table is translated as the table says (and keeps the English
    in brackets, so two English synonyms stay two terms)."""
    table = {r["en"].lower(): r["zh"] for r in terminology()}
    glossary = (REPO / "book" / "glossary.md").read_text(encoding="utf-8")
    block = glossary.split("```{glossary}", 1)[1].split("\n```", 1)[0]
    heads = [line for line in block.splitlines() if line and not line.startswith(" ")]
    messages = {m.id: m.string for m in catalogs()["book/glossary"]}
    bad = []
    for head in heads:
        zh = messages.get(head)
        if zh is None:
            bad.append(f"{head!r} is not in the glossary's catalog")
        elif head.lower() in table and not zh.startswith(table[head.lower()]):
            bad.append(f"{head!r} -> {zh!r}, the table says {table[head.lower()]!r}")
        elif zh != head and f"（{head}）" not in zh:
            bad.append(f"{head!r} -> {zh!r}: the English in brackets is missing")
    assert not bad, bad


#: Taiwan (and Hong Kong) wording, in either script, where the mainland says otherwise.
TAIWAN = [
    "列印",
    "列印",
    "檔案",
    "档案",
    "程式",
    "預設",
    "预设",
    "伺服器",
    "搜寻",
    "搜尋",
    "軟體",
    "软体",
    "記憶體",
    "记忆体",
    "執行緒",
    "执行绪",
    "物件",
    "函式",
    "變數",
    "变数",
    "陣列",
    "阵列",
    "位元組",
    "位元组",
    "快取",
    "網路",
    "网路",
    "訊息",
    "讯息",
    "螢幕",
    "萤幕",
]


def test_mainland_wording_in_the_catalogs():
    bad = [
        f"{page}: {w} in {m.string[:60]!r}"
        for page, m in entries()
        for w in TAIWAN
        if w in (m.string or "")
    ]
    assert not bad, bad


# --------------------------------------------------------------------------- the notebooks


def test_markdown_cells_are_translated_block_by_block():
    from zh_edition import translate_markdown

    messages = {
        "Why it matters": "为什么重要",
        "A line that goes on over two lines.": "跨两行的一句话。",
        "one": "一",
        "Answer": "答案",
        "a | b": "甲 | 乙",
        "\nx = 1\n": "\nx = 1\n",
    }
    source = (
        "## Why it matters\n\nA line that goes\non over two lines.\n\n- one\n\n"
        "```{admonition} Answer\n:class: dropdown\nA line that goes\non over two lines.\n```\n\n"
        "```python\none\n```\n\n$$\nx = 1\n$$"
    )
    out = translate_markdown(source, messages)
    assert out == (
        "## 为什么重要\n\n跨两行的一句话。\n\n- 一\n\n"
        "```{admonition} 答案\n:class: dropdown\n跨两行的一句话。\n```\n\n"
        "```python\none\n```\n\n$$\nx = 1\n$$"
    )


# --------------------------------------------------------------------------- the built site

needs_zh = pytest.mark.skipif(
    not (ZH / "book" / "intro.html").exists(), reason="the zh site is not built: run `make book`"
)


def toc_html() -> list[str]:
    from test_site import toc_files

    return [f + ".html" for f in toc_files(REPO / "_toc.yml")]


@needs_zh
def test_every_toc_page_is_built_in_both_editions():
    missing = [p for p in toc_html() if not (ZH / p).exists() or not (EN / p).exists()]
    assert not missing, missing


@needs_zh
def test_every_page_links_to_its_counterpart():
    switch = re.compile(r'<a class="btn btn-sm kv-lang-switch" href="([^"]+)"')
    bad = []
    for root, other in ((EN, ZH), (ZH, EN)):
        for page in [*toc_html(), "search.html", "genindex.html"]:
            html = (root / page).read_text(encoding="utf-8")
            hrefs = switch.findall(html)
            if len(hrefs) != 1:
                bad.append(f"{root.name}/{page}: {len(hrefs)} language links")
                continue
            target = ((root / page).parent / hrefs[0]).resolve()
            if target != (other / page).resolve():
                bad.append(f"{root.name}/{page} links {hrefs[0]} -> {target}")
    assert not bad, bad


@needs_zh
def test_zh_pages_are_chinese():
    bad = []
    for page in toc_html():
        html = (ZH / page).read_text(encoding="utf-8")
        if '<html lang="zh-CN"' not in html:
            bad.append(f"{page}: not lang zh-CN")
        for w in TAIWAN:
            if w in html:
                bad.append(f"{page}: Taiwan wording {w}")
        title = re.search(r"<h1>(.*?)<", html, re.S)
        if page.startswith("book/api/"):
            continue
        if not title or not re.search(r"[\u4e00-\u9fff]", title.group(1)):
            bad.append(f"{page}: title {title.group(1) if title else None!r} is not Chinese")
    assert not bad, bad


@needs_zh
def test_toc_captions_and_landing_note_are_chinese():
    import yaml

    html = (ZH / "book" / "intro.html").read_text(encoding="utf-8")
    parts = [p["caption"] for p in yaml.safe_load((REPO / "_toc.yml").read_text())["parts"]]
    captions = re.findall(
        r'<p aria-level="2" class="caption" role="heading">'
        r'<span class="caption-text">(.*?)</span>',
        html,
    )
    assert len(captions) == len(parts), captions
    english = [c for c in captions if c in parts]
    assert not english, f"toc captions left in English on the zh site: {english}"
    assert "kv-edition-note" in html and "保持英文" in html, "the landing note is missing"
    page = (ZH / "book" / "04_request_life.html").read_text(encoding="utf-8")
    title = re.search(r"<title>(.*?)</title>", page, re.S).group(1)
    logo = re.search(r'logo__title">(.*?)<', page, re.S).group(1)
    assert "KV 缓存管理" in title and "KV 缓存管理" in logo, f"site title not Chinese: {title!r}"


@needs_zh
def test_figure_captions_are_chinese():
    """The captions the cells' figures carry (kvcache.viz writes them; book/_ext/kv_figures.py
    makes them text of the page, so the catalogs hold them and Sphinx translates them) read in
    Chinese on the zh pages. The number Sphinx puts first ("图 17.2") does not count."""
    caption = re.compile(r"<figcaption\b[^>]*>(.*?)</figcaption>", re.S)
    number = re.compile(r'<span class="caption-number">.*?</span>', re.S)
    found, english = 0, []
    for page in toc_html():
        for inner in caption.findall((ZH / page).read_text(encoding="utf-8")):
            text = re.sub(r"<[^>]+>", "", number.sub("", inner))
            if not re.search(r"[A-Za-z]{3}", text):
                continue
            found += 1
            if not re.search(r"[\u4e00-\u9fff]", text):
                english.append(f"{page}: {text[:70]!r}")
    assert found >= 40, f"expected the chapters' figure captions, found {found}"
    assert not english, f"figure captions left in English: {english}"


@needs_zh
def test_download_gives_a_chinese_notebook():
    bad = []
    for page in toc_html():
        source = REPO / page.replace(".html", ".ipynb")
        if not source.exists():
            continue
        html = (ZH / page).read_text(encoding="utf-8")
        assert f"_sources/{Path(page).stem}.ipynb" in html or "_sources/book/" in html
        english = json.loads(source.read_text(encoding="utf-8"))
        zh = json.loads((ZH / "_sources" / page.replace(".html", ".ipynb")).read_text("utf-8"))
        assert [c["cell_type"] for c in zh["cells"]] == [c["cell_type"] for c in english["cells"]]
        messages = {
            m.id for m in catalogs()[page[: -len(".html")]] if len(m.id) > 30 and m.string != m.id
        }
        for en_cell, zh_cell in zip(english["cells"], zh["cells"], strict=True):
            if en_cell["cell_type"] != "markdown":
                if zh_cell["source"] != en_cell["source"]:
                    bad.append(f"{page}: a code cell changed")
                continue
            text = "".join(zh_cell["source"])
            joined = " ".join(text.split())
            left = [msg for msg in messages if msg in joined]
            if left:
                bad.append(f"{page}: English left in a markdown cell: {left[0][:60]!r}")
            if not re.search(r"[\u4e00-\u9fff]", text):
                bad.append(f"{page}: a markdown cell without Chinese: {text[:60]!r}")
    assert not bad, bad[:20]


@needs_zh
@pytest.mark.parametrize(
    "query, page",
    [
        ("驱逐", "book/13_lock_evict.html"),
        ("基数树", "book/12_radix_tree.html"),
        ("前缀", "book/12_radix_tree.html"),
    ],
)
def test_chinese_search_finds_the_teaching_page(browser, query, page):  # noqa: F811
    from urllib.parse import quote

    tab = browser.open_tab((ZH / "search.html").as_uri() + "?q=" + quote(query), 1400)
    try:
        hrefs = tab.eval("""new Promise(resolve => {
            const t0 = Date.now();
            const poll = () => {
                const items = [...document.querySelectorAll('#search-results li a')];
                const done = document.querySelector('#search-results p.search-summary');
                if ((done && items.length) || Date.now() - t0 > 20000) {
                    resolve(items.map(a => new URL(a.href).pathname));
                } else setTimeout(poll, 100);
            };
            poll();
        })""")
    finally:
        tab.close()
    assert hrefs, f"searching {query} on the zh site found nothing"
    assert any(h.endswith(page) for h in hrefs[:5]), f"{query}: {hrefs[:8]}"


from test_site import browser  # noqa: E402,F401  (the module's Chromium fixture)
