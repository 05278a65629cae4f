"""kvcache as a package: the sdist and wheel build, pass twine's metadata checks, and the wheel
installed (not editable) into a fresh venv gives the whole public API, its package data, and
nothing else (no tests, no book).

Nothing is downloaded: the build runs without isolation (setuptools comes from this venv) and
the throwaway venv sees this venv's site-packages (torch, numpy, graphviz, ...) through a
``.pth`` line, so only the wheel itself is installed into it, with ``--no-deps --no-index``.
A ``.pth`` line puts a directory on ``sys.path`` without running that directory's own ``.pth``
files, so the editable install of kvcache in this venv stays invisible there.
"""

from __future__ import annotations

import email.parser
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "kvcache"
# What the sdist build needs of the repository; the rest (.venv, the built site) is skipped.
SKIP = shutil.ignore_patterns(
    ".venv",
    ".git",
    "_build",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".pytest_cache",
    ".hypothesis",
    ".ipynb_checkpoints",
    ".ruff_cache",
    ".mypy_cache",
)

pytestmark = pytest.mark.timeout(300)


def run(*args: str | Path, cwd: Path | None = None) -> str:
    # Without PYTHONPATH: the tests run with the repository on it, which would shadow the wheel.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode:
        pytest.fail(
            f"{' '.join(map(str, args))} exited {proc.returncode}:\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc.stdout


def source_package_files() -> set[str]:
    """Every file the package directory holds (sources and data), as wheel paths."""
    return {
        str(p.relative_to(REPO))
        for p in PACKAGE.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> dict[str, Path]:
    """The sdist, and the wheel built from it (``python -m build`` builds the wheel from the
    unpacked sdist, so a file the sdist forgets is missing from the wheel too)."""
    tmp = tmp_path_factory.mktemp("kvcache-dist")
    src = tmp / "src"
    shutil.copytree(REPO, src, ignore=SKIP)
    out = tmp / "dist"
    run(sys.executable, "-m", "build", "--no-isolation", "--outdir", out, src)
    wheels, sdists = sorted(out.glob("*.whl")), sorted(out.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, sorted(out.iterdir())
    return {"wheel": wheels[0], "sdist": sdists[0]}


def test_version_has_one_source():
    import kvcache

    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"], "the version is set in kvcache/__init__.py only"
    assert pyproject["project"]["dynamic"] == ["version"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "kvcache.__version__"}
    assert isinstance(kvcache.__version__, str) and kvcache.__version__[0].isdigit()


def test_metadata_passes_twine_check(dist):
    out = run(sys.executable, "-m", "twine", "check", "--strict", dist["wheel"], dist["sdist"])
    assert out.count("PASSED") == 2, out


def test_wheel_metadata(dist):
    import kvcache

    with zipfile.ZipFile(dist["wheel"]) as whl:
        meta_name = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(whl.read(meta_name).decode())
    assert meta["Name"] == "kvcache"
    assert meta["Version"] == kvcache.__version__
    assert meta["Requires-Python"] == ">=3.11"
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta["Description-Content-Type"] == "text/markdown"
    extras = set(meta.get_all("Provides-Extra"))
    assert {"triton", "test", "book"} <= extras, extras
    assert any(r.startswith("torch==") for r in meta.get_all("Requires-Dist"))


def test_wheel_holds_the_package_and_its_data_only(dist):
    with zipfile.ZipFile(dist["wheel"]) as whl:
        names = [n for n in whl.namelist() if ".dist-info/" not in n]
    outside = sorted(n for n in names if not n.startswith("kvcache/"))
    assert not outside, f"the wheel installs files outside kvcache/: {outside}"
    missing = sorted(source_package_files() - set(names))
    assert not missing, (
        f"files of kvcache/ missing from the wheel (package data not declared "
        f"in pyproject.toml [tool.setuptools.package-data]?): {missing}"
    )
    assert "kvcache/py.typed" in names


def test_sdist_holds_what_the_wheel_is_built_from(dist):
    with tarfile.open(dist["sdist"]) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for needed in (
        "pyproject.toml",
        "README.md",
        "PKG-INFO",
        "kvcache/__init__.py",
        "kvcache/py.typed",
    ):
        assert needed in names, f"{needed} missing from the sdist"
    assert not {n for n in names if n.startswith(("book/", ".venv/", "_build/"))}


IMPORT_CHECK = textwrap.dedent("""
    import importlib.metadata, json, sys, sysconfig
    from kvcache import *
    import kvcache
    missing = [n for n in kvcache.__all__ if not hasattr(kvcache, n)]
    star = {}
    exec("from kvcache import *", star)
    import kvcache.kernels, kvcache.storage, kvcache.managers, kvcache.serving, kvcache.viz
    import kvcache.examples.tp_attention
    files = [str(f) for f in importlib.metadata.files("kvcache")]
    print(json.dumps({
        "file": kvcache.__file__, "purelib": sysconfig.get_paths()["purelib"],
        "version": kvcache.__version__, "dist_version": importlib.metadata.version("kvcache"),
        "missing": missing, "star": sorted(set(kvcache.__all__) - set(star)), "files": files,
    }))
""")


def test_wheel_installs_into_a_fresh_venv(dist, tmp_path):
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    py = venv / "bin" / "python"
    purelib = Path(
        run(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip()
    )
    # This venv's dependencies (torch, ...) are visible there; kvcache's editable finder is not.
    (purelib / "_kvcache_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run(
        sys.executable,
        "-m",
        "pip",
        "--python",
        py,
        "install",
        "--quiet",
        "--no-deps",
        "--no-index",
        dist["wheel"],
    )
    info = json.loads(run(py, "-c", IMPORT_CHECK, cwd=tmp_path).strip().splitlines()[-1])
    assert Path(info["file"]).is_relative_to(Path(info["purelib"])), (
        f"imported kvcache from {info['file']}, not from the installed wheel"
    )
    assert not info["missing"], f"names of kvcache.__all__ that do not resolve: {info['missing']}"
    assert not info["star"], f"names `from kvcache import *` does not bind: {info['star']}"
    assert info["version"] == info["dist_version"]
    installed = {f for f in info["files"] if ".dist-info/" not in f and "__pycache__" not in f}
    source = source_package_files()
    assert installed == source, (
        f"installed files differ from kvcache/: extra "
        f"{sorted(installed - source)}, missing {sorted(source - installed)}"
    )


def test_pre_commit_runs_the_pinned_ruff():
    """.pre-commit-config.yaml installs ruff itself; it must be the version `make lint` runs."""
    import yaml
    from packaging.requirements import Requirement

    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    pins = {
        Requirement(r).name: str(Requirement(r).specifier)
        for extra in pyproject["project"]["optional-dependencies"].values()
        for r in extra
    }
    config = yaml.safe_load((REPO / ".pre-commit-config.yaml").read_text())
    hooks = [h for repo in config["repos"] for h in repo["hooks"]]
    used = {
        Requirement(d).name: str(Requirement(d).specifier)
        for h in hooks
        for d in h.get("additional_dependencies", [])
    }
    assert used, "no hook pins a tool"
    for name, spec in used.items():
        assert pins.get(name) == spec, f"pre-commit pins {name}{spec}, pyproject {pins.get(name)}"
