"""The built website works offline: every page opens in headless Chromium, every figure
loads, and no page requests anything outside ``file://``.

``make test`` builds the book first (``make book``), so ``_build/html`` exists here; the
tests skip only when it does not (e.g. ``pytest tests/`` run by hand before a build).

The browser is Debian's ``chromium`` driven over the Chrome DevTools Protocol through
``--remote-debugging-pipe`` (file descriptors 3 and 4), which needs no extra Python package
and no TCP port. Every request a page makes (from the page, its frames and its workers) is
recorded with ``Network.requestWillBeSent``; DNS is mapped to nothing as a second line of
defence, so a page that tries to reach a CDN fails here even on a machine with network.

Run as a script to look at a page yourself::

    .venv/bin/python tests/book/test_site.py --screenshot /tmp/intro.png book/intro.html
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

REPO = Path(__file__).resolve().parents[2]
# BOOK_ROOT: the directory holding _toc.yml and _build/html (the repository by default).
BOOK_ROOT = Path(os.environ.get("BOOK_ROOT", REPO)).resolve()
HTML = BOOK_ROOT / "_build" / "html"
LOCAL_SCHEMES = {"file", "data", "blob", "about"}
PAGE_TIMEOUT_S = 60.0
DESKTOP_WIDTH = 1400  # a laptop: every page is visited (and its layout checked) at this width
PHONE_WIDTH = 420
QUIET_S = 1.0  # a page is settled when no request started or finished for this long


def find_chromium() -> str | None:
    for name in (os.environ.get("CHROMIUM"), "/usr/bin/chromium", "chromium", "chromium-browser"):
        if name and (path := shutil.which(name)):
            return path
    return None


# --------------------------------------------------------------------------- DevTools client


class DevToolsError(RuntimeError):
    pass


class Chromium:
    """Headless Chromium and a minimal CDP client over --remote-debugging-pipe."""

    def __init__(self, executable: str):
        self.profile = tempfile.mkdtemp(prefix="kvcache-site-chromium-")
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()
        # The child's ends move to fds 3 and 4; keep them clear of those numbers first.
        to_chrome_r, from_chrome_w = (self._high_fd(to_chrome_r), self._high_fd(from_chrome_w))
        args = [
            executable,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-extensions",
            "--disable-dev-shm-usage",
            "--mute-audio",
            "--hide-scrollbars",
            "--window-size=1280,900",
            # Nothing resolves: a request that escapes file:// cannot reach the network.
            "--host-resolver-rules=MAP * ~NOTFOUND",
            f"--user-data-dir={self.profile}",
            "--remote-debugging-pipe",
            "about:blank",
        ]
        # Chromium reads commands from fd 3 and writes replies to fd 4.
        script = f'exec "$0" "$@" 3<&{to_chrome_r} 4>&{from_chrome_w} {to_chrome_r}<&- {from_chrome_w}>&-'
        self.proc = subprocess.Popen(
            ["/bin/bash", "-c", script, *args],
            pass_fds=(to_chrome_r, from_chrome_w),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._next_id = 0
        self._replies: dict[int, dict] = {}
        self._events: list[dict] = []
        self._cond = threading.Condition()
        self._closed = False
        self._stderr_tail: list[bytes] = []
        threading.Thread(target=self._read_loop, daemon=True).start()
        threading.Thread(target=self._stderr_loop, daemon=True).start()
        self.call("Browser.getVersion", timeout=30)

    @staticmethod
    def _high_fd(fd: int) -> int:
        import fcntl

        high = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
        os.close(fd)
        return high

    # -- transport
    def _read_loop(self) -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(self._from_chrome, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                break
            buf += chunk
            *messages, buf = buf.split(b"\0")
            with self._cond:
                for raw in messages:
                    msg = json.loads(raw)
                    if "id" in msg:
                        self._replies[msg["id"]] = msg
                    else:
                        self._events.append(msg)
                self._cond.notify_all()
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _stderr_loop(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._stderr_tail = ([*self._stderr_tail, line])[-20:]

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> int:
        self._next_id += 1
        msg: dict = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._to_chrome, json.dumps(msg).encode() + b"\0")
        return self._next_id

    def call(
        self,
        method: str,
        params: dict | None = None,
        session: str | None = None,
        timeout: float = 30.0,
    ) -> dict:
        msg_id = self.send(method, params, session)
        deadline = time.monotonic() + timeout
        with self._cond:
            while msg_id not in self._replies:
                left = deadline - time.monotonic()
                if self._closed or left <= 0:
                    tail = b"".join(self._stderr_tail).decode(errors="replace")
                    raise DevToolsError(f"no reply to {method} (chromium said: {tail[-2000:]})")
                self._cond.wait(left)
            reply = self._replies.pop(msg_id)
        if "error" in reply:
            raise DevToolsError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def take_events(self) -> list[dict]:
        with self._cond:
            events, self._events = self._events, []
        return events

    def close(self) -> None:
        with contextlib.suppress(DevToolsError):
            self.call("Browser.close", timeout=10)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._to_chrome, self._from_chrome):
            with contextlib.suppress(OSError):
                os.close(fd)
        shutil.rmtree(self.profile, ignore_errors=True)

    # -- pages
    def visit(self, url: str, screenshot: Path | None = None) -> Visit:
        """Open url in a fresh tab, wait until it settles, and report what it did."""
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})[
            "sessionId"
        ]
        visit = Visit(url)
        sessions = {session}
        try:
            self.call("Network.enable", session=session)
            self.call("Page.enable", session=session)
            self.call("Runtime.enable", session=session)
            self.call(
                "Emulation.setDeviceMetricsOverride",
                {
                    "width": DESKTOP_WIDTH,
                    "height": 900,
                    "deviceScaleFactor": 1,
                    "mobile": False,
                },
                session=session,
            )
            # Frames in other processes and workers get their own sessions; hold them until
            # their network is watched, then let them run.
            self.call(
                "Target.setAutoAttach",
                {"autoAttach": True, "waitForDebuggerOnStart": True, "flatten": True},
                session=session,
            )
            self.take_events()
            self.send("Page.navigate", {"url": url}, session=session)
            deadline = time.monotonic() + PAGE_TIMEOUT_S
            loaded = False
            pending: set[str] = set()
            urls: dict[str, str] = {}
            last_activity = time.monotonic()
            while True:
                for ev in self.take_events():
                    method, params = ev.get("method"), ev.get("params", {})
                    if ev.get("sessionId") not in sessions:
                        continue
                    if method == "Target.attachedToTarget":
                        child = params["sessionId"]
                        sessions.add(child)
                        for m in ("Network.enable", "Runtime.runIfWaitingForDebugger"):
                            self.send(m, session=child)
                    elif method == "Network.requestWillBeSent":
                        pending.add(params["requestId"])
                        urls[params["requestId"]] = params["request"]["url"]
                        visit.requests.append(params["request"]["url"])
                        last_activity = time.monotonic()
                    elif method == "Network.webSocketCreated":
                        visit.requests.append(params["url"])
                    elif method in ("Network.loadingFinished", "Network.loadingFailed"):
                        pending.discard(params["requestId"])
                        last_activity = time.monotonic()
                        if method == "Network.loadingFailed" and not params.get("canceled"):
                            visit.failed.append(
                                f"{params.get('errorText')} {urls.get(params['requestId'], '?')}"
                            )
                    elif method == "Network.responseReceived":
                        status = params["response"].get("status", 200)
                        if status >= 400:
                            visit.failed.append(f"HTTP {status} {params['response']['url']}")
                    elif method == "Page.loadEventFired":
                        loaded = True
                        last_activity = time.monotonic()
                    elif method == "Runtime.exceptionThrown":
                        d = params["exceptionDetails"]
                        visit.js_errors.append(
                            (d.get("exception") or {}).get("description") or d.get("text", "?")
                        )
                now = time.monotonic()
                if loaded and not pending and now - last_activity >= QUIET_S:
                    break
                if now > deadline:
                    visit.timed_out = True
                    break
                time.sleep(0.05)
            result = self.call(
                "Runtime.evaluate",
                {
                    "expression": FIGURE_PROBE,
                    "awaitPromise": True,
                    "returnByValue": True,
                },
                session=session,
                timeout=PAGE_TIMEOUT_S,
            )
            if "exceptionDetails" in result:
                raise DevToolsError(f"figure probe failed on {url}: {result['exceptionDetails']}")
            visit.figures = result["result"]["value"]
            result = self.call(
                "Runtime.evaluate",
                {
                    "expression": LAYOUT_PROBE,
                    "awaitPromise": True,
                    "returnByValue": True,
                },
                session=session,
                timeout=PAGE_TIMEOUT_S,
            )
            if "exceptionDetails" in result:
                raise DevToolsError(f"layout probe failed on {url}: {result['exceptionDetails']}")
            visit.layout = result["result"]["value"]
            if screenshot is not None:
                size = self.call("Page.getLayoutMetrics", session=session)["cssContentSize"]
                clip = {
                    "x": 0,
                    "y": 0,
                    "width": size["width"],
                    "height": min(size["height"], 8000),
                    "scale": 1,
                }
                shot = self.call(
                    "Page.captureScreenshot",
                    {"format": "png", "clip": clip, "captureBeyondViewport": True},
                    session=session,
                )
                import base64

                screenshot.write_bytes(base64.b64decode(shot["data"]))
        finally:
            self.call("Target.closeTarget", {"targetId": target})
        return visit

    def open_tab(self, url: str, width: int, height: int = 900) -> Tab:
        """A page at the given viewport size, loaded and settled, to drive by hand."""
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})[
            "sessionId"
        ]
        tab = Tab(self, target, session)
        self.call("Page.enable", session=session)
        self.call(
            "Emulation.setDeviceMetricsOverride",
            {
                "width": width,
                "height": height,
                "deviceScaleFactor": 1,
                "mobile": width < 992,
            },
            session=session,
        )
        self.take_events()
        self.send("Page.navigate", {"url": url}, session=session)
        deadline = time.monotonic() + PAGE_TIMEOUT_S
        while time.monotonic() < deadline:
            if any(
                ev.get("method") == "Page.loadEventFired" and ev.get("sessionId") == session
                for ev in self.take_events()
            ):
                break
            time.sleep(0.05)
        tab.wait_idle()
        return tab


class Tab:
    """One open page: evaluate JavaScript in it and click like a mouse."""

    def __init__(self, browser: Chromium, target: str, session: str):
        self.b, self.target, self.session = browser, target, session

    def eval(self, expression: str):
        res = self.b.call(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
            session=self.session,
        )
        if "exceptionDetails" in res:
            raise DevToolsError(f"evaluating {expression[:80]!r}: {res['exceptionDetails']}")
        return res["result"].get("value")

    def wait_idle(self) -> None:
        """Until the page's scripts and layout are done (two animation frames after load)."""
        self.eval("new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
        time.sleep(QUIET_S)

    def click(self, x: float, y: float) -> None:
        """A real mouse click (press and release) at viewport coordinates."""
        for kind in ("mousePressed", "mouseReleased"):
            self.b.call(
                "Input.dispatchMouseEvent",
                {"type": kind, "x": x, "y": y, "button": "left", "clickCount": 1},
                session=self.session,
            )
        self.wait_idle()

    def close(self) -> None:
        self.b.call("Target.closeTarget", {"targetId": self.target})


# Runs in the page once it has settled: make lazy images load, then describe every figure.
FIGURE_PROBE = r"""
(async () => {
  const imgs = [...document.querySelectorAll('img')];
  imgs.forEach(i => { i.loading = 'eager'; });
  await Promise.all(imgs.map(i => i.decode().catch(() => null)));
  const inOutput = el => !!el.closest('.cell_output, .output, figure, article');
  const figs = [];
  for (const i of imgs) {
    figs.push({kind: 'img', src: i.currentSrc || i.src, ok: i.complete && i.naturalWidth > 0,
               width: i.naturalWidth, output: !!i.closest('.cell_output, .output')});
  }
  for (const o of document.querySelectorAll('object')) {
    const r = o.getBoundingClientRect();
    let ok = r.width > 0 && r.height > 0;
    try { if (o.contentDocument) ok = ok && !!o.contentDocument.documentElement; } catch (e) {}
    figs.push({kind: 'object', src: o.data, ok, width: r.width, output: !!o.closest('.cell_output, .output')});
  }
  for (const s of document.querySelectorAll('svg')) {
    if (!inOutput(s) || s.closest('svg') !== s || s.closest('mjx-container, .MathJax, .widget-area, .jupyter-widgets')) continue;
    const r = s.getBoundingClientRect();
    const hidden = s.closest('details:not([open]), [hidden]') || getComputedStyle(s).display === 'none';
    if (hidden) continue;
    figs.push({kind: 'svg', src: 'inline <svg>', ok: r.width > 0 && r.height > 0, width: r.width,
               output: !!s.closest('.cell_output, .output'),
               graphviz: s.outerHTML.includes('Generated by graphviz')});
  }
  // ipywidgets stored in the notebook: the vendored HTML manager renders each view next to
  // the <script type="application/vnd.jupyter.widget-view+json"> that describes it.
  for (const w of document.querySelectorAll('script[type="application/vnd.jupyter.widget-view+json"]')) {
    const host = w.parentElement;
    const view = host && host.querySelector('.jupyter-widgets, .widget-inline-hbox, .widget-box');
    const r = view ? view.getBoundingClientRect() : {width: 0, height: 0};
    figs.push({kind: 'widget', src: 'ipywidgets view', ok: !!view && r.width > 0 && r.height > 0,
               width: r.width, output: true});
  }
  return figs;
})()
"""


# The answer cells of a page, in order, as [cell, is_old_form]: a solution (a cell tagged
# hide-input after a cell that raises NotImplementedError, the exercise's stub) or an older
# "# Your answer" cell.
ANSWER_CELLS = r"""
const ANSWER_CELLS = main => {
  const found = [];
  let stub = false;
  for (const cell of main.querySelectorAll('div.cell')) {
    const text = (cell.querySelector('.cell_input') || {}).textContent || '';
    if (/#\s*Your (answer|prediction)/i.test(text)) found.push([cell, true]);
    else if (/raise NotImplementedError/.test(text)) stub = true;
    else if (stub && cell.classList.contains('tag_hide-input')) {
      found.push([cell, false]);
      stub = false;
    }
  }
  return found;
};
"""

# Runs in the page (at DESKTOP_WIDTH) after the figure probe: what a reader would find rough.
#  overflow: code blocks (cell inputs, outputs, markdown code) and display equations wider
#            than their box, i.e. that scroll sideways or are cut off;
#  streams:  cells whose output is split into several stream boxes;
#  markers:  internal markers (nbval's comments, linter pragmas) in the page's text, shown or
#            folded away;
#  answers:  each answer a reader should try before seeing: a solution cell (tagged hide-input)
#            after an exercise's stub (``raise NotImplementedError``), or an older answer cell
#            (a "# Your answer" comment) and the output of the check after it: whether either
#            is visible before any click;
#  sidebar:  the sidebar's links to chapter pages and their text;
#  figures:  every picture with its <figure>, caption, number and (trees) full-size link;
#  tables:   every captioned table with its number; numrefs: the {numref} links and their text;
#  chapter:  the page's chapter number (its title's section number), '' on unnumbered pages.
LAYOUT_PROBE = r"""
(() => {
  const main = document.querySelector('main') || document.body;
  const snippet = el => (el.textContent || '').replace(/\s+/g, ' ').trim().slice(0, 70);
  const shown = el => !!el && el.getClientRects().length > 0 &&
                      el.getBoundingClientRect().height > 0 && el.checkVisibility();
  const answers = [];
  for (const [cell, old] of ANSWER_CELLS(main)) {
    const input = cell.querySelector('.cell_input');
    let check = old ? cell.nextElementSibling : null;
    while (check && !(check.matches('div.cell') && check.querySelector('.cell_output'))) {
      check = check.matches('div.cell') ? null : check.nextElementSibling;
    }
    answers.push({text: snippet(input), input_shown: shown(input.querySelector('pre')),
                  check_output_shown: check ? shown(check.querySelector('.cell_output')) : null});
  }
  const streams = [];
  for (const out of main.querySelectorAll('.cell_output')) {
    const n = out.querySelectorAll(':scope > .output.stream, :scope > .output.stderr').length;
    if (n > 1) streams.push({boxes: n, text: snippet(out)});
  }
  const text = main.textContent;
  const markers = [...text.matchAll(/.{0,40}(NBVAL|noqa).{0,20}/g)].map(m => m[0]);
  const overflow = [];
  const wider = el => el.scrollWidth - el.clientWidth;
  // folded code (answers, dropdowns) must fit too once opened: measure with every fold open
  const folded = [...main.querySelectorAll('details:not([open])')];
  folded.forEach(d => { d.open = true; });
  for (const pre of main.querySelectorAll('pre')) {
    if (!pre.getClientRects().length) continue;
    const kind = pre.closest('.cell_input') ? 'code cell' : pre.closest('.cell_output') ? 'output'
               : 'code block';
    if (wider(pre) > 1) overflow.push({kind, over: wider(pre), text: snippet(pre)});
  }
  for (const m of main.querySelectorAll('div.math, mjx-container[display="true"]')) {
    if (!m.getClientRects().length || (m.matches('mjx-container') && m.closest('div.math'))) continue;
    const box = m.closest('div.math') || m;
    const svg = m.querySelector('svg');
    const cut = svg ? svg.getBoundingClientRect().right - box.getBoundingClientRect().right : 0;
    const over = Math.max(wider(m), cut);
    if (over > 1) overflow.push({kind: 'equation', over, text: snippet(m)});
  }
  folded.forEach(d => { d.open = false; });
  const sidebar = [...document.querySelectorAll('.bd-sidebar-primary a.reference.internal')]
    .filter(a => /\/book\/\d\d_[^/]*\.html$/.test(new URL(a.href).pathname))
    .map(a => a.textContent.replace(/\s+/g, ' ').trim());
  // figures: every picture of the page (a graphviz tree, a step player, an output image, a
  // Markdown figure) with the <figure> around it, its caption, the number Sphinx put at the
  // caption's start (book/_ext/kv_figures.py numbers the package's figures) and, for a tree,
  // its link to the full-size SVG.
  const pictures = new Set();
  for (const s of main.querySelectorAll('svg')) {
    if (s.closest('svg') !== s || s.closest('mjx-container, .MathJax, .jupyter-widgets, .widget-area')) continue;
    if (s.querySelector(':scope > g.graph')) pictures.add(s.closest('.kvp') || s);
  }
  for (const i of main.querySelectorAll('.cell_output img, figure img')) pictures.add(i);
  // the package's other figures (diagrams drawn as SVG without graphviz): their picture
  for (const f of main.querySelectorAll('figure.kv-figure')) {
    if (![...pictures].some(p => f.contains(p))) pictures.add(f.querySelector('svg') || f);
  }
  const numberOf = el => {
    const n = el ? el.querySelector('.caption-number') : null;
    return n ? n.textContent.replace(/\s+/g, ' ').trim() : '';
  };
  const figures = [];
  for (const el of pictures) {
    const fig = el.closest('figure');
    const cap = fig && fig.querySelector(':scope > figcaption');
    const number = numberOf(cap);
    let text = cap ? cap.textContent.replace(/\s+/g, ' ').trim() : '';
    if (number && text.startsWith(number)) text = text.slice(number.length).trim();
    const full = fig && fig.querySelector('a.kv-full');
    figures.push({
      kind: el.matches('.kvp') ? 'player' : el.tagName.toLowerCase(),
      // a Chinese caption has no spaces: each CJK character counts as a word
      caption: text.slice(0, 90),
      words: text ? text.split(' ').length + (text.match(/[\u4e00-\u9fff]/g) || []).length : 0,
      number,
      id: fig ? fig.id : '',
      captions: fig ? fig.querySelectorAll(':scope > figcaption').length : 0,
      numbers: fig ? fig.querySelectorAll('.caption-number').length : 0,
      tree: !!fig && fig.classList.contains('kv-tree'),
      graphviz: el.tagName.toLowerCase() === 'svg' && !!el.querySelector(':scope > g.graph'),
      full: full ? full.href : null,
    });
  }
  // tables with a caption (the prose's {table} directives, the cells' named Markdown tables)
  // and the tables cells print as text (<figure class="kv-table">, numbered the same way)
  const captionOf = t => t.querySelector(':scope > caption, :scope > figcaption');
  const tables = [...main.querySelectorAll('table, figure.kv-table')].filter(captionOf)
    .map(t => ({id: t.id, number: numberOf(captionOf(t)),
                numbers: t.querySelectorAll('.caption-number').length,
                caption: captionOf(t).textContent.trim().slice(0, 90)}));
  // {numref} links, the number they print and where they point
  const numrefs = [...main.querySelectorAll('a span.std-numref')].map(s => ({
    text: s.textContent.replace(/\s+/g, ' ').trim(), href: s.closest('a').href}));
  const h1 = main.querySelector('h1 .section-number');
  const chapter = h1 ? h1.textContent.trim().replace(/\.$/, '') : '';
  return {overflow, streams, markers, answers, sidebar, figures, tables, numrefs, chapter};
})()
"""
# The answer-cell finder, defined inside the probe.
LAYOUT_PROBE = LAYOUT_PROBE.replace("(() => {", "(() => {" + ANSWER_CELLS, 1)


class Visit:
    def __init__(self, url: str):
        self.url = url
        self.requests: list[str] = []
        self.failed: list[str] = []
        self.js_errors: list[str] = []
        self.figures: list[dict] = []
        self.layout: dict = {}
        self.timed_out = False

    @property
    def external(self) -> list[str]:
        return sorted({u for u in self.requests if urlparse(u).scheme not in LOCAL_SCHEMES})


# --------------------------------------------------------------------------- the book's pages


def toc_files(toc_path: Path) -> list[str]:
    """Every file the Jupyter Book 1 toc lists (root, parts, chapters, sections), in order."""
    import yaml

    toc = yaml.safe_load(toc_path.read_text())
    files = [toc["root"]]

    def walk(node):
        if isinstance(node, dict):
            if "file" in node:
                files.append(node["file"])
            for key in ("parts", "chapters", "sections"):
                for child in node.get(key, []) or []:
                    walk(child)
        elif isinstance(node, list):
            for child in node:
                walk(child)

    walk({k: v for k, v in toc.items() if k != "root"})
    return files


def redirects() -> dict[str, str]:
    """_config.yml's ``redirects``: a chapter file's old docname -> its new page (relative)."""
    import yaml

    config = yaml.safe_load((REPO / "_config.yml").read_text(encoding="utf-8"))
    return dict(config["sphinx"]["config"].get("redirects", {}))


def built_pages() -> list[Path]:
    """Every page of the site, the forwarding pages at old chapter names left out."""
    skip = {"_static", "_sources", "_images", "_sphinx_design_static", "_panels_static"}
    forwards = {f"{old}.html" for old in redirects()}
    return sorted(
        p
        for p in HTML.rglob("*.html")
        if not (set(p.relative_to(HTML).parts[:-1]) & skip)
        and p.relative_to(HTML).as_posix().removeprefix("zh/") not in forwards
    )


def page_id(p: Path) -> str:
    return str(p.relative_to(HTML))


needs_site = pytest.mark.skipif(
    not (HTML / "index.html").exists(),
    reason=f"{HTML} not built: run `make book` first (make test does)",
)


@pytest.fixture(scope="module")
def browser():
    exe = find_chromium()
    if exe is None:
        pytest.fail("Chromium not found (Debian: apt-get install -y chromium; make setup does it)")
    b = Chromium(exe)
    yield b
    b.close()


_visits: dict[Path, Visit] = {}


def visit(browser: Chromium, page: Path) -> Visit:
    if page not in _visits:
        _visits[page] = browser.visit(page.as_uri())
    return _visits[page]


@needs_site
def test_every_toc_page_is_built():
    missing = [
        f
        for f in toc_files(BOOK_ROOT / "_toc.yml")
        if not (HTML / (str(Path(f).with_suffix("")) + ".html")).exists()
    ]
    assert not missing, f"pages listed in _toc.yml but not built under {HTML}: {missing}"


@needs_site
@pytest.mark.parametrize("page", built_pages() if HTML.exists() else [], ids=page_id)
def test_page_is_offline_and_complete(browser, page):
    v = visit(browser, page)
    assert not v.timed_out, f"{page_id(page)} did not settle within {PAGE_TIMEOUT_S}s"
    assert not v.external, f"{page_id(page)} requests resources outside file://: {v.external}"
    broken = [f for f in v.figures if not f["ok"]]
    assert not broken, f"{page_id(page)}: figures that did not load: {broken}"
    assert not v.failed, f"{page_id(page)}: requests that failed: {v.failed}"
    assert not v.js_errors, f"{page_id(page)}: uncaught JavaScript errors: {v.js_errors}"


def chapter_pages() -> list[Path]:
    pages = [
        HTML / (str(Path(f).with_suffix("")) + ".html")
        for f in toc_files(BOOK_ROOT / "_toc.yml")[1:]
    ]
    return [p for p in pages if p.exists()]


def figure_kind(fig: dict) -> str:
    """'graphviz' for a graphviz SVG, 'png' for a PNG (matplotlib), else 'other'."""
    if fig["kind"] == "svg":
        return "graphviz" if fig.get("graphviz") else "other"
    src = fig["src"]
    path = urlparse(src).path
    if src.startswith("data:image/png") or path.lower().endswith(".png"):
        return "png"
    if path.lower().endswith(".svg") and urlparse(src).scheme == "file":
        text = Path(unquote(path)).read_text(errors="replace")
        return "graphviz" if "Generated by graphviz" in text else "other"
    return "other"


@needs_site
@pytest.mark.parametrize("kind", ["graphviz", "png"])
def test_chapter_figures_render(browser, kind):
    """Chapters draw radix trees with graphviz (SVG) and plots with matplotlib (PNG): every
    such figure in a chapter's outputs must render. Skips while no chapter has one."""
    found = 0
    for page in chapter_pages():
        for fig in visit(browser, page).figures:
            if fig["output"] and figure_kind(fig) == kind:
                found += 1
                assert fig["ok"], f"{page_id(page)}: {kind} figure did not render: {fig}"
    if not found:
        pytest.skip(f"no chapter in the toc shows a {kind} figure yet")


def _number_pattern(page: Path, kind: str, chapter: str) -> re.Pattern:
    """What a figure's or table's number reads like on ``page``: "Figure 17.2" ("图 17.2" in
    the Chinese edition), the chapter's own number first; "Figure 1" on an unnumbered page."""
    zh = page_id(page).startswith("zh/")
    word = {"figure": "图" if zh else "Figure", "table": "表" if zh else "Table"}[kind]
    prefix = re.escape(chapter) + r"\." if chapter else ""
    return re.compile(rf"{word} {prefix}(\d+)")


@needs_site
def test_every_figure_is_numbered_and_captioned(browser):
    """Every picture (a tree, a sequence, a step player, a plot, the landing page's tree) sits
    in a <figure> with one <figcaption> that says what it shows and starts with the one number
    Sphinx gave it (book/_ext/kv_figures.py): "Figure 17.2" on chapter 17's page ("图 17.2" in
    the Chinese edition), the figures of a page numbered 1, 2, 3 ... in order. Captioned tables
    are numbered the same way ("Table 17.1", "表 17.1")."""
    bad: dict[str, list] = {}
    found = tables = 0
    for page in built_pages():
        layout = visit(browser, page).layout
        chapter = layout.get("chapter", "")
        seen: dict[str, list[int]] = {"figure": [], "table": []}
        for kind, items in (("figure", layout.get("figures") or []),
                            ("table", layout.get("tables") or [])):  # fmt: skip
            pattern = _number_pattern(page, kind, chapter)
            for f in items:
                problems = []
                if kind == "figure":
                    found += 1
                    if f["words"] < 3:
                        problems.append(f"no caption (or a caption of {f['words']} words)")
                    if f["captions"] != 1:
                        problems.append(f"{f['captions']} captions")
                else:
                    tables += 1
                m = pattern.fullmatch(f["number"])
                if f["numbers"] != 1 or not m:
                    problems.append(
                        f"{f['numbers']} numbers, {f['number']!r} is not {pattern.pattern!r}"
                    )
                elif f["id"] and int(m.group(1)) not in seen[kind]:
                    seen[kind].append(int(m.group(1)))
                if problems:
                    bad.setdefault(page_id(page), []).append({**f, "problems": problems})
        for kind, numbers in seen.items():  # (the probe lists pictures by kind, not in order)
            if sorted(numbers) != list(range(1, len(numbers) + 1)):
                bad.setdefault(page_id(page), []).append(f"{kind}s numbered {numbers}")
    assert found >= 20, f"expected the chapters' figures, found {found}"
    assert tables >= 5, f"expected the chapters' numbered tables, found {tables}"
    n = sum(map(len, bad.values()))
    assert not bad, f"{n} of {found} figures and {tables} tables without a good number: {bad}"


@needs_site
def test_numrefs_print_the_number_of_what_they_point_at(browser):
    """A {numref} in the text prints the number its figure or table shows in its caption (same
    page or another), in both editions: the text and the captions count the same way."""
    numbers: dict[tuple[str, str], str] = {}
    refs: list[tuple[Path, dict]] = []
    for page in built_pages():
        layout = visit(browser, page).layout
        for item in (layout.get("figures") or []) + (layout.get("tables") or []):
            if item.get("id"):
                numbers[(page.resolve().as_posix(), item["id"])] = item["number"]
        refs += [(page, r) for r in layout.get("numrefs") or []]
    assert len(refs) >= 20, f"expected the chapters' {{numref}} references, found {len(refs)}"
    bad = []
    for page, ref in refs:
        url = urlparse(ref["href"])
        target = (Path(unquote(url.path)).resolve().as_posix(), url.fragment)
        shown = numbers.get(target)
        if shown != ref["text"]:
            bad.append(f"{page_id(page)}: {ref['text']!r} points at {target[1]!r} ({shown!r})")
    assert not bad, f"{{numref}} text that is not its target's number: {bad}"


@needs_site
def test_every_tree_links_its_full_size_svg(browser):
    """Each tree figure's caption links to the tree's own SVG file (book/_ext/kv_figures.py),
    which exists next to the pages (offline, no data: URL) and is the same graphviz drawing."""
    bad: dict[str, list] = {}
    trees = 0
    for page in built_pages():
        for f in visit(browser, page).layout.get("figures") or []:
            if not (f["graphviz"] and f["kind"] == "svg"):
                continue
            trees += 1
            href = f["full"]
            if not f["tree"] or not href:
                bad.setdefault(page_id(page), []).append(f"no full-size link: {f['caption']!r}")
                continue
            url = urlparse(href)
            path = Path(unquote(url.path))
            if url.scheme != "file" or not path.is_file():
                bad.setdefault(page_id(page), []).append(f"link to nothing: {href}")
            elif "Generated by graphviz" not in path.read_text(errors="replace")[:3000]:
                bad.setdefault(page_id(page), []).append(f"not a graphviz SVG: {href}")
    assert trees >= 20, f"expected the chapters' tree figures, found {trees}"
    assert not bad, f"tree figures that cannot be opened full size: {bad}"


#: The API reference part (book/api/): the page of each layer and the module it documents.
API_PAGES = {
    "kernels": "kvcache.kernels",
    "storage": "kvcache.storage",
    "managers": "kvcache.managers",
    "serving": "kvcache.serving",
    "system": "kvcache.system",
    "viz": "kvcache.viz",
    "examples": "kvcache.examples.tp_attention",
}


@needs_site
@pytest.mark.parametrize("page, module", sorted(API_PAGES.items()))
def test_api_page_documents_every_public_name(page, module):
    """Each layer's page has an entry (the anchor autodoc writes) for every name of __all__."""
    import importlib

    html = (HTML / "book" / "api" / f"{page}.html").read_text()
    names = importlib.import_module(module).__all__
    missing = [n for n in names if f'id="{module}.{n}"' not in html]
    assert not missing, f"book/api/{page}.html documents none of {missing} (from {module}.__all__)"
    # ...and its summary table says what each one is: no row with an empty description
    blank = []
    for row in re.findall(r'<tr class="row-(?:odd|even)">(.*?)</tr>', html, re.S):
        cells = [
            re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td>(.*?)</td>", row, re.S)
        ]
        if len(cells) >= 2 and not cells[1]:
            blank.append(cells[0])
    assert not blank, f"book/api/{page}.html: summary rows with no description: {blank}"


@needs_site
def test_api_links_in_chapters_resolve():
    """A chapter's {py:class}`~kvcache...` role links to the API page. Unresolved, Sphinx renders
    it as plain code without a link and without a warning (nitpicky is off for the docstrings'
    types), so a misspelt name is caught here."""
    unresolved = {}
    for page in chapter_pages():
        if "api" in page.relative_to(HTML).parts:
            continue
        html = page.read_text()
        refs = re.findall(r'(<a [^>]*>)?<code class="xref py[^"]*"[^>]*>(.*?)</code>', html, re.S)
        bad = [re.sub(r"<[^>]+>", "", text) for link, text in refs if not link]
        if bad:
            unresolved[page_id(page)] = bad
    assert not unresolved, f"API references that link nowhere: {unresolved}"


# --------------------------------------------------------------------------- reading comfort


def layout_findings(browser, key: str) -> dict[str, list]:
    """What LAYOUT_PROBE reported under ``key``, for every built page where it found some."""
    found = {}
    for page in built_pages():
        items = visit(browser, page).layout.get(key) or []
        if items:
            found[page_id(page)] = items
    return found


@needs_site
@pytest.mark.parametrize("kind", ["code cell", "code block", "equation"])
def test_nothing_scrolls_sideways_on_a_laptop(browser, kind):
    """At 1400 px no code (at most ~88 columns) or display equation is wider than the text."""
    found = {
        page: [f"{o['over']}px: {o['text']!r}" for o in items if o["kind"] == kind]
        for page, items in layout_findings(browser, "overflow").items()
    }
    found = {page: items for page, items in found.items() if items}
    n = sum(map(len, found.values()))
    assert not found, f"{n} {kind}(s) wider than the page at {DESKTOP_WIDTH}px: {found}"


@needs_site
def test_a_cells_output_is_one_stream_box(browser):
    """A table printed line by line is one box (myst-nb's nb_merge_streams), not one per write."""
    found = layout_findings(browser, "streams")
    assert not found, f"cells whose output is split into several stream boxes: {found}"


@needs_site
def test_no_internal_markers_on_pages(browser):
    """nbval's comments and linter pragmas are for tools: cell tags instead, and legal code."""
    found = layout_findings(browser, "markers")
    assert not found, f"pages that show NBVAL or noqa: {found}"


@needs_site
def test_markdown_tables_in_outputs_are_tables():
    """A cell that displays a Markdown table (display(Markdown(...))) shows a table, not its
    source: myst-nb parses such outputs as CommonMark, which has no tables, unless the config
    says nb_render_markdown_format: myst."""
    import html as html_lib

    found = {}
    for page in chapter_pages():
        for para in re.findall(r"<p>(.*?)</p>", page.read_text(encoding="utf-8"), flags=re.S):
            text = html_lib.unescape(re.sub(r"<[^>]+>", "", para)).strip()
            if text.startswith("|") and re.search(r"\|\s*:?[-\u2013\u2014]+:?\s*\|", text):
                found.setdefault(page_id(page), []).append(text[:60])
    assert not found, f"Markdown tables shown as text: {found}"


@needs_site
def test_exercise_answers_are_hidden_until_asked(browser):
    """The reader's answer cell ("# Your answer") and what its check prints stay folded until a
    click: the reader tries first. The cells still run (and nbval still checks them)."""
    answers = {page_id(p): visit(browser, p).layout.get("answers") or [] for p in chapter_pages()}
    assert sum(map(len, answers.values())) >= 10, f"expected the chapters' answer cells: {answers}"
    shown = {
        page: [a for a in items if a["input_shown"] or a["check_output_shown"]]
        for page, items in answers.items()
    }
    shown = {page: items for page, items in shown.items() if items}
    assert not shown, f"answer cells (or their check's output) visible without a click: {shown}"


@needs_site
def test_sidebar_numbers_the_chapters(browser):
    """The toc numbers the chapters (numbered in _toc.yml), and the sidebar shows the numbers."""
    links = visit(browser, HTML / "book" / "intro.html").layout["sidebar"]
    assert len(links) >= 10, f"the sidebar should list the chapters: {links}"
    unnumbered = [t for t in links if not re.match(r"\d+\.\s", t)]
    assert not unnumbered, f"chapters without a number in the sidebar: {unnumbered}"


@needs_site
def test_revealing_an_answer_shows_it(browser):
    """The fold is a real toggle: one click on its summary shows the answer cell."""
    tab = browser.open_tab((HTML / "book" / "07_layouts.html").as_uri(), DESKTOP_WIDTH)
    find = ANSWER_CELLS + "const [cell] = ANSWER_CELLS(document)[0] || [null];"
    try:
        box = tab.eval(
            "(() => {"
            + find
            + """const summary = cell && cell.querySelector('details summary');
            if (!summary) return null;
            summary.scrollIntoView({block: 'center'});
            const r = summary.getBoundingClientRect();
            return [r.x + r.width / 2, r.y + r.height / 2];
        })()"""
        )
        assert box, "no folded answer cell on the layouts chapter"
        tab.click(*box)
        shown = tab.eval(
            "(() => {"
            + find
            + """const pre = cell.querySelector('.cell_input pre');
            return pre.checkVisibility() && pre.getBoundingClientRect().height > 0;
        })()"""
        )
        assert shown, "clicking the fold's summary did not show the answer cell"
    finally:
        tab.close()


@needs_site
def test_search_ranks_the_chapter_named_by_the_query_first(browser):
    """Searching "radix tree" lists the radix tree chapter first (book/_ext/search_scorer.js),
    not a page that only has "tree" in a section title (Sphinx's default ranked "Integrity")."""
    tab = browser.open_tab((HTML / "search.html").as_uri() + "?q=radix+tree", DESKTOP_WIDTH)
    try:
        titles = tab.eval("""new Promise(resolve => {
            const t0 = Date.now();
            const poll = () => {
                const items = [...document.querySelectorAll('#search-results li a')];
                const done = document.querySelector('#search-results p.search-summary');
                if ((done && items.length) || Date.now() - t0 > 20000) {
                    resolve(items.map(a => a.textContent.replace(/\\s+/g, ' ').trim()));
                } else setTimeout(poll, 100);
            };
            poll();
        })""")
        assert titles, "the search page found nothing for 'radix tree'"
        assert "The radix tree" in titles[0], f"results for 'radix tree', best first: {titles[:6]}"
    finally:
        tab.close()


@needs_site
def test_printout_shows_answers_and_uncut_code(browser):
    """Printing (or saving as PDF) opens every fold, answers included (book.js on beforeprint),
    and the print styles (book.css) wrap code instead of cutting it at the page's edge."""
    tab = browser.open_tab((HTML / "book" / "12_radix_tree.html").as_uri(), 800)
    try:
        b = tab.b
        b.call("Emulation.setEmulatedMedia", {"media": "print"}, session=tab.session)
        state = tab.eval(
            """(async () => {"""
            + ANSWER_CELLS
            + """
            window.dispatchEvent(new Event('beforeprint'));
            await new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
            const main = document.querySelector('main');
            const closed = main.querySelectorAll('details:not([open])').length;
            const cut = [...main.querySelectorAll('pre')].filter(
                p => p.getClientRects().length && p.scrollWidth - p.clientWidth > 1).length;
            const [answer] = ANSWER_CELLS(main)[0] || [null];  // the first exercise's answer
            const pre = answer && answer.querySelector('.cell_input pre');
            const answer_shown = !!pre && pre.checkVisibility();
            // dropdown admonitions (challenge answers) are printed open too
            const folded_notes = [...main.querySelectorAll('.admonition.toggle-hidden')].filter(
                a => [...a.children].some(c => !c.matches('.admonition-title, button')
                                              && c.getBoundingClientRect().height === 0)).length;
            window.dispatchEvent(new Event('afterprint'));
            return {closed, cut, answer_shown, folded_notes,
                    closed_after: main.querySelectorAll('details:not([open])').length};
        })()"""
        )
        assert state["closed"] == 0, f"folds left closed in the printout: {state}"
        assert state["answer_shown"], f"the answer cell is not in the printout: {state}"
        assert state["folded_notes"] == 0, f"dropdown answers left folded in the printout: {state}"
        assert state["cut"] == 0, f"code cut at the printed page's edge: {state}"
        assert state["closed_after"] > 0, f"the folds did not close again after printing: {state}"
    finally:
        tab.close()


# In print media, after "beforeprint": what a printed page would lose. Folds left closed,
# answer cells not shown, sidebars or buttons still laid out, figures cut at the page's edge
# (a picture wider than its card, a card wider than the text, a figure body that scrolls).
PRINT_PROBE = r"""
(async () => {
  window.dispatchEvent(new Event('beforeprint'));
  await new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
  const main = document.querySelector('main');
  const seen = el => !!el && el.checkVisibility() && el.getBoundingClientRect().height > 0;
  const closed = main.querySelectorAll('details:not([open])').length;
  const hidden_answers = [...main.querySelectorAll('div.cell')].filter(c =>
      /#\s*Your (answer|prediction)/i.test((c.querySelector('.cell_input') || {}).textContent || ''))
    .filter(c => !seen(c.querySelector('.cell_input pre'))).length;
  const folded_notes = [...main.querySelectorAll('.admonition.toggle-hidden')].filter(
      a => [...a.children].some(c => !c.matches('.admonition-title, button')
                                    && c.getBoundingClientRect().height === 0)).length;
  const chrome = ['.bd-sidebar-primary', '.bd-sidebar-secondary', '.bd-header-article',
                  '.prev-next-area'].filter(sel => [...document.querySelectorAll(sel)].some(seen));
  const text = (main.querySelector('article') || main).getBoundingClientRect();
  const cut = [];
  for (const fig of main.querySelectorAll('figure')) {
    if (!seen(fig)) continue;
    const f = fig.getBoundingClientRect();
    const label = (fig.querySelector('figcaption') || fig).textContent.trim().slice(0, 50);
    if (f.right > text.right + 1) cut.push(`figure wider than the text by ${f.right - text.right}px: ${label}`);
    for (const pic of fig.querySelectorAll(':scope svg:not(svg svg), :scope img')) {
      if (!seen(pic)) continue;
      const r = pic.getBoundingClientRect();
      if (r.right > f.right + 1 || r.left < f.left - 1) cut.push(`picture wider than its figure: ${label}`);
    }
    for (const body of fig.querySelectorAll('.kv-figure-body'))
      if (body.scrollWidth - body.clientWidth > 1) cut.push(`figure scrolls: ${label}`);
  }
  window.dispatchEvent(new Event('afterprint'));
  return {closed, hidden_answers, folded_notes, chrome, cut};
})()
"""


def pages_with_figures_or_answers() -> list[Path]:
    if not HTML.exists():
        return []
    marks = ("kv-figure", "Your answer", "Your prediction", "toggle-hidden", "<img")
    return [p for p in chapter_pages() if any(m in p.read_text() for m in marks)]


@needs_site
@pytest.mark.parametrize("page", pages_with_figures_or_answers(), ids=page_id)
def test_printout_keeps_figures_whole_and_answers_open(browser, page):
    """Printed (or saved as PDF, print media at a printed page's width): no sidebar or header,
    every fold and dropdown answer open, every answer cell shown, and no figure cut or scrolled
    (book.css's print rules scale wide figures to the page; book.js opens the folds)."""
    tab = browser.open_tab(page.as_uri(), 720)
    try:
        tab.b.call("Emulation.setEmulatedMedia", {"media": "print"}, session=tab.session)
        state = tab.eval(PRINT_PROBE)
        assert state["closed"] == 0, f"folds left closed in the printout: {state}"
        assert state["hidden_answers"] == 0, f"answer cells hidden in the printout: {state}"
        assert state["folded_notes"] == 0, f"dropdown answers left folded in the printout: {state}"
        assert not state["chrome"], f"sidebars or buttons in the printout: {state['chrome']}"
        assert not state["cut"], f"figures cut in the printout: {state['cut']}"
    finally:
        tab.close()


# At a phone's width: how far the page is wider than the screen, and the first elements that
# stick out without a scrolling box around them that fits (a figure or a code block may scroll
# inside itself; the page may not).
PHONE_OVERFLOW = r"""
(() => {
  const out = [];
  for (const e of document.querySelectorAll('main *')) {
    if (e.closest('.bd-sidebar-primary, .bd-sidebar-secondary')) continue;  // drawers, off screen
    const r = e.getBoundingClientRect();
    if (!(r.width > 0 && r.right > innerWidth + 1)) continue;
    let p = e.parentElement, contained = false;
    for (; p; p = p.parentElement) {
      if (getComputedStyle(p).overflowX !== 'visible' && p.getBoundingClientRect().right <= innerWidth + 1) {
        contained = true; break;
      }
    }
    if (!contained) out.push(`${e.tagName.toLowerCase()} to ${Math.round(r.right)}px: ` +
                             (e.textContent || '').replace(/\s+/g, ' ').trim().slice(0, 50));
    if (out.length >= 3) break;
  }
  return {width: document.documentElement.scrollWidth, out};
})()
"""


@needs_site
@pytest.mark.parametrize("page", built_pages() if HTML.exists() else [], ids=page_id)
def test_no_page_scrolls_sideways_on_a_phone(browser, page):
    """At 420 px no page is wider than the screen: tree figures and code scroll inside their own
    box, the step player shrinks its frames, and a long name in the text breaks (book.css)."""
    tab = browser.open_tab(page.as_uri(), PHONE_WIDTH)
    try:
        state = tab.eval(PHONE_OVERFLOW)
        assert state["width"] <= PHONE_WIDTH, f"{page_id(page)} at {PHONE_WIDTH}px: {state}"
    finally:
        tab.close()


# The sidebar's link to a chapter, and whether a reader can see it (on screen, not covered).
CHAPTER_LINK_SEEN = r"""
(() => {
  const links = [...document.querySelectorAll('a.reference.internal')]
    .filter(a => /\/book\/01_[^/]*\.html$/.test(new URL(a.href).pathname)
                 && a.closest('.bd-sidebar-primary, #pst-primary-sidebar-modal'));
  return links.some(a => {
    const r = a.getBoundingClientRect();
    if (!(r.width > 0 && r.height > 0 && r.left >= 0 && r.right <= innerWidth + 1
          && r.top >= 0 && r.bottom <= innerHeight)) return false;
    const hit = document.elementFromPoint(r.x + r.width / 2, r.y + r.height / 2);
    return !!hit && (a === hit || a.contains(hit));
  });
})()
"""

# The page's own table of contents (the secondary sidebar): whether a reader can see it.
PAGE_TOC_SEEN = r"""
(() => [...document.querySelectorAll('.bd-toc-nav a, #pst-secondary-sidebar-modal a')].some(a => {
  const r = a.getBoundingClientRect();
  return r.width > 0 && r.height > 0 && r.left >= 0 && r.right <= innerWidth + 1
         && r.top >= 0 && r.bottom <= innerHeight && a.checkVisibility();
}))()
"""

VISIBLE_BUTTON = r"""
((sel) => {
  const b = [...document.querySelectorAll(sel)].find(e => {
    const r = e.getBoundingClientRect();
    return r.width > 0 && r.height > 0 && e.checkVisibility();
  });
  if (!b) return null;
  const r = b.getBoundingClientRect();
  return [r.x + r.width / 2, r.y + r.height / 2];
})
"""


@needs_site
@pytest.mark.parametrize(
    "toggle, seen",
    [(".primary-toggle", CHAPTER_LINK_SEEN), (".secondary-toggle", PAGE_TOC_SEEN)],
    ids=["chapter list", "page contents"],
)
@pytest.mark.parametrize("edition", ["", "zh"], ids=["en", "zh"])
def test_phone_sidebar_toggles_open_the_sidebars(browser, toggle, seen, edition):
    """On a phone (420 px) the header's buttons open the chapter list and the page's contents
    (pydata-sphinx-theme 0.17 listens only on the first toggle of the page, which the book
    theme hides; book/_static/book.js forwards the visible button's click), in both editions
    (the Chinese one has the language switch in the same header)."""
    page = HTML / edition / "book" / "12_radix_tree.html"
    if not page.exists():
        pytest.skip(f"{page_id(page)} is not built")
    tab = browser.open_tab(page.as_uri(), PHONE_WIDTH)
    try:
        assert not tab.eval(seen), "the sidebar is open before any click"
        box = tab.eval(f"{VISIBLE_BUTTON}({json.dumps(toggle)})")
        assert box, f"no visible {toggle} button at {PHONE_WIDTH}px"
        tab.click(*box)
        assert tab.eval(seen), f"clicking {toggle} at {PHONE_WIDTH}px did not open its sidebar"
    finally:
        tab.close()


@needs_site
def test_laptop_sidebar_toggle_collapses_and_restores_the_chapter_list(browser):
    """At 1400 px the article header's button hides the chapter list and brings it back (the
    book theme's handler sits on the hidden header button; book.js forwards to it)."""
    tab = browser.open_tab((HTML / "book" / "12_radix_tree.html").as_uri(), DESKTOP_WIDTH)
    try:
        shown = "getComputedStyle(document.querySelector('.bd-sidebar-primary')).visibility"
        assert tab.eval(shown) == "visible"
        tab.click(*tab.eval(f"{VISIBLE_BUTTON}('.primary-toggle')"))
        assert tab.eval(shown) == "hidden", "the button did not hide the chapter list"
        tab.click(*tab.eval(f"{VISIBLE_BUTTON}('.primary-toggle')"))
        assert tab.eval(shown) == "visible", "the button did not bring the chapter list back"
    finally:
        tab.close()


# --------------------------------------------------------------------------- by hand


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("pages", nargs="*", help="pages relative to _build/html (default: all)")
    ap.add_argument("--screenshot", type=Path, help="save a PNG of the (first) page here")
    args = ap.parse_args(argv)
    pages = [HTML / p for p in args.pages] or built_pages()
    exe = find_chromium()
    if exe is None:
        print("chromium not found", file=sys.stderr)
        return 2
    b = Chromium(exe)
    bad = 0
    try:
        for i, page in enumerate(pages):
            v = b.visit(page.as_uri(), screenshot=args.screenshot if i == 0 else None)
            print(
                f"{page_id(page)}: {len(v.requests)} requests, external={v.external}, "
                f"failed={v.failed}, figures={[(f['kind'], f['ok']) for f in v.figures]}, "
                f"js_errors={v.js_errors}, timed_out={v.timed_out}"
            )
            bad += bool(
                v.external or v.failed or v.timed_out or any(not f["ok"] for f in v.figures)
            )
    finally:
        b.close()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


@needs_site
def test_old_chapter_names_forward_to_the_renamed_pages():
    """The chapter files were renamed to the site's numbers; each old page, in both editions,
    is a forwarding page to the chapter's new page, which exists, and no old name is a toc
    file any more (it would be overwritten)."""
    moved = redirects()
    assert moved, "no redirects in _config.yml"
    toc = set(toc_files(REPO / "_toc.yml"))
    bad = []
    for root in [HTML] + ([HTML / "zh"] if (HTML / "zh" / "index.html").exists() else []):
        for old, target in moved.items():
            page = root / f"{old}.html"
            if old in toc:
                bad.append(f"{old} is still a chapter of the toc")
            elif not page.exists():
                bad.append(f"{page.relative_to(HTML)} was not written")
            elif f'var target = "{target}"' not in page.read_text(encoding="utf-8"):
                bad.append(f"{page.relative_to(HTML)} does not forward to {target}")
            elif not (page.parent / target).exists():
                bad.append(f"{page.relative_to(HTML)} forwards to {target}, which is not built")
    assert not bad, bad
