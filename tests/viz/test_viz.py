"""kvcache.viz: DOT structure, labels and colours per state; snapshots, diffs, eviction preview; text form.

Only the DOT source (``.source``) is checked, never SVG bytes.
"""

from __future__ import annotations

import copy
import math
import re
import shutil
import sys
from dataclasses import FrozenInstanceError, replace
from xml.etree import ElementTree

import pytest
import torch
from conftest import slots
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcache import (
    BlockHashCacheManager,
    NaiveCacheManager,
    PageAllocator,
    RadixCacheManager,
    RequestFlow,
)
from kvcache.serving.tokenizer import ByteTokenizer
from kvcache.viz import (
    PALETTE,
    TreeRecorder,
    TreeSnapshot,
    diff_snapshots,
    draw_sequence,
    draw_tree,
    format_indices,
    format_tokens,
    predict_evict,
    render_svg,
    snapshot,
    tree_text,
)
from kvcache.viz.text import one_line

needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz 'dot' not installed")

WORDS = ["Hello", "world", "there", "how", "are", "you", "what", "is", "your", "name"]


def words(text: str) -> torch.Tensor:
    return torch.tensor([WORDS.index(w) for w in text.split()], dtype=torch.int64)


def say(ids: list[int]) -> str:
    return " ".join(WORDS[i] for i in ids)


def source_13_4() -> tuple[RadixCacheManager, TreeRecorder]:
    """§13.4: "Hello world", "Hello there", "Hello world how are you" inserted in that order."""
    rec = TreeRecorder(RadixCacheManager(), decode=say)
    rec.insert_prefix(words("Hello world"), slots(1, 2))
    rec.insert_prefix(words("Hello there"), slots(1, 3))
    rec.insert_prefix(words("Hello world how are you"), slots(1, 2, 4, 5, 6))
    return rec.manager, rec


# ------------------------------------------------------------------ DOT parsing helpers
def dot_nodes(src: str) -> dict[str, str]:
    """``{name: attribute text}`` of every node statement (not edges, not graph attributes)."""
    out = {}
    for m in re.finditer(r"^\s*(\w+) \[(.*)\]$", src, re.M):
        if m.group(1) not in ("graph", "node", "edge"):
            out[m.group(1)] = m.group(2)
    return out


def dot_edges(src: str, visible_only: bool = True) -> set[tuple[str, str]]:
    edges = set()
    for m in re.finditer(r"^\s*(\w+) -> (\w+)(.*)$", src, re.M):
        if visible_only and "invis" in m.group(3):
            continue
        edges.add((m.group(1), m.group(2)))
    return edges


def attr(attrs: str, key: str) -> str:
    m = re.search(rf'\b{key}="?([^" ]*)', attrs)
    return m.group(1) if m else ""


# ------------------------------------------------------------------------ text form
def test_tree_text_source_13_4_exact():
    manager, _ = source_13_4()
    assert tree_text(manager, say) == (
        "root\n"
        "└── [Hello] → [1] ref=0 t=3\n"
        "    ├── [world] → [2] ref=0 t=3\n"
        "    │   └── [how are you] → [4–6] ref=0 t=3\n"
        "    └── [there] → [3] ref=0 t=2"
    )
    # Step 4 of §13.4: request 3 holds its path; evicting 2 would fail, so nothing is marked.
    handle, _ = manager.match_prefix(words("Hello world how are you"))
    manager.lock_handle(handle)
    assert tree_text(manager, say, evict_size=2) == (
        "root\n"
        "└── [Hello] → [1] ref=1 t=4\n"
        "    ├── [world] → [2] ref=1 t=4\n"
        "    │   └── [how are you] → [4–6] ref=1 t=4\n"
        "    └── [there] → [3] ref=0 t=2"
    )
    # Without a decoder the ids are shown; marks name the leaves evict(1) would take.
    manager.lock_handle(handle, unlock=True)
    assert (
        tree_text(manager, evict_size=1).splitlines()[-1]
        == "    └── [2] → [3] ref=0 t=2 (evict #1)"
    )


def test_tree_text_marks_shortening_and_fifo():
    tok = ByteTokenizer()
    m = RadixCacheManager(eviction_policy="fifo")
    rec = TreeRecorder(m, decode=tok)
    long = "The quick brown fox jumps over the lazy dog, " * 3
    rec.insert_prefix(tok.encode(long), torch.arange(len(long), dtype=torch.int32))
    text = tree_text(rec.last, tok)
    assert text.endswith(f"ref=0 t=1 in=1 ({len(long)} tokens, new)")
    assert "…" in text and len(text.splitlines()[1]) < 120
    rec.insert_prefix(tok.encode("The quick cat"), slots(*range(10), 500, 501, 502))
    lines = tree_text(rec.last, tok).splitlines()
    assert lines[1] == "└── [The quick ] → [0–9] ref=0 t=2 in=1 (split)"
    assert lines[3] == "    └── [cat] → [500–502] ref=0 t=2 in=2 (new)"


