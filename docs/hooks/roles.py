"""MkDocs hook: the docstrings' Sphinx roles (``:class:`X```, ``:func:`f```, ``:math:`...```) shown as their code
alone on the site, as a reader of the source sees them."""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj|math):(?=<code)")


def on_page_content(html: str, **_: Any) -> str:
    """The page's HTML without the role prefixes before inline code."""
    return _ROLE.sub("", html)
