"""The book's frame: the landing page, the glossary and the bibliography.

Checked from the markdown sources (no build needed): every glossary entry names the study guide's
term and links a numbered chapter the toc lists; every bibliography entry has a `ref-` label; the
landing page's colour key names every state the tree figures colour, in the package's own words.
"""

import re
from pathlib import Path

import yaml

from kvcache.viz.style import LEGEND_TEXT, node_style

REPO = Path(__file__).resolve().parents[2]
BOOK = REPO / "book"


def toc_chapters() -> set[str]:
    """Document names (relative to book/) of the chapters in the toc's numbered parts."""
    toc = yaml.safe_load((REPO / "_toc.yml").read_text())
    return {
        Path(ch["file"]).name
        for part in toc["parts"]
        if part.get("numbered")
        for ch in part["chapters"]
    }


def toc_files() -> set[str]:
    toc = yaml.safe_load((REPO / "_toc.yml").read_text())
    return {ch["file"] for part in toc["parts"] for ch in part["chapters"]}


def glossary_entries() -> list[tuple[list[str], str]]:
    """(names, body) of each entry of the glossary directive."""
    text = (BOOK / "glossary.md").read_text()
    block = re.search(r"```\{glossary\}\n(.*?)\n```", text, re.S)
    assert block, "glossary.md has no {glossary} directive"
    entries: list[tuple[list[str], str]] = []
    names: list[str] = []
    body: list[str] = []
    for line in block.group(1).splitlines():
        if line and not line.startswith(" "):
            if body:
                entries.append((names, "\n".join(body)))
                names, body = [], []
            names.append(line.strip())
        elif line.strip():
            body.append(line.strip())
    if names:
        entries.append((names, "\n".join(body)))
    return entries


def test_toc_lists_the_glossary_and_bibliography():
    files = toc_files()
    assert {"book/glossary", "book/bibliography"} <= files


def test_every_glossary_entry_has_the_guide_term_and_a_chapter():
    chapters = toc_chapters()
    entries = glossary_entries()
    assert len(entries) >= 30, f"only {len(entries)} glossary entries"
    for names, body in entries:
        assert re.search(r"\*Guide:\* \S", body), f"{names}: no '*Guide:*' term (or '—')"
        links = re.findall(r"\{chapter\}`([^`<]+?)`", body)
        assert links, f"{names}: no {{chapter}} link to where it is taught"
        for target in links:
            assert target in chapters, f"{names}: links {target!r}, not a numbered chapter"
            assert (BOOK / f"{target}.ipynb").exists(), f"{names}: {target}.ipynb missing"


def test_glossary_names_are_unique():
    seen: dict[str, list[str]] = {}
    for names, _ in glossary_entries():
        for n in names:
            seen.setdefault(n.lower(), []).append(n)
    twice = {k: v for k, v in seen.items() if len(v) > 1}
    assert not twice, f"glossary terms defined twice: {twice}"


def test_bibliography_entries_have_labels_and_links():
    text = (BOOK / "bibliography.md").read_text()
    labels = re.findall(r"^\((ref-[a-z0-9-]+)\)=$", text, re.M)
    wanted = {
        "ref-vllm",
        "ref-sglang",
        "ref-mini-sglang",
        "ref-nano-vllm",
        "ref-triton",
        "ref-flashattention",
    }
    assert wanted <= set(labels), f"missing labels: {wanted - set(labels)}"
    assert len(labels) == len(set(labels)), f"a label used twice: {labels}"
    for chunk in re.split(r"^\(ref-[a-z0-9-]+\)=$", text, flags=re.M)[1:]:
        assert re.search(r"\]\(https://", chunk), f"entry without a stable link: {chunk[:80]!r}"


# The states a key entry stands for (a fill state, then the flag drawn over it), as the figures
# combine them.
KEY_STATES = {
    "protected": ("protected",),
    "evictable": ("evictable",),
    "inserted": ("evictable", "inserted"),
    "split": ("evictable", "split"),
    "evict": ("evictable", "evict"),
    "evicted": ("evicted",),
}


