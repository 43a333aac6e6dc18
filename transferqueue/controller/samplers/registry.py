"""The sampler registry: a dict filled by one decorator."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from transferqueue.controller.samplers.base import Sampler

__all__ = ["get_sampler", "register_sampler", "sampler_names"]

_SAMPLERS: dict[str, type[Sampler]] = {}
S = TypeVar("S", bound="type[Sampler]")


def register_sampler(name: str) -> Callable[[S], S]:
    """Class decorator: make a :class:`Sampler` subclass available under ``name``."""

    def deco(cls: S) -> S:
        if name in _SAMPLERS:
            raise ValueError(f"sampler {name!r} is already registered ({_SAMPLERS[name]})")
        cls.name = name
        _SAMPLERS[name] = cls
        return cls

    return deco


def get_sampler(name: str) -> type[Sampler]:
    try:
        return _SAMPLERS[name]
    except KeyError:
        raise ValueError(
            f"unknown sampler {name!r}; known samplers: {', '.join(sorted(_SAMPLERS))}"
        ) from None


def sampler_names() -> list[str]:
    return sorted(_SAMPLERS)
