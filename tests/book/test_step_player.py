"""The explorer's step player (chapter 19) works on the built website: clicks change the
picture and caption.

Opens ``_build/html/book/19_explorer.html`` in headless Chromium (the DevTools client of
``tests/book/test_site.py``), and with real mouse clicks on the player's buttons checks that
*next*, *previous*, *last* and *play* / *pause* move the player: exactly one frame (one
pre-rendered SVG tree) is shown, it is the frame of the current step, it is drawn with a
non-zero size, and the caption above it is that step's caption. Every request the page makes
must stay inside ``file://`` (and friends), and the page must throw no JavaScript error.

``make test`` builds the book first; the test skips only when the site is not built (no
``_build/html/index.html``, the condition ``tests/book/test_site.py`` uses). A second test needs no
site: it opens a player whose captions, title and token text are built to break out of their
HTML and script contexts, and checks that the browser shows them as text and runs nothing else.
"""

from __future__ import annotations

import json
import shutil
import time
from urllib.parse import urlparse

import pytest
import torch
from test_site import (  # noqa: F401  (fixture)
    DESKTOP_WIDTH,
    HTML,
    LOCAL_SCHEMES,
    PAGE_TIMEOUT_S,
    PHONE_WIDTH,
    QUIET_S,
    Chromium,
    browser,
    find_chromium,
    needs_site,
)

from kvcache import RadixCacheManager
from kvcache.serving.tokenizer import ByteTokenizer
from kvcache.viz import TreeRecorder, render_svg, step_player

PAGE = HTML / "book" / "19_explorer.html"

needs_chromium = pytest.mark.skipif(find_chromium() is None, reason="Chromium not found")

# Describes the first player on the page: its step attribute, its frames, and what is shown.
STATE = r"""
(() => {
  const p = document.querySelector('.kvp');
  if (!p) return null;
  const frames = [...p.querySelectorAll('.kvp-frame')];
  const shown = frames.filter(f => !f.hidden && getComputedStyle(f).display !== 'none');
  const svg = shown.length === 1 ? shown[0].querySelector('svg') : null;
  const r = svg ? svg.getBoundingClientRect() : {width: 0, height: 0};
  return {
    ready: p.getAttribute('data-ready') === '1',
    step: parseInt(p.getAttribute('data-step'), 10),
    playing: p.getAttribute('data-playing') === '1',
    n: frames.length,
    shown: shown.map(f => parseInt(f.getAttribute('data-step'), 10)),
    svg_w: r.width, svg_h: r.height,
    svg_nodes: svg ? svg.querySelectorAll('g.node').length : 0,
    svg_text: svg ? svg.textContent.replace(/\s+/g, ' ').trim() : '',
    caption: p.querySelector('.kvp-caption').textContent,
    frame_caption: shown.length === 1 ? shown[0].getAttribute('data-caption') : null,
    count: p.querySelector('.kvp-count').textContent,
    prev_disabled: p.querySelector('.kvp-prev').disabled,
    next_disabled: p.querySelector('.kvp-next').disabled,
    play_label: p.querySelector('.kvp-play').textContent,
  };
})()
"""


