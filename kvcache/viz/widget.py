"""The ipywidgets view of an `Explorer`: the request box, the preset list, the buttons and the panes.

Kept apart from `kvcache.viz.explorer` so that module holds the logic only. ``ipywidgets`` is
imported when a view is built, never at import time. The view knows the explorer only through
`ExplorerActions`, the methods its buttons call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

__all__ = ["ExplorerWidget", "ExplorerActions"]


class ExplorerActions(Protocol):
    """What the view calls on its explorer (`Explorer` is one): a method a button, ``presets``
    for the drop-down, and ``refresh`` when the eviction size or the preview box changes."""

    @property
    def presets(self) -> Sequence[tuple[str, str]]: ...
    def match(self) -> object: ...
    def insert(self) -> object: ...
    def lock(self) -> object: ...
    def unlock(self) -> object: ...
    def evict(self) -> object: ...
    def reset(self) -> object: ...
    def refresh(self) -> None: ...


class ExplorerWidget:
    """The ipywidgets of an `Explorer`: inputs and buttons on top, state and tree below."""

    def __init__(self, ex: ExplorerActions) -> None:
        import ipywidgets as W

        self.ex = ex
        self.text = W.Text(
            value=ex.presets[0][1] if ex.presets else "",
            description="request",
            layout=W.Layout(width="100%"),
        )
        self.preset = W.Dropdown(
            options=[("pick a preset request…", ""), *ex.presets],
            value="",
            description="preset",
            layout=W.Layout(width="100%"),
        )
        self.preset.observe(self._on_preset, names="value")
        self.buttons = {}
        specs = [
            ("match", "match_prefix", "info", lambda: ex.match()),
            ("insert", "insert (serve)", "success", lambda: ex.insert()),
            ("lock", "lock", "primary", lambda: ex.lock()),
            ("unlock", "unlock", "", lambda: ex.unlock()),
            ("evict", "evict N", "danger", lambda: ex.evict()),
            ("reset", "reset", "warning", lambda: ex.reset()),
        ]
        for key, label, style, action in specs:
            b = W.Button(description=label, button_style=style, layout=W.Layout(width="auto"))
            b.on_click(lambda _b, act=action: act())
            self.buttons[key] = b
        self.evict_n = W.BoundedIntText(
            value=4, min=0, max=10**9, description="N", layout=W.Layout(width="9em")
        )
        self.preview = W.Checkbox(value=True, description="mark what evict N takes", indent=False)
        self.evict_n.observe(lambda _c: ex.refresh(), names="value")
        self.preview.observe(lambda _c: ex.refresh(), names="value")
        self.tree = W.HTML()
        self.status = W.HTML()
        self.log = W.HTML()
        row = W.HBox(
            [*self.buttons.values(), self.evict_n, self.preview],
            layout=W.Layout(flex_flow="row wrap", align_items="center"),
        )
        info = W.HBox(
            [
                W.VBox([W.HTML("<b>state</b>"), self.status], layout=W.Layout(width="50%")),
                W.VBox([W.HTML("<b>event log</b>"), self.log], layout=W.Layout(width="50%")),
            ]
        )
        self.box = W.VBox([self.text, self.preset, row, info, self.tree])

    def _on_preset(self, change: Any) -> None:
        if change["new"]:
            self.text.value = change["new"]
