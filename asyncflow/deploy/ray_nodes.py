"""A Ray node lost under a running ``deploy=ray`` job: what keeps the run going.

Every actor of a node dies at once when the node goes (its raylet and worker processes end
with it). What each costs, and who brings it back:

| on the lost node        | at once                                | back                        |
|-------------------------|----------------------------------------|-----------------------------|
| a generator             | its calls fail over to the other       | Ray restarts it where its   |
|                         | instances (``InstanceLostError``)      | placement's resources are   |
|                         |                                        | (a node that joins later);  |
|                         |                                        | it takes batches once it    |
|                         |                                        | holds recent weights        |
| a reward / reference    | its leased rows return to their task   | Ray restarts it, as above   |
| worker                  | as its heartbeat stops (seconds)       |                             |
| a storage unit          | reads of its rows go to their second   | Ray restarts it empty, as   |
|                         | copy (``transferqueue.replicas=2``;    | above; it takes new rows    |
|                         | with one copy: those groups are        |                             |
|                         | regenerated)                           |                             |
| the driver's node       | the run ends (the driver is the run's  | ``asyncflow run --resume``  |
|                         | single controller)                     |                             |

The driver's own helpers (the coordinator, TransferQueue's controller, the rollout
dispatcher) are placed on the driver's node (:func:`on_driver_node`), so that no other
node's loss takes them.

A restart waits for resources: Ray keeps a dead actor pending until a node can take it,
without bound, and queues the calls made to it meanwhile. So the rollout routes nothing to a
generator the driver saw die (``RolloutScaler.lost``) until it registers again, and bounds its
own wait for a version on one (``RemoteGenerator.wait_version``); the driver's wait for the
restart is bounded (:func:`until_alive`, ``deploy.start_timeout_s``), each of its pings too;
a generator that does not come back within it leaves the run
while other instances remain (``RolloutScaler.drop``), any other host ends the run with an
error naming it and the resources Ray could not find.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from transferqueue.aio import within

__all__ = ["NotBackError", "on_driver_node", "until_alive"]

PING_S = 5.0
"""Bound of one ping of a host Ray is restarting (a call to an actor not placed yet waits)."""


class NotBackError(RuntimeError):
    """A stage host that died did not come back: dead for good, or not placed in time."""


def driver_node() -> str:
    """The Ray node id (hex) of this process (the driver)."""
    import ray

    return str(ray.get_runtime_context().get_node_id())


def on_driver_node(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` pinned to the driver's node (and restarted there). Hard: with a soft
    affinity Ray 2.60 spilled the coordinator of a test run to another node although the
    driver's had room (it asks for nothing), and that node's loss ended the run."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    strategy = NodeAffinitySchedulingStrategy(driver_node(), soft=False)
    return {**options, "scheduling_strategy": strategy}


async def until_alive(name: str, host: Any, cause: BaseException, bound_s: float) -> None:
    """Until Ray has restarted ``host`` (it answers a ping); :class:`NotBackError` after
    ``bound_s`` (it waits for resources no live node has) or when Ray will not restart it
    (its restarts spent, or pinned to a node that is gone)."""
    import ray

    deadline = time.monotonic() + bound_s
    while True:
        left = deadline - time.monotonic()
        try:
            await within(host.ping.remote(), max(0.1, min(PING_S, left)))
            return
        except (ray.exceptions.ActorUnavailableError, TimeoutError):  # restarting: not yet
            if time.monotonic() >= deadline:
                raise NotBackError(
                    f"stage host {name!r} died and did not come back within "
                    f"deploy.start_timeout_s={bound_s:g}: Ray found no node with the resources "
                    f"its placement asks for (available: {_available()}); add a node that has "
                    "them or lower the stage's placement"
                ) from cause
            await asyncio.sleep(0.5)
        except ray.exceptions.RayActorError as e:  # dead for good
            raise NotBackError(f"stage host {name!r} died and Ray will not restart it: {e}") from (
                cause
            )


def _available() -> str:
    """Ray's free resources, for an error message (a driver that left Ray: unknown)."""
    import ray

    try:
        return str(ray.available_resources())
    except Exception:
        return "unknown"
