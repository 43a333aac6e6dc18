"""``asyncflow.run``: run a workflow to completion, starting what it needs as early as it can.

A run that starts a Ray cluster of its own (``deploy.mode=ray`` without ``deploy.address``)
starts it while the workflow's modules import (:mod:`asyncflow.deploy.ray_start`): the two
took turns before, about 2.5 s each on two cores. Every other run is
:func:`asyncflow.workflow.run` as it is. This module imports neither torch nor the engines.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from adapters.base import Adapter
    from asyncflow.build import Components, EngineFactories
    from asyncflow.config import RunConfig
    from asyncflow.workflow import RunResult

__all__ = ["run"]

_WORKFLOW_MODULES = ("asyncflow.workflow", "asyncflow.deploy.ray", "asyncflow.build")


def run(
    config: RunConfig,
    components: Components | None = None,
    *,
    factories: EngineFactories | None = None,
    adapters: dict[str, type[Adapter]] | None = None,
) -> RunResult:
    """Run a workflow to completion (blocking); see :class:`asyncflow.Workflow` for the
    arguments."""
    from asyncflow.deploy.ray_start import release_early, start_early

    if components is None:  # (given components: a local run, built by the caller)
        start_early(config, _WORKFLOW_MODULES)
    try:
        from asyncflow.workflow import run as run_workflow

        return run_workflow(config, components, factories=factories, adapters=adapters)
    finally:
        release_early()  # (a cluster no deployment took over: a run that failed before)
