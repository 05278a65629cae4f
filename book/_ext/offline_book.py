"""Sphinx extension: keep the built book free of anything that would load from the internet.

Jupyter Book 1 always enables sphinx-thebe, which puts an inline script on every page naming
thebe on unpkg.com (loaded only when a reader presses a launch button; this book has none) and
emits it twice, which throws "Identifier 'THEBE_JS_URL' has already been declared". The book
has no live kernels, so both thebe scripts are dropped from every page here.

MathJax, require.js and the ipywidgets manager are vendored instead (see _config.yml and
book/_static/vendor/README.md); tests/book/test_site.py checks every built page in Chromium.

The widget manager's bundle injects one of its stylesheets before it reads
``__jupyter_widgets_assets_path__`` (set by widgets-config.js), so that sheet's icon fonts point
at ``@jupyter-widgets/<hash>.woff2`` relative to the page. Whether the browser fetches them
before the correct sheet wins is a race (seen failing once in CI's site test). After the build,
the vendored fonts are therefore also copied to ``@jupyter-widgets/`` beside every folder of
pages, so both addresses resolve.
"""

from __future__ import annotations

import shutil
from pathlib import Path

_WIDGET_FONTS = (
    Path(__file__).resolve().parents[1] / "_static" / "vendor" / "jupyter-widgets"
)


def _is_thebe(script) -> bool:
    filename = str(script) if script else ""
    body = getattr(script, "attributes", {}).get("body", "") or ""
    return filename.endswith("sphinx-thebe.js") or "THEBE_JS_URL" in body


def _drop_thebe(app, pagename, templatename, context, doctree):
    scripts = context.get("script_files")
    if scripts:
        context["script_files"] = [s for s in scripts if not _is_thebe(s)]


def _copy_widget_fonts(app, exception) -> None:
    if exception is not None or app.builder.format != "html":
        return
    out = Path(app.outdir)
    for folder in {page.parent for page in out.rglob("*.html")}:
        if "_static" in folder.parts:
            continue
        # another site built inside this one (the Chinese edition in zh/, built at the same
        # time by `make book`) copies its own fonts
        nested = folder.relative_to(out).parents
        if any((out / p / "_static").is_dir() for p in nested if p != Path(".")) or (
            folder != out and (folder / "_static").is_dir()
        ):
            continue
        target = folder / "@jupyter-widgets"
        target.mkdir(exist_ok=True)
        for font in _WIDGET_FONTS.glob("*.woff2"):
            shutil.copy2(font, target / font.name)


def setup(app):
    app.connect("html-page-context", _drop_thebe, priority=900)
    app.connect("build-finished", _copy_widget_fonts)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
