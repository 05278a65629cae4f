"""The package's layers, written down once as data, and checked on its real import graph.

Every import in ``kvcache/`` (module level, inside functions and under ``TYPE_CHECKING`` alike)
is read from the source with `ast`, so a layer rule cannot be broken by an import hidden in a
function, and a cycle through type-only imports counts as a cycle.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "kvcache"

#: What each layer may import of the package (itself included). ``kvcache`` (the package's
#: ``__init__``) re-exports everything and may import any layer.
ALLOWED = {
    "kvcache._validate": set(),
    "kvcache.kernels": {"kvcache._validate"},
    "kvcache.storage": {"kvcache._validate", "kvcache.kernels"},
    "kvcache.managers": {"kvcache._validate"},
    "kvcache.serving": {
        "kvcache._validate",
        "kvcache.kernels",
        "kvcache.storage",
        "kvcache.managers",
    },
    # The serving system around one cache (host tier, router, tenancy): built on serving, and
    # nothing below it may need it.
    "kvcache.system": {
        "kvcache._validate",
        "kvcache.kernels",
        "kvcache.storage",
        "kvcache.managers",
        "kvcache.serving",
    },
    "kvcache.viz": {
        "kvcache._validate",
        "kvcache.kernels",
        "kvcache.storage",
        "kvcache.managers",
        "kvcache.serving",
        "kvcache.system",
    },
    "kvcache.examples": {
        "kvcache._validate",
        "kvcache.kernels",
        "kvcache.storage",
        "kvcache.managers",
        "kvcache.serving",
        "kvcache.system",
    },
}

#: Outside packages a layer must never import (prefix match on the dotted name): the layers
#: below serving draw nothing, plot nothing and spawn nothing.
_PLAIN = (
    "graphviz",
    "ipywidgets",
    "matplotlib",
    "IPython",
    "torch.distributed",
    "torch.multiprocessing",
    "book",
)
FORBIDDEN_OUTSIDE = {
    "kvcache._validate": _PLAIN,
    "kvcache.kernels": _PLAIN,
    "kvcache.storage": _PLAIN,
    "kvcache.managers": _PLAIN,
    "kvcache.serving": ("graphviz", "ipywidgets", "IPython", "torch.multiprocessing", "book"),
    "kvcache.system": ("graphviz", "ipywidgets", "IPython", "torch.multiprocessing", "book"),
    "kvcache.viz": ("book",),
    "kvcache.examples": ("graphviz", "ipywidgets", "IPython", "book"),
}

#: Heavy packages that ``import kvcache`` must not load.
HEAVY = ("graphviz", "ipywidgets", "matplotlib", "IPython", "kvcache.examples")

#: A module longer than this must say in its docstring why it is one module ("long because").
LONG_MODULE = 900


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, absolute and dotted (``from . import x`` resolved)."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            # ``from .sub import name`` may import the submodule ``sub.name``.
            for alias in node.names:
                candidate = f"{target}.{alias.name}"
                if _path_of(candidate) is not None:
                    found.add(candidate)
    return found


def _path_of(module: str) -> Path | None:
    if not module.startswith("kvcache"):
        return None
    rel = Path(*module.split("."))
    for p in (PACKAGE.parent / rel.with_suffix(".py"), PACKAGE.parent / rel / "__init__.py"):
        if p.exists():
            return p
    return None


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        graph[_module_name(path)] = _imports(path)
    return graph


def test_layers_import_only_what_is_below_them():
    broken = []
    for module, imports in _graph().items():
        layer = _layer(module)
        if module == "kvcache":
            continue
        allowed = ALLOWED[layer] | {layer}
        for target in imports:
            if target.startswith("kvcache"):
                if target == "kvcache" or _layer(target) not in allowed:
                    broken.append(f"{module} imports {target}")
            elif target.startswith(FORBIDDEN_OUTSIDE[layer]):
                broken.append(f"{module} imports {target}")
    assert not broken, "layer rules broken:\n" + "\n".join(sorted(broken))


def test_no_import_cycle():
    graph = {m: {t for t in ts if t in _graph_modules()} for m, ts in _graph().items()}
    # A package's __init__ importing its own submodules is how packages work, not a cycle.
    for m in graph:
        graph[m] = {t for t in graph[m] if not (m and t.startswith(m + "."))}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycle = [*stack[stack.index(t) :], t]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def _graph_modules() -> set[str]:
    return {_module_name(p) for p in PACKAGE.rglob("*.py")}


def _trees() -> dict[str, ast.Module]:
    return {
        str(p.relative_to(PACKAGE.parent)): ast.parse(p.read_text(), str(p))
        for p in sorted(PACKAGE.rglob("*.py"))
    }


#: Modules that break a rule of the house below and are still to be moved (issue 26). An entry
#: must be removed once its module keeps the rule: the tests fail on a stale entry too.
STILL_TO_MOVE: dict[str, set[str]] = {
    "borrowed_methods": set(),
    "private_bases": set(),
    "private_imports": set(),
    "private_attributes": set(),
}


def _check_rule(rule: str, found: dict[str, list[str]]) -> None:
    waived = STILL_TO_MOVE[rule]
    broken = {m: f for m, f in found.items() if m not in waived}
    stale = sorted(waived - set(found))
    assert not broken, f"{rule}:\n" + "\n".join(x for f in broken.values() for x in f)
    assert not stale, (
        f"{rule}: these modules keep the rule now; take them off STILL_TO_MOVE: {stale}"
    )


def test_no_module_is_long_without_a_reason():
    """A learner reads a module top to bottom: past LONG_MODULE lines it says why it is one."""
    long = {
        str(p.relative_to(PACKAGE.parent)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > LONG_MODULE
        and "long because" not in (ast.get_docstring(ast.parse(p.read_text())) or "")
    }
    assert not long, f"modules over {LONG_MODULE} lines whose docstring does not say why: {long}"


def _package_imports(tree: ast.Module) -> dict[str, str]:
    """Names a module imports from other modules of the package, and where from."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (
            node.level or (node.module or "").startswith("kvcache")
        ):
            for alias in node.names:
                names[alias.asname or alias.name] = "." * node.level + (node.module or "")
    return names


