"""Pictures of a prefix cache: snapshots and diffs, text and graphviz drawings, a recorder of
operations, the live ipywidgets explorer and the static step player.

The top of the package: nothing below imports it. ``import kvcache`` does not load it (nor
graphviz); ``from kvcache.viz import draw_tree`` or ``kvcache.draw_tree`` does.
"""

from .drawing import (
    PALETTE,
    NodeSnapshot,
    TreeRecorder,
    TreeSnapshot,
    diff_snapshots,
    draw_sequence,
    draw_tree,
    format_indices,
    format_tokens,
    predict_evict,
    snapshot,
    tree_text,
)
from .explorer import DEFAULT_PRESETS, Explorer, StepPlayer, render_svg, step_player

__all__ = [
    "NodeSnapshot", "TreeSnapshot", "TreeRecorder", "snapshot", "diff_snapshots", "predict_evict",
    "format_indices", "format_tokens", "tree_text", "draw_tree", "draw_sequence", "PALETTE",
    "Explorer", "StepPlayer", "step_player", "render_svg", "DEFAULT_PRESETS",
]
