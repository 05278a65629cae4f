"""What the benchmarks against the engines' own code share: importing an engine from the folder
`scripts/real_engines_env.sh` fills, the label of a run, and its JSON record."""

from __future__ import annotations

import importlib
import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["import_engine", "commit", "machine", "write_json"]


def import_engine(folder: Path | None, module: str, what: str) -> None:
    """Import ``module`` (``folder``, when given, first on the path), or exit naming ``what``
    and the script that makes such a folder."""
    if folder is not None:
        sys.path.insert(0, str(folder.resolve()))
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise SystemExit(
            f"{what} does not import ({e}); make a folder for it with "
            "`bash scripts/real_engines_env.sh DIR` and pass --engines-path DIR"
        ) from None


def commit(where: Path | None = None) -> str | None:
    """The commit of the repository holding ``where`` (default: this one), where git can tell."""
    folder = where.resolve() if where is not None else Path(__file__).resolve().parent
    out = subprocess.run(
        ["git", "-C", str(folder), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    )
    return out.stdout.strip() or None


def machine(**engines: Any) -> dict[str, Any]:
    """What a run ran on (CPU, versions, date, this repository's commit, the clock), and
    ``engines``: the versions (or commits) of the engines it ran."""
    return {
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        **engines,
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit(),
        "clock": "wall (perf_counter)",
    }


def write_json(path: Path | None, result: dict[str, Any]) -> None:
    """Keep ``result`` at ``path`` (nothing when ``None``)."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
