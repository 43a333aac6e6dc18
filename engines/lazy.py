"""Public names of an engines package imported on first use (PEP 562).

A process that needs one part of ``engines`` (the config's task and reward names, a reward
worker's text helpers) should not pay for torch or the model code. A package lists where each
name lives::

    __getattr__, __dir__ = lazy_names(__name__, {"Generation": "engines.protocols"}, globals())

``engines`` imports nothing of ``transferqueue`` (which has the same helper for its own
packages), so it keeps its own.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(
    package: str, where: Mapping[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for the package ``package``: a name of ``where``
    imports its module on first use and is kept in ``namespace``."""

    def getattr_(name: str) -> Any:
        try:
            module = where[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        namespace[name] = value = getattr(importlib.import_module(module), name)
        return value

    def dir_() -> list[str]:
        return sorted({*namespace, *where})

    return getattr_, dir_
