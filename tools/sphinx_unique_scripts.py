"""Sphinx extension for the book's HTML: every page lists each inline <script> once.

Sphinx 7.4 (what Jupyter Book 1.x runs) writes an inline script twice when an extension adds it
after the HTML builder has started: once from the builder's own list, where its file name is
None, and once re-read from the registry in ``StandaloneHTMLBuilder.prepare_writing``, where it
is '' (so the two compare unequal and both stay). sphinx-thebe adds
``const THEBE_JS_URL = ...`` that way, and its second copy is a SyntaxError in the console of
every page ("Identifier 'THEBE_JS_URL' has already been declared"); sphinx-togglebutton's
selector is repeated the same way. This drops the repeats, keeping the first of each.

Enabled in book.yml under ``sphinx: local_extensions``; tests/test_book_browser.py checks that
the console of every page is free of errors.
"""
from __future__ import annotations

from typing import Any


def _key(js: Any) -> tuple:
    attributes = getattr(js, "attributes", {})
    return (getattr(js, "filename", js) or "", tuple(sorted(attributes.items())))


def drop_repeated_scripts(app: Any, pagename: str, templatename: str, context: dict, doctree: Any) -> None:
    """html-page-context handler: remove every script whose (file, attributes) came before."""
    scripts = context.get("script_files")
    if not isinstance(scripts, list):
        return
    seen: set[tuple] = set()
    unique = []
    for js in scripts:
        key = _key(js)
        if key not in seen:
            seen.add(key)
            unique.append(js)
    context["script_files"] = unique


def setup(app: Any) -> dict:
    # late priority: after the handlers that add a page's own scripts (MathJax, thebe)
    app.connect("html-page-context", drop_repeated_scripts, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
