"""The layers a run's config is built from, and which one each value came from.

Lowest first; a layer sets only the keys it names, and a higher one wins:

| layer        | what it holds                                              | label              |
|--------------|------------------------------------------------------------|--------------------|
| defaults     | the dataclass fields' defaults (``asyncflow.config``)      | ``default``        |
| environment  | the ``recipe`` of the run's environment (``engines.envs``) | ``environment NAME`` |
| task         | the ``recipe`` of ``task.name`` (``engines.tasks``)        | ``task NAME``      |
| file         | the YAML config file                                       | ``file PATH``      |
| command line | ``section.field=value`` overrides                          | ``command line``   |

A recipe (:class:`engines.recipe.Recipe`) is what a task or an environment needs to learn,
in the engines' terms; :data:`RECIPE_KEYS` maps it to config keys. The task and the
environment are the ones the file and the command line name (or the defaults'), so
``asyncflow run task=tool_use`` runs with the calculator's turn length and the task's warm
start, and ``rollout.max_new_tokens=8`` on the same line still wins. The loader
(:func:`asyncflow.config.load.load_config_sources`) builds the layers with :func:`merge` and
labels every leaf key; ``asyncflow config`` prints them with :func:`annotated_yaml`.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import yaml

from asyncflow.config.run import RunConfig
from asyncflow.config.sections import TaskConfig
from engines.envs import environment_recipe
from engines.recipe import Recipe
from engines.tasks import TASKS, task_class

__all__ = [
    "COMMAND_LINE",
    "DEFAULT",
    "PRESETS",
    "RECIPE_KEYS",
    "annotated_yaml",
    "leaf_keys",
    "merge",
    "recipe_layers",
    "section_value",
    "set_key",
    "touched",
]

DEFAULT = "default"
"""The source of a value no layer set."""
COMMAND_LINE = "command line"
"""The source of a value an override set."""

RECIPE_KEYS: dict[str, str] = {
    "max_new_tokens": "rollout.max_new_tokens",
    "max_turns": "rollout.max_turns",
    "max_episode_tokens": "rollout.max_episode_tokens",
    "warm_start_steps": "model.warm_start_steps",
    "train_steps": "train.steps",
}
"""Each field of :class:`engines.recipe.Recipe` and the config key it sets."""


def _shorthand(section: type[Any]) -> str | None:
    """The field a section's shorthand sets: ``mode`` or ``name`` (None: it has none)."""
    names = {f.name for f in dataclasses.fields(section)}
    return next((name for name in ("mode", "name") if name in names), None)


def section_value(section: type[Any], value: Any) -> Any:
    """``value`` given for a whole section, with the shorthands spelled out: ``deploy=ray`` is
    ``deploy.mode=ray``, ``task=tool_use`` is ``task.name=tool_use``."""
    field = _shorthand(section)
    if isinstance(value, str) and field is not None:
        return {field: value}
    return value


_SECTIONS: dict[type[Any], dict[str, type[Any] | None]] = {}


def set_key(data: dict[str, Any], parts: list[str], value: Any, cls: type[Any] | None) -> None:
    """Set the dotted key ``parts`` of the nested mapping ``data`` (fields of ``cls``; None
    below a value field, e.g. inside ``task.options``) to ``value``, an override's meaning: a
    section reached on the way that holds a shorthand (``task: file``) becomes its mapping
    (``{name: file}``), and a section set as a whole (a shorthand or a mapping) is merged into
    what is there, field by field (:func:`merge`). ValueError names the key that is not a
    section."""
    sections = _sections(cls) if cls is not None else {}
    head, rest = parts[0], parts[1:]
    section = sections.get(head)
    if not rest:
        below = data.get(head)
        if section is not None:
            value = section_value(section, value)
            below = section_value(section, below)
            if isinstance(value, dict) and isinstance(below, dict):
                value = merge(below, value, section)
        data[head] = value
        return
    node = data.get(head)
    if section is not None:
        node = section_value(section, node)
    if node is None:
        node = {}
    if not isinstance(node, dict):
        raise ValueError(f"{head!r} is {node!r}, not a section or a mapping")
    data[head] = node
    set_key(node, rest, value, section)


def _sections(cls: type[Any]) -> dict[str, type[Any] | None]:
    """Field name -> its section's dataclass, or None for a value field (read once a class)."""
    if cls in _SECTIONS:
        return _SECTIONS[cls]
    hints = typing.get_type_hints(cls)
    _SECTIONS[cls] = {
        f.name: hint
        if dataclasses.is_dataclass(hint := hints[f.name]) and isinstance(hint, type)
        else None
        for f in dataclasses.fields(cls)
    }
    return _SECTIONS[cls]


