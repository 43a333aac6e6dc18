"""Fixtures shared by the TransferQueue behaviour tests.

``tq`` is parametrized over deployments, so every behaviour test runs unchanged against each
way of running TransferQueue: in-process (``embedded``; ``replicas``: the same keeping two
copies of each row, which must behave alike), controller and units as local processes over
ZeroMQ (``service``), and as Ray actors (``ray``, needs the ray extra). Service
and Ray servers are started once per session and reset between tests.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tq_helpers import Deploy

import transferqueue
from transferqueue import Client, TransferQueue

DEPLOYMENTS = [
    "embedded",
    pytest.param("replicas", marks=pytest.mark.replicas),
    pytest.param("service", marks=pytest.mark.service),
    pytest.param("ray", marks=pytest.mark.ray),
]


@pytest.fixture(scope="session")
def local_service() -> Iterator[transferqueue.LocalService]:
    with transferqueue.serve(num_units=2, spread_bytes=0) as svc:
        yield svc


@pytest.fixture(scope="session")
def ray_tq(ray_cluster: None) -> Iterator[str]:
    from transferqueue.deploy.ray import start_on_ray

    handle = start_on_ray(num_units=2, spread_bytes=0)
    yield str(handle.address)
    handle.close()


@pytest.fixture(params=DEPLOYMENTS)
def deploy(request: pytest.FixtureRequest) -> Iterator[Deploy]:
    """A factory of TransferQueue handles of the test's deployment.

    ``deploy()`` gives the shared (reset) instance; options such as ``capacity_rows`` start
    a dedicated one. Puts spread over both units (``spread_bytes=0``) unless a test says.
    """
    kind = request.param
    handles: list[TransferQueue] = []
    services: list[transferqueue.LocalService] = []

    def make(**options: object) -> TransferQueue:
        # every put over both units, so that the multi-unit paths are what the tests exercise
        options.setdefault("spread_bytes", 0)
        if kind in ("embedded", "replicas"):
            copies = 2 if kind == "replicas" else 1
            h = transferqueue.start(num_units=2, replicas=copies, **options)  # type: ignore[arg-type]
        elif set(options) - {"spread_bytes"}:
            if kind == "ray":
                request.getfixturevalue("ray_cluster")  # (skips without ray; starts it once)
                from transferqueue.deploy.ray import start_on_ray

                h = start_on_ray(num_units=2, **options)  # type: ignore[arg-type]
            else:
                svc = transferqueue.serve(num_units=2, **options)
                services.append(svc)
                h = transferqueue.connect(svc.address)
        else:
            shared = request.getfixturevalue("local_service" if kind == "service" else "ray_tq")
            address = shared.address if kind == "service" else shared
            h = transferqueue.connect(address)
            h.reset()
        handles.append(h)
        return h

    yield make
    for h in handles:
        h.close()
    for s in services:
        s.close()


@pytest.fixture
def tq(deploy: Deploy) -> TransferQueue:
    return deploy()


@pytest.fixture
def client(tq: TransferQueue) -> Client:
    return tq.client()
