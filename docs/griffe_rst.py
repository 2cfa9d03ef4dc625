"""A griffe extension for the API reference: the package's docstrings use a little reStructuredText
(``:func:`name``` roles, a paragraph ending in ``::`` before a literal block), which Markdown
would show as typed. Loaded by mkdocs.yml; the docstrings themselves stay as they are.
"""

from __future__ import annotations

import re

import griffe

ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|obj|exc):`~?([^`]+)`")
LITERAL_MARKER = re.compile(r"(\S)::\n(\s*\n)", re.MULTILINE)  # "text::" then a blank line


class RstRoles(griffe.Extension):
    """Rewrite reST roles as code spans and ``text::`` as ``text:`` (the block stays indented)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            text = ROLE.sub(r"`\1`", obj.docstring.value)
            obj.docstring.value = LITERAL_MARKER.sub(r"\1:\n\2", text)