PRESETS: dict[str, str] = {
    f.name: field
    for f in dataclasses.fields(RunConfig)
    if (section := _sections(RunConfig)[f.name]) is not None
    and (field := _shorthand(section)) is not None
}
"""The sections with a shorthand (``task=NAME`` for ``task.name=NAME``, ``deploy=ray`` for
``deploy.mode=ray``) and the field it sets; the section's other fields compose with it, in
either order on the command line (:func:`set_key`)."""


def merge(lower: dict[str, Any], upper: dict[str, Any], cls: type[Any]) -> dict[str, Any]:
    """``upper`` laid over ``lower``, both nested mappings of ``cls``'s fields: sections merge
    field by field, a value field (a dict-valued one too, e.g. ``task.options``) is replaced
    whole. Keys ``cls`` lacks are kept as given, for the loader to refuse by name."""
    out = dict(lower)
    sections = _sections(cls)
    for key, value in upper.items():
        section = sections.get(key)
        if section is None:
            out[key] = value
            continue
        value = section_value(section, value)
        below = out.get(key)
        if isinstance(value, dict) and isinstance(below, dict):
            out[key] = merge(below, value, section)
        else:
            out[key] = value
    return out


def touched(data: dict[str, Any], cls: type[Any], prefix: str = "") -> set[str]:
    """The dotted leaf keys of ``cls`` that the nested mapping ``data`` sets (a section given
    whole, e.g. ``train={steps: 5}``, sets the fields it names; unknown keys are skipped)."""
    out: set[str] = set()
    sections = _sections(cls)
    for key, value in data.items():
        if key not in sections:
            continue
        section = sections[key]
        if section is None:
            out.add(f"{prefix}{key}")
            continue
        value = section_value(section, value)
        if isinstance(value, dict):
            out |= touched(value, section, f"{prefix}{key}.")
    return out


def leaf_keys(cls: type[Any], prefix: str = "") -> list[str]:
    """Every dotted leaf key of ``cls`` and its sections, in declaration order."""
    out: list[str] = []
    for key, section in _sections(cls).items():
        if section is None:
            out.append(f"{prefix}{key}")
        else:
            out += leaf_keys(section, f"{prefix}{key}.")
    return out


def _named(data: dict[str, Any], section: str) -> Any:
    value = data.get(section)
    if isinstance(value, dict):
        return value.get("name")
    return value


def recipe_layers(data: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The recipes under a file's and the command line's ``data`` (their merged mapping): the
    environment's, then the task's, each as ``(label, {config key: value})``.

    The task is ``task.name`` as ``data`` gives it (else the default); the environment is
    ``env.name``, or the task's own. A name that is not a task, or an environment that does
    not import, brings no recipe: the loader and :func:`asyncflow.config.check.check_config`
    refuse it with its own error.
    """
    task = _named(data, "task")
    if task is None:
        task = TaskConfig().name
    if not isinstance(task, str) or task not in TASKS:
        return []
    cls = task_class(task)
    env = _named(data, "env")
    if env is None:
        env = cls.environment
    layers: list[tuple[str, dict[str, Any]]] = []
    if isinstance(env, str) and env and env != "none":
        try:
            recipe = environment_recipe(env)
        except ValueError:
            recipe = Recipe()
        layers.append((f"environment {env}", _keys(recipe)))
    layers.append((f"task {task}", _keys(cls.recipe)))
    return [(label, keys) for label, keys in layers if keys]


def _keys(recipe: Recipe) -> dict[str, Any]:
    return {RECIPE_KEYS[name]: value for name, value in recipe.items().items()}


def nested(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"a.b": 1}`` -> ``{"a": {"b": 1}}``."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *heads, last = key.split(".")
        node = out
        for head in heads:
            node = node.setdefault(head, {})
        node[last] = value
    return out


def annotated_yaml(cfg: Any, sources: dict[str, str]) -> str:
    """``cfg`` as YAML, each value followed by a comment naming its source (``sources``:
    dotted key -> label). Loading the text gives :func:`dataclasses.asdict` of ``cfg``."""
    rows: list[tuple[str, str]] = []  # (the YAML line, its source or "" for a section)

    def walk(obj: Any, prefix: str, depth: int) -> None:
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            indent = "  " * depth
            if dataclasses.is_dataclass(value):
                rows.append((f"{indent}{f.name}:", ""))
                walk(value, f"{prefix}{f.name}.", depth + 1)
            else:
                key = f"{prefix}{f.name}"
                rows.append((f"{indent}{f.name}: {_flow(value)}", sources.get(key, DEFAULT)))

    walk(cfg, "", 0)
    width = min(48, max(len(line) for line, source in rows if source))
    head = "# where each value comes from: default < environment < task < file < command line"
    lines = [head] + [
        f"{line.ljust(width)}  # {source}" if source else line for line, source in rows
    ]
    return "\n".join(lines) + "\n"


def _flow(value: Any) -> str:
    """One value as one line of YAML (lists and mappings in flow style)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 30, sort_keys=False)
    return text.strip().removesuffix("...").strip()
