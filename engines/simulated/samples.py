"""Which sample a request of the simulated generation engine is: shared across instances.

A simulated sample is a pure function of ``(prompt, index)`` (its length, tokens and
log-probs; see :mod:`engines.simulated.generation`). What makes the ``n`` samples of a prompt
differ is the index, counted per prompt: the ``k``-th request of a prompt is its ``k``-th
sample. A sample cut short by ``max_new_tokens`` is recorded under the digest of its
continuation prompt (prompt + tokens so far), so that the request continuing it on any
instance resumes the same sample. For schedules compared on one prompt stream to do the same
work whatever the routing, every generation instance of a run must share that book:

| implementation       | instances sharing it                 | cost per ``generate`` call        |
|----------------------|--------------------------------------|-----------------------------------|
| :class:`LocalSamples`| those in one process (plain dicts)   | none (never suspends)             |
| :class:`RaySamples`  | those in any process of a Ray        | one actor call before scheduling, |
|                      | cluster (a :class:`SampleBook` actor)| one more overlapping the decode   |
|                      |                                      | when the call cuts samples        |

The engine asks once per call, never per request or token: :meth:`SampleStore.claim` for the
call's prompts before it schedules them, :meth:`SampleStore.record` for the samples it will
cut, started as soon as they are known and awaited before the call returns (a continuation
can only be requested after that). :class:`SampleBook` is the state both wrap, a plain class
(``ray.remote`` is applied in :func:`start_ray_samples`, so nothing here imports Ray at module
level and the engine runs without it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "Claim",
    "Cut",
    "LocalSamples",
    "RaySamples",
    "SampleBook",
    "SampleStore",
    "start_ray_samples",
]

MAX_CUTS = 1 << 16
"""Cut samples remembered at most; the oldest are forgotten (never continued)."""


@dataclass(frozen=True)
class Cut:
    """A sample cut short by ``max_new_tokens``: what its continuation resumes."""

    key: bytes
    """Digest of the sample's original prompt."""
    index: int
    """The sample's index (with the prompt, it determines every token)."""
    natural: int
    """The sample's full length had it not been cut."""
    offset: int
    """Tokens generated before the cut (where the continuation starts)."""


Claim = Cut | int
"""What :meth:`SampleStore.claim` returns per prompt: the cut sample its prompt continues, or
how many requests of that prompt came before this one (its sample number)."""


class SampleBook:
    """Request counts per prompt digest and cut samples per continuation digest.

    Plain state, no I/O: :class:`LocalSamples` holds one in-process, :func:`start_ray_samples`
    runs one as a Ray actor. Methods are synchronous, so each call is atomic on its actor.
    """

    def __init__(
        self,
        counts: dict[bytes, int] | None = None,
        cuts: dict[bytes, Cut] | None = None,
        *,
        max_cuts: int = MAX_CUTS,
    ) -> None:
        self.counts: dict[bytes, int] = {} if counts is None else counts
        self.cuts: dict[bytes, Cut] = {} if cuts is None else cuts
        self.max_cuts = max_cuts

    def claim(self, keys: Sequence[bytes], count: bool = True) -> list[Claim]:
        """Per prompt digest, in order: the cut it continues (removed: continued once), else
        its request number (counted when ``count``; a call with its own seed does not count,
        and gets 0)."""
        out: list[Claim] = []
        for key in keys:
            cut = self.cuts.pop(key, None)
            if cut is not None:
                out.append(cut)
            elif count:
                seen = self.counts.get(key, 0)
                self.counts[key] = seen + 1
                out.append(seen)
            else:
                out.append(0)
        return out

    def record(self, cuts: Sequence[tuple[bytes, Cut]]) -> None:
        """Remember cut samples under their continuation prompts' digests."""
        for key, cut in cuts:
            self.cuts[key] = cut
        while len(self.cuts) > self.max_cuts:  # never continued: forget the oldest
            del self.cuts[next(iter(self.cuts))]

    def ping(self) -> bool:
        return True


@runtime_checkable
class SampleStore(Protocol):
    """Where simulated generation engines look up and record sample identities.

    :class:`~engines.simulated.SimulatedGenerationEngine` calls :meth:`claim` once per
    ``generate`` call, before it schedules the call's requests, and :meth:`record` at most once
    per call, for the samples the call will cut (awaited before the call returns).
    """

    async def claim(self, keys: Sequence[bytes], count: bool) -> list[Claim]:
        """See :meth:`SampleBook.claim`."""
        ...

    async def record(self, cuts: Sequence[tuple[bytes, Cut]]) -> None:
        """See :meth:`SampleBook.record`."""
        ...


class LocalSamples:
    """A :class:`SampleBook` in this process, shared by the engines given the same object.

    Its methods never suspend, so an engine using it schedules exactly as with plain dicts.
    ``counts``/``cuts`` may be given to share existing dicts.
    """

    def __init__(
        self, counts: dict[bytes, int] | None = None, cuts: dict[bytes, Any] | None = None
    ) -> None:
        self.book = SampleBook(counts, cuts)

    async def claim(self, keys: Sequence[bytes], count: bool) -> list[Claim]:
        return self.book.claim(keys, count)

    async def record(self, cuts: Sequence[tuple[bytes, Cut]]) -> None:
        self.book.record(cuts)


@dataclass
class RaySamples:
    """A :class:`SampleBook` actor of a Ray cluster, found by name (picklable: give it to
    engines built in other actors; the handle is looked up at the first call)."""

    name: str
    """The actor's name (:func:`start_ray_samples`)."""
    namespace: str | None = None
    timeout_s: float = 60.0
    """Bound on one call (the book answers in microseconds; only a dead actor takes long)."""
    _handle: Any = field(default=None, init=False, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        return {"name": self.name, "namespace": self.namespace, "timeout_s": self.timeout_s}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _handle=None)

    def _actor(self) -> Any:
        if self._handle is None:
            import ray

            self._handle = ray.get_actor(self.name, namespace=self.namespace)
        return self._handle

    async def claim(self, keys: Sequence[bytes], count: bool) -> list[Claim]:
        import asyncio

        ref = self._actor().claim.remote(list(keys), count)
        async with asyncio.timeout(self.timeout_s):
            out: list[Claim] = await ref
        return out

    async def record(self, cuts: Sequence[tuple[bytes, Cut]]) -> None:
        import asyncio

        async with asyncio.timeout(self.timeout_s):
            await self._actor().record.remote(list(cuts))


def start_ray_samples(name: str, *, namespace: str | None = None) -> tuple[RaySamples, Any]:
    """Start a :class:`SampleBook` actor named ``name`` on the connected Ray cluster (no CPU
    reserved: it only answers lookups); returns the store to give engines and the actor
    handle (kill it with ``ray.kill`` when the run is over; it also ends with the driver)."""
    import ray

    book: Any = ray.remote(SampleBook)
    handle = book.options(name=name, namespace=namespace, num_cpus=0).remote()
    try:
        ray.get(handle.ping.remote(), timeout=120)
    except BaseException:
        with contextlib.suppress(Exception):
            ray.kill(handle)
        raise
    return RaySamples(name, namespace), handle
