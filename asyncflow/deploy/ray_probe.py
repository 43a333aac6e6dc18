"""``deploy=ray``: the driver's progress probes of the stage hosts, and the replacement of a
stalled one (:mod:`asyncflow.stall` judges; this part asks and acts).

Each host actor answers ``progress`` on a concurrency group of its own
(:data:`~asyncflow.deploy.ray_hosts.PROBE_GROUP`: its own thread and event loop), so a host
whose stage loop is busy or blocked still answers, with the Python stacks of its threads when
asked; one that does not answer at all is frozen (SIGSTOP, a swapping host) or blocks every
thread. At most one probe per host is in flight, asked again when it has not answered in
:data:`RESEND_S` (then less and less often): a silent host is never sent a pile of them.

| event                       | what the probes do                                         |
|-----------------------------|------------------------------------------------------------|
| a probe answers             | its answer and the time are the host's last heard          |
| the host dies               | its probe fails; the driver's restart path marks it        |
|                             | restarting (:meth:`HostProbes.restarting`): not judged     |
|                             | until its replacement runs, then heard from afresh         |
| :meth:`HostProbes.replace`  | SIGKILL to its process when it is on the driver's node (a |
|                             | frozen process cannot act on Ray's own kill request), else |
|                             | ``ray.kill`` with its restart kept; Ray restarts it, and   |
|                             | its replacement hands back the leases it held at once      |
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from asyncflow.deploy.ray_hosts import PROBE_GROUP
from asyncflow.stall import Probe
from transferqueue.aio import within

__all__ = ["PROBE_OPTIONS", "HostProbes"]

log = logging.getLogger(__name__)

PROBE_OPTIONS: dict[str, Any] = {"concurrency_groups": {PROBE_GROUP: 1}}
"""``ray.remote`` options of every stage host class (its probe's group; Ray takes concurrency
groups there, not in ``.options()``)."""

_Heard = tuple[dict[str, Any] | None, float]

RESEND_S = 5.0
"""A probe not answered in this long is asked again (then after twice as long, and so on up
to :data:`RESEND_MAX_S`): a probe lost on its way never leaves a live host unheard."""
RESEND_MAX_S = 60.0


@dataclass
class _Asking:
    future: asyncio.Future[_Heard]
    sent_at: float
    wait_s: float


class HostProbes:
    """The driver's probes of the hosts ``named()`` returns (name, actor handle)."""

    def __init__(
        self, named: Callable[[], list[tuple[str, Any]]], replaceable: Callable[[str], bool]
    ) -> None:
        self._named = named
        self._replaceable = replaceable
        self._asking: dict[str, _Asking] = {}
        self._heard: dict[str, _Heard] = {}
        self._restarting: set[str] = set()
        self._failed: set[str] = set()

    def progress(self) -> dict[str, Probe]:
        """Every host not restarting, as last heard; a new probe sent to each host whose last
        one has answered, or has not within its wait (:data:`RESEND_S`, doubling)."""
        now = time.monotonic()
        out: dict[str, Probe] = {}
        for name, actor in self._named():
            if name in self._restarting:
                continue
            asking = self._asking.get(name)
            if asking is not None and asking.future.done():
                del self._asking[name]
                self._take(name, asking.future)
                asking = None  # (answered: the next probe gets the first wait again)
            elif asking is not None and now - asking.sent_at > asking.wait_s:
                # (a probe lost or queued behind a frozen process: asked again, less often
                # each time, so a frozen host finds only a few probes queued when it wakes)
                asking.future.cancel()
                del self._asking[name]
            if name not in self._asking:
                wait_s = RESEND_S if asking is None else min(2 * asking.wait_s, RESEND_MAX_S)
                future = asyncio.ensure_future(_ask(actor, False))
                self._asking[name] = _Asking(future, now, wait_s)
            answer, at = self._heard.setdefault(name, (None, now))
            out[name] = Probe(answer, max(0.0, now - at), self._replaceable(name))
        return out

    def _take(self, name: str, future: asyncio.Future[_Heard]) -> None:
        """Record ``name``'s answer; a failed probe is said once (until the host answers)."""
        if future.cancelled():
            return
        if future.exception() is None:
            self._heard[name] = future.result()
            self._failed.discard(name)
        elif name not in self._failed:
            import ray

            self._failed.add(name)
            e = future.exception()
            # (a host that died is the restart path's to tell; any other failure is a cause)
            level = logging.INFO if isinstance(e, ray.exceptions.RayActorError) else logging.WARNING
            log.log(level, "the progress probe of stage host %r failed: %r", name, e)

    async def stacks(self, host: str, timeout_s: float) -> dict[str, Any] | None:
        actor = dict(self._named()).get(host)
        if actor is None:
            return None
        try:
            answer, _ = await within(_ask(actor, True), timeout_s)
        except Exception:  # (no answer in time, or the host died meanwhile)
            return None
        return answer

    async def replace(self, host: str) -> bool:
        """Kill ``host`` so that Ray restarts it (see the module doc)."""
        import ray

        actor = dict(self._named()).get(host)
        if actor is None or not self._replaceable(host):
            return False
        answer = self._heard.get(host, (None, 0.0))[0]
        here = ray.get_runtime_context().get_node_id()
        if answer is not None and answer.get("node") == here:
            try:
                os.kill(int(answer["pid"]), signal.SIGKILL)
                return True
            except ProcessLookupError:  # (gone already: Ray restarts it)
                return True
            except PermissionError:
                pass
        ray.kill(actor, no_restart=False)
        return True

    @contextlib.contextmanager
    def restarting(self, host: str) -> Iterator[None]:
        """``host`` is being restarted meanwhile: not judged, and heard from afresh after."""
        self._restarting.add(host)
        try:
            yield
        finally:
            self._restarting.discard(host)
            self._heard.pop(host, None)
            asking = self._asking.pop(host, None)
            if asking is not None:
                asking.future.cancel()

    def is_restarting(self, host: str) -> bool:
        """Whether the driver waits for Ray to restart ``host`` now (a call to it would wait
        as long: Ray queues calls to an actor it has not placed again)."""
        return host in self._restarting

    def close(self) -> None:
        for asking in self._asking.values():
            asking.future.cancel()
        self._asking.clear()


async def _ask(actor: Any, stacks: bool) -> _Heard:
    answer = await actor.progress.options(concurrency_group=PROBE_GROUP).remote(stacks)
    return answer, time.monotonic()
