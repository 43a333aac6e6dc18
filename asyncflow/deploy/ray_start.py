"""Starting Ray for a run: the same ``ray.init`` whenever it happens, and early.

A run with ``deploy.mode=ray`` and no ``deploy.address`` starts a Ray cluster of its own.
Ray's start (its GCS, raylet and agents: about 2.5 s on two cores, mostly spent waiting for
those processes) does not need the workflow's modules, and importing those (torch,
transformers, the engines: about as long) does not need Ray. :func:`asyncflow.run` does both
at once: :func:`start_early` starts Ray on the calling (main) thread while a thread imports
the workflow, and the deployment then takes the cluster over (:func:`take_early`), shutting
it down at its end as it does a cluster it started itself.

Ray is started on the main thread: it installs its signal handlers there, and the processes
it starts die with the thread that started them.

This module imports neither torch nor the engines.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import logging
import math
import os
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncflow.config import RunConfig

__all__ = [
    "QUIET_BLOCKING_GET",
    "START_GC_THRESHOLD",
    "cpus_asked",
    "fewer_collections",
    "init_ray",
    "release_early",
    "start_early",
    "take_early",
]

log = logging.getLogger(__name__)

QUIET_BLOCKING_GET = "RAY_WARN_BLOCKING_GET_INSIDE_ASYNC"
"""Ray's warning on a blocking ``ray.get`` inside an async actor: some stage hosts block on
purpose (their constructors), so a run turns it off in its hosts."""

START_GC_THRESHOLD = (50_000, 20, 20)
"""Python's GC thresholds while a process imports and builds its engines (the defaults are
700, 10, 10): importing torch and transformers allocates millions of objects that live as
long as the process, and collections over them were about a fifth of the CPU of importing
the HF engines (2.5 -> 2.05 s on the reference machine)."""

_early = False  # a cluster start_early started, not yet taken by a deployment
_IMPORT_BOUND_S = 600.0  # the importing thread (a hang is a bug: its join has a bound)


def cpus_asked(cfg: RunConfig) -> float:
    """CPU slots the config's actors ask for."""
    total = cfg.rollout.instances * cfg.rollout.placement.num_cpus
    if not cfg.reward.colocate:
        total += cfg.reward.instances * cfg.reward.placement.num_cpus
    total += cfg.train.dp_size * cfg.train.placement.num_cpus
    if cfg.reference.enabled:
        total += cfg.reference.instances * cfg.reference.placement.num_cpus
    return total


def init_ray(cfg: RunConfig) -> bool:
    """Start or join Ray as the run's config says (``deploy.address``: join that cluster;
    None: a cluster of the run's own, with enough logical CPUs for every actor the config
    asks for). False when Ray was running in this process already (the caller's)."""
    import ray

    if ray.is_initialized():
        return False
    dep = cfg.deploy
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if dep.address is None:  # (every worker of our cluster inherits it)
        os.environ.setdefault(QUIET_BLOCKING_GET, "0")
    num_cpus = dep.num_cpus
    if dep.address is None and num_cpus is None:
        num_cpus = max(os.cpu_count() or 1, math.ceil(cpus_asked(cfg)))
    ray.init(
        address=dep.address or "local",  # None: a cluster of our own, never a stranger's
        num_cpus=num_cpus if dep.address is None else None,
        include_dashboard=False,
        log_to_driver=True,
        _system_config=({"worker_niceness": dep.worker_niceness} if dep.address is None else None),
    )
    return True


@contextlib.contextmanager
def fewer_collections() -> Iterator[None]:
    """Collections rarer (:data:`START_GC_THRESHOLD`) inside the block, as before after it:
    around the imports and engine builds of a process's start."""
    previous = gc.get_threshold()
    gc.set_threshold(*START_GC_THRESHOLD)
    try:
        yield
    finally:
        gc.set_threshold(*previous)


def start_early(cfg: RunConfig, modules: Sequence[str]) -> bool:
    """For a run that starts a Ray cluster of its own, called on the main thread: start Ray
    there while a thread imports ``modules``. True when it started Ray (a deployment takes it
    over with :func:`take_early`; :func:`release_early` shuts down one left untaken). Does
    nothing for a local run, a cluster given by address, Ray already running, or another
    thread. An import that fails is left to fail again, and say so, where it is used."""
    global _early
    if cfg.deploy.mode != "ray" or cfg.deploy.address is not None:
        return False
    if threading.current_thread() is not threading.main_thread():
        return False
    import ray

    if ray.is_initialized():
        return False

    def load() -> None:
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception:  # (raised again where the module is imported for use)
                log.debug("early import of %s failed", name, exc_info=True)
                return

    importer = threading.Thread(target=load, name="asyncflow-imports", daemon=True)
    with fewer_collections():
        importer.start()
        try:
            _early = init_ray(cfg)
        finally:
            importer.join(_IMPORT_BOUND_S)
    return _early


def take_early() -> bool:
    """Whether a cluster :func:`start_early` started is waiting for a deployment to own it
    (the caller owns it from now: it shuts it down at its end)."""
    global _early
    taken, _early = _early, False
    return taken


def release_early() -> None:
    """Shut down a cluster :func:`start_early` started that no deployment took over."""
    if take_early():
        import ray

        ray.shutdown()
