"""kvcache.viz.explorer without a browser: the explorer's actions and buttons, and the step player's HTML.

The explorer is driven through its methods and through its ipywidgets buttons (``Button.click``
fires the same handlers a browser click does); the state is checked on the manager, the
allocator and the flow, and the picture on the DOT source the tree pane renders. The player is
checked on its HTML: one frame per snapshot, captions in order, nothing that loads from outside
the page. ``tests/book/test_step_player.py`` clicks the player in Chromium on the built site.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from dataclasses import replace
from html.parser import HTMLParser
from importlib import resources

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcache import RadixCacheManager
from kvcache.serving.tokenizer import ByteTokenizer
from kvcache.viz import TreeRecorder, TreeSnapshot, draw_tree, tree_text
from kvcache.viz.explorer import DEFAULT_PRESETS, Explorer, StepPlayer, render_svg, step_player
from kvcache.viz.player import PLAYER_ID_PATTERN, js_string
from kvcache.viz.text import one_line

SYS_A = "You are terse. What is a KV cache?"
SYS_B = "You are terse. What is a radix tree?"
SHARED = len("You are terse. What is a ")

needs_dot = pytest.mark.skipif(
    shutil.which("dot") is None, reason="graphviz `dot` is not installed"
)


def static_file(name: str) -> str:
    """A file the package ships in ``kvcache/viz/static`` (read as an installed package would)."""
    return resources.files("kvcache.viz").joinpath("static", name).read_text(encoding="utf-8")


def cached_tokens(ex: Explorer) -> int:
    return ex.manager.size_info.total_size


def test_insert_reuses_shared_prefix_and_keeps_partition():
    ex = Explorer(num_pages=128)
    assert ex.insert(SYS_A) == 0
    assert ex.insert(SYS_B) == SHARED
    assert cached_tokens(ex) == len(SYS_A) + len(SYS_B) - SHARED
    assert ex.allocator.num_free_pages == 128 - cached_tokens(ex)
    ex.flow.check_integrity()
    assert (
        ex.log[-1].startswith('insert "You are terse. What is a ra')
        and f"reused {SHARED}" in ex.log[-1]
    )
    text = ex.text()
    assert (
        "[You are terse. What is a ] " in text and "[KV cache?]" in text and "[radix tree?]" in text
    )


def test_insert_of_a_cached_text_still_computes_its_last_token():
    """As on a server: the last token's logits are needed, so it is never taken from the cache."""
    ex = Explorer(num_pages=128)
    ex.insert(SYS_A)
    assert ex.insert(SYS_A) == len(SYS_A) - 1
    assert "computed 1" in ex.log[-1]
    assert cached_tokens(ex) == len(SYS_A)  # the recomputed token's page was a duplicate: freed
    assert ex.allocator.num_free_pages == 128 - len(SYS_A)
    ex.flow.check_integrity()


def test_match_reports_cached_len_and_splits():
    ex = Explorer(num_pages=64)
    ex.insert(SYS_A)
    assert ex.manager.num_nodes == 1
    assert ex.match("You are terse. Hi") == len("You are terse. ")
    # match_prefix splits the node at the end of the match (source error 2: match changes the tree)
    assert ex.manager.num_nodes == 2
    assert ex.history.last.split and ex.history.last.shrunk
    assert "cached_len=15" in ex.log[-1]


def test_lock_protects_and_failed_evict_changes_nothing():
    ex = Explorer(num_pages=64)
    ex.insert(SYS_A)
    ex.insert(SYS_B)
    assert ex.lock(SYS_A) == len(SYS_A)
    info = ex.manager.size_info
    assert info.protected_size == len(SYS_A) and info.evictable_size == len(SYS_B) - SHARED
    free_before = ex.allocator.num_free_pages
    nodes_before = ex.text()
    assert ex.evict(info.total_size) == []
    assert ex.log[-1].startswith("✗ evict(") and not ex.last_ok
    assert ex.text().replace(" (evict #1)", "") == nodes_before.replace(" (evict #1)", "")
    assert ex.allocator.num_free_pages == free_before
    freed = ex.evict(3)
    assert len(freed) == len(SYS_B) - SHARED  # a whole leaf goes, not just 3 tokens
    assert ex.allocator.num_free_pages == free_before + len(freed)
    assert ex.unlock() == len(SYS_A)
    assert ex.manager.size_info.protected_size == 0
    assert ex.unlock() == 0 and ex.log[-1] == "✗ unlock: no lock is held"
    ex.flow.check_integrity()


