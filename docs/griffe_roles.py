"""A griffe extension for the API reference: the docstrings' Sphinx roles as inline code.

The code's docstrings name other objects the Sphinx way (``:class:`Ragged```,
``:meth:`~transferqueue.client.async_client.AsyncClient.put```); mkdocstrings renders
docstrings as Markdown, where the role would show as text. This turns each into inline code
of the name as written (``~`` keeps the last part only, as Sphinx does), before the docstrings
are parsed. mkdocs.yml loads it by path (``extensions``); it is not a page of the site.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:class|meth|func|mod|data|attr|exc|obj):`(~?)([^`]+)`")


def _code(match: re.Match[str]) -> str:
    short, name = match.groups()
    return f"`{name.rsplit('.', 1)[-1] if short else name}`"


class SphinxRoles(griffe.Extension):
    """Rewrites the roles of every docstring once the object tree is loaded."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(_code, obj.docstring.value)
