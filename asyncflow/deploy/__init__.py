"""Deployments of the workflow: ``local`` (one process) and ``ray`` (a Ray actor per stage
instance). See :mod:`asyncflow.deploy.base` for what the driver gets from either."""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncflow.deploy.base import Deployment
    from asyncflow.deploy.local import LocalDeployment

__all__ = ["Deployment", "LocalDeployment"]

_LAZY = {"Deployment": "asyncflow.deploy.base", "LocalDeployment": "asyncflow.deploy.local"}
"""Imported on first use (PEP 562): the coordinator actor imports
:mod:`asyncflow.deploy.coordinator` without the deployments' engines."""


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'asyncflow.deploy' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