def test_lock_of_uncached_text_is_refused():
    ex = Explorer(num_pages=16)
    assert ex.lock("nothing here") == 0
    assert not ex.locks and not ex.last_ok


def test_unlock_picks_the_lock_taken_on_that_text():
    ex = Explorer(num_pages=128)
    ex.insert(SYS_A)
    ex.insert(SYS_B)
    ex.lock(SYS_A)
    ex.lock(SYS_B)
    assert ex.unlock(SYS_A) == len(SYS_A)
    assert [h.text for h in ex.locks] == [SYS_B]
    assert ex.manager.size_info.protected_size == len(SYS_B)


def test_insert_evicts_when_pool_is_short_and_refuses_when_impossible():
    ex = Explorer(num_pages=40)
    ex.insert(SYS_A)  # 34 pages used, 6 free
    assert ex.insert("Translate: cat") == 0  # needs 14: evicts the cached request
    assert "evicted 34 to make room" in ex.log[-1]
    assert ex.flow.stats.evicted_tokens == len(SYS_A)
    ex.lock("Translate: cat")
    assert ex.insert("x" * 30) is None  # 26 free, 0 evictable
    assert "refused" in ex.log[-1] and "out of KV pages" in ex.log[-1]
    ex.flow.check_integrity()
    assert ex.insert("") is None


def test_page_size_4_caches_whole_pages_only():
    ex = Explorer(page_size=4, num_pages=32)
    ex.insert("abcdefghij")  # 10 tokens: 8 cached
    assert cached_tokens(ex) == 8 and "cached 8 (whole pages)" in ex.log[-1]
    assert ex.match("abcdefgXYZ") == 4
    assert ex.allocator.num_free_pages == 32 - 2
    ex.flow.check_integrity()


def test_reset_drops_locks_and_refills_free_list():
    ex = Explorer(num_pages=64)
    ex.insert(SYS_A)
    ex.lock(SYS_A)
    ex.reset()
    assert cached_tokens(ex) == 0 and not ex.locks and ex.allocator.num_free_pages == 64
    assert ex.history.last.num_nodes == 0


def test_preview_evict_matches_real_evict():
    ex = Explorer(num_pages=128)
    for text in (SYS_A, SYS_B, "User: hi! Bot: hello."):
        ex.insert(text)
    ex.match(SYS_A)  # refresh A: B's leaf and the chat are older
    predicted = ex.preview_evict(12)
    assert predicted == ["radix tree?", "User: hi! Bot: hello."]
    freed = ex.evict(12)
    assert len(freed) == len("radix tree?") + len("User: hi! Bot: hello.")
    assert ex.preview_evict(10**6) == []


def test_history_records_one_snapshot_per_action():
    ex = Explorer(num_pages=64)
    ex.insert(SYS_A)
    ex.match(SYS_B)
    ex.evict(100)
    caps = [s.caption for s in ex.history.snapshots]
    assert caps[0] == "empty tree"
    assert (
        caps[1].startswith("insert ")
        and caps[2].startswith("match ")
        and caps[3].startswith("✗ evict(100)")
    )
    assert ex.history.snapshots[3].evict_size == 100


def test_given_manager_must_be_empty_radix():
    m = RadixCacheManager()
    m.insert_prefix(torch.tensor([1, 2]), torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="must be empty"):
        Explorer(m)
    with pytest.raises(TypeError):
        Explorer(object())  # type: ignore[arg-type]
    ex = Explorer(RadixCacheManager(page_size=2, eviction_policy="fifo"), num_pages=8)
    assert ex.page_size == 2 and ex.manager.eviction_policy == "fifo"


