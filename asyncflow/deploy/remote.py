"""The Ray side of shared state: the coordinator actor and the proxies that call it.

:class:`Coordinator` is the generator :class:`~asyncflow.registry.Registry` plus the inbox of
step reports. It runs as one async Ray actor (``ray.remote`` is applied in
``asyncflow.deploy.ray``), because stage hosts on other nodes must report to and wait on one
shared state, and a Ray actor cannot call back into the driver. The driver stays the single
controller: it reads the coordinator (admission control, step reports) and decides.

:class:`RemoteRegistry` gives the coordinator the registry's own async interface (what the
feeder and the generator hosts already call), so those run unchanged in both deployments;
:class:`RemoteGenerator` is a generation instance in another actor as the rollout adapter
sees it. Every remote call either returns, raises ``RayActorError`` when the actor died, or
is a long poll with its own ``timeout_s``: none can hang.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
from collections.abc import Sequence
from typing import Any

import torch

from adapters import InstanceLostError, StepReport
from asyncflow.registry import Snapshot, WeightSync
from engines.packed import pack_prompts, unpack_generations
from engines.protocols import Generation, SamplingParams
from transferqueue.aio import within

__all__ = ["GeneratorView", "RemoteGenerator", "RemoteRegistry"]

log = logging.getLogger(__name__)

LOST_WAIT_S = 0.05
"""How long a wait on a generator host that died or failed lasts before it says no."""
CALL_SLACK_S = 2.0
"""A bounded call's time to reach its host and come back, beyond the host's own bound."""


class RemoteRegistry:
    """The coordinator actor behind the registry's async methods."""

    def __init__(self, handle: Any) -> None:
        self._h = handle
        self._demanded = -1  # the newest version this proxy demanded

    async def register(self, name: str, version: int) -> int:
        return int(await self._h.register.remote(name, version))

    async def unregister(self, name: str) -> None:
        await self._h.unregister.remote(name)

    async def report(
        self,
        name: str,
        *,
        version: int | None = None,
        in_flight: int | None = None,
        drain_tokens: int | None = None,
        running: int | None = None,
        received: int | None = None,
    ) -> None:
        await self._h.report.remote(
            name,
            version=version,
            in_flight=in_flight,
            drain_tokens=drain_tokens,
            running=running,
            received=received,
        )

    async def wait_update(self, name: str, timeout_s: float) -> int | None:
        result = await self._h.wait_update.remote(name, timeout_s)
        return None if result is None else int(result)

    async def updated(
        self,
        name: str,
        version: int,
        seconds: float,
        *,
        transfer_s: float = 0.0,
        pause_s: float = 0.0,
        kept_tokens: int = 0,
    ) -> None:
        await self._h.updated.remote(
            name,
            version,
            seconds,
            transfer_s=transfer_s,
            pause_s=pause_s,
            kept_tokens=kept_tokens,
        )

    async def update_failed(self, name: str) -> None:
        await self._h.update_failed.remote(name)

    async def publish(self, version: int) -> None:
        await self._h.publish.remote(version)

    async def admission_view(self) -> tuple[int, int, int]:
        newest, published, changes = await self._h.admission_view.remote()
        return int(newest), int(published), int(changes)

    async def filter_groups(self, groups: list[int]) -> None:
        await self._h.filter_groups.remote(list(groups))

    async def filtered_count(self) -> int:
        return int(await self._h.filtered_count.remote())

    def demand(self, version: int) -> None:
        """Fire and forget: routing code calls it as a plain callback. A version this proxy
        demanded already is not sent again (the registry's demand only ever rises, and its
        loads and reports wake the update decision themselves)."""
        if version <= self._demanded:
            return
        self._demanded = version
        self._h.demand.remote(version)

    async def wait_changed(self, seen: int, timeout_s: float) -> tuple[int, int, int]:
        newest, published, changes = await self._h.wait_changed.remote(seen, timeout_s)
        return int(newest), int(published), int(changes)

    async def watch(self, seq: int, timeout_s: float) -> tuple[int, dict[str, Snapshot]]:
        result: tuple[int, dict[str, Snapshot]] = await self._h.watch.remote(seq, timeout_s)
        return result

    async def step_done(self, report: StepReport) -> None:
        # pickled here and unpickled by the driver: the coordinator only holds the bytes, so
        # its process never imports the adapters (and torch) to read a report
        await self._h.step_done.remote(pickle.dumps(report), report.step, report.next_group)

    async def train_position(self) -> tuple[int, int | None]:
        """Where a replaced trainer rank 0 goes on (the coordinator's ``stats``)."""
        step, group = (await self.stats())["train_position"]
        return int(step), None if group is None else int(group)

    async def next_step(
        self, timeout_s: float, syncs_after: int
    ) -> tuple[StepReport | None, list[WeightSync], int]:
        """The next step report (None after ``timeout_s``) and the weight syncs after the
        first ``syncs_after``, with their count: one call to the coordinator."""
        data, syncs, count = await self._h.next_report.remote(timeout_s, syncs_after)
        report: StepReport | None = None if data is None else pickle.loads(data)
        return report, list(syncs), int(count)

    async def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = await self._h.stats.remote()
        return stats

    async def weight_syncs(self, after: int) -> tuple[list[WeightSync], int]:
        syncs, count = await self._h.weight_syncs.remote(after)
        return list(syncs), int(count)


