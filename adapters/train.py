"""``TrainAdapter``: whole GRPO groups in, optimizer steps out.

| consumes                                                  | produces                  |
|-----------------------------------------------------------|---------------------------|
| prompt_ids, response_ids, behaviour_logprobs, loss_mask,  | nothing (acks the rows);  |
| token_versions (``TrainBatch.extra``), generated_at,      | a step report per step    |
| reward, num_turns, end_reason, episode_info, episode_stats|                           |
| (+ ref_logprobs with a reference stage)                   |                           |

Each step trains exactly ``B = groups_per_step`` groups: those of its *window*, consecutive
group ids from the first one no earlier step consumed (the prompt feeder numbers groups in
admission order; step ``t`` of a run without filtering trains ``t*B .. (t+1)*B - 1``). It
takes them with the ``group`` sampler ordered by group id and ``max_group`` set to the end of
the window, a micro-batch of whole groups at a time, in whatever order they complete, and
calls ``forward_backward`` on each as it arrives (streaming: training starts before the last
group of the step is generated). After the step's ``B``-th group, ``optimizer_step``.

**Dynamic sampling** (DAPO's filter, ``dynamic_sampling=True``): a group whose rewards all tie
(every finite reward equal, or fewer than two finite) has zero advantages and teaches
nothing; it is not trained. The stage acknowledges its rows, counts it in the step's
``filtered`` groups and tells ``on_filtered`` (the feeder then admits a replacement), and the
step's window grows by one group. So step ``t`` trains the ``B`` unfiltered groups that follow
the previous step's window, every group is consumed (trained or filtered) exactly once, and a
group's step depends only on how many groups before it were filtered: the bound the feeder's
admission relies on (``asyncflow.feeder``). A step that filters more than
``FILTER_LIMIT * B`` groups fails the run (the rewards never separate: the task is too easy or
too hard for the policy).

**Dropped groups** (always, with or without dynamic sampling): a group with an episode that
ended ``env_error`` (its environment's infrastructure failed on every try, see
``engines.episodes.runner``) is never trained, not even its episodes that succeeded: it goes
the filtered groups' way (acknowledged, counted in the step's ``filtered`` and ``dropped``,
told to ``on_filtered`` so that the feeder admits a new prompt in its place, the window grows
by one group). So a group is trained whole or not at all, each group exactly once, and the
staleness bound holds by the same argument. ``timeout`` episodes (the policy's failure) are
trained with their reward.

**Token budgets** (``max_tokens_per_micro_batch``): a leased micro-batch of groups is packed
into engine calls of at most that many tokens (prompt + response, :mod:`engines.packing`);
one ``forward_backward`` per packed micro-batch, all before the step's one optimizer step, so
the gradient does not depend on the packing. Data-parallel trainers split the lease across
ranks by tokens first (``asyncflow.deploy.ray_hosts``). A group never spans two steps.

Advantages are group-normalized rewards: ``(r - mean(group)) / (std(group) + eps)``. A sample
whose reward is NaN (the reward function gave no verdict) gets advantage 0 and is left out of
its group's statistics. A sample is an episode (one turn, or several with an environment): one
reward and one advantage per episode, and the loss covers only the tokens its ``loss_mask``
marks (the model's own turns, never an observation's tokens).

Versions of a trained sample (step ``t`` trains with policy version ``t``), in the report:
``sample_versions`` the oldest token's (the row's ``version`` header: what ``staleness = t -
v`` and the bound are about), ``newest_versions`` the newest token's (partial rollouts:
the versions it spans), and ``ended_versions`` the trainer's version when its generation
ended: the number of optimizer steps finished at its ``generated_at`` time (this stage keeps
the time of each of its steps), clamped to ``[oldest, t]``. Staleness splits into the part
spent generating, ``ended - oldest`` (the generator's lag at the start included), and the part
spent queued, ``t - ended``. ``generated_at`` is wall-clock time, written by the rollout in its
own process: across nodes, as good as their clock sync. Only tokens the model generated count
here: an episode's observation tokens carry version -1 in ``token_versions`` and are left out.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from adapters.base import Adapter, StageOutput
from adapters.episodes import SUMMARY_FIELDS, EpisodeTally, failed_groups
from engines.packing import pack_by_tokens
from engines.protocols import TrainBatch, TrainingEngine
from transferqueue import BatchMeta, Ragged
from transferqueue.schema import Column

log = logging.getLogger(__name__)

__all__ = [
    "FILTER_LIMIT",
    "StepReport",
    "TrainAdapter",
    "group_advantages",
    "make_train_batch",
    "select_columns",
    "tied_groups",
    "train_micro_batches",
]

FILTER_LIMIT = 10
"""A step that filters more than this many times ``groups_per_step`` groups fails."""


def _group_index(groups: np.ndarray) -> tuple[np.ndarray, torch.Tensor]:
    """The distinct group ids (sorted) and each row's index among them."""
    ids, inverse = np.unique(np.asarray(groups), return_inverse=True)
    return ids, torch.from_numpy(inverse.astype(np.int64, copy=False).reshape(-1))


