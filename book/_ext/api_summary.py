"""Sphinx extension for the API reference pages (book/api/): two directives that read a layer's
``__all__``, so no page lists names by hand and none can drift from the package.

``.. layer-summary:: kvcache.managers``
    An autosummary table of every name in the module's ``__all__`` (short names, linked).
``.. layer-data:: kvcache.managers``
    An entry for every *data* name of ``__all__`` (constants, registries). autodoc's
    ``automodule`` documents the classes and functions a layer re-exports, but skips data
    defined in a submodule (it only documents data assigned in the module it reads); this
    directive documents it under the layer's name with the ``#:`` comment from the module that
    defines it.

It also lets a docstring's short reference find its target across layers: `RadixCacheManager`
written in ``kvcache.viz`` (or ``kvcache.managers.eviction.EVICTION_POLICIES``, a submodule
path) links to the one entry the pages hold under that name, ``kvcache.managers.X``. Sphinx
alone looks only in the current module and at the top level, and leaves such names unlinked.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from types import ModuleType
from typing import Any

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.ext.autosummary import Autosummary
from sphinx.pycode import ModuleAnalyzer, PycodeError
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import make_refnode


def _public_names(module_name: str) -> tuple[ModuleType, list[str]]:
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None)
    if not names:
        raise ValueError(f"{module_name} has no __all__ to document")
    return module, list(names)


def _is_data(obj: Any) -> bool:
    return not (inspect.isclass(obj) or inspect.isroutine(obj) or inspect.ismodule(obj))


def _data_doc(module: ModuleType, name: str) -> tuple[list[str], str]:
    """The ``#:`` comment lines and the annotation of data ``name`` re-exported by ``module``,
    read from the submodule that assigns it."""
    obj = getattr(module, name)
    prefix = module.__name__
    for sub_name, sub in sorted(sys.modules.items()):
        if not (sub_name == prefix or sub_name.startswith(prefix + ".")) or sub is None:
            continue
        if vars(sub).get(name, None) is not obj:
            continue
        try:
            docs = ModuleAnalyzer.for_module(sub_name).find_attr_docs()
        except PycodeError:
            continue
        if ("", name) in docs:
            annotation = getattr(sub, "__annotations__", {}).get(name, "")
            if not isinstance(annotation, str):
                annotation = inspect.formatannotation(annotation)
            return [line for line in docs[("", name)] if line.strip()], annotation
    return [], ""


class LayerSummary(Autosummary):
    """An autosummary table whose rows are ``<module>.<name>`` for every name in ``__all__``."""

    required_arguments = 1
    has_content = False

    def run(self) -> list[Any]:
        module_name = self.arguments[0]
        try:
            self._module, names = _public_names(module_name)
        except ValueError as err:
            raise self.error(f"layer-summary: {err}") from None
        self.content = StringList(
            [f"~{module_name}.{name}" for name in names],
            source=self.get_source_info()[0],
        )
        self.arguments = []
        return super().run()

    def get_items(self, names: list[str]) -> list[tuple[str, str, str, str]]:
        items = []
        for display, sig, summary, real_name in super().get_items(names):
            obj = getattr(self._module, real_name.rpartition(".")[2], None)
            if _is_data(obj):
                # autosummary would show the docstring of the value's type (dict's, bool's).
                lines, _ = _data_doc(self._module, real_name.rpartition(".")[2])
                summary = lines[0] if lines else ""
            items.append((display, sig, summary, real_name))
        return items


class LayerData(SphinxDirective):
    """``py:data`` entries for the data names of a module's ``__all__``."""

    required_arguments = 1
    has_content = False

    def run(self) -> list[nodes.Node]:
        module_name = self.arguments[0]
        try:
            module, names = _public_names(module_name)
        except ValueError as err:
            raise self.error(f"layer-data: {err}") from None
        rst: list[str] = []
        for name in names:
            if not _is_data(getattr(module, name)):
                continue
            lines, annotation = _data_doc(module, name)
            rst += [f".. py:data:: {name}", f"   :module: {module_name}"]
            if annotation:
                rst.append(f"   :type: {annotation}")
            rst.append("")
            rst += [f"   {line}" for line in lines] or ["   (no description)"]
            rst.append("")
        container = nodes.container()
        self.state.nested_parse(
            StringList(rst, source=self.get_source_info()[0]),
            self.content_offset,
            container,
        )
        return container.children


def _resolve_across_layers(app: Sphinx, env: Any, node: Any, contnode: Any) -> Any:
    """``missing-reference``: link a short or submodule-qualified ``py`` name to the single
    documented ``kvcache`` object it names; leave it alone when none or several match."""
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"].lstrip("~.")
    objects = env.get_domain("py").objects
    if target.startswith("kvcache."):
        # kvcache.managers.eviction.X (where it is defined) -> kvcache.managers.X (documented)
        target = target.rpartition(".")[2]
    if "." in target:  # Class.method
        found = [name for name in objects if name.endswith("." + target)]
    else:  # a module-level name only: kvcache.<layer>.<Name>
        found = [
            name
            for name in objects
            if name.endswith("." + target) and name.count(".") == 2
        ]
    found = [name for name in found if name.startswith("kvcache.")]
    if len(found) != 1:
        return None
    entry = objects[found[0]]
    return make_refnode(
        app.builder, node["refdoc"], entry.docname, entry.node_id, contnode, found[0]
    )


def setup(app: Sphinx) -> dict[str, Any]:
    app.setup_extension("sphinx.ext.autosummary")
    app.add_directive("layer-summary", LayerSummary)
    app.add_directive("layer-data", LayerData)
    app.connect("missing-reference", _resolve_across_layers)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
