"""Sphinx extension: the book's search ranking (book/_ext/search_scorer.js).

Sphinx opens ``html_search_scorer`` relative to the directory the build runs in, not to the
configuration, so the path is set here, absolute, unless _config.yml names another scorer.
"""

from __future__ import annotations

from pathlib import Path

SCORER = Path(__file__).resolve().parent / "search_scorer.js"


def _set_scorer(app, config) -> None:
    if not config.html_search_scorer:
        config.html_search_scorer = str(SCORER)


def setup(app):
    app.connect("config-inited", _set_scorer)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
