"""Pictures of a prefix cache: snapshots and diffs, text and graphviz drawings, a recorder of
operations, the live ipywidgets explorer and the static step player.

One module a job, each importing only the ones above it in this list:

- `kvcache.viz.snapshot`: `snapshot`, `diff_snapshots`, `predict_evict` (frozen trees);
- `kvcache.viz.text`: `tree_text`, `format_tokens`, `format_indices` (the tree as text);
- `kvcache.viz.drawing`: `draw_tree`, `PALETTE` (graphviz); `kvcache.viz.sequence`: `draw_sequence`;
- `kvcache.viz.recorder`: `TreeRecorder` (a snapshot after every call);
- `kvcache.viz.player`: `step_player`, `StepPlayer`, `render_svg` (static HTML; its script
  and stylesheet are the package data files ``static/player.js`` and ``static/player.css``);
- `kvcache.viz.widget`: `ExplorerWidget` (the explorer's ipywidgets view, built on demand);
- `kvcache.viz.explorer`: `Explorer` (the live widget).

The top of the package: nothing below imports it. ``import kvcache`` does not load it (nor
graphviz); ``from kvcache.viz import draw_tree`` or ``kvcache.draw_tree`` does.
"""

from .drawing import PALETTE, draw_tree
from .explorer import DEFAULT_PRESETS, Explorer
from .player import StepPlayer, render_svg, step_player
from .recorder import TreeRecorder
from .sequence import draw_sequence
from .snapshot import NodeSnapshot, TreeSnapshot, diff_snapshots, predict_evict, snapshot
from .text import format_indices, format_tokens, tree_text

__all__ = [
    "NodeSnapshot",
    "TreeSnapshot",
    "TreeRecorder",
    "snapshot",
    "diff_snapshots",
    "predict_evict",
    "format_indices",
    "format_tokens",
    "tree_text",
    "draw_tree",
    "draw_sequence",
    "PALETTE",
    "Explorer",
    "StepPlayer",
    "step_player",
    "render_svg",
    "DEFAULT_PRESETS",
]
