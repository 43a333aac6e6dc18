"""``RolloutAdapter``: prompts in, episodes (sampled tokens and behaviour log-probs) out.

| consumes                  | produces                                      | header set         |
|---------------------------|-----------------------------------------------|--------------------|
| prompt_ids (+ the task's  | an episode per row: response_ids,             | version (of the    |
| columns an environment    | behaviour_logprobs, loss_mask, token_versions,| oldest token),     |
| reads)                    | turns, rewards, end reason                    | length             |
|                           | (``adapters.episodes.EPISODE_FIELDS``), and   |                    |
|                           | generated_at (float64: wall-clock seconds     |                    |
|                           | when the row's episode ended)                 |                    |

Every row becomes an episode. Without an environment (``episodes=None``) it is one turn: a
batch is one ``generate`` call, as below. With an :class:`engines.episodes.EpisodeRunner`,
every row of a batch is an episode of several turns with its environment, all of the batch's
episodes in flight at once on the batch's instance, their turns merged into few ``generate``
calls (``turn_gather_s``, :class:`engines.episodes.TurnBatcher`); every turn's samples are
checked against the batch's version bound, so the oldest token of an episode is recent enough
(the staleness bound holds per episode). The columns are the same either way
(:mod:`adapters.episodes`), and so is everything downstream.

Any :class:`engines.GenerationEngine` works (HF, vLLM, simulated, your own). Given several
engines (instances), each batch goes to the one a :class:`Router` picks: the least loaded by
default, or, with :class:`LengthAwareRouter`, dedicated instances for prompts the
:class:`LengthRanker` predicts to run long (StreamRL's skewness-aware dispatch). The ranker
learns from every batch's observed response lengths.

With ``version_field`` (the workflow uses ``min_gen_version``), a batch only goes to an
instance whose weights version is at least the batch's bound: that is how the staleness bound
holds while instances update their weights independently. When no instance is recent enough
yet, the batch waits for one. With ``dispatch_ahead``, instances that wait for weights
themselves (:class:`AheadInstance`: the generator hosts of ``deploy=ray``) are given a
one-turn batch before they hold its version (the router picks one by load): the instance
starts it the moment its load lands, without a routing round trip after it (one hop less per
synchronous step); not loaded within ``WAKE_S``, the batch is routed anew. It suits a weight
sync that updates every instance at each publish (``eager``): under ``on_demand`` only one
lagging instance updates, and a batch given to another would wait out ``WAKE_S``.

Long-tail migration (``migrate_after``, with a :class:`LengthAwareRouter`): a batch first
runs with a budget of ``migrate_after`` new tokens; the samples still going when the budget
runs out are continued (prompt + their tokens so far as the new prompt, the rest of the budget)
on the dedicated long instances, which run few sequences at a time and so decode them fastest.
The instance that started them is free for new prompts meanwhile, so one runaway sample never
holds a full batch's instance at a crawl. The sample's tokens and behaviour log-probs are the
two parts joined, each token with its version; the sample's version is its oldest token's (the
staleness bound holds for every token, and the per-token log-probs stay exact for importance
weighting). Any engine works: a continuation is an ordinary prompt.

Per-token versions: an engine with partial rollouts (``rollout.partial``) goes on decoding a
response across a weight update, so one response's tokens may come from several versions; the
row's ``version`` header is always the oldest, the one the staleness bound is checked against,
and ``token_versions`` records every token's (the train stage reads it for its metrics and
for objectives that weigh tokens by their version).

Load: an engine that reports ``in_flight`` (sequences accepted and not finished) is routed by
it; otherwise by the samples of the adapter's calls in flight on it.

Instances may live in other processes (``asyncflow.deploy``): a proxy whose instance died
raises :class:`InstanceLostError`, and the batch (still leased) is generated again on another
eligible instance, as is a batch that came back from an instance older than its bound (one
that restarted with its initial weights between routing and the call). Every returned sample
is checked against the batch's version bound, so the staleness bound holds whatever happens
to instances.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol

import numpy as np
import torch

from adapters.base import Adapter, StageOutput
from adapters.episodes import (
    EPISODE_FIELDS,
    episode_columns,
    episode_metrics,
    rows_of,
    run_episodes,
    single_turn_columns,
)
from adapters.ranker import LengthRanker
from engines.episodes import Episode, EpisodeSource
from engines.protocols import Generation, SamplingParams
from transferqueue import BatchMeta, Ragged
from transferqueue.schema import Column

__all__ = [
    "AheadInstance",
    "GenerationInstance",
    "InstanceLostError",
    "LeastLoadedRouter",
    "LengthAwareRouter",
    "RolloutAdapter",
    "Router",
]

log = logging.getLogger(__name__)


WAKE_S = 0.5
"""Longest wait for a version between two ``on_demand`` calls, with instances that wake the
rollout when they load weights (``wait_version``)."""


class InstanceLostError(RuntimeError):
    """A generation instance is gone (its process died) or came back with weights older than
    the batch it was given; the rollout adapter generates the batch elsewhere."""


class GenerationInstance(Protocol):
    """What the rollout adapter needs of an instance: a generation engine, or a proxy of one
    in another process. ``in_flight`` (sequences accepted, not finished) is optional."""

    @property
    def version(self) -> int: ...

    async def generate(
        self, prompts: Sequence[torch.Tensor], params: SamplingParams
    ) -> list[Generation]: ...


class AheadInstance(Protocol):
    """An instance that takes a batch before it holds the batch's weights (optional).

    ``generate_after`` waits (at most ``timeout_s``) until the instance holds ``version`` or
    a newer one, then generates the batch as ``generate`` does; it returns the generations and
    the seconds it waited, or None when the version did not land in time (nothing generated,
    the batch is routed anew). An instance in another process saves the rollout a round trip
    between its load and the batch's start."""

    async def generate_after(
        self,
        prompts: Sequence[torch.Tensor],
        params: SamplingParams,
        version: int,
        timeout_s: float,
    ) -> tuple[list[Generation], float] | None: ...