# ---------------------------------------------------------------------------- the widget
@pytest.fixture
def widget_explorer():
    pytest.importorskip("ipywidgets")
    ex = Explorer(num_pages=64)
    ex.widget  # build it
    return ex


@needs_dot
def test_buttons_drive_the_same_actions(widget_explorer):
    ex = widget_explorer
    w = ex._widget
    w.text.value = SYS_A
    w.buttons["insert"].click()
    w.preset.value = SYS_B  # picking a preset fills the text box
    assert w.text.value == SYS_B
    w.buttons["insert"].click()
    assert ex.flow.stats.reused_tokens == SHARED
    w.buttons["match"].click()
    assert (
        ex.log[-1].startswith('match "You are terse. What is a ra')
        and f"cached_len={len(SYS_B)}" in ex.log[-1]
    )
    w.text.value = SYS_A
    w.buttons["lock"].click()
    assert ex.manager.size_info.protected_size == len(SYS_A)
    w.evict_n.value = 1000
    w.buttons["evict"].click()
    assert ex.log[-1].startswith("✗ evict(1000)")
    w.evict_n.value = 2
    w.buttons["evict"].click()
    assert ex.log[-1].startswith("evict(2) → freed 11 slots")
    w.buttons["unlock"].click()
    assert not ex.locks
    w.buttons["reset"].click()
    assert cached_tokens(ex) == 0
    # the panes show the state: the status and the log as text, the tree as inline SVG
    assert "cached 0 tokens in 0 nodes" in w.status.value
    assert "reset → empty tree" in w.log.value
    assert w.tree.value.count("<svg") == 1 and "<?xml" not in w.tree.value


@needs_dot
def test_tree_pane_renders_the_dot_it_shows(widget_explorer):
    ex = widget_explorer
    w = ex._widget
    ex.insert(SYS_A)
    ex.insert(SYS_B)
    dot = ex.dot
    # node labels hold the text; the just-inserted leaf is green; the title is the last action
    assert "You are terse. What is a" in dot and "radix tree?" in dot
    assert 'class="kv-evictable kv-inserted"' in dot
    assert "insert &quot;You are terse. What is a ra" in dot  # the title (an HTML label, escaped)
    # preview marks what evict N would take (the LRU leaf: "KV cache?")
    w.evict_n.value = 3
    w.preview.value = True
    assert "evict #1" in ex.dot and "kv-evict" in ex.dot
    assert "evict #1" in w.tree.value  # the pane was redrawn when N changed
    w.preview.value = False
    assert "evict #1" not in ex.dot and "evict #1" not in w.tree.value
    # what the pane shows is that DOT rendered: every node's text appears in the SVG
    for label in ("You are terse. What is a ", "KV cache?", "radix tree?"):
        assert label.replace(" ", "&#160;") in w.tree.value or label in w.tree.value


def test_status_text():
    ex = Explorer(num_pages=16)
    ex.insert("abcdef")
    ex.lock("abcdef")
    assert ex.status().splitlines() == [
        "page_size 1 · pool of 16 pages (16 slots)",
        "cached 6 tokens in 1 nodes: evictable 0, protected 6",
        "free list: 10 pages [6, 7, 8, 9, 10, 11, 12, 13, …]",
        'locks held: 1 ("abcdef")',
    ]
    assert repr(ex) == "Explorer(page_size=1, num_pages=16, cached=6, locks=1, events=2)"


def test_presets_are_short_text():
    assert all(len(ByteTokenizer().encode(t)) <= 40 for _, t in DEFAULT_PRESETS)


# --------------------------------------------------------------------------- step player
def fake_svg(graph) -> str:
    """A stand-in renderer: deterministic, needs no `dot`, keeps the node names."""
    names = sorted(set(re.findall(r"^\s*(n\d+) \[", graph.source, flags=re.M)))
    return f'<svg xmlns="http://www.w3.org/2000/svg"><!-- {" ".join(names)} --></svg>'


