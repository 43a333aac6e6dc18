"""The generator registry: what admission, routing and weight sync know about generators.

Generators report here; nobody reads ``version``, ``in_flight`` or ``drain_tokens`` off an
engine object elsewhere. That is what lets one code path serve both deployments: with
``deploy=local`` the registry is a plain object in the driver's event loop, with
``deploy=ray`` the same class runs as a small async Ray actor (the *coordinator*) that stage
hosts on any node report to (Ray actors cannot call back into the driver, so shared state
needs a home of its own; see ``asyncflow.deploy.ray``).

| who                       | calls                                              |
|---------------------------|----------------------------------------------------|
| generator host            | ``register`` at start (again after a restart),     |
|                           | ``report`` when its load changes, ``wait_update``  |
|                           | / ``updated`` around each weight load (with its    |
|                           | transfer and pause times)                          |
| trainer (rank 0)          | ``publish`` once its weights of a version can be   |
|                           | fetched through the weight transport               |
| prompt feeder (driver)    | ``newest_generator_version``, ``published``,       |
|                           | ``demand``, ``wait_changed``, ``filtered_count``   |
|                           | (admission control)                                |
| train stage (rank 0)      | ``filter_groups`` (dynamic sampling: the feeder    |
|                           | may admit one more group per filtered one)         |
| rollout stage             | ``demand`` (a batch waits for newer weights),      |
|                           | ``watch`` (versions and loads, for routing)        |
| driver (each step record) | ``weight_syncs`` (the syncs done since it last     |
|                           | asked: :class:`WeightSync`)                        |

**When a generator takes newer weights** (``policy``):

- ``eager``: at once. Every generator then drains its running requests after every step
  (vLLM's ``pause_generation(mode="wait")``): with long-tailed lengths an instance that runs
  one 8k-token sample admits nothing new until it ends.
- ``on_demand``: when the generator is idle (nothing in flight, so nothing to drain), or when
  the workflow needs newer weights than any generator holds (the feeder admitted groups no
  generator is recent enough for, or the rollout holds one: :meth:`demand`). Then only one
  lagging generator updates: the one likely to drain soonest (``drain_tokens``: its running
  requests' likely remaining tokens, as its engine estimates them). Generators a version or
  two behind keep taking the groups their weights are recent enough for, so the staleness
  bound holds exactly as with ``eager`` (it is enforced per group at routing); what changes is
  that a long-running sample no longer stalls its instance at every step. Engines that do not
  report ``in_flight`` count as idle (updated at once).

A restarted generator registers again under its name: it counts as a restart, and its
version is what it reports then (its initial weights), never the dead incarnation's, so no
group is routed to it before it holds recent enough weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from transferqueue.aio import wait_event, within

__all__ = ["POLICIES", "GeneratorStatus", "Registry", "WeightSync"]

POLICIES = ("eager", "on_demand")

LiveSource = Callable[[], tuple[int, int, int]]
"""``() -> (version, in_flight, drain_tokens)`` read off an engine in the registry's own
process (``deploy=local``): exact values at the moment of a decision, no report lag."""


@dataclass
class GeneratorStatus:
    """One generator as last reported."""

    version: int = -1
    in_flight: int = 0
    drain_tokens: int = 0
    incarnation: int = 0
    """Registrations so far minus one: how often this generator was restarted."""
    running: int = 0
    """Sequences the engine itself runs (a call's finished samples no longer count), for
    routing; reported by hosts in another process only."""
    received: int = 0
    """Samples of generate calls the host had received when it reported (for routing: what
    was dispatched after that is not in ``running`` yet)."""


@dataclass
class WeightSync:
    """One generator's weight update, as its host timed it (seconds of its own clock)."""

    generator: str
    version: int
    transfer_s: float
    """Fetching the weights through the transport (the engine generates meanwhile)."""
    pause_s: float
    """``update_weights``: the engine took no new work. With partial rollouts that is the
    load alone (every sequence stopped at a token boundary); otherwise it includes waiting
    for the running requests to finish on the old weights."""
    kept_tokens: int = 0
    """Tokens of the running sequences a partial update stopped and kept, as far as the engine
    has counted them (vLLM counts a sample's when it finishes): what aborting them and
    generating them again would have thrown away."""


Snapshot = tuple[int, int, int, int, int]
"""One generator in :meth:`Registry.watch`: ``(version, in_flight, incarnation, running,
received)``."""


class Registry:
    """Generator states, the newest published version, and the weight-update policy.

    Every method runs on one event loop (the driver's, or the coordinator actor's); none
    blocks it. Waiting methods take a ``timeout_s`` so that a remote caller's long poll always
    returns.
    """

    def __init__(
        self, initial_version: int = 0, *, policy: str = "eager", poll_s: float = 0.05
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"weight sync policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self.poll_s = poll_s
        self._published = initial_version
        self._any_published = False
        self._gens: dict[str, GeneratorStatus] = {}
        self._live: dict[str, LiveSource] = {}
        self._wake: dict[str, asyncio.Event] = {}
        self._changed = asyncio.Event()
        self._changes = 0  # weights published, groups filtered (what the feeder waits for)
        self._filtered = 0  # groups the train stage filtered (dynamic sampling)
        self._filtered_ids: set[int] = set()  # (a replaced trainer rank 0 tells them again)
        self._watch = asyncio.Condition()
        self._seq = 0
        self._need = -1
        self._updating: set[str] = set()
        self._published_at: dict[int, float] = {}
        self.updates = 0
        self.update_seconds = 0.0
        self.pause_s: list[float] = []
        """Per generator update, seconds its engine spent loading (generation paused)."""
        self.adoption_s: list[float] = []
        """Per published version, seconds until the first generator held it (or newer)."""
        self._syncs: list[WeightSync] = []  # not yet taken by weight_syncs
        self._syncs_taken = 0  # syncs taken before self._syncs[0]
        self.restarts: dict[str, int] = {}

    # -- generator hosts ---------------------------------------------------------------------
    async def register(self, name: str, version: int) -> int:
        """A generator host starts (or starts again): returns its incarnation (0 the first
        time). An update the dead incarnation had begun is forgotten."""
        old = self._gens.get(name)
        incarnation = 0 if old is None else old.incarnation + 1
        if incarnation:
            self.restarts[name] = incarnation
        self._gens[name] = GeneratorStatus(version=version, incarnation=incarnation)
        self._wake.setdefault(name, asyncio.Event())
        self._updating.discard(name)
        self._live.pop(name, None)
        await self._notify()
        return incarnation

    async def unregister(self, name: str) -> None:
        """Generator ``name`` left the run (scaled down, drained): no longer counted for
        admission, routing or updates. Unknown names are ignored (asked twice)."""
        if self._gens.pop(name, None) is None:
            return
        self._wake.pop(name, None)
        self._updating.discard(name)
        self._live.pop(name, None)
        self.restarts.pop(name, None)
        self._poke()  # (an update it blocked may now go to another)
        await self._notify()

    def set_live(self, name: str, source: LiveSource) -> None:
        """Read this generator's state from ``source`` at each decision (same process only)."""
        self._live[name] = source

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
        """New values for a registered generator (omitted ones are kept)."""
        st = self._status(name)
        if running is not None:
            st.running = running
        if received is not None:
            st.received = received
        if version is not None:
            st.version = version
        if in_flight is not None:
            st.in_flight = in_flight
        if drain_tokens is not None:
            st.drain_tokens = drain_tokens
        self._wake[name].set()
        await self._notify()

    async def wait_update(self, name: str, timeout_s: float) -> int | None:
        """Block until generator ``name`` should load newer weights (the policy allows it);
        returns the version to load and marks it updating, or None after ``timeout_s``."""
        wake = self._wake[name]
        deadline = time.monotonic() + timeout_s
        while True:
            if self._current(name)[0] < self._published and self._may_update(name):
                self._updating.add(name)
                return self._published
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            wake.clear()
            await wait_event(wake, min(left, self.poll_s))

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
        """Generator ``name`` now holds ``version`` (its update took ``seconds``: fetching the
        weights, ``transfer_s``, then loading them, ``pause_s``)."""
        self._syncs.append(WeightSync(name, version, transfer_s, pause_s, kept_tokens))
        self._updating.discard(name)
        st = self._status(name)
        st.version = max(st.version, version)
        self.updates += 1
        self.update_seconds += seconds
        self.pause_s.append(pause_s)
        now = time.perf_counter()
        for v in [v for v in self._published_at if v <= version]:
            self.adoption_s.append(now - self._published_at.pop(v))
        # (no admission change: the feeder admits from the published version; the generator
        # version in its view only decides whether it demands, and a demand is idempotent)
        self._poke()
        await self._notify()

    async def update_failed(self, name: str) -> None:
        """A generator's update raised: another may be chosen."""
        self._updating.discard(name)
        self._poke()

    # -- trainer -----------------------------------------------------------------------------
    async def publish(self, version: int) -> None:
        """Weights of ``version`` can now be fetched through the transport."""
        if version == self._published and self._any_published:
            return  # a replaced trainer rank 0 publishing the step it took over again
        if version < self._published and self._any_published:
            raise ValueError(f"published version {version} is not newer than {self._published}")
        self._published, self._any_published = version, True
        if any(self._current(n)[0] >= version for n in self._gens):
            self.adoption_s.append(0.0)  # a generator took it from its transport already
        else:
            self._published_at[version] = time.perf_counter()
        self._changes += 1
        self._changed.set()  # a waiting feeder may now demand them
        self._poke()

    async def filter_groups(self, groups: list[int]) -> None:
        """The train stage filtered ``groups`` (their rewards all tied; acknowledged, never
        trained): the feeder may admit as many more."""
        new = set(groups) - self._filtered_ids  # each group counts once
        self._filtered_ids |= new
        self._filtered += len(new)
        self._changes += 1
        self._changed.set()

    # -- admission and routing ---------------------------------------------------------------
    async def filtered_count(self) -> int:
        """Groups the train stage filtered since this registry started."""
        return self._filtered

    async def newest_generator_version(self) -> int:
        """The newest weights version any registered generator holds (published version
        before any registered)."""
        if not self._gens:
            return self._published
        return max(max(self._current(n)[0], 0) for n in self._gens)

    async def oldest_generator_version(self) -> int:
        """The oldest weights version any registered generator holds."""
        if not self._gens:
            return self._published
        return min(max(self._current(n)[0], 0) for n in self._gens)

    def demand(self, version: int) -> None:
        """Some work needs weights of at least ``version`` (``on_demand``: if no generator
        holds them, the lagging one likely to drain soonest updates). Never waits, so that
        routing code can call it as a plain callback."""
        if version > self._need:
            self._need = version
        self._poke()

    async def admission_view(self) -> tuple[int, int, int]:
        """``(newest generator version, published version, changes so far)`` in one call: what
        the feeder's admission control reads (pass the third to :meth:`wait_changed`, which
        returns the next view)."""
        return await self.newest_generator_version(), self._published, self._changes

    async def wait_changed(self, seen: int, timeout_s: float) -> tuple[int, int, int]:
        """Wait until weights were published, or groups filtered, since the view
        numbered ``seen`` (or ``timeout_s`` passes); returns the current
        :meth:`admission_view` (one call, not two, per change when the registry is in another
        process). Nothing is missed between a view and the wait, even when they are two
        remote calls."""
        deadline = time.monotonic() + timeout_s
        while self._changes == seen:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._changed.clear()
            await wait_event(self._changed, left)
        return await self.admission_view()

    async def watch(self, seq: int, timeout_s: float) -> tuple[int, dict[str, Snapshot]]:
        """Long poll: once the state differs from the one numbered ``seq`` (or ``timeout_s``
        passed), the new number and ``{name: (version, in_flight, incarnation, running,
        received)}`` (the last two: see :class:`GeneratorStatus`)."""
        async with self._watch:
            if self._seq == seq:
                with contextlib.suppress(TimeoutError):
                    await within(self._watch.wait(), timeout_s)
            return self._seq, {
                n: (*self._current(n)[:2], st.incarnation, st.running, st.received)
                for n, st in self._gens.items()
            }

    async def weight_syncs(self, after: int) -> tuple[list[WeightSync], int]:
        """The weight syncs after the first ``after`` (in order), and how many there are now:
        pass that as ``after`` next time. Those up to ``after`` are forgotten (one reader:
        the driver)."""
        drop = min(max(after - self._syncs_taken, 0), len(self._syncs))
        del self._syncs[:drop]
        self._syncs_taken += drop
        return list(self._syncs), self._syncs_taken + len(self._syncs)

    async def stats(self) -> dict[str, object]:
        """Counters for the run's records."""
        return {
            "updates": self.updates,
            "update_seconds": self.update_seconds,
            "pause_s": list(self.pause_s),
            "adoption_s": list(self.adoption_s),
            "restarts": dict(self.restarts),
            "versions": {n: self._current(n)[0] for n in self._gens},
        }

    # -- internals ---------------------------------------------------------------------------
    def _status(self, name: str) -> GeneratorStatus:
        try:
            return self._gens[name]
        except KeyError:
            raise KeyError(
                f"generator {name!r} is not registered; registered: {sorted(self._gens)}"
            ) from None

    def _current(self, name: str) -> tuple[int, int, int]:
        live = self._live.get(name)
        if live is not None:
            return live()
        st = self._gens[name]
        return st.version, st.in_flight, st.drain_tokens

    def _may_update(self, name: str) -> bool:
        if self.policy == "eager":
            return True
        _, in_flight, _ = self._current(name)
        if not in_flight:
            return True  # idle: nothing to drain
        newest = max(self._current(n)[0] for n in self._gens)
        if self._need <= newest or self._updating:
            return False  # some generator is recent enough, or one is already updating
        lagging = [n for n in self._gens if self._current(n)[0] < self._need]
        return name == min(lagging, key=self._drain_cost)

    def _drain_cost(self, name: str) -> tuple[int, int]:
        """What an update would wait for: the likely tokens of the running requests, then
        the requests in flight."""
        _, in_flight, drain = self._current(name)
        return (drain, in_flight)

    def poke(self) -> None:
        """Something changed that may let a generator update (a call finished): the waiting
        followers look again at once rather than at their next poll."""
        self._poke()

    def _poke(self) -> None:
        for ev in self._wake.values():
            ev.set()

    async def _notify(self) -> None:
        async with self._watch:
            self._seq += 1
            self._watch.notify_all()