def test_format_helpers():
    assert format_indices([4, 5, 6, 7, 8, 9, 12]) == "4–9, 12"
    assert format_indices([]) == ""
    assert format_indices([1, 3, 5, 7, 9, 11], max_runs=4) == "1, 3, 5, …, 11"
    assert format_tokens([1, 2, 3]) == "1, 2, 3"
    short = format_tokens(list(range(100)), max_chars=24)
    assert short.startswith("0, 1, 2") and short.endswith("98, 99") and ", …, " in short
    assert len(short) <= 30
    tok = ByteTokenizer()
    assert format_tokens(tok.encode("a\nb"), tok) == "a\\nb"  # always one line
    cut = format_tokens(tok.encode("abcdefghijklmnopqrstuvwxyz0123456789"), tok, max_chars=16)
    assert cut.startswith("abcdefghi") and cut.endswith("789") and "…" in cut


# --------------------------------------------------------------------- DOT structure
def test_draw_tree_one_node_per_tree_node_and_parent_edges():
    manager, _ = source_13_4()
    g = draw_tree(manager, say)
    nodes, edges = dot_nodes(g.source), dot_edges(g.source)
    assert set(nodes) == {f"n{n.uuid}" for n in manager.nodes()}
    expected = {(f"n{n.parent.uuid}", f"n{n.uuid}") for n in manager.nodes() if not n.is_root()}
    assert edges == expected
    root = nodes[f"n{manager.root_node.uuid}"]
    assert "label=root" in root and "shape=circle" in root


def test_labels_show_tokens_slots_ref_and_age():
    manager, _ = source_13_4()
    handle, _ = manager.match_prefix(words("Hello there"))
    manager.lock_handle(handle)
    nodes = dot_nodes(draw_tree(manager, say).source)
    by_text = {n.key.tolist().__repr__(): n for n in manager.nodes()}
    there = by_text[repr(words("there").tolist())]
    label = nodes[f"n{there.uuid}"]
    assert "“there”" in label and "slots 3" in label and "ref 1 · t 4" in label
    how = by_text[repr(words("how are you").tolist())]
    assert "“how are you”" in nodes[f"n{how.uuid}"] and "slots 4–6" in nodes[f"n{how.uuid}"]
    # Ids without a decoder; FIFO trees also show the insert time.
    fifo = RadixCacheManager(eviction_policy="fifo")
    fifo.insert_prefix(words("Hello world"), slots(7, 8))
    fifo.match_prefix(words("Hello world"))
    (label,) = [v for k, v in dot_nodes(draw_tree(fifo).source).items() if "slots" in v]
    assert "[0, 1]" in label and "slots 7–8" in label and "ref 0 · t 2 in 1" in label


def test_long_keys_are_shortened_with_their_count():
    tok = ByteTokenizer()
    m = RadixCacheManager()
    text = "".join(chr(ord("a") + i % 26) for i in range(100))
    m.insert_prefix(tok.encode(text), torch.arange(100, dtype=torch.int32))
    (label,) = [
        v for v in dot_nodes(draw_tree(m, tok, max_chars=20).source).values() if "slots" in v
    ]
    shown = re.search(r"“([^”]*)”", label).group(1)
    assert (
        shown.startswith("abcdefgh") and "…" in shown and shown.endswith("uv") and len(shown) <= 20
    )
    assert "100 tokens · slots 0–99" in label


