"""The book's own tooling: the notebook check that `make book` runs first, and the nbval
sanitize file (which must mask what varies between runs and nothing else)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHECK = REPO / "scripts" / "check_notebooks.py"
SANITIZE = REPO / "tests" / "nbval_sanitize.cfg"


def code(source, count, outputs=(), tags=()):
    return {
        "cell_type": "code",
        "metadata": {"tags": list(tags)} if tags else {},
        "source": source,
        "execution_count": count,
        "outputs": list(outputs),
    }


def stdout(text):
    return {"output_type": "stream", "name": "stdout", "text": text}


def write(tmp_path, cells):
    nb = {"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path = tmp_path / "chapter.ipynb"
    path.write_text(json.dumps(nb))
    return path


def run_check(path):
    return subprocess.run([sys.executable, str(CHECK), str(path)], capture_output=True, text=True)


def test_executed_notebook_passes(tmp_path):
    out = {
        "output_type": "execute_result",
        "execution_count": 2,
        "data": {"text/plain": "3"},
        "metadata": {},
    }
    path = write(
        tmp_path,
        [
            code("x = 1", 1),
            {"cell_type": "markdown", "metadata": {}, "source": "hi"},
            code("x + 2", 2, [out]),
            code("", None),
        ],
    )
    r = run_check(path)
    assert r.returncode == 0, r.stderr


def test_tagged_cells_pass(tmp_path):
    """nbval's tags and a hidden answer cell are the accepted forms."""
    path = write(
        tmp_path,
        [
            code("print(1)", 1, tags=["nbval-ignore-output"]),
            code("print(2)", 2, tags=["nbval-skip"]),
            code("# Your answer:\nn = 3", 3, tags=["hide-input"]),
            code("print(d)", 4, [stdout("max |a - b| = 5.96e-07\n")], ["nbval-ignore-output"]),
            code("print(c)", 5, [stdout("prefill_s_per_token=3.2e-05, 1.5e+03, v1.0e-07x\n")]),
        ],
    )
    r = run_check(path)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize(
    "cells, message",
    [
        ([code("x = 1", 1), code("y = 2", None)], "never executed"),
        (
            [
                code(
                    "1/0",
                    1,
                    [
                        {
                            "output_type": "error",
                            "ename": "ZeroDivisionError",
                            "evalue": "division by zero",
                            "traceback": [],
                        }
                    ],
                )
            ],
            "raised ZeroDivisionError",
        ),
        ([code("a = 1", 2), code("b = 1", 1)], "expected 1"),
        ([code("a = 1", 1), code("b = 1", 3)], "expected 2"),
        (
            [
                code(
                    "a",
                    1,
                    [
                        {
                            "output_type": "execute_result",
                            "execution_count": 7,
                            "data": {"text/plain": "1"},
                            "metadata": {},
                        }
                    ],
                )
            ],
            "output from execution 7",
        ),
        # what the website would print in a chapter: nbval's comments, linter markers, answers
        ([code("# NBVAL_IGNORE_OUTPUT\nprint(1)", 1)], "'nbval-ignore-output' instead"),
        ([code("x = 1\n# NBVAL_SKIP\n", 1)], "'nbval-skip' instead"),
        ([code("import os  # noqa: F401", 1)], "`# noqa` shows on the page"),
        ([code("# Your answer:\nn = 3", 1)], "answer cell without the 'hide-input' tag"),
        ([code("# Your prediction:\nn = 3", 1, tags=["hide-output"])], "without the 'hide-input'"),
        # a float rounding difference in a compared output: CPU-dependent
        ([code("print(d)", 1, [stdout("largest difference: 5.96e-07\n")])], "number 5.96e-07"),
        ([code("print(d)", 1, [stdout("max |a - b| = 1.2e-06\n")])], "number 1.2e-06"),
        ([code("print(d)", 1, [stdout("largest difference: 0.00e+00\n")])], "number 0.00e+00"),
        (
            [
                code(
                    "d",
                    1,
                    [
                        {
                            "output_type": "execute_result",
                            "execution_count": 1,
                            "data": {"text/plain": ["7.", "2e-08"]},
                            "metadata": {},
                        }
                    ],
                )
            ],
            "number 7.2e-08",
        ),
    ],
)
def test_check_notebooks_fails(tmp_path, cells, message):
    r = run_check(write(tmp_path, cells))
    assert r.returncode == 1
    assert message in r.stderr


def sanitize(text):
    pairs = re.findall(r"^regex: (.*)$\n^replace: (.*)$", SANITIZE.read_text(), flags=re.MULTILINE)
    assert pairs, "nbval would read no pattern from the sanitize file"
    for regex, replace in pairs:
        text = re.sub(regex, replace, text)
    return text


