"""Sphinx extension: keep the built book free of anything that would load from the internet.

Jupyter Book 1 always enables sphinx-thebe, which puts an inline script on every page naming
thebe on unpkg.com (loaded only when a reader presses a launch button; this book has none) and
emits it twice, which throws "Identifier 'THEBE_JS_URL' has already been declared". The book
has no live kernels, so both thebe scripts are dropped from every page here.

MathJax, require.js and the ipywidgets manager are vendored instead (see _config.yml and
book/_static/vendor/README.md); tests/test_site.py checks every built page in Chromium.
"""

from __future__ import annotations


def _is_thebe(script) -> bool:
    filename = str(script) if script else ""
    body = getattr(script, "attributes", {}).get("body", "") or ""
    return filename.endswith("sphinx-thebe.js") or "THEBE_JS_URL" in body


def _drop_thebe(app, pagename, templatename, context, doctree):
    scripts = context.get("script_files")
    if scripts:
        context["script_files"] = [s for s in scripts if not _is_thebe(s)]


def setup(app):
    app.connect("html-page-context", _drop_thebe, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
