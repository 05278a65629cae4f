"""Every ``tests/...`` path the chapters, the README and the Makefile cite exists.

The tests sit in folders by layer (``tests/managers/test_radix_manager.py``); a chapter that
sends its reader to a test file, or a Makefile target that runs one, must name the file that is
there. The texts read: every cell of ``book/*.ipynb`` (markdown and code, not outputs),
``book/*.md``, ``README.md`` and ``Makefile``. A path counts when ``tests/`` starts it (not
``minisgl/tests/...``), and it may name a file or a folder.

A chapter may also cite another project's test file by its path in that project; such a path is
listed in `EXTERNAL` with the project, and every citation of it must name the project just
before it (and the path must not exist here, or it would be ambiguous).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

#: Paths of other projects' files that a chapter cites, with the project it names beside them.
EXTERNAL: dict[str, str] = {
    # mini-sglang's store-kernel test (book/08_mha_pool.ipynb quotes its lines 15-24 and 20).
    "tests/kernel/test_store.py": "mini-sglang",
}

#: How far before a citation of an `EXTERNAL` path the project's name must appear.
CONTEXT = 400

PATH = re.compile(r"(?<![\w/.-])tests/[\w./*-]*")


def texts() -> dict[str, str]:
    """Each cited-from text by its name (a chapter's cells by their index)."""
    out: dict[str, str] = {}
    for nb in sorted((REPO / "book").glob("*.ipynb")):
        cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
        for i, cell in enumerate(cells):
            src = cell["source"]
            out[f"{nb.relative_to(REPO)} cell {i}"] = src if isinstance(src, str) else "".join(src)
    for md in sorted((REPO / "book").glob("*.md")):
        out[str(md.relative_to(REPO))] = md.read_text(encoding="utf-8")
    for name in ("README.md", "Makefile"):
        out[name] = (REPO / name).read_text(encoding="utf-8")
    return out


def cited(text: str) -> list[tuple[str, int]]:
    """The ``tests/...`` paths in ``text`` with where each starts (sentence dots dropped)."""
    return [(m.group().rstrip("."), m.start()) for m in PATH.finditer(text)]


def problems(name: str, text: str, repo: Path = REPO) -> list[str]:
    """What is wrong with the paths ``text`` cites: a path that is not in ``repo``, or an
    `EXTERNAL` one cited without its project's name just before it."""
    out = []
    for path, at in cited(text):
        if path in EXTERNAL:
            project = EXTERNAL[path]
            if project not in text[max(0, at - CONTEXT) : at]:
                out.append(f"{name}: {path} is {project}'s; say so before citing it")
        elif not (any(repo.glob(path)) if "*" in path else (repo / path).exists()):
            out.append(f"{name}: {path} does not exist")
    return out


def test_every_cited_test_path_exists() -> None:
    found = [p for text in texts().values() for p, _ in cited(text)]
    assert len(found) >= 20, found  # the chapters and the README cite many test files
    assert "tests/nbval_sanitize.cfg" in found  # the Makefile's nbval flags: read too
    wrong = [msg for name, text in texts().items() for msg in problems(name, text)]
    assert not wrong, "\n".join(wrong)


def test_external_paths_are_cited_and_not_ours() -> None:
    """A stale `EXTERNAL` entry fails, and so does one that names a path of this repository."""
    every = "\n".join(texts().values())
    for path in EXTERNAL:
        assert not (REPO / path).exists(), f"{path} exists here: not another project's"
        assert path in {p for p, _ in cited(every)}, f"{path} is cited nowhere: remove it"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # a moved file under its old path: the mistake this test is for
        ("the stateful tests (`tests/test_radix_stateful.py`) drive", ["test_radix_stateful"]),
        ("run tests/managers/test_no_such_file.py.", ["test_no_such_file.py does"]),
        ("OPT_TESTS := tests/managers/test_misuse.py tests/nope/", ["tests/nope/ does"]),
        ("the store test (`tests/kernel/test_store.py`, line 20)", ["mini-sglang's; say so"]),
    ],
)
def test_a_planted_wrong_path_is_found(text: str, expected: list[str]) -> None:
    found = problems("planted", text)
    assert len(found) == len(expected), found
    for msg, part in zip(found, expected, strict=True):
        assert part in msg, msg


def test_right_paths_and_other_projects_paths_pass() -> None:
    text = (
        "`tests/managers/test_radix_stateful.py`, tests/book/, tests/nbval_sanitize.cfg, "
        "mini-sglang's own store test (`tests/kernel/test_store.py`), SGLang's "
        "`python/sglang/test/tests/test_x.py` and `minisgl/tests/foo.py`."
    )
    assert [p for p, _ in cited(text)] == [
        "tests/managers/test_radix_stateful.py",
        "tests/book/",
        "tests/nbval_sanitize.cfg",
        "tests/kernel/test_store.py",
    ]
    assert problems("planted", text) == []
