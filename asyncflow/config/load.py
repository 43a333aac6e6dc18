"""Loading a run's configuration: defaults, then the recipe of the run's environment and
task, then a YAML file, then ``key=value`` overrides, into :class:`~asyncflow.config.RunConfig`
(the layers: :mod:`asyncflow.config.sources`), with one-line :class:`ConfigError` messages that
name the key and the fix (unknown keys with the closest names, wrong types with an example).
The sections and their own checks are in :mod:`asyncflow.config`.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from asyncflow.config.run import RunConfig
from asyncflow.config.sections import RENAMED_KEYS, ConfigError
from asyncflow.config.sources import (
    COMMAND_LINE,
    DEFAULT,
    leaf_keys,
    merge,
    nested,
    recipe_layers,
    section_value,
    set_key,
    touched,
)

__all__ = [
    "apply_overrides",
    "config_to_dict",
    "load_config",
    "load_config_sources",
    "read_config_file",
]


# -- loading -----------------------------------------------------------------------------------
def _build(cls: type[Any], data: dict[str, Any], where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(
            f"{where or 'config'} must be a mapping of its fields (e.g. {where or 'train'}: "
            f"{{...}} in YAML, {where or 'train'}.FIELD=value on the command line), got {data!r}"
        )
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        renamed = RENAMED_KEYS.get(f"{where}.{key}".lstrip("."))
        if renamed:
            raise ConfigError(renamed)
    unknown = set(data) - names
    if unknown:
        keys = sorted(map(str, unknown))
        close = [m for k in keys for m in difflib.get_close_matches(k, names, n=1)]
        guess = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        raise ConfigError(
            f"unknown key(s) {keys} in {where or 'config'}; valid keys: {sorted(names)}{guess}"
        )
    kwargs = {}
    defaults = {f.name: f for f in dataclasses.fields(cls)}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint) and isinstance(hint, type):
            value = section_value(hint, value)  # ``deploy=ray`` is ``deploy.mode=ray``
            # a partial section starts from the field's own default (e.g. a placement whose
            # default differs from the class defaults), not from the bare class
            factory = defaults[name].default_factory
            base = factory() if factory is not dataclasses.MISSING else None
            if base is not None and isinstance(value, dict):
                value = {**_shallow(base), **value}
            kwargs[name] = _build(hint, value, f"{where}.{name}".lstrip("."))
        else:
            kwargs[name] = _coerce(value, hint, f"{where}.{name}".lstrip("."))
    return cls(**kwargs)


def _shallow(obj: Any) -> dict[str, Any]:
    """A dataclass's fields as a dict, nested dataclasses left as dicts of their fields."""
    return {
        f.name: _shallow(v) if dataclasses.is_dataclass(v := getattr(obj, f.name)) else v
        for f in dataclasses.fields(obj)
    }


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Light type checking of YAML scalars (int given for float is fine)."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where)
            except ValueError:
                continue
        raise ConfigError(
            f"{where}: {value!r} does not match {_type_name(hint)}; give {where} a value of "
            "that type"
        )
    if hint is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):
        try:  # YAML 1.1 reads "2e-5" (no dot) as a string
            return float(value)
        except ValueError:
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if hint is float and not isinstance(value, float):
        raise ConfigError(f"{where}: expected a number, got {value!r}; write {where}=0.5")
    if hint in (int, str, bool) and type(value) is not hint:
        example = {int: "8", str: "text", bool: "true"}[hint]
        raise ConfigError(
            f"{where}: expected {hint.__name__}, got {value!r}; write e.g. {where}={example}"
        )
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}; write {where}=[a,b]")
        (item,) = args
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict and not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping, got {value!r}; write {where}={{k: v}}")
    return value


def _type_name(hint: Any) -> str:
    return str(hint).replace("typing.", "") if typing.get_origin(hint) else hint.__name__


def config_to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b=value`` overrides (values parsed as YAML) to a nested dict, in order.

    A section's shorthand (``task=file``, ``env=openenv``, ``deploy=ray``: :data:`~asyncflow.
    config.sources.PRESETS`) sets only that section's name or mode: fields of the section set
    before it (``task.options=...``) stay, and fields after it apply on top
    (``task=file task.options.path=x``). A section given whole (``train={steps: 5}``) sets the
    fields it names; a value field given whole (``task.options={...}``) is replaced whole, and a
    dotted key into one (``task.options.path=x``) sets that entry.
    """
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.field=value")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as e:
            raise ConfigError(
                f"override {item!r}: the value is not valid YAML ({_yaml_problem(e)}); quote "
                "text with special characters, e.g. key='a: b'"
            ) from None
        try:
            set_key(data, key.strip().split("."), value, RunConfig)
        except ValueError as e:
            raise ConfigError(f"override {item!r}: {e}") from None
    return data


def _yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error in one line: the problem and where."""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{problem}{where}"


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML config file; :class:`ConfigError` if missing or malformed."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(
            f"config file {str(path)!r} not found; pass an existing YAML file, or only "
            "section.field=value overrides"
        ) from None
    except OSError as e:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {e.strerror}") from None
    try:
        loaded = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(
            f"{path}: malformed YAML ({_yaml_problem(e)}); fix the file's syntax"
        ) from None
    if not isinstance(loaded, dict):
        raise ConfigError(
            f"{path}: the top level of a config file must be a mapping of sections (e.g. "
            f"'train: {{steps: 80}}'), got {type(loaded).__name__}"
        )
    return loaded


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Defaults, then the recipes of the run's environment and task, then the YAML file (if
    any), then the overrides."""
    return load_config_sources(path, overrides)[0]


def load_config_sources(
    path: str | Path | None = None, overrides: list[str] | None = None
) -> tuple[RunConfig, dict[str, str]]:
    """:func:`load_config`, and where each value came from: dotted leaf key -> ``default``,
    ``environment NAME``, ``task NAME``, ``file PATH`` or ``command line`` (the highest
    layer that set it; see :mod:`asyncflow.config.sources`). ``asyncflow config`` prints both.
    """
    overrides = overrides or []
    given = read_config_file(path) if path is not None else {}
    data = apply_overrides(copy.deepcopy(given), overrides)  # the file under the overrides
    layers = recipe_layers(data)
    base: dict[str, Any] = {}
    for _, keys in layers:  # the environment's, then the task's over it
        base = merge(base, nested(keys), RunConfig)
    cfg: RunConfig = _build(RunConfig, merge(base, data, RunConfig), "")
    sources = dict.fromkeys(leaf_keys(RunConfig), DEFAULT)
    for label, keys in layers:
        sources.update(dict.fromkeys(keys, label))
    sources.update(dict.fromkeys(touched(given, RunConfig), f"file {path}"))
    sources.update(dict.fromkeys(touched(apply_overrides({}, overrides), RunConfig), COMMAND_LINE))
    return cfg, sources