@pytest.mark.parametrize(
    "varying, masked",
    [
        (
            "<kvcache.managers.radix.RadixTreeNode object at 0x7f3a2c1b9e50>",
            "<kvcache.managers.radix.RadixTreeNode object at 0xADDRESS>",
        ),
        ("store_cache: 123.4 µs per call", "store_cache: TIME per call"),
        (
            "evict took 1.23 ms, match 850 ns, total 0.52 s",
            "evict took TIME, match TIME, total TIME",
        ),
        (
            '<?xml version="1.0"?>\n<svg width="62pt"><g id="node1"><text>a</text></g></svg>\n',
            "<svg/>",
        ),
    ],
)
def test_sanitize_masks_what_varies(varying, masked):
    assert sanitize(varying) == masked


@pytest.mark.parametrize(
    "stable",
    [
        "cached_len=4, indices=tensor([0, 1, 2, 3], dtype=torch.int32)",
        "nbytes = 131,072,000 (125.0 MiB)",
        "SizeInfo(evictable_size=3, protected_size=5)",
        "page_size=16 slots, 0x10 = 16",
        "2 ranks, 8 heads each, 32 layers",
    ],
)
def test_sanitize_leaves_the_rest(stable):
    assert sanitize(stable) == stable


def _wrap_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "wrap_code_cells", REPO / "scripts" / "wrap_code_cells.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "source",
    [
        "result = some_function(first_argument=1, second_argument=2, third_argument=3, fourth=4)  # why",
        'print(f"{name:<10} has {count:>5} entries and {size:>8,d} bytes in total, {ratio:.2f} per entry")',
        "# " + "a long comment that explains something at length " * 3,
        "x = 1",
    ],
)
def test_wrap_code_cells_keeps_the_program(source):
    """scripts/wrap_code_cells.py brings a cell within 88 columns with the same syntax tree."""
    import ast

    wrap = _wrap_module()
    new = wrap.wrap_cell(source)
    assert all(len(line) <= wrap.WIDTH for line in new.split("\n")), new
    assert ast.dump(ast.parse(new)) == ast.dump(ast.parse(source))


def test_wrap_code_cells_leaves_ipython_syntax_alone():
    wrap = _wrap_module()
    source = "%timeit " + "x" * 100
    assert wrap.wrap_cell(source) == source


def markdown(source):
    return {"cell_type": "markdown", "metadata": {}, "source": source}


@pytest.mark.parametrize(
    "prose",
    [
        "A store of one token takes about 4.5 µs.",  # the output says 29.4 µs
        "The manager is 3.5x faster.",
        "Reuse rises to 56%.",
        "It holds 4,096 tokens.",
        "Evicting costs 12 ms a call.",
        "Hashing is about three times slower.",
    ],
)
def test_a_prose_number_no_cell_gives_fails(tmp_path, prose):
    """A planted mismatch: the prose quotes a number the chapter's outputs do not print."""
    cells = [
        code("print(t)", 1, [stdout("store: 29.4 µs, ratio 2.1x, reuse 0.41, 2,048 tokens\n")]),
        markdown(prose),
    ]
    r = run_check(write(tmp_path, cells))
    assert r.returncode == 1
    assert "is quoted in prose but no compared output" in r.stderr


@pytest.mark.parametrize(
    "prose",
    [
        "A store of one token takes {glue:text}`store_us:.1f` µs.",  # glued
        "A store of one token takes 29.4 µs, the ratio is about 2.1x.",  # as printed
        "Reuse is 41%, about two times the baseline; 2,048 tokens in all.",  # 0.41 and 2,048
        "Section §13.4 of the guide, SGLang 0.5.23, `page_size=4096`, and $10^{-6}$.",
        "Each of the 4 layers, 16 heads.",  # small counts: constants of the text
        "The weights take 4.8 ms to read.",  # declared below
    ],
)
def test_backed_prose_numbers_pass(tmp_path, prose):
    cells = [
        code("print(t)", 1, [stdout("store: 29.4 µs, ratio 2.1x, reuse 0.41, 2,048 tokens\n")]),
        code("print(x)", 2, [stdout("99.9 µs\n")], tags=["nbval-ignore-output"]),
        code("n = 2", 3),
        markdown(prose),
    ]
    nb = {
        "cells": cells,
        "metadata": {"kvcache": {"prose_constants": {"4.8 ms": "LLAMA3_8B_H100's weight read"}}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    path = tmp_path / "chapter.ipynb"
    path.write_text(json.dumps(nb))
    r = run_check(path)
    assert r.returncode == 0, r.stderr


def test_a_number_only_an_ignored_output_prints_must_be_glued(tmp_path):
    """A timing printed in a cell nbval ignores changes on every run: prose must glue it."""
    cells = [
        code("print(x)", 1, [stdout("99.9 µs\n")], tags=["nbval-ignore-output"]),
        markdown("It took 99.9 µs."),
    ]
    r = run_check(write(tmp_path, cells))
    assert r.returncode == 1 and "'99.9 µs'" in r.stderr