def recorded() -> TreeRecorder:
    tok = ByteTokenizer()
    rec = TreeRecorder(RadixCacheManager(), decode=tok)
    rec.insert_prefix(tok.encode("Hello world"), torch.arange(11, dtype=torch.int32))
    rec.insert_prefix(tok.encode("Hello there"), torch.arange(11, 22, dtype=torch.int32))
    h, _ = rec.match_prefix(tok.encode("Hello world"))
    rec.lock_handle(h)
    with contextlib.suppress(RuntimeError):
        rec.evict(20)
    rec.lock_handle(h, unlock=True)
    rec.evict(4)
    return rec


def test_player_has_one_frame_per_snapshot_in_order():
    rec = recorded()
    p = step_player(rec, render=fake_svg)
    n = len(rec.snapshots)
    assert isinstance(p, StepPlayer) and p.num_steps == n == 8
    assert p.captions[0] == f"1 / {n} · empty tree"
    assert p.captions[-1].startswith(f"{n} / {n} · evict(4) → [")
    frames = re.findall(
        r'<div class="kvp-frame" data-step="(\d+)" data-caption="([^"]*)"( hidden)?>', p.html
    )
    assert [int(f[0]) for f in frames] == list(range(n))
    assert [f[2] for f in frames] == [""] + [" hidden"] * (
        n - 1
    )  # only the first shows before JS runs
    assert p.html.count("<svg") == n
    assert f'data-steps="{n}"' in p.html and f'max="{n - 1}"' in p.html
    for cls in (
        "kvp-prev",
        "kvp-next",
        "kvp-play",
        "kvp-first",
        "kvp-last",
        "kvp-range",
        "kvp-caption",
    ):
        assert f'class="{cls}"' in p.html
    assert p._repr_html_() == p.html and repr(p) == f"StepPlayer({n} steps, id={p.player_id!r})"


def test_player_previews_the_next_evict():
    p = step_player(recorded(), render=lambda g: "<svg>" + g.source + "</svg>")
    # the step before the successful evict(4) marks the leaf it will take; the failed evict(20) marks nothing
    before_ok = p.svgs[-2]
    assert "evict #1" in before_ok
    assert (
        "evict #1" not in p.svgs[3]
    )  # before the refused evict(20): it would fail, nothing marked
    q = step_player(
        recorded(), render=lambda g: "<svg>" + g.source + "</svg>", preview_evictions=False
    )
    assert all("evict #" not in s for s in q.svgs)


def test_player_is_deterministic_and_self_contained():
    a = step_player(recorded(), render=fake_svg)
    b = step_player(recorded(), render=fake_svg)
    assert a.html == b.html and a.player_id == b.player_id and a.player_id.startswith("kvp-")
    assert a.html.count("<script") == 1 and "src=" not in a.html
    assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", a.html)  # only the SVG namespace
    assert f'document.getElementById("{a.player_id}")' in a.html
    c = step_player(recorded(), render=fake_svg, start=1, title="A <b>title</b>", player_id="p1")
    assert c.num_steps == 7 and c.captions[0].startswith("1 / 7 · insert_prefix(")
    assert 'id="p1"' in c.html and "A &lt;b&gt;title&lt;/b&gt;" in c.html


def test_player_input_errors():
    with pytest.raises(ValueError, match="no snapshots"):
        step_player([], render=fake_svg)
    with pytest.raises(TypeError):
        step_player([1, 2], render=fake_svg)
    with pytest.raises(ValueError, match="interval_ms"):
        step_player(recorded(), render=fake_svg, interval_ms=0)


def test_player_of_an_explorer_uses_its_history():
    ex = Explorer(num_pages=32)
    ex.insert("abc")
    ex.insert("abd")
    p = step_player(ex, render=fake_svg, start=1)
    assert p.num_steps == 2 and 'insert "abd"' in p.captions[1]


@needs_dot
def test_render_svg_strips_the_prolog():
    rec = recorded()
    svg = render_svg(draw_tree(rec.last, rec.decode))
    assert svg.startswith("<svg") and svg.endswith("</svg>") and "<!DOCTYPE" not in svg


