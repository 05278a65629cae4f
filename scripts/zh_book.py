"""The Chinese edition: extract the English into gettext catalogs, update them, build the zh site.

    python scripts/zh_book.py html      # the Chinese site into _build/html/zh (warnings are errors)
    python scripts/zh_book.py catalogs  # extract (gettext builder) + sphinx-intl update locale/
    python scripts/zh_book.py check     # the same into a copy: exit 1 if locale/ would change

The book is Jupyter Book 1, whose command line passes no Sphinx overrides; this script calls
Jupyter Book's own ``build_sphinx`` (what ``jupyter-book build`` calls) with the overrides the
Chinese edition needs: ``language``, and, for extraction, the ``gettext`` builder with its own
doctree folder (the gettext builder keeps a different environment than the html one, and the
English site's doctrees are wiped by every ``make book``). Everything else, the i18n settings
included, lives in _config.yml and book/_ext/zh_edition.py, so the three commands and
``make book`` see one configuration.

Catalogs: ``locale/zh_CN/LC_MESSAGES/<docname>.po``, one per page (``gettext_compact: false``),
without source locations or uuids, so inserting a code cell rewrites nothing. ``catalogs``
runs ``sphinx-intl update``: a changed English paragraph becomes a fuzzy entry (its old
translation kept as a starting point), a new one an empty entry, a removed one disappears;
tests/book/test_zh_edition.py fails on both until the translation is done.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUILD = REPO / "_build"
LOCALE = REPO / "locale"
LANGUAGE = "zh_CN"
POT_DIR = BUILD / "gettext"


def _sphinx(builder: str, outdir: Path, doctreedir: Path, overrides: dict) -> int:
    from jupyter_book.sphinx import build_sphinx

    result = build_sphinx(
        REPO,
        outdir,
        noconfig=True,
        path_config=REPO / "_config.yml",
        confoverrides={
            "external_toc_path": (REPO / "_toc.yml").as_posix(),
            "latex_individualpages": False,
            **overrides,
        },
        doctreedir=doctreedir,
        builder=builder,
        warningiserror=True,
        keep_going=True,
        quiet=True,
    )
    if isinstance(result, BaseException):
        raise result
    return int(result)


def build_html(outdir: Path = BUILD / "html" / "zh") -> int:
    """The Chinese site, from the English sources and locale/'s catalogs."""
    shutil.rmtree(outdir, ignore_errors=True)
    doctrees = BUILD / ".doctrees-zh"
    shutil.rmtree(doctrees, ignore_errors=True)
    return _sphinx("html", outdir, doctrees, {"language": LANGUAGE})


def extract(pot_dir: Path = POT_DIR) -> int:
    """The message templates (.pot), one per page, from the English sources (the captions of
    the figures the chapters' cells draw included: book/_ext/kv_figures.py makes them text)."""
    shutil.rmtree(pot_dir, ignore_errors=True)
    # Its own doctrees (the gettext builder's environment differs from the html one's), read
    # afresh: what is extracted also depends on book/_ext, which Sphinx does not track.
    doctrees = BUILD / ".doctrees-gettext"
    shutil.rmtree(doctrees, ignore_errors=True)
    return _sphinx("gettext", pot_dir, doctrees, {})


def update(locale_dir: Path, pot_dir: Path = POT_DIR) -> None:
    """sphinx-intl update: merge the templates into the catalogs (new, fuzzy, obsolete dropped)."""
    subprocess.run(
        [
            str(Path(sys.executable).parent / "sphinx-intl"),
            "update",
            "--pot-dir",
            str(pot_dir),
            "--locale-dir",
            str(locale_dir),
            "--language",
            LANGUAGE,
            "--line-width",
            "-1",
            "--no-obsolete",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    # sphinx-intl never deletes the catalog of a page that left the toc: do it here.
    pots = {p.relative_to(pot_dir).with_suffix(".po") for p in pot_dir.rglob("*.pot")}
    messages = locale_dir / LANGUAGE / "LC_MESSAGES"
    for po in messages.rglob("*.po"):
        if po.relative_to(messages) not in pots:
            po.unlink()
    for mo in messages.rglob("*.mo"):
        mo.unlink()


def _differences(a: Path, b: Path) -> list[str]:
    files_a = {p.relative_to(a) for p in a.rglob("*.po")}
    files_b = {p.relative_to(b) for p in b.rglob("*.po")}
    out = [f"only in the regenerated catalogs: {p}" for p in sorted(files_b - files_a)]
    out += [f"no longer extracted: {p}" for p in sorted(files_a - files_b)]
    out += [
        f"changed by the update: {p}"
        for p in sorted(files_a & files_b)
        if not filecmp.cmp(a / p, b / p, shallow=False)
    ]
    return out


def check() -> list[str]:
    """What `catalogs` would change in locale/ (empty: the catalogs match the English)."""
    with tempfile.TemporaryDirectory(prefix="kvcache-catalogs-") as tmp:
        pot_dir = Path(tmp) / "gettext"
        if extract(pot_dir):
            return ["the gettext build failed (see its warnings above)"]
        copy = Path(tmp) / "locale"
        shutil.copytree(LOCALE, copy, ignore=shutil.ignore_patterns("*.mo"))
        update(copy, pot_dir)
        return _differences(LOCALE, copy)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["html", "catalogs", "check", "extract"])
    args = ap.parse_args(argv)
    os.chdir(REPO)
    if args.command == "html":
        return build_html()
    if args.command == "extract":
        return extract()
    if args.command == "catalogs":
        rc = extract()
        if rc:
            return rc
        update(LOCALE)
        return 0
    diffs = check()
    for line in diffs:
        print(line, file=sys.stderr)
    if diffs:
        print("the catalogs are out of step with the English: run `make catalogs`", file=sys.stderr)
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