def test_one_class_lives_in_one_file():
    """No class takes a method (or any attribute) from a function or class of another module:
    its body is all there, where a learner opens it."""
    found: dict[str, list[str]] = {}
    for mod, tree in _trees().items():
        imported = _package_imports(tree)
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for stmt in cls.body:
                value = stmt.value if isinstance(stmt, (ast.Assign, ast.AnnAssign)) else None
                root = value
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(root, ast.Name) and root.id in imported:
                    found.setdefault(mod, []).append(
                        f"{mod}:{stmt.lineno} {cls.name} takes {ast.unparse(value)} "
                        f"from {imported[root.id]}"
                    )
    _check_rule("borrowed_methods", found)


def _public_names() -> set[str]:
    import kvcache

    names = set(kvcache.__all__)
    for layer in ("managers", "serving", "system", "storage", "kernels", "viz"):
        names |= set(getattr(importlib.import_module(f"kvcache.{layer}"), "__all__", ()))
    return names


def test_no_mixins():
    """A class extends a class of another module only if that class is public (a contract such
    as `BaseCacheManager`), never a private piece of itself kept elsewhere."""
    public = _public_names()
    found: dict[str, list[str]] = {}
    for mod, tree in _trees().items():
        imported = _package_imports(tree)
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for base in cls.bases:
                name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)
                if name in imported and name not in public:
                    found.setdefault(mod, []).append(
                        f"{mod}:{cls.lineno} {cls.name} extends {name} from {imported[name]}"
                    )
    _check_rule("private_bases", found)


def test_no_private_name_is_imported():
    """``from .x import _y`` reads another module's private name: never."""
    found: dict[str, list[str]] = {}
    for mod, tree in _trees().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (
                node.level or (node.module or "").startswith("kvcache")
            ):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.setdefault(mod, []).append(
                            f"{mod}:{node.lineno} imports {alias.name}"
                        )
    _check_rule("private_imports", found)


def _is_record_class(cls: ast.ClassDef) -> bool:
    """A dataclass or NamedTuple: its annotated names are fields it owns."""
    decorators = {ast.unparse(d).split("(")[0].rsplit(".", 1)[-1] for d in cls.decorator_list}
    bases = {ast.unparse(b).rsplit(".", 1)[-1] for b in cls.bases}
    return "dataclass" in decorators or "NamedTuple" in bases


def _owned_private_names(tree: ast.AST) -> set[str]:
    """Private attributes a module defines itself: ``self._x = ...``, ``def _x``, slots, fields.

    A bare annotation in a class body (``_x: int``, no value) owns nothing unless the class is a
    dataclass or NamedTuple: annotating another class's private state to call into it is the
    loophole this closes."""
    owned: set[str] = set()
    records = {
        id(stmt)
        for cls in ast.walk(tree)
        if isinstance(cls, ast.ClassDef) and _is_record_class(cls)
        for stmt in cls.body
    }
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and node.attr.startswith("_")
        ):
            owned.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith(
            "_"
        ):
            owned.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if node.value is not None or id(node) in records:
                owned.add(node.target.id)
        elif isinstance(node, ast.Assign):
            owned.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value.startswith("_")
        ):
            owned.add(node.value)  # __slots__ entries
    return owned


def test_no_reach_into_private_attributes_of_other_modules():
    """``obj._x`` only for a ``_x`` the same module defines; ``getattr(obj, "_x")`` never."""
    found: dict[str, list[str]] = {}
    for mod, tree in _trees().items():
        owned = _owned_private_names(tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and node.attr not in owned
            ):
                found.setdefault(mod, []).append(f"{mod}:{node.lineno} .{node.attr}")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and str(node.args[1].value).startswith("_")
            ):
                found.setdefault(mod, []).append(
                    f"{mod}:{node.lineno} getattr {node.args[1].value}"
                )
    _check_rule("private_attributes", found)


def test_no_check_vanishes_under_python_O():
    """``python -O`` strips ``assert`` statements and makes ``__debug__`` false: the package
    has neither, so every check a caller can trigger runs the same with and without ``-O``
    (which `make test` also shows by running the misuse tests under ``-O``)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Assert) or (
                isinstance(node, ast.Name) and node.id == "__debug__"
            ):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not found, f"assert or __debug__ in the package (raise an error instead): {found}"


def test_import_kvcache_loads_nothing_heavy():
    code = (
        "import sys, kvcache\n"
        f"heavy = [m for m in sys.modules if m.startswith({HEAVY!r})]\n"
        "print(','.join(sorted(heavy)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PACKAGE.parent
    )
    assert out.stdout.strip() == "", f"import kvcache loaded: {out.stdout.strip()}"


def test_lazy_names_resolve():
    code = "import kvcache\nfor name in kvcache.__all__:\n    getattr(kvcache, name)\nprint('ok')\n"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent
    )
    assert out.stdout.strip() == "ok", out.stderr
