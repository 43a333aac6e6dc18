"""The train stage over data-parallel trainer ranks under ``deploy=ray``, and the recovery of a
rank that died mid-run (``asyncflow.deploy.ray_trainer.TrainerActor`` hosts the ranks).

Rank 0 runs the train stage (:class:`DataParallelTrain`) and calls the other ranks for their
part of each micro-batch and for the optimizer step. With ``train.strategy=ddp`` every rank
holds the same weights and optimizer state, so any rank of a group of two or more that dies
(SIGKILL, OOM) is replaced without losing anything (``deploy.max_restarts`` > 0).

**A rank r >= 1 dies.** Rank 0 recovers it:

1. Ray restarts its actor; rank 0 sees the death as the failure of a call to it (or, for a
   replacement that has not joined yet, :class:`RankRestartedError`).
2. Rank 0 waits (bounded by ``deploy.start_timeout_s``) until the replacement answers, then
   hands it rank 0's own state: the weights, the optimizer's moments, the version and the
   RNGs, in the checkpoint format (``asyncflow.checkpoint.write_trainer_part``), sent as bytes
   through Ray (no shared folder needed). Rank 0's state in memory, not the last
   checkpoint: the checkpoint is older than the step in flight, and the replacement must
   hold the state the other ranks hold *now* for the step's gradients to sum correctly.
3. Every rank leaves the broken ``torch.distributed`` group and forms a new one.
4. The step in flight is redone, never trained twice or in part: rank 0 keeps, for each other
   rank, the parts of the step's micro-batches it sent it, with their columns (rank 0 reads
   the whole micro-batch while ranks are restartable). The replacement trains them again
   from those columns; its gradients are the dead rank's. Then the optimizer step runs
   (again): the gradient all-reduce is atomic on every rank (``all_reduce_gradients(...,
   atomic=True)``: the sums are written back only once every bucket is reduced), so a rank
   whose all-reduce failed still holds its own gradients. If rank 0's optimizer step did
   complete before the other rank died, the step is done and the replacement takes the
   stepped state instead.

**Rank 0 dies.** Its replacement takes the train stage over (:func:`take_over`), because
everything rank 0 orchestrates can be rebuilt from what survives it:

- *The step's rows.* While ranks are restartable, the train stage holds every row of the step
  in flight leased (``Adapter.holds_leases``) until the step is taken and reported, and only
  then acknowledges them. Rank 0's leases are held under its actor's name, so its replacement,
  announcing that it replaces it (``replace_earlier_holders``), gets them all back into the
  train task's queue at once (else the dead holder's silence returns them within seconds).
- *The position.* Each step report reaches the coordinator with the first group of the next
  window (``Coordinator.step_done``) before the step's rows are acknowledged; the replacement
  starts at the step after the last one reported (``train_position``) and first acknowledges
  rows of earlier windows that a death cut short.
- *The state.* The other ranks finish the call they were in (``quiesce``) and say their
  version. Survivors at the step's version ``v`` have not stepped: every rank, the source
  itself included, takes the state of one of them, which drops the step's gradients, and the
  step is trained again from its rows. A survivor at ``v + 1`` has stepped (its all-reduce
  completed, so it holds the full sum): every rank takes its state, and the step's rows are
  gone through only for its report (``step_taken_over`` in the step's metrics), not trained
  again. Any other version fails the run (:class:`TrainerLostError`).
- *The group.* Every rank forms a new ``torch.distributed`` group with the replacement as its
  rank 0 (it hosts the rendezvous).
- *Weight publishing, checkpoints, reports* restart on the replacement with the stage: it
  opens the weight transport's sender again (receivers join it again by themselves), publishes
  a step it reports again under the same version (the registry takes that once), and the
  coordinator drops a report of a step it has (``step_done``), so the driver sees each step
  once. A checkpoint due at such a step is staged again and never completed (harmless: only
  completed checkpoints are picked up).

So every group is trained exactly once, with the same gradients as without the death, and the
staleness bound holds (rows are admitted by the feeder's bound whatever the step's length; a
group's step depends only on the groups before it). The cost: Ray's restart of the actor (a new
interpreter importing torch) plus the state's transfer and the step trained again.

Which deaths end the run instead (:func:`trainer_lost` words the error, naming the rank, why
it is not replaced and ``asyncflow run --resume DIR``):

| trainer rank that died              | why it is not replaced                                  |
|-------------------------------------|---------------------------------------------------------|
| the only rank (``train.dp_size=1``) | it holds the only copy of the weights and optimizer     |
| any rank of ``train.strategy=fsdp`` | each rank holds only its shards: no surviving copy      |
| any rank, ``deploy.max_restarts=0`` | Ray does not restart it                                 |
| any rank, its restarts spent        | ``deploy.max_restarts`` deaths of that actor already    |

Such a run goes on from its newest checkpoint (``checkpoint.every_steps``):
``asyncflow run --resume DIR``, ``DIR`` the run's ``output.dir`` (or its ``checkpoint.dir``).
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from adapters.episodes import SUMMARY_FIELDS
from adapters.train import TrainAdapter, select_columns
from asyncflow.deploy.remote import remote_cause
from asyncflow.progress import waiting
from engines.packing import balance_by_tokens
from transferqueue import BatchMeta
from transferqueue.aio import within
from transferqueue.meta import balance_lengths
from transferqueue.schema import Column

__all__ = [
    "TRAIN_FIELDS",
    "DataParallelTrain",
    "RankLostError",
    "RankRestartedError",
    "TrainerLostError",
    "ranks_restartable",
    "read_state",
    "take_over",
    "trainer_lost",
    "write_state",
]

log = logging.getLogger(__name__)

TRAIN_FIELDS = ("prompt_ids", "response_ids", "behaviour_logprobs", "loss_mask", "token_versions")
"""The columns a rank reads for its part of a micro-batch (+ ``ref_logprobs`` with a
reference stage)."""

Part = tuple[BatchMeta, dict[str, Column], torch.Tensor, float]
Result = tuple[dict[str, float], int, int, list[int]]


def ranks_restartable(cfg: Any) -> bool:
    """Whether Ray restarts trainer ranks 1.. of this run (and rank 0 recovers them):
    ``train.strategy=ddp`` with several ranks and ``deploy.max_restarts`` > 0."""
    return cfg.train.dp_size > 1 and cfg.train.strategy != "fsdp" and cfg.deploy.max_restarts > 0


class TrainerLostError(RuntimeError):
    """A trainer rank died that the run cannot replace (see the module docstring's table); the
    message says why and how to go on (:func:`trainer_lost`)."""


def trainer_lost(rank: int, cfg: Any, cause: BaseException | str) -> TrainerLostError:
    """The error for trainer rank ``rank``'s death where it is not replaced: why, and the
    command that resumes the run (``cfg``: the run's :class:`~asyncflow.RunConfig`). Called by
    the driver when a trainer host's actor dies, and by rank 0 when a call to a rank fails."""
    t = cfg.train
    if t.dp_size == 1:
        why = (
            "a single-rank trainer holds the only copy of the weights and optimizer state, so "
            "no replacement could take them up"
        )
    elif t.strategy == "fsdp":
        why = (
            "with train.strategy=fsdp each rank holds only its shards of the weights and "
            "optimizer state, so no surviving rank holds a copy of its part"
        )
    elif cfg.deploy.max_restarts == 0:
        why = (
            "deploy.max_restarts=0, so Ray does not restart it (with deploy.max_restarts > 0, "
            "every rank of train.strategy=ddp is replaced within seconds)"
        )
    else:
        why = f"its restarts are spent (deploy.max_restarts={cfg.deploy.max_restarts})"
    resume = cfg.checkpoint.dir or cfg.output.dir
    if cfg.checkpoint.every_steps:
        go_on = f"resume the run from its newest checkpoint: asyncflow run --resume {resume}"
    else:
        go_on = (
            "this run writes no checkpoints (checkpoint.every_steps=0): start it again with "
            "checkpoint.every_steps=N to be able to resume a run after such a death "
            "(asyncflow run --resume DIR)"
        )
    return TrainerLostError(f"trainer rank {rank} died ({cause}); {why}: {go_on}")


class RankRestartedError(RuntimeError):
    """Raised by a trainer rank that Ray restarted and that has not joined the group yet: it
    holds the initial weights, not the group's (rank 0 then recovers it)."""


class RankLostError(RuntimeError):
    """A call to trainer rank ``rank`` failed because the rank died or was replaced."""

    def __init__(self, rank: int, cause: BaseException) -> None:
        super().__init__(f"trainer rank {rank} died or was restarted: {cause}")
        self.rank = rank


async def rank_call(ref: Any, rank: int, *, restartable: bool, cfg: Any = None) -> Any:
    """A call to trainer rank ``rank``. Its death is :class:`RankLostError` when the rank is
    restartable, else :class:`TrainerLostError` naming the rank and the way to go on (worded
    from ``cfg``, the run's config, when given)."""
    import ray

    try:
        return await ref
    except ray.exceptions.RayActorError as e:
        if restartable:
            raise RankLostError(rank, e) from e
        if cfg is not None:
            raise trainer_lost(rank, cfg, e) from e
        raise TrainerLostError(
            f"trainer rank {rank} died ({e}); it is not restarted (train.strategy=fsdp, or "
            "deploy.max_restarts=0): resume the run from its newest checkpoint: asyncflow run "
            "--resume DIR"
        ) from e
    except ray.exceptions.RayTaskError as e:
        cause = remote_cause(e)
        if restartable and isinstance(cause, RankRestartedError):
            raise RankLostError(rank, cause) from e
        raise


def read_state(write: Any) -> dict[str, bytes]:
    """The files ``write(folder)`` writes (a trainer's checkpoint part), as bytes by relative
    path (sent to a replacement rank, perhaps on another node)."""
    with tempfile.TemporaryDirectory(prefix="asyncflow-rank-state-") as d:
        root = Path(d) / "state"
        write(root)
        return {
            str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
        }


def write_state(files: dict[str, bytes], restore: Any) -> None:
    """Write ``files`` (from :func:`read_state`) into a temporary folder and ``restore(folder)``."""
    with tempfile.TemporaryDirectory(prefix="asyncflow-rank-state-") as d:
        root = Path(d)
        for rel, data in files.items():
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        restore(root)


class DataParallelTrain(TrainAdapter):
    """The train stage on rank 0 of ``dp_size`` ranks (see the module docstring).

    Only the rewards (for the filter and the group advantages) and the version columns (for
    the step's report) are read here, unless ranks are ``restartable`` (then the whole
    micro-batch: the step's parts are kept until its optimizer step). The micro-batch (whole
    groups of the step's window, its filtered groups left out) is split across the ranks:
    with a token budget by tokens (:func:`engines.packing.balance_by_tokens` over the rows'
    ``length`` headers, prompt + response tokens), else into parts of equal rows (±1) and
    near-equal tokens (the ``balanced`` sampler's split). Each rank reads its part's columns
    itself and accumulates its gradients (in packed calls under the budget); the optimizer
    step all-reduces them on every rank at once.
    """

    def __init__(
        self,
        *args: Any,
        ranks: list[Any],
        local: Any,
        restartable: bool = False,
        restart_timeout_s: float = 300.0,
        run_cfg: Any = None,
        **kw: Any,
    ) -> None:
        super().__init__(*args, **kw)
        self.run_cfg = run_cfg  # the run's config: words a lost rank's error (trainer_lost)
        # restartable: the step's rows stay leased until it is reported (with the position
        # rank 0's replacement goes on from), then they are acknowledged
        self.holds_leases = restartable
        self._replay = False  # see taken_over
        self.ranks = ranks  # actor handles of ranks 1..dp_size-1
        self.local = local  # rank 0's TrainerActor (this process)
        self.dp = len(ranks) + 1
        self.restartable = restartable
        self.restart_timeout_s = restart_timeout_s
        self.recoveries: list[float] = []  # seconds each recovery took
        self._recovery_s = 0.0  # in the step in flight
        self._redone = 0  # parts of the step in flight trained again by replacements
        self._parts: dict[int, list[Part]] = {r: [] for r in range(1, self.dp)}
        if self.max_tokens is None:
            self.sampler = "balanced"
            self.sampler_options = {**self.sampler_options, "dp_size": self.dp}
        self.read_fields = ("reward", "token_versions", "generated_at", *SUMMARY_FIELDS)
        if restartable:
            fields = [*TRAIN_FIELDS, *(("ref_logprobs",) if self.use_reference else ())]
            self.read_fields = tuple(dict.fromkeys([*self.read_fields, *fields]))

    def taken_over(self, taken: bool, seconds: float) -> None:
        """This rank 0 replaces a dead one (:func:`take_over`): whether the step in flight was
        already taken (its optimizer step ran on the survivors: its rows go into its report,
        untrained), and the seconds the take-over cost (``rank_recovery_s`` of the step)."""
        self._replay = taken
        self._recovery_s += seconds

    def settled(self) -> bool:
        """No step is in progress (its rows are held until it is reported)."""
        return self._groups_done == 0 and not self._acc["filtered"]

    def _shares(self, meta: BatchMeta) -> list[np.ndarray]:
        if self.max_tokens is None:  # the sampler's split, unless filtering changed the rows
            if meta.splits is not None:
                return meta.splits
            return balance_lengths(meta.lengths, self.dp)
        if len(meta) and int(meta.lengths.min()) < 0:
            raise ValueError(
                "train.max_tokens_per_micro_batch with train.dp_size > 1 splits by the rows' "
                "length headers, and some are unknown (-1): the rollout adapter must set "
                "StageOutput.length (prompt + response tokens)"
            )
        return balance_by_tokens(meta.lengths, self.dp)

    async def train_batch(
        self,
        meta: BatchMeta,
        cols: dict[str, Column],
        advantages: torch.Tensor,
        loss_scale: float,
    ) -> tuple[dict[str, float], int]:
        if self._replay:  # taken already: the rows only go into the step's report
            return {}, 0
        shares = self._shares(meta)
        calls = []
        for r, pos in enumerate(shares):
            part, adv = meta.select(pos), advantages[torch.from_numpy(pos)]
            if r == 0:
                if self.restartable:  # the columns are here already
                    own = select_columns(cols, pos)
                    calls.append(self.local.train_cols(part, own, adv, loss_scale))
                else:
                    calls.append(self.local.train_part(part, adv, loss_scale))
                continue
            handle = self.ranks[r - 1]
            if self.restartable:
                self._parts[r].append((part, select_columns(cols, pos), adv, loss_scale))
            ref = handle.train_part.remote(part, adv, loss_scale)
            calls.append(rank_call(ref, r, restartable=self.restartable, cfg=self.run_cfg))
        results: list[Any] = list(await asyncio.gather(*calls, return_exceptions=True))
        lost = self._lost(results[1:])
        if lost:  # the replacements train the step's parts again; this one's result is last
            replayed = await self._recover(lost, replay=True)
            for r in lost:
                results[r] = replayed[r]
        rows = sum(n for _, _, n, _ in results) or 1
        merged: dict[str, float] = {}
        for metrics, _, n, _ in results:
            for k, v in metrics.items():
                merged[k] = merged.get(k, 0.0) + float(v) * n / rows
        self.record_split(
            [t for *_, done in results for t in done], [sum(done) for *_, done in results]
        )
        return merged, sum(t for _, t, _, _ in results)

    def _lost(self, results: list[Any]) -> list[int]:
        """The ranks (1..) whose call failed because they died; any other failure raises."""
        lost: list[int] = []
        for res in results:
            if isinstance(res, RankLostError):
                lost.append(res.rank)
            elif isinstance(res, BaseException):
                raise res
        return lost

    async def optimizer_step(self) -> dict[str, float]:
        if self._replay:  # the survivors took this step before rank 0 died
            self._replay = False
            return self._done({"step_taken_over": 1.0})
        version = int(self.local.engine.version)
        calls = [self.local.optimizer_step(atomic=self.restartable)]
        calls += [
            rank_call(
                h.optimizer_step.remote(atomic=self.restartable),
                r,
                restartable=self.restartable,
                cfg=self.run_cfg,
            )
            for r, h in enumerate(self.ranks, 1)
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        mine = results[0]
        lost = self._lost([r if isinstance(r, RankLostError) else None for r in results[1:]])
        if not self.restartable or not lost:
            for res in results:
                if isinstance(res, BaseException):
                    raise res
            assert isinstance(mine, dict)
            return self._done(mine)
        if not isinstance(mine, BaseException):  # rank 0 stepped: the step is done
            await self._recover(lost, replay=False)
            return self._done(mine)
        # rank 0's all-reduce failed with the dead rank (atomic: its gradients are its own)
        if int(self.local.engine.version) != version:
            raise RuntimeError(
                f"trainer rank 0 stepped to version {self.local.engine.version} although its "
                f"optimizer step failed ({mine!r}); the step cannot be redone exactly"
            ) from mine
        log.warning("trainer rank 0's optimizer step failed with rank(s) %s gone: %r", lost, mine)
        await self._recover(lost, replay=True)
        return await self.optimizer_step()

    def _done(self, metrics: dict[str, float]) -> dict[str, float]:
        """The step is taken: forget its parts; report the seconds recoveries took in it
        and the parts trained again (``rank_recovery_s``, ``rank_parts_redone``; restartable
        ranks only)."""
        for parts in self._parts.values():
            parts.clear()
        if not self.restartable:
            return metrics
        spent, self._recovery_s = self._recovery_s, 0.0
        redone, self._redone = self._redone, 0
        return {**metrics, "rank_recovery_s": spent, "rank_parts_redone": float(redone)}

    async def _recover(self, lost: list[int], *, replay: bool) -> dict[int, Result]:
        """Bring the replacements of ranks ``lost`` into the group with rank 0's state, then
        (``replay``) have them train the step's parts again; returns each one's last
        result (the micro-batch in flight)."""
        # (the step's unit is not stuck meanwhile: the stall watch judges this wait by its
        # own bound, Ray's restart and as long again for the hand-over and the parts redone)
        with waiting(f"recover trainer rank(s) {lost}", 2 * self.restart_timeout_s):
            return await self._recover_within(lost, replay=replay)

    async def _recover_within(self, lost: list[int], *, replay: bool) -> dict[int, Result]:
        t0 = time.monotonic()
        log.warning("trainer rank(s) %s died; waiting for their replacements", lost)
        for r in lost:
            await self._until_back(r)
        await self._check_survivors(lost)
        files = await asyncio.to_thread(read_state, self.local.write_state)
        await asyncio.gather(
            *(
                rank_call(self.ranks[r - 1].adopt_state.remote(files), r, restartable=True)
                for r in lost
            )
        )
        host, port = self.local.endpoint()
        await asyncio.gather(
            self.local.regroup(self.dp, host, port),
            *(
                rank_call(h.regroup.remote(self.dp, host, port), r, restartable=True)
                for r, h in enumerate(self.ranks, 1)
            ),
        )
        out: dict[int, Result] = {}
        if replay:
            for r in lost:
                res: Result = ({}, 0, 0, [])
                for part, cols, adv, scale in self._parts[r]:
                    ref = self.ranks[r - 1].train_cols.remote(part, cols, adv, scale)
                    res = await rank_call(ref, r, restartable=True)
                    self._redone += 1
                out[r] = res
        seconds = time.monotonic() - t0
        self.recoveries.append(seconds)
        self._recovery_s += seconds
        log.warning(
            "trainer rank(s) %s replaced in %.2f s (state from rank 0, %d parts trained again)",
            lost,
            seconds,
            sum(len(self._parts[r]) for r in lost) if replay else 0,
        )
        return out

    async def _until_back(self, rank: int) -> None:
        """Wait (bounded) until Ray restarted rank ``rank``; raise if it never will."""
        import ray

        deadline = time.monotonic() + self.restart_timeout_s
        handle = self.ranks[rank - 1]
        while True:
            try:
                await within(handle.ping.remote(), max(deadline - time.monotonic(), 1.0))
                return
            except (ray.exceptions.ActorUnavailableError, TimeoutError) as e:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"trainer rank {rank} died and did not come back within "
                        f"deploy.start_timeout_s={self.restart_timeout_s}"
                    ) from e
                await asyncio.sleep(0.2)
            except ray.exceptions.RayActorError as e:  # dead for good (restarts spent)
                raise RuntimeError(
                    f"trainer rank {rank} died and is not restarted again ({e}; "
                    "deploy.max_restarts spent): resume the run from its newest checkpoint: "
                    "asyncflow run --resume DIR"
                ) from e

    async def _check_survivors(self, lost: list[int]) -> None:
        """Every surviving rank holds rank 0's version (none stepped alone), else the step
        cannot be redone exactly: fail naming the ranks."""
        mine = int(self.local.engine.version)
        alive = [r for r in range(1, self.dp) if r not in lost]
        versions = await asyncio.gather(
            *(
                rank_call(
                    self.ranks[r - 1].version.remote(), r, restartable=False, cfg=self.run_cfg
                )
                for r in alive
            )
        )
        odd = {r: v for r, v in zip(alive, versions, strict=True) if v != mine}
        if odd:
            raise RuntimeError(
                f"trainer ranks {sorted(odd)} hold versions {odd} while rank 0 holds {mine} "
                f"after rank(s) {lost} died mid-step: the step cannot be redone exactly; "
                "resume the run from its newest checkpoint: asyncflow run --resume DIR"
            )


async def take_over(
    train: DataParallelTrain, client: Any, step: int, first_group: int | None
) -> None:
    """On the replacement of trainer rank 0 (Ray restarted its actor), before its train stage
    (``train``, built at the coordinator's ``train_position``: ``step`` and the first group of
    its window) runs: bring the group back and say whether ``step`` was taken already.

    1. Rows of earlier windows still leased when rank 0 died (their acknowledgement, after the
       position was recorded, cut short) are acknowledged now.
    2. Every other rank finishes the call it was in (``quiesce``) and says its version; the
       one with the newest (``step`` + 1 if the step's optimizer step ran on it, else
       ``step``) hands its state to every rank, itself and the replacement included: the
       same weights, optimizer and RNG state everywhere, the step's gradients dropped.
    3. Every rank forms a new group with the replacement as its rank 0.
    The step is then trained again from its rows (they came back with the dead holder), or,
    taken already, its rows only go into its report."""
    t0 = time.monotonic()
    cfg, ranks, local = train.run_cfg, train.ranks, train.local
    if first_group is not None:
        stale = 0
        while True:
            meta = await client.get_meta(
                train.task,
                list(train.input_fields),
                timeout_s=0.5,
                lease_s=60.0,
                sampler=train.sampler,
                **train.sampler_options,
                batch_size=train.batch_size,
                max_group=first_group - 1,
            )
            if not len(meta):
                break
            await client.ack(meta)
            stale += len(meta)
        if stale:
            log.warning("trainer rank 0's replacement acknowledged %d settled rows", stale)
    numbered = list(enumerate(ranks, 1))
    versions = list(
        await asyncio.gather(
            *(rank_call(h.quiesce.remote(), r, restartable=False, cfg=cfg) for r, h in numbered)
        )
    )
    top = max(versions)
    if top not in (step, step + 1):
        raise TrainerLostError(
            f"trainer rank 0 died in step {step} and the other ranks hold versions {versions}: "
            "the step cannot be redone exactly; resume the run from its newest checkpoint: "
            "asyncflow run --resume DIR"
        )
    source = versions.index(top) + 1
    files = await rank_call(
        ranks[source - 1].state_files.remote(), source, restartable=False, cfg=cfg
    )
    await asyncio.gather(
        local.adopt_state(files),
        *(
            rank_call(h.adopt_state.remote(files), r, restartable=False, cfg=cfg)
            for r, h in numbered
        ),
    )
    host, port = local.endpoint()
    world = len(ranks) + 1
    await asyncio.gather(
        local.regroup(world, host, port),
        *(
            rank_call(h.regroup.remote(world, host, port), r, restartable=False, cfg=cfg)
            for r, h in numbered
        ),
    )
    seconds = time.monotonic() - t0
    train.taken_over(top > step, seconds)
    log.warning(
        "trainer rank 0 replaced: step %d %s, state from rank %d (version %d), %.2f s",
        step,
        "taken already (its rows are reported, not trained)" if top > step else "trained again",
        source,
        top,
        seconds,
    )
