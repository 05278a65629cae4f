"""kvcache.viz.diagrams: each figure shows what the package does, and refuses bad input."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import KVCacheLayout, PageAllocator, RadixCacheManager, RequestFlow
from kvcache.viz.diagrams import (
    REQUEST_STEPS,
    DiagramFigure,
    draw_pool_layout,
    draw_request_steps,
    draw_tp_heads,
    pool_block_order,
)

LF, PF = KVCacheLayout.LayerFirst, KVCacheLayout.PageFirst


@given(st.integers(1, 4), st.integers(1, 4))
@settings(max_examples=20, deadline=None)
def test_block_order_is_the_buffer_shape(num_layers, num_pages):
    """Memory order = row-major order of (2, L, P) for LayerFirst and (2, P, L) for PageFirst."""
    lf = pool_block_order(LF, num_layers, num_pages)
    pf = pool_block_order(PF, num_layers, num_pages)
    L, P = range(num_layers), range(num_pages)
    assert lf == [(kv, layer, page) for kv in (0, 1) for layer in L for page in P]
    assert pf == [(kv, layer, page) for kv in (0, 1) for page in P for layer in L]


def test_pool_layout_labels_count_the_runs():
    fig = draw_pool_layout(num_layers=3, num_pages=4, layer=1, page=2)
    assert isinstance(fig, DiagramFigure)
    labels = fig.labels()
    assert "LayerFirst: buffer (2, L, P, page_size, H, D)" in labels
    assert "PageFirst: buffer (2, P, L, page_size, H, D)" in labels
    # one layer: 1 run in LayerFirst, one per page in PageFirst; one page: 2 per layer vs 2
    assert "k_cache(1): 1 contiguous run" in labels
    assert "k_cache(1): 4 contiguous runs" in labels
    assert "page 2, K and V of every layer: 6 contiguous runs" in labels
    assert "page 2, K and V of every layer: 2 contiguous runs" in labels
    assert sum(label == "L2\np3" for label in labels) == 4  # K and V, both layouts
    assert "<svg" in fig._repr_svg_()


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"num_layers": 0}, ValueError),
        ({"num_layers": 5}, ValueError),
        ({"num_pages": 2.0}, TypeError),
        ({"num_pages": True}, TypeError),
        ({"layer": 2}, ValueError),
        ({"page": -1}, ValueError),
    ],
)
def test_pool_layout_refuses_bad_input(kwargs, error):
    with pytest.raises(error):
        draw_pool_layout(**kwargs)


def test_block_order_refuses_a_string_layout():
    with pytest.raises(TypeError, match="KVCacheLayout"):
        pool_block_order("LayerFirst", 2, 2)


@pytest.mark.parametrize(("hq", "hkv", "tp"), [(8, 4, 2), (32, 8, 4), (4, 4, 1), (6, 2, 2)])
def test_tp_heads_put_each_group_with_its_kv_head(hq, hkv, tp):
    fig = draw_tp_heads(hq, hkv, tp)
    labels = fig.labels()
    assert [f"rank {r}" for r in range(tp)] == [t for t in labels if t.startswith("rank ")]
    # every head drawn once, query heads right before their KV head's box, group by group
    q = [int(t[1:]) for t in labels if t[0] == "q" and t[1:].isdigit()]
    kv = [int(t[3:]) for t in labels if t.startswith("KV ")]
    assert sorted(q) == list(range(hq)) and sorted(kv) == list(range(hkv))
    group = hq // hkv
    heads = [t for t in labels if (t[0] == "q" and t[1:].isdigit()) or t.startswith("KV ")]
    order = [("q", int(t[1:])) if t[0] == "q" else ("kv", int(t[3:])) for t in heads]
    for i, (kind, h) in enumerate(order):
        if kind == "kv":
            assert [x for _, x in order[i - group : i]] == [h * group + g for g in range(group)]
    per_rank = hkv // tp
    for r in range(tp):
        lo = r * per_rank
        assert (
            f"query heads {lo * group}–{(lo + per_rank) * group - 1}, KV heads {lo}–{lo + per_rank - 1}"
            in labels
        )


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((8, 3, 1), ValueError, "multiple of num_kv_heads"),
        ((8, 4, 3), ValueError, "not divisible by tp_size=3"),
        ((4, 2, 4), ValueError, "not divisible by tp_size=4"),
        ((8, 4, 0), ValueError, "tp_size"),
        ((8.0, 4, 2), TypeError, "num_q_heads"),
        ((128, 4, 2), ValueError, "num_q_heads"),
    ],
)
def test_tp_heads_refuse_what_the_pool_refuses(args, error, match):
    with pytest.raises(error, match=match):
        draw_tp_heads(*args)


def _one_request_events():
    flow = RequestFlow(RadixCacheManager(), PageAllocator(8), trace=True)
    for prompt in ([1, 2], [1, 2, 3, 4]):
        req = flow.begin(torch.tensor(prompt))
        flow.mark_computed(req)
        flow.finish(req)
    return flow, [e for e in flow.events if e.rid == 1]


def test_request_steps_follow_the_flow():
    _flow, events = _one_request_events()
    # the diagram's order is the order RequestFlow runs the steps
    assert [s[0] for s in REQUEST_STEPS] == [e.step for e in events]
    labels = draw_request_steps().labels()
    for name in (
        "RequestFlow",
        "PageAllocator",
        "begin(input_ids)",
        "finish(req)",
        "mark_computed(req)",
        "the flow calls",  # the colour key
        "the caller calls",
        "returns",
    ):
        assert name in labels
    calls = [call for _, _, _, call, _ in REQUEST_STEPS]
    assert [t for t in labels if t in calls] == calls
    steps = [t for t in labels if t in {"1", "2", "3", "4", "5", "6", "7"}]
    assert steps == ["1", "2", "3", "6", "4", "5", "7"]
    with_details = draw_request_steps(events).labels()
    for e in events:
        assert e.detail in with_details


def test_request_steps_refuse_bad_events():
    flow, events = _one_request_events()
    with pytest.raises(ValueError, match="seven steps"):
        draw_request_steps(events[:-1])
    with pytest.raises(ValueError, match="request ids"):
        draw_request_steps(flow.events)  # two requests
    with pytest.raises(TypeError, match="FlowEvent"):
        draw_request_steps([("step", 1)])
    with pytest.raises(TypeError, match="sequence"):
        draw_request_steps("events")


def test_svg_is_the_same_on_every_call():
    fig = draw_tp_heads()
    assert fig._repr_svg_() == fig._repr_svg_()


@settings(max_examples=25, deadline=None)
@given(st.text(alphabet="$\\^_{}ab1 ", min_size=1, max_size=12))
def test_request_step_details_are_drawn_as_written(detail):
    """An event detail holding ``$...$``, ``\\`` or ``^`` is text, not mathtext: the diagram
    renders (matplotlib raised on unbalanced ``$`` before) and shows it verbatim."""
    _flow, events = _one_request_events()
    events = [dataclasses.replace(e, detail=detail) if e.step == 3 else e for e in events]
    fig = draw_request_steps(events)
    assert detail in fig.labels()
    assert fig._repr_svg_().startswith("<")  # drawn to the end


@pytest.mark.parametrize("kind", ['tree" onload="x', "Tree", "", "a b", 3, "-x"])
def test_figure_kind_must_be_a_css_name(kind):
    from kvcache.viz.figure import figure_html

    with pytest.raises(ValueError, match="kind must be a CSS class name"):
        figure_html("<p>x</p>", "caption", kind)
    assert 'class="kv-figure kv-step-2"' in figure_html("<p>x</p>", "c", "step-2")
