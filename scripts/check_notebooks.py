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
    assert the bound,
  - quotes in its prose a number that no cell computed: a decimal, a number with a unit
    (``29.4 µs``, ``3.2x``, ``56%``, ``4,096 tokens``) or an integer from 1,000 up must be glued
    from the cell that computed it (myst-nb's ``{glue:text}`` role), or equal (at the precision
    the prose gives) a number printed by a compared output of the chapter or written in its
    code, or be listed under the notebook's ``kvcache.prose_constants`` metadata with the
    reason it is a constant of the text (a number quoted from a paper or a real server's
    code). A number printed only by a cell whose output nbval ignores varies between runs: it
    must be glued. Numbers in code spans, math, roles, links, headings and section references
    (``§13.4``) are not prose numbers. Chapters listed in ``PROSE_NUMBERS_UNCHECKED`` are not
    checked yet (issue 28 glues them one by one; an entry that passes fails as stale).
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
# A prose number: digits (with thousands commas or a decimal point), an optional unit.
_UNIT = (
    r"(?:\s?(?:µs|us|ns|ms|s|%|x|×|[KMGT]i?B(?:/s)?|req/s|tokens/s|tok/s|tokens|pages|slots|steps))"
)
PROSE_NUMBER = re.compile(
    r"(?<![\w./#§])(\d{1,3}(?:,\d{3})+|\d+(?:\.\d+)?)(" + _UNIT + r"(?![\w/]))?(?![\w.,]*\d)"
)
OUTPUT_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:e[-+]?\d+)?")
# A ratio in words ("about two times", "three-fold"): measured, so it must be backed too.
_WORDS = [
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
]
WORD_RATIO = re.compile(r"\b(" + "|".join(_WORDS) + r")(?:\s+times\b|-fold\b)", re.I)
NOT_PROSE = [  # what is removed from markdown before its numbers are read
    re.compile(r"```.*?```|~~~.*?~~~", re.S),  # fenced blocks and directives
    re.compile(r"\{[\w:-]+\}`[^`]*`"),  # roles: {glue:text}`x`, {ref}`y`
    re.compile(r"`[^`]*`"),  # code spans
    re.compile(r"\]\([^)]*\)|<[^>]+>"),  # link targets, HTML tags
    re.compile(r"\$\$.*?\$\$|\$[^$\n]*\$", re.S),  # math
    re.compile(r"^#+ .*$|^\s*(?:\d+\.|[-*+])\s", re.M),  # headings, list markers
    re.compile(r"§\s?[\d.]+|\b\d+(?:\.\d+){2,}\b|\b\d{4}-\d{2}(?:-\d{2})?\b"),  # §, versions, dates
]
#: Chapters whose prose numbers are not glued yet (issue 28); a passing entry is stale.
PROSE_NUMBERS_UNCHECKED: set[str] = set()
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


def _numbers(text: str) -> set[float]:
    return {float(m.group(0).replace(",", "")) for m in OUTPUT_NUMBER.finditer(text)}


def _output_text(out: dict) -> str:
    data = out.get("data", {})
    text = out.get("text") or data.get("text/plain") or data.get("text/html") or ""
    return "".join(text) if isinstance(text, list) else text


def unbacked_prose_numbers(nb: dict) -> list[str]:
    """The numbers the chapter's prose quotes that no compared output, code cell or declared
    constant backs (see the module docstring)."""
    backed: set[float] = set()
    for cell in nb.get("cells", []):
        if cell.get("cell_type") != "code":
            continue
        backed |= _numbers("".join(cell.get("source", "")))
        if not set(cell.get("metadata", {}).get("tags", [])) & UNCOMPARED:
            for out in cell.get("outputs", []):
                backed |= _numbers(_output_text(out))
    constants = nb.get("metadata", {}).get("kvcache", {}).get("prose_constants", {})
    found = []
    for i, cell in enumerate(nb.get("cells", [])):
        if cell.get("cell_type") != "markdown":
            continue
        text = "".join(cell.get("source", ""))
        for pattern in NOT_PROSE:
            text = pattern.sub(" ", text)
        for m in WORD_RATIO.finditer(text):
            value = float(_WORDS.index(m.group(1).lower()) + 2)
            if m.group(0) not in constants and not any(round(b) == value for b in backed):
                found.append(f"markdown cell {i}: {m.group(0)!r}")
        for m in PROSE_NUMBER.finditer(text):
            raw, unit = m.group(1), m.group(2)
            value = float(raw.replace(",", ""))
            if not ("." in raw or unit or value >= 1000) or m.group(0).strip() in constants:
                continue
            places = len(raw.partition(".")[2])
            scales = (1, 0.01) if unit and unit.strip() == "%" else (1,)
            if not any(round(b / s, places) == value for b in backed for s in scales):
                found.append(f"markdown cell {i}: {m.group(0).strip()!r}")
    return found


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
    unbacked = unbacked_prose_numbers(nb)
    if path.stem in PROSE_NUMBERS_UNCHECKED and path.parent.resolve() == REPO / "book":
        if not unbacked:
            problems.append("every prose number is backed now: take it off PROSE_NUMBERS_UNCHECKED")
    else:
        problems += [
            f"{u} is quoted in prose but no compared output, code cell or declared constant "
            "gives it: glue it from the cell that computes it ({glue:text})"
            for u in unbacked
        ]
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