class _NotLoaded(Exception):
    """A batch given ahead of its weights to an instance that did not load them in time."""


class Router(Protocol):
    """Chooses the engine instance for a batch. Called by the rollout adapter per batch.

    A router may also define ``choose_continuation(load, eligible, samples) -> int``, the
    instance for samples migrated after the budget (see the module docstring); without it
    they go to the least loaded eligible instance.
    """

    def choose(
        self, load: Sequence[int], predicted_len: float, eligible: Sequence[int], samples: int = 1
    ) -> int:
        """Index of the instance among ``eligible`` (non-empty) for a batch of ``samples``
        sequences; ``load`` is the samples in flight on each instance."""
        ...


class LeastLoadedRouter:
    """The instance with the fewest samples in flight."""

    def choose(
        self, load: Sequence[int], predicted_len: float, eligible: Sequence[int], samples: int = 1
    ) -> int:
        return min(eligible, key=lambda i: load[i])

    def choose_continuation(
        self, load: Sequence[int], eligible: Sequence[int], samples: int = 1
    ) -> int:
        """Instance for samples that outlived the migration budget (any: none dedicated)."""
        return min(eligible, key=lambda i: load[i])


class LengthAwareRouter:
    """Predicted-long batches go to dedicated instances kept lightly loaded.

    Decode speed of a continuous-batching instance falls with its batch (every iteration
    advances every running sequence), so the long tail of a step finishes soonest on an
    instance that runs few sequences. A batch is "long" when its predicted response length is
    at or above the ``quantile`` of recent predictions (a moving threshold). Long batches go to
    a dedicated instance with room for the whole batch within ``long_capacity`` samples, else
    to the least loaded other instance (work-conserving: queueing behind a dedicated
    instance's full batch would cost more than decoding in a fuller one). Other batches go to
    the other instances, or to an idle dedicated one.
    """

    def __init__(
        self,
        long_instances: Sequence[int],
        *,
        quantile: float = 0.9,
        long_capacity: int = 16,
        window: int = 512,
    ) -> None:
        if not long_instances:
            raise ValueError("LengthAwareRouter needs at least one dedicated long instance")
        self.long = sorted(set(long_instances))
        self.quantile = quantile
        self.long_capacity = long_capacity
        self._recent: deque[float] = deque(maxlen=window)
        self.long_batches = 0
        self.batches = 0
        self.continuations = 0

    def choose(
        self, load: Sequence[int], predicted_len: float, eligible: Sequence[int], samples: int = 1
    ) -> int:
        self._recent.append(predicted_len)
        threshold = float(np.quantile(np.fromiter(self._recent, float), self.quantile))
        is_long = len(self._recent) >= 8 and predicted_len >= threshold
        dedicated = [i for i in eligible if i in self.long]
        others = [i for i in eligible if i not in self.long]
        self.batches += 1
        if is_long:
            self.long_batches += 1
            room = [i for i in dedicated if load[i] + samples <= self.long_capacity]
            pool = room or others or dedicated
        else:
            idle = [i for i in dedicated if load[i] == 0]
            pool = others + idle if others else dedicated
        return min(pool, key=lambda i: load[i])

    def choose_continuation(
        self, load: Sequence[int], eligible: Sequence[int], samples: int = 1
    ) -> int:
        """Migrated long-tail samples: the least loaded dedicated instance with room for them
        (``long_capacity``); when every one is full, the least loaded instance (queueing
        behind a full dedicated instance would cost more than a fuller batch)."""
        room = [i for i in eligible if i in self.long and load[i] + samples <= self.long_capacity]
        self.continuations += 1
        return min(room or eligible, key=lambda i: load[i])