class Page:
    """One open tab: evaluate JavaScript, click elements with the mouse, and record requests."""

    def __init__(self, b: Chromium, url: str) -> None:
        self.b = b
        self.target = b.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = b.call("Target.attachToTarget", {"targetId": self.target, "flatten": True})[
            "sessionId"
        ]
        self.sessions = {self.session}
        self.requests: list[str] = []
        self.js_errors: list[str] = []
        for m in ("Network.enable", "Page.enable", "Runtime.enable"):
            b.call(m, session=self.session)
        b.call(
            "Target.setAutoAttach",
            {"autoAttach": True, "waitForDebuggerOnStart": True, "flatten": True},
            session=self.session,
        )
        b.take_events()
        b.send("Page.navigate", {"url": url}, session=self.session)
        self.settle(require_load=True)

    def pump(self) -> bool:
        """Handle events so far; True if there was network activity or the page loaded."""
        active = False
        for ev in self.b.take_events():
            method, params = ev.get("method"), ev.get("params", {})
            if ev.get("sessionId") not in self.sessions:
                continue
            if method == "Target.attachedToTarget":
                child = params["sessionId"]
                self.sessions.add(child)
                for m in ("Network.enable", "Runtime.runIfWaitingForDebugger"):
                    self.b.send(m, session=child)
            elif method == "Network.requestWillBeSent":
                self.requests.append(params["request"]["url"])
                active = True
            elif method == "Network.webSocketCreated":
                self.requests.append(params["url"])
            elif method in (
                "Network.loadingFinished",
                "Network.loadingFailed",
                "Page.loadEventFired",
            ):
                active = True
                if method == "Page.loadEventFired":
                    self.loaded = True
            elif method == "Runtime.exceptionThrown":
                d = params["exceptionDetails"]
                self.js_errors.append(
                    (d.get("exception") or {}).get("description") or d.get("text", "?")
                )
        return active

    def settle(self, require_load: bool = False) -> None:
        self.loaded = not require_load
        deadline = time.monotonic() + PAGE_TIMEOUT_S
        last = time.monotonic()
        while time.monotonic() < deadline:
            if self.pump():
                last = time.monotonic()
            if self.loaded and time.monotonic() - last >= QUIET_S:
                return
            time.sleep(0.05)
        raise AssertionError(f"page did not settle within {PAGE_TIMEOUT_S}s")

    def eval(self, expression: str):
        res = self.b.call(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
            session=self.session,
        )
        if "exceptionDetails" in res:
            raise AssertionError(f"evaluating {expression[:80]!r}: {res['exceptionDetails']}")
        self.pump()
        return res["result"].get("value")

    def state(self) -> dict:
        return self.eval(STATE)

    def click(self, selector: str) -> None:
        """A real mouse click (press and release) at the centre of the element."""
        sel = json.dumps(selector)
        box = self.eval(f"""(() => {{
            const e = document.querySelector('.kvp').querySelector({sel});
            e.scrollIntoView({{block: 'center'}});
            const r = e.getBoundingClientRect();
            return [r.x + r.width / 2, r.y + r.height / 2, r.width, r.height];
        }})()""")
        assert box[2] > 0 and box[3] > 0, f"{selector} is not visible"
        for kind in ("mousePressed", "mouseReleased"):
            self.b.call(
                "Input.dispatchMouseEvent",
                {"type": kind, "x": box[0], "y": box[1], "button": "left", "clickCount": 1},
                session=self.session,
            )
        self.pump()

    def wait_for(self, predicate, timeout: float = 15.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            s = self.state()
            if predicate(s) or time.monotonic() > deadline:
                return s
            time.sleep(0.1)

    def close(self) -> None:
        self.b.call("Target.closeTarget", {"targetId": self.target})

    @property
    def external(self) -> list[str]:
        return sorted({u for u in self.requests if urlparse(u).scheme not in LOCAL_SCHEMES})


def check_shows(s: dict, step: int, captions: dict) -> None:
    """The player shows step ``step`` and nothing else, drawn, with that step's caption."""
    assert s["step"] == step, s
    assert s["shown"] == [step], f"exactly frame {step} should be shown, got {s['shown']}"
    assert s["svg_w"] > 50 and s["svg_h"] > 20 and s["svg_nodes"] >= 1, (
        f"frame {step} is not drawn: {s}"
    )
    assert s["caption"] == s["frame_caption"], s
    assert s["count"] == f"{step + 1} / {s['n']}"
    captions[step] = (s["caption"], s["svg_text"])


# Skips (like tests/book/test_site.py) only when the site was not built: no _build/html/index.html.
@needs_site
def test_step_player_clicks_through(browser):  # noqa: F811  (the fixture imported from test_site)
    assert PAGE.exists(), f"{PAGE} was not built (chapter 19 must be in _toc.yml)"
    page = Page(browser, PAGE.as_uri())
    try:
        s = page.state()
        assert s is not None, "no step player (.kvp) on the page"
        assert s["ready"], "the player's script did not run"
        n = s["n"]
        assert n >= 3, f"the recorded session should have several steps, got {n}"
        seen: dict = {}
        check_shows(s, 0, seen)
        assert s["prev_disabled"] and not s["next_disabled"]

        page.click(".kvp-next")
        s = page.state()
        check_shows(s, 1, seen)
        assert not s["prev_disabled"]
        page.click(".kvp-next")
        check_shows(page.state(), 2, seen)
        page.click(".kvp-prev")
        check_shows(page.state(), 1, seen)
        page.click(".kvp-prev")
        check_shows(page.state(), 0, seen)

        # each step has its own caption and its own picture
        assert len({seen[i][0] for i in range(3)}) == 3, f"captions do not change: {seen}"
        assert len({seen[i][1] for i in range(3)}) == 3, "the picture does not change between steps"

        page.click(".kvp-last")
        s = page.state()
        check_shows(s, n - 1, seen)
        assert s["next_disabled"] and not s["prev_disabled"]
        page.click(".kvp-first")
        check_shows(page.state(), 0, seen)

        # play advances on its own, pause stops it
        page.click(".kvp-play")
        s = page.wait_for(lambda s: s["step"] >= 2)
        assert s["playing"] and s["step"] >= 2, f"play did not advance: {s}"
        check_shows(s, s["step"], seen)
        assert "pause" in s["play_label"]
        page.click(".kvp-play")
        s = page.state()
        assert not s["playing"] and "play" in s["play_label"]
        stopped = s["step"]
        time.sleep(2.0)
        check_shows(page.state(), stopped, seen)  # paused: it stays

        page.settle()
        assert not page.external, f"the page requested resources outside file://: {page.external}"
        assert not page.js_errors, f"JavaScript errors: {page.js_errors}"
    finally:
        page.close()


#: Strings that would run script or end an element if pasted into the page unescaped.
HOSTILE = [
    '<img src=x onerror="window.__pwned=1">',
    "</script><script>window.__pwned=1</script>",
    '" onmouseover="window.__pwned=1" x="',
    "</div></div><b>out</b> &amp; &lt; \\N ' `${1}`",
]


@needs_chromium
@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz `dot` is not installed")
def test_hostile_strings_stay_text_in_the_browser(browser, tmp_path):  # noqa: F811
    tok = ByteTokenizer()
    rec = TreeRecorder(RadixCacheManager(), decode=tok)
    for i, text in enumerate(HOSTILE):
        rec.insert_prefix(
            tok.encode(text), torch.arange(100 * i, 100 * i + len(text.encode()), dtype=torch.int32)
        )
        rec.record(text)  # a caption that is the hostile string itself
    player = step_player(rec, title=HOSTILE[0], start=1, render=render_svg)
    page_file = tmp_path / "player.html"
    page_file.write_text(
        f'<!DOCTYPE html><html><head><meta charset="utf-8"></head><body>{player.html}</body></html>',
        encoding="utf-8",
    )
    page = Page(browser, page_file.as_uri())
    try:
        s = page.state()
        assert s is not None and s["ready"], "the player's script did not run"
        assert s["n"] == player.num_steps
        assert page.eval("document.querySelectorAll('script').length") == 1
        assert (
            page.eval("document.querySelectorAll('img, body > b, .kvp b:not(.kvp-title b)').length")
            == 0
        )
        assert page.eval("document.querySelector('.kvp-title').textContent") == HOSTILE[0]
        seen = {}
        for step in range(player.num_steps):
            s = page.state()
            check_shows(s, step, seen)
            assert s["caption"] == rec.snapshots[step + 1].caption
            if step + 1 < player.num_steps:
                page.click(".kvp-next")
        shown = " ".join(text for text, _ in seen.values())
        assert all(h in shown for h in HOSTILE[1:])
        for x in (10, 200, 400):  # hover the frame and the bar: no handler of a caption may run
            browser.call(
                "Input.dispatchMouseEvent",
                {"type": "mouseMoved", "x": x, "y": 60},
                session=page.session,
            )
        page.settle()
        assert page.eval("window.__pwned === undefined"), "a caption or title ran as script"
        assert not page.js_errors, f"JavaScript errors: {page.js_errors}"
        assert not page.external, f"the page requested resources outside file://: {page.external}"
    finally:
        page.close()


@needs_site
def test_step_player_keeps_its_height(browser):  # noqa: F811  (the fixture imported from test_site)
    """Stepping through the frames does not move the page: the player is as tall on every step
    (book/_static/book.css stacks the frames in one grid cell), at a laptop's and a phone's
    width."""
    for width in (DESKTOP_WIDTH, PHONE_WIDTH):
        tab = browser.open_tab(PAGE.as_uri(), width)
        try:
            # the theme scrolls smoothly: a click must not land while the page still moves
            tab.eval("document.documentElement.style.scrollBehavior = 'auto'")
            n = tab.eval(
                "document.querySelectorAll('.kvp')[0].querySelectorAll('.kvp-frame').length"
            )
            assert n >= 3, f"the player should have several frames, got {n}"
            heights = []
            for step in range(n):
                box = tab.eval("""(() => {
                    const p = document.querySelector('.kvp');
                    p.scrollIntoView({block: 'start'});
                    const b = p.querySelector('.kvp-next').getBoundingClientRect();
                    return [p.getBoundingClientRect().height, parseInt(p.getAttribute('data-step')),
                            b.x + b.width / 2, b.y + b.height / 2];
                })()""")
                assert box[1] == step, f"the player should be at step {step}: {box}"
                heights.append(box[0])
                if step < n - 1:
                    tab.click(box[2], box[3])
            assert max(heights) - min(heights) <= 1, (
                f"at {width}px the player's height changes between steps: {heights}"
            )
        finally:
            tab.close()


# At a phone's width: the page does not scroll sideways, and the player (its bar, caption and
# every frame, the hidden ones included) fits inside the text column.
PHONE_FIT = r"""
(() => {
  const out = {page: document.documentElement.scrollWidth, width: innerWidth, players: []};
  for (const p of document.querySelectorAll('.kvp')) {
    p.scrollIntoView({block: 'start'});
    const box = p.getBoundingClientRect();
    const wide = [];
    for (const el of p.querySelectorAll('.kvp-bar, .kvp-caption, .kvp-frame, .kvp-frame svg, button, input')) {
      const r = el.getBoundingClientRect();
      if (r.width && (r.right > box.right + 1 || r.left < box.left - 1))
        wide.push(`${el.className.baseVal ?? el.className} ${r.left.toFixed(0)}..${r.right.toFixed(0)}`);
    }
    out.players.push({left: box.left, right: box.right, scroll: p.scrollWidth - p.clientWidth,
                      wide: wide.slice(0, 5)});
  }
  return out;
})()
"""


def check_fits_a_phone(tab, where: str) -> None:
    state = tab.eval(PHONE_FIT)
    assert state["players"], f"{where}: no step player found"
    assert state["page"] <= PHONE_WIDTH, (
        f"{where}: the page scrolls sideways at {PHONE_WIDTH}px: {state}"
    )
    for p in state["players"]:
        assert p["right"] <= PHONE_WIDTH + 0.5 and p["left"] >= -0.5, (
            f"{where}: player off screen: {p}"
        )
        assert p["scroll"] <= 1 and not p["wide"], f"{where}: wider than the player: {p}"


@needs_site
def test_step_player_fits_a_phone(browser):  # noqa: F811  (the fixture imported from test_site)
    """At 420 px the chapter's player shrinks its frames to the column (no sideways scroll)."""
    tab = browser.open_tab(PAGE.as_uri(), PHONE_WIDTH)
    try:
        check_fits_a_phone(tab, "chapter 19")
    finally:
        tab.close()


@needs_chromium
@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz `dot` is not installed")
def test_step_player_fits_a_phone_on_its_own(browser, tmp_path):  # noqa: F811
    """The player's own stylesheet (Jupyter, no book.css) shrinks it to a phone's width too,
    with a tree much wider than the phone."""
    tok = ByteTokenizer()
    rec = TreeRecorder(RadixCacheManager(), decode=tok)
    for i in range(6):
        text = f"a rather long shared prefix number {i} that widens the tree"
        rec.insert_prefix(
            tok.encode(text), torch.arange(100 * i, 100 * i + len(text), dtype=torch.int32)
        )
    player = step_player(rec, start=1)
    page_file = tmp_path / "player.html"
    page_file.write_text(
        '<!DOCTYPE html><html><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1"></head>'
        f"<body style='margin:8px'>{player.html}</body></html>",
        encoding="utf-8",
    )
    tab = browser.open_tab(page_file.as_uri(), PHONE_WIDTH)
    try:
        check_fits_a_phone(tab, "a player on its own")
    finally:
        tab.close()
