"""Deployments of the workflow: ``local`` (one process) and ``ray`` (a Ray actor per stage
instance). See :mod:`asyncflow.deploy.base` for what the driver gets from either."""

from asyncflow.deploy.base import Deployment
from asyncflow.deploy.local import LocalDeployment

__all__ = ["Deployment", "LocalDeployment"]
