"""Starting TransferQueue's servers on Ray without waiting for them
(``transferqueue.deploy.ray.launch_on_ray``): the controller starts beside its units and asks
them where they listen; other processes find it by name while it starts; a start that
cannot complete fails within its bound and leaves no actor behind (a real local Ray
cluster, loopback)."""

from __future__ import annotations

import time
import uuid

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.usefixtures("ray_cluster")]


def test_servers_launched_on_ray_serve_and_are_found_by_name() -> None:
    import ray

    from transferqueue.deploy.ray import controller_address, launch_on_ray

    prefix = f"tq-launch-{uuid.uuid4().hex[:6]}"
    started = launch_on_ray(num_units=2, spread_bytes=0, name_prefix=prefix)
    assert started.controller_name == f"{prefix}-controller"
    assert len(started.actors) == 3  # two units and the controller, created at once
    # a process that knows only the name waits for the controller and gets its address
    address = controller_address(started.controller_name, 120.0)
    with started.handle() as tq:
        assert tq.address == address
        client = tq.client()
        x = torch.arange(24, dtype=torch.float32).view(6, 4)
        client.put({"x": x}, partition="p")
        meta = client.get_meta("t", ["x"], 6, partition="p", timeout_s=30)
        got = client.get_data(meta)["x"]
        assert isinstance(got, torch.Tensor)
        assert torch.equal(got, x[meta.indexes])  # both units' rows, bit for bit
        units = ray.get(
            [ray.get_actor(started.controller_name).unit_address.remote(i) for i in (0, 1)],
            timeout=60,
        )
        assert units == ray.get([a.address.remote() for a in started.actors[:2]], timeout=60)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the handle's close ended the actors
        try:
            ray.get_actor(started.controller_name)
        except ValueError:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the controller actor outlived the handle's close")


def test_a_launch_that_cannot_start_fails_in_its_bound_and_kills_its_actors() -> None:
    """Actors asking for a resource no node has are never scheduled: the handle says so
    within ``start_timeout_s`` and ends them; ``controller_address`` is bounded too."""
    import ray
    from ray.exceptions import GetTimeoutError

    from transferqueue.deploy.ray import controller_address, launch_on_ray

    prefix = f"tq-nowhere-{uuid.uuid4().hex[:6]}"
    started = launch_on_ray(
        num_units=1,
        name_prefix=prefix,
        actor_options={"resources": {"no_such_node": 1}},
        start_timeout_s=2.0,
    )
    t0 = time.monotonic()
    with pytest.raises(GetTimeoutError, match="did not answer within 1 s"):
        controller_address(started.controller_name, 1.0)
    with pytest.raises(TimeoutError, match=r"servers did not start within 2\.0 s"):
        started.handle()
    assert time.monotonic() - t0 < 30
    for name in (started.controller_name, f"{prefix}-unit0"):
        with pytest.raises(ValueError):
            ray.get_actor(name)
