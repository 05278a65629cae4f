#!/usr/bin/env python3
"""Wrap chapter code cells to 88 columns without changing what they do.

The website shows about 88 columns of code at a laptop's width (tests/book/test_site.py fails on
code that scrolls sideways). For every code cell with a longer line this script

  1. moves a trailing comment of a too-long line onto its own line above,
  2. formats the cell with ``ruff format --line-length 88``,
  3. splits a too-long string literal inside brackets into adjacent literals ("a " "b"),
  4. wraps a too-long comment line,

and keeps the result only if the cell's syntax tree (``ast.dump``) is unchanged: the same
program, so re-executing gives the same outputs. Only ``source`` changes; outputs, counts and
metadata stay. Lines it cannot shorten (a long docstring) are listed; fix those by hand.

Usage: scripts/wrap_code_cells.py [NOTEBOOK ...]   (default: book/*.ipynb)
"""

from __future__ import annotations

import ast
import io
import json
import re
import shutil
import subprocess
import sys
import textwrap
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WIDTH = 88


def ruff() -> str:
    exe = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if exe is None:
        raise SystemExit("ruff not found (it is in the project's test extra)")
    return exe


def fmt(code: str) -> str | None:
    r = subprocess.run(
        [ruff(), "format", "--config", f"line-length={WIDTH}", "--stdin-filename", "cell.py", "-"],
        input=code,
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    return None if r.returncode else r.stdout.rstrip("\n")


def too_long(code: str) -> list[str]:
    return [line for line in code.split("\n") if len(line) > WIDTH]


def move_trailing_comments(code: str) -> str:
    lines = code.split("\n")
    try:
        toks = list(tokenize.generate_tokens(io.StringIO(code).readline))
    except (tokenize.TokenError, SyntaxError):
        return code
    moves = {}
    for t in toks:
        row, col = t.start
        if (
            t.type == tokenize.COMMENT
            and lines[row - 1][:col].strip()
            and len(lines[row - 1]) > WIDTH
        ):
            moves[row] = (col, t.string)
    for row in sorted(moves, reverse=True):
        col, text = moves[row]
        line = lines[row - 1]
        indent = line[: len(line) - len(line.lstrip())]
        lines[row - 1] = line[:col].rstrip()
        lines.insert(row - 1, indent + text)
    return "\n".join(lines)


def wrap_comments(code: str) -> str:
    out = []
    for line in code.split("\n"):
        body = line.lstrip()
        if len(line) > WIDTH and body.startswith("#"):
            indent = line[: len(line) - len(body)]
            out += textwrap.wrap(
                body[1:].strip(),
                WIDTH - len(indent) - 2,
                initial_indent=indent + "# ",
                subsequent_indent=indent + "# ",
                break_long_words=False,
                break_on_hyphens=False,
            )
        else:
            out.append(line)
    return "\n".join(out)


def _split_points(body: str, is_f: bool) -> list[int]:
    """Offsets just after a space of ``body`` where a split keeps f-string fields whole."""
    depth, i, points = 0, 0, []
    while i < len(body):
        ch = body[i]
        if ch == "\\":
            i += 2
            continue
        if is_f and depth == 0 and body.startswith(("{{", "}}"), i):
            i += 2
            continue
        if is_f and ch == "{":
            depth += 1
        elif is_f and ch == "}":
            depth -= 1
        elif ch == " " and depth == 0 and i + 1 < len(body) and body[i + 1] != " ":
            points.append(i + 1)
        i += 1
    return points


def split_one_string(code: str) -> str | None:
    lines = code.split("\n")
    depth = 0
    for t in tokenize.generate_tokens(io.StringIO(code).readline):
        if t.type == tokenize.OP and t.string in "([{":
            depth += 1
        elif t.type == tokenize.OP and t.string in ")]}":
            depth -= 1
        if t.type != tokenize.STRING or t.start[0] != t.end[0] or depth == 0:
            continue
        row, col = t.start
        if len(lines[row - 1]) <= WIDTH or t.string.startswith(('"""', "'''")):
            continue
        m = re.fullmatch(r"([rRbBfF]*)([\"'])(.*)\2", t.string, re.S)
        if not m:
            continue
        prefix, quote, body = m.groups()
        room = WIDTH - col - len(prefix) - 2
        points = [p for p in _split_points(body, "f" in prefix.lower()) if 8 <= p <= room]
        if not points:
            continue
        p = points[-1]
        new = f"{prefix}{quote}{body[:p]}{quote}\n{' ' * col}{prefix}{quote}{body[p:]}{quote}"
        lines[row - 1] = lines[row - 1][:col] + new + lines[row - 1][t.end[1] :]
        return "\n".join(lines)
    return None


def wrap_cell(source: str) -> str:
    """The cell's code within WIDTH columns where possible; the same syntax tree, or unchanged."""
    if not too_long(source):
        return source
    try:
        tree = ast.dump(ast.parse(source))
    except SyntaxError:  # IPython magics: leave the cell alone
        return source
    new = fmt(move_trailing_comments(source))
    if new is None:
        return source
    new = wrap_comments(move_trailing_comments(new))
    for _ in range(20):
        if not too_long(new):
            break
        split = split_one_string(new)
        formatted = fmt(split) if split is not None else None
        if formatted is None:
            break
        new = formatted
    return new if ast.dump(ast.parse(new)) == tree else source


def main(argv: list[str]) -> int:
    paths = [Path(a) for a in argv] or sorted((REPO / "book").glob("*.ipynb"))
    left = 0
    for path in paths:
        nb = json.loads(path.read_text())
        changed = 0
        for i, cell in enumerate(nb["cells"]):
            if cell.get("cell_type") != "code":
                continue
            source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            new = wrap_cell(source)
            if new != source:
                cell["source"] = new.splitlines(keepends=True)
                changed += 1
            for line in too_long(new):
                left += 1
                print(
                    f"{path}: cell {i}: still {len(line)} columns: {line.strip()[:70]}",
                    file=sys.stderr,
                )
        if changed:
            path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
        print(f"{path}: {changed} cell(s) wrapped")
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