def test_colours_per_state():
    """Protected, evictable, just inserted, just split, about to be evicted, evicted ghost."""
    rec = TreeRecorder(RadixCacheManager(), decode=say)
    rec.insert_prefix(words("Hello world"), slots(0, 1))
    h, _ = rec.match_prefix(words("Hello world"))
    rec.lock_handle(h)
    rec.insert_prefix(words("Hello there"), slots(0, 2))  # splits [Hello world], inserts [there]
    m = rec.manager
    uuid = {say(n.key.tolist()): n.uuid for n in m.nodes() if not n.is_root()}
    nodes = dot_nodes(draw_tree(rec.last, say).source)

    def node(word: str) -> str:
        return nodes[f"n{uuid[word]}"]

    assert attr(node("Hello"), "fillcolor") == PALETTE["protected"]["fillcolor"]
    assert attr(node("Hello"), "color") == PALETTE["split"]["color"]  # split-off prefix
    assert attr(node("world"), "color") == PALETTE["split"]["color"]  # old node keeping the suffix
    assert attr(node("there"), "fillcolor") == PALETTE["inserted"]["fillcolor"]
    assert (
        "kv-protected" in node("Hello")
        and "kv-split" in node("world")
        and "kv-inserted" in node("there")
    )
    # A drawing of the manager itself has no history: plain protected / evictable.
    plain = dot_nodes(draw_tree(m, say).source)
    assert attr(plain[f"n{uuid['there']}"], "fillcolor") == PALETTE["evictable"]["fillcolor"]
    assert attr(plain[f"n{uuid['world']}"], "fillcolor") == PALETTE["protected"]["fillcolor"]
    assert attr(plain[f"n{uuid['world']}"], "penwidth") == PALETTE["protected"]["penwidth"]
    # About to be evicted: red dashed, numbered; everything else not.
    marked = dot_nodes(draw_tree(m, say, evict_size=1).source)
    there = marked[f"n{uuid['there']}"]
    assert (
        attr(there, "fillcolor") == PALETTE["evict"]["fillcolor"]
        and "dashed" in there
        and "evict #1" in there
    )
    assert sum("evict #" in v for v in marked.values()) == 1
    # Evicted: a ghost hangs dashed and grey under its old parent in the snapshot after the evict.
    rec.evict(1)
    src = draw_tree(rec.last, say).source
    ghost = dot_nodes(src)[f"n{uuid['there']}"]
    assert (
        attr(ghost, "color") == PALETTE["evicted"]["color"]
        and "dashed" in ghost
        and "kv-evicted" in ghost
    )
    assert re.search(rf"n{uuid['Hello']} -> n{uuid['there']} \[.*style=dashed", src)
    assert f"n{uuid['there']}" not in dot_nodes(draw_tree(rec.last, say, show_evicted=False).source)


def test_legend_and_layout_direction():
    manager, _ = source_13_4()
    src = draw_tree(manager, say, legend=True).source
    assert "rankdir=TB" in src and 'fontname="DejaVu Sans"' in src
    assert (
        "evictable (ref 0)" in src and "protected" not in src.split('label=<<TABLE BORDER="1"')[1]
    )
    assert "evictable (ref 0)" not in draw_tree(manager, say, legend=False).source
    big = RadixCacheManager()
    for i in range(20):
        big.insert_prefix(torch.tensor([i, 100 + i]), slots(2 * i, 2 * i + 1))
    g = draw_tree(big)
    assert (
        "rankdir=LR" in g.source
        and len([k for k in dot_nodes(g.source) if k.startswith("n")]) == 21
    )
    # dot stacks LR clusters bottom-up: panels are emitted last first so that panel 1 is on top.
    rec = TreeRecorder(big)
    rec.evict(1)
    rec.evict(1)
    src = rec.draw().source
    assert "rankdir=LR" in src and src.index("cluster_2") < src.index("cluster_1") < src.index(
        "cluster_0"
    )


# ------------------------------------------------------------------ snapshots, diffs, sequences
def test_snapshot_diff_detects_new_split_and_evicted():
    m = RadixCacheManager()
    m.insert_prefix(words("Hello world"), slots(0, 1))
    before = snapshot(m)
    (old,) = [n.uuid for n in before.nodes[1:]]
    m.insert_prefix(words("Hello there"), slots(0, 2))
    after = diff_snapshots(before, snapshot(m))
    prefix = after.by_uuid[old].parent
    (there,) = after.new
    assert after.split == {prefix} and after.shrunk == {old} and after.evicted == ()
    assert after.by_uuid[prefix].tokens == (0,) and after.by_uuid[old].tokens == (1,)
    assert after.by_uuid[there].tokens == (2,) and after.by_uuid[there].indices == (2,)
    m.evict(1)
    gone = diff_snapshots(after, snapshot(m))
    assert [n.uuid for n in gone.evicted] == [old] and not gone.new and not gone.split
    with pytest.raises(FrozenInstanceError):
        gone.caption = "frozen"  # type: ignore[misc]


def test_snapshot_with_pages():
    m = RadixCacheManager(page_size=4)
    m.insert_prefix(torch.arange(10), torch.arange(10, dtype=torch.int32))  # 8 tokens enter
    m.insert_prefix(torch.tensor([0, 1, 2, 3, 9, 9, 9, 9]), slots(0, 1, 2, 3, 20, 21, 22, 23))
    snap = snapshot(m)
    assert snap.page_size == 4 and snap.num_nodes == 3
    assert all(n.length % 4 == 0 for n in snap.nodes[1:])
    assert tree_text(snap) == (
        "root\n"
        "└── [0, 1, 2, 3] → [0–3] ref=0 t=2\n"
        "    ├── [4, 5, 6, 7] → [4–7] ref=0 t=1\n"
        "    └── [9, 9, 9, 9] → [20–23] ref=0 t=2"
    )


