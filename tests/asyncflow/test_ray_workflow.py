"""The distributed workflow (``deploy=ray``): placement on several nodes, dead stage hosts
recovered.

Both start Ray actors for every stage instance; they are marked ``ray`` and ``slow``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from asyncflow import EngineFactories, StageError, run
from asyncflow.deploy.ray import RayDeployment
from asyncflow.feeder import PromptFeeder
from tests.asyncflow.cluster_probes import run_probe
from tests.asyncflow.conftest import RAY_START, RAY_TEST_TIMEOUT_S, small_config, until_holding
from tests.asyncflow.faulty import (
    rank0_dying_trainer_factory,
    rank1_dying_trainer_factory,
    slow_generator,
    slow_reward_factory,
    train_leased,
)

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(RAY_TEST_TIMEOUT_S)]

ROOT = Path(__file__).resolve().parents[2]


def test_a_run_over_three_nodes_lands_where_the_config_says_and_broadcasts_its_weights() -> None:
    """Three Ray nodes (``placement_probe``): every stage host and TransferQueue server lands
    on the node its placement names; the trainer and the generators being on different
    nodes, the weights go by ``broadcast``; every step trains its window, each group once,
    within the staleness bound, with weights that came across (updates counted)."""
    pytest.importorskip("ray")
    from tests.asyncflow.placement_probe import MAX_STALENESS, STEPS

    report = run_probe("tests.asyncflow.placement_probe", RAY_TEST_TIMEOUT_S - 60)
    where = report["where"]
    units = {k: v for k, v in where.items() if k.startswith("tq/")}
    assert set(units) == {"tq/unit0", "tq/unit1", "tq/controller"}
    assert set(units.values()) == {"node_a"}  # a custom resource only node a declares
    for stage in ("rollout/instance0", "rollout/instance1", "reward/0", "reward/1"):
        assert where[stage] == "node_b", (stage, where)
    assert where["train"] == where["train/rank1"] == "node_c"  # pinned by node id
    assert report["weight_transport"] == "broadcast"
    b = report["groups_per_step"]
    steps = report["steps"]
    assert [s["step"] for s in steps] == list(range(STEPS))
    for s in steps:
        assert s["groups"] == list(range(s["step"] * b, (s["step"] + 1) * b))
        assert min(s["staleness"]) >= 0 and max(s["staleness"]) <= MAX_STALENESS
    # generators sampled with versions the trainer broadcast (they start at version 0)
    assert report["weight_updates"] >= 1
    assert max(steps[-1]["sample_versions"]) >= STEPS - 1 - MAX_STALENESS >= 1


def _until_steps(out: Path, steps: int) -> None:
    """Return once the run writing to ``out`` has recorded ``steps`` steps (at most 600 s)."""
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            return
        time.sleep(0.2)


def _kill_when(
    out: Path,
    after_steps: int,
    targets: list[str],
    killed: list[str],
    pids: list[int] | None = None,
    holding: str | None = None,
) -> None:
    """Once ``after_steps`` steps are recorded (and, with ``holding``, that host is seen
    holding a lease), SIGKILL the stage hosts whose actor names end with ``targets`` (their
    processes, as an OOM killer would; their pids go to ``pids``)."""
    import ray

    _until_steps(out, after_steps)
    if holding is not None and not until_holding(out, holding):
        return
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    for suffix in targets:
        name = max(n for n in names if n.endswith(suffix))
        pid = ray.get(ray.get_actor(name).where.remote(), timeout=60)["pid"]
        os.kill(pid, signal.SIGKILL)
        killed.append(suffix)
        if pids is not None:
            pids.append(pid)


class _AdmissionGate:
    """Holds the driver's feeder before it puts group ``first`` or a later one, until
    :meth:`open` (or ``bound_s``): a test that kills stage hosts keeps the run going until
    their restarts are seen, however long a loaded machine takes to start an actor (a
    restarted generator imports torch and builds its engine), instead of racing them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, first: int, bound_s: float) -> None:
        self._open = threading.Event()
        real = PromptFeeder._put

        async def put(
            feeder: PromptFeeder, group_ids: Sequence[int], required: Sequence[int]
        ) -> None:
            if max(group_ids) >= first:
                deadline = time.monotonic() + bound_s
                while not self._open.is_set() and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
            await real(feeder, group_ids, required)

        monkeypatch.setattr(PromptFeeder, "_put", put)

    def open(self) -> None:
        self._open.set()


