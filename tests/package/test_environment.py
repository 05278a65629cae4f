"""pyproject.toml and environment.yml describe the same environment.

Every requirement of the package (its dependencies and every extra) must appear in the pip
section of environment.yml with the same specifier and marker, and that section must hold
nothing else (besides `-e .`, the package itself). The conda section holds Python at the
version pyproject.toml requires, pip, and system tools pip cannot provide.
"""

import re
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
CONDA_ONLY = {"python", "pip", "graphviz"}  # graphviz here is the conda package with `dot`


def load():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    env = yaml.safe_load((REPO / "environment.yml").read_text())
    return pyproject, env


def key(req: Requirement):
    return (
        canonicalize_name(req.name),
        frozenset(req.extras),
        str(req.specifier),
        str(req.marker) if req.marker else "",
    )


def pyproject_requirements(pyproject) -> dict:
    project = pyproject["project"]
    reqs = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        reqs.extend(extra)
    by_name: dict = {}
    for text in reqs:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        if name in by_name and key(by_name[name]) != key(req):
            pytest.fail(
                f"pyproject.toml asks for {name} twice, differently: {by_name[name]} and {req}"
            )
        by_name[name] = req
    return by_name


def environment_pip(env) -> dict:
    pip_sections = [d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d]
    assert len(pip_sections) == 1, "environment.yml needs exactly one pip section"
    by_name: dict = {}
    for text in pip_sections[0]:
        if text.strip() in ("-e .", "--editable ."):
            continue
        req = Requirement(text)
        name = canonicalize_name(req.name)
        assert name not in by_name, f"environment.yml lists {name} twice"
        by_name[name] = req
    return by_name


def test_every_requirement_matches():
    pyproject, env = load()
    want, have = pyproject_requirements(pyproject), environment_pip(env)
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    differ = sorted(
        f"pyproject '{want[n]}' vs environment.yml '{have[n]}'"
        for n in set(want) & set(have)
        if key(want[n]) != key(have[n])
    )
    assert not missing, f"in pyproject.toml but not in environment.yml: {missing}"
    assert not extra, f"in environment.yml but not in pyproject.toml: {extra}"
    assert not differ, "specifiers differ: " + "; ".join(differ)


def test_environment_installs_the_package_itself():
    _, env = load()
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    assert "-e ." in [p.strip() for p in pip], "environment.yml should install kvcache (-e .)"


def test_conda_section_is_python_pip_and_system_tools():
    pyproject, env = load()
    conda = [d for d in env["dependencies"] if isinstance(d, str)]
    names = {re.split(r"[=<>! ]", d, maxsplit=1)[0] for d in conda}
    assert names <= CONDA_ONLY, (
        f"conda packages besides {sorted(CONDA_ONLY)}: {sorted(names - CONDA_ONLY)}"
    )
    assert "pip" in names
    python = [d for d in conda if re.split(r"[=<>! ]", d, maxsplit=1)[0] == "python"]
    assert len(python) == 1, "environment.yml must pin python once"
    version = python[0].split("=", 1)[1].strip("=")
    assert version in SpecifierSet(pyproject["project"]["requires-python"]), (
        f"environment.yml python={version} outside requires-python "
        f"{pyproject['project']['requires-python']}"
    )


def test_torch_is_pinned_exactly():
    """A looser torch requirement pulls a multi-GB CUDA build on a fresh machine."""
    pyproject, _ = load()
    torch = pyproject_requirements(pyproject)["torch"]
    assert str(torch.specifier) == "==2.13.0"
