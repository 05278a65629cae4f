"""The tree figures on the built website fit: measured in a real browser, every text of a tree
SVG lies inside its node's shape (or its panel's frame) and inside the SVG's viewBox.

Graphviz sizes each node from the metrics of the font it names; the browser draws the text
with the font it finds under that name. When the two differ, labels run past their boxes and
titles are cut at both ends. This test opens every built page that shows a tree (inline SVG in
``.kv-figure``, or an ``<img>`` of a graphviz SVG, which is opened as its own document), opens
every ``<details>`` and every hidden step-player frame so that they are measured too, waits for the page's fonts, and
measures each ``<text>`` with ``getBBox()`` mapped into the SVG's user space.

Like tests/book/test_site.py (whose headless Chromium and DevTools client it reuses), it skips when
``_build/html`` has not been built. Run as a script to print the measurements of some pages::

    .venv/bin/python tests/book/test_figures_site.py book/12_radix_tree.html
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_site import (  # noqa: F401  (browser: the module's Chromium fixture)
    HTML,
    PAGE_TIMEOUT_S,
    Chromium,
    DevToolsError,
    browser,
    find_chromium,
    needs_site,
    page_id,
)

TOLERANCE = 0.75  # points: anti-aliasing and rounding of graphviz's coordinates (2 decimals)

# For every graphviz SVG of the page (or the page itself when it is an SVG document): each text
# of a node inside the node's shape, each text of a cluster (a panel's caption) inside the
# cluster's frame, every text inside the viewBox. Boxes are in the root SVG's user units.
MEASURE = r"""
(async () => {
  document.querySelectorAll('details').forEach(d => { d.open = true; });
  if (document.fonts) await document.fonts.ready;
  await new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
  const tol = %(tol)s;
  const isGraphviz = s => s.querySelector(':scope > g.graph') !== null;
  const roots = document.documentElement.tagName.toLowerCase() === 'svg'
      ? [document.documentElement]
      : [...document.querySelectorAll('svg')].filter(s => s.closest('svg') === s && isGraphviz(s));
  for (const svg of roots)  // a step player shows one frame at a time: measure them all
    for (let el = svg; el; el = el.parentElement) if (el.hidden) el.hidden = false;
  await new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
  const box = (el, svg) => {
    const b = el.getBBox();
    const m = svg.getScreenCTM().inverse().multiply(el.getScreenCTM());
    const pts = [[b.x, b.y], [b.x + b.width, b.y], [b.x, b.y + b.height], [b.x + b.width, b.y + b.height]]
      .map(([x, y]) => new DOMPoint(x, y).matrixTransform(m));
    const xs = pts.map(p => p.x), ys = pts.map(p => p.y);
    return {x0: Math.min(...xs), y0: Math.min(...ys), x1: Math.max(...xs), y1: Math.max(...ys)};
  };
  const inside = (a, b) => a.x0 >= b.x0 - tol && a.y0 >= b.y0 - tol && a.x1 <= b.x1 + tol && a.y1 <= b.y1 + tol;
  const over = (a, b) => Math.max(b.x0 - a.x0, b.y0 - a.y0, a.x1 - b.x1, a.y1 - b.y1).toFixed(1);
  const name = g => { const t = g.querySelector(':scope > title'); return t ? t.textContent : g.id; };
  // The font graphviz measured with, served by the page itself (book/_static/fonts), not
  // borrowed from whatever the reader's machine has installed.
  const served = document.fonts ? [...document.fonts].some(
      f => f.family.replace(/["']/g, '') === 'DejaVu Sans' && f.status === 'loaded') : false;
  const out = [];
  roots.forEach((svg, index) => {
    const vb = svg.viewBox.baseVal;
    const view = {x0: vb.x, y0: vb.y, x1: vb.x + vb.width, y1: vb.y + vb.height};
    const fig = {index, width: vb.width, height: vb.height, texts: 0, problems: [], served,
                 inline: document.documentElement.tagName.toLowerCase() !== 'svg'};
    for (const t of svg.querySelectorAll('text')) {
      if (!t.textContent.trim()) continue;
      fig.texts += 1;
      const tb = box(t, svg);
      if (!inside(tb, view))
        fig.problems.push(`"${t.textContent}" outside the viewBox by ${over(tb, view)}`);
      const owner = t.closest('g.node, g.cluster');
      if (!owner) {  // the graph's label (title and colour key): inside the box drawn around it
        const frames = [...svg.querySelectorAll(':scope > g.graph > path, :scope > g.graph > polygon')].slice(1)
          .map(f => box(f, svg)).filter(f => f.x0 <= tb.x0 + 2 && tb.x0 + 2 <= f.x1 && f.y0 <= (tb.y0 + tb.y1) / 2
                                            && (tb.y0 + tb.y1) / 2 <= f.y1)
          .sort((a, b) => (b.x1 - b.x0) * (b.y1 - b.y0) - (a.x1 - a.x0) * (a.y1 - a.y0));
        if (frames.length && !inside(tb, frames[0]))
          fig.problems.push(`"${t.textContent}" outside the label's box by ${over(tb, frames[0])}`);
        continue;
      }
      const shape = owner.querySelector('path, polygon, ellipse');  // the outline comes first
      if (!shape) continue;
      const sb = box(shape, svg);
      if (!inside(tb, sb))
        fig.problems.push(`"${t.textContent}" outside its ${owner.classList[0]} ${name(owner)} by ${over(tb, sb)}`);
    }
    out.push(fig);
  });
  return out;
})()
""".replace("%(tol)s", str(TOLERANCE))


def measure(chrome: Chromium, url: str) -> list[dict]:
    """Open ``url`` in a fresh tab, wait for its load event, and run `MEASURE` in it."""
    return evaluate(chrome, url, MEASURE)


def graphviz_images(page: Path) -> list[Path]:
    """The graphviz SVG files a page shows through ``<img>`` (stored outputs of older runs)."""
    import re

    found = []
    for src in re.findall(r'<img[^>]+src="([^"]+\.svg)"', page.read_text()):
        path = (page.parent / unquote(urlparse(src).path)).resolve()
        if path.exists() and "Generated by graphviz" in path.read_text(errors="replace")[:2000]:
            found.append(path)
    return found


def tree_pages() -> list[Path]:
    """Built chapter pages (``book/*.html``, whatever their numbers) that show a tree figure."""
    if not HTML.exists():
        return []
    pages = []
    for page in sorted((HTML / "book").glob("*.html")):
        text = page.read_text()
        if 'class="kv-figure"' in text or 'class="graph"' in text or graphviz_images(page):
            pages.append(page)
    return pages


@needs_site
def test_some_page_shows_a_tree():
    assert tree_pages(), f"no page under {HTML / 'book'} shows a tree figure"


@needs_site
@pytest.mark.parametrize("page", tree_pages(), ids=page_id)
def test_tree_text_fits_its_shapes(browser, page):  # noqa: F811  (the fixture from test_site)
    """No text of a tree figure runs past its node, its panel or the figure's edge."""
    figures = measure(browser, page.as_uri())
    for svg in graphviz_images(page):
        figures += [dict(f, index=f"img {svg.name}") for f in measure(browser, svg.as_uri())]
    assert figures, f"{page_id(page)}: no tree figure found to measure"
    bad = {
        f"figure {f['index']} ({f['width']:.0f}x{f['height']:.0f} pt)": f["problems"][:8]
        for f in figures
        if f["problems"]
    }
    assert not bad, f"{page_id(page)}: text outside its shape or the SVG: {bad}"
    assert all(f["texts"] > 0 for f in figures), f"{page_id(page)}: a tree figure without text"
    unserved = [f["index"] for f in figures if f["inline"] and not f["served"]]
    assert not unserved, (
        f"{page_id(page)}: the page does not serve the figures' font (DejaVu Sans from "
        f"_static/fonts/kvcache-figures.css; is it in html_css_files?) for {unserved}"
    )


# In the theme's dark mode (pydata-sphinx-theme: <html data-theme="dark">), every figure must
# still read: the page really is dark, each picture sits on a light card (the pictures are
# drawn for a light background), every text of a tree lies inside that card, and the caption
# contrasts with the card (WCAG ratio of at least 4.5).
DARK = r"""
(async () => {
  document.documentElement.dataset.theme = 'dark';
  document.querySelectorAll('details').forEach(d => { d.open = true; });
  for (const f of document.querySelectorAll('.kvp-frame[hidden]')) f.hidden = false;
  if (document.fonts) await document.fonts.ready;
  await new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
  const lum = c => {
    const [r, g, b] = c.match(/[\d.]+/g).map(Number).slice(0, 3).map(v => {
      v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; });
    return 0.2126 * r + 0.7152 * g + 0.0722 * b;
  };
  const ratio = (a, b) => (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05);
  const page = lum(getComputedStyle(document.body).backgroundColor);
  const out = [];
  const pics = [...document.querySelectorAll('main svg, main .cell_output img, main figure img')]
    .filter(s => (s.tagName.toLowerCase() === 'img' || (s.closest('svg') === s && s.querySelector(':scope > g.graph')))
                 && !s.closest('.jupyter-widgets, .widget-area'));
  pics.forEach((pic, index) => {
    const problems = [];
    const card = pic.closest('figure');
    if (!card) { out.push({index, problems: ['not in a <figure> card']}); return; }
    const cs = getComputedStyle(card);
    const bg = lum(cs.backgroundColor);
    if (cs.backgroundColor === 'rgba(0, 0, 0, 0)' || bg < 0.7)
      problems.push(`card background ${cs.backgroundColor} is not light`);
    const cap = card.querySelector(':scope > figcaption');
    if (cap && ratio(lum(getComputedStyle(cap).color), bg) < 4.5)
      problems.push(`caption colour ${getComputedStyle(cap).color} on ${cs.backgroundColor}`);
    const c = card.getBoundingClientRect();
    for (const t of pic.tagName.toLowerCase() === 'svg' ? pic.querySelectorAll('text') : []) {
      if (!t.textContent.trim()) continue;
      const r = t.getBoundingClientRect();
      if (r.left < c.left - 1 || r.right > c.right + 1 || r.top < c.top - 1 || r.bottom > c.bottom + 1)
        problems.push(`"${t.textContent}" outside the figure's light card`);
    }
    out.push({index, problems: problems.slice(0, 6)});
  });
  return {page, figures: out};
})()
"""


def evaluate(chrome: Chromium, url: str, expression: str):
    """Open ``url`` in a fresh tab, wait for its load event, and evaluate ``expression``."""
    target = chrome.call("Target.createTarget", {"url": "about:blank"})["targetId"]
    session = chrome.call("Target.attachToTarget", {"targetId": target, "flatten": True})[
        "sessionId"
    ]
    try:
        chrome.call("Page.enable", session=session)
        chrome.take_events()
        chrome.call("Page.navigate", {"url": url}, session=session)
        deadline = time.monotonic() + PAGE_TIMEOUT_S
        while not any(
            e.get("method") == "Page.loadEventFired" and e.get("sessionId") == session
            for e in chrome.take_events()
        ):
            if time.monotonic() > deadline:
                raise DevToolsError(f"{url} did not load within {PAGE_TIMEOUT_S}s")
            time.sleep(0.05)
        result = chrome.call(
            "Runtime.evaluate",
            {"expression": expression, "awaitPromise": True, "returnByValue": True},
            session=session,
            timeout=PAGE_TIMEOUT_S,
        )
        if "exceptionDetails" in result:
            raise DevToolsError(f"evaluating on {url} failed: {result['exceptionDetails']}")
        return result["result"]["value"]
    finally:
        chrome.call("Target.closeTarget", {"targetId": target})


def figure_pages() -> list[Path]:
    """The landing page and every chapter page that shows a tree or a plot."""
    if not HTML.exists():
        return []
    intro = [p for p in [HTML / "book" / "intro.html"] if p.exists()]
    plots = [
        p
        for p in sorted((HTML / "book").glob("*.html"))
        if "<img" in p.read_text() and p not in tree_pages()
    ]
    return intro + tree_pages() + plots


@needs_site
@pytest.mark.parametrize("page", figure_pages(), ids=page_id)
def test_figures_read_in_the_dark_theme(browser, page):  # noqa: F811  (the fixture)
    """Dark mode: every figure's text stays on its light card, and its caption is legible."""
    state = evaluate(browser, page.as_uri(), DARK)
    assert state["page"] < 0.1, f"{page_id(page)}: the dark theme did not apply: {state}"
    bad = {f"figure {f['index']}": f["problems"] for f in state["figures"] if f["problems"]}
    assert not bad, f"{page_id(page)} in the dark theme: {bad}"


@needs_site
def test_full_size_svgs_fit(browser):  # noqa: F811  (the fixture)
    """The full-size SVG files the trees link to (book/_ext/kv_figures.py), opened on their
    own: every text inside its node and the viewBox, in the page's font."""
    files = sorted((HTML / "_images").glob("kv-tree-*.svg"))
    assert files, "no full-size tree SVG was written under _images/"
    bad = {}
    for svg in files:
        for f in measure(browser, svg.as_uri()):
            if f["problems"] or not f["texts"]:
                bad[svg.name] = f["problems"][:5] or ["no text"]
    assert not bad, f"full-size tree SVGs with text outside its shape: {bad}"


# --------------------------------------------------------------------------- the figures' HTML
# (no site needed: what kvcache.viz puts into a notebook's output, which the site shows as is)


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz `dot` is not installed")
def test_tree_figures_render_as_captioned_figures():
    """draw_tree and draw_sequence display as <figure class="kv-figure kv-tree"> with the SVG
    inline and a <figcaption>: the title (escaped) when given, else what the tree shows and
    what its colours mark. The title is not drawn a second time inside the inline SVG."""
    import torch

    from kvcache import RadixCacheManager
    from kvcache.viz import TreeRecorder, draw_sequence, draw_tree

    m = RadixCacheManager()
    m.insert_prefix(torch.tensor([1, 2, 3]), torch.arange(3, dtype=torch.int32))
    m.insert_prefix(torch.tensor([1, 2, 4]), torch.tensor([0, 1, 5], dtype=torch.int32))
    handle, _ = m.match_prefix(torch.tensor([1, 2, 3]))
    m.lock_handle(handle)
    title = 'the <b>locked</b> path & "its" leaf'
    html = draw_tree(m, title=title)._repr_mimebundle_()["text/html"]
    assert html.startswith('<figure class="kv-figure kv-tree"><div class="kv-figure-body"><svg')
    svg, caption = html.split("<figcaption", 1)
    assert 'class="kv-caption">the &lt;b&gt;locked&lt;/b&gt; path &amp; &quot;its&quot; leaf<' in (
        "<figcaption" + caption
    )
    assert "locked" not in svg, "the title is drawn in the inline SVG as well as the caption"
    assert "locked" in draw_tree(m, title=title).pipe(format="svg", encoding="utf-8")
    auto = draw_tree(m, evict_size=1).caption
    assert "3 nodes" in auto and "Blue" in auto and "evict(1)" in auto, auto
    rec = TreeRecorder(RadixCacheManager())
    rec.insert_prefix(torch.tensor([7, 8]), torch.arange(2, dtype=torch.int32))
    rec.insert_prefix(torch.tensor([7, 9]), torch.tensor([0, 2], dtype=torch.int32))
    seq = rec.draw(per_row=2)
    assert "panels" in seq.caption and "Green" in seq.caption, seq.caption
    assert draw_sequence(rec.snapshots, title="two inserts").caption == "two inserts"
    with pytest.raises(TypeError, match="title"):
        draw_sequence(rec.snapshots, title=3)


def test_captioned_plots_are_figures_and_refuse_bad_input():
    """captioned(fig, caption): a PNG in a captioned <figure class="kv-figure kv-plot">, the
    matplotlib figure closed (not shown twice); bad arguments raise, naming the argument."""
    import base64

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvcache.viz.figure import captioned

    fig, ax = plt.subplots(figsize=(2, 1))
    ax.plot([0, 1], [1, 0])
    for bad, exc, name in (
        (lambda: captioned(None, "x"), TypeError, "fig"),
        (lambda: captioned(fig, 3), TypeError, "caption"),
        (lambda: captioned(fig, "  "), ValueError, "caption"),
        (lambda: captioned(fig, "x", dpi=0), ValueError, "dpi"),
    ):
        with pytest.raises(exc, match=name):
            bad()
    assert plt.fignum_exists(fig.number), "a refused call closed the figure"
    plot = captioned(fig, "Look at <the> line")
    assert not plt.fignum_exists(fig.number)
    bundle = plot._repr_mimebundle_()
    assert base64.b64decode(bundle["image/png"])[:8] == b"\x89PNG\r\n\x1a\n"
    html = bundle["text/html"]
    assert html.startswith('<figure class="kv-figure kv-plot"><div class="kv-figure-body">')
    assert '<img src="data:image/png;base64,' in html
    assert '<figcaption class="kv-caption">Look at &lt;the&gt; line</figcaption></figure>' in html


def main(argv: list[str]) -> int:
    pages = [HTML / p for p in argv] or tree_pages()
    exe = find_chromium()
    if exe is None:
        print("chromium not found", file=sys.stderr)
        return 2
    b = Chromium(exe)
    bad = 0
    try:
        for page in pages:
            figures = measure(b, page.as_uri())
            for svg in graphviz_images(page):
                figures += [dict(f, index=f"img {svg.name[:12]}") for f in measure(b, svg.as_uri())]
            for f in figures:
                print(
                    f"{page_id(page)} figure {f['index']}: {f['width']:.0f}x{f['height']:.0f} pt, "
                    f"{f['texts']} texts, {len(f['problems'])} outside"
                )
                for p in f["problems"][:5]:
                    print("    " + p)
                bad += bool(f["problems"])
    finally:
        b.close()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
