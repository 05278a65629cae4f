"""kvcache.viz: DOT structure, labels and colours per state; snapshots, diffs, eviction preview; text form.

Only the DOT source (``.source``) is checked, never SVG bytes.
"""

from __future__ import annotations

import copy
import re
import shutil
from typing import Dict, List, Set, Tuple

import pytest
import torch
from conftest import slots
from hypothesis import HealthCheck, given, settings, strategies as st

from kvcache import PageAllocator, RadixCacheManager, RequestFlow
from kvcache.serving.tokenizer import ByteTokenizer
from kvcache.viz import (
    PALETTE, TreeRecorder, TreeSnapshot, diff_snapshots, draw_sequence, draw_tree, format_indices,
    format_tokens, predict_evict, snapshot, tree_text,
)

WORDS = ["Hello", "world", "there", "how", "are", "you", "what", "is", "your", "name"]


def words(text: str) -> torch.Tensor:
    return torch.tensor([WORDS.index(w) for w in text.split()], dtype=torch.int64)


def say(ids: List[int]) -> str:
    return " ".join(WORDS[i] for i in ids)


def source_13_4() -> Tuple[RadixCacheManager, TreeRecorder]:
    """§13.4: "Hello world", "Hello there", "Hello world how are you" inserted in that order."""
    rec = TreeRecorder(RadixCacheManager(), decode=say)
    rec.insert_prefix(words("Hello world"), slots(1, 2))
    rec.insert_prefix(words("Hello there"), slots(1, 3))
    rec.insert_prefix(words("Hello world how are you"), slots(1, 2, 4, 5, 6))
    return rec.manager, rec


# ------------------------------------------------------------------ DOT parsing helpers
def dot_nodes(src: str) -> Dict[str, str]:
    """``{name: attribute text}`` of every node statement (not edges, not graph attributes)."""
    out = {}
    for m in re.finditer(r"^\s*(\w+) \[(.*)\]$", src, re.M):
        if m.group(1) not in ("graph", "node", "edge"):
            out[m.group(1)] = m.group(2)
    return out


def dot_edges(src: str, visible_only: bool = True) -> Set[Tuple[str, str]]:
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
    assert tree_text(manager, evict_size=1).splitlines()[-1] == "    └── [2] → [3] ref=0 t=2 (evict #1)"


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
    (label,) = [v for v in dot_nodes(draw_tree(m, tok, max_chars=20).source).values() if "slots" in v]
    shown = re.search(r"“([^”]*)”", label).group(1)
    assert shown.startswith("abcdefgh") and "…" in shown and shown.endswith("uv") and len(shown) <= 20
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
    assert "kv-protected" in node("Hello") and "kv-split" in node("world") and "kv-inserted" in node("there")
    # A drawing of the manager itself has no history: plain protected / evictable.
    plain = dot_nodes(draw_tree(m, say).source)
    assert attr(plain[f"n{uuid['there']}"], "fillcolor") == PALETTE["evictable"]["fillcolor"]
    assert attr(plain[f"n{uuid['world']}"], "fillcolor") == PALETTE["protected"]["fillcolor"]
    assert attr(plain[f"n{uuid['world']}"], "penwidth") == PALETTE["protected"]["penwidth"]
    # About to be evicted: red dashed, numbered; everything else not.
    marked = dot_nodes(draw_tree(m, say, evict_size=1).source)
    there = marked[f"n{uuid['there']}"]
    assert attr(there, "fillcolor") == PALETTE["evict"]["fillcolor"] and "dashed" in there and "evict #1" in there
    assert sum("evict #" in v for v in marked.values()) == 1
    # Evicted: a ghost hangs dashed and grey under its old parent in the snapshot after the evict.
    rec.evict(1)
    src = draw_tree(rec.last, say).source
    ghost = dot_nodes(src)[f"n{uuid['there']}"]
    assert attr(ghost, "color") == PALETTE["evicted"]["color"] and "dashed" in ghost and "kv-evicted" in ghost
    assert re.search(rf"n{uuid['Hello']} -> n{uuid['there']} \[.*style=dashed", src)
    assert f"n{uuid['there']}" not in dot_nodes(draw_tree(rec.last, say, show_evicted=False).source)


def test_legend_and_layout_direction():
    manager, _ = source_13_4()
    src = draw_tree(manager, say, legend=True).source
    assert "cluster_legend" in src and "rankdir=TB" in src
    for key in ("protected", "evictable", "inserted", "split", "evict", "evicted"):
        assert f"legend_{key}" in src
    assert "cluster_legend" not in draw_tree(manager, say).source
    big = RadixCacheManager()
    for i in range(20):
        big.insert_prefix(torch.tensor([i, 100 + i]), slots(2 * i, 2 * i + 1))
    g = draw_tree(big)
    assert "rankdir=LR" in g.source and len([k for k in dot_nodes(g.source) if k.startswith("n")]) == 21
    # dot stacks LR clusters bottom-up: panels are emitted last first so that panel 1 is on top.
    rec = TreeRecorder(big)
    rec.evict(1)
    rec.evict(1)
    src = rec.draw().source
    assert "rankdir=LR" in src and src.index("cluster_2") < src.index("cluster_1") < src.index("cluster_0")


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
    with pytest.raises(Exception):
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
    manager, rec = source_13_4()
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
        assert mine == {f"s{i}n{u}" for u in snap.by_uuid} | {f"s{i}n{e.uuid}" for e in snap.evicted}
    # Panel 4 (before the evict) previews the leaf evict(1) takes; panel 5 shows it as a ghost.
    (there,) = [u for u, node in rec.snapshots[3].by_uuid.items() if node.tokens == (2,)]
    assert "evict #1" in nodes[f"s3n{there}"] and "kv-evict" in nodes[f"s3n{there}"]
    assert "kv-evicted" in nodes[f"s4n{there}"]
    assert "evict #" not in "".join(v for k, v in nodes.items() if not k.startswith("s3n"))
    # Rows: two panels side by side (same rank), then the next row below.
    assert src.count("rank=same") == 3 + 1 and "cluster_legend" in src  # 3 rows, the legend
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
    assert any("req 1 · step 2 lock_handle" in c for c in captions)
    assert all(a.nodes != b.nodes for a, b in zip(rec.snapshots, rec.snapshots[1:]))  # no repeats
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
    st.tuples(st.sampled_from(["insert", "match_lock", "unlock"]),
              st.lists(st.integers(0, 2), min_size=1, max_size=6)),
    min_size=1, max_size=14,
)


@settings(derandomize=True, max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
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
