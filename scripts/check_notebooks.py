#!/usr/bin/env python3
"""Check that every chapter was executed top to bottom without an error before it is built.

The website shows the outputs stored in book/*.ipynb (Jupyter Book runs with
execute_notebooks: "off"), so `make book` runs this first and fails when a chapter
  - has a code cell that was never executed (no execution_count),
  - holds an error output (a cell raised: show an expected error with try/except instead),
  - was not executed in one fresh run from the top: execution counts must be 1, 2, 3, ... in
    document order, and each execute_result must carry its cell's count,
  - is not listed in _toc.yml (it would silently be left out of the website),
  - marks a cell for nbval with a comment (`# NBVAL_IGNORE_OUTPUT`, `# NBVAL_SKIP`) instead of
    nbval's cell tags (`nbval-ignore-output`, `nbval-skip`), or silences a linter with
    `# noqa`: the website shows a cell's source, so both would be printed in the chapter,
  - has a reader's answer cell (a `# Your answer` / `# Your prediction` comment) that the
    website would show: it must carry the `hide-input` (or `hide-cell`) tag,
  - prints a rounding-level number (``5.96e-07``, ``0.00e+00``: how far two float computations
    differ) in an output nbval compares: its size depends on the CPU's vector instructions, so
    the test fails on another machine. Print it in a cell tagged `nbval-ignore-output` and
    assert the bound.
Empty code cells are skipped (Jupyter does not execute them). Fix a failure with
`make refresh`, which re-executes every chapter in place.

Usage: scripts/check_notebooks.py [NOTEBOOK ...]   (default: book/*.ipynb)
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NBVAL_COMMENT = re.compile(r"^\s*#\s*NBVAL_(\w+)", re.MULTILINE)
NOQA = re.compile(r"#\s*noqa\b", re.IGNORECASE)
ANSWER = re.compile(r"^\s*#\s*Your (answer|prediction)", re.MULTILINE | re.IGNORECASE)
HIDDEN_INPUT = {"hide-input", "hide-cell", "remove-input", "remove-cell"}
UNCOMPARED = {"nbval-ignore-output", "nbval-skip"}
# Scientific notation at 1e-6 and below, or a zero written that way: float rounding, not a result.
# With a decimal point only: a bare ``1e-06`` in the chapters is a printed tolerance, a constant.
ROUNDING = re.compile(r"(?<![\w.])(\d\.\d*e-(0[6-9]|[1-9]\d)|0\.0*e[+-]00)(?![\w.])")


def toc_files() -> set[str]:
    import yaml

    toc = yaml.safe_load((REPO / "_toc.yml").read_text())
    files = {toc["root"]}

    def walk(node):
        if isinstance(node, dict):
            if "file" in node:
                files.add(node["file"])
            for k in ("parts", "chapters", "sections"):
                for child in node.get(k) or []:
                    walk(child)

    walk({k: v for k, v in toc.items() if k != "root"})
    return {str(Path(f).with_suffix("")) for f in files}


def check(path: Path, listed: set[str] | None) -> list[str]:
    problems = []
    try:
        nb = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return [f"cannot read notebook: {e}"]
    expected = 1
    for i, cell in enumerate(nb.get("cells", [])):
        if cell.get("cell_type") != "code":
            continue
        source = cell.get("source", "")
        source = "".join(source) if isinstance(source, list) else source
        where = (
            f"cell {i} ({source.strip().splitlines()[0][:60]!r})" if source.strip() else f"cell {i}"
        )
        count = cell.get("execution_count")
        if not source.strip():
            continue
        tags = set(cell.get("metadata", {}).get("tags", []))
        for m in NBVAL_COMMENT.finditer(source):
            tag = "nbval-" + m.group(1).lower().replace("_", "-")
            problems.append(
                f"{where}: `# NBVAL_{m.group(1)}` comment shows on the page; "
                f"give the cell nbval's tag {tag!r} instead"
            )
        if NOQA.search(source):
            problems.append(f"{where}: `# noqa` shows on the page; write code the linter accepts")
        if ANSWER.search(source) and not tags & HIDDEN_INPUT:
            problems.append(
                f"{where}: a reader's answer cell without the 'hide-input' tag "
                "(the website would show the answer before the reader tries)"
            )
        if count is None:
            problems.append(f"{where}: never executed (no execution_count)")
            continue
        if count != expected:
            problems.append(
                f"{where}: execution_count {count}, expected {expected} (not one top-to-bottom run)"
            )
        expected = count + 1
        for out in cell.get("outputs", []):
            kind = out.get("output_type")
            text = out.get("text") or out.get("data", {}).get("text/plain") or ""
            text = "".join(text) if isinstance(text, list) else text
            m = ROUNDING.search(text) if not tags & UNCOMPARED else None
            if m:
                problems.append(
                    f"{where}: prints the rounding-level number {m.group(1)} where nbval compares "
                    "it (it differs between CPUs); print it in a cell tagged "
                    "'nbval-ignore-output' and assert its bound"
                )
            if kind == "error":
                problems.append(f"{where}: raised {out.get('ename')}: {out.get('evalue')}")
            elif kind == "execute_result" and out.get("execution_count") not in (None, count):
                problems.append(
                    f"{where}: output from execution {out.get('execution_count')}, "
                    f"cell says {count}"
                )
    if listed is not None and path.resolve().is_relative_to(REPO):
        rel = str(path.resolve().relative_to(REPO).with_suffix(""))
        if rel not in listed:
            problems.append("not listed in _toc.yml (add it to its part; see README.md)")
    return problems


def main(argv: list[str]) -> int:
    paths = [Path(a) for a in argv] or sorted((REPO / "book").glob("*.ipynb"))
    try:
        listed = toc_files()
    except FileNotFoundError:
        listed = None
    failed = 0
    for path in paths:
        problems = check(path, listed)
        for p in problems:
            print(f"{path}: {p}", file=sys.stderr)
        failed += bool(problems)
    print(
        f"check_notebooks: {len(paths)} notebook(s), {failed} with problems",
        file=sys.stderr if failed else sys.stdout,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