class GeneratorView:
    """Every generator's weights version as the coordinator last told it, kept fresh by one
    long poll (the rollout routes by it many times a second). A generator whose calls failed
    because its actor died counts as having no weights (-1) until it registers again (a new
    incarnation), so nothing is routed to it meanwhile."""

    def __init__(self, registry: RemoteRegistry, poll_s: float = 5.0) -> None:
        self.registry = registry
        self.poll_s = poll_s
        self._snap: dict[str, Snapshot] = {}
        self._lost: dict[str, int] = {}  # name -> incarnation that died
        self._seq = -1

    def version(self, name: str) -> int:
        version, _, incarnation, _, _ = self._snap.get(name, (-1, 0, -1, 0, 0))
        if self._lost.get(name) == incarnation:
            return -1
        return version

    def incarnation(self, name: str) -> int:
        """The incarnation of ``name`` the coordinator last told of (-1: none yet)."""
        snap = self._snap.get(name)
        return -1 if snap is None else snap[2]

    def routing(self, name: str) -> tuple[int, int] | None:
        """``(running, received)`` as the generator last reported them (None before)."""
        snap = self._snap.get(name)
        return None if snap is None else (snap[3], snap[4])

    def lost(self, name: str) -> None:
        if name in self._snap:
            self._lost[name] = self._snap[name][2]

    async def refresh(self, timeout_s: float = 0.0) -> None:
        self._seq, self._snap = await self.registry.watch(self._seq, timeout_s)

    async def run(self) -> None:
        """Follow the coordinator until cancelled (raises if it died)."""
        while True:
            await self.refresh(self.poll_s)


