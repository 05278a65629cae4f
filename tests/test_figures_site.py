"""The tree figures on the built website fit: measured in a real browser, every text of a tree
SVG lies inside its node's shape (or its panel's frame) and inside the SVG's viewBox.

Graphviz sizes each node from the metrics of the font it names; the browser draws the text
with the font it finds under that name. When the two differ, labels run past their boxes and
titles are cut at both ends. This test opens every built page that shows a tree (inline SVG in
``.kv-figure``, or an ``<img>`` of a graphviz SVG, which is opened as its own document), opens
every ``<details>`` and every hidden step-player frame so that they are measured too, waits for the page's fonts, and
measures each ``<text>`` with ``getBBox()`` mapped into the SVG's user space.

Like tests/test_site.py (whose headless Chromium and DevTools client it reuses), it skips when
``_build/html`` has not been built. Run as a script to print the measurements of some pages::

    .venv/bin/python tests/test_figures_site.py book/10_radix_tree.html
"""

from __future__ import annotations

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
            {"expression": MEASURE, "awaitPromise": True, "returnByValue": True},
            session=session,
            timeout=PAGE_TIMEOUT_S,
        )
        if "exceptionDetails" in result:
            raise DevToolsError(f"measuring {url} failed: {result['exceptionDetails']}")
        return result["result"]["value"]
    finally:
        chrome.call("Target.closeTarget", {"targetId": target})


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
