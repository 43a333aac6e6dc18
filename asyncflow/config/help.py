"""Every config field with its type, default and docstring: what ``asyncflow run --help`` lists.

Also the options of each task (``task.options``), from the tasks' config dataclasses, and the
defaults a task and its environment bring (their recipes, :mod:`asyncflow.config.sources`).

The docstrings are the string literals under each field in ``asyncflow/config.py``, read with
``ast`` from the source (Python keeps no runtime trace of them); types come from
``typing.get_type_hints`` and defaults from the dataclass fields, so the listing cannot drift
from the code.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import itertools
import sys
import textwrap
import typing
from dataclasses import dataclass
from typing import Any

from asyncflow.config.run import RunConfig
from asyncflow.config.sources import recipe_layers
from engines.tasks import TASKS, task_config_class

__all__ = ["FieldDoc", "field_docs", "fields_help"]


@dataclass(frozen=True)
class FieldDoc:
    """One config field: its dotted key, type, default and docstring."""

    key: str
    type: str
    default: str
    doc: str


def field_docs(cls: type[Any] = RunConfig, prefix: str = "") -> list[FieldDoc]:
    """Every leaf field of ``cls`` and its nested sections, in declaration order."""
    docs = _docstrings(cls)
    hints = typing.get_type_hints(cls)
    out: list[FieldDoc] = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hint) and isinstance(hint, type):
            out += field_docs(hint, key + ".")
            continue
        out.append(FieldDoc(key, _type_name(hint), _default(f), docs.get(f.name, "")))
    return out


def fields_help(width: int = 100) -> str:
    """The field listing as text, grouped by section, for an argparse epilog."""
    lines = [
        "config fields (defaults < the task's recipe < CONFIG.yaml < section.field=value "
        "overrides; values are YAML):"
    ]
    section = None
    for doc in field_docs():
        head = doc.key.split(".")[0] if "." in doc.key else ""
        if head != section:
            section = head
            lines.append("")
            if head:
                lines.append(f"{head}:")
        lines.append(f"  {doc.key} ({doc.type}) = {doc.default}")
        lines += _wrapped(doc.doc, width)
    for task in TASKS:
        lines += ["", f"task.options of task.name={task}:"]
        for label, keys in recipe_layers({"task": task}):
            brings = ", ".join(f"{key}={value}" for key, value in keys.items())
            lines += _wrapped(f"defaults it brings ({label}): {brings}", width)
        for doc in field_docs(task_config_class(task)):
            lines.append(f"  {doc.key} ({doc.type}) = {doc.default}")
            lines += _wrapped(doc.doc, width)
    return "\n".join(lines)


def _wrapped(doc: str, width: int) -> list[str]:
    text = " ".join(doc.split())
    indent = " " * 6
    return textwrap.wrap(
        text, width, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False
    )


@functools.cache
def _classes(module: str) -> dict[str, ast.ClassDef]:
    """The top-level classes of a module's source, parsed once."""
    tree = ast.parse(inspect.getsource(sys.modules[module]))
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


def _docstrings(cls: type[Any]) -> dict[str, str]:
    """Field name -> the string literal right under its annotated assignment."""
    class_def = _classes(cls.__module__).get(cls.__name__)
    body = class_def.body if class_def is not None else []
    out: dict[str, str] = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            out[node.target.id] = inspect.cleandoc(after.value.value)
    return out


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is None and isinstance(hint, type):
        return hint.__name__
    return str(hint).replace("typing.", "").replace("collections.abc.", "")


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    if isinstance(value, str):
        return repr(value)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)
