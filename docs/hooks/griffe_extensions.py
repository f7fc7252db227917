"""Griffe extensions for the API reference (mkdocs.yml loads them; not part of the package).

``LiteralBlockMarkers``: the docstrings are reStructuredText-flavoured, and introduce an
indented example with ``::`` as Sphinx reads it. Markdown renders the indented block as code
already; this writes the marker as Sphinx shows it, ``paragraph::`` as ``paragraph:`` and a
``::`` on a line of its own as nothing. The source is not changed.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

# "text::" then a blank line: the paragraph ends in ":"; a "::" line of its own disappears.
_MARKER_ALONE = re.compile(r"^[ \t]*::[ \t]*\n(?=[ \t]*\n)", re.MULTILINE)
_MARKER_AFTER_TEXT = re.compile(r"(?<=\S)::[ \t]*\n(?=[ \t]*\n)")


class LiteralBlockMarkers(griffe.Extension):
    """Render reStructuredText's ``::`` before an indented block as Sphinx does."""

    def on_object(self, *, obj: griffe.Object, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if obj.docstring is not None:
            value = _MARKER_ALONE.sub("", obj.docstring.value)
            obj.docstring.value = _MARKER_AFTER_TEXT.sub(":\n", value)

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        self.on_object(obj=pkg, loader=loader)  # on_object runs for the package's members only