def test_recorder_is_transparent_and_captions_each_call():
    plain, _ = source_13_4()
    manager, rec = source_13_4()
    assert tree_text(plain) == tree_text(manager)
    h, idx = rec.match_prefix(words("Hello world how"))
    assert h.cached_len == 3 and idx.tolist() == [1, 2, 4]
    rec.lock_handle(h)
    with pytest.raises(RuntimeError, match="cannot evict 5"):
        rec.evict(5)
    rec.lock_handle(h, unlock=True)
    assert rec.evict(1).tolist() == [3]
    assert rec.size_info == manager.size_info  # other attributes are the manager's
    captions = [s.caption for s in rec.snapshots]
    assert captions == [
        "empty tree",
        'insert_prefix("Hello world", [1–2]) → 0',
        'insert_prefix("Hello there", [1, 3]) → 1',
        'insert_prefix("Hello world how are you", [1–2, 4–6]) → 2',
        'match_prefix("Hello world how") → cached_len=3',
        'lock_handle(h("Hello world how"))',
        "evict(5) ✗ cannot evict 5 tokens: only 3 are evictable (3 are locked)",
        'lock_handle(h("Hello world how"), unlock=True)',
        "evict(1) → [3]",
    ]
    assert rec.snapshots[-1].evict_size == 1 and rec.snapshots[-3].evict_size == 5
    assert "3. insert_prefix" in rec.text()


def test_draw_sequence_clusters_captions_and_eviction_preview():
    _manager, rec = source_13_4()
    rec.evict(1)
    g = draw_sequence(rec, say, per_row=2)
    src = g.source
    n = len(rec.snapshots)
    assert all(f"subgraph cluster_{i} " in src for i in range(n)) and f"cluster_{n}" not in src
    assert "1. empty tree" in src and "5. evict(1) → [3]" in src
    # Every panel's nodes are its own, with its own edges.
    nodes = dot_nodes(src)
    for i, snap in enumerate(rec.snapshots):
        mine = {k for k in nodes if k.startswith(f"s{i}n")}
        assert mine == {f"s{i}n{u}" for u in snap.by_uuid} | {
            f"s{i}n{e.uuid}" for e in snap.evicted
        }
    # Panel 4 (before the evict) previews the leaf evict(1) takes; panel 5 shows it as a ghost.
    (there,) = [u for u, node in rec.snapshots[3].by_uuid.items() if node.tokens == (2,)]
    assert "evict #1" in nodes[f"s3n{there}"] and "kv-evict" in nodes[f"s3n{there}"]
    assert "kv-evicted" in nodes[f"s4n{there}"]
    assert "evict #" not in "".join(v for k, v in nodes.items() if not k.startswith("s3n"))
    # Rows: two panels side by side (same rank), then the next row below.
    assert (
        src.count("rank=same") == 2 and "evicted (ghost)" in src
    )  # 2 rows (3 + 2 panels), the key
    assert "evict #" not in draw_sequence(rec, say, preview_evictions=False).source


def test_recorder_records_a_request_flow():
    tok = ByteTokenizer()
    m = RadixCacheManager(page_size=2)
    rec = TreeRecorder(m, decode=tok)
    flow = RequestFlow(m, PageAllocator(16, page_size=2), on_event=rec.on_event)
    for text in ("Hello world", "Hello there"):
        req = flow.begin(tok.encode(text))
        flow.mark_computed(req)
        flow.finish(req)
    captions = [s.caption for s in rec.snapshots]
    assert captions[0] == "empty tree"
    assert captions[1] == "req 0 · step 4 insert_prefix: 10 tokens, 0 already cached"
    assert captions[2] == "req 1 · step 1 match_prefix: cached_len=6 indices=[0, 1, 2, 3, 4, 5]"
    assert rec.snapshots[2].split and rec.snapshots[2].shrunk  # the match split [Hello worl]
    # Match and lock are one manager call, and events are sent once `begin` has applied: the
    # lock is in the tree the match event shows (protected: the matched [Hello ] node, ref 1).
    assert rec.snapshots[2].protected_size == 6
    assert [n.ref_count for n in rec.snapshots[2].nodes if n.tokens[:1] == tuple(b"H")] == [1]
    assert all(
        a.nodes != b.nodes for a, b in zip(rec.snapshots, rec.snapshots[1:], strict=False)
    )  # no repeats
    assert tree_text(m, tok) == (
        "root\n"
        "└── [Hello ] → [0–5] ref=0 t=4\n"
        "    ├── [worl] → [6–9] ref=0 t=2\n"
        "    └── [ther] → [12–15] ref=0 t=4"
    )


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz 'dot' not installed")
def test_dot_accepts_the_source():
    manager, rec = source_13_4()
    rec.evict(1)
    for g in (draw_tree(manager, say, legend=True, evict_size=1), draw_sequence(rec, say)):
        svg = g.pipe(format="svg")
        assert b"<svg" in svg


