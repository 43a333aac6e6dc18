"""The one message of every registry for a name it does not hold: the closest names that exist
(:func:`difflib.get_close_matches`), then the names themselves, or how many there are where
they are too many for one line."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["closest", "unknown_name"]

_LISTED = 20
"""Registries up to this size are listed whole in the message."""


def closest(name: str, known: Iterable[str], n: int = 3) -> list[str]:
    """Up to ``n`` names of ``known`` closest to ``name``, best first (none when nothing is
    near: difflib's ratio under 0.6)."""
    return difflib.get_close_matches(name, list(known), n=n)


def unknown_name(kind: str, name: str, known: Iterable[str], *, other: str = "") -> str:
    """``unknown KIND 'NAME' (closest: 'A', 'B'); known KINDs: [...]`` (``other``: what
    else is accepted, e.g. ``, or an import path 'module.path:attribute'``)."""
    names = sorted(known)
    near = closest(name, names)
    guess = f" (closest: {', '.join(map(repr, near))})" if near else ""
    listed = (
        str(names)
        if len(names) <= _LISTED
        else f"{len(names)} names, from {names[0]!r} to {names[-1]!r}"
    )
    return f"unknown {kind} {name!r}{guess}; known {kind}s: {listed}{other}"
