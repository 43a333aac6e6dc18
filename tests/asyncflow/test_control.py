"""The control channel of a running job (``asyncflow scale``): real ZeroMQ sockets on
loopback, a stand-in deployment's scale, and the one-line errors of bad requests (no Ray)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from asyncflow.cli import main as cli_main
from asyncflow.control import CONTROL_FILE, ControlError, ControlServer, ask, parse_scale, serve


class _Stages:
    """A deployment's scaling as the control server sees it: counts, and the calls made."""

    def __init__(self) -> None:
        self.counts = {"rollout": 1, "train": 1}
        self.calls: list[tuple[str, int]] = []

    async def scale(self, stage: str, n: int) -> int:
        self.calls.append((stage, n))
        was, self.counts[stage] = self.counts[stage], n
        return was

    def instances(self) -> dict[str, int]:
        return dict(self.counts)


def _serving(tmp_path: Path, stages: _Stages, *requests: dict[str, object]) -> list[dict]:
    """Start a control server on ``tmp_path``, send ``requests`` one by one with :func:`ask`
    (as the command does, from another thread), stop it; the replies."""

    async def go() -> list[dict]:
        server = ControlServer(tmp_path, stages.scale, stages.instances, ("rollout",))
        assert json.loads((tmp_path / CONTROL_FILE).read_text())["address"] == server.address
        task = asyncio.ensure_future(serve(server))
        try:
            return [await asyncio.to_thread(ask, tmp_path, dict(r), 10.0) for r in requests]
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    return asyncio.run(go())


def test_scale_requests_reach_the_deployment_and_the_file_goes_with_the_server(
    tmp_path: Path,
) -> None:
    stages = _Stages()
    replies = _serving(
        tmp_path,
        stages,
        {"op": "scale", "stage": "rollout", "n": 3},
        {"op": "instances"},
        {"op": "scale", "stage": "rollout", "n": 1},
    )
    assert replies == [
        {"ok": True, "stage": "rollout", "n": 3, "was": 1},
        {"ok": True, "instances": {"rollout": 3, "train": 1}},
        {"ok": True, "stage": "rollout", "n": 1, "was": 3},
    ]
    assert stages.calls == [("rollout", 3), ("rollout", 1)]
    assert not (tmp_path / CONTROL_FILE).exists()


def test_the_server_refuses_what_cannot_be_scaled_and_keeps_serving(tmp_path: Path) -> None:
    """Requests the command would have refused, sent raw: each gets a one-line error naming
    what can be scaled, the deployment is never called, the next good request is served."""
    stages = _Stages()
    replies = _serving(
        tmp_path,
        stages,
        {"op": "scale", "stage": "train", "n": 2},
        {"op": "scale", "stage": "rollout", "n": 0},
        {"op": "scale", "stage": "critic", "n": 2},
        {"op": "drop"},
        {"op": "scale", "stage": "rollout", "n": 2},
    )
    errors = [r["error"] for r in replies[:4]]
    assert all(r["ok"] is False for r in replies[:4])
    assert "train stage cannot be scaled" in errors[0] and "rollout=N" in errors[0]
    assert "at least 1 instance" in errors[1]
    assert "unknown stage 'critic'" in errors[2] and "rollout=N" in errors[2]
    assert "unknown op" in errors[3]
    assert replies[4] == {"ok": True, "stage": "rollout", "n": 2, "was": 1}
    assert stages.calls == [("rollout", 2)]


def test_a_failing_scale_is_an_error_reply_not_a_dead_server(tmp_path: Path) -> None:
    stages = _Stages()

    async def refuse(stage: str, n: int) -> int:
        if n > 4:
            raise ControlError("the cluster has room for 4 generators")
        raise RuntimeError("actor died")

    stages.scale = refuse  # type: ignore[method-assign]
    replies = _serving(
        tmp_path,
        stages,
        {"op": "scale", "stage": "rollout", "n": 8},
        {"op": "scale", "stage": "rollout", "n": 2},
        {"op": "instances"},
    )
    assert replies[0] == {"ok": False, "error": "the cluster has room for 4 generators"}
    assert replies[1]["ok"] is False and "actor died" in replies[1]["error"]
    assert replies[2]["ok"] is True


def test_a_request_in_hand_when_the_run_ends_is_answered(tmp_path: Path) -> None:
    """The run ends (the control job cancelled) while a scale is under way: the command gets
    an error reply at once, not silence until its timeout."""
    started = asyncio.Event()

    async def slow(stage: str, n: int) -> int:
        started.set()
        await asyncio.Event().wait()  # (a generator that never starts)
        return 1

    async def go() -> dict:
        server = ControlServer(tmp_path, slow, dict, ("rollout",))
        task = asyncio.ensure_future(serve(server))
        request = {"op": "scale", "stage": "rollout", "n": 2}
        asking = asyncio.ensure_future(asyncio.to_thread(ask, tmp_path, request, 30.0))
        await started.wait()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return await asking

    reply = asyncio.run(go())
    assert reply == {"ok": False, "error": "the run ended before the request was done"}
    assert not (tmp_path / CONTROL_FILE).exists()


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["train=2"], "train stage cannot be scaled"),
        (["rollout=0"], "at least 1 instance"),
        (["critic=2"], "unknown stage 'critic'"),
        (["rollout"], "is not STAGE=N"),
        (["rollout=two"], "must be an integer"),
        ([], "nothing to scale"),
    ],
)
def test_bad_requests_are_refused_before_anything_is_sent(args: list[str], words: str) -> None:
    with pytest.raises(ControlError, match=words) as info:
        parse_scale(args)
    assert "rollout=N" in str(info.value)