# ------------------------------------------------------------------ eviction preview = evict
OPS = st.lists(
    st.tuples(
        st.sampled_from(["insert", "match_lock", "unlock"]),
        st.lists(st.integers(0, 2), min_size=1, max_size=6),
    ),
    min_size=1,
    max_size=14,
)


@settings(
    derandomize=True, max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(ops=OPS, policy=st.sampled_from(["lru", "fifo"]), page_size=st.sampled_from([1, 2]))
def test_predicted_eviction_matches_a_real_evict(ops, policy, page_size):
    m = RadixCacheManager(page_size=page_size, eviction_policy=policy)
    next_slot, locked = 0, []
    for op, toks in ops:
        ids = torch.tensor(toks, dtype=torch.int64)
        if op == "insert":
            n = len(toks)
            m.insert_prefix(ids, torch.arange(next_slot, next_slot + n, dtype=torch.int32))
            next_slot += -(-n // page_size) * page_size
        elif op == "match_lock":
            h, _ = m.match_prefix(ids)
            m.lock_handle(h)
            locked.append(h)
        elif locked:
            m.lock_handle(locked.pop(0), unlock=True)
    before = snapshot(m)
    for size in range(1, m.size_info.evictable_size + 1):
        order = predict_evict(m, size)
        assert snapshot(m).nodes == before.nodes  # prediction changed nothing
        twin = copy.deepcopy(m)
        got = twin.evict(size)
        expected = [i for u in order for i in before.by_uuid[u].indices]
        assert got.tolist() == expected
        twin.check_integrity()
    with pytest.raises(RuntimeError):
        predict_evict(m, m.size_info.evictable_size + 1)
    assert predict_evict(m, 0) == []


# ---------------------------------------------------------------------- tokenizer
def test_byte_tokenizer():
    tok = ByteTokenizer()
    ids = tok.encode("héllo")
    assert ids.dtype == torch.int64 and ids.tolist() == list("héllo".encode())
    assert tok.decode(ids) == "héllo" and tok.decode(ids.tolist()) == "héllo"
    assert tok.decode(ids[:2]) == "h\\xc3"  # a key may end inside a character
    assert tok.decode(tok.encode("a\tb\n\x01")) == "a\\tb\\n\\x01"
    with pytest.raises(ValueError):
        tok.decode([256])
    with pytest.raises(TypeError):
        tok.encode(b"bytes")  # type: ignore[arg-type]
    assert isinstance(snapshot(RadixCacheManager()), TreeSnapshot)


# ----------------------------------------------------- any depth: no recursion over the tree
def deep_chain(depth: int) -> RadixCacheManager:
    """A request cached after every decode token: ``depth`` nodes, each the only child of the last."""
    m = RadixCacheManager()
    ids = torch.arange(depth, dtype=torch.int64) % 7
    for k in range(1, depth + 1):
        m.insert_prefix(ids[:k], torch.arange(k, dtype=torch.int32))
    return m


def test_a_chain_deeper_than_the_recursion_limit():
    depth = 1100
    assert sys.getrecursionlimit() < depth, "the test needs a chain deeper than the recursion limit"
    m = deep_chain(depth)
    assert m.num_nodes == depth
    snap = snapshot(m)
    assert snap.num_nodes == depth and max(snap.depths().values()) == depth
    lines = tree_text(snap).splitlines()
    assert len(lines) == depth + 1
    assert (
        lines[-1]
        == " " * 4 * (depth - 1) + f"└── [{(depth - 1) % 7}] → [{depth - 1}] ref=0 t={depth}"
    )
    graph = draw_tree(m, evict_size=3)
    assert len(dot_edges(graph.source)) == depth and graph.source.count("evict #") == 3
    if shutil.which("dot") is not None:  # graphviz lays the chain out too (well under a second)
        assert render_svg(graph).count('class="node') == depth + 1
    order = predict_evict(m, depth)
    by_depth = snap.depths()
    assert [by_depth[u] for u in order] == list(range(depth, 0, -1))  # deepest first, up the chain
    rec = TreeRecorder(m)
    rec.evict(2)
    assert {n.uuid for n in rec.last.evicted} == set(order[:2])
    assert diff_snapshots(snap, rec.last).evicted == rec.last.evicted
    assert draw_sequence(rec).source.count("subgraph cluster_") == 2  # two panels
    assert "2. evict(2)" in rec.text()


# ------------------------------------------------- wrong types fail early, naming the argument
def test_snapshot_refuses_managers_without_a_tree():
    for manager in (BlockHashCacheManager(), NaiveCacheManager(), object(), None):
        with pytest.raises(TypeError, match=r"^manager must be a RadixCacheManager"):
            snapshot(manager)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"^manager must be a RadixCacheManager"):
            TreeRecorder(manager)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"^tree must be"):
            tree_text(manager)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"^tree must be"):
            draw_tree(manager)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"^tree must be"):
            predict_evict(manager, 0)  # type: ignore[arg-type]


