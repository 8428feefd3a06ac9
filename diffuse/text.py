"""Docstrings shown as ``--help`` text."""

from __future__ import annotations

import re


def plain(doc: str | None) -> str:
    """``doc`` without reStructuredText literal marks (code in double backquotes, as docstrings here write
    it): a terminal would show the marks, not the emphasis."""
    return re.sub(r"``(.+?)``", r"\1", doc or "")