# ------------------------------------------- the player's HTML: every string stays in its context
class PlayerDOM(HTMLParser):
    """The elements of a player block, as an HTML parser (a browser's first pass) reads them."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.open: list[tuple[str, dict[str, str]]] = []
        self.data: dict[str, list[str]] = {
            "script": [],
            "style": [],
            "caption": [],
            "title": [],
            "frame": [],
        }

    def handle_starttag(self, tag, attrs):
        a = {k: v or "" for k, v in attrs}
        self.tags.append((tag, a))
        if tag not in ("input",):  # the only void element a player holds
            self.open.append((tag, a))

    def handle_startendtag(self, tag, attrs):
        self.tags.append((tag, {k: v or "" for k, v in attrs}))

    def handle_endtag(self, tag):
        while self.open:
            if self.open.pop()[0] == tag:
                break

    def handle_data(self, data):
        classes = [a.get("class", "") for _, a in self.open]
        tags = [t for t, _ in self.open]
        if tags and tags[-1] in ("script", "style"):
            self.data[tags[-1]].append(data)
        elif "kvp-caption" in classes:
            self.data["caption"].append(data)
        elif "kvp-title" in classes:
            self.data["title"].append(data)
        elif "kvp-frame" in classes:
            self.data["frame"].append(data)


def parse_player(html_text: str) -> PlayerDOM:
    dom = PlayerDOM()
    dom.feed(html_text)
    dom.close()
    return dom


def captioned(captions: list[str]) -> list[TreeSnapshot]:
    snaps = recorded().snapshots
    return [replace(snaps[i % len(snaps)], caption=c) for i, c in enumerate(captions)]


ANY_ID = st.from_regex(PLAYER_ID_PATTERN, fullmatch=True).filter(lambda s: len(s) < 40)
#: Any text, made mostly of what could close a context: quotes, tags, comments, entities, escapes.
NASTY = st.lists(
    st.one_of(
        st.sampled_from(
            [
                '"',
                "'",
                "<",
                ">",
                "&",
                "</script>",
                "</div>",
                "<!--",
                "-->",
                "<svg>",
                "&amp;",
                "&#x27;",
                "\\",
                "\n",
                "\x00",
                "\r",
                "\u2028",
                "`",
                "${",
                " ",
                "=",
                "/",
            ]
        ),
        st.text(max_size=4),
    ),
    max_size=8,
).map("".join)


@settings(
    derandomize=True, max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    captions=st.lists(NASTY, min_size=1, max_size=4),
    title=NASTY,
    player_id=st.one_of(st.none(), ANY_ID),
    interval=st.integers(50, 10**6),
)
def test_player_strings_never_leave_their_context(captions, title, player_id, interval):
    """Whatever the captions, title and id hold, the block parses into exactly the player's
    elements, with each string back as the text or attribute value it was given."""
    snaps = captioned(captions)
    p = step_player(
        snaps,
        title=title,
        player_id=player_id,
        interval_ms=interval,
        render=lambda g: "<svg></svg>",
    )
    dom = parse_player(p.html)
    assert {t for t, _ in dom.tags} <= {
        "div",
        "style",
        "b",
        "button",
        "input",
        "span",
        "script",
        "svg",
    }
    assert dom.tags[0] == ("div", dom.tags[0][1]) and dom.tags[0][1]["id"] == p.player_id
    assert PLAYER_ID_PATTERN.fullmatch(p.player_id) and (
        player_id is None or p.player_id == player_id
    )
    assert [t for t, _ in dom.tags].count("script") == 1 and [t for t, _ in dom.tags].count(
        "style"
    ) == 1
    expected_js = (
        static_file("player.js")
        .replace("__INTERVAL_MS__", str(interval))
        .replace("__PLAYER_ID__", json.dumps(p.player_id))
    )
    assert "".join(dom.data["script"]) == "\n" + expected_js
    assert "".join(dom.data["style"]) == "\n" + static_file("player.css")
    frames = [a for t, a in dom.tags if a.get("class") == "kvp-frame"]
    assert [f["data-caption"] for f in frames] == captions
    assert [f["data-step"] for f in frames] == [str(i) for i in range(len(captions))]
    assert "".join(dom.data["caption"]) == captions[0]
    assert "".join(dom.data["title"]) == title
    assert [a["class"] for t, a in dom.tags if t == "button"] == [
        "kvp-first",
        "kvp-prev",
        "kvp-play",
        "kvp-next",
        "kvp-last",
    ]


@needs_dot
@settings(
    derandomize=True, max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(text=NASTY.filter(bool))
def test_player_token_text_stays_text_in_the_svg(text):
    snaps = captioned(["a", "b"])
    p = step_player(snaps, lambda ids: text, max_chars=1000)
    dom = parse_player(p.html)
    assert [t for t, _ in dom.tags].count("script") == 1 and [t for t, _ in dom.tags].count(
        "svg"
    ) == 2
    shown = "".join(dom.data["frame"]).replace("\xa0", " ")
    assert f"“{one_line(text)}”" in shown


def test_player_id_must_be_a_plain_html_id():
    for bad in ('x" onclick="alert(1)', "a</script>", "1abc", "", "a b", "ä", "-x", "a\n"):
        with pytest.raises(ValueError, match="player_id"):
            step_player(recorded(), render=fake_svg, player_id=bad)
    with pytest.raises(TypeError, match="player_id"):
        step_player(recorded(), render=fake_svg, player_id=7)  # type: ignore[arg-type]
    assert js_string("</script><!--&\u2028") == '"\\u003c/script\\u003e\\u003c!--\\u0026\\u2028"'


@settings(derandomize=True, max_examples=60, deadline=None)
@given(bad=st.text(max_size=12).filter(lambda s: not PLAYER_ID_PATTERN.fullmatch(s)))
def test_any_other_player_id_is_refused(bad):
    with pytest.raises(ValueError, match="player_id"):
        step_player(recorded(), render=fake_svg, player_id=bad)


def test_player_script_and_style_are_package_data():
    js, css = static_file("player.js"), static_file("player.css")
    assert js.count("__PLAYER_ID__") == 1 and js.count("__INTERVAL_MS__") == 1
    assert ".kvp-frame" in css and "<" not in css
    p = step_player(recorded(), render=fake_svg, interval_ms=700)
    assert "__PLAYER_ID__" not in p.html and "__INTERVAL_MS__" not in p.html and "700);" in p.html
    assert css in p.html


def test_player_and_explorer_wrong_types_name_the_argument():
    rec = recorded()
    cases = [
        (lambda: step_player(rec, render=fake_svg, interval_ms=1.5), TypeError, "interval_ms"),
        (lambda: step_player(rec, render=fake_svg, start=-1), ValueError, "start"),
        (lambda: step_player(rec, render=fake_svg, start="1"), TypeError, "start"),
        (lambda: step_player(rec, render=fake_svg, title=None), TypeError, "title"),
        (lambda: step_player(rec, render="svg"), TypeError, "render"),
        (lambda: step_player(rec, render=lambda g: b"<svg/>"), TypeError, "render"),
        (lambda: step_player(rec, decode=5, render=fake_svg), TypeError, "decode"),
        (lambda: step_player("abc", render=fake_svg), TypeError, "source"),
        (lambda: render_svg("digraph {}"), TypeError, "graph"),
        (lambda: Explorer(max_log=0), ValueError, "max_log"),
        (lambda: Explorer(presets="ab"), TypeError, "presets"),
        (lambda: Explorer(presets=[("a", 1)]), TypeError, "presets"),
        (lambda: Explorer(tokenizer=object()), TypeError, "tokenizer"),
        (lambda: Explorer(num_pages=0), ValueError, "num_pages"),
    ]
    for call, error, name in cases:
        with pytest.raises(error, match=rf"\b{name}\b"):
            call()


def test_explorer_refuses_a_bad_evict_size_without_raising():
    ex = Explorer(num_pages=16)
    ex.insert("abc")
    before = (tree_text(ex.manager), ex.allocator.free_pages().tolist())
    assert ex.evict(-1) == [] and ex.evict(1.5) == []  # type: ignore[arg-type]
    assert not ex.last_ok and ex.log[-1].startswith("✗ evict(1.5) refused")
    assert (tree_text(ex.manager), ex.allocator.free_pages().tolist()) == before
    assert ex.history.last.evict_size is None
    ex.flow.check_integrity()
