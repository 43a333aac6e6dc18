"""Public names of a package imported on first use (PEP 562).

A process that needs one part of a package (a controller, a unit, the coordinator of a Ray
deployment) should not pay for the imports of the others (torch and transformers among them:
seconds of CPU per Ray actor on a small machine). A package lists where each public name
lives and hands this module its namespace::

    __getattr__, __dir__ = lazy_names(__name__, {"Client": "pkg.client"}, globals())

The names stay visible to type checkers through ``if TYPE_CHECKING:`` imports beside it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(
    package: str, where: Mapping[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A module ``__getattr__`` that imports ``where[name]`` on first use and caches the name
    in ``namespace`` (later lookups never reach it), and the matching ``__dir__``."""

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(where))

    return __getattr__, __dir__