def _restarted(names: list[str], generator: str, worker: str, old_pid: int) -> bool:
    """The generator registered again with the coordinator, and the worker's actor answers
    from a new process."""
    import ray

    coord = ray.get_actor(max(n for n in names if n.endswith("-coordinator")))
    restarts = ray.get(coord.stats.remote(), timeout=30)["restarts"]
    if restarts.get(generator, 0) < 1:
        return False
    actor = ray.get_actor(max(n for n in names if n.endswith(f"-{worker}")))
    return bool(ray.get(actor.where.remote(), timeout=30)["pid"] != old_pid)


def test_killed_generator_and_reward_hosts_are_recovered(
    ray_cluster: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL a generator and a reward worker mid-run: Ray restarts them, the driver runs
    them again, what they held comes back (the generator's call at once, the reward worker's
    rows when their lease ends), and the run finishes with every invariant intact. The
    driver's feeder waits before step 8's groups until both restarts are seen (the
    generator registered again, the worker answers from a new process), so that the run
    outlasts them on any machine."""
    import ray

    out = tmp_path / "run"
    k, steps = 1, 30
    cfg = small_config(
        out,
        "deploy.mode=ray",
        "rollout.instances=2",
        "reward.instances=2",
        f"train.steps={steps}",
        f"train.max_staleness={k}",
        "transferqueue.lease_s=5",
        RAY_START,
    )
    gate = _AdmissionGate(monkeypatch, 8 * cfg.train.groups_per_step, RAY_TEST_TIMEOUT_S / 2)
    killed: list[str] = []
    pids: list[int] = []
    seen: list[bool] = []

    def kill_then_open_the_gate_once_both_came_back() -> None:
        try:
            _kill_when(out, 3, ["-instance0", "-reward-0"], killed, pids)
            names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
            old_pid = pids[-1]
            deadline = time.monotonic() + RAY_TEST_TIMEOUT_S / 2
            while time.monotonic() < deadline:
                with contextlib.suppress(Exception):  # (unavailable while it restarts)
                    if _restarted(names, "instance0", "reward-0", old_pid):
                        seen.append(True)
                        return
                time.sleep(0.5)
        finally:
            gate.open()

    killer = threading.Thread(target=kill_then_open_the_gate_once_both_came_back, daemon=True)
    killer.start()
    # a reward with latency: the kill meets groups in every stage
    result = run(cfg, factories=EngineFactories(reward=slow_reward_factory))
    killer.join(timeout=60)
    assert killed == ["-instance0", "-reward-0"]
    assert seen == [True], "the restarts were not seen within the bound"
    b = cfg.train.groups_per_step
    trained: list[int] = []
    for rep in result.reports:
        assert min(rep.staleness) >= 0 and max(rep.staleness) <= k
        assert rep.groups == list(range(rep.step * b, (rep.step + 1) * b))
        trained += rep.groups
    assert trained == list(range(steps * b))  # every group trained exactly once
    assert result.extra["restarts"].get("rollout/instance0", 0) >= 1
    assert result.extra["restarts"].get("reward/0", 0) >= 1
    assert result.extra["generator_restarts"].get("instance0", 0) >= 1  # it registered again
    assert result.records[-1]["restarts"] >= 2


def test_a_ray_run_rides_through_its_tq_controller_actor_killed(
    ray_cluster: None, tmp_path: Path
) -> None:
    """TransferQueue deployed on Ray by the run, with a ``state_dir``: its controller actor
    SIGKILLed after the first step is restarted by Ray with its state, the driver and every
    stage host ride through it (``transferqueue.ride_through_s``), and every step still
    trains exactly its window, each group once and whole, within the staleness bound. The
    weights go through Ray's object store (``deploy.weight_transport=ray``), the transport
    no other test runs."""
    import ray

    out = tmp_path / "run"
    steps, per_step, k = 8, 2, 1
    cfg = small_config(
        out,
        "deploy.mode=ray",
        "transferqueue.mode=ray",
        f"transferqueue.state_dir={tmp_path / 'state'}",
        f"transferqueue.ride_through_s={RAY_TEST_TIMEOUT_S // 4}",
        f"train.steps={steps}",
        f"train.groups_per_step={per_step}",
        f"train.max_staleness={k}",
        "deploy.weight_transport=ray",
        RAY_START,
    )
    pids: list[int] = []

    def kill_the_controller_after_the_first_step() -> None:
        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + RAY_TEST_TIMEOUT_S
        while not (metrics.exists() and metrics.read_text().strip()):
            if time.monotonic() > deadline:
                return
            time.sleep(0.1)
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
        ctl = ray.get_actor(next(n for n in names if n.endswith("-tq-controller")))
        pids.append(ray.get(ctl.pid.remote(), timeout=60))
        os.kill(pids[0], signal.SIGKILL)
        while time.monotonic() < deadline:  # (Ray answers ActorUnavailableError meanwhile)
            try:
                pids.append(ray.get(ctl.pid.remote(), timeout=10))
                return
            except Exception:
                time.sleep(0.5)

    killer = threading.Thread(target=kill_the_controller_after_the_first_step, daemon=True)
    killer.start()
    # a reward with latency: the kill meets groups in every stage
    result = run(cfg, factories=EngineFactories(reward=slow_reward_factory))
    killer.join(timeout=120)
    assert len(pids) == 2 and pids[0] != pids[1], f"no controller restart seen: {pids}"
    assert [r.step for r in result.reports] == list(range(steps))
    for r in result.reports:
        assert r.groups == list(range(r.step * per_step, (r.step + 1) * per_step))
        assert r.samples == per_step * cfg.rollout.group_size
        assert min(r.staleness) >= 0 and max(r.staleness) <= k
    assert result.extra["weight_transport"] == "ray"
    assert result.extra["weight_updates"] >= 1
    assert max(result.reports[-1].sample_versions) >= steps - 1 - k  # (generators start at 0)


def test_a_dead_trainer_rank_0_not_restarted_ends_the_run_naming_it(
    ray_cluster: None, tmp_path: Path
) -> None:
    """Trainer rank 0 not restarted (``deploy.max_restarts=0``): its death must end the run at
    once with an error that names it, says why and names the command that resumes the run,
    never leave another rank waiting in a collective."""
    out = tmp_path / "run"
    cfg = small_config(
        out,
        "deploy.mode=ray",
        "train.dp_size=2",
        "train.steps=40",
        "deploy.max_restarts=0",
        RAY_START,
    )
    killed: list[str] = []
    killer = threading.Thread(
        target=_kill_when, args=(out, 2, ["-train-rank0"], killed), daemon=True
    )
    killer.start()
    with pytest.raises(StageError, match=r"stage 'train' failed: .*died") as failed:
        run(cfg, factories=EngineFactories(reward=slow_reward_factory))
    text = str(failed.value)
    assert "trainer rank 0 died" in text and "deploy.max_restarts=0" in text, text
    assert "asyncflow run --resume DIR" in text and "checkpoint.every_steps=N" in text, text
    killer.join(timeout=60)
    assert killed == ["-train-rank0"]


@pytest.mark.parametrize("rank", [1, 0])
def test_a_killed_trainer_rank_is_replaced_and_its_step_redone(
    ray_cluster: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rank: int
) -> None:
    """SIGKILL trainer rank 1 or rank 0 of two (ddp) mid-run: Ray restarts it, a surviving
    rank's weights and optimizer state go to the replacement, the group forms again and the
    step in flight is redone (rank 0's replacement takes the train stage over, the step's
    rows back from the dead holder), so the step that meets the kill costs at most 10 s over
    a normal one (or Ray's restart of the actor plus 3 s on a loaded machine), every group is
    trained exactly once, within the staleness bound, both ranks end with the same weights,
    and the step records show the recovery."""
    out = tmp_path / "run"
    k, steps, kill_after = 1, 14, 4
    cfg = small_config(
        out,
        "deploy.mode=ray",
        "train.dp_size=2",
        f"train.steps={steps}",
        f"train.max_staleness={k}",
        RAY_START,
    )
    killed: list[str] = []
    killer = threading.Thread(
        target=_kill_when, args=(out, kill_after, [f"-train-rank{rank}"], killed), daemon=True
    )
    digests: list[tuple[int, str]] = []
    real_close = RayDeployment.close

    async def close(dep: RayDeployment) -> None:  # the ranks' state before they stop
        if not digests:
            digests.extend(await asyncio.gather(*(t.digest.remote() for t in dep._trainers)))
        await real_close(dep)

    monkeypatch.setattr(RayDeployment, "close", close)
    killer.start()
    result = run(cfg)
    killer.join(timeout=60)
    assert killed == [f"-train-rank{rank}"]
    # the replacement holds the survivor's weights and version: it adopted them and stepped
    assert len(digests) == 2 and digests[0] == digests[1] and digests[0][0] == steps
    b = cfg.train.groups_per_step
    trained: list[int] = []
    for rep in result.reports:
        assert min(rep.staleness) >= 0 and max(rep.staleness) <= k
        assert rep.groups == list(range(rep.step * b, (rep.step + 1) * b))
        trained += rep.groups
    assert trained == list(range(steps * b))  # every group trained exactly once
    assert [r.version for r in result.reports] == list(range(1, steps + 1))  # one step each
    assert result.extra["restarts"].get("train/rank1" if rank else "train", 0) >= 1
    records = result.records
    recovery_s = sum(r["rank_recovery_s"] for r in records)
    restart_s = sum(r["restart_s"] for r in records)
    assert recovery_s > 0, f"rank {rank} was never recovered"
    normal = sorted(r["step_s"] for r in records[1:kill_after])
    median = normal[len(normal) // 2]
    worst = max(r["step_s"] for r in records[kill_after - 1 :])
    print(
        f"trainer rank {rank} killed: worst step {worst:.2f} s, normal {median:.2f} s, Ray restart "
        f"{restart_s:.2f} s, rank recovery (restart + state + regroup + redo) {recovery_s:.2f} s"
    )
    assert worst <= median + max(10.0, restart_s + 3.0), [round(r["step_s"], 2) for r in records]
    assert worst < 60.0


@pytest.mark.parametrize("where", ["forward_backward", "optimizer_step"])
def test_a_trainer_rank_killed_at_a_known_point_of_its_step_is_recovered_exactly(
    ray_cluster: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Trainer rank 1 SIGKILLs its own process at a known point of step 3: in its second
    micro-batch (rank 0 has the replacement train the step's two parts again), or in its
    optimizer step after the gradient all-reduce (rank 0 has stepped: the replacement takes
    the stepped state). Either way every group is trained once, every step is one version,
    and both ranks end with the same weights and version."""
    out = tmp_path / "run"
    steps = 8
    cfg = small_config(
        out,
        "deploy.mode=ray",
        "train.dp_size=2",
        "train.micro_batch_groups=1",  # two micro-batches a step
        f"train.steps={steps}",
        RAY_START,
    )
    digests: list[tuple[int, str]] = []
    real_close = RayDeployment.close

    async def close(dep: RayDeployment) -> None:
        if not digests:
            digests.extend(await asyncio.gather(*(t.digest.remote() for t in dep._trainers)))
        await real_close(dep)

    monkeypatch.setattr(RayDeployment, "close", close)
    result = run(cfg, factories=EngineFactories(trainer=rank1_dying_trainer_factory(where)))
    assert (out / "rank1-killed").exists()
    b = cfg.train.groups_per_step
    assert [g for r in result.reports for g in r.groups] == list(range(steps * b))
    assert [r.version for r in result.reports] == list(range(1, steps + 1))
    assert result.extra["restarts"].get("train/rank1", 0) == 1
    assert sum(r["rank_recovery_s"] for r in result.records) > 0
    # the dead rank's parts of step 3 trained again (both micro-batches), or none: stepped
    redone = [r["rank_parts_redone"] for r in result.records]
    assert redone == [0] * 3 + [2 if where == "forward_backward" else 0] + [0] * (steps - 4)
    assert len(digests) == 2 and digests[0] == digests[1] and digests[0][0] == steps


@pytest.mark.parametrize("where", ["forward_backward", "optimizer_step"])
def test_trainer_rank_0_killed_at_a_known_point_of_its_step_is_taken_over_exactly(
    ray_cluster: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Trainer rank 0 SIGKILLs its own process at a known point of step 3: in its second
    micro-batch (rank 1 has not stepped: the replacement trains the step again from its rows,
    which came back with their dead holder), or in its optimizer step after the gradient
    all-reduce (rank 1 has stepped: the replacement takes the stepped state and only reports
    the step, its rows acknowledged, not trained again). Either way every group is trained
    once, every step is one version, and both ranks end with the same weights and version."""
    out = tmp_path / "run"
    steps = 8
    cfg = small_config(
        out,
        "deploy.mode=ray",
        "train.dp_size=2",
        "train.micro_batch_groups=1",  # two micro-batches a step
        f"train.steps={steps}",
        RAY_START,
    )
    digests: list[tuple[int, str]] = []
    real_close = RayDeployment.close

    async def close(dep: RayDeployment) -> None:
        if not digests:
            digests.extend(await asyncio.gather(*(t.digest.remote() for t in dep._trainers)))
        await real_close(dep)

    monkeypatch.setattr(RayDeployment, "close", close)
    result = run(cfg, factories=EngineFactories(trainer=rank0_dying_trainer_factory(where)))
    assert (out / "rank0-killed").exists()
    b = cfg.train.groups_per_step
    assert [g for r in result.reports for g in r.groups] == list(range(steps * b))
    assert [r.version for r in result.reports] == list(range(1, steps + 1))
    assert [r.step for r in result.reports] == list(range(steps))
    assert result.extra["restarts"].get("train", 0) == 1
    assert result.records[3]["rank_recovery_s"] > 0
    taken = [r.metrics.get("step_taken_over", 0.0) for r in result.reports]
    assert taken == [0.0] * 3 + [1.0 if where == "optimizer_step" else 0.0] + [0.0] * (steps - 4)
    assert len(digests) == 2 and digests[0] == digests[1] and digests[0][0] == steps


def test_groups_a_dead_unit_actor_took_are_regenerated_on_the_ray_workflow(
    ray_cluster: None, tmp_path: Path
) -> None:
    """The Ray workflow over TransferQueue's Ray deployment: a storage unit actor SIGKILLed
    after the first step (Ray restarts it empty). The groups whose rows it took are retired
    and admitted again by the driver, the stage hosts give back batches that lost rows, and
    every step still trains exactly its window, each group once and whole, within the
    staleness bound."""
    import ray

    from transferqueue.deploy.ray import start_on_ray

    out = tmp_path / "run"
    steps, per_step, k = 8, 2, 1
    prefix = f"tq-regen-{os.getpid()}"
    with start_on_ray(num_units=2, spread_bytes=0, name_prefix=prefix) as tq:  # rows on both
        cfg = small_config(
            out,
            "deploy.mode=ray",
            "transferqueue.mode=connect",
            f"transferqueue.address={tq.address}",
            f"train.steps={steps}",
            f"train.groups_per_step={per_step}",
            f"train.max_staleness={k}",
            RAY_START,
        )
        pid = ray.get(ray.get_actor(f"{prefix}-unit1").pid.remote(), timeout=60)
        killed: list[str] = []
        held: list[int] = []  # unit1's bytes when it was killed
        watcher = tq.client()

        def kill_after_first_step() -> None:
            # after the first step, while unit1 holds rows of the run and the train stage has
            # none leased: the kill takes rows it has not read (see train_leased)
            metrics = out / "metrics.jsonl"
            deadline = time.monotonic() + RAY_TEST_TIMEOUT_S
            while time.monotonic() < deadline:
                if metrics.exists() and metrics.read_text().strip():
                    stats = watcher.stats()["controller"]
                    on_unit1 = int(stats["unit_bytes"][1])
                    if on_unit1 > 0 and train_leased(stats) == 0:
                        os.kill(pid, signal.SIGKILL)
                        killed.append("unit1")
                        held.append(on_unit1)
                        return
                time.sleep(0.1)

        killer = threading.Thread(target=kill_after_first_step, daemon=True)
        killer.start()
        # a reward with latency: when the unit dies, generated groups wait for their reward,
        # so rows the train stage has not consumed yet are lost
        result = run(cfg, factories=EngineFactories(reward=slow_reward_factory))
        killer.join(timeout=60)
        assert killed == ["unit1"], "the run ended before unit1 held rows after a step"
        lost = tq.client().stats()["controller"]["rows_lost"]
        assert lost > 0, f"unit1 held {held} bytes when killed, yet no row was lost"
    regenerated = result.extra["regenerated_groups"]
    assert regenerated, f"{lost} rows lost, no group put again"
    assert len(regenerated) == len(set(regenerated)), f"a group put again twice: {regenerated}"
    assert [r.step for r in result.reports] == list(range(steps))
    for r in result.reports:
        assert r.groups == list(range(r.step * per_step, (r.step + 1) * per_step)), r
        assert r.samples == per_step * cfg.rollout.group_size, r
        assert min(r.staleness) >= 0 and max(r.staleness) <= k, r


@pytest.mark.parametrize(
    ("target", "job", "busy"),
    [
        # responses long enough, and every generate call 0.5 s longer, that generation
        # outlasts training, and the kill waits until the live view shows the rollout holding
        # a lease: it finds rows leased to it (without, it could wait on admission and die
        # holding none)
        ("-rollout", "rollout", "rollout.max_new_tokens=24"),
        ("-reward-0", "reward", "rollout.max_new_tokens=4"),
    ],
)
def test_a_killed_stage_host_costs_seconds_not_its_lease(
    ray_cluster: None, tmp_path: Path, target: str, job: str, busy: str
) -> None:
    """SIGKILL a stage host (rollout, reward) mid-run, its leases as long as the default
    (120 s): the rows it held come back when it is seen gone (its heartbeat stops; its
    replacement says it replaces it), so the step that meets the kill costs at most 10 s more
    than a normal one, every group is trained once, within the staleness bound, and the step
    records show the restart and the rows returned."""
    out = tmp_path / "run"
    k, steps, kill_after = 1, 14, 4
    cfg = small_config(
        out,
        "deploy.mode=ray",
        f"train.steps={steps}",
        f"train.max_staleness={k}",
        "transferqueue.lease_s=120",
        busy,
        RAY_START,
    )
    killed: list[str] = []
    holding = "rollout" if job == "rollout" else None
    killer = threading.Thread(
        target=_kill_when, args=(out, kill_after, [target], killed, None, holding), daemon=True
    )
    killer.start()
    slow = EngineFactories(generator=slow_generator) if holding else None
    result = run(cfg, factories=slow)
    killer.join(timeout=60)
    assert killed == [target]
    b = cfg.train.groups_per_step
    trained: list[int] = []
    for rep in result.reports:
        assert min(rep.staleness) >= 0 and max(rep.staleness) <= k
        trained += rep.groups
    assert trained == list(range(steps * b))  # every group trained exactly once
    assert result.extra["restarts"].get(job, 0) >= 1
    records = result.records
    normal = sorted(r["step_s"] for r in records[1:kill_after])
    median = normal[len(normal) // 2]
    worst = max(r["step_s"] for r in records[kill_after - 1 :])
    restart_s = sum(r["restart_s"] for r in records)
    returned = sum(r["rows_returned"] for r in records)
    print(
        f"{job} host killed: worst step {worst:.2f} s, normal {median:.2f} s, restart "
        f"{restart_s:.2f} s, rows returned {returned}"
    )
    # at most 10 s over a normal step, unless Ray took longer than that to start the
    # replacement (a one-instance stage waits for it; a loaded machine): never the lease
    assert worst <= median + max(10.0, restart_s + 3.0), [round(r["step_s"], 2) for r in records]
    assert worst < 60.0
    assert sum(r["rows_returned"] for r in records) >= 1
    assert sum(r["restart_s"] for r in records) > 0


def _probe_classes(out: Path, after_steps: int, seen: dict[str, dict[str, int]]) -> None:
    """Once ``after_steps`` steps are recorded, the scheduling class of every thread of every
    named actor."""
    import ray

    def thread_classes(actor: object) -> dict[str, int]:  # (local: pickled by value)
        classes = {}
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError), open(f"/proc/self/task/{tid}/comm") as f:
                classes[f"{f.read().strip()}:{tid}"] = os.sched_getscheduler(int(tid))
        return classes

    def stage_loops(actor: object) -> dict[str, int]:  # where a stage host's stages run
        tq = getattr(actor, "_tq", None)
        if tq is None or not getattr(actor, "runners", None):
            return {}
        workers = {"on the client's loop": 0, "elsewhere": 0}
        for loop, where in ((tq._io.loop, "on the client's loop"), (None, "elsewhere")):
            with contextlib.suppress(RuntimeError):  # (no loop running on this thread)
                tasks = asyncio.all_tasks(loop) if loop is not None else asyncio.all_tasks()
                names = [t.get_coro().__qualname__ for t in tasks]  # type: ignore[union-attr]
                workers[where] = sum(n == "StageRunner._worker" for n in names)
        return workers

    _until_steps(out, after_steps)
    try:
        for a in ray.util.list_named_actors(all_namespaces=True):
            handle = ray.get_actor(a["name"], namespace=a["namespace"])
            seen[a["name"]] = ray.get(handle.__ray_call__.remote(thread_classes), timeout=60)
            if workers := ray.get(handle.__ray_call__.remote(stage_loops), timeout=60):
                seen[f"stages of {a['name']}"] = workers
    except Exception as e:  # (the test reports it)
        seen["error"] = {repr(e): -1}


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux's SCHED_BATCH")
def test_every_actor_of_a_ray_run_runs_in_sched_batch(ray_cluster: None, tmp_path: Path) -> None:
    """``deploy.batch_sched`` (the default): every thread of the stage hosts, the coordinator
    and TransferQueue's servers is in ``SCHED_BATCH``, but for an engine's compute call in
    progress (the normal class for its length); every stage host runs its stages on its
    TransferQueue client's loop; the run's invariants hold."""
    out = tmp_path / "run"
    steps = 40  # (long enough for the probe: a few seconds)
    cfg = small_config(out, "deploy.mode=ray", f"train.steps={steps}", RAY_START)
    assert cfg.deploy.batch_sched
    seen: dict[str, dict[str, int]] = {}
    prober = threading.Thread(target=_probe_classes, args=(out, 2, seen), daemon=True)
    prober.start()
    result = run(cfg)
    prober.join(timeout=120)
    assert "error" not in seen, seen
    # every stage host runs its stages on its TransferQueue client's loop (no hop per call)
    stages = {n: seen.pop(n) for n in sorted(seen) if n.startswith("stages of ")}
    assert len(stages) == 3, stages  # rollout, reward, train
    for name, workers in stages.items():
        assert workers["on the client's loop"] >= 1 and workers["elsewhere"] == 0, (name, workers)
    names = sorted(seen)
    for role in ("-coordinator", "-train-rank0", "-tq-controller", "-tq-unit0"):
        assert any(n.endswith(role) for n in names), (role, names)
    for stage in ("rollout", "reward"):
        assert any(stage in n for n in names), (stage, names)
    for name, classes in seen.items():
        other = {t: c for t, c in classes.items() if c != os.SCHED_BATCH}
        assert len(classes) >= 5 and len(other) <= 1, (name, other)  # (a compute call)
    b = cfg.train.groups_per_step
    assert [g for rep in result.reports for g in rep.groups] == list(range(steps * b))