def test_intro_colour_key_matches_the_figures():
    """One row per state of `LEGEND_TEXT`, in its words, with a swatch in the figures' own fill,
    border colour and border style (so a palette change that forgets the page fails here)."""
    text = (BOOK / "intro.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert set(KEY_STATES) == set(LEGEND_TEXT)
    for state, words in LEGEND_TEXT.items():
        row = next((r for r in rows if r.startswith(f"| {words} |")), None)
        assert row, f"the landing page's colour key has no row for {words!r}"
        style = node_style(KEY_STATES[state])
        dash = "dashed" if "dashed" in style["style"] else "solid"
        assert f"background:{style['fillcolor']};" in row, f"{words}: fill is not {style}"
        assert f"{dash} {style['color']}" in row, f"{words}: border is not {style}"


def test_intro_maps_every_chapter():
    text = (BOOK / "intro.md").read_text()
    linked = set(re.findall(r"\{chapter\}`Chapter <([^>]+)>`", text))
    missing = toc_chapters() - linked
    assert not missing, f"chapters missing from the landing page's map: {sorted(missing)}"


def _cells(name: str) -> list[dict]:
    import json

    return json.loads((BOOK / f"{name}.ipynb").read_text())["cells"]


def test_every_chapter_opens_with_objectives_and_closes_with_a_summary():
    """Each numbered chapter: an 'After this chapter you can' admonition of 3-5 points among its
    first markdown cells, and `## Summary` as its last section (only hidden answers after it)."""
    for name in sorted(toc_chapters()):
        md = ["".join(c["source"]) for c in _cells(name) if c["cell_type"] == "markdown"]
        opening = "\n".join(md[:3])
        block = re.search(r"```\{admonition\} After this chapter you can\n(.*?)```", opening, re.S)
        assert block, f"{name}: no 'After this chapter you can' admonition at the start"
        points = re.findall(r"^- ", block.group(1), re.M)
        assert 3 <= len(points) <= 5, f"{name}: {len(points)} objectives (want 3-5)"
        heads = [(i, h) for i, text in enumerate(md) for h in re.findall(r"^## .*", text, re.M)]
        assert heads and heads[-1][1].strip() == "## Summary", (
            f"{name}: last section is not ## Summary"
        )


#: Chapters whose code still reads a private name of the package (issue 26), to be emptied: a
#: learner copies what a cell does, so a cell uses only public names. A stale entry fails too.
PRIVATE_NAMES_STILL_READ: set[str] = set()


def test_chapters_use_only_public_names():
    """No code cell reads or writes ``obj._name`` (dunders such as ``__version__`` aside)."""
    import json

    private = re.compile(r"\.(_[A-Za-z0-9][A-Za-z0-9_]*)\b")
    found: dict[str, list[str]] = {}
    for nb_path in sorted(BOOK.glob("*.ipynb")):
        cells = json.loads(nb_path.read_text())["cells"]
        for i, cell in enumerate(cells):
            if cell["cell_type"] != "code":
                continue
            for name in private.findall("".join(cell["source"])):
                found.setdefault(nb_path.name, []).append(f"{nb_path.name} cell {i}: .{name}")
    broken = {nb: f for nb, f in found.items() if nb not in PRIVATE_NAMES_STILL_READ}
    stale = sorted(PRIVATE_NAMES_STILL_READ - set(found))
    assert not broken, "chapters read private names:\n" + "\n".join(
        x for f in broken.values() for x in f
    )
    assert not stale, f"these chapters use only public names now; drop them from the list: {stale}"


# ------------------------------------------------------------ the apparatus (issue 28)
# Each rule below lists the chapters that do not keep it yet; a chapter leaves its list when it
# does, and an entry that keeps the rule fails as stale, so the lists only shrink.


def _toc_order() -> list[str]:
    """The numbered chapters in the toc's order."""
    toc = yaml.safe_load((REPO / "_toc.yml").read_text())
    return [
        Path(ch["file"]).name
        for part in toc["parts"]
        if part.get("numbered")
        for ch in part["chapters"]
    ]


def _check_rule(rule: str, broken: dict[str, str], waived: set[str]) -> None:
    unexpected = {n: why for n, why in broken.items() if n not in waived}
    stale = sorted(waived - set(broken))
    assert not unexpected, f"{rule}:\n" + "\n".join(f"{n}: {w}" for n, w in unexpected.items())
    assert not stale, f"{rule}: these chapters keep the rule now; take them off its list: {stale}"


#: Chapters without a "Before you start" admonition (prerequisites) among their first cells.
NO_PREREQUISITES_YET: set[str] = set()


def test_every_chapter_says_what_it_needs_first():
    """A "Before you start" admonition among the first four markdown cells names the chapters
    (``{chapter}`` roles) or the background a reader needs, so the path has no hidden step."""
    broken = {}
    for name in _toc_order():
        md = ["".join(c["source"]) for c in _cells(name) if c["cell_type"] == "markdown"][:4]
        block = re.search(r"```\{admonition\} Before you start\n(.*?)```", "\n".join(md), re.S)
        if not block or len(block.group(1).split()) < 4:
            broken[name] = "no 'Before you start' admonition with its prerequisites"
    _check_rule("prerequisites", broken, NO_PREREQUISITES_YET)


#: Chapters without their 2-4 numbered exercises in the book's form yet.
NO_EXERCISES_YET: set[str] = set()


def _exercise_problems(cells: list[dict]) -> str | None:
    """Why the chapter's ``## Exercises`` section is not in the book's form (None: it is).

    The form: 2-4 ``### Exercise N: title`` subsections numbered 1, 2, ...; in each, a code
    exercise gives the reader a visible stub that raises ``NotImplementedError`` and keeps its
    solution in a later cell tagged ``hide-input`` (never the answer hidden in the reader's own
    cell); a written exercise's answer sits in a ``dropdown`` admonition."""
    start = next(
        (i for i, c in enumerate(cells) if c["cell_type"] == "markdown"
         and re.search(r"^## Exercises\s*$", "".join(c["source"]), re.M)),
        None,
    )  # fmt: skip
    if start is None:
        return "no '## Exercises' section"
    section, numbers = [], []
    for c in cells[start:]:
        src = "".join(c["source"])
        if c is not cells[start] and c["cell_type"] == "markdown" and re.search(r"^## ", src, re.M):
            break
        section.append(c)
        numbers += [int(n) for n in re.findall(r"^### Exercise (\d+)\b", src, re.M)]
    if not 2 <= len(numbers) <= 4 or numbers != list(range(1, len(numbers) + 1)):
        return f"exercises numbered {numbers} (want 2-4, numbered 1, 2, ...)"
    stub_seen = False
    for c in section:
        if c["cell_type"] == "markdown" and re.search(r"^### Exercise", "".join(c["source"]), re.M):
            stub_seen = False
        if c["cell_type"] != "code":
            continue
        src, tags = "".join(c["source"]), set(c["metadata"].get("tags", []))
        hidden = bool(tags & {"hide-input", "hide-cell"})
        if "raise NotImplementedError" in src:
            if hidden:
                return "a stub the reader must fill in is hidden"
            stub_seen = True
        elif hidden and not stub_seen:
            return "a hidden cell answers an exercise that gives the reader no stub"
    return None


def test_every_chapter_ends_with_numbered_exercises():
    broken = {
        name: why for name in _toc_order() if (why := _exercise_problems(_cells(name))) is not None
    }
    _check_rule("exercises", broken, NO_EXERCISES_YET)


#: Chapters from the block-hash chapter on without a "Where real servers differ" box yet.
NO_SERVER_BOX_YET: set[str] = set()
# A file of a real server's code, and the version or commit it was read at.
_CITED_FILE = re.compile(r"[\w./-]+\.(?:py|cc|cpp|cu|h|rs)\b")
_CITED_VERSION = re.compile(r"\bv?\d+\.\d+(?:\.\d+)?\b|\b[0-9a-f]{7,40}\b")


def test_chapters_past_the_source_say_where_real_servers_differ():
    """From the block-hash chapter on, a "Where real servers differ" admonition lists where the
    package departs from SGLang, vLLM or mini-sglang, citing the file and version checked."""
    order = _toc_order()
    broken = {}
    for name in order[order.index("16_block_hash") :]:
        md = "\n".join("".join(c["source"]) for c in _cells(name) if c["cell_type"] == "markdown")
        box = re.search(r"```\{admonition\} Where real servers differ\n(.*?)\n```", md, re.S)
        if not box:
            broken[name] = "no 'Where real servers differ' admonition"
        elif not (_CITED_FILE.search(box.group(1)) and _CITED_VERSION.search(box.group(1))):
            broken[name] = "its 'Where real servers differ' box cites no file and version"
    _check_rule("where real servers differ", broken, NO_SERVER_BOX_YET)


#: Chapters whose code still edits ``sys.path`` or imports from ``benchmarks/``.
READS_BENCHMARKS_YET: set[str] = set()


def test_no_chapter_reaches_outside_the_package():
    """A learner's copy of a cell works wherever the package is installed: no cell edits
    ``sys.path`` or imports from the repository's ``benchmarks/`` (drivers a chapter needs live
    in the package)."""
    broken = {}
    for name in _toc_order():
        for i, c in enumerate(_cells(name)):
            src = "".join(c["source"])
            if c["cell_type"] == "code" and re.search(r"sys\.path|\bbenchmarks\b", src):
                broken[name] = f"cell {i} edits sys.path or imports from benchmarks/"
                break
    _check_rule("no reach outside the package", broken, READS_BENCHMARKS_YET)


#: The longest code cell a learner reads ("about 30 lines", issue 28): non-blank lines of a cell
#: whose input the page shows. A longer one is split where the program has a seam, or hidden.
LONGEST_TEACHING_CELL = 35
_HIDING_TAGS = {"hide-input", "hide-cell", "remove-input", "remove-cell"}


def _long_cells(cells: list[dict]) -> list[str]:
    return [
        f"cell {i} shows {n} lines"
        for i, c in enumerate(cells)
        if c["cell_type"] == "code"
        and not _HIDING_TAGS & set(c.get("metadata", {}).get("tags", []))
        and (n := sum(1 for line in "".join(c["source"]).splitlines() if line.strip()))
        > LONGEST_TEACHING_CELL
    ]


def test_no_teaching_cell_is_longer_than_a_reader_follows():
    broken = {n: "; ".join(p) for n in _toc_order() if (p := _long_cells(_cells(n)))}
    _check_rule("teaching cells of about 30 lines", broken, set())


def test_the_cell_length_rule_catches_what_it_should():
    def code(lines: int, *tags: str) -> dict:
        return {
            "cell_type": "code",
            "source": ["x = 1\n\n"] * lines,
            "metadata": {"tags": list(tags)},
        }

    assert _long_cells([code(LONGEST_TEACHING_CELL)]) == []
    assert _long_cells([code(LONGEST_TEACHING_CELL + 1)]) == [
        f"cell 0 shows {LONGEST_TEACHING_CELL + 1} lines"
    ]
    assert _long_cells([code(80, "hide-input")]) == []


def test_the_exercise_rule_catches_what_it_should():
    def md(s: str) -> dict:
        return {"cell_type": "markdown", "source": [s], "metadata": {}}

    def code(s: str, *tags: str) -> dict:
        return {"cell_type": "code", "source": [s], "metadata": {"tags": list(tags)}}

    good = [
        md("## Exercises\n\n### Exercise 1: count\nHow many?"),
        md("```{admonition} Answer\n:class: dropdown\nSix.\n```"),
        md("### Exercise 2: write it"),
        code("def f():\n    raise NotImplementedError"),
        code("check(f)"),
        code("def f():\n    return 1", "hide-input"),
        md("## Summary"),
    ]
    assert _exercise_problems(good) is None
    hidden_answer = [*good[:3], code("answer = 17", "hide-input"), good[-1]]
    assert "no stub" in _exercise_problems(hidden_answer)
    hidden_stub = [*good[:3], code("raise NotImplementedError", "hide-input"), good[-1]]
    assert "is hidden" in _exercise_problems(hidden_stub)
    assert "numbered [1]" in _exercise_problems([good[0], good[-1]])
    assert "numbered [1, 3]" in _exercise_problems([good[0], md("### Exercise 3: x"), good[-1]])
    assert _exercise_problems([md("## Summary")]) == "no '## Exercises' section"


#: Chapters whose figures and tables are not all named and referred to by number yet.
FIGURES_NOT_NUMBERED_YET: set[str] = set()
#: Prose that points at a figure or table by position instead of by number ({numref}).
_BY_POSITION = re.compile(
    r"\b(?:figure|table|plot|picture|drawing|diagram|chart|tree|panel|player)s?"
    r"\s+(?:above|below)\b",
    re.I,
)
_KV_FIGURE_OUTPUT = re.compile(r'<figure class="kv-figure\b')
_TABLE_RULE = re.compile(r"^\s*\|(?:\s*:?-{3,}:?\s*\|)+\s*$", re.M)
_NAMED_TABLE = re.compile(
    r"^(?P<fence>`{3,}|:{3,})\{table\}[ \t]+\S.*\n(?P<body>(?:.*\n)*?)(?P=fence)[ \t]*$", re.M
)


def _names(value: object) -> list:
    return value if isinstance(value, list) else [] if value is None else [value]


def _numbering_problems(cells: list[dict]) -> list[str]:
    """Why a chapter's figures and tables are not named and referred to by number (issue 28).

    - every output that is a kvcache.viz figure (``<figure class="kv-figure ...">``) belongs to
      a cell that names it in its metadata, ``"figure": "fig-..."`` (a list: one per figure);
    - a cell's ``"table"`` metadata is ``{"name": "tab-...", "caption": ...}`` (or a list);
    - every Markdown table of the prose is a ``{table}`` directive with a caption and a
      ``:name: tab-...``;
    - the prose never points at a figure or table by position ("the figure above", "the table
      below", "the plot above", "the tree above", ...): it writes ``{numref}`fig-...` ``."""
    problems = []
    for i, c in enumerate(cells):
        src = "".join(c["source"])
        if c["cell_type"] == "code":
            meta = c.get("metadata", {})
            shown = sum(
                len(_KV_FIGURE_OUTPUT.findall("".join(o.get("data", {}).get("text/html", ""))))
                for o in c.get("outputs", [])
            )
            names = _names(meta.get("figure"))
            if len(names) != shown:
                problems.append(f"cell {i} shows {shown} figure(s), its metadata names {names}")
            problems += [
                f"cell {i}: figure name {n!r} is not fig-..."
                for n in names
                if not (isinstance(n, str) and re.fullmatch(r"fig-[a-z0-9-]+", n))
            ]
            for t in _names(meta.get("table")):
                if not (
                    isinstance(t, dict)
                    and re.fullmatch(r"tab-[a-z0-9-]+", str(t.get("name")))
                    and len(str(t.get("caption", "")).split()) >= 3
                ):
                    problems.append(f"cell {i}: table {t!r} needs a tab- name and a caption")
            continue
        if c["cell_type"] != "markdown":
            continue
        named = [m.span() for m in _NAMED_TABLE.finditer(src)
                 if re.search(r"^:name: tab-[a-z0-9-]+\s*$", m.group("body"), re.M)]  # fmt: skip
        problems += [
            f"cell {i}: a ``` fence whose caption holds a backtick is no fence: use :::{{table}}"
            for line in re.findall(r"^`{3,}\{table\}.*$", src, re.M)
            if "`" in line.lstrip("`")
        ]
        for rule in _TABLE_RULE.finditer(src):
            if not any(a <= rule.start() < b for a, b in named):
                problems.append(f"cell {i}: a Markdown table outside a named {{table}} directive")
        problems += [f"cell {i}: {m.group(0)!r}" for m in _BY_POSITION.finditer(src)]
    return problems


def _labels_defined() -> set[str]:
    """Every figure and table name the chapters define (cell metadata, {table} directives)."""
    import json

    names: set[str] = set()
    for nb_path in BOOK.glob("*.ipynb"):
        for c in json.loads(nb_path.read_text())["cells"]:
            meta = c.get("metadata", {})
            names.update(n for n in _names(meta.get("figure")) if isinstance(n, str))
            names.update(t["name"] for t in _names(meta.get("table")) if isinstance(t, dict))
            names.update(re.findall(r"^:name: (tab-[a-z0-9-]+)", "".join(c["source"]), re.M))
    return names


def test_figures_and_tables_are_numbered_and_referred_to_by_number():
    broken = {
        name: "; ".join(p) for name in _toc_order() if (p := _numbering_problems(_cells(name)))
    }
    _check_rule("figures and tables by number", broken, FIGURES_NOT_NUMBERED_YET)
    pages = {p.stem: p.read_text() for p in BOOK.glob("*.md")}
    by_position = {n: _BY_POSITION.findall(t) for n, t in pages.items() if _BY_POSITION.search(t)}
    assert not by_position, f"pages that point at a figure by position: {by_position}"
    # every {numref} names a figure or table that exists (Sphinx would fail the build too)
    defined = _labels_defined()
    refs: dict[str, list[str]] = {}
    for nb_path in BOOK.glob("*.ipynb"):
        text = "".join("".join(c["source"]) for c in json_cells(nb_path))
        for target in re.findall(r"\{numref\}`(?:[^`<]*<)?([^`>]+)>?`", text):
            refs.setdefault(target, []).append(nb_path.stem)
    unknown = {t: where for t, where in refs.items() if t not in defined}
    assert not unknown, f"{{numref}} to names no chapter defines: {unknown}"


def json_cells(path: Path) -> list[dict]:
    import json

    return json.loads(path.read_text())["cells"]


def test_the_numbering_rule_catches_what_it_should():
    def md(s: str) -> dict:
        return {"cell_type": "markdown", "source": [s], "metadata": {}}

    def fig(meta: dict, n: int = 1) -> dict:
        html = '<figure class="kv-figure kv-tree"><div class="kv-figure-body"></div></figure>'
        outputs = [{"output_type": "display_data", "data": {"text/html": html}}] * n
        return {"cell_type": "code", "source": ["x"], "metadata": meta, "outputs": outputs}

    table = "| a | b |\n|---|---:|\n| 1 | 2 |\n"
    good = [
        md("As {numref}`fig-one` shows."),
        fig({"figure": "fig-one"}),
        fig({"figure": ["fig-two", "fig-three"]}, 2),
        md("```{table} What the columns say\n:name: tab-one\n\n" + table + "```"),
        fig({"table": {"name": "tab-two", "caption": "A table a cell prints"}}, 0),
    ]
    assert _numbering_problems(good) == []
    assert "names []" in _numbering_problems([fig({})])[0]
    assert "names ['fig-a']" in _numbering_problems([fig({"figure": "fig-a"}, 2)])[0]
    assert "not fig-" in _numbering_problems([fig({"figure": "Fig_1"})])[0]
    assert "caption" in _numbering_problems([fig({"table": {"name": "tab-x"}}, 0)])[0]
    assert "outside" in _numbering_problems([md(table)])[0]
    backtick = "```{table} The `x` table\n:name: tab-x\n\n" + table + "```"
    assert "no fence" in _numbering_problems([md(backtick)])[0]
    colon = ":::{table} The `x` table\n:name: tab-x\n\n" + table + ":::"
    assert _numbering_problems([md(colon)]) == []
    unnamed = "```{table} A caption here\n\n" + table + "```"
    assert "outside" in _numbering_problems([md(unnamed)])[0]
    for words in ("the figure above", "The table below", "the plot above", "the tree above"):
        assert _numbering_problems([md(f"As {words} shows.")]), words
    assert _numbering_problems([md("The cell above checks it.")]) == []