class RemoteGenerator:
    """A generation instance in another actor (a generator host), for the rollout adapter.

    ``version`` is what the instance last registered or reported (never newer than what it
    holds, so routing by it never breaks the staleness bound; the adapter still checks every
    sample's version). ``in_flight`` is the instance's load as the rollout routes by it: the
    sequences its engine last reported running, plus the samples dispatched since that report
    (the host counts the samples it received), never more than this proxy's calls in flight
    (the rollout is the only caller). In one process the rollout reads the engine's own count
    (a call's finished samples no longer load it); counting whole calls here instead made an
    instance finishing a long-tail group look full, and skew-aware dispatch left it idle.
    """

    def __init__(self, name: str, handle: Any, view: GeneratorView) -> None:
        self.name = name
        self._h = handle
        self._view = view
        self._outstanding = 0  # samples of this proxy's calls in flight
        self._sent = 0  # samples dispatched so far (what the host's ``received`` counts)
        self._held = (-1, -1)  # (incarnation, version) the host itself said it holds
        self.lost = 0

    @property
    def version(self) -> int:
        """The newest version the instance is known to hold: the coordinator's view, or
        newer where the instance answered :meth:`wait_version` itself since (the same
        incarnation: a restarted one starts from its own version again)."""
        viewed = self._view.version(self.name)
        incarnation, held = self._held
        if viewed < 0 or incarnation != self._view.incarnation(self.name):
            return viewed
        return max(viewed, held)

    async def wait_version(self, version: int, timeout_s: float) -> bool:
        """Until the instance holds ``version`` (True) or ``timeout_s`` passed (False),
        answered by the generator host when its load finishes: the rollout routes a batch
        waiting for new weights without waiting for the coordinator to hear of the load. A
        host that died answers False (its calls report the loss)."""
        import ray

        incarnation = self._view.incarnation(self.name)
        try:
            # (bounded here too: Ray queues a call to a host it has not placed again, e.g.
            # its node lost, and the host's own bound never starts)
            call = self._h.wait_version.remote(version, timeout_s)
            ok = bool(await within(call, timeout_s + CALL_SLACK_S))
        except TimeoutError:
            return False
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError):
            await asyncio.sleep(min(timeout_s, LOST_WAIT_S))  # (no spin while it restarts)
            return False
        if ok and incarnation >= 0 and (incarnation, version) > self._held:
            self._held = (incarnation, version)
        return ok

    @property
    def outstanding(self) -> int:
        """Samples of this proxy's calls in flight (0: the instance holds nothing of ours)."""
        return self._outstanding

    @property
    def in_flight(self) -> int:
        reported = self._view.routing(self.name)
        if reported is None:
            return self._outstanding
        running, received = reported
        unseen = max(0, self._sent - received)  # dispatched after the report
        return min(self._outstanding, running + unseen)

    async def generate(
        self, prompts: Sequence[torch.Tensor], params: SamplingParams
    ) -> list[Generation]:
        flat, lengths = pack_prompts(prompts)  # (a few arrays, not a tensor per sample)
        packed = await self._call(len(prompts), self._h.generate_packed, flat, lengths, params)
        return unpack_generations(packed)

    async def generate_after(
        self,
        prompts: Sequence[torch.Tensor],
        params: SamplingParams,
        version: int,
        timeout_s: float,
    ) -> tuple[list[Generation], float] | None:
        """:meth:`generate` once the instance holds ``version`` (waited for on the host, at
        most ``timeout_s``): the generations and the seconds waited, or None when it did not
        load it in time (``adapters.rollout.AheadInstance``)."""
        flat, lengths = pack_prompts(prompts)
        incarnation = self._view.incarnation(self.name)
        got = await self._call(
            len(prompts), self._h.generate_packed_after, flat, lengths, params, version, timeout_s
        )
        if got is None:
            self._sent -= len(prompts)  # (the host never counted them as received)
            return None
        packed, waited = got
        if incarnation >= 0 and (incarnation, version) > self._held:
            self._held = (incarnation, version)  # (routable before the coordinator hears)
        return unpack_generations(packed), float(waited)

    async def _call(self, samples: int, method: Any, *args: Any) -> Any:
        """One actor call carrying ``samples`` prompts: counted as in flight while it runs;
        the host's death raises :class:`InstanceLostError`, its error raises as is."""
        import ray

        self._outstanding += samples
        self._sent += samples
        try:
            return await method.remote(*args)
        except ray.exceptions.RayTaskError as e:
            raise remote_cause(e) from None  # the engine's own error, as if it ran here
        except ray.exceptions.RayActorError as e:
            self.lost += 1
            self._view.lost(self.name)  # not routable until it registers again
            raise InstanceLostError(f"generation instance {self.name!r} died: {e}") from e
        finally:
            self._outstanding -= samples


def remote_cause(error: Any) -> BaseException:
    """The exception a remote call raised (Ray wraps it; its traceback is in the message)."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) else error