def _bad_calls(m: RadixCacheManager, rec: TreeRecorder):
    """``(call, exception, argument name)`` for every public function of the package."""
    snap = rec.last
    return [
        (lambda: snapshot(m, 3), TypeError, "caption"),
        (lambda: snapshot(m, previous=m), TypeError, "previous"),
        (lambda: snapshot(m, evict_size=1.0), TypeError, "evict_size"),
        (lambda: snapshot(m, evict_size=-1), ValueError, "evict_size"),
        (lambda: diff_snapshots(snap, m), TypeError, "after"),
        (lambda: diff_snapshots(None, snap), TypeError, "before"),
        (lambda: predict_evict(m, 1.0), TypeError, "size"),
        (lambda: predict_evict(m, True), TypeError, "size"),
        (lambda: predict_evict(m, -1), ValueError, "size"),
        (lambda: format_tokens("abc"), TypeError, "tokens"),
        (lambda: format_tokens([1, 2.5]), TypeError, "tokens"),
        (lambda: format_tokens(torch.ones(2)), TypeError, "tokens"),
        (lambda: format_tokens([1], max_chars=0), ValueError, "max_chars"),
        (lambda: format_tokens([1], decode=3), TypeError, "decode"),
        (lambda: format_tokens([1], decode=lambda ids: ids), TypeError, "decode"),
        (lambda: format_indices([True]), TypeError, "indices"),
        (lambda: format_indices(5), TypeError, "indices"),
        (lambda: format_indices([1], max_runs=1.5), TypeError, "max_runs"),
        (lambda: tree_text(m, decode=3), TypeError, "decode"),
        (lambda: tree_text(m, max_chars="9"), TypeError, "max_chars"),
        (lambda: tree_text(m, evict_size="2"), TypeError, "evict_size"),
        (lambda: draw_tree(m, title=3), TypeError, "title"),
        (lambda: draw_tree(m, font_size="big"), TypeError, "font_size"),
        (lambda: draw_tree(m, font_size=0), ValueError, "font_size"),
        (lambda: draw_tree(m, rankdir="up"), ValueError, "rankdir"),
        (lambda: draw_tree(m, evict_size=-1), ValueError, "evict_size"),
        (lambda: draw_tree(m, max_chars=0), ValueError, "max_chars"),
        (lambda: draw_sequence(3), TypeError, "snapshots"),
        (lambda: draw_sequence(snap), TypeError, "snapshots"),
        (lambda: draw_sequence([snap, m]), TypeError, "snapshots"),
        (lambda: draw_sequence(rec, per_row=0), ValueError, "per_row"),
        (lambda: draw_sequence(rec, per_row=1.0), TypeError, "per_row"),
        (lambda: draw_sequence(rec, caption_width=None), TypeError, "caption_width"),
        (lambda: draw_sequence(rec, max_width="wide"), TypeError, "max_width"),
        (lambda: draw_sequence(rec, max_width=10), ValueError, "max_width"),
        (lambda: draw_tree(m, title_width=True), TypeError, "title_width"),
        (lambda: draw_tree(m, title_width=float("nan")), ValueError, "title_width"),
        (lambda: TreeRecorder(m, decode=3), TypeError, "decode"),
        (lambda: TreeRecorder(m, snapshots=[1]), TypeError, "snapshots"),
        (lambda: rec.record(None), TypeError, "caption"),
    ]


def test_wrong_arguments_raise_naming_the_argument_and_change_nothing():
    manager, rec = source_13_4()
    before_tree, before_snaps = tree_text(manager), list(rec.snapshots)
    for call, error, name in _bad_calls(manager, rec):
        with pytest.raises(error, match=rf"\b{name}\b"):
            call()
    assert tree_text(manager) == before_tree and rec.snapshots == before_snaps


