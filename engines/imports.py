"""User objects named by import path (``module.path:attribute``): the resolution shared by the
reward and environment registries, with errors that name the path and what to change."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["MissingExtraError", "import_path", "require"]


def import_path(path: str, what: str, *, target: str, example: str) -> Any:
    """The object at ``path`` (``'module.path:attribute'``, the attribute may be dotted).

    ``what`` names the registry in errors (``'reward'``), ``target`` the attribute's kind in the
    format hint (``'function'``) and ``example`` a valid path. Raises ``ValueError`` naming
    ``path``: a malformed path, a module that is missing or fails to import (its exception in
    one line), or an attribute the module lacks (listing what it defines)."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute or ":" in attribute:
        raise ValueError(
            f"{what} import path {path!r} must look like 'module.path:{target}', e.g. {example!r}"
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ValueError(
            f"{what} {path!r}: no module named {e.name!r}; put the module's folder on "
            "PYTHONPATH or install its package"
        ) from None
    except Exception as e:  # the user's module itself failed: say so, in one line
        raise ValueError(
            f"{what} {path!r}: importing {module_name!r} failed: {type(e).__name__}: {e}"
        ) from None
    obj: Any = module
    for part in attribute.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(module) if not n.startswith("_"))
            raise ValueError(
                f"{what} {path!r}: {module_name!r} has no attribute {attribute!r}; it defines "
                f"{public}"
            )
        obj = getattr(obj, part)
    return obj


class MissingExtraError(ImportError):
    """An optional extra is not installed; the message is the ``pip install`` line to type."""


def require(module: str, *, extra: str, what: str) -> Any:
    """Import ``module`` of the optional extra ``extra``, or raise :class:`MissingExtraError`
    in one line: what needs it and the ``pip install`` to type."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingExtraError(
            f"{what} needs {e.name or module}: pip install 'asyncflow[{extra}]'"
        ) from None