def test_the_command_says_in_one_line_when_no_run_listens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No control file, a control file nobody answers at, a stage that cannot scale: exit
    status 2 and one line naming what can be scaled or why no run answers."""
    assert cli_main(["scale", str(tmp_path), "rollout=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no running job writes" in err
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REP)  # bound, never answering: a run that hangs or just ended
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        address = f"tcp://127.0.0.1:{port}"
        (tmp_path / CONTROL_FILE).write_text(json.dumps({"address": address, "pid": 1}))
        assert cli_main(["scale", str(tmp_path), "rollout=2", "--timeout", "0.3"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "did not answer" in err, err
        assert msgpack.unpackb(sock.recv()) == {"op": "scale", "stage": "rollout", "n": 2}
    finally:
        sock.close(0)
        ctx.term()
    assert cli_main(["scale", str(tmp_path), "train=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("asyncflow: cannot scale: the train stage") and "rollout=N" in err


def test_reward_is_scaled_beside_the_rollout_and_refused_below_one() -> None:
    assert parse_scale(["rollout=2", "reward=3"]) == {"rollout": 2, "reward": 3}
    with pytest.raises(ControlError, match="reward=0: a stage keeps at least 1") as info:
        parse_scale(["reward=0"])
    assert "rollout=N, reward=N" in str(info.value)


def test_a_run_that_scores_in_the_rollout_refuses_reward_in_one_line(tmp_path: Path) -> None:
    """A ``reward.colocate=true`` run's deployment scales only the rollout: ``reward=M`` is
    refused by the driver with why and what to change, the deployment never called."""
    stages = _Stages()
    replies = _serving(
        tmp_path,
        stages,
        {"op": "scale", "stage": "reward", "n": 2},
        {"op": "scale", "stage": "rollout", "n": 2},
    )
    error = replies[0]["error"]
    assert replies[0]["ok"] is False and "\n" not in error
    assert "reward.colocate=true" in error and "reward.colocate=false" in error
    assert "rollout=N" in error
    assert replies[1]["ok"] is True and stages.calls == [("rollout", 2)]


@pytest.mark.parametrize("colocate", [True, False])
def test_a_ray_deployment_scales_reward_only_with_reward_workers(colocate: bool) -> None:
    """What a ``deploy.mode=ray`` run tells its control server it can scale (no Ray started);
    its worker scaler refuses reward with colocated scoring, and any change before the run's
    stages run."""
    from asyncflow.config import load_config
    from asyncflow.deploy.ray import RayDeployment
    from asyncflow.deploy.ray_hosts import TQAccess
    from asyncflow.deploy.ray_workers import WorkerScaler
    from asyncflow.metrics import Timeline

    cfg = load_config(overrides=["deploy.mode=ray", f"reward.colocate={str(colocate).lower()}"])
    assert RayDeployment(cfg, Timeline()).scalable == (
        ("rollout",) if colocate else ("rollout", "reward")
    )
    made: list[tuple[str, int]] = []

    def make(role: str, i: int, opts: dict[str, Any] | None) -> Any:
        made.append((role, i))
        return object()

    def job(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("no job before the run's stages run")

    workers: list[tuple[str, Any]] = []
    scaler = WorkerScaler(cfg, workers, [], make, job, set(), TQAccess("x"), "run", Timeline())
    scaler.start(lambda p, n: [{} for _ in range(n)])
    assert [n for n, _ in workers] == ([] if colocate else ["reward"]) and len(made) == len(workers)
    words = "reward.colocate=true" if colocate else "not running its stages yet"
    with pytest.raises(ControlError, match=words):
        asyncio.run(scaler.scale("reward", 2))
    assert len(made) == len(workers)  # nothing placed


def test_beyond_loopback_the_channel_needs_keys_and_speaks_curve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``deploy.control_host=0.0.0.0``: refused without keys; with the run's keys the command
    gets in with the client key of ``--keys DIR`` and is refused (one line) without it; a key
    the run does not trust gets no answer."""
    from transferqueue.errors import AuthError
    from transferqueue.wire.auth import ENV_KEYS, keygen

    monkeypatch.delenv(ENV_KEYS, raising=False)
    stages = _Stages()
    out = tmp_path / "run"
    out.mkdir()
    with pytest.raises(AuthError, match=r"refusing to listen on 0\.0\.0\.0 without keys"):
        ControlServer(out, stages.scale, stages.instances, ("rollout",), "0.0.0.0")
    assert not (out / CONTROL_FILE).exists()
    keys, other = tmp_path / "keys", tmp_path / "other"
    keygen(keys)
    keygen(other)

    async def go() -> list[Any]:
        server = ControlServer(out, stages.scale, stages.instances, ("rollout",), "0.0.0.0", keys)
        info = json.loads((out / CONTROL_FILE).read_text())
        assert info["curve"] is True and not info["address"].startswith("tcp://0.0.0.0")
        task = asyncio.ensure_future(serve(server))
        scale = {"op": "scale", "stage": "rollout", "n": 2}
        outcomes: list[Any] = []
        try:
            for k in (keys, None, other):
                try:
                    outcomes.append(await asyncio.to_thread(ask, out, dict(scale), 3.0, k))
                except ControlError as e:
                    outcomes.append(str(e))
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return outcomes

    with_keys, without, untrusted = asyncio.run(go())
    assert with_keys == {"ok": True, "stage": "rollout", "n": 2, "was": 1}
    assert "listens beyond loopback with CURVE keys" in without and "--keys DIR" in without
    assert "did not answer" in untrusted  # (CURVE: an unknown key gets no answer at all)
    assert stages.calls == [("rollout", 2)]
