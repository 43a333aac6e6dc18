"""Deployments of the workflow: ``local`` (one process) and ``ray`` (a Ray actor per stage
instance). See :mod:`asyncflow.deploy.base` for what the driver gets from either."""

from typing import TYPE_CHECKING

from transferqueue.lazy import lazy_names

if TYPE_CHECKING:
    from asyncflow.deploy.base import Deployment
    from asyncflow.deploy.local import LocalDeployment

__all__ = ["Deployment", "LocalDeployment"]

_LAZY = {"Deployment": "asyncflow.deploy.base", "LocalDeployment": "asyncflow.deploy.local"}
"""Imported on first use (PEP 562): the coordinator actor imports
:mod:`asyncflow.deploy.coordinator` without the deployments' engines."""


__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals())