def group_advantages(
    rewards: torch.Tensor, groups: np.ndarray, *, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO advantages: rewards normalized within each group; NaN rewards give 0.

    Whole-column operations (a fixed number of tensor calls per batch, not per group): each
    group's mean and population standard deviation over its finite rewards, and 0 for a NaN
    reward or a group with fewer than two finite ones."""
    r = rewards.float().reshape(-1).cpu()  # (the group statistics on the host)
    if r.numel() == 0:
        return torch.zeros_like(r).to(rewards.device)
    ids, idx = _group_index(groups)
    ok = ~r.isnan()
    okf = ok.float()
    count = torch.zeros(len(ids)).index_add_(0, idx, okf)
    denom = count.clamp(min=1.0)
    mean = torch.zeros(len(ids)).index_add_(0, idx, torch.where(ok, r, 0.0)) / denom
    dev = torch.where(ok, r - mean[idx], 0.0)
    std = (torch.zeros(len(ids)).index_add_(0, idx, dev * dev) / denom).sqrt()
    valid = ok & (count[idx] >= 2)
    return torch.where(valid, dev / (std[idx] + eps), 0.0).to(rewards.device)


def tied_groups(rewards: torch.Tensor, groups: np.ndarray) -> list[int]:
    """Ids of the groups whose rewards all tie: every finite reward equal (exactly), or fewer
    than two finite ones. Their advantages are all 0 (see :func:`group_advantages`)."""
    r = rewards.float().reshape(-1).cpu()
    if r.numel() == 0:
        return []
    ids, idx = _group_index(groups)
    finite = torch.isfinite(r)
    count = torch.zeros(len(ids)).index_add_(0, idx, finite.float())
    lo = torch.full((len(ids),), math.inf).scatter_reduce_(
        0, idx, torch.where(finite, r, math.inf), "amin"
    )
    hi = torch.full((len(ids),), -math.inf).scatter_reduce_(
        0, idx, torch.where(finite, r, -math.inf), "amax"
    )
    tied = (count < 2) | (lo == hi)
    return [int(g) for g in ids[tied.numpy()]]


def select_columns(cols: dict[str, Column], positions: np.ndarray) -> dict[str, Column]:
    """The rows ``positions`` of every column (the columns of ``meta.select(positions)``)."""
    out: dict[str, Column] = {}
    idx = torch.from_numpy(np.asarray(positions, dtype=np.int64))
    for name, col in cols.items():
        if isinstance(col, Ragged):
            out[name] = col.take(positions)
        elif isinstance(col, torch.Tensor):
            out[name] = col.index_select(0, idx)
        else:
            out[name] = [col[int(i)] for i in positions]
    return out


def _newest_versions(token_versions: Ragged, oldest: np.ndarray) -> list[int]:
    """Per row: the newest version among its generated tokens (``>= 0``; -1 marks an
    observation's tokens), or ``oldest`` for a row without one. One segment reduction over
    the column's buffer, not a tensor call per row."""
    values = token_versions.values.reshape(-1).cpu().numpy().astype(np.int64, copy=False)
    offsets = token_versions.offsets.cpu().numpy()
    rows = len(offsets) - 1
    if rows == 0:
        return []
    # a sentinel -1 at the end: reduceat needs every start inside the buffer (empty rows)
    padded = np.concatenate([values, np.full(1, -1, dtype=np.int64)])
    starts = np.minimum(offsets[:-1], values.size)
    top = np.maximum.reduceat(padded, starts)
    top = np.where(offsets[1:] > offsets[:-1], top, -1)
    return np.where(top >= 0, top, oldest).tolist()


_SUMMED = ("loss", "num_tokens", "num_samples", "micro_batches")
_MAXED = ("staleness_max",)


def _merge(parts: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """Metrics of several ``forward_backward`` calls as one: totals summed (``loss``,
    counts), ``staleness_max`` the max, the rest means weighted by rows."""
    rows = sum(n for n, _ in parts) or 1
    out: dict[str, float] = {}
    for n, metrics in parts:
        for k, v in metrics.items():
            if k in _SUMMED:
                out[k] = out.get(k, 0.0) + float(v)
            elif k in _MAXED:
                out[k] = max(out.get(k, -math.inf), float(v))
            else:
                out[k] = out.get(k, 0.0) + float(v) * n / rows
    return out


def token_parts(
    cols: dict[str, Column], rows: int, max_tokens: int | None
) -> tuple[np.ndarray, list[np.ndarray]]:
    """Each row's prompt + response tokens, and the rows of each ``forward_backward`` call
    :func:`train_micro_batches` makes (one call, or packs of at most ``max_tokens``)."""
    prompts, responses = cols["prompt_ids"], cols["response_ids"]
    if not (isinstance(prompts, Ragged) and isinstance(responses, Ragged)):
        raise TypeError("train needs ragged prompt_ids and response_ids")
    lengths = (prompts.lengths + responses.lengths).numpy()
    if max_tokens is None:
        return lengths, [np.arange(rows, dtype=np.int64)]
    return lengths, pack_by_tokens(lengths, max_tokens)


async def train_micro_batches(
    engine: TrainingEngine,
    meta: BatchMeta,
    cols: dict[str, Column],
    advantages: torch.Tensor,
    loss_scale: float,
    *,
    use_reference: bool,
    max_tokens: int | None,
) -> tuple[dict[str, float], int, list[int]]:
    """``forward_backward`` over the rows of ``meta``: in one call, or with ``max_tokens`` in
    packed micro-batches of at most that many prompt + response tokens (a sample longer than
    the budget alone). Returns the merged metrics, the response tokens trained and each
    call's prompt + response tokens."""
    lengths, parts = token_parts(cols, len(meta), max_tokens)
    results: list[tuple[int, dict[str, float]]] = []
    tokens = 0
    for pos in parts:
        whole = pos.size == len(meta)
        batch = make_train_batch(
            meta if whole else meta.select(pos),
            cols if whole else select_columns(cols, pos),
            advantages[torch.from_numpy(pos)],
            use_reference,
        )
        metrics = await asyncio.to_thread(engine.forward_backward, batch, loss_scale)
        results.append((len(batch), metrics))
        tokens += batch.num_tokens
    return _merge(results), tokens, [int(lengths[pos].sum()) for pos in parts]


def _rows(col: Ragged, dtype: torch.dtype) -> list[torch.Tensor]:
    """The rows of ``col`` as views of one converted buffer (one conversion per column, not
    one per row)."""
    if not len(col):
        return []
    return list(torch.split(col.values.to(dtype), col.lengths.tolist(), dim=0))


def make_train_batch(
    meta: BatchMeta, cols: dict[str, Column], advantages: torch.Tensor, use_reference: bool
) -> TrainBatch:
    """The engine's view of a micro-batch read from TransferQueue (advantages computed by the
    caller, over whole groups)."""
    prompts, responses = cols["prompt_ids"], cols["response_ids"]
    blp = cols["behaviour_logprobs"]
    if not (
        isinstance(prompts, Ragged) and isinstance(responses, Ragged) and isinstance(blp, Ragged)
    ):
        raise TypeError("train needs ragged prompt_ids, response_ids and behaviour_logprobs")
    mask = cols.get("loss_mask")
    if mask is not None and not isinstance(mask, Ragged):
        raise TypeError(f"loss_mask must be a ragged column, got {type(mask).__name__}")
    extra: dict[str, Any] = {}
    token_versions = cols.get("token_versions")
    if isinstance(token_versions, Ragged):  # per token (-1: not generated, an observation)
        extra["token_versions"] = _rows(token_versions, torch.int64)
    ref = None
    if use_reference:
        ref_col = cols["ref_logprobs"]
        if not isinstance(ref_col, Ragged):
            raise TypeError("train needs a ragged ref_logprobs column with a reference stage")
        ref = ref_col.unbind()
    return TrainBatch(
        prompt_ids=_rows(prompts, torch.int64),
        response_ids=_rows(responses, torch.int64),
        behaviour_logprobs=blp.unbind(),
        advantages=advantages,
        versions=torch.from_numpy(meta.versions.copy()),
        ref_logprobs=ref,
        loss_mask=None if mask is None else mask.unbind(),
        extra=extra,
    )


@dataclass
class StepReport:
    """One optimizer step: what was trained and how."""

    step: int  # 0-based index of the step just taken
    version: int  # policy version after the step (= step + 1 on a fresh run)
    samples: int
    tokens: int
    reward_mean: float
    reward_std: float
    staleness: list[int]  # per trained sample: step - its oldest token's version
    sample_versions: list[int]  # per trained sample: its oldest token's version
    groups: list[int]
    metrics: dict[str, float] = field(default_factory=dict)
    filtered: list[int] = field(default_factory=list)
    """Groups of the step's window not trained: their rewards all tied (dynamic sampling), or
    dropped (``dropped``)."""
    dropped: list[int] = field(default_factory=list)
    """Groups of ``filtered`` dropped because an episode's environment failed
    (``env_error``)."""
    next_group: int = -1
    """The first group of the next step's window (every group before it was consumed)."""
    newest_versions: list[int] = field(default_factory=list)
    """Per trained sample: its newest token's version (partial rollouts: above the oldest)."""
    ended_versions: list[int] = field(default_factory=list)
    """Per trained sample: the trainer's version when its generation ended (see the module
    docstring): ``ended - oldest`` of its staleness was spent generating, ``step - ended``
    queued."""
    episodes: dict[str, Any] = field(default_factory=dict)
    """The step's episodes (trained, filtered and dropped): end reasons and their rates, the
    environment's counters, call latencies and wait times
    (:meth:`adapters.episodes.EpisodeTally.summary`)."""


class TrainAdapter(Adapter):
    """Training engine as the train stage (see the module docstring).

    ``first_step``/``first_group``: where a resumed run goes on (the step's window starts at
    ``first_group``, default ``first_step * groups_per_step``); ``on_filtered`` is awaited
    with the ids of the groups a batch filtered, once the batch is acknowledged.
    """

    task = "train"
    sampler = "group"

    def __init__(
        self,
        engine: TrainingEngine,
        *,
        group_size: int,
        groups_per_step: int,
        micro_batch_groups: int = 1,
        use_reference: bool = False,
        on_step: Callable[[StepReport], Awaitable[None]] | None = None,
        first_step: int = 0,
        first_group: int | None = None,
        dynamic_sampling: bool = False,
        on_filtered: Callable[[list[int]], Awaitable[None]] | None = None,
        max_tokens_per_micro_batch: int | None = None,
    ) -> None:
        if group_size < 1 or groups_per_step < 1 or micro_batch_groups < 1:
            raise ValueError(
                "group_size, groups_per_step and micro_batch_groups must be >= 1, got "
                f"{group_size}, {groups_per_step}, {micro_batch_groups}"
            )
        if max_tokens_per_micro_batch is not None and max_tokens_per_micro_batch < 1:
            raise ValueError(
                f"max_tokens_per_micro_batch must be >= 1 or None, got {max_tokens_per_micro_batch}"
            )
        self.engine = engine
        self.group_size = group_size
        self.groups_per_step = groups_per_step
        self.micro_batch_groups = min(micro_batch_groups, groups_per_step)
        self.use_reference = use_reference
        self.on_step = on_step
        self.dynamic_sampling = dynamic_sampling
        self.on_filtered = on_filtered
        self.max_tokens = max_tokens_per_micro_batch
        fields = [
            "prompt_ids",
            "response_ids",
            "behaviour_logprobs",
            "loss_mask",
            "reward",
            "token_versions",  # the metrics, and the decoupled loss interpolates by them
            "generated_at",
        ]
        if use_reference:
            fields.append("ref_logprobs")
        fields += SUMMARY_FIELDS
        self.tally = EpisodeTally()
        self.input_fields = tuple(fields)
        self.sampler_options = {"group_size": group_size, "order": "group"}
        self.batch_size = self.micro_batch_groups * group_size
        self.step = first_step
        self.window_start = first_step * groups_per_step if first_group is None else first_group
        self._groups_done = 0
        self._acc: dict[str, list[Any]] = self._new_acc()
        self._report: StepReport | None = None  # a finished step, reported after its batch
        self._just_filtered: list[int] = []  # told to on_filtered after the batch
        self._step_times: list[float] = []  # wall-clock end of each step taken here, in order

    @staticmethod
    def _new_acc() -> dict[str, list[Any]]:
        return {
            "rewards": [],
            "versions": [],
            "newest": [],
            "ended": [],
            "groups": [],
            "tokens": [],
            "metrics": [],
            "filtered": [],
            "dropped": [],
            "call_tokens": [],
            "rank_ratio": [],
        }

    @property
    def window_end(self) -> int:
        """The last group id of the current step's window (inclusive)."""
        return self.window_start + self.groups_per_step + len(self._acc["filtered"]) - 1

    def request(self) -> dict[str, Any]:
        left = self.groups_per_step - self._groups_done
        return {
            "batch_size": min(self.micro_batch_groups, left) * self.group_size,
            "max_group": self.window_end,
        }

    async def process(self, meta: BatchMeta, cols: dict[str, Column]) -> StageOutput:
        reward = cols["reward"]
        if not isinstance(reward, torch.Tensor):
            raise TypeError(f"train needs a dense reward column, got {type(reward).__name__}")
        lo, hi = self.window_start, self.window_end
        if self.holds_leases and bool((meta.groups < lo).any()):
            # rows of steps already trained and reported whose acknowledgement a dead holder
            # cut short, come back once the store learnt of its death (a replacement of
            # trainer rank 0 under Ray): acknowledged with this batch, never trained again
            keep = np.flatnonzero(meta.groups >= lo)
            log.warning(
                "step %d: %d rows of settled groups %s came back; acknowledged, not trained",
                self.step,
                len(meta) - len(keep),
                sorted({int(g) for g in meta.groups if g < lo}),
            )
            meta, cols = meta.select(keep), select_columns(cols, keep)
            reward = cols["reward"]
            assert isinstance(reward, torch.Tensor)
            if not len(meta):
                return StageOutput(tokens=0)
        if not all(lo <= int(g) <= hi for g in meta.groups):
            raise RuntimeError(
                f"step {self.step} got groups {sorted(set(meta.groups.tolist()))} outside its "
                f"window {lo}..{hi}; group ids must be admission indexes"
            )
        self.tally.add(cols)  # every episode the step consumes, trained or not
        dropped = failed_groups(cols, meta.groups)
        tied = tied_groups(reward, meta.groups) if self.dynamic_sampling else []
        tied = [g for g in tied if g not in dropped]
        tokens = 0
        if tied or dropped:
            self._filter(tied, dropped)
            keep = np.flatnonzero(~np.isin(meta.groups, tied + dropped))
            meta, cols = meta.select(keep), select_columns(cols, keep)
            reward = cols["reward"]
            assert isinstance(reward, torch.Tensor)
        if len(meta):
            advantages = group_advantages(reward, meta.groups)
            scale = 1.0 / (self.groups_per_step * self.group_size)
            metrics, tokens = await self.train_batch(meta, cols, advantages, scale)
            acc = self._acc
            acc["rewards"].append(reward)
            acc["versions"] += meta.versions.tolist()
            newest, ended = self._version_columns(meta, cols)
            acc["newest"] += newest
            acc["ended"] += ended
            acc["groups"] += meta.groups.tolist()
            acc["tokens"].append(tokens)
            acc["metrics"].append((len(meta), metrics))
            self._groups_done += len(meta) // self.group_size
        if self._groups_done >= self.groups_per_step:
            await self._finish_step()
        return StageOutput(tokens=tokens)

    def _filter(self, tied: list[int], dropped: list[int]) -> None:
        filtered = self._acc["filtered"]
        filtered += tied + dropped
        self._acc["dropped"] += dropped
        self._just_filtered += tied + dropped
        if len(filtered) <= FILTER_LIMIT * self.groups_per_step:
            return
        limit = f"more than {FILTER_LIMIT} x train.groups_per_step={self.groups_per_step}"
        drops = len(self._acc["dropped"])
        if drops * 2 >= len(filtered):
            causes = self.tally.causes()
            raise RuntimeError(
                f"step {self.step} dropped {drops} groups whose environment failed on every "
                f"try (env_error) and filtered {len(filtered) - drops} ({limit}): the "
                "environment's infrastructure keeps failing"
                + (f"; failed tries by cause: {causes}" if causes else "")
                + "; fix what the causes name (start the server, check its URL and protocol), "
                "or raise env.retries or env.timeout_s"
            )
        raise RuntimeError(
            f"step {self.step} filtered {len(filtered)} groups whose rewards all tied "
            f"({limit}): the rewards do not separate the policy's answers; make the task "
            "harder or easier, or set train.dynamic_sampling=false"
        )

    def _version_columns(
        self, meta: BatchMeta, cols: dict[str, Column]
    ) -> tuple[list[int], list[int]]:
        """Per row: its newest token's version, and the trainer's version when its generation
        ended (see the module docstring)."""
        oldest = meta.versions.astype(np.int64, copy=False)
        token_versions, generated_at = cols["token_versions"], cols["generated_at"]
        if not isinstance(token_versions, Ragged) or not isinstance(generated_at, torch.Tensor):
            raise TypeError("train needs a ragged token_versions and a dense generated_at column")
        newest = _newest_versions(token_versions, oldest)
        first = self.step - len(self._step_times)  # the version before this stage's first step
        done = np.searchsorted(
            np.asarray(self._step_times, dtype=np.float64),
            generated_at.double().reshape(-1).cpu().numpy(),
            side="right",
        )
        ended = np.minimum(np.maximum(first + done, oldest), self.step).tolist()
        return newest, ended

    async def train_batch(
        self,
        meta: BatchMeta,
        cols: dict[str, Column],
        advantages: torch.Tensor,
        loss_scale: float,
    ) -> tuple[dict[str, float], int]:
        """Accumulate the gradients of one micro-batch of whole groups (in packed engine
        calls with a token budget); returns the engine's metrics and the response tokens
        trained. Override to train elsewhere (data-parallel ranks)."""
        metrics, tokens, calls = await train_micro_batches(
            self.engine,
            meta,
            cols,
            advantages,
            loss_scale,
            use_reference=self.use_reference,
            max_tokens=self.max_tokens,
        )
        self.record_split(calls, [sum(calls)])
        return metrics, tokens

    def record_split(self, call_tokens: list[int], rank_tokens: list[int]) -> None:
        """Note how a micro-batch was split: prompt + response tokens of each engine call and
        of each data-parallel rank (reported per step with a token budget:
        ``micro_batch_tokens_max``, ``rank_tokens_max_over_mean``)."""
        self._acc["call_tokens"] += call_tokens
        total = sum(rank_tokens)
        if total:
            self._acc["rank_ratio"].append(max(rank_tokens) * len(rank_tokens) / total)

    async def optimizer_step(self) -> dict[str, float]:
        """Step the optimizer once the step's micro-batches are in (override with
        :meth:`train_batch`)."""
        return await asyncio.to_thread(self.engine.optimizer_step)

    async def _finish_step(self) -> None:
        step_metrics = await self.optimizer_step()
        self._step_times.append(time.time())  # the trainer holds version step + 1 from now
        acc = self._acc
        rewards = torch.cat(acc["rewards"]).float()
        valid = rewards[~rewards.isnan()]
        merged: dict[str, float] = {}
        total = sum(n for n, _ in acc["metrics"])
        for n, m in acc["metrics"]:
            for k, v in m.items():
                merged[k] = merged.get(k, 0.0) + float(v) * n / total
        merged.update({k: float(v) for k, v in step_metrics.items()})
        if self.max_tokens is not None and acc["call_tokens"]:
            merged["micro_batch_tokens_max"] = float(max(acc["call_tokens"]))
            merged["rank_tokens_max_over_mean"] = float(max(acc["rank_ratio"], default=1.0))
        next_group = self.window_end + 1
        report = StepReport(
            step=self.step,
            version=self.engine.version,
            samples=len(acc["versions"]),
            tokens=int(sum(acc["tokens"])),
            reward_mean=float(valid.mean()) if valid.numel() else math.nan,
            reward_std=float(valid.std(unbiased=False)) if valid.numel() else math.nan,
            staleness=[self.step - v for v in acc["versions"]],
            sample_versions=list(acc["versions"]),
            groups=sorted(set(acc["groups"])),
            metrics=merged,
            filtered=sorted(acc["filtered"]),
            dropped=sorted(acc["dropped"]),
            next_group=next_group,
            newest_versions=list(acc["newest"]),
            ended_versions=list(acc["ended"]),
            episodes=self.tally.summary(),
        )
        self.step += 1
        self.window_start = next_group
        self._groups_done = 0
        self._acc = self._new_acc()
        self._report = report

    async def after_batch(self) -> None:
        """Tell ``on_filtered`` what the batch filtered (its rows now acknowledged), then
        report the step the batch finished (its time now in the stage timeline)."""
        filtered, self._just_filtered = self._just_filtered, []
        if filtered and self.on_filtered is not None:
            await self.on_filtered(filtered)
        report, self._report = self._report, None
        if report is not None and self.on_step is not None:
            await self.on_step(report)