# ---------------------------------------- escaping: text reaches DOT and SVG only as text
def test_one_line_escapes_every_invisible_character():
    assert one_line("a\tb\nc\rd") == "a\\tb\\nc\\rd"
    assert one_line("\x00\x7f\u2028\u202e\ufffe") == "\\x00\\x7f\\u2028\\u202e\\ufffe"
    assert one_line("héllo wörld 😀 \\n") == "héllo wörld 😀 \\n"  # printable text is kept as is


SVG_NS = "{http://www.w3.org/2000/svg}"


def _svg_texts(element, deep: bool = False) -> list[str]:
    """Visible text of ``element``'s ``<text>`` children (all descendants with ``deep``)."""
    found = element.iter(f"{SVG_NS}text") if deep else element.findall(f"{SVG_NS}text")
    return ["".join(e.itertext()).replace("\xa0", " ") for e in found]  # dot pads with nbsp


@needs_dot
@settings(
    derandomize=True, max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(text=st.text(max_size=30))
def test_any_text_is_drawn_as_written(text):
    """Titles, captions and token text, whatever they hold, come out of graphviz as the same
    visible text (control characters escaped), and the SVG is well-formed: nothing is taken
    for DOT syntax, an HTML label, an escape like ``\\N`` or an entity."""
    m = RadixCacheManager()
    m.insert_prefix(torch.tensor([1, 2]), slots(0, 1))
    snap = replace(snapshot(m), caption=text)
    decode = lambda ids: text  # noqa: E731
    root = ElementTree.fromstring(
        render_svg(draw_tree(snap, decode, max_chars=1000, legend=False, title_width=100_000))
    )  # one line a line
    graph = root.find(f"{SVG_NS}g")
    title = [t.strip() for t in _svg_texts(graph)]
    assert title == [one_line(line).strip() for line in text.split("\n") if line.strip()]
    nodes = [g for g in graph.findall(f"{SVG_NS}g") if g.get("class", "").split()[:1] == ["node"]]
    assert len(nodes) == 2 and _svg_texts(nodes[1], deep=True)[0] == f"“{one_line(text)}”"
    seq = ElementTree.fromstring(render_svg(draw_sequence([snap, snap], decode)))
    clusters = [
        g for g in seq.find(f"{SVG_NS}g").findall(f"{SVG_NS}g") if g.get("class") == "cluster"
    ]
    assert len(clusters) == 2  # two panels (the key is the graph's label, not a cluster)


def test_recorder_forwards_only_public_names():
    manager, rec = source_13_4()
    assert rec.size_info == manager.size_info and rec.page_size == manager.page_size
    with pytest.raises(AttributeError):
        rec._policy
    assert [s.caption for s in rec] == [s.caption for s in rec.snapshots]  # iterates its snapshots
    assert rec.to_snapshot() is rec.last and copy.deepcopy(rec).last.nodes == rec.last.nodes


def test_formatting_takes_any_integer_sequence():
    import numpy as np

    for slots_ in (
        [4, 5, 6, 9],
        (4, 5, 6, 9),
        torch.tensor([4, 5, 6, 9]),
        np.array([4, 5, 6, 9]),
        [np.int64(4), 5, 6, np.int32(9)],
    ):
        assert format_indices(slots_) == "4–6, 9"
        assert format_tokens(slots_) == "4, 5, 6, 9"
    with pytest.raises(TypeError, match="indices"):
        format_indices(np.array([1.5]))


# ------------------------------------- figures: one font, a key of the colours shown, even grids
def _key_entries(src: str) -> set[str]:
    """The states the figure's colour key lists (read back from its words)."""
    from kvcache.viz.style import LEGEND_TEXT

    key = src.rsplit("label=<<TABLE", 1)[-1] if 'label=<<TABLE BORDER="1"' in src else ""
    return {k for k, words in LEGEND_TEXT.items() if f">{html_escape(words)}<" in key}


def html_escape(text: str) -> str:
    import html

    return html.escape(text)


def _drawn_states(src: str) -> set[str]:
    """The states of the nodes drawn (their ``kv-*`` classes), the root aside."""
    classes = re.findall(r'class="([^"]*)"', src)
    return {c[3:] for cls in classes for c in cls.split() if c.startswith("kv-") and c != "kv-root"}


def test_every_label_names_the_one_installed_font():
    from kvcache.viz.style import FONT

    manager, rec = source_13_4()
    rec.evict(1)
    for g in (draw_tree(manager, say, evict_size=1, title="t"), draw_sequence(rec, say)):
        names = set(re.findall(r'fontname="?([^"\]\s]+(?: [^"\]\s=]+)*)"?', g.source))
        assert names == {FONT}, names  # graph, node and edge defaults: no fallback list
        assert "FACE=" not in g.source  # no label overrides it
        if shutil.which("dot") is not None:
            families = set(re.findall(r'font-family="([^"]*)"', render_svg(g)))
            assert families == {FONT}, families
    if shutil.which("fc-list") is not None:  # `make system-deps` installs it (fonts-dejavu-core)
        import subprocess

        out = subprocess.run(
            ["fc-list", f":family={FONT}", "family"], capture_output=True, text=True
        ).stdout
        assert FONT in out, f"{FONT!r} is not installed: graphviz would measure another font"


def test_the_key_lists_exactly_the_states_drawn():
    _, rec = source_13_4()
    rec.evict(1)
    h, _ = rec.match_prefix(words("Hello world"))
    rec.lock_handle(h)
    rec.insert_prefix(words("Hello there"), slots(1, 3))  # a new leaf next to the protected path
    for i, snap in enumerate(rec.snapshots):
        for evict_size in (None, 1):
            src = draw_tree(snap, say, evict_size=evict_size).source
            assert _key_entries(src) == _drawn_states(src), (i, evict_size)
            assert (
                _key_entries(draw_tree(snap, say, evict_size=evict_size, legend=False).source)
                == set()
            )
    src = draw_sequence(rec, say).source  # a sequence: the union over its panels
    assert (
        _key_entries(src)
        == _drawn_states(src)
        >= {"protected", "evictable", "inserted", "split", "evict", "evicted"}
    )
    assert _key_entries(draw_tree(rec.snapshots[0]).source) == set()  # an empty tree: no key


@settings(derandomize=True, max_examples=60, deadline=None)
@given(
    text=st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=120),
    width=st.floats(20, 400),
)
def test_wrap_keeps_every_character_and_fits_the_width(text, width):
    from kvcache.viz.style import text_width, wrap

    text = one_line(text)
    lines = wrap(text, width, 9)
    assert "".join(lines).replace(" ", "") == text.replace(" ", "")
    assert all(text_width(line, 9) <= width or len(line.strip()) <= 1 for line in lines)


