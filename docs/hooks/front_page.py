"""MkDocs hook: the site's home page is README.md, so the two never drift apart; its links into ``docs/`` are
made relative to the site."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

_README = Path(__file__).resolve().parents[2] / "README.md"
_INTO_DOCS = re.compile(r"\]\(docs/")


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """The home page's markdown: README.md's, with ``](docs/x)`` links as ``](x)``."""
    if page.file.src_uri != "index.md":
        return markdown
    return _INTO_DOCS.sub("](", _README.read_text(encoding="utf-8"))
