"""Config: defaults < file < overrides, typed errors that say what to change."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncflow import build_components, load_config
from tests.asyncflow.conftest import small_config


def test_precedence(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  steps: 7\n  lr: 0.001\nrollout:\n  group_size: 4\n")
    cfg = load_config(f, ["train.steps=9", "task.options={max_operand: 5}"])
    assert cfg.train.steps == 9 and cfg.train.lr == 0.001  # override beats file
    assert cfg.rollout.group_size == 4 and cfg.task.options == {"max_operand": 5}
    assert cfg.train.max_staleness == 1  # default kept


def test_unknown_key_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['stepz'\] in train; valid keys"):
        load_config(overrides=["train.stepz=3"])


def test_type_and_range_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"train\.steps: expected int"):
        load_config(overrides=["train.steps=lots"])
    with pytest.raises(ValueError, match=r"train\.max_staleness must be >= 0"):
        load_config(overrides=["train.max_staleness=-1"])
    with pytest.raises(ValueError, match=r"rollout\.migrate_after needs rollout\.long_instances"):
        load_config(overrides=["rollout.migrate_after=512"])
    with pytest.raises(ValueError, match=r"rollout\.weight_sync must be eager or on_demand"):
        load_config(overrides=["rollout.weight_sync=lazy"])
    with pytest.raises(ValueError, match=r"kl_coef > 0 needs reference\.enabled"):
        load_config(overrides=["reference.kl_coef=0.1"])
    with pytest.raises(ValueError, match=r"reward\.instances=2 needs reward\.colocate=false"):
        load_config(overrides=["reward.colocate=true", "reward.instances=2"])


def test_cli_prints_resolved_config() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "asyncflow.cli", "config", "train.steps=3"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "steps: 3" in out and "max_staleness: 1" in out
    bad = subprocess.run(
        [sys.executable, "-m", "asyncflow.cli", "config", "train.nope=1"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "valid keys" in bad.stderr


def test_partial_override_of_a_section_keeps_its_own_defaults() -> None:
    """``transferqueue.placement`` defaults to no CPU slot (servers are I/O bound);
    naming one of its fields must not bring back the class default of one CPU per server."""
    cfg = load_config(overrides=["transferqueue.placement.resources={node_a: 0.01}"])
    assert cfg.transferqueue.placement.num_cpus == 0
    assert cfg.transferqueue.placement.resources == {"node_a": 0.01}
    assert load_config(overrides=["reward.placement.num_gpus=1"]).reward.placement.num_cpus == 0.5


def test_a_section_with_a_mode_takes_a_bare_word() -> None:
    cfg = load_config(overrides=["deploy=ray", "transferqueue=service"])
    assert cfg.deploy.mode == "ray" and cfg.transferqueue.mode == "service"
    with pytest.raises(ValueError, match=r"deploy\.mode must be local or ray"):
        load_config(overrides=["deploy=slurm"])
    assert cfg.deploy.worker_niceness == 0  # (Ray's own default, 15, starves the actors)
    with pytest.raises(ValueError, match=r"deploy\.worker_niceness must be in 0\.\.19"):
        load_config(overrides=["deploy.mode=ray", "deploy.worker_niceness=20"])


def test_unknown_engine_option_is_a_clear_error(out_dir: Path) -> None:
    """Caught while building the engines, before vLLM is imported: runs without vLLM."""
    cfg = small_config(out_dir, "rollout.engine=vllm", "rollout.engine_options={max_seqs: 8}")
    with pytest.raises(ValueError, match=r"\['max_seqs'\] are not fields of VLLMEngineConfig"):
        build_components(cfg)


def test_engine_options_cannot_replace_the_model() -> None:
    with pytest.raises(ValueError, match=r"must not set \['model'\]"):
        load_config(overrides=["rollout.engine=vllm", "rollout.engine_options={model: other}"])


def test_the_controller_state_dir_is_for_a_controller_this_run_starts(tmp_path: Path) -> None:
    state = str(tmp_path / "state")
    cfg = load_config(overrides=["deploy=ray", f"transferqueue.state_dir={state}"])
    assert (cfg.transferqueue.state_dir, cfg.transferqueue.fsync) == (state, "batch")
    with pytest.raises(ValueError, match=r"transferqueue\.state_dir is for modes service and ray"):
        load_config(overrides=["transferqueue.mode=embedded", f"transferqueue.state_dir={state}"])
    with pytest.raises(ValueError, match="auto means embedded"):
        load_config(overrides=[f"transferqueue.state_dir={state}"])  # deploy=local
    with pytest.raises(ValueError, match=r"transferqueue\.fsync must be one of"):
        load_config(overrides=["transferqueue.mode=service", "transferqueue.fsync=often"])


def test_the_servers_connection_limit_is_configured_and_checked() -> None:
    cfg = load_config(overrides=["transferqueue.mode=service", "transferqueue.max_connections=64"])
    assert cfg.transferqueue.service_options()["max_connections"] == 64
    assert load_config().transferqueue.max_connections is None  # (the servers' default)
    with pytest.raises(ValueError, match=r"transferqueue\.max_connections must be >= 1"):
        load_config(overrides=["transferqueue.max_connections=0"])


def test_row_copies_are_configured_and_checked() -> None:
    over = ["transferqueue.mode=service", "transferqueue.num_units=2", "transferqueue.replicas=2"]
    assert load_config(overrides=over).transferqueue.service_options()["replicas"] == 2
    assert load_config().transferqueue.replicas == 1
    for bad in (
        ["transferqueue.replicas=2"],
        ["transferqueue.num_units=3", "transferqueue.replicas=3"],
    ):
        with pytest.raises(ValueError, match=r"transferqueue\.replicas must be 1 or 2 and at most"):
            load_config(overrides=bad)


@pytest.mark.slow
@pytest.mark.service
def test_a_service_run_gives_its_controller_the_state_dir(tmp_path: Path) -> None:
    from asyncflow.deploy.local import open_transferqueue

    state = tmp_path / "state"
    cfg = load_config(overrides=["transferqueue.mode=service", f"transferqueue.state_dir={state}"])
    tq, service = open_transferqueue(cfg)
    try:
        assert service is not None and service._controller_restartable
        tq.client().put({"x": [1, 2, 3]})
        assert (state / "snapshot").exists()  # (the controller journals there)
    finally:
        tq.close()
        if service is not None:
            service.close()


@pytest.mark.slow
@pytest.mark.ray
def test_a_ray_run_gives_its_controller_actor_the_state_dir(
    ray_cluster: None, tmp_path: Path
) -> None:
    import ray

    from asyncflow.deploy.ray import RayDeployment
    from asyncflow.metrics import Timeline

    state = tmp_path / "state"
    cfg = load_config(overrides=["deploy=ray", f"transferqueue.state_dir={state}"])
    prefix = f"statecfg-{os.getpid()}"
    from transferqueue.deploy.ray import RayStart

    started = RayDeployment(cfg, Timeline())._open_tq(prefix)
    assert isinstance(started, RayStart)  # (the stage hosts start beside its servers)
    tq = started.handle()
    try:
        ctl = ray.get_actor(f"{prefix}-tq-controller")
        assert ray.get(ctl.address.remote(), timeout=60) == tq.address
        assert (state / "address").read_text() == tq.address  # (kept for a restart by Ray)
        assert (state / "snapshot").exists()
    finally:
        tq.close()