def test_panel_captions_are_wrapped_to_their_panel():
    from kvcache.viz.sequence import _MIN_CAPTION
    from kvcache.viz.style import text_width

    m = RadixCacheManager()
    rec = TreeRecorder(m, decode=say)
    rec.insert_prefix(words("Hello world"), slots(1, 2))
    rec.insert_prefix(words("Hello there how are you"), slots(1, 3, 4, 5, 6))
    src = draw_sequence(rec, say, caption_width=30).source
    captions = re.findall(r'subgraph cluster_\d+ \{\n\t\t[^\n]*? label="((?:[^"\\]|\\.)*)"', src)
    assert len(captions) == 3
    limit = max(_MIN_CAPTION, text_width("n" * 30, 9))
    for caption in captions:
        lines = caption.split("\\l")[:-1]
        assert len(lines) >= 1 and all(
            text_width(line.replace('\\"', '"'), 9) <= limit for line in lines
        )
    assert any(len(c.split("\\l")) > 2 for c in captions)  # the long insert caption did wrap


@given(n=st.integers(1, 40), per_row=st.integers(1, 8))
def test_grid_rows_are_even_and_never_leave_a_panel_alone(n, per_row):
    from kvcache.viz.style import grid_rows

    rows = grid_rows(n, per_row)
    assert sum(rows) == n and max(rows) - min(rows) <= 1 and rows == sorted(rows, reverse=True)
    if per_row == 1:
        assert rows == [1] * n
    else:
        assert max(rows) <= per_row + 1 and (n == 1 or min(rows) >= 2)
        assert len(rows) in (math.ceil(n / per_row), math.ceil(n / per_row) - 1)


@pytest.mark.parametrize(
    "n, per_row, rows",
    [
        (4, 3, [2, 2]),
        (5, 3, [3, 2]),
        (3, 2, [3]),
        (7, 3, [3, 2, 2]),
        (9, 4, [3, 3, 3]),
        (6, 1, [1] * 6),
    ],
)
def test_draw_sequence_lays_panels_in_an_even_grid(n, per_row, rows):
    m = RadixCacheManager()
    rec = TreeRecorder(m)
    for i in range(n - 1):
        rec.insert_prefix(torch.tensor([i]), slots(i))
    src = draw_sequence(rec, per_row=per_row, max_width=10_000).source
    groups = re.findall(r"\{\n\t\trank=same\n((?:\t\t\S+\n)+)\t\}", src)
    assert [len(g.split()) for g in groups] == rows
