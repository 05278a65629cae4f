"""Translate a page's catalog entries through a plain text file (for translators).

    python scripts/zh_translate.py todo                  # pages with entries left, and counts
    python scripts/zh_translate.py dump book/01_why      # the page's entries needing work
    python scripts/zh_translate.py dump book/01_why --all
    python scripts/zh_translate.py fill book/01_why FILE # write FILE's translations

``dump`` prints each entry as ``@@ N`` (its position in the catalog) followed by the English
(and, for a fuzzy entry, ``@@ old:`` with the previous translation). ``fill`` reads the same
shape with the translation under each ``@@ N``; ``=`` means "the same as the English" (a name,
a formula). It refuses a file whose numbers do not match the catalog's entries, clears the
fuzzy flag of what it fills, and escapes a translation that would start a list (``1. ``,
``- ``): Sphinx would parse such a msgstr as a list and silently keep the English. It also
spaces ``**`` where a CJK character meets a role or code span, which CommonMark would not
read as bold.
tests/book/test_zh_edition.py checks the result (code spans, roles, math, terminology).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MESSAGES = REPO / "locale" / "zh_CN" / "LC_MESSAGES"

#: A translation that starts like a list item or a heading is parsed as one by the i18n
#: transform, which then keeps the English: escape the marker.
LIST_START = re.compile(r"^(\d+)([.)])(\s)|^([-+*])(\s)|^(#+)(\s)")


def escape_block_start(text: str) -> str:
    def repl(m: re.Match) -> str:
        if m.group(1):
            return f"{m.group(1)}\\{m.group(2)}{m.group(3)}"
        if m.group(4):
            return f"\\{m.group(4)}{m.group(5)}"
        return f"\\{m.group(6)}{m.group(7)}"

    return LIST_START.sub(repl, text, count=1)


#: `**` next to a CJK character on one side and punctuation (a role's backtick, a brace) on the
#: other is not a delimiter in CommonMark, and renders as two asterisks: a space makes it one.
_OPEN_BOLD = re.compile(r"([\u4e00-\u9fff])(\*\*)(?=[{`])")
_CLOSE_BOLD = re.compile(r"(?<=`)(\*\*)([\u4e00-\u9fff])")


def space_bold(text: str) -> str:
    return _CLOSE_BOLD.sub(r"\1 \2", _OPEN_BOLD.sub(r"\1 \2", text))


def load(page: str):
    from sphinx_intl.catalog import load_po

    return load_po(str(MESSAGES / f"{page}.po"))


def save(page: str, catalog) -> None:
    from sphinx_intl.catalog import dump_po

    dump_po(str(MESSAGES / f"{page}.po"), catalog, width=-1)


def entries(catalog):
    return [m for m in catalog if m.id]


def needs_work(message) -> bool:
    return not message.string or message.fuzzy


def dump(page: str, everything: bool) -> str:
    out = []
    for n, m in enumerate(entries(load(page)), 1):
        if everything or needs_work(m):
            out.append(f"@@ {n}\n{m.id}")
            if m.fuzzy and m.string:
                out.append(f"@@ old:\n{m.string}")
    return "\n".join(out) + "\n"


def parse(text: str) -> dict[int, str]:
    found: dict[int, str] = {}
    number = None
    lines: list[str] = []
    skipping = False

    def flush() -> None:
        if number is not None:
            found[number] = "\n".join(lines).strip("\n")

    for line in text.split("\n"):
        head = re.match(r"^@@ (\d+)\s*$", line)
        if head:
            flush()
            number, lines, skipping = int(head.group(1)), [], False
        elif line.startswith("@@ old:"):
            skipping = True
        elif not skipping:
            lines.append(line)
    flush()
    return found


def fill(page: str, path: Path) -> int:
    catalog = load(page)
    messages = entries(catalog)
    translations = parse(path.read_text(encoding="utf-8"))
    bad = [n for n in translations if not 1 <= n <= len(messages)]
    if bad:
        print(f"{page}: no entries numbered {bad} (it has {len(messages)})", file=sys.stderr)
        return 1
    for n, text in translations.items():
        message = messages[n - 1]
        if not text:
            continue
        if text == "=":
            text = message.id
        elif not message.id.startswith("\n"):  # display math keeps its line breaks
            text = " ".join(text.split("\n")) if "\n" in text else text
            text = space_bold(escape_block_start(text))
        message.string = text
        message.flags.discard("fuzzy")
        message.previous_id = ()
    save(page, catalog)
    left = sum(needs_work(m) for m in messages)
    print(f"{page}: {len(translations)} filled, {left} of {len(messages)} left")
    return 0


def todo() -> None:
    for po in sorted(MESSAGES.rglob("*.po")):
        page = str(po.relative_to(MESSAGES).with_suffix(""))
        messages = entries(load(page))
        left = [m for m in messages if needs_work(m)]
        if left:
            words = sum(len(m.id.split()) for m in left)
            print(f"{page}: {len(left)} of {len(messages)} entries, {words} words")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["todo", "dump", "fill"])
    ap.add_argument("page", nargs="?")
    ap.add_argument("file", nargs="?", type=Path)
    ap.add_argument("--all", action="store_true")
    args = ap.parse_args(argv)
    if args.command == "todo":
        todo()
        return 0
    if args.command == "dump":
        sys.stdout.write(dump(args.page, args.all))
        return 0
    return fill(args.page, args.file)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
