"""MkDocs hooks: the reference text whose source is the code, written at build time so it cannot drift from it.

``mkdocs.yml`` names this file under ``hooks:``. A page marks where generated text goes with
``<!-- generated: NAME [ARGUMENT] -->``; ``docs_reference.render`` (beside this file, and read by the tests too)
replaces the markers, so what the tests check is what the site shows.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import docs_reference  # noqa: E402 - found beside this file, which MkDocs loads by path


def on_page_markdown(markdown: str, **_: object) -> str:
    return docs_reference.render(markdown)
