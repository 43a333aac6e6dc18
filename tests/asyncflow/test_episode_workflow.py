"""Multi-turn episodes end to end: the workflow with an environment, on the tiny model.

The invariants of the one-turn workflow hold per episode (every group trained once and whole,
the staleness bound on each episode's oldest token), every token's version is recorded and
checked where it is trained (:class:`tests.asyncflow.episodes.CheckingTrain`), the trainer
gets every episode's loss mask (whose false entries leave the gradient unchanged:
``tests/engines/test_hf_engines.py``), and an
environment that raises or hangs costs its episode, never the run. Each runs in this process
and, where the rollout runs in a Ray actor, with ``deploy=ray``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import pytest

from asyncflow import EngineFactories, RunConfig, RunResult, run
from tests.asyncflow.conftest import RAY_START, RAY_TEST_TIMEOUT_S, deploys_by_k, small_config
from tests.asyncflow.episodes import CheckingTrain, mask_checking_trainer

EPISODES = [
    "task=guess_number",  # the untrained model rarely says a number: several turns each
    "rollout.max_turns=3",
    "rollout.max_new_tokens=3",
    "rollout.max_episode_tokens=48",
]


def _check_groups(result: RunResult, cfg: RunConfig, k: int) -> None:
    b, n = cfg.train.groups_per_step, cfg.rollout.group_size
    trained: list[int] = []
    for rep in result.reports:
        assert min(rep.staleness) >= 0 and max(rep.staleness) <= k, rep.staleness
        assert rep.groups == list(range(rep.step * b, (rep.step + 1) * b))  # whole, in order
        assert rep.samples == b * n
        trained += rep.groups
    assert trained == list(range(cfg.train.steps * b))  # every episode once, none dropped


@pytest.mark.parametrize(("deploy", "k"), deploys_by_k(ray_ks=()), indirect=["deploy"])
def test_episodes_keep_the_staleness_bound_and_every_token_version(
    out_dir: Path, deploy: list[str], k: int
) -> None:
    """In process and over the service (on Ray, with partial rollouts on too:
    :func:`test_partial_rollouts_within_episodes`)."""
    cfg = small_config(
        out_dir, *EPISODES, f"train.max_staleness={k}", "train.steps=6", *deploy, "train.dp_size=1"
    )
    result = run(
        cfg,
        adapters={"train": CheckingTrain},
        factories=EngineFactories(trainer=mask_checking_trainer),
    )
    _check_groups(result, cfg, k)
    for r in result.records:
        assert r["versions_checked"] == 1.0  # every trained row went through the checks
        assert 0.0 < r["loss_mask_frac"] < 1.0  # the observations are masked out
        assert r["turns_mean"] > 1.0  # multi-turn episodes
        assert sum(r["episode_end_reasons"].values()) == r["samples"]
        assert set(r["episode_end_reasons"]) <= {"done", "max_turns", "max_tokens"}
    if k == 0:  # synchronous: every token of a step's episodes from the step's own weights
        assert all(set(rep.sample_versions) == {rep.step} for rep in result.reports)
        assert all(r["multi_version_episodes"] == 0.0 for r in result.records)


@pytest.mark.parametrize(
    ("deploy", "k"), deploys_by_k(ray_ks=(0, 1, 2), ks=(2,)), indirect=["deploy"]
)
def test_partial_rollouts_within_episodes(out_dir: Path, deploy: list[str], k: int) -> None:
    """Multi-turn episodes with ``rollout.partial`` (eager weight sync, turns long enough for
    updates to land inside them): every group is still trained once within the bound on each
    episode's oldest model token (checked token by token by :class:`CheckingTrain`: -1
    exactly on the observations), with k >= 1 some episodes span versions, and the step's
    ``spanned_share`` is the share of episodes whose *model* tokens carry more than one
    version (the -1 tokens count in no version); every weight sync is recorded with its
    transfer and pause times. On Ray (generators, rollout and reward in actors) this is the
    test of the bound for every ``k``, of episodes and of partial rollouts alike."""
    cfg = small_config(
        out_dir,
        "task=guess_number",
        "rollout.max_turns=2",
        "rollout.max_new_tokens=24",
        "rollout.max_episode_tokens=96",
        "rollout.partial=true",
        "rollout.weight_sync=eager",
        f"train.max_staleness={k}",
        "train.steps=6",
        *deploy,
        "train.dp_size=1",
    )
    result = run(
        cfg,
        adapters={"train": CheckingTrain},
        factories=EngineFactories(trainer=mask_checking_trainer),
    )
    _check_groups(result, cfg, k)
    for rep in result.reports:
        for oldest, newest in zip(rep.sample_versions, rep.newest_versions, strict=True):
            assert 0 <= oldest <= newest <= rep.step
        if k == 0:  # synchronous: every token of a step's episodes from the step's weights
            assert set(rep.sample_versions) == set(rep.newest_versions) == {rep.step}
    for r in result.records:
        assert r["versions_checked"] == 1.0  # every trained row went through the checks
        assert 0.0 < r["loss_mask_frac"] < 1.0  # the observations are masked out
        assert r["spanned_share"] == pytest.approx(r["multi_version_episodes"])
        assert 0 <= r["span_max"] <= k
        assert all(s["transfer_s"] >= 0 and s["pause_s"] >= 0 for s in r["weight_syncs"])
    assert sum(r["turns_mean"] for r in result.records) > len(result.records)  # multi-turn
    spanned = sum(r["spanned_share"] for r in result.records)
    if k == 0:
        assert spanned == 0  # no trained episode ran across an update
    else:
        assert spanned > 0 and sum(r["kept_tokens"] for r in result.records) > 0


@pytest.mark.parametrize(
    "deploy_mode",
    [
        "local",
        pytest.param(
            "ray",
            marks=[pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(RAY_TEST_TIMEOUT_S)],
        ),
    ],
)
def test_environment_failures_are_retried_or_refilled_and_timeouts_trained(
    out_dir: Path, request: pytest.FixtureRequest, deploy_mode: str
) -> None:
    """A quarter of the secrets make the environment fail on every try: their episodes end
    ``env_error`` and their groups are dropped whole and refilled from new prompts (never
    trained, counted); one environment in three fails once and is retried; a quarter of the
    secrets are too slow for the episode's budget: ``timeout``, trained with its reward. Every
    step still trains ``B`` whole groups, each group is consumed once, and the run goes on."""
    extra = []
    if deploy_mode == "ray":
        request.getfixturevalue("ray_cluster")
        extra = ["deploy.mode=ray", RAY_START]
    cfg = small_config(
        out_dir,
        *EPISODES,
        "env.name=tests.asyncflow.episodes:FlakyEnv",
        "env.episode_timeout_s=0.25",
        "env.timeout_reward=-1.0",
        "env.threads=8",
        "train.steps=4",
        *extra,
    )
    result = run(cfg)
    b, n = cfg.train.groups_per_step, cfg.rollout.group_size
    consumed: list[int] = []
    for rep in result.reports:
        assert rep.samples == b * n and len(rep.groups) == b  # B whole groups per step
        assert set(rep.dropped) <= set(rep.filtered) and not set(rep.groups) & set(rep.filtered)
        consumed += rep.groups + rep.filtered
    assert sorted(consumed) == list(range(len(consumed)))  # each group once, none skipped
    records = result.records
    dropped = sum(r["groups_dropped"] for r in records)
    reasons: dict[str, int] = {}
    for r in records:
        for reason, count in r["episode_end_reasons"].items():
            reasons[reason] = reasons.get(reason, 0) + count
        assert abs(sum(r["episode_end_rates"].values()) - 1.0) < 1e-9
    assert dropped > 0 and reasons["env_error"] > 0 and reasons["timeout"] > 0, reasons
    assert reasons["env_error"] <= dropped * n  # every env_error episode in a dropped group
    assert sum(reasons.values()) == len(consumed) * n
    assert sum(r["env_retries"] for r in records) > 0  # the transient failures were retried
    assert min(r["reward"] for r in records) >= -1.0  # the timeout reward, trained


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(RAY_TEST_TIMEOUT_S)
def test_a_killed_rollout_actor_loses_no_episode(ray_cluster: None, tmp_path: Path) -> None:
    """SIGKILL the rollout actor (it holds every episode in flight) mid-run: Ray restarts it,
    the episodes it held come back when their leases end and are played again, and every
    group is trained exactly once and whole."""
    import ray

    from tests.asyncflow.test_ray_workflow import _kill_when

    out = tmp_path / "run"
    k, steps = 1, 10
    cfg = small_config(
        out,
        *EPISODES,
        "env.name=tests.asyncflow.episodes:SlowEnv",  # 0.2 s a step: the kill meets episodes
        "deploy.mode=ray",
        f"train.steps={steps}",
        f"train.max_staleness={k}",
        "transferqueue.lease_s=5",
        RAY_START,
    )
    killed: list[str] = []
    pids: list[int] = []
    back: list[bool] = []

    def kill_and_see_it_back() -> None:
        _kill_when(out, 2, ["-rollout"], killed, pids)
        deadline = time.monotonic() + RAY_TEST_TIMEOUT_S / 2
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
        name = max(n for n in names if n.endswith("-rollout"))
        while time.monotonic() < deadline and not back:
            with contextlib.suppress(Exception):  # (unavailable while it restarts)
                if ray.get(ray.get_actor(name).where.remote(), timeout=30)["pid"] != pids[0]:
                    back.append(True)
            time.sleep(0.5)

    killer = threading.Thread(target=kill_and_see_it_back, daemon=True)
    killer.start()
    result = run(cfg)
    killer.join(timeout=60)
    assert killed == ["-rollout"]
    assert back == [True]
    _check_groups(result, cfg, k)
    assert result.extra["restarts"].get("rollout", 0) >= 1
    assert result.records[-1]["restarts"] >= 1