_LEAST_LOADED = LeastLoadedRouter()


class RolloutAdapter(Adapter):
    """Generation engine(s) as the rollout stage."""

    task = "rollout"
    input_fields: tuple[str, ...] = ("prompt_ids",)
    output_fields: tuple[str, ...] = (*EPISODE_FIELDS, "generated_at")

    def __init__(
        self,
        engine: GenerationInstance | Sequence[GenerationInstance],
        params: SamplingParams,
        *,
        batch_size: int = 16,
        router: Router | None = None,
        ranker: LengthRanker | None = None,
        sampler: str = "fifo",
        sampler_options: dict[str, Any] | None = None,
        version_field: str | None = None,
        wait_poll_s: float = 0.005,
        migrate_after: int = 0,
        on_demand: Callable[[int], None] | None = None,
        on_done: Callable[[], None] | None = None,
        max_retries: int = 3,
        episodes: EpisodeSource | None = None,
        row_columns: Sequence[str] = (),
        turn_gather_s: float = 0.005,
        dispatch_ahead: bool = False,
    ) -> None:
        self.engines = list(engine) if isinstance(engine, Sequence) else [engine]
        if not self.engines:
            raise ValueError("RolloutAdapter needs at least one generation engine")
        self.params = params
        self.batch_size = batch_size
        self.router: Router = router or LeastLoadedRouter()
        self.ranker = ranker
        self.sampler = sampler
        self.sampler_options = dict(sampler_options or {})
        self.load = [0] * len(self.engines)
        self.version_field = version_field
        if version_field is not None:
            self.input_fields = (*type(self).input_fields, version_field)
        self.wait_poll_s = wait_poll_s
        self.waited_s = 0.0
        """Seconds batches waited for an instance with recent enough weights."""
        if migrate_after < 0:
            raise ValueError(f"migrate_after must be >= 0 (0: off), got {migrate_after}")
        self.migrate_after = migrate_after
        self.on_demand = on_demand
        """Called with the version a batch waits for when no instance holds it."""
        self.on_done = on_done
        """Called after every engine call returns (an instance may now be idle)."""
        self.migrated = 0
        """Samples continued on another instance after the migration budget."""
        self.max_retries = max_retries
        self.retries = 0
        """Batches generated again because their instance was lost."""
        if episodes is not None and migrate_after:
            raise ValueError(
                "migrate_after continues one-turn responses elsewhere; multi-turn episodes keep "
                "their instance (its prefix cache): set migrate_after=0"
            )
        self.episodes = episodes
        """Runs a row's episode with its environment (None: one-turn responses)."""
        self.row_columns = tuple(row_columns)
        """Columns handed to the environment's ``reset`` (the task's prompt and answer...)."""
        if episodes is not None:
            self.input_fields = (*self.input_fields, *self.row_columns)
        self.writes_prompt = bool(getattr(episodes, "writes_prompt", False))
        """Agents choose their own prompt: each row's ``prompt_ids`` is rewritten with it."""
        if self.writes_prompt:
            self.output_fields = (*type(self).output_fields, "prompt_ids")
        self.turn_gather_s = turn_gather_s
        self.dispatch_ahead = dispatch_ahead
        """One-turn batches go to an :class:`AheadInstance` before it holds their version."""
        self.retired: set[int] = set()
        """Instances that take no new batch (leaving the run: :meth:`retire`)."""

    def add(self, engine: GenerationInstance) -> int:
        """A new instance joins (a running job scaled up); its index. Routed to once its
        version is recent enough for a batch, as every other."""
        self.engines.append(engine)
        self.load.append(0)
        return len(self.engines) - 1

    def retire(self, k: int) -> None:
        """Instance ``k`` takes no new batch; the calls it has finish there (a batch's
        migration or next turn goes to the others). Indexes stay: batches in flight name
        their instance by index."""
        if not 0 <= k < len(self.engines):
            raise IndexError(f"no instance {k}: {len(self.engines)} instances")
        if len(self.retired | {k}) >= len(self.engines):
            raise ValueError("the rollout keeps at least one instance")
        self.retired.add(k)

    def busy(self, k: int) -> int:
        """Samples this adapter has on instance ``k`` now."""
        return self.load[k]

    async def process(self, meta: BatchMeta, cols: dict[str, Column]) -> StageOutput:
        attempt = 0
        while True:
            try:
                return await self._process(meta, cols)
            except _NotLoaded:
                continue  # (each try waited WAKE_S on an instance: routed anew, as in _eligible)
            except InstanceLostError as e:
                attempt += 1
                self.retries += 1
                if attempt > self.max_retries:
                    raise
                log.warning("rollout: %s; generating the batch again (retry %d)", e, attempt)

    async def _process(self, meta: BatchMeta, cols: dict[str, Column]) -> StageOutput:
        prompts = cols["prompt_ids"]
        if not isinstance(prompts, Ragged):
            raise TypeError(f"prompt_ids must be a ragged column, got {type(prompts).__name__}")
        prompt_lens = prompts.lengths.numpy()
        predicted = float(np.mean(np.maximum(meta.lengths - prompt_lens, 0))) if len(meta) else 0
        need = self._need(cols)
        ahead_ok = self.dispatch_ahead and self.episodes is None
        eligible, ahead = await self._eligible(need, ahead=ahead_ok)
        k = self.router.choose(self._loads(), predicted, eligible, len(prompts))
        # a batch given ahead is generated with weights of at least ``need``
        version_at_dispatch = need if ahead else self.engines[k].version
        ids = [p.long() for p in prompts.unbind()]
        t0 = time.perf_counter()
        episodes: list[Episode] | None = None
        if self.episodes is not None:
            episodes = await run_episodes(
                self.episodes,
                ids,
                rows_of(cols, self.row_columns, len(meta)),
                functools.partial(self._turns, k, need),
                self.params,
                gather_s=self.turn_gather_s,
            )
            spans = [(f"instance{k}", t0, time.perf_counter())]
            metrics = episode_metrics(episodes)
            columns = episode_columns(episodes)
            # an episode the environment ended before the model's first token has no sampled
            # token: it counts as generated by the instance it was given
            versions = [e.version if e.version >= 0 else version_at_dispatch for e in episodes]
            model_tokens = sum(e.model_tokens for e in episodes)
        else:  # one turn: the columns straight from the generations (no Episode per row)
            gens, spans = await self._responses(k, ids, need, t0, ahead)
            metrics = {}
            columns = single_turn_columns(gens)
            versions = [
                g.version if g.version >= 0 and g.token_ids.numel() else version_at_dispatch
                for g in gens
            ]
            model_tokens = sum(int(g.token_ids.numel()) for g in gens)
        # wall clock: the train stage reads it in its own process
        columns["generated_at"] = torch.full((len(versions),), time.time(), dtype=torch.float64)
        responses = columns["response_ids"]
        if isinstance(responses, Ragged):
            response_lens = responses.lengths.numpy()
        else:
            response_lens = np.array([int(r.numel()) for r in responses], dtype=np.int64)
        if self.ranker is not None:
            self._observe(meta, prompts, response_lens)
        if self.writes_prompt:
            own = ids
            if episodes is not None:
                own = [
                    e.prompt_ids if e.prompt_ids is not None else p
                    for e, p in zip(episodes, ids, strict=True)
                ]
            columns["prompt_ids"] = [p.to(torch.int32) for p in own]
            prompt_lens = np.array([int(p.numel()) for p in own], dtype=np.int64)
        return StageOutput(
            columns=columns,
            version=np.array(versions, dtype=np.int64),
            length=prompt_lens + response_lens,
            tokens=model_tokens,
            lane=f"instance{k}",
            spans=spans if len(spans) > 1 else [],
            metrics=metrics,
        )

    async def _responses(
        self, k: int, ids: list[torch.Tensor], need: int, t0: float, ahead: bool = False
    ) -> tuple[list[Generation], list[tuple[str, float, float]]]:
        """One-turn responses: the batch in one call (continued elsewhere past the migration
        budget); ``ahead``: given to instance ``k`` before it holds ``need``."""
        budget = self.migrate_after
        migrating = 0 < budget < self.params.max_new_tokens
        first = replace(self.params, max_new_tokens=budget) if migrating else self.params
        if ahead:
            gens, waited = await self._generate_after(k, ids, first, need)
            t0 += waited  # (the instance's span starts when its weights landed)
        else:
            gens = await self._generate(k, ids, first)
        spans = [(f"instance{k}", t0, time.perf_counter())]
        if migrating:
            gens = await self._continue(ids, gens, need, spans)
        self._check_versions(k, gens, need)
        return gens, spans

    async def _turns(
        self, k: int, need: int, prompts: list[torch.Tensor], params: SamplingParams
    ) -> list[Generation]:
        """One generate call of episodes' turns on the batch's instance ``k``."""
        gens = await self._generate(k, prompts, params)
        self._check_versions(k, gens, need)
        return gens

    @staticmethod
    def _check_versions(k: int, gens: Sequence[Generation], need: int) -> None:
        stale = [g.version for g in gens if g.version < need]
        if stale:
            raise InstanceLostError(
                f"instance {k} returned samples of weights version {min(stale)} for a batch "
                f"that needs {need} (it restarted with older weights)"
            )

    async def close(self) -> None:
        if self.episodes is not None:
            aclose = getattr(self.episodes, "aclose", None)
            if aclose is not None:  # an agent runner's endpoint runs on this loop
                await aclose()
            self.episodes.close()

    def _loads(self) -> list[int]:
        return [
            int(n) if (n := getattr(e, "in_flight", None)) is not None else self.load[i]
            for i, e in enumerate(self.engines)
        ]

    async def _generate(
        self, k: int, prompts: list[torch.Tensor], params: SamplingParams
    ) -> list[Generation]:
        self.load[k] += len(prompts)
        try:
            gens = await self.engines[k].generate(prompts, params)
        finally:
            self.load[k] -= len(prompts)
            if self.on_done is not None:
                self.on_done()
        if len(gens) != len(prompts):
            raise RuntimeError(
                f"generation engine returned {len(gens)} samples for {len(prompts)} prompts"
            )
        return gens

    async def _generate_after(
        self, k: int, prompts: list[torch.Tensor], params: SamplingParams, need: int
    ) -> tuple[list[Generation], float]:
        """:meth:`_generate` on an :class:`AheadInstance` before it holds ``need``; raises
        :class:`_NotLoaded` when the version did not land within ``WAKE_S``."""
        engine: AheadInstance = self.engines[k]  # type: ignore[assignment]
        self.load[k] += len(prompts)
        try:
            got = await engine.generate_after(prompts, params, need, WAKE_S)
        finally:
            self.load[k] -= len(prompts)
            if self.on_done is not None:
                self.on_done()
        if got is None:
            raise _NotLoaded
        gens, waited = got
        self.waited_s += waited
        if len(gens) != len(prompts):
            raise RuntimeError(
                f"generation engine returned {len(gens)} samples for {len(prompts)} prompts"
            )
        return gens, waited

    async def _continue(
        self,
        prompts: list[torch.Tensor],
        gens: list[Generation],
        need: int,
        spans: list[tuple[str, float, float]],
    ) -> list[Generation]:
        """Continue the samples cut by the migration budget on a long instance."""
        budget = self.migrate_after
        cut = [
            i
            for i, g in enumerate(gens)
            if g.finish_reason == "length" and int(g.token_ids.numel()) >= budget
        ]
        if not cut:
            return gens
        eligible, _ = await self._eligible(need)
        choose = getattr(self.router, "choose_continuation", _LEAST_LOADED.choose_continuation)
        k = choose(self._loads(), eligible, len(cut))
        rest = replace(self.params, max_new_tokens=self.params.max_new_tokens - budget)
        resumed = [torch.cat([prompts[i], gens[i].token_ids.long()]) for i in cut]
        t0 = time.perf_counter()
        tails = await self._generate(k, resumed, rest)
        spans.append((f"instance{k}", t0, time.perf_counter()))
        self.migrated += len(cut)
        out = list(gens)
        for i, tail in zip(cut, tails, strict=True):
            head = gens[i]
            out[i] = Generation(
                token_ids=torch.cat([head.token_ids, tail.token_ids.to(head.token_ids.dtype)]),
                logprobs=torch.cat([head.logprobs, tail.logprobs.to(head.logprobs.dtype)]),
                finish_reason=tail.finish_reason,
                token_versions=torch.cat([head.token_versions, tail.token_versions]),
            )
        return out

    def _need(self, cols: dict[str, Column]) -> int:
        """The oldest weights version allowed to generate every row of the batch (-1: any)."""
        if self.version_field is None:
            return -1
        bound = cols[self.version_field]
        if not isinstance(bound, torch.Tensor):
            raise TypeError(f"{self.version_field} must be a dense integer column")
        return int(bound.max()) if bound.numel() else -1

    async def _eligible(self, need: int, ahead: bool = False) -> tuple[list[int], bool]:
        """Instances whose weights are recent enough for every row (waits until one is), and
        False; with ``ahead``, while none is, the live :class:`AheadInstance` ones and True."""
        t0 = time.perf_counter()
        while True:
            ok = [
                i for i, e in enumerate(self.engines) if e.version >= need and i not in self.retired
            ]
            if ok:
                self.waited_s += time.perf_counter() - t0
                return ok, False
            if self.on_demand is not None:
                self.on_demand(need)
            if ahead and (live := self._ahead()):
                self.waited_s += time.perf_counter() - t0
                return live, True
            await self._wait_any(need)

    def _ahead(self) -> list[int]:
        """Live instances that wait for weights themselves (the router picks by load)."""
        return [
            i
            for i, e in enumerate(self.engines)
            if e.version >= 0 and hasattr(e, "generate_after") and i not in self.retired
        ]

    async def _wait_any(self, need: int) -> None:
        """Until an instance may hold version ``need``: woken by the update where every
        instance can tell (``wait_version``, bounded by ``WAKE_S``), else ``wait_poll_s``."""
        waits = [
            getattr(e, "wait_version", None)
            for i, e in enumerate(self.engines)
            if i not in self.retired
        ]
        if not all(waits):
            await asyncio.sleep(self.wait_poll_s)
            return
        tasks = [asyncio.ensure_future(w(need, WAKE_S)) for w in waits if w is not None]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()

    def _observe(self, meta: BatchMeta, prompts: Ragged, lens: np.ndarray) -> None:
        """One observation per prompt: the mean response length of its samples here."""
        assert self.ranker is not None
        firsts: dict[int, int] = {}
        sums: dict[int, list[int]] = {}
        for pos, g in enumerate(meta.groups.tolist()):
            firsts.setdefault(g, pos)
            sums.setdefault(g, []).append(int(lens[pos]))
        self.ranker.observe(
            [prompts[firsts[g]] for g in firsts], [float(np.mean(sums[g])) for g in firsts]
        )
